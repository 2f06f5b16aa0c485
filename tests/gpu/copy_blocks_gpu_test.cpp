// copy_blocks on the GPU, bit for bit against the CPU twin (memcpy): every engine and setting
// (copy kernel with automatic and odd CTA counts, DMA over 1/2/4 streams, auto) in every direction
// (device to host, host to device, device to device, host to host) on random run lists (odd sizes
// and offsets, empty runs, runs of many 64 KiB chunks); the whole destination is compared, so a
// byte written outside a run fails too. Also: copy plans of both layouts, back-to-back copies that
// reuse the copier's staging slots, both directions at once, offsets past 2^32, and bad input.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../unit/kernels_test_util.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"

namespace kvferry {
namespace {

using namespace kernels;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

enum class Mem { kDevice, kPinned };

/// A buffer in device or pinned host memory with a host mirror that the CPU twin works on.
struct Buf {
  Mem mem;
  size_t n = 0;
  uint8_t* p = nullptr;       // device or pinned
  std::vector<uint8_t> host;  // the mirror
  Buf(Mem m, size_t bytes) : mem(m), n(bytes), host(bytes) {
    const cudaError_t e = m == Mem::kDevice ? cudaMalloc(&p, n) : cudaMallocHost(&p, n);
    if (e != cudaSuccess) p = nullptr;
  }
  ~Buf() {
    if (p) (void)(mem == Mem::kDevice ? cudaFree(p) : cudaFreeHost(p));
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  bool ok() const { return p != nullptr; }
  int64_t size() const { return static_cast<int64_t>(n); }
  /// Fills mirror and buffer with the same seeded bytes.
  void fill(uint32_t seed) {
    test::fill_random(host.data(), n, seed);
    (void)cudaMemcpy(p, host.data(), n, cudaMemcpyDefault);
  }
  std::vector<uint8_t> read() const {
    std::vector<uint8_t> v(n);
    (void)cudaMemcpy(v.data(), p, n, cudaMemcpyDefault);
    return v;
  }
};

/// Index of the first differing byte, or -1.
int64_t first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return -1;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

/// Random runs reading anywhere in [0, src_bytes) and writing disjoint ranges of [0, dst_bytes):
/// odd and aligned sizes from 0 bytes to several 64 KiB chunks, aligned and unaligned offsets.
std::vector<CopyRun> random_runs(uint32_t seed, int count, int64_t src_bytes, int64_t dst_bytes) {
  std::mt19937_64 g(seed);
  const int64_t sizes[] = {
      0, 1, 15, 16, 100, 4096, 16 << 10, (16 << 10) + 16, 64 << 10, (64 << 10) + 48, (200 << 10) + 3, 1 << 20};
  std::vector<CopyRun> runs;
  int64_t at = 0;
  for (int i = 0; i < count; ++i) {
    int64_t bytes = sizes[g() % std::size(sizes)];
    const bool aligned = g() % 4 != 0;
    int64_t dst = at + static_cast<int64_t>(g() % 64);
    if (aligned) dst = (dst + 15) & ~int64_t{15};
    if (dst + bytes > dst_bytes) break;
    int64_t src = static_cast<int64_t>(g() % static_cast<uint64_t>(src_bytes - bytes + 1));
    if (aligned) src &= ~int64_t{15};
    runs.push_back({src, dst, bytes});
    at = dst + bytes;
  }
  std::shuffle(runs.begin(), runs.end(), g);
  return runs;
}

struct Setting {
  CopyEngine engine;
  int ctas;
  int dma_streams;
  std::string name() const {
    return std::string(copy_engine_name(engine)) + " ctas=" + std::to_string(ctas) +
           " streams=" + std::to_string(dma_streams);
  }
};

const Setting kSettings[] = {{CopyEngine::kKernel, 0, 4}, {CopyEngine::kKernel, 1, 4}, {CopyEngine::kKernel, 7, 4},
                             {CopyEngine::kDma, 0, 1},    {CopyEngine::kDma, 0, 2},    {CopyEngine::kDma, 0, 4},
                             {CopyEngine::kStaged, 0, 1}, {CopyEngine::kStaged, 0, 4}, {CopyEngine::kAuto, 0, 4}};

class CopyBlocksGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  /// Copies `runs` src -> dst with `s` and compares all of dst with the CPU twin's result.
  void check(Buf& src, Buf& dst, const std::vector<CopyRun>& runs, const Setting& s, BlockCopier& c, uint32_t seed,
             const std::string& what) {
    dst.fill(seed);  // the bytes outside the runs must survive
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> want = dst.host;
    ASSERT_TRUE(copy_blocks_cpu(src.host.data(), src.size(), want.data(), dst.size(), runs).ok());
    c.set_kernel_ctas(s.ctas);
    c.set_dma_streams(s.dma_streams);
    const Status st = c.copy(src.p, dst.p, runs, s.engine, stream_);
    ASSERT_TRUE(st.ok()) << what << " " << s.name() << ": " << st.to_string();
    CUDA_OK(cudaStreamSynchronize(stream_));
    const int64_t at = first_diff(dst.read(), want);
    EXPECT_EQ(at, -1) << what << " " << s.name() << ": first wrong byte at " << at;
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(CopyBlocksGpu, EveryEngineAndDirectionMatchesMemcpy) {
  const size_t mib = size_t{1} << 20;
  Buf dev_a(Mem::kDevice, 48 * mib), dev_b(Mem::kDevice, 40 * mib), pin_a(Mem::kPinned, 48 * mib),
      pin_b(Mem::kPinned, 40 * mib);
  ASSERT_TRUE(dev_a.ok() && dev_b.ok() && pin_a.ok() && pin_b.ok());
  dev_a.fill(1);
  pin_a.fill(2);
  auto copier = BlockCopier::create(1024);
  ASSERT_TRUE(copier.ok()) << copier.status().to_string();
  struct Dir {
    Buf* src;
    Buf* dst;
    CopyDirection want;
  };
  const Dir dirs[] = {{&dev_a, &pin_b, CopyDirection::kDeviceToHost},
                      {&pin_a, &dev_b, CopyDirection::kHostToDevice},
                      {&dev_a, &dev_b, CopyDirection::kDeviceToDevice},
                      {&pin_a, &pin_b, CopyDirection::kHostToHost}};
  uint32_t seed = 10;
  for (const Dir& d : dirs) {
    const auto runs = random_runs(seed, 300, d.src->size(), d.dst->size());
    ASSERT_GT(runs.size(), 100u);
    for (const Setting& s : kSettings) {
      check(*d.src, *d.dst, runs, s, **copier, ++seed, copy_direction_name(d.want));
      if (s.engine == CopyEngine::kKernel) {
        EXPECT_EQ((*copier)->last_direction(), d.want);
      }
    }
  }
}

TEST_F(CopyBlocksGpu, ThousandsOfSmallRunsEachFindTheirChunks) {
  // Every warp of the copy kernel searches the chunk prefix for its first run, 32 probes a round:
  // 6000 runs (empty ones among them, so the prefix repeats values) need three rounds.
  const size_t mib = size_t{1} << 20;
  Buf dev(Mem::kDevice, 80 * mib), pin(Mem::kPinned, 80 * mib), dev2(Mem::kDevice, 96 * mib);
  ASSERT_TRUE(dev.ok() && pin.ok() && dev2.ok());
  pin.fill(31);
  dev.fill(32);
  std::mt19937_64 g(33);
  const int64_t sizes[] = {0, 0, 16, 48, 4096, 16 << 10, 70000};
  std::vector<CopyRun> runs;
  int64_t at = 0;
  for (int i = 0; i < 6000; ++i) {
    const int64_t bytes = sizes[g() % std::size(sizes)];
    const int64_t src = static_cast<int64_t>(g() % static_cast<uint64_t>(static_cast<int64_t>(pin.n) - bytes)) & ~15;
    runs.push_back({src, at, bytes});
    at += (bytes + 15) & ~int64_t{15};
  }
  ASSERT_LT(at, static_cast<int64_t>(dev2.n));
  std::shuffle(runs.begin(), runs.end(), g);
  auto copier = BlockCopier::create(8192);
  ASSERT_TRUE(copier.ok());
  uint32_t seed = 34;
  for (int ctas : {0, 1, 7, 64}) {
    const Setting s{CopyEngine::kKernel, ctas, 4};
    check(pin, dev2, runs, s, **copier, ++seed, "host to device");
    check(dev, dev2, runs, s, **copier, ++seed, "device to device");
  }
}

TEST_F(CopyBlocksGpu, PlansOfBothLayoutsRoundTrip) {
  for (Layout layout : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    const auto region = test::mk_spec(5, 96, 16, EntryFormat::mla_fp8_ds(), layout);
    const auto pool = test::mk_spec(5, 40, 16, EntryFormat::mla_fp8_ds());
    std::vector<int64_t> rb, hb;
    for (int64_t i = 0; i < 40; ++i) {
      rb.push_back((i * 37 + 5) % 96);
      hb.push_back((i * 7) % 40);
    }
    auto save = copy_plan(region, rb, pool, hb);
    auto load = copy_plan(pool, hb, region, rb);
    ASSERT_TRUE(save.ok() && load.ok());
    Buf reg(Mem::kDevice, static_cast<size_t>(region.region_bytes())), reg2(Mem::kDevice, reg.n),
        pin(Mem::kPinned, static_cast<size_t>(pool.region_bytes()));
    ASSERT_TRUE(reg.ok() && reg2.ok() && pin.ok());
    reg.fill(50);
    auto copier = BlockCopier::create(4096);
    ASSERT_TRUE(copier.ok());
    for (const Setting& s : kSettings) {
      check(reg, pin, *save, s, **copier, 51, "save");
      pin.host = pin.read();  // the pool as saved, for the load's twin
      check(pin, reg2, *load, s, **copier, 52, "load");
    }
  }
}

TEST_F(CopyBlocksGpu, BackToBackCopiesReuseStagingSlots) {
  // Five copies enqueued without a sync in between, each reading what the one before wrote:
  // slots alternate, and the third copy must not overwrite the first's staged run list early.
  const size_t n = size_t{8} << 20;
  std::vector<std::unique_ptr<Buf>> bufs;
  for (int i = 0; i < 6; ++i) {
    bufs.push_back(std::make_unique<Buf>(i % 2 ? Mem::kPinned : Mem::kDevice, n));
    ASSERT_TRUE(bufs.back()->ok());
    bufs.back()->fill(60 + static_cast<uint32_t>(i));
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (CopyEngine e : {CopyEngine::kKernel, CopyEngine::kDma, CopyEngine::kStaged}) {
    for (int i = 0; i < 6; ++i) bufs[static_cast<size_t>(i)]->fill(70 + static_cast<uint32_t>(i));
    CUDA_OK(cudaDeviceSynchronize());
    auto copier = BlockCopier::create(512);
    ASSERT_TRUE(copier.ok());
    std::vector<std::vector<CopyRun>> lists;
    for (int i = 0; i < 5; ++i) {
      lists.push_back(
          random_runs(80 + static_cast<uint32_t>(i), 200, static_cast<int64_t>(n), static_cast<int64_t>(n)));
      Buf& src = *bufs[static_cast<size_t>(i)];
      Buf& dst = *bufs[static_cast<size_t>(i + 1)];
      ASSERT_TRUE(copy_blocks_cpu(src.host.data(), src.size(), dst.host.data(), dst.size(), lists.back()).ok());
      ASSERT_TRUE((*copier)->copy(src.p, dst.p, lists.back(), e, stream_).ok());
    }
    CUDA_OK(cudaStreamSynchronize(stream_));
    for (int i = 1; i < 6; ++i)
      EXPECT_EQ(first_diff(bufs[static_cast<size_t>(i)]->read(), bufs[static_cast<size_t>(i)]->host), -1)
          << copy_engine_name(e) << " copy " << i;
  }
}

TEST_F(CopyBlocksGpu, BothDirectionsAtOnce) {
  const size_t n = size_t{32} << 20;
  Buf dev_out(Mem::kDevice, n), pin_out(Mem::kPinned, n), pin_in(Mem::kPinned, n), dev_in(Mem::kDevice, n);
  ASSERT_TRUE(dev_out.ok() && pin_out.ok() && pin_in.ok() && dev_in.ok());
  cudaStream_t other = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  auto ca = BlockCopier::create(2048), cb = BlockCopier::create(2048);
  ASSERT_TRUE(ca.ok() && cb.ok());
  for (CopyEngine e : {CopyEngine::kKernel, CopyEngine::kDma, CopyEngine::kStaged, CopyEngine::kAuto}) {
    dev_out.fill(90);
    pin_in.fill(91);
    pin_out.fill(92);
    dev_in.fill(93);
    CUDA_OK(cudaDeviceSynchronize());
    const auto out = random_runs(94, 400, static_cast<int64_t>(n), static_cast<int64_t>(n));
    const auto in = random_runs(95, 400, static_cast<int64_t>(n), static_cast<int64_t>(n));
    ASSERT_TRUE(copy_blocks_cpu(dev_out.host.data(), dev_out.size(), pin_out.host.data(), pin_out.size(), out).ok());
    ASSERT_TRUE(copy_blocks_cpu(pin_in.host.data(), pin_in.size(), dev_in.host.data(), dev_in.size(), in).ok());
    ASSERT_TRUE((*ca)->copy(dev_out.p, pin_out.p, out, e, stream_).ok());
    ASSERT_TRUE((*cb)->copy(pin_in.p, dev_in.p, in, e, other).ok());
    CUDA_OK(cudaStreamSynchronize(stream_));
    CUDA_OK(cudaStreamSynchronize(other));
    EXPECT_EQ(first_diff(pin_out.read(), pin_out.host), -1) << "out, " << copy_engine_name(e);
    EXPECT_EQ(first_diff(dev_in.read(), dev_in.host), -1) << "in, " << copy_engine_name(e);
  }
  (void)cudaStreamDestroy(other);
}

TEST_F(CopyBlocksGpu, OffsetsPast4GiB) {
  const int64_t big = (int64_t{9} << 29) + 4096;  // 4.5 GiB + a page
  size_t free_b = 0, total_b = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < static_cast<size_t>(big) + (size_t{1} << 30)) GTEST_SKIP() << "needs 5.5 GiB of free device memory";
  uint8_t* reg = nullptr;
  CUDA_OK(cudaMalloc(&reg, static_cast<size_t>(big)));
  const size_t pn = size_t{4} << 20;
  Buf pin(Mem::kPinned, pn), back(Mem::kPinned, pn);
  ASSERT_TRUE(pin.ok() && back.ok());
  // Runs at offsets around 2^31, 2^32 and the end of the region; the source bytes are filled
  // through a host copy of each run's range.
  const int64_t offs[] = {(int64_t{1} << 31) - 5000, (int64_t{1} << 32) - 70000, (int64_t{1} << 32) + (160 << 10) + 48,
                          big - (300 << 10)};  // disjoint sources
  std::vector<CopyRun> save, load, d2d;
  int64_t at = 0;
  for (size_t i = 0; i < std::size(offs); ++i) {
    const int64_t bytes = i == 3 ? (300 << 10) : (200 << 10) + 16 * static_cast<int64_t>(i);
    std::vector<uint8_t> bytes_h(static_cast<size_t>(bytes));
    test::fill_random(bytes_h.data(), bytes_h.size(), 100 + static_cast<uint32_t>(i));
    CUDA_OK(cudaMemcpy(reg + offs[i], bytes_h.data(), bytes_h.size(), cudaMemcpyHostToDevice));
    std::memcpy(pin.host.data() + at, bytes_h.data(), bytes_h.size());
    save.push_back({offs[i], at, bytes});
    at += bytes + 16;
  }
  // Loads go back above 2^32 at other places; d2d moves the first run to just under the end.
  for (size_t i = 0; i < save.size(); ++i)
    load.push_back({save[i].dst, (int64_t{1} << 32) + (int64_t{8} << 20) + save[i].dst, save[i].bytes});
  d2d.push_back({offs[0], big - (600 << 10), save[0].bytes});
  auto copier = BlockCopier::create(64);
  ASSERT_TRUE(copier.ok());
  for (CopyEngine e : {CopyEngine::kKernel, CopyEngine::kDma, CopyEngine::kStaged}) {
    std::memset(pin.p, 0, pn);
    ASSERT_TRUE((*copier)->copy(reg, pin.p, save, e, stream_).ok());
    CUDA_OK(cudaStreamSynchronize(stream_));
    for (const CopyRun& r : save)
      ASSERT_EQ(std::memcmp(pin.p + r.dst, pin.host.data() + r.dst, static_cast<size_t>(r.bytes)), 0)
          << copy_engine_name(e) << " save from " << r.src;
    ASSERT_TRUE((*copier)->copy(pin.p, reg, load, e, stream_).ok());
    ASSERT_TRUE((*copier)->copy(reg, reg, d2d, e, stream_).ok());
    CUDA_OK(cudaStreamSynchronize(stream_));
    for (const CopyRun& r : load) {
      std::vector<uint8_t> got(static_cast<size_t>(r.bytes));
      CUDA_OK(cudaMemcpy(got.data(), reg + r.dst, got.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(got.data(), pin.host.data() + r.src, got.size()), 0)
          << copy_engine_name(e) << " load to " << r.dst;
    }
    std::vector<uint8_t> got(static_cast<size_t>(d2d[0].bytes));
    CUDA_OK(cudaMemcpy(got.data(), reg + d2d[0].dst, got.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(got.data(), pin.host.data() + save[0].dst, got.size()), 0) << copy_engine_name(e) << " d2d";
  }
  (void)cudaFree(reg);
}

TEST_F(CopyBlocksGpu, StagedMergesConsecutiveHostRangesInPieces) {
  // Like an offload: small blocks scattered over the region, consecutive in the pool. 80 MiB
  // take six pieces (a 2 MiB lead and 16 MiB ones) of the 64 MiB ring's four parts, so parts are
  // refilled while the copy goes on; a run bigger than a part goes by DMA as it is.
  const int64_t block = 64 << 10, nblocks = 1280, region_blocks = 3000;
  const size_t big = size_t{65} << 20;
  Buf reg(Mem::kDevice, static_cast<size_t>(region_blocks * block) + big), reg2(Mem::kDevice, reg.n),
      pool(Mem::kPinned, static_cast<size_t>(nblocks * block) + big + 4096);
  ASSERT_TRUE(reg.ok() && reg2.ok() && pool.ok());
  reg.fill(120);
  std::vector<int64_t> ids(static_cast<size_t>(region_blocks));
  for (int64_t i = 0; i < region_blocks; ++i) ids[static_cast<size_t>(i)] = i;
  std::shuffle(ids.begin(), ids.end(), std::mt19937(121));
  std::vector<CopyRun> save, load;
  for (int64_t i = 0; i < nblocks; ++i) {
    save.push_back({ids[static_cast<size_t>(i)] * block, i * block, block});
    load.push_back({i * block, ids[static_cast<size_t>(i)] * block, block});
  }
  auto copier = BlockCopier::create(4096);
  ASSERT_TRUE(copier.ok());
  for (CopyEngine e : {CopyEngine::kAuto, CopyEngine::kStaged}) {
    check(reg, pool, save, {e, 0, 4}, **copier, 122, "save");
    EXPECT_EQ((*copier)->last_engine(), CopyEngine::kStaged) << copy_engine_name(e);
    pool.host = pool.read();
    check(pool, reg2, load, {e, 0, 4}, **copier, 123, "load");
    EXPECT_EQ((*copier)->last_engine(), CopyEngine::kStaged) << copy_engine_name(e);
  }
  // Scattered on both sides, auto keeps the kernel.
  std::vector<CopyRun> scattered(load.begin(), load.begin() + 64);
  for (size_t i = 0; i < scattered.size(); ++i) scattered[i].src = static_cast<int64_t>((i * 7) % 64) * block;
  check(pool, reg2, scattered, {CopyEngine::kAuto, 0, 4}, **copier, 124, "scattered load");
  EXPECT_EQ((*copier)->last_engine(), CopyEngine::kKernel);
  // One run bigger than the stage among small ones, each way.
  std::vector<CopyRun> mixed(save.begin(), save.begin() + 10);
  mixed.push_back({region_blocks * block, nblocks * block + 4096, static_cast<int64_t>(big)});
  mixed.push_back(save[10]);
  check(reg, pool, mixed, {CopyEngine::kStaged, 0, 2}, **copier, 125, "save with a big run");
  pool.host = pool.read();
  std::vector<CopyRun> back;
  for (const CopyRun& r : mixed) back.push_back({r.dst, r.src, r.bytes});
  check(pool, reg2, back, {CopyEngine::kStaged, 0, 2}, **copier, 126, "load with a big run");
}

TEST_F(CopyBlocksGpu, BadInputIsRefusedWithAReason) {
  Buf dev(Mem::kDevice, 1 << 20), pin(Mem::kPinned, 1 << 20);
  ASSERT_TRUE(dev.ok() && pin.ok());
  auto copier = BlockCopier::create(4);
  ASSERT_TRUE(copier.ok());
  EXPECT_EQ(BlockCopier::create(0).status().code(), ErrorCode::kInvalidArgument);
  const std::vector<CopyRun> one{{0, 0, 4096}}, five(5, CopyRun{0, 0, 16});
  EXPECT_EQ((*copier)->copy(dev.p, pin.p, five, CopyEngine::kDma, stream_).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*copier)->copy(dev.p, pin.p, one, CopyEngine::kDma, nullptr).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*copier)->copy(nullptr, pin.p, one, CopyEngine::kKernel, stream_).code(), ErrorCode::kInvalidArgument);
  // Pageable host memory: the kernel cannot reach it, and says so.
  std::vector<uint8_t> pageable(1 << 20);
  const Status st = (*copier)->copy(dev.p, pageable.data(), one, CopyEngine::kKernel, stream_);
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.to_string().find("pageable"), std::string::npos) << st.to_string();
  // Nothing to copy is fine.
  EXPECT_TRUE((*copier)->copy(dev.p, pin.p, {}, CopyEngine::kKernel, stream_).ok());
  const std::vector<CopyRun> empty_runs{{0, 0, 0}, {16, 16, 0}};
  EXPECT_TRUE((*copier)->copy(dev.p, pin.p, empty_runs, CopyEngine::kDma, stream_).ok());
  EXPECT_TRUE((*copier)->copy(dev.p, pin.p, empty_runs, CopyEngine::kKernel, stream_).ok());
  CUDA_OK(cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace kvferry
