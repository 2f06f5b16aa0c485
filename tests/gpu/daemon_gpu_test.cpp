// kvferryd with the CUDA backend: a region in GPU memory (cuMemCreate + POSIX fd, and the
// legacy IPC fallback), mapped by a client in another process, written through one layer view
// and read back through the daemon's own mapping byte for byte. Skips without a GPU.
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>

#include "../integration/daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/cuda_vmm.h"
#include "kvferry/kernels/device.h"

namespace kvferry {
namespace {

const char* kRegions = R"(regions:
  - name: gpu
    layers: 7
    blocks: 12
    block_size: 64
    format: mla_fp8_ds
    layout: block_major
)";

uint8_t pattern(int64_t i, int64_t layer) { return static_cast<uint8_t>((i * 131 + layer * 17 + 1) % 251) + 1; }

class DaemonGpu : public ::testing::TestWithParam<const char*> {};

TEST_P(DaemonGpu, LayerViewWriteReadsBackThroughTheDaemon) {
  // Ask in a child: this process forks the writer, and CUDA must not be initialized before fork.
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  const bool force_ipc = std::string(GetParam()) == "cuda_ipc";
  std::vector<std::string> env;
  if (force_ipc) env.push_back("KVFERRY_CUDA_IPC=1");
  testing::DaemonProcess d(kRegions, env, "cuda");
  ASSERT_TRUE(d.ready()) << d.log();
  const int64_t layer = 3;
  int rc = testing::run_in_child([&] {
    Client::Options o;
    o.socket = d.socket();
    o.name = "gpu-writer";
    auto c = Client::connect(o);
    if (!c.ok()) return 10;
    auto id = (*c)->find_region("gpu");
    if (!id.ok()) return 11;
    auto base = (*c)->map_region(*id);
    if (!base.ok()) {
      std::fprintf(stderr, "map_region: %s\n", base.status().to_string().c_str());
      return 12;
    }
    auto v = (*c)->layer_view(*id, layer);
    if (!v.ok() || !v->on_device) return 13;
    // Write every block's page of this layer through the view: base + b * stride(0).
    const TensorView& tv = v->view;
    const int64_t page = tv.size(1) * tv.stride(1) * tv.elem_bytes();
    std::vector<uint8_t> host(static_cast<size_t>(page));
    for (int64_t b = 0; b < tv.size(0); ++b) {
      for (int64_t i = 0; i < page; ++i) host[static_cast<size_t>(i)] = pattern(b * page + i, layer);
      auto* dst = static_cast<uint8_t*>(v->data) + b * tv.stride(0) * tv.elem_bytes();
      if (!cuda_vmm::copy_to_device(dst, host.data(), host.size(), 0).ok()) return 14;
    }
    return 0;
  });
  ASSERT_EQ(rc, 0) << "writer child failed (10 connect, 11 find, 12 map, 13 view, 14 copy)\n" << d.log();
  Client::Options o;
  o.socket = d.socket();
  auto c = Client::connect(o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto regions = (*c)->regions();
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].backend, force_ipc ? proto::Backend::kCudaIpc : proto::Backend::kCudaVmm);
  const KvCacheSpec& s = regions[0].spec;
  const int64_t page = s.page_bytes();
  size_t bad = 0;
  for (int64_t b = 0; b < s.blocks; ++b) {
    for (int64_t l = 0; l < s.layers; ++l) {
      auto r = (*c)->debug_read(regions[0].id, static_cast<uint64_t>(s.page_offset(l, b)), static_cast<uint32_t>(page));
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      for (int64_t i = 0; i < page; ++i) {
        const uint8_t want = l == layer ? pattern(b * page + i, layer) : 0;
        bad += (*r)[static_cast<size_t>(i)] != want;
      }
    }
  }
  EXPECT_EQ(bad, 0u) << "bytes that differ";
  std::printf(
      "[gpu] region '%s' on %s, %lld bytes, layer %lld written by another process and read back through "
      "the daemon: %zu bytes differ\n",
      regions[0].name.c_str(), std::string(proto::backend_name(regions[0].backend)).c_str(),
      static_cast<long long>(regions[0].bytes), static_cast<long long>(layer), bad);
  c->reset();
  int st = d.stop();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << d.log();
}

