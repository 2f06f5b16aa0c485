// OffloadService::load_mapped (issue 40): loads across page sizes, tensor-parallel head slices,
// NHD/HND and MLA format conversions, checked token row by token row against the saved region,
// and the all-or-nothing rule of a region block.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvferry/kernels/convert.h"
#include "kvferry/layouts/geometry.h"
#include "kvferry/store/offload.h"

namespace kvferry::store {
namespace {

struct HostRegion {
  explicit HostRegion(KvCacheSpec s, uint32_t seed = 0) : spec(s), bytes(static_cast<size_t>(s.region_bytes())) {
    std::mt19937 rng(seed);
    if (s.format.kind == FormatKind::kMlaFp8) {
      for (auto& b : bytes) b = static_cast<uint8_t>(rng() % 0x7E) | (rng() & 0x80);  // finite e4m3
    } else {
      for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    }
  }
  RegionAccess access() { return {bytes.data(), spec, false}; }
  // The bytes of (layer, block, plane, token, head): one MHA head's row, or an MLA entry.
  std::vector<uint8_t> row(int64_t l, int64_t b, int plane, int64_t t, int32_t head) const {
    const auto& f = spec.format;
    int64_t off = spec.page_offset(l, b), w = f.bytes_per_token();
    if (f.kind == FormatKind::kMha) {
      w = int64_t{f.head_dim} * dtype_size(f.dtype);
      const int64_t h = head - f.head_first;
      off += plane * spec.block_size * f.heads * w +
             (f.order == MhaOrder::kNHD ? (t * f.heads + h) * w : (h * spec.block_size + t) * w);
    } else {
      off += t * w;
    }
    return {bytes.begin() + off, bytes.begin() + off + w};
  }
  KvCacheSpec spec;
  std::vector<uint8_t> bytes;
};

class MappedLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostPool::Options o;
    o.capacity = 64 << 20;
    o.chunk_bytes = 1 << 20;
    o.pin = false;
    pool_ = std::move(HostPool::create(o)).value();
    index_ = std::make_unique<BlockIndex>(*pool_, BlockIndex::Options{});
    auto s = OffloadService::create(*index_, metrics_, {});
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    svc_ = std::move(s).value();
    ns_ = index_->intern_namespace("m|fam|t");
  }
  static std::vector<BlockKey> keys(int n, uint64_t salt) {
    std::vector<BlockKey> k;
    for (int i = 0; i < n; ++i) k.push_back({salt, static_cast<uint64_t>(i) + 1});
    return k;
  }
  void save(HostRegion& r, const std::vector<BlockKey>& k) {
    std::vector<int64_t> ids(k.size());
    for (size_t i = 0; i < k.size(); ++i) ids[i] = static_cast<int64_t>(i);
    for (const Status& s : svc_->save(r.access(), ns_, k, ids)) ASSERT_TRUE(s.ok()) << s.to_string();
  }
  static void all_ok(const std::vector<Status>& st) {
    for (size_t i = 0; i < st.size(); ++i) ASSERT_TRUE(st[i].ok()) << "entry " << i << ": " << st[i].to_string();
  }
  Registry metrics_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<BlockIndex> index_;
  std::unique_ptr<OffloadService> svc_;
  NamespaceId ns_ = 0;
};

