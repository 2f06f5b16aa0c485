// kvferryd with the CUDA backend: a region in GPU memory (cuMemCreate + POSIX fd, and the
// legacy IPC fallback), mapped by a client in another process, written through one layer view
// and read back through the daemon's own mapping byte for byte. Skips without a GPU.
#include <gtest/gtest.h>

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

INSTANTIATE_TEST_SUITE_P(Backends, DaemonGpu, ::testing::Values("cuda_vmm", "cuda_ipc"));

}  // namespace
}  // namespace kvferry
