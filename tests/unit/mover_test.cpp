// The movers under the offload service (issue 37): the host mover's contract, the CUDA mover's
// factory, and what an offload service built without CUDA answers for a device region.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "kvferry/kernels/convert.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/host_pool.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/offload.h"
#include "mover.h"

namespace kvferry::store {
namespace {

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng() % 255 + 1);
  return v;
}

// Block b's runs between a region of `spec` and a slot at `slot` (the slot block-major), toward
// the slot when `to_pool`.
std::vector<CopyRun> block_runs(const KvCacheSpec& spec, int64_t b, int64_t slot, bool to_pool) {
  std::vector<CopyRun> runs;
  for (int64_t l = 0; l < spec.layers; ++l) {
    const int64_t off = spec.page_offset(l, b), in_slot = slot + l * spec.page_bytes();
    runs.push_back(to_pool ? CopyRun{off, in_slot, spec.page_bytes()} : CopyRun{in_slot, off, spec.page_bytes()});
  }
  return runs;
}

std::vector<uint8_t> block_of(const std::vector<uint8_t>& region, const KvCacheSpec& spec, int64_t b) {
  std::vector<uint8_t> out;
  for (int64_t l = 0; l < spec.layers; ++l) {
    const uint8_t* p = region.data() + spec.page_offset(l, b);
    out.insert(out.end(), p, p + spec.page_bytes());
  }
  return out;
}

// Fills `n` entries of format `f` at `p` with values its conversions take (finite e4m3; for 656 B
// entries rope values that are e4m3 numbers, and every tile scale `scale`).
void fill_entries(uint8_t* p, int64_t n, const EntryFormat& f, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  for (int64_t e = 0; e < n; ++e, p += f.bytes_per_token()) {
    if (f.kind == FormatKind::kMlaFp8) {
      for (int i = 0; i < kMlaDim; ++i) p[i] = static_cast<uint8_t>(rng() % 0x7E) | (rng() & 0x80);
    } else {
      for (int i = 0; i < kMlaRank; ++i) p[i] = static_cast<uint8_t>(rng() % 0x7E) | (rng() & 0x80);
      for (int t = 0; t < kMlaTiles; ++t) std::memcpy(p + kMlaDsScaleOffset + 4 * t, &scale, 4);
      for (int i = 0; i < kMlaRope; ++i) {
        const uint16_t h = float_to_bf16(e4m3_to_float(static_cast<uint8_t>(rng() % 0x7E)));
        std::memcpy(p + kMlaDsRopeOffset + 2 * i, &h, 2);
      }
    }
  }
}

std::unique_ptr<MoveOp> begin(Mover& m, std::vector<uint8_t>& region, const KvCacheSpec& spec, bool to_pool) {
  auto op = m.begin(RegionAccess{region.data(), spec, false}, to_pool);
  EXPECT_TRUE(op.ok()) << op.status().to_string();
  return op.ok() ? std::move(op).value() : nullptr;
}

// Saves blocks 0..n-1 of a region into slots in reverse order, then loads them back into blocks
// n..2n-1, block by block, as the offload service does on its pool threads.
class HostMoverTest : public ::testing::TestWithParam<std::tuple<Layout, int>> {};

TEST_P(HostMoverTest, MovesEachBlockInMoveBlockAndNothingInEnqueue) {
  const Layout layout = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const KvCacheSpec spec{3, 2 * n + 1, 4, EntryFormat::mla_bf16(), layout};
  const int64_t bb = spec.block_bytes();
  auto region = pattern(static_cast<size_t>(spec.region_bytes()), 1);
  auto pool = pattern(static_cast<size_t>(n * bb), 2);
  const auto pool_before = pool;
  auto mover = make_host_mover({pool.data(), static_cast<int64_t>(pool.size()), 2});
  ASSERT_TRUE(mover->prepare().ok());
  auto slot = [&](int64_t b) { return (n - 1 - b) * bb; };

  auto save = begin(*mover, region, spec, true);
  ASSERT_NE(save, nullptr);
  EXPECT_EQ(save->depth(), 0);
  EXPECT_TRUE(save->by_block());
  std::vector<CopyRun> all;
  for (int64_t b = 0; b < n; ++b)
    for (const CopyRun& r : block_runs(spec, b, slot(b), true)) all.push_back(r);
  ASSERT_TRUE(save->enqueue(0, all).ok());
  ASSERT_TRUE(save->wait(0).ok());
  EXPECT_EQ(pool, pool_before) << "a mover of depth 0 moves nothing in enqueue or wait";
  for (int64_t b = 0; b < n; ++b) ASSERT_TRUE(save->move_block(block_runs(spec, b, slot(b), true)).ok()) << b;
  ASSERT_TRUE(save->finish().ok());
  for (int64_t b = 0; b < n; ++b) {
    const auto want = block_of(region, spec, b);
    EXPECT_EQ(std::vector<uint8_t>(pool.begin() + slot(b), pool.begin() + slot(b) + bb), want) << "slot of block " << b;
  }

  const auto before = region;
  auto load = begin(*mover, region, spec, false);
  ASSERT_NE(load, nullptr);
  for (int64_t b = 0; b < n; ++b) ASSERT_TRUE(load->move_block(block_runs(spec, n + b, slot(b), false)).ok()) << b;
  ASSERT_TRUE(load->finish().ok());
  for (int64_t b = 0; b < n; ++b) {
    EXPECT_EQ(block_of(region, spec, n + b), block_of(before, spec, b)) << "block " << n + b;
    EXPECT_EQ(block_of(region, spec, b), block_of(before, spec, b)) << "source block " << b << " unchanged";
  }
  EXPECT_EQ(block_of(region, spec, 2 * n), block_of(before, spec, 2 * n)) << "the block nobody named";
}

