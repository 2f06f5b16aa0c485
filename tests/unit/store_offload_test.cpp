#include <gtest/gtest.h>

#include <cstring>
#include <chrono>
#include <numeric>
#include <random>
#include <vector>

#include "kvferry/kernels/convert.h"
#include "kvferry/store/offload.h"

namespace kvferry::store {
namespace {

// A host region of `spec` filled with a seeded pattern that is valid for its format (fp8 values
// finite, 656 B scales 1.0 and rope exactly representable, so conversions are meaningful).
struct HostRegion {
  explicit HostRegion(KvCacheSpec s) : spec(s), bytes(static_cast<size_t>(s.region_bytes())) {}
  RegionAccess access() { return {bytes.data(), spec, false}; }
  std::vector<uint8_t> block(int64_t b) const {
    std::vector<uint8_t> out;
    for (int64_t l = 0; l < spec.layers; ++l) {
      const uint8_t* p = bytes.data() + spec.page_offset(l, b);
      out.insert(out.end(), p, p + spec.page_bytes());
    }
    return out;
  }
  KvCacheSpec spec;
  std::vector<uint8_t> bytes;
};

void fill(HostRegion& r, uint32_t seed) {
  std::mt19937 rng(seed);
  const auto f = r.spec.format;
  const int64_t bpt = f.bytes_per_token();
  const int64_t entries = r.spec.region_bytes() / bpt;
  for (int64_t e = 0; e < entries; ++e) {
    uint8_t* p = r.bytes.data() + e * bpt;
    if (f.kind == FormatKind::kMlaBf16) {
      for (int i = 0; i < kMlaDim; ++i) {
        const uint16_t h = float_to_bf16(static_cast<float>(static_cast<int>(rng() % 200) - 100) / 64.0f);
        std::memcpy(p + 2 * i, &h, 2);
      }
    } else if (f.kind == FormatKind::kMlaFp8) {
      for (int i = 0; i < kMlaDim; ++i) p[i] = static_cast<uint8_t>(rng() % 0x7E) | (rng() & 0x80);
    } else if (f.kind == FormatKind::kMlaFp8Ds) {
      for (int i = 0; i < kMlaRank; ++i) p[i] = static_cast<uint8_t>(rng() % 0x7E) | (rng() & 0x80);
      const float one = 1.0f;
      for (int t = 0; t < 4; ++t) std::memcpy(p + 512 + 4 * t, &one, 4);
      for (int i = 0; i < kMlaRope; ++i) {
        const uint16_t h = float_to_bf16(e4m3_to_float(static_cast<uint8_t>(rng() % 0x7E)));
        std::memcpy(p + 528 + 2 * i, &h, 2);
      }
    } else {
      for (int64_t i = 0; i < bpt; ++i) p[i] = static_cast<uint8_t>(rng());
    }
  }
}

class OffloadTest : public ::testing::Test {
 protected:
  void make(uint64_t capacity, uint64_t chunk = 1 << 20, OffloadService::Options so = {}) {
    HostPool::Options o;
    o.capacity = capacity;
    o.chunk_bytes = chunk;
    o.pin = false;
    pool_ = std::move(HostPool::create(o)).value();
    index_ = std::make_unique<BlockIndex>(*pool_, BlockIndex::Options{});
    svc_.reset();
    auto s = OffloadService::create(*index_, metrics_, so);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    svc_ = std::move(s).value();
    ns_ = index_->intern_namespace("m|mla|t");
  }
  void SetUp() override { make(64 << 20); }

  static std::vector<BlockKey> keys(int n, uint64_t salt = 0) {
    std::vector<BlockKey> k;
    for (int i = 0; i < n; ++i) k.push_back({salt, static_cast<uint64_t>(i) * 2654435761u + 1});
    return k;
  }
  static void expect_all_ok(const std::vector<Status>& st) {
    for (size_t i = 0; i < st.size(); ++i) EXPECT_TRUE(st[i].ok()) << i << ": " << st[i].to_string();
  }

