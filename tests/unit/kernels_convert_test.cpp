// CPU twins of the conversions, gathers and copy_blocks: hand-checked bytes, round trips
// (bf16 -> 656 -> bf16 within the fp8 bound, 576 -> 656 -> 576 bit-exact), lossless detection,
// and the cross-layer equivalence design for readers (garbage neighbours) and writers.
#include <gtest/gtest.h>

#include <cfloat>
#include <string>

#include "kernels_test_util.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/gather.h"

namespace kvferry {
namespace {

using kernels::ConvertKind;
using test::Bytes;
using test::Region;

using test::fill_valid;

TEST(KernelsConvert, Fp8ToDsHandChecked) {
  Region src(test::mk_spec(1, 1, 1, EntryFormat::mla_fp8()), 1);
  Region dst(test::mk_spec(1, 1, 1, EntryFormat::mla_fp8_ds()), 2);
  src.bytes.data()[512] = 0x38;  // e4m3 1.0
  src.bytes.data()[513] = 0xC0;  // e4m3 -2.0
  std::vector<int64_t> ids{0};
  ASSERT_TRUE(kernels::convert_blocks_cpu(src.bytes.data(), src.spec, ids, dst.bytes.data(), dst.spec, ids).ok());
  const uint8_t* d = dst.bytes.data();
  EXPECT_EQ(std::memcmp(d, src.bytes.data(), 512), 0);
  const uint8_t one[4] = {0x00, 0x00, 0x80, 0x3F};
  for (int t = 0; t < 4; ++t) EXPECT_EQ(std::memcmp(d + 512 + 4 * t, one, 4), 0) << t;
  EXPECT_EQ(d[528], 0x80);
  EXPECT_EQ(d[529], 0x3F);  // bf16 1.0 = 0x3F80
  EXPECT_EQ(d[530], 0x00);
  EXPECT_EQ(d[531], 0xC0);  // bf16 -2.0 = 0xC000
}

TEST(KernelsConvert, Fp8ToDsToFp8IsBitExactAndLossless) {
  const auto spec576 = test::mk_spec(3, 5, 8, EntryFormat::mla_fp8());
  const auto spec656 = test::mk_spec(3, 5, 8, EntryFormat::mla_fp8_ds());
  Region a(spec576, 1), mid(spec656, 2), back(spec576, 3);
  fill_valid(a, 4);
  std::vector<int64_t> ids{0, 1, 2, 3, 4};
  ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), spec576, ids, mid.bytes.data(), spec656, ids, {2}).ok());
  std::vector<int64_t> bad;
  ASSERT_TRUE(
      kernels::convert_blocks_cpu(mid.bytes.data(), spec656, ids, back.bytes.data(), spec576, ids, {2}, &bad).ok());
  EXPECT_TRUE(bad.empty());
  EXPECT_TRUE(a.bytes == back.bytes);
}

TEST(KernelsConvert, DsToFp8ReportsBlocksThatAreNotLossless) {
  const auto spec576 = test::mk_spec(2, 4, 4, EntryFormat::mla_fp8());
  const auto spec656 = test::mk_spec(2, 4, 4, EntryFormat::mla_fp8_ds());
  Region a(spec576, 1), mid(spec656, 2), back(spec576, 3);
  fill_valid(a, 5);
  std::vector<int64_t> ids{0, 1, 2, 3};
  ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), spec576, ids, mid.bytes.data(), spec656, ids).ok());
  // Block 1: a scale of 2.0 in layer 1. Block 3: a rope value with more mantissa than e4m3.
  const float two = 2.0f;
  std::memcpy(mid.bytes.data() + spec656.page_offset(1, 1) + 2 * 656 + 516, &two, 4);
  const uint16_t fine = 0x3F81;  // 1.0078125: 7 mantissa bits
  std::memcpy(mid.bytes.data() + spec656.page_offset(0, 3) + 528 + 2 * 5, &fine, 2);
  std::vector<int64_t> bad;
  std::vector<int64_t> dst_ids{3, 2, 1, 0};
  ASSERT_TRUE(
      kernels::convert_blocks_cpu(mid.bytes.data(), spec656, ids, back.bytes.data(), spec576, dst_ids, {}, &bad).ok());
  EXPECT_EQ(bad, (std::vector<int64_t>{1, 3}));
  // Block 0 went to block 3 unchanged.
  for (int64_t l = 0; l < 2; ++l)
    EXPECT_EQ(std::memcmp(back.bytes.data() + spec576.page_offset(l, 3), a.bytes.data() + spec576.page_offset(l, 0),
                          static_cast<size_t>(spec576.page_bytes())),
              0);
}