INSTANTIATE_TEST_SUITE_P(LayoutsAndCounts, HostMoverTest,
                         ::testing::Combine(::testing::Values(Layout::kBlockMajor, Layout::kLayerMajor),
                                            ::testing::Values(0, 1, 7)));

TEST(HostMover, RefusesARunOutsideThePoolAndWritesNothing) {
  const KvCacheSpec spec{2, 4, 4, EntryFormat::mla_bf16(), Layout::kLayerMajor};
  auto region = pattern(static_cast<size_t>(spec.region_bytes()), 3);
  auto pool = pattern(static_cast<size_t>(2 * spec.block_bytes()), 4);
  const auto pool_before = pool;
  auto mover = make_host_mover({pool.data(), static_cast<int64_t>(pool.size()), 1});
  auto op = begin(*mover, region, spec, true);
  ASSERT_NE(op, nullptr);
  EXPECT_FALSE(op->move_block(block_runs(spec, 1, 2 * spec.block_bytes(), true)).ok()) << "the slot past the pool";
  EXPECT_EQ(pool, pool_before);
}

// A stored mla_fp8 block loaded into an mla_fp8_ds region: the region's block is what the CPU
// conversion writes, the others stay as they were.
TEST(HostMover, ConvertsAStoredBlockIntoTheRegionsFormat) {
  const BlockShape stored_shape{2, 16, EntryFormat::mla_fp8()};
  const KvCacheSpec spec{2, 4, 16, EntryFormat::mla_fp8_ds(), Layout::kLayerMajor};
  std::vector<uint8_t> pool(static_cast<size_t>(stored_shape.bytes()));
  fill_entries(pool.data(), stored_shape.layers * stored_shape.block_size, stored_shape.format, 5);
  auto region = pattern(static_cast<size_t>(spec.region_bytes()), 6);
  auto want = region;
  const int64_t zero = 0, target = 2;
  ASSERT_TRUE(
      kernels::convert_blocks_cpu(pool.data(), stored_shape.slot_spec(), {&zero, 1}, want.data(), spec, {&target, 1})
          .ok());
  auto mover = make_host_mover({pool.data(), static_cast<int64_t>(pool.size()), 2});
  auto op = begin(*mover, region, spec, false);
  ASSERT_NE(op, nullptr);
  std::vector<int64_t> lossy;
  ASSERT_TRUE(op->convert_block(pool.data(), stored_shape, block_runs(spec, target, 0, false), &lossy).ok());
  EXPECT_TRUE(lossy.empty());
  EXPECT_EQ(region, want);
}

// 656 -> 576 with tile scales of 2: not lossless, reported, and the target block is untouched.
TEST(HostMover, ALossyConversionLeavesTheRegionAlone) {
  const BlockShape stored_shape{1, 8, EntryFormat::mla_fp8_ds()};
  const KvCacheSpec spec{1, 3, 8, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  std::vector<uint8_t> pool(static_cast<size_t>(stored_shape.bytes()));
  fill_entries(pool.data(), stored_shape.block_size, stored_shape.format, 7, 2.0f);
  auto region = pattern(static_cast<size_t>(spec.region_bytes()), 8);
  const auto before = region;
  auto mover = make_host_mover({pool.data(), static_cast<int64_t>(pool.size()), 1});
  auto op = begin(*mover, region, spec, false);
  ASSERT_NE(op, nullptr);
  std::vector<int64_t> lossy;
  ASSERT_TRUE(op->convert_block(pool.data(), stored_shape, block_runs(spec, 1, 0, false), &lossy).ok());
  EXPECT_FALSE(lossy.empty());
  EXPECT_EQ(region, before);
}

TEST(CudaMover, TheFactoryTouchesNoDeviceOrSaysWhyThereIsNone) {
  auto m = make_cuda_mover({});
#if defined(KVFERRY_WITH_CUDA)
  EXPECT_TRUE(m.ok()) << m.status().to_string() << " (lanes are made on first need, so this needs no GPU)";
#else
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kUnavailable);
  EXPECT_EQ(m.status().message(), "kvferry was built without CUDA");
#endif
}