TEST_F(MappedLoadTest, LargePagesFillSeveralSmallOnesAndBack) {
  for (auto layout : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    HostRegion big({4, 2, 64, EntryFormat::mla_fp8(), layout}, 1);
    const auto k = keys(2, 10 + static_cast<int>(layout));
    save(big, k);
    // 64 -> 4 x 16: stored block s, part p into small block 4 s + p.
    HostRegion small(
        {4, 8, 16, EntryFormat::mla_fp8(), layout == Layout::kBlockMajor ? Layout::kLayerMajor : Layout::kBlockMajor});
    std::vector<BlockKey> mk;
    std::vector<int64_t> mb;
    std::vector<int32_t> mp;
    for (int s = 0; s < 2; ++s)
      for (int p = 0; p < 4; ++p) {
        mk.push_back(k[static_cast<size_t>(s)]);
        mb.push_back(4 * s + p);
        mp.push_back(p);
      }
    all_ok(svc_->load_mapped(small.access(), ns_, mk, mb, mp));
    for (int64_t l = 0; l < 4; ++l)
      for (int64_t t = 0; t < 128; ++t)
        ASSERT_EQ(small.row(l, t / 16, 0, t % 16, 0), big.row(l, t / 64, 0, t % 64, 0))
            << "layer " << l << " token " << t;
    // And back: save the small pages, fill a 64-token block from four of them.
    const auto sk = keys(8, 20 + static_cast<int>(layout));
    save(small, sk);
    HostRegion again({4, 2, 64, EntryFormat::mla_fp8(), layout}, 99);
    std::vector<BlockKey> bk(sk.begin() + 4, sk.end());
    all_ok(svc_->load_mapped(again.access(), ns_, bk, std::vector<int64_t>(4, 1), std::vector<int32_t>{0, 1, 2, 3}));
    for (int64_t l = 0; l < 4; ++l)
      for (int64_t t = 0; t < 64; ++t) ASSERT_EQ(again.row(l, 1, 0, t, 0), big.row(l, 1, 0, t, 0));
  }
}

TEST_F(MappedLoadTest, AMissingPartFailsTheWholeRegionBlockAndLeavesItUntouched) {
  HostRegion small({2, 8, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor}, 3);
  const auto k = keys(8, 30);
  save(small, k);
  HostRegion big({2, 2, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor}, 4);
  const auto before = big.bytes;
  std::vector<BlockKey> mk = k;
  mk[6] = BlockKey{777, 777};  // never saved: region block 1 loses its part 2
  std::vector<int64_t> mb{0, 0, 0, 0, 1, 1, 1, 1};
  std::vector<int32_t> mp{0, 1, 2, 3, 0, 1, 2, 3};
  const auto st = svc_->load_mapped(big.access(), ns_, mk, mb, mp);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(st[static_cast<size_t>(i)].ok()) << st[static_cast<size_t>(i)].to_string();
  for (int i = 4; i < 8; ++i) {
    EXPECT_EQ(st[static_cast<size_t>(i)].code(), ErrorCode::kNotFound) << st[static_cast<size_t>(i)].to_string();
    EXPECT_NE(st[static_cast<size_t>(i)].message().find("region block 1"), std::string::npos);
  }
  const int64_t bb = big.spec.block_bytes();
  EXPECT_TRUE(std::equal(before.begin() + bb, before.end(), big.bytes.begin() + bb)) << "region block 1 was written";
  for (int64_t t = 0; t < 64; ++t) ASSERT_EQ(big.row(1, 0, 0, t, 0), small.row(1, t / 16, 0, t % 16, 0));
}