// An engine registers GPU memory it allocated itself (cuMem POSIX fd, or a legacy IPC handle);
// the daemon imports it and reads what the engine wrote.
TEST_P(DaemonGpu, EngineRegisteredGpuBufferIsReadByTheDaemon) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  const bool ipc = std::string(GetParam()).rfind("cuda_ipc", 0) == 0;
  // cuda_ipc_offset: the region sits inside a larger allocation (a framework's view of its buffer).
  const uint64_t offset = std::string(GetParam()) == "cuda_ipc_offset" ? 3 * 4096 + 256 : 0;
  testing::DaemonProcess d("", {}, "cuda");
  ASSERT_TRUE(d.ready()) << d.log();
  const KvCacheSpec spec{4, 6, 64, EntryFormat::mla_fp8(), Layout::kLayerMajor};
  const uint64_t bytes = static_cast<uint64_t>(spec.region_bytes());
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  pid_t child = ::fork();
  if (child == 0) {
    auto done = [&](char code) {
      if (::write(to_parent[1], &code, 1) != 1) ::_exit(2);
      char x;
      if (::read(to_child[0], &x, 1) != 1) ::_exit(3);
      ::_exit(0);
    };
    Client::Options o;
    o.socket = d.socket();
    o.name = "gpu-registrant";
    auto c = Client::connect(o);
    if (!c.ok()) done('c');
    Client::OwnBuffer buf;
    buf.device = 0;
    uint8_t handle[64];
    cuda_vmm::Mapping vm;
    if (ipc) {
      auto p = cuda_vmm::malloc_ipc(0, bytes + offset, handle);
      if (!p.ok()) done('a');
      buf.backend = proto::Backend::kCudaIpc;
      buf.ipc_handle = handle;
      buf.base = *p;
      buf.alloc_bytes = bytes + offset;
      buf.offset = offset;
    } else {
      auto m = cuda_vmm::create_exportable(0, bytes);
      if (!m.ok()) done('a');
      vm = *m;
      buf.backend = proto::Backend::kCudaVmm;
      buf.fd = vm.fd;
      buf.base = vm.ptr;
      buf.alloc_bytes = vm.size;
    }
    std::vector<uint8_t> host(bytes);
    for (uint64_t i = 0; i < bytes; ++i) host[i] = pattern(static_cast<int64_t>(i), 9);
    if (!cuda_vmm::copy_to_device(static_cast<uint8_t*>(buf.base) + buf.offset, host.data(), bytes, 0).ok()) done('w');
    auto id = (*c)->register_region("engine-gpu", spec, buf);
    if (!id.ok()) {
      std::fprintf(stderr, "register_region: %s\n", id.status().to_string().c_str());
      done('r');
    }
    done('k');
  }
  char code = 0;
  pollfd pf{to_parent[0], POLLIN, 0};
  ASSERT_EQ(::poll(&pf, 1, 20000), 1) << "the registrant did not report within 20 s";
  ASSERT_EQ(::read(to_parent[0], &code, 1), 1);
  EXPECT_EQ(code, 'k') << "c connect, a alloc, w write, r register\n" << d.log();
  if (code == 'k') {
    Client::Options o;
    o.socket = d.socket();
    auto c = Client::connect(o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto st = (*c)->status();
    ASSERT_TRUE(st.ok());
    uint32_t rid = 0;
    for (auto& r : st->regions)
      if (r.desc.name == "engine-gpu") rid = r.desc.id;
    ASSERT_NE(rid, 0u);
    size_t bad = 0;
    for (uint64_t off = 0; off < bytes; off += proto::kMaxDebugRead) {
      const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(proto::kMaxDebugRead, bytes - off));
      auto r = (*c)->debug_read(rid, off, n);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      for (uint32_t i = 0; i < n; ++i) bad += (*r)[i] != pattern(static_cast<int64_t>(off + i), 9);
    }
    EXPECT_EQ(bad, 0u);
    std::printf("[gpu] engine-registered %s buffer of %llu bytes read back through the daemon: %zu bytes differ\n",
                GetParam(), static_cast<unsigned long long>(bytes), bad);
  }
  char go = 'x';
  EXPECT_EQ(::write(to_child[1], &go, 1), 1);
  EXPECT_NE(testing::wait_pid(child, std::chrono::seconds(10)), -1);
  int st = d.stop();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << d.log();
}

INSTANTIATE_TEST_SUITE_P(Backends, DaemonGpu, ::testing::Values("cuda_vmm", "cuda_ipc", "cuda_ipc_offset"));

}  // namespace
}  // namespace kvferry
