// Geometry maps (layouts/geometry.h) against a per-token reference: over a table of geometries
// (pages 16/32/64/128 both ways, TP 1/2/4/8 slices both ways, NHD/HND, block- and layer-major),
// every token row of every head lands where a reference computed element by element puts it, and
// no other byte of the destination changes.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvferry/layouts/geometry.h"

namespace kvferry {
namespace {

// Reference: byte offset of (layer, block, plane, token, head) in a spec, element by element,
// written from the page layout (not from geometry.h): an MHA plane is [BS, H, D] (NHD) or
// [H, BS, D] (HND) of the heads the cache holds; other formats have token-major planes.
int64_t ref_offset(const KvCacheSpec& s, int64_t layer, int64_t block, int plane, int64_t token, int64_t head) {
  const int64_t page = s.layout == Layout::kBlockMajor ? (block * s.layers + layer) * s.page_bytes()
                                                       : (layer * s.blocks + block) * s.page_bytes();
  if (s.format.kind == FormatKind::kMha) {
    const int64_t hd = int64_t{s.format.head_dim} * dtype_size(s.format.dtype);
    const int64_t h = head - s.format.head_first, H = s.format.heads;
    const int64_t in_plane = s.format.order == MhaOrder::kNHD ? (token * H + h) * hd : (h * s.block_size + token) * hd;
    return page + plane * s.block_size * H * hd + in_plane;
  }
  if (s.format.kind == FormatKind::kIndexerFp8)
    return page + (plane == 0 ? token * 128 : s.block_size * 128 + token * 4);
  if (s.format.kind == FormatKind::kMlaFp4)  // 288 B of values per token, then 36 scale bytes per token
    return page + (plane == 0 ? token * 288 : s.block_size * 288 + token * 36);
  return page + token * s.format.bytes_per_token();
}
int64_t ref_width(const KvCacheSpec& s, int plane) {
  if (s.format.kind == FormatKind::kMha) return int64_t{s.format.head_dim} * dtype_size(s.format.dtype);
  if (s.format.kind == FormatKind::kIndexerFp8) return plane == 0 ? 128 : 4;
  if (s.format.kind == FormatKind::kMlaFp4) return plane == 0 ? 288 : 36;
  return s.format.bytes_per_token();
}

struct Case {
  EntryFormat src_fmt, dst_fmt;
  int64_t src_bs, dst_bs;
  Layout src_layout, dst_layout;
};

// Runs the map of every part between block 1 of `src` and blocks of `dst` and checks each byte.
void check_case(const Case& c) {
  SCOPED_TRACE(geometry_name(c.src_fmt, 3, c.src_bs) + " " + (c.src_layout == Layout::kBlockMajor ? "bm" : "lm") +
               " -> " + geometry_name(c.dst_fmt, 3, c.dst_bs) + " " +
               (c.dst_layout == Layout::kBlockMajor ? "bm" : "lm"));
  const KvCacheSpec src{3, 3, c.src_bs, c.src_fmt, c.src_layout};
  const KvCacheSpec dst{3, 10, c.dst_bs, c.dst_fmt, c.dst_layout};
  std::vector<uint8_t> s(static_cast<size_t>(src.region_bytes())), d(static_cast<size_t>(dst.region_bytes()));
  std::mt19937 rng(7);
  for (auto& b : s) b = static_cast<uint8_t>(rng());
  for (auto& b : d) b = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> d0 = d;
  const int64_t parts = c.src_bs >= c.dst_bs ? c.src_bs / c.dst_bs : c.dst_bs / c.src_bs;
  // Part p goes to destination block 1 + p (stored blocks larger) or into block 2 (smaller).
  std::vector<uint8_t> expect_written(d.size(), 0);
  std::vector<uint8_t> expect = d0;
  const int planes = c.src_fmt.kind == FormatKind::kMha || c.src_fmt.kind == FormatKind::kIndexerFp8 ||
                             c.src_fmt.kind == FormatKind::kMlaFp4
                         ? 2
                         : 1;
  const bool mha = c.src_fmt.kind == FormatKind::kMha;
  const int32_t h0 = mha ? std::max(c.src_fmt.head_first, c.dst_fmt.head_first) : 0;
  const int32_t h1 = mha ? std::min(c.src_fmt.head_first + c.src_fmt.heads, c.dst_fmt.head_first + c.dst_fmt.heads) : 1;
  for (int64_t p = 0; p < parts; ++p) {
    auto span = token_span(c.src_bs, c.dst_bs, p);
    ASSERT_TRUE(span.ok()) << span.status().to_string();
    const int64_t db = c.src_bs >= c.dst_bs ? 1 + p : 2;
    std::vector<CopyRun> runs;
    ASSERT_TRUE(push_token_runs(&runs, src, 1, span->src_token, dst, db, span->dst_token, span->tokens).ok());
    for (const CopyRun& r : runs) {
      ASSERT_GE(r.src, 0);
      ASSERT_LE(r.src + r.bytes, src.region_bytes());
      ASSERT_GE(r.dst, 0);
      ASSERT_LE(r.dst + r.bytes, dst.region_bytes());
      std::memcpy(d.data() + r.dst, s.data() + r.src, static_cast<size_t>(r.bytes));
    }
    for (int64_t l = 0; l < 3; ++l)
      for (int pl = 0; pl < planes; ++pl)
        for (int64_t t = 0; t < span->tokens; ++t)
          for (int32_t h = h0; h < h1; ++h) {
            const int64_t so = ref_offset(src, l, 1, pl, span->src_token + t, h);
            const int64_t dof = ref_offset(dst, l, db, pl, span->dst_token + t, h);
            const int64_t w = ref_width(src, pl);
            std::memcpy(expect.data() + dof, s.data() + so, static_cast<size_t>(w));
            std::memset(expect_written.data() + dof, 1, static_cast<size_t>(w));
          }
  }
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] != expect[i]) {
      ADD_FAILURE() << "byte " << i << (expect_written[i] ? " (mapped)" : " (must stay)") << ": got " << int(d[i])
                    << ", want " << int(expect[i]);
      return;
    }
  }
}