TEST_F(MappedLoadTest, TensorParallelSlicesBothWaysWithHeadLayouts) {
  const int32_t H = 8, D = 32;
  const auto full_f = EntryFormat::mha(H, D, DType::kBF16, MhaOrder::kNHD);
  HostRegion full({3, 2, 16, full_f, Layout::kBlockMajor}, 5);
  const auto fk = keys(2, 40);
  save(full, fk);
  // TP 1 -> 2: each rank (HND, layer-major) loads its slice with a plain load, block for block.
  for (int r = 0; r < 2; ++r) {
    HostRegion rank(
        {3, 2, 16, EntryFormat::mha_slice(4, D, DType::kBF16, MhaOrder::kHND, 4 * r, H), Layout::kLayerMajor});
    all_ok(svc_->load(rank.access(), ns_, fk, std::vector<int64_t>{1, 0}));
    for (int64_t l = 0; l < 3; ++l)
      for (int pl = 0; pl < 2; ++pl)
        for (int64_t t = 0; t < 16; ++t)
          for (int32_t h = 4 * r; h < 4 * r + 4; ++h) ASSERT_EQ(rank.row(l, 1, pl, t, h), full.row(l, 0, pl, t, h));
  }
  // TP 4 -> 1: four ranks save their slices under their own keys; a full region assembles a block
  // from the four (and 64-token pages from 16-token slices at once).
  std::vector<HostRegion> ranks;
  std::vector<std::vector<BlockKey>> rk;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back(KvCacheSpec{3, 4, 16, EntryFormat::mha_slice(2, D, DType::kBF16, MhaOrder::kNHD, 2 * r, H),
                                   Layout::kBlockMajor},
                       60 + r);
    rk.push_back(keys(4, 50 + r));
    save(ranks.back(), rk.back());
  }
  HostRegion out({3, 1, 64, EntryFormat::mha(H, D, DType::kBF16, MhaOrder::kHND), Layout::kBlockMajor}, 9);
  std::vector<BlockKey> mk;
  std::vector<int32_t> mp;
  for (int r = 0; r < 4; ++r)
    for (int p = 0; p < 4; ++p) {
      mk.push_back(rk[static_cast<size_t>(r)][static_cast<size_t>(p)]);
      mp.push_back(p);
    }
  all_ok(svc_->load_mapped(out.access(), ns_, mk, std::vector<int64_t>(16, 0), mp));
  for (int64_t l = 0; l < 3; ++l)
    for (int pl = 0; pl < 2; ++pl)
      for (int64_t t = 0; t < 64; ++t)
        for (int32_t h = 0; h < H; ++h)
          ASSERT_EQ(out.row(l, 0, pl, t, h), ranks[static_cast<size_t>(h / 2)].row(l, t / 16, pl, t % 16, h));
  // Three of the four slices: the heads of the fourth are not covered, nothing is written.
  HostRegion gap({3, 1, 64, EntryFormat::mha(H, D, DType::kBF16, MhaOrder::kHND), Layout::kBlockMajor}, 9);
  const auto before = gap.bytes;
  const auto st = svc_->load_mapped(gap.access(), ns_, std::span(mk).first(12), std::vector<int64_t>(12, 0),
                                    std::span(mp).first(12));
  EXPECT_EQ(st[0].code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st[0].message().find("fills 384 of its 512 token-heads"), std::string::npos) << st[0].to_string();
  EXPECT_EQ(gap.bytes, before);
}

TEST_F(MappedLoadTest, PageMapWithFormatConversion) {
  // 64-token mla_fp8 blocks into 16-token mla_fp8_ds (or mla_fp4) pages: the same bytes as
  // converting the 64-token block whole and taking its rows (fp4: the value and scale planes).
  HostRegion big({2, 1, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor}, 11);
  const auto k = keys(1, 70);
  save(big, k);
  for (auto to : {EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp4()}) {
    SCOPED_TRACE(to.name());
    HostRegion ds({2, 4, 16, to, Layout::kLayerMajor}, 12);
    all_ok(svc_->load_mapped(ds.access(), ns_, std::vector<BlockKey>(4, k[0]), std::vector<int64_t>{3, 2, 1, 0},
                             std::vector<int32_t>{0, 1, 2, 3}));
    HostRegion whole({2, 1, 64, to, Layout::kBlockMajor});
    const int64_t zero = 0;
    ASSERT_TRUE(
        kernels::convert_blocks_cpu(big.bytes.data(), big.spec, {&zero, 1}, whole.bytes.data(), whole.spec, {&zero, 1})
            .ok());
    const bool fp4 = to.kind == FormatKind::kMlaFp4;
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t t = 0; t < 64; ++t) {
        if (!fp4) {
          ASSERT_EQ(ds.row(l, 3 - t / 16, 0, t % 16, 0), whole.row(l, 0, 0, t, 0));
          continue;
        }
        for (int plane = 0; plane < 2; ++plane) {  // values [BS x 288], then scales [BS x 36]
          const int64_t w = plane == 0 ? 288 : 36;
          const uint8_t* got = ds.bytes.data() + ds.spec.page_offset(l, 3 - t / 16) + plane * 16 * 288 + (t % 16) * w;
          const uint8_t* want = whole.bytes.data() + whole.spec.page_offset(l, 0) + plane * 64 * 288 + t * w;
          ASSERT_EQ(0, std::memcmp(got, want, static_cast<size_t>(w))) << "layer " << l << " token " << t;
        }
      }
  }
}

