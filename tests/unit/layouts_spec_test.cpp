#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kvferry/layouts/layouts.h"

namespace kvferry {
namespace {

TEST(EntryFormat, SizesAndOffsetsMatchTheSpecTables) {
  EXPECT_EQ(EntryFormat::mla_bf16().bytes_per_token(), 1152);
  EXPECT_EQ(EntryFormat::mla_fp8().bytes_per_token(), 576);
  EXPECT_EQ(EntryFormat::mla_fp8_ds().bytes_per_token(), 656);
  EXPECT_EQ(EntryFormat::indexer_fp8().bytes_per_token(), 132);
  const MlaFields ds = EntryFormat::mla_fp8_ds().mla_fields();
  EXPECT_EQ(ds.nope_offset, 0);
  EXPECT_EQ(ds.nope_bytes, 512);
  EXPECT_EQ(ds.scale_offset, 512);
  EXPECT_EQ(ds.scale_bytes, 16);
  EXPECT_EQ(ds.rope_offset, 528);
  EXPECT_EQ(ds.rope_bytes, 128);
  EXPECT_EQ(ds.rope_offset + ds.rope_bytes, 656);
  const MlaFields bf = EntryFormat::mla_bf16().mla_fields();
  EXPECT_EQ(bf.rope_offset, 1024);
  EXPECT_EQ(bf.rope_offset + bf.rope_bytes, 1152);
  const MlaFields f8 = EntryFormat::mla_fp8().mla_fields();
  EXPECT_EQ(f8.rope_offset, 512);
  EXPECT_EQ(f8.scale_bytes, 0);
  const EntryFormat f4 = EntryFormat::mla_fp4();
  EXPECT_EQ(f4.bytes_per_token(), 288 + 36);
  EXPECT_EQ(f4.entry_elems(), 324);
  EXPECT_EQ(f4.dtype, DType::kU8);
  EXPECT_EQ(f4.alignment(), 4);
  EXPECT_TRUE(f4.is_mla());
  EXPECT_FALSE(EntryFormat::indexer_fp8().is_mla());
  // mla_fp4's fields are ranges of the token's value row; its scales live in the scale plane.
  const MlaFields fp4 = f4.mla_fields();
  EXPECT_EQ(fp4.nope_offset, 0);
  EXPECT_EQ(fp4.nope_bytes, 256);
  EXPECT_EQ(fp4.scale_bytes, 0);
  EXPECT_EQ(fp4.rope_offset, 256);
  EXPECT_EQ(fp4.rope_offset + fp4.rope_bytes, kMlaFp4ValueBytes);
  EXPECT_EQ(EntryFormat::mha(8, 128, DType::kBF16).bytes_per_token(), 2 * 8 * 128 * 2);
  EXPECT_EQ(EntryFormat::mha(8, 128, DType::kFP8E4M3, MhaOrder::kHND).bytes_per_token(), 2 * 8 * 128);
}

TEST(EntryFormat, NamesParseBack) {
  for (const EntryFormat& f :
       {EntryFormat::mla_bf16(), EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds(), EntryFormat::indexer_fp8(),
        EntryFormat::mla_fp4(), EntryFormat::mha(8, 128, DType::kBF16),
        EntryFormat::mha(32, 64, DType::kFP16, MhaOrder::kHND), EntryFormat::mha(1, 256, DType::kFP8E4M3)}) {
    auto p = EntryFormat::parse(f.name());
    ASSERT_TRUE(p.ok()) << f.name() << ": " << p.status().to_string();
    EXPECT_EQ(*p, f) << f.name();
    EXPECT_EQ(p->name(), f.name());
  }
  for (const char* bad : {"", "mla", "mha:", "mha:bf16", "mha:bf16:8x", "mha:int4:8x128", "mha:bf16:0x128",
                          "mha:bf16:8x128:xyz", "mla_fp8_ds ", "mla_fp4x", "MLA_FP4"}) {
    auto p = EntryFormat::parse(bad);
    EXPECT_FALSE(p.ok()) << "'" << bad << "' parsed";
  }
  EXPECT_NE(EntryFormat::parse("mla_fp9").status().message().find("mla_fp9"), std::string::npos);
  EXPECT_NE(EntryFormat::parse("mla_fp9").status().message().find("mla_fp4"), std::string::npos);
  EXPECT_NE(EntryFormat::mla_fp4(), EntryFormat::mla_fp8());
  EXPECT_EQ(EntryFormat::parse("mla_fp4")->kind, FormatKind::kMlaFp4);
}

// The specs the property tests run over: every format, both layouts, L in {1,2,3,61}.
std::vector<KvCacheSpec> spec_table() {
  std::vector<KvCacheSpec> out;
  const EntryFormat fmts[] = {EntryFormat::mla_bf16(),
                              EntryFormat::mla_fp8(),
                              EntryFormat::mla_fp8_ds(),
                              EntryFormat::indexer_fp8(),
                              EntryFormat::mla_fp4(),
                              EntryFormat::mha(4, 64, DType::kBF16),
                              EntryFormat::mha(2, 128, DType::kFP8E4M3, MhaOrder::kHND)};
  for (const EntryFormat& f : fmts)
    for (int64_t L : {1, 2, 3, 61})
      for (Layout lay : {Layout::kBlockMajor, Layout::kLayerMajor})
        for (int64_t nb : {1, 7}) out.push_back({L, nb, f.kind == FormatKind::kMha ? 16 : 64, f, lay});
  return out;
}

std::string describe(const KvCacheSpec& s) {
  return s.format.name() + " L=" + std::to_string(s.layers) + " NB=" + std::to_string(s.blocks) +
         (s.layout == Layout::kBlockMajor ? " block_major" : " layer_major");
}

TEST(KvCacheSpec, EveryViewCoordinateMapsToTheFormulaByte) {
  for (const KvCacheSpec& s : spec_table()) {
    ASSERT_TRUE(s.validate().ok()) << describe(s);
    const int64_t page = s.page_bytes();
    const int64_t bpt = s.format.bytes_per_token();
    for (int64_t l : {int64_t{0}, s.layers / 2, s.layers - 1}) {
      for (int64_t b = 0; b < s.blocks; ++b) {
        // The formula: block-major (b*L + l)*page; layer-major (l*NB + b)*page.
        const int64_t base = s.layout == Layout::kBlockMajor ? (b * s.layers + l) * page : (l * s.blocks + b) * page;
        if (s.format.kind == FormatKind::kMha) {
          const int64_t H = s.format.heads, D = s.format.head_dim, eb = dtype_size(s.format.dtype);
          const TensorView k = s.kv_view(l, false), v = s.kv_view(l, true);
          ASSERT_TRUE(k.validate(s.region_bytes()).ok()) << describe(s);
          ASSERT_TRUE(v.validate(s.region_bytes()).ok()) << describe(s);
          for (int64_t t : {int64_t{0}, s.block_size - 1})
            for (int64_t h : {int64_t{0}, H - 1})
              for (int64_t d : {int64_t{0}, D - 1}) {
                const int64_t in_plane =
                    s.format.order == MhaOrder::kNHD ? (t * H + h) * D + d : (h * s.block_size + t) * D + d;
                ASSERT_EQ(k.offset_at(b, t, h, d), base + in_plane * eb) << describe(s);
                ASSERT_EQ(v.offset_at(b, t, h, d), base + page / 2 + in_plane * eb) << describe(s);
              }
        } else {
          const TensorView v = s.layer_view(l);
          ASSERT_TRUE(v.validate(s.region_bytes()).ok()) << describe(s) << " " << v.to_string();
          const int64_t eb = dtype_size(s.format.dtype);
          for (int64_t t : {int64_t{0}, int64_t{1}, s.block_size - 1})
            for (int64_t e : {int64_t{0}, s.format.entry_elems() - 1})
              ASSERT_EQ(v.offset_at(b, t, e), base + t * bpt + e * eb) << describe(s);
          if (s.format.kind == FormatKind::kMlaFp4) {
            const TensorView val = s.mla_fp4_values_view(l), sc = s.mla_fp4_scales_view(l);
            ASSERT_TRUE(val.validate(s.region_bytes(), 4).ok()) << describe(s);
            ASSERT_TRUE(sc.validate(s.region_bytes(), 4).ok()) << describe(s);
            for (int64_t t : {int64_t{0}, int64_t{1}, s.block_size - 1}) {
              for (int64_t e : {int64_t{0}, int64_t{kMlaFp4ValueBytes - 1}})
                ASSERT_EQ(val.offset_at(b, t, e), base + t * kMlaFp4ValueBytes + e) << describe(s);
              for (int64_t e : {int64_t{0}, int64_t{kMlaFp4ScaleBytes - 1}})
                ASSERT_EQ(sc.offset_at(b, t, e), base + s.block_size * kMlaFp4ValueBytes + t * kMlaFp4ScaleBytes + e)
                    << describe(s);
            }
          }
        }
      }
    }
  }
}

// The two mla_fp4 planes of every layer's page tile it exactly: each byte of the region belongs to
// exactly one (layer, block, token, byte) of exactly one plane, for any block size.
TEST(KvCacheSpec, MlaFp4PlanesTileEveryPage) {
  for (Layout lay : {Layout::kBlockMajor, Layout::kLayerMajor})
    for (int64_t bs : {1, 3, 64})
      for (int64_t L : {1, 3}) {
        KvCacheSpec s{L, 5, bs, EntryFormat::mla_fp4(), lay};
        ASSERT_TRUE(s.validate().ok());
        std::vector<int> hits(static_cast<size_t>(s.region_bytes()), 0);
        for (int64_t l = 0; l < L; ++l) {
          const TensorView planes[] = {s.mla_fp4_values_view(l), s.mla_fp4_scales_view(l)};
          for (const TensorView& v : planes) {
            ASSERT_EQ(v.dtype, DType::kU8);
            ASSERT_EQ(v.stride(0), s.block_stride_bytes());
            ASSERT_TRUE(v.validate(s.region_bytes(), 4).ok()) << v.to_string();
            for (int64_t b = 0; b < s.blocks; ++b)
              for (int64_t t = 0; t < bs; ++t)
                for (int64_t e = 0; e < v.size(2); ++e) ++hits[static_cast<size_t>(v.offset_at(b, t, e))];
          }
        }
        for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "byte " << i << " bs " << bs;
      }
  KvCacheSpec s{3, 32, 64, EntryFormat::mla_fp4(), Layout::kBlockMajor};
  EXPECT_EQ(s.mla_fp4_values_view(1).to_string(), "(32,64,288):(62208,288,1)+20736B");
  EXPECT_EQ(s.mla_fp4_scales_view(1).to_string(), "(32,64,36):(62208,36,1)+39168B");
  s.layout = Layout::kLayerMajor;
  EXPECT_EQ(s.mla_fp4_scales_view(2).to_string(), "(32,64,36):(20736,36,1)+1345536B");
}

TEST(KvCacheSpec, BlockMajorViewHasInflatedBlockStride) {
  KvCacheSpec s{3, 32, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  const TensorView v = s.layer_view(1);
  EXPECT_EQ(v.to_string(), "(32,64,576):(110592,576,1)+73728B");
  EXPECT_EQ(v.stride(0), 3 * 64 * 576);
  EXPECT_EQ(v.offset, 64 * 576 * 2);
  KvCacheSpec lm = s;
  lm.layout = Layout::kLayerMajor;
  EXPECT_EQ(lm.layer_view(0).to_string(), "(32,64,576):(36864,576,1)");
}

// Coalesced runs cover exactly the blocks' bytes, do not overlap and leave no mergeable neighbours.
void check_coalesce(const KvCacheSpec& s, const std::vector<int64_t>& blocks) {
  auto runs = s.coalesce(blocks);
  ASSERT_TRUE(runs.ok()) << runs.status().to_string();
  std::set<int64_t> want;  // page-granular coverage
  for (int64_t b : blocks)
    for (int64_t l = 0; l < s.layers; ++l) want.insert(s.page_offset(l, b));
  std::set<int64_t> got;
  for (size_t i = 0; i < runs->size(); ++i) {
    const ByteRun& r = (*runs)[i];
    ASSERT_GT(r.bytes, 0);
    ASSERT_EQ(r.offset % s.page_bytes(), 0);
    ASSERT_EQ(r.bytes % s.page_bytes(), 0);
    if (i > 0) {
      ASSERT_GT(r.offset, (*runs)[i - 1].offset + (*runs)[i - 1].bytes) << "overlapping or mergeable runs";
    }
    for (int64_t o = r.offset; o < r.offset + r.bytes; o += s.page_bytes()) ASSERT_TRUE(got.insert(o).second);
  }
  EXPECT_EQ(got, want) << describe(s);
}

TEST(KvCacheSpec, CoalesceCoversExactlyTheBlocks) {
  std::mt19937 rng(3);
  for (KvCacheSpec s : spec_table()) {
    s.blocks = 40;
    check_coalesce(s, {});
    check_coalesce(s, {0});
    check_coalesce(s, {s.blocks - 1});
    std::vector<int64_t> all(static_cast<size_t>(s.blocks));
    std::iota(all.begin(), all.end(), 0);
    check_coalesce(s, all);
    std::shuffle(all.begin(), all.end(), rng);
    check_coalesce(s, std::vector<int64_t>(all.begin(), all.begin() + 13));
    check_coalesce(s, {5, 3, 4, 4, 9, 10});  // unsorted, duplicate
  }
}

TEST(KvCacheSpec, CoalesceMergesAdjacentBlockMajorBlocksOnly) {
  KvCacheSpec s{61, 100, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  auto runs = s.coalesce(std::vector<int64_t>{7, 5, 6, 9});
  ASSERT_TRUE(runs.ok());
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[0], (ByteRun{5 * s.block_bytes(), 3 * s.block_bytes()}));
  EXPECT_EQ((*runs)[1], (ByteRun{9 * s.block_bytes(), s.block_bytes()}));
  s.layout = Layout::kLayerMajor;
  auto lr = s.block_runs(3);
  ASSERT_TRUE(lr.ok());
  EXPECT_EQ(lr->size(), 61u);  // one run per layer
  auto lm = s.coalesce(std::vector<int64_t>{5, 6});
  ASSERT_TRUE(lm.ok());
  EXPECT_EQ(lm->size(), 61u);  // blocks 5 and 6 of one layer merge; layers stay apart
  EXPECT_EQ((*lm)[0].bytes, 2 * s.page_bytes());
}

TEST(KvCacheSpec, OffsetsBeyond4GiB) {
  // 61 layers x 4096 blocks x 64 tokens x 656 B = 10.5 GB: offsets far beyond 2^32.
  KvCacheSpec s{61, 4096, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  ASSERT_TRUE(s.validate().ok());
  EXPECT_GT(s.region_bytes(), int64_t{1} << 33);
  const TensorView v = s.layer_view(60);
  ASSERT_TRUE(v.validate(s.region_bytes()).ok());
  const int64_t b = 4095, t = 63, e = 655;
  EXPECT_EQ(v.offset_at(b, t, e), (b * 61 + 60) * 64 * 656 + t * 656 + e);
  EXPECT_EQ(v.offset_at(b, t, e), s.region_bytes() - 1);
  auto runs = s.block_runs(b);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ((*runs)[0].offset + (*runs)[0].bytes, s.region_bytes());
}

TEST(KvCacheSpec, ZeroBlocks) {
  KvCacheSpec s{3, 0, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  ASSERT_TRUE(s.validate().ok());
  EXPECT_EQ(s.region_bytes(), 0);
  EXPECT_TRUE(s.layer_view(0).validate(0).ok());
  auto runs = s.coalesce({});
  ASSERT_TRUE(runs.ok());
  EXPECT_TRUE(runs->empty());
  EXPECT_EQ(s.block_runs(0).status().code(), ErrorCode::kOutOfRange);
}

TEST(CopyPlan, PairsBlocksAndMergesWhereBothSidesAreContiguous) {
  KvCacheSpec region{4, 64, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  KvCacheSpec pool{4, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  auto plan = copy_plan(region, std::vector<int64_t>{10, 11, 12, 40}, pool, std::vector<int64_t>{2, 3, 7, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->size(), 3u);
  const int64_t bb = region.block_bytes();
  EXPECT_EQ((*plan)[0], (CopyRun{10 * bb, 2 * bb, 2 * bb}));
  EXPECT_EQ((*plan)[1], (CopyRun{12 * bb, 7 * bb, bb}));
  EXPECT_EQ((*plan)[2], (CopyRun{40 * bb, 0, bb}));
  // Layer-major source: L runs per block, each to its layer's place in the block-major slot.
  region.layout = Layout::kLayerMajor;
  auto lm = copy_plan(region, std::vector<int64_t>{5}, pool, std::vector<int64_t>{1});
  ASSERT_TRUE(lm.ok());
  ASSERT_EQ(lm->size(), 4u);
  for (int64_t l = 0; l < 4; ++l)
    EXPECT_EQ((*lm)[l],
              (CopyRun{(l * 64 + 5) * region.page_bytes(), bb + l * region.page_bytes(), region.page_bytes()}));
}

TEST(CopyPlan, ErrorsNameTheCulprit) {
  KvCacheSpec a{4, 64, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  KvCacheSpec b{4, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  auto e1 = copy_plan(a, std::vector<int64_t>{1, 2}, b, std::vector<int64_t>{1});
  EXPECT_EQ(e1.status().code(), ErrorCode::kInvalidArgument);
  auto e2 = copy_plan(a, std::vector<int64_t>{1}, b, std::vector<int64_t>{8});
  EXPECT_EQ(e2.status().code(), ErrorCode::kOutOfRange);
  EXPECT_NE(e2.status().message().find("destination: block 8"), std::string::npos) << e2.status().message();
  auto e3 = copy_plan(a, std::vector<int64_t>{-1}, b, std::vector<int64_t>{0});
  EXPECT_NE(e3.status().message().find("source: block -1"), std::string::npos) << e3.status().message();
  KvCacheSpec c{4, 8, 16, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  EXPECT_EQ(copy_plan(a, std::vector<int64_t>{1}, c, std::vector<int64_t>{1}).status().code(),
            ErrorCode::kInvalidArgument);
}

// ---- every validate() error, with the culprit named ----
void expect_error(const Status& s, ErrorCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << s.message() << "' lacks '" << needle << "'";
}

TEST(Validate, SpecErrors) {
  KvCacheSpec s{0, 4, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kInvalidArgument, "layers = 0");
  s = {2, -1, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kInvalidArgument, "blocks = -1");
  s = {2, 4, 0, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kInvalidArgument, "block_size = 0");
  s = {int64_t{1} << 40, int64_t{1} << 20, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kOverflow, "overflows int64");
  s = {2, 4, 16, EntryFormat::mha(0, 128, DType::kBF16), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kInvalidArgument, "heads 0");
  s = {2, 4, 16, EntryFormat::mha(8, 128, DType::kI32), Layout::kBlockMajor};
  expect_error(s.validate(), ErrorCode::kInvalidArgument, "mha dtype i32");
  s = {2, 4, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  expect_error(s.check_block(4), ErrorCode::kOutOfRange, "block 4 is out of range");
  expect_error(s.check_block(-1), ErrorCode::kOutOfRange, "block -1");
  expect_error(s.check_layer(2), ErrorCode::kOutOfRange, "layer 2 is out of range");
}

TEST(Validate, ViewErrors) {
  KvCacheSpec s{3, 8, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  const int64_t region = s.region_bytes();
  TensorView v = s.layer_view(2);
  ASSERT_TRUE(v.validate(region).ok());

  TensorView bad = v;
  bad.strides[2] = 2;
  expect_error(bad.validate(region), ErrorCode::kInvalidArgument, "stride(-1) = 2");
  bad = v;
  bad.offset += 1;  // bf16 view one byte off
  expect_error(bad.validate(region), ErrorCode::kMisaligned, "offset");
  bad = v;
  bad.strides[1] = 577;  // 1154 bytes: not a multiple of the 16-byte entry alignment
  expect_error(bad.validate(region, 16), ErrorCode::kMisaligned, "stride(1)");
  bad = v;
  bad.sizes[0] = 9;  // one block past the region
  expect_error(bad.validate(region), ErrorCode::kOutOfRange, "past the region");
  bad = v;
  bad.strides[0] = int64_t{1} << 62;
  expect_error(bad.validate(region), ErrorCode::kOverflow, "stride(0)");
  bad = v;
  bad.strides[0] = int64_t{1} << 60;
  bad.sizes[0] = 64;
  expect_error(bad.validate(region), ErrorCode::kOverflow, "int64");
  bad = v;
  bad.sizes[1] = -1;
  expect_error(bad.validate(region), ErrorCode::kInvalidArgument, "size(1) = -1");
  bad = v;
  bad.strides[0] = -5;
  expect_error(bad.validate(region), ErrorCode::kInvalidArgument, "stride(0) = -5");
  bad = v;
  bad.offset = -2;
  expect_error(bad.validate(region), ErrorCode::kOutOfRange, "negative");
  bad = v;
  bad.rank = 0;
  expect_error(bad.validate(region), ErrorCode::kInvalidArgument, "rank 0");
}

}  // namespace
}  // namespace kvferry