  Registry metrics_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<BlockIndex> index_;
  std::unique_ptr<OffloadService> svc_;
  NamespaceId ns_ = 0;
};

TEST_F(OffloadTest, RoundTripIntoOtherBlockIdsForEveryLayoutAndBatchSize) {
  for (Layout lay : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    for (int n : {1, 5, 16}) {
      HostRegion src({3, 16, 16, EntryFormat::mla_fp8_ds(), lay});
      fill(src, 100 + n);
      auto k = keys(n, static_cast<uint64_t>(lay) * 100 + n);
      std::vector<int64_t> from(n), to(n);
      std::iota(from.begin(), from.end(), 0);
      for (int i = 0; i < n; ++i) to[i] = 15 - i;  // different ids, reversed
      expect_all_ok(svc_->save(src.access(), ns_, k, from));
      HostRegion dst(src.spec);
      fill(dst, 999);  // garbage that must be overwritten
      expect_all_ok(svc_->load(dst.access(), ns_, k, to));
      for (int i = 0; i < n; ++i) ASSERT_EQ(dst.block(to[i]), src.block(from[i])) << "block " << i;
    }
  }
}

TEST_F(OffloadTest, MissesAndBadBlockIdsArePerBlock) {
  HostRegion r({2, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(r, 1);
  auto k = keys(3);
  auto st = svc_->save(r.access(), ns_, k, std::vector<int64_t>{0, 8, 2});
  EXPECT_TRUE(st[0].ok());
  EXPECT_EQ(st[1].code(), ErrorCode::kOutOfRange);
  EXPECT_NE(st[1].message().find("block 8"), std::string::npos);
  EXPECT_TRUE(st[2].ok());
  auto ld = svc_->load(r.access(), ns_, k, std::vector<int64_t>{4, 5, -1});
  EXPECT_TRUE(ld[0].ok());
  EXPECT_EQ(ld[1].code(), ErrorCode::kNotFound);  // never saved
  EXPECT_EQ(ld[2].code(), ErrorCode::kOutOfRange);
  auto mism = svc_->load(r.access(), ns_, k, std::vector<int64_t>{1});
  EXPECT_EQ(mism[0].code(), ErrorCode::kInvalidArgument);
}

TEST_F(OffloadTest, ListsOfDifferentLengthsFailEveryBlock) {
  HostRegion r({1, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  auto k = keys(2);
  for (const auto& st : {svc_->save(r.access(), ns_, k, std::vector<int64_t>{0}),
                         svc_->load(r.access(), ns_, k, std::vector<int64_t>{0})}) {
    ASSERT_EQ(st.size(), 2u);
    for (const Status& s : st) {
      EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(s.message().find("2 keys but 1 block ids"), std::string::npos) << s.message();
    }
  }
  EXPECT_EQ(index_->stats().entries, 0u);
}

TEST_F(OffloadTest, SavingTwiceIsANoOpAndKeepsTheFirstCopy) {
  HostRegion r({1, 4, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  fill(r, 2);
  auto k = keys(1);
  expect_all_ok(svc_->save(r.access(), ns_, k, std::vector<int64_t>{0}));
  const auto first = r.block(0);
  fill(r, 3);
  expect_all_ok(svc_->save(r.access(), ns_, k, std::vector<int64_t>{0}));
  expect_all_ok(svc_->load(r.access(), ns_, k, std::vector<int64_t>{1}));
  EXPECT_EQ(r.block(1), first);
}

TEST_F(OffloadTest, CorruptedSlotIsDetectedReportedAndDropped) {
  HostRegion r({2, 4, 16, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor});
  fill(r, 4);
  auto k = keys(2);
  expect_all_ok(svc_->save(r.access(), ns_, k, std::vector<int64_t>{0, 1}));
  ASSERT_TRUE(index_->corrupt_for_test(NsKey{ns_, k[1]}, 1234).ok());
  const auto before = r.block(3);
  auto st = svc_->load(r.access(), ns_, k, std::vector<int64_t>{2, 3});
  EXPECT_TRUE(st[0].ok());
  EXPECT_EQ(st[1].code(), ErrorCode::kChecksumMismatch);
  EXPECT_EQ(r.block(3), before) << "damaged bytes must never reach the region";
  EXPECT_EQ(index_->lookup(ns_, k).present, (std::vector<uint8_t>{1, 0}));
  EXPECT_NE(metrics_.render().find("kvferry_checksum_failures_total 1"), std::string::npos);
}

TEST_F(OffloadTest, ABatchLargerThanThePoolFailsCleanlyForTheRest) {
  make(4 << 20, 1 << 20);
  HostRegion r({1, 16, 1024, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(r, 6);
  auto k = keys(6);
  std::vector<int64_t> ids = {0, 1, 2, 3, 4, 5};
  auto st = svc_->save(r.access(), ns_, k, ids);  // blocks of one batch are in flight together
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(st[i].ok()) << st[i].to_string();
  for (int i = 4; i < 6; ++i) EXPECT_EQ(st[i].code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(index_->lookup(ns_, k).prefix, 4u);
}

TEST_F(OffloadTest, EvictedBlocksReportAMissNeverWrongBytes) {
  make(4 << 20, 1 << 20);  // room for 4 blocks of 1 layer x 1024 tokens x 576 B (576 KiB -> 1 per chunk)
  HostRegion r({1, 16, 1024, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(r, 5);
  auto k = keys(10);
  std::vector<int64_t> ids(10);
  std::iota(ids.begin(), ids.end(), 0);
  for (int i = 0; i < 10; i += 2)  // batches of 2: older batches are committed and evictable
    expect_all_ok(svc_->save(r.access(), ns_, std::span(k).subspan(i, 2), std::span(ids).subspan(i, 2)));
  EXPECT_GT(index_->stats().evictions, 0u);
  HostRegion out(r.spec);
  auto st = svc_->load(out.access(), ns_, k, ids);
  int hits = 0;
  for (int i = 0; i < 10; ++i) {
    if (st[i].ok()) {
      ++hits;
      EXPECT_EQ(out.block(i), r.block(i)) << i;
    } else {
      EXPECT_EQ(st[i].code(), ErrorCode::kNotFound) << st[i].to_string();
    }
  }
  EXPECT_GE(hits, 1);
  EXPECT_LE(hits, 4);
}

// Converting loads: each supported pair gives exactly what the CPU conversion kernel gives, also
// into a layer-major region; unsupported pairs are a per-block kUnsupported.
TEST_F(OffloadTest, LoadsConvertBetweenMlaFormats) {
  const std::pair<EntryFormat, EntryFormat> pairs[] = {
      {EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds()},
      {EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds()},
      {EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16()},
      {EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp8()},
  };
  uint64_t salt = 50;
  for (const auto& [from, to] : pairs) {
    HostRegion src({3, 4, 16, from, Layout::kBlockMajor});
    fill(src, 7);
    auto k = keys(2, ++salt);
    expect_all_ok(svc_->save(src.access(), ns_, k, std::vector<int64_t>{1, 2}));
    HostRegion dst({3, 4, 16, to, Layout::kLayerMajor});
    auto st = svc_->load(dst.access(), ns_, k, std::vector<int64_t>{3, 0});
    for (const Status& x : st) ASSERT_TRUE(x.ok()) << from.name() << " -> " << to.name() << ": " << x.to_string();
    HostRegion want(dst.spec);
    ASSERT_TRUE(kernels::convert_blocks_cpu(src.bytes.data(), src.spec, std::vector<int64_t>{1, 2}, want.bytes.data(),
                                            want.spec, std::vector<int64_t>{3, 0})
                    .ok());
    EXPECT_EQ(dst.block(3), want.block(3)) << from.name() << " -> " << to.name();
    EXPECT_EQ(dst.block(0), want.block(0)) << from.name() << " -> " << to.name();
  }
  // 576 -> 656 -> 576 through the daemon is bit-exact.
  HostRegion a({2, 2, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(a, 8);
  auto k1 = keys(1, 900), k2 = keys(1, 901);
  expect_all_ok(svc_->save(a.access(), ns_, k1, std::vector<int64_t>{0}));
  HostRegion ds({2, 2, 16, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor});
  expect_all_ok(svc_->load(ds.access(), ns_, k1, std::vector<int64_t>{1}));
  expect_all_ok(svc_->save(ds.access(), ns_, k2, std::vector<int64_t>{1}));
  HostRegion back(a.spec);
  expect_all_ok(svc_->load(back.access(), ns_, k2, std::vector<int64_t>{1}));
  EXPECT_EQ(back.block(1), a.block(0));
  // Unsupported pair and mismatched shapes are per-block errors.
  HostRegion f8({2, 2, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  auto kb = keys(1, 902);
  HostRegion bf({2, 2, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  fill(bf, 9);
  expect_all_ok(svc_->save(bf.access(), ns_, kb, std::vector<int64_t>{0}));
  auto un = svc_->load(f8.access(), ns_, kb, std::vector<int64_t>{0});
  EXPECT_EQ(un[0].code(), ErrorCode::kUnsupported);
  EXPECT_NE(un[0].message().find("mla_bf16"), std::string::npos) << un[0].message();
  HostRegion other({3, 2, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  EXPECT_EQ(svc_->load(other.access(), ns_, kb, std::vector<int64_t>{0})[0].code(), ErrorCode::kInvalidArgument);
}

TEST_F(OffloadTest, LossyDowngradeIsReported) {
  HostRegion ds({1, 2, 16, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor});
  fill(ds, 10);
  const float two = 2.0f;  // a tile scale other than 1.0 cannot be expressed in the 576 B format
  std::memcpy(ds.bytes.data() + 512, &two, 4);
  auto k = keys(1, 77);
  expect_all_ok(svc_->save(ds.access(), ns_, k, std::vector<int64_t>{0}));
  HostRegion f8({1, 2, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  auto st = svc_->load(f8.access(), ns_, k, std::vector<int64_t>{0});
  EXPECT_EQ(st[0].code(), ErrorCode::kDataLoss) << st[0].to_string();
}

// Sub-batches of one block each: the verify/copy pipeline still stops exactly the damaged block.
TEST_F(OffloadTest, PipelinedSubBatchesRoundTripAndStopADamagedBlock) {
  OffloadService::Options so;
  so.pipeline_bytes = 1;  // sub-batches of one block per hashing thread: 4 blocks
  so.hash_threads = 3;
  make(64 << 20, 1 << 20, so);
  HostRegion r({2, 32, 64, EntryFormat::mla_fp8(), Layout::kLayerMajor});
  fill(r, 21);
  auto k = keys(16);
  std::vector<int64_t> from(16), to(16);
  std::iota(from.begin(), from.end(), 0);
  std::iota(to.begin(), to.end(), 16);
  expect_all_ok(svc_->save(r.access(), ns_, k, from));
  ASSERT_TRUE(index_->corrupt_for_test(NsKey{ns_, k[9]}, 77).ok());
  const auto untouched = r.block(25);
  auto st = svc_->load(r.access(), ns_, k, to);
  for (int i = 0; i < 16; ++i) {
    if (i == 9) {
      EXPECT_EQ(st[i].code(), ErrorCode::kChecksumMismatch);
      EXPECT_EQ(r.block(to[i]), untouched) << "damaged bytes must never reach the region";
    } else {
      ASSERT_TRUE(st[i].ok()) << i << ": " << st[i].to_string();
      EXPECT_EQ(r.block(to[i]), r.block(from[i])) << "block " << i;
    }
  }
  EXPECT_NE(metrics_.render().find("kvferry_transfer_phase_microseconds_total{op=\"load\",phase=\"total\"}"),
            std::string::npos);
}

TEST_F(OffloadTest, ASaveQueuedPastItsDeadlineStoresNothing) {
  HostRegion r({2, 8, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  fill(r, 30);
  auto k = keys(4);
  auto st = svc_->save(r.access(), ns_, k, std::vector<int64_t>{0, 1, 2, 3},
                       OffloadService::Clock::now() - std::chrono::milliseconds(1));
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), ErrorCode::kTimeout);
    EXPECT_NE(s.message().find("limits.request_timeout"), std::string::npos) << s.message();
  }
  const auto stats = index_->stats();
  EXPECT_EQ(stats.entries, 0u);
  EXPECT_EQ(stats.writing, 0u);
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_NE(metrics_.render().find("kvferry_transfer_timeouts_total 4"), std::string::npos);
}

TEST_F(OffloadTest, ADeadlineMidSaveCommitsTheFinishedSubBatchesOnly) {
  OffloadService::Options so;
  so.pipeline_bytes = 1;
  so.hash_threads = 0;                            // one block per sub-batch
  so.test_delay = std::chrono::milliseconds(50);  // before each sub-batch
  make(64 << 20, 1 << 20, so);
  HostRegion r({2, 8, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  fill(r, 31);
  auto k = keys(6);
  auto st = svc_->save(r.access(), ns_, k, std::vector<int64_t>{0, 1, 2, 3, 4, 5},
                       OffloadService::Clock::now() + std::chrono::milliseconds(120));
  EXPECT_TRUE(st[0].ok()) << st[0].to_string();
  EXPECT_EQ(st[5].code(), ErrorCode::kTimeout);
  const auto present = index_->lookup(ns_, k).present;
  bool timed_out = false;
  for (int i = 0; i < 6; ++i) {
    if (!st[i].ok()) {
      EXPECT_EQ(st[i].code(), ErrorCode::kTimeout) << i;
      timed_out = true;
    } else {
      EXPECT_FALSE(timed_out) << "block " << i << " ok after a timed-out one";
    }
    EXPECT_EQ(present[i], st[i].ok() ? 1 : 0) << "block " << i << ": visible exactly when saved";
  }
  EXPECT_EQ(index_->stats().writing, 0u) << "no half-written block is left reserved";
  // What was saved loads back intact.
  expect_all_ok(svc_->load(r.access(), ns_, std::span<const BlockKey>(k.data(), 1), std::vector<int64_t>{7}));
  EXPECT_EQ(r.block(7), r.block(0));
}

TEST_F(OffloadTest, ALoadPastItsDeadlineWritesNothingAndKeepsTheBlocks) {
  HostRegion r({2, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(r, 32);
  auto k = keys(3);
  expect_all_ok(svc_->save(r.access(), ns_, k, std::vector<int64_t>{0, 1, 2}));
  const auto before = r.bytes;
  auto st = svc_->load(r.access(), ns_, k, std::vector<int64_t>{5, 6, 7},
                       OffloadService::Clock::now() - std::chrono::milliseconds(1));
  for (const Status& s : st) EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
  EXPECT_EQ(r.bytes, before) << "no target block was written";
  EXPECT_EQ(index_->lookup(ns_, k).prefix, 3u);
  EXPECT_EQ(index_->evict(ns_, k), 3u) << "the load released its holds";
}

TEST_F(OffloadTest, VerifyOnLoadCanBeSwitchedAtRunTime) {
  HostRegion r({1, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  fill(r, 33);
  auto k = keys(1);
  expect_all_ok(svc_->save(r.access(), ns_, k, std::vector<int64_t>{0}));
  ASSERT_TRUE(index_->corrupt_for_test(NsKey{ns_, k[0]}, 3).ok());
  svc_->set_verify_on_load(false);
  expect_all_ok(svc_->load(r.access(), ns_, k, std::vector<int64_t>{1}));
  EXPECT_NE(r.block(1), r.block(0)) << "unverified: the damaged copy went through";
  svc_->set_verify_on_load(true);
  EXPECT_EQ(svc_->load(r.access(), ns_, k, std::vector<int64_t>{2})[0].code(), ErrorCode::kChecksumMismatch);
}

TEST(FormatFamily, MlaFormatsShareAFamily) {
  EXPECT_EQ(format_family(EntryFormat::mla_fp8()), "mla");
  EXPECT_EQ(format_family(EntryFormat::mla_fp8_ds()), "mla");
  EXPECT_EQ(format_family(EntryFormat::mla_bf16()), "mla");
  EXPECT_EQ(format_family(EntryFormat::mha(8, 128, DType::kBF16)), "mha:bf16:8x128");
  // Tensor-parallel ranks and both head layouts of one model share blocks (loads map between them).
  EXPECT_EQ(format_family(*EntryFormat::parse("mha:bf16:2x128:hnd:slice=6/8")), "mha:bf16:8x128");
}

}  // namespace
}  // namespace kvferry::store