TEST(KernelsConvert, Bf16ToDsToBf16WithinFp8Bound) {
  const auto sb = test::mk_spec(2, 3, 8, EntryFormat::mla_bf16());
  const auto sd = test::mk_spec(2, 3, 8, EntryFormat::mla_fp8_ds());
  Region a(sb, 1), mid(sd, 2), back(sb, 3);
  fill_valid(a, 6);
  std::vector<int64_t> ids{0, 1, 2};
  ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), sb, ids, mid.bytes.data(), sd, ids).ok());
  ASSERT_TRUE(kernels::convert_blocks_cpu(mid.bytes.data(), sd, ids, back.bytes.data(), sb, ids).ok());
  int64_t checked = 0;
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t t = 0; t < 8; ++t) {
        const uint8_t* x = a.bytes.data() + sb.page_offset(l, b) + t * 1152;
        const uint8_t* y = back.bytes.data() + sb.page_offset(l, b) + t * 1152;
        const uint8_t* q = mid.bytes.data() + sd.page_offset(l, b) + t * 656;
        for (int i = 0; i < 576; ++i) {
          uint16_t hx, hy;
          std::memcpy(&hx, x + 2 * i, 2);
          std::memcpy(&hy, y + 2 * i, 2);
          if (i >= 512) {
            ASSERT_EQ(hx, hy) << "rope must be copied";
            continue;
          }
          float s;
          std::memcpy(&s, q + 512 + 4 * (i / 128), 4);
          const float fx = bf16_to_float(hx), fy = bf16_to_float(hy);
          // e4m3 keeps 3 mantissa bits (half-ulp 2^-4 relative; subnormal step 2^-9 * s); bf16 2^-9.
          ASSERT_LE(std::fabs(fx - fy), std::fabs(fx) * (1.0f / 16 + 1.0f / 256) + s * (1.0f / 1024)) << i;
          ++checked;
        }
      }
  EXPECT_EQ(checked, 2 * 3 * 8 * 512);
}

TEST(KernelsConvert, RejectsMismatchedSpecsAndBlocks) {
  const auto a = test::mk_spec(2, 3, 8, EntryFormat::mla_fp8());
  auto b = test::mk_spec(2, 3, 8, EntryFormat::mla_fp8_ds());
  Region ra(a, 1), rb(b, 2);
  std::vector<int64_t> ids{0, 3};
  Status st = kernels::convert_blocks_cpu(ra.bytes.data(), a, ids, rb.bytes.data(), b, ids);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << st.to_string();
  EXPECT_NE(st.message().find("block 3"), std::string::npos) << st.to_string();
  st = kernels::convert_blocks_cpu(ra.bytes.data(), a, ids, ra.bytes.data(), a, ids);
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  b.block_size = 4;
  EXPECT_EQ(kernels::convert_blocks_cpu(ra.bytes.data(), a, ids, rb.bytes.data(), b, ids).code(),
            ErrorCode::kInvalidArgument);
  // Layer and block counts past what the CUDA kernels' 32-bit entry walk holds are refused by name.
  Region rd(test::mk_spec(2, 3, 8, EntryFormat::mla_fp8_ds()), 3);
  kernels::ConvertParams p;
  p.kind = ConvertKind::kFp8ToDs;
  p.src = ra.layer(0);
  p.dst = rd.layer(0);
  p.count = 1;
  p.src_blocks = ids.data();
  p.dst_blocks = ids.data();
  ASSERT_TRUE(kernels::validate_convert(p).ok());
  for (const auto& [layers, count] : {std::pair<int64_t, int64_t>{int64_t{1} << 31, 1}, {1, int64_t{1} << 31}}) {
    p.layers = layers;
    p.count = count;
    st = kernels::validate_convert(p);
    EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << st.to_string();
    EXPECT_NE(st.message().find("2^31"), std::string::npos) << st.to_string();
  }
}

