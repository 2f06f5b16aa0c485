// Region-to-region sends between two kvferryd of one host with GPU regions (tiers.remote.local_transfer):
// A imports B's region (a cuMem POSIX fd, or a legacy IPC handle) and moves the blocks with
// device-to-device DMA. One GPU here: both daemons on GPU 0, the import-and-copy path that daemons
// on two GPUs of one host take over NVLink. Byte for byte, block-major and layer-major; a region of
// another format goes through the host pools and is converted there; a receiver killed (-9) while
// sends go on fails them within the remote tier's bound. Skips without a GPU.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <future>
#include <thread>

#include "../integration/daemon_harness.h"
#include "../integration/etcd_harness.h"
#include "../integration/test_blocks.h"
#include "kvferry/connector/client.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/device.h"

namespace kvferry {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using testing::create;
/// A region of GPU memory: `base` is a device pointer in this process.
using GpuRegion = testing::Region;

std::vector<uint8_t> read(const GpuRegion& r) {
  std::vector<uint8_t> h(static_cast<size_t>(r.spec.region_bytes()));
  EXPECT_EQ(cudaMemcpy(h.data(), r.base, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

/// Fills a region with seeded MLA entries (write_mla's CPU twin on the host, valid fp8 scales, so
/// a conversion has meaning), copied up; returns the bytes.
std::vector<uint8_t> fill(const GpuRegion& r, uint32_t seed) {
  std::vector<uint8_t> h(static_cast<size_t>(r.spec.region_bytes()));
  testing::Region hr;
  hr.spec = r.spec;
  hr.base = h.data();
  testing::fill_mla(hr, seed);
  EXPECT_EQ(cudaMemcpy(r.base, h.data(), h.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return h;
}

using testing::iota_ids;

constexpr testing::TestKeys kKeys{0x6C0C000000000000ull};

struct Pair {
  int port_a = 0, port_b = 0;
  std::unique_ptr<testing::DaemonProcess> a, b;
  std::unique_ptr<Client> ca, cb;  // a client of each
  std::string peer_b() const { return "127.0.0.1:" + std::to_string(port_b); }
};

std::unique_ptr<Client> connect(const testing::DaemonProcess& d);

/// Two daemons with the CUDA backend, A on GPU 0 and B on GPU `gpu_b`, static peers on loopback.
Pair start_pair(bool force_ipc, int gpu_b = 0) {
  Pair p;
  p.port_a = testing::etcd::free_port();
  p.port_b = testing::etcd::free_port();
  const std::string peers =
      "[\"127.0.0.1:" + std::to_string(p.port_a) + "\", \"127.0.0.1:" + std::to_string(p.port_b) + "\"]";
  auto yaml = [&](int port) {
    return "tiers:\n  host:\n    capacity: 256MiB\n  remote:\n    listen: 127.0.0.1:" + std::to_string(port) +
           "\n    peers: " + peers + "\n    transport: tcp\n    timeout: 3s\n";
  };
  std::vector<std::string> env;
  if (force_ipc) env.push_back("KVFERRY_CUDA_IPC=1");
  p.a = std::make_unique<testing::DaemonProcess>(yaml(p.port_a), env, "cuda");
  // The harness writes "device:\n  backend: <this>": B's GPU index goes in the same section.
  p.b = std::make_unique<testing::DaemonProcess>(yaml(p.port_b), env, "cuda\n  gpu: " + std::to_string(gpu_b));
  EXPECT_TRUE(p.a->ready()) << p.a->log();
  EXPECT_TRUE(p.b->ready()) << p.b->log();
  if (p.a->ready() && p.b->ready()) {
    p.ca = connect(*p.a);
    p.cb = connect(*p.b);
  }
  return p;
}

std::unique_ptr<Client> connect(const testing::DaemonProcess& d) {
  Client::Options o;
  o.socket = d.socket();
  o.name = "local-gpu-test";
  o.model = "m";
  auto c = Client::connect(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(*c) : nullptr;
}

class RemoteLocalGpu : public ::testing::TestWithParam<const char*> {};

/// Sends from A's regions into B's, byte for byte (block-major and layer-major, B's blocks
/// permuted), seen by B's lookup_wait and stored on neither side, and a send that needs a
/// conversion (through the host pools, converted on B's host).
void sends_region_to_region(Pair& p) {
  auto &a = p.ca, &b = p.cb;
  constexpr int64_t n = 40;
  for (Layout layout : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    SCOPED_TRACE(layout == Layout::kBlockMajor ? "block-major" : "layer-major");
    const std::string tag = layout == Layout::kBlockMajor ? "bm" : "lm";
    const KvCacheSpec spec{5, n, 64, EntryFormat::mla_fp8(), layout};
    GpuRegion src = create(*a, "prefill-" + tag, spec);
    GpuRegion dst = create(*b, "decode-" + tag, spec);
    ASSERT_TRUE(src.base && dst.base);
    const auto want = fill(src, layout == Layout::kBlockMajor ? 5 : 6);
    const std::vector<uint8_t> zeros(size_t(spec.region_bytes()), 0);
    ASSERT_EQ(cudaMemcpy(dst.base, zeros.data(), zeros.size(), cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<int64_t> theirs(n);
    for (int64_t i = 0; i < n; ++i) theirs[size_t(i)] = (i * 7) % n;  // a permutation (7 and 40 are coprime)
    const auto k = kKeys.keys(n, layout == Layout::kBlockMajor ? 1 : 2);
    auto sd = a->send_into(src.id, k, iota_ids(n), p.peer_b(), dst.id, theirs);
    ASSERT_TRUE(sd.ok()) << sd.status().to_string();
    ASSERT_EQ(sd->done, uint64_t(n)) << p.a->log() << p.b->log();
    const auto got = read(dst);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t l = 0; l < spec.layers; ++l)
        ASSERT_EQ(std::memcmp(got.data() + spec.page_offset(l, theirs[size_t(i)]), want.data() + spec.page_offset(l, i),
                              size_t(spec.page_bytes())),
                  0)
            << "block " << i << " layer " << l;
    auto w = b->lookup_wait(dst.id, k, 5000);
    ASSERT_TRUE(w.ok());
    EXPECT_EQ(w->done, uint64_t(n));
    auto lk = b->lookup(dst.id, k);  // region to region: not stored on B
    ASSERT_TRUE(lk.ok());
    EXPECT_EQ(lk->done, 0u);
  }
  EXPECT_NE(p.a->log().find("GPU memory) for region-to-region sends"), std::string::npos) << p.a->log();

  // Another format on B: through the host pools, converted on B's host while staged.
  const KvCacheSpec fs{5, n, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  KvCacheSpec ds_spec = fs;
  ds_spec.format = EntryFormat::mla_fp8_ds();
  GpuRegion src = create(*a, "prefill-conv", fs);
  GpuRegion ds = create(*b, "decode-ds", ds_spec);
  ASSERT_TRUE(src.base && ds.base);
  const auto sb = fill(src, 7);
  std::vector<uint8_t> want(static_cast<size_t>(ds_spec.region_bytes()));
  ASSERT_TRUE(kernels::convert_blocks_cpu(sb.data(), fs, iota_ids(n), want.data(), ds_spec, iota_ids(n)).ok());
  auto cv = a->send_into(src.id, kKeys.keys(n, 3), iota_ids(n), p.peer_b(), ds.id, iota_ids(n));
  ASSERT_TRUE(cv.ok());
  ASSERT_EQ(cv->done, uint64_t(n)) << p.a->log() << p.b->log();
  EXPECT_EQ(read(ds), want);
}

TEST_P(RemoteLocalGpu, SendsRegionToRegionOnOneGpu) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  auto p = start_pair(std::string(GetParam()) == "cuda_ipc");
  ASSERT_TRUE(p.ca && p.cb);
  sends_region_to_region(p);
}

// A on GPU 0, B on GPU 1: A's copy engines write into B's GPU over NVLink (peer access granted to
// the imported cuMem mapping; lazy peer access for IPC), the path the one-GPU test stands in for.
TEST_P(RemoteLocalGpu, SendsRegionToRegionBetweenTwoGpus) {
  if (testing::run_in_child([] { return cuda_device_count() > 1 ? 0 : 1; }) != 0)
    GTEST_SKIP() << "needs two CUDA devices (one GPU runs SendsRegionToRegionOnOneGpu)";
  auto p = start_pair(std::string(GetParam()) == "cuda_ipc", 1);
  ASSERT_TRUE(p.ca && p.cb);
  sends_region_to_region(p);
}

TEST_P(RemoteLocalGpu, ReceiverKilledMidTransfer) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  auto p = start_pair(std::string(GetParam()) == "cuda_ipc");
  ASSERT_TRUE(p.ca && p.cb);
  auto &a = p.ca, &b = p.cb;
  constexpr int64_t n = 256;  // 256 blocks of 4 layers x 64 tokens x 1152 B: 72 MiB a send
  const KvCacheSpec spec{4, n, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  GpuRegion src = create(*a, "prefill", spec);
  GpuRegion dst = create(*b, "decode", spec);
  ASSERT_TRUE(src.base && dst.base);
  ASSERT_EQ(cudaMemset(src.base, 0x11, size_t(spec.region_bytes())), cudaSuccess);
  auto first = a->send_into(src.id, kKeys.keys(n, 10), iota_ids(n), p.peer_b(), dst.id, iota_ids(n));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->done, uint64_t(n)) << p.a->log() << p.b->log();
  std::atomic<bool> killed{false};
  auto sender = std::async(std::launch::async, [&] {
    return testing::sends_after_kill(killed, [&](uint64_t k) {
      return a->send_into(src.id, kKeys.keys(n, 11 + k % 64), iota_ids(n), p.peer_b(), dst.id, iota_ids(n));
    });
  });
  std::this_thread::sleep_for(30ms);
  p.b->stop(SIGKILL);
  killed = true;
  ASSERT_EQ(sender.wait_for(60s), std::future_status::ready) << "a send hung after its receiver died";
  const auto after = sender.get();
  ASSERT_FALSE(after.empty());
  for (const auto& r : after) {
    EXPECT_EQ(r.done, 0u);
    for (ErrorCode e : r.blocks) EXPECT_TRUE(e == ErrorCode::kUnavailable || e == ErrorCode::kTimeout) << int(e);
  }
  // A still serves its own client: a save of the same region completes.
  auto sv = a->save(src.id, kKeys.keys(8, 99), iota_ids(8));
  ASSERT_TRUE(sv.ok());
  EXPECT_EQ(sv->done, 8u) << p.a->log();
}

INSTANTIATE_TEST_SUITE_P(Backends, RemoteLocalGpu, ::testing::Values("cuda_vmm", "cuda_ipc"));

}  // namespace
}  // namespace kvferry