// Built without CUDA, the service refuses use_cuda, and every block of a device region fails
// with the reason (nothing reserved stays behind, stored blocks stay).
TEST(OffloadWithoutCuda, DeviceRegionsFailWithTheReason) {
#if defined(KVFERRY_WITH_CUDA)
  GTEST_SKIP() << "built with CUDA: device regions are served (offload_gpu_test covers them)";
#else
  HostPool::Options po;
  po.capacity = 8 << 20;
  po.chunk_bytes = 1 << 20;
  po.pin = false;
  auto pool = HostPool::create(po);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  BlockIndex index(**pool, BlockIndex::Options{});
  Registry metrics;
  OffloadService::Options so;
  so.use_cuda = true;
  auto refused = OffloadService::create(index, metrics, so);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnavailable);
  EXPECT_EQ(refused.status().message(), "kvferry was built without CUDA");

  auto svc = OffloadService::create(index, metrics, {});
  ASSERT_TRUE(svc.ok()) << svc.status().to_string();
  const NamespaceId ns = index.intern_namespace("m|mla|t");
  const KvCacheSpec spec{2, 4, 8, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  auto bytes = pattern(static_cast<size_t>(spec.region_bytes()), 9);
  const RegionAccess host{bytes.data(), spec, false};
  const RegionAccess device{bytes.data(), spec, true};  // never dereferenced without CUDA
  const std::vector<BlockKey> stored = {{1, 1}}, fresh = {{1, 2}, {1, 3}};
  ASSERT_TRUE((*svc)->save(host, ns, stored, std::vector<int64_t>{0})[0].ok());

  for (const Status& s : (*svc)->save(device, ns, fresh, std::vector<int64_t>{1, 2})) {
    EXPECT_EQ(s.code(), ErrorCode::kUnavailable);
    EXPECT_EQ(s.message(), "device region but kvferry was built without CUDA");
  }
  EXPECT_EQ(index.stats().writing, 0u);
  EXPECT_EQ(index.lookup(ns, fresh).prefix, 0u);
  const auto ld = (*svc)->load(device, ns, stored, std::vector<int64_t>{3});
  EXPECT_EQ(ld[0].code(), ErrorCode::kUnavailable);
  EXPECT_EQ(ld[0].message(), "device region but kvferry was built without CUDA");
  EXPECT_EQ(index.lookup(ns, stored).prefix, 1u) << "the stored block stays";
#endif
}

}  // namespace
}  // namespace kvferry::store

namespace kvferry::store {
namespace {

// Pitched copies: runs of one size at constant strides fold into one 2-D run; anything else stays
// a run of its own, in order, and the folded rows cover exactly the runs' bytes.
TEST(Fold2D, ConstantStridesFoldAndTheRestStays) {
  std::vector<CopyRun> runs;
  for (int64_t l = 0; l < 14; ++l) runs.push_back({1000 + l * 4096, l * 1024, 1024});  // a page's layers
  runs.push_back({900000, 500000, 64});                                                // an odd one
  runs.push_back({800000, 600000, 512});
  runs.push_back({800000 + 300, 600000 + 512, 512});  // source stride below the width: no fold
  const auto f = fold_2d(runs);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0].rows, 14);
  EXPECT_EQ(f[0].spitch, 4096);
  EXPECT_EQ(f[0].dpitch, 1024);
  EXPECT_EQ(f[0].width, 1024);
  EXPECT_EQ(f[1].rows, 1);
  EXPECT_EQ(f[1].width, 64);
  EXPECT_EQ(f[2].rows, 1);
  EXPECT_EQ(f[3].rows, 1);
  EXPECT_EQ(f[3].src, 800300);
  int64_t bytes = 0, folded = 0;
  for (const auto& r : runs) bytes += r.bytes;
  for (const auto& r : f) folded += r.rows * r.width;
  EXPECT_EQ(bytes, folded);
  EXPECT_TRUE(fold_2d({}).empty());
}

}  // namespace
}  // namespace kvferry::store