// Cross-layer convert: converting layer l of block-major buffers must equal converting a
// contiguous copy of that layer, and must not touch the destination's other layers. Also all
// layers at once (layers = L) equal L single-layer conversions, block-major and layer-major.
class KernelsConvertCrossLayer : public ::testing::TestWithParam<int64_t> {};

TEST_P(KernelsConvertCrossLayer, AllKinds) {
  const int64_t layers = GetParam(), nb = 4, bs = 4;
  struct K {
    ConvertKind kind;
    EntryFormat s, d;
  };
  const K kinds[] = {{ConvertKind::kFp8ToDs, EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds()},
                     {ConvertKind::kDsToFp8, EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp8()},
                     {ConvertKind::kBf16ToDs, EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds()},
                     {ConvertKind::kDsToBf16, EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16()}};
  const std::vector<int64_t> src_ids{2, 0, 3}, dst_ids{1, 3, 0};
  for (const K& k : kinds) {
    Region src(test::mk_spec(layers, nb, bs, k.s), 1);
    fill_valid(src, 9);
    for (int64_t l : test::probe_layers(layers)) {
      Region one_src(test::mk_spec(1, nb, bs, k.s), 2), one_dst(test::mk_spec(1, nb, bs, k.d), 3);
      Region dst(test::mk_spec(layers, nb, bs, k.d), 4);
      test::copy_layer(src, l, one_src, false);
      test::copy_layer(dst, l, one_dst, false);
      const Bytes garbage = dst.bytes;
      kernels::ConvertParams p;
      p.kind = k.kind;
      p.src_blocks = src_ids.data();
      p.dst_blocks = dst_ids.data();
      p.count = 3;
      p.src = one_src.layer(0);
      p.dst = one_dst.layer(0);
      ASSERT_TRUE(kernels::convert_cpu(p).ok());
      p.src = src.layer(l);
      p.dst = dst.layer(l);
      ASSERT_TRUE(kernels::convert_cpu(p).ok());
      EXPECT_TRUE(test::layer_equal(dst, l, one_dst)) << int(k.kind) << " layer " << l;
      Region g(dst.spec, 0);
      std::memcpy(g.bytes.data(), garbage.data(), garbage.size());
      EXPECT_TRUE(test::others_equal(dst, g, l));
    }
    // All layers in one call, block-major source into a layer-major destination.
    Region all(test::mk_spec(layers, nb, bs, k.d, Layout::kLayerMajor), 5);
    Region per(all.spec, 5);
    ASSERT_TRUE(
        kernels::convert_blocks_cpu(src.bytes.data(), src.spec, src_ids, all.bytes.data(), all.spec, dst_ids, {4})
            .ok());
    for (int64_t l = 0; l < layers; ++l) {
      kernels::ConvertParams p;
      p.kind = k.kind;
      p.src = src.layer(l);
      p.dst = per.layer(l);
      p.src_blocks = src_ids.data();
      p.dst_blocks = dst_ids.data();
      p.count = 3;
      ASSERT_TRUE(kernels::convert_cpu(p).ok());
    }
    EXPECT_TRUE(all.bytes == per.bytes) << int(k.kind);
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, KernelsConvertCrossLayer, ::testing::Values(1, 2, 3, 61));

// ---- gathers ----

struct GatherCase {
  std::vector<int32_t> block_table, cu, starts;
  int64_t batch = 0, bt_stride = 0, rows = 0;
};

GatherCase gather_case(int64_t nb, int64_t bs, uint32_t seed) {
  GatherCase c;
  c.batch = 3;
  c.bt_stride = 4;
  std::mt19937 g(seed);
  for (int64_t i = 0; i < c.batch * c.bt_stride; ++i) c.block_table.push_back(static_cast<int32_t>(g() % nb));
  const int32_t lens[3] = {static_cast<int32_t>(2 * bs + 3), 0, static_cast<int32_t>(bs + 1)};
  c.starts = {1, 0, static_cast<int32_t>(bs - 1)};
  c.cu = {0};
  for (int i = 0; i < 3; ++i) c.cu.push_back(c.cu.back() + lens[i]);
  c.rows = c.cu.back();
  return c;
}

TEST(KernelsGather, CopyFollowsBlockTableAndSeqStarts) {
  const int64_t bs = 4;
  Region r(test::mk_spec(1, 8, bs, EntryFormat::mla_fp8()), 3);
  std::vector<int32_t> bt{5, 2, 7};
  std::vector<int32_t> cu{0, 6};
  std::vector<int32_t> starts{3};
  Bytes dst(6 * 576);
  kernels::GatherParams p;
  p.cache = r.layer(0);
  p.dst = dst.data();
  p.dst_stride = 576;
  p.block_table = bt.data();
  p.block_table_stride = 3;
  p.cu_seq_lens = cu.data();
  p.seq_starts = starts.data();
  p.batch = 1;
  p.total_rows = 6;
  ASSERT_TRUE(kernels::gather_cpu(p).ok());
  // positions 3..8: (blk 5, t 3), (2, 0..3), (7, 0)
  const std::pair<int, int> want[6] = {{5, 3}, {2, 0}, {2, 1}, {2, 2}, {2, 3}, {7, 0}};
  for (int j = 0; j < 6; ++j)
    EXPECT_EQ(std::memcmp(dst.data() + j * 576, r.bytes.data() + (want[j].first * bs + want[j].second) * 576, 576), 0)
        << j;
  starts[0] = 7;  // needs column 3 of a 3-column table
  EXPECT_EQ(kernels::gather_cpu(p).code(), ErrorCode::kOutOfRange);
}

class KernelsGatherCrossLayer : public ::testing::TestWithParam<int64_t> {};

TEST_P(KernelsGatherCrossLayer, AllModesSeeTheirLayerOnly) {
  const int64_t layers = GetParam(), nb = 6, bs = 4;
  const GatherCase c = gather_case(nb, bs, 17);
  struct M {
    kernels::GatherMode mode;
    EntryFormat f;
    int64_t dst_row_bytes;
  };
  const M modes[] = {{kernels::GatherMode::kCopy, EntryFormat::mla_bf16(), 1152},
                     {kernels::GatherMode::kCopy, EntryFormat::indexer_fp8(), 132},
                     {kernels::GatherMode::kDequantFp8, EntryFormat::mla_fp8(), 1152},
                     {kernels::GatherMode::kDequantDs, EntryFormat::mla_fp8_ds(), 1152}};
  for (const M& m : modes) {
    for (int64_t l : test::probe_layers(layers)) {
      Region u(test::mk_spec(layers, nb, bs, m.f), 3);  // random garbage everywhere
      Region one(test::mk_spec(1, nb, bs, m.f), 4);
      fill_valid(one, 5);
      test::copy_layer(u, l, one, true);
      Bytes out_a(static_cast<size_t>(c.rows * m.dst_row_bytes)), out_b(out_a.size());
      kernels::GatherParams p;
      p.dst_stride = m.dst_row_bytes / (m.mode == kernels::GatherMode::kCopy ? dtype_size(m.f.dtype) : 2);
      p.block_table = c.block_table.data();
      p.block_table_stride = c.bt_stride;
      p.cu_seq_lens = c.cu.data();
      p.seq_starts = c.starts.data();
      p.batch = c.batch;
      p.total_rows = c.rows;
      p.mode = m.mode;
      p.scale = 0.75f;
      p.cache = one.layer(0);
      p.dst = out_a.data();
      ASSERT_TRUE(kernels::gather_cpu(p).ok());
      p.cache = u.layer(l);
      p.dst = out_b.data();
      ASSERT_TRUE(kernels::gather_cpu(p, {2}).ok());
      EXPECT_TRUE(out_a == out_b) << "mode " << int(m.mode) << " layer " << l;
      bool nonzero = false;
      for (size_t i = 0; i < out_a.size(); ++i) nonzero |= out_a.data()[i] != 0;
      EXPECT_TRUE(nonzero);
    }
  }
}

TEST_P(KernelsGatherCrossLayer, DequantPagedBySlot) {
  const int64_t layers = GetParam(), nb = 5, bs = 8;
  const auto slots64 = test::random_slots(nb * bs, 20, 23);
  std::vector<int32_t> slots(slots64.begin(), slots64.end());
  for (int64_t l : test::probe_layers(layers)) {
    Region u(test::mk_spec(layers, nb, bs, EntryFormat::mla_fp8_ds()), 3);
    Region one(test::mk_spec(1, nb, bs, EntryFormat::mla_fp8_ds()), 4);
    fill_valid(one, 6);
    test::copy_layer(u, l, one, true);
    Bytes a(20 * 1152), b(20 * 1152);
    kernels::DequantPagedParams p;
    p.slots = slots.data();
    p.count = 20;
    p.cache = one.layer(0);
    p.dst = a.data();
    ASSERT_TRUE(kernels::dequant_paged_cpu(p).ok());
    p.cache = u.layer(l);
    p.dst = b.data();
    ASSERT_TRUE(kernels::dequant_paged_cpu(p).ok());
    EXPECT_TRUE(a == b);
    // Row 3 has slot -1: untouched (zero).
    for (int i = 0; i < 1152; ++i) ASSERT_EQ(a.data()[3 * 1152 + i], 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, KernelsGatherCrossLayer, ::testing::Values(1, 2, 3, 61));

// ---- copy_blocks ----

TEST(KernelsCopyBlocks, RegionToPoolAndBackBothLayouts) {
  for (Layout layout : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    const auto region = test::mk_spec(3, 10, 4, EntryFormat::mla_fp8(), layout);
    const auto pool = test::mk_spec(3, 4, 4, EntryFormat::mla_fp8());
    Region r(region, 1), h(pool, 2), r2(region, 3);
    const std::vector<int64_t> rb{7, 2, 3, 9}, hb{0, 1, 2, 3};
    auto save = copy_plan(region, rb, pool, hb);
    ASSERT_TRUE(save.ok());
    ASSERT_TRUE(
        kernels::copy_blocks_cpu(r.bytes.data(), r.bytes.ssize(), h.bytes.data(), h.bytes.ssize(), *save, {2}).ok());
    auto load = copy_plan(pool, hb, region, rb);
    ASSERT_TRUE(load.ok());
    ASSERT_TRUE(
        kernels::copy_blocks_cpu(h.bytes.data(), h.bytes.ssize(), r2.bytes.data(), r2.bytes.ssize(), *load).ok());
    for (int64_t b : rb)
      for (int64_t l = 0; l < 3; ++l)
        EXPECT_EQ(std::memcmp(r.bytes.data() + region.page_offset(l, b), r2.bytes.data() + region.page_offset(l, b),
                              static_cast<size_t>(region.page_bytes())),
                  0);
    // A block not in the list kept r2's own pattern.
    EXPECT_NE(std::memcmp(r.bytes.data() + region.page_offset(0, 0), r2.bytes.data() + region.page_offset(0, 0),
                          static_cast<size_t>(region.page_bytes())),
              0);
  }
}

TEST(KernelsCopyBlocks, RejectsRunsOutsideTheBuffersAndPicksEngines) {
  Bytes a(1024), b(1024);
  std::vector<CopyRun> runs{{0, 512, 600}};
  Status st = kernels::copy_blocks_cpu(a.data(), 1024, b.data(), 1024, runs);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(st.message().find("destination"), std::string::npos) << st.to_string();
  std::vector<CopyRun> small{{0, 0, 16 << 10}}, big{{0, 0, 1 << 20}};
  EXPECT_EQ(kernels::choose_copy_engine(small, kernels::CopyEngine::kAuto), kernels::CopyEngine::kKernel);
  EXPECT_EQ(kernels::choose_copy_engine(big, kernels::CopyEngine::kAuto), kernels::CopyEngine::kDma);
  EXPECT_EQ(kernels::choose_copy_engine(big, kernels::CopyEngine::kKernel), kernels::CopyEngine::kKernel);
}

}  // namespace
}  // namespace kvferry

// The CPU twins' lookup tables must be the scalar conversions, value for value.
#include "cpu/entry_ops.h"

namespace kvferry {
namespace {

TEST(KernelsCpuTables, MatchTheScalarConversions) {
  using namespace kernels::detail;
  for (int q = 0; q < 256; ++q) {
    ASSERT_EQ(e4m3_bf16_table()[q], e4m3_to_bf16(static_cast<uint8_t>(q))) << q;
    ASSERT_EQ(float_bits(e4m3_float_table()[q]), float_bits(e4m3_to_float(static_cast<uint8_t>(q)))) << q;
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    uint8_t q = 0;
    const bool exact = bf16_to_e4m3_exact(static_cast<uint16_t>(h), &q);
    ASSERT_EQ(bf16_e4m3_table()[h], q) << h;
    ASSERT_EQ(e4m3_bf16_table()[q] == h, exact) << h;
  }
}

}  // namespace
}  // namespace kvferry