TEST_F(MappedLoadTest, BadMapsAreRefusedWithBothGeometriesNamed) {
  HostRegion a({4, 2, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor}, 13);
  const auto k = keys(2, 80);
  save(a, k);
  HostRegion five({5, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  auto st = svc_->load_mapped(five.access(), ns_, std::vector<BlockKey>{k[0]}, std::vector<int64_t>{0},
                              std::vector<int32_t>{0});
  EXPECT_EQ(st[0].code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st[0].message().find("mla_fp8, 4 layers x 64 tokens"), std::string::npos) << st[0].to_string();
  EXPECT_NE(st[0].message().find("mla_fp8, 5 layers x 16 tokens"), std::string::npos) << st[0].to_string();
  HostRegion small({4, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  st = svc_->load_mapped(small.access(), ns_, std::vector<BlockKey>{k[0], k[0]}, std::vector<int64_t>{0, 1},
                         std::vector<int32_t>{4, 0});
  EXPECT_EQ(st[0].code(), ErrorCode::kOutOfRange) << st[0].to_string();
  EXPECT_TRUE(st[1].ok()) << st[1].to_string();
  HostRegion big({4, 1, 128, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  st = svc_->load_mapped(big.access(), ns_, std::vector<BlockKey>{k[0], k[0]}, std::vector<int64_t>{0, 0},
                         std::vector<int32_t>{0, 0});
  EXPECT_EQ(st[0].code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st[1].message().find("overlaps"), std::string::npos) << st[1].to_string();
  HostRegion mha({4, 4, 16, EntryFormat::mha(8, 64, DType::kBF16), Layout::kBlockMajor});
  st = svc_->load_mapped(mha.access(), ns_, std::vector<BlockKey>{k[0]}, std::vector<int64_t>{0},
                         std::vector<int32_t>{0});
  EXPECT_EQ(st[0].code(), ErrorCode::kUnsupported) << st[0].to_string();
  // A plain load across page sizes says how to do it.
  st = svc_->load(small.access(), ns_, std::vector<BlockKey>{k[0]}, std::vector<int64_t>{0});
  EXPECT_NE(st[0].message().find("mapped load"), std::string::npos) << st[0].to_string();
}

TEST_F(MappedLoadTest, ADamagedStoredBlockFailsEveryRegionBlockItFeedsAndIsDropped) {
  HostRegion a({2, 1, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor}, 15);
  const auto k = keys(1, 90);
  save(a, k);
  auto h = index_->acquire(NsKey{ns_, k[0]});
  ASSERT_TRUE(h.ok());
  h->data[100] ^= 0x40;
  index_->release(*h);
  HostRegion small({2, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor}, 16);
  const auto before = small.bytes;
  const auto st = svc_->load_mapped(small.access(), ns_, std::vector<BlockKey>(4, k[0]),
                                    std::vector<int64_t>{0, 1, 2, 3}, std::vector<int32_t>{0, 1, 2, 3});
  for (const Status& s : st) EXPECT_EQ(s.code(), ErrorCode::kChecksumMismatch) << s.to_string();
  EXPECT_EQ(small.bytes, before);
  EXPECT_FALSE(index_->acquire(NsKey{ns_, k[0]}).ok()) << "the damaged block is still served";
}

}  // namespace
}  // namespace kvferry::store