TEST(Geometry, PageSizesBothWaysMla) {
  for (auto fmt : {EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16(),
                   EntryFormat::indexer_fp8(), EntryFormat::mla_fp4()})
    for (int64_t a : {16, 32, 64, 128})
      for (int64_t b : {16, 32, 64, 128})
        for (auto la : {Layout::kBlockMajor, Layout::kLayerMajor})
          for (auto lb : {Layout::kBlockMajor, Layout::kLayerMajor}) check_case({fmt, fmt, a, b, la, lb});
}

TEST(Geometry, TensorParallelSlicesBothWaysWithOrderAndPages) {
  const int32_t H = 8, D = 16;
  for (int tp_src : {1, 2, 4, 8})
    for (int tp_dst : {1, 2, 4, 8})
      for (auto os : {MhaOrder::kNHD, MhaOrder::kHND})
        for (auto od : {MhaOrder::kNHD, MhaOrder::kHND})
          for (auto [a, b] : {std::pair<int64_t, int64_t>{16, 16}, {64, 16}, {16, 32}}) {
            const int32_t hs = H / tp_src, hdst = H / tp_dst;
            // Every source rank against the destination ranks that share heads with it.
            for (int rs = 0; rs < tp_src; ++rs)
              for (int rd = 0; rd < tp_dst; ++rd) {
                const auto sf = EntryFormat::mha_slice(hs, D, DType::kBF16, os, rs * hs, H);
                const auto df = EntryFormat::mha_slice(hdst, D, DType::kBF16, od, rd * hdst, H);
                if (common_heads(sf, df).count() == 0) continue;
                check_case(
                    {sf, df, a, b, Layout::kBlockMajor, (rs + rd) % 2 ? Layout::kLayerMajor : Layout::kBlockMajor});
              }
          }
}

TEST(Geometry, MergesWholeBlockRunsAndRefusesBadMaps) {
  const KvCacheSpec a{4, 2, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  std::vector<CopyRun> runs;
  ASSERT_TRUE(push_token_runs(&runs, a, 0, 0, a, 1, 0, 64).ok());
  ASSERT_EQ(runs.size(), 1u);  // the same geometry is one run per block-major block
  EXPECT_EQ(runs[0].bytes, a.block_bytes());
  // Part 0 of a 64-token block into 16-token pages: one run per layer of 16 x 576 bytes.
  const KvCacheSpec b{4, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  runs.clear();
  ASSERT_TRUE(push_token_runs(&runs, a, 0, 16, b, 3, 0, 16).ok());
  EXPECT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[1].bytes, 16 * 576);
  // Different layer counts, formats, ranges.
  const KvCacheSpec c{5, 2, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  EXPECT_EQ(push_token_runs(&runs, a, 0, 0, c, 0, 0, 64).code(), ErrorCode::kInvalidArgument);
  const KvCacheSpec e{4, 2, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  EXPECT_EQ(push_token_runs(&runs, a, 0, 0, e, 0, 0, 64).code(), ErrorCode::kUnsupported);
  EXPECT_EQ(push_token_runs(&runs, a, 0, 60, b, 0, 0, 16).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(push_token_runs(&runs, a, 2, 0, b, 0, 0, 16).code(), ErrorCode::kOutOfRange);
  // Token spans.
  EXPECT_EQ(token_span(64, 16, 3)->src_token, 48);
  EXPECT_EQ(token_span(16, 64, 3)->dst_token, 48);
  EXPECT_EQ(token_span(64, 16, 4).status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(token_span(48, 64, 0).status().code(), ErrorCode::kUnsupported);
}

TEST(Geometry, SliceNamesAndFamilies) {
  auto f = EntryFormat::parse("mha:bf16:2x128:hnd:slice=6/8");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->head_first, 6);
  EXPECT_EQ(f->total_heads(), 8);
  EXPECT_EQ(f->order, MhaOrder::kHND);
  EXPECT_TRUE(f->sliced());
  EXPECT_EQ(f->name(), "mha:bf16:2x128:hnd:slice=6/8");
  EXPECT_FALSE(EntryFormat::parse("mha:bf16:4x128:slice=6/8").ok());  // past the last head
  EXPECT_FALSE(EntryFormat::parse("mha:bf16:4x128:slice=x/8").ok());
  EXPECT_FALSE(EntryFormat::parse("mha:bf16:4x128:nhd:slice=0/8:slice=4/8").ok());
  EXPECT_EQ(EntryFormat::parse("mha:bf16:8x128:slice=0/8")->name(), "mha:bf16:8x128:nhd");  // all heads: no slice
  EXPECT_NE(*EntryFormat::parse("mha:bf16:4x128:slice=0/8"), *EntryFormat::parse("mha:bf16:4x128:slice=4/8"));
  EXPECT_TRUE(same_entries(*EntryFormat::parse("mha:bf16:4x128:slice=0/8"), *EntryFormat::parse("mha:bf16:8x128:hnd")));
  EXPECT_FALSE(same_entries(*EntryFormat::parse("mha:bf16:4x128:slice=0/8"), *EntryFormat::parse("mha:bf16:4x128")));
}

}  // namespace
}  // namespace kvferry
