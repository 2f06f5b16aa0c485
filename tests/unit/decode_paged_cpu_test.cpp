// CPU twin of the paged MHA/GQA decode against an independent float64 reference, layout
// equivalence on the CPU, and boundary validation.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <string>

#include "unit/decode_paged_problem.h"

namespace kvferry::test {
namespace {

ProblemShape with_page(ProblemShape s, int page) {
  s.P = page;
  return s;
}

struct Case {
  const char* name;
  ProblemShape s;
  int splits = 1;
  float cap = 0;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

void expect_close(const Problem& p, const Output& out, double otol) {
  std::vector<double> ro, rl;
  reference(p, ro, rl);
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < ro.size(); ++i) {
    const float got = out.o_at(p, i);
    ASSERT_TRUE(std::isfinite(got)) << "o[" << i << "]";
    max_err = std::max(max_err, std::abs(got - ro[i]));
    max_ref = std::max(max_ref, std::abs(ro[i]));
  }
  EXPECT_LE(max_err, otol) << "max |o - ref|";
  for (size_t i = 0; i < rl.size(); ++i) {
    if (std::isinf(rl[i])) {
      EXPECT_TRUE(std::isinf(out.lse[i]) && out.lse[i] < 0) << "lse[" << i << "] of an empty sequence";
      for (int d = 0; d < p.s.Dv; ++d) EXPECT_EQ(out.o_at(p, i * p.s.Dv + d), 0.0f);
    } else {
      EXPECT_NEAR(out.lse[i], rl[i], 1e-4 * std::max(1.0, std::abs(rl[i]))) << "lse[" << i << "]";
    }
  }
  bool any_len = false;
  for (int32_t l : p.lens) any_len = any_len || l > 0;
  if (any_len) {
    EXPECT_GT(max_ref, 1e-3) << "reference output is degenerate";
  }
}

ProblemShape shape(int B, int Hq, int Hkv, int Dk, int Dv, std::vector<int32_t> lens, DType ct = DType::kBF16,
                   DType qt = DType::kBF16) {
  ProblemShape s;
  s.B = B;
  s.Hq = Hq;
  s.Hkv = Hkv;
  s.Dk = Dk;
  s.Dv = Dv;
  s.lens = std::move(lens);
  s.ct = ct;
  s.qt = qt;
  return s;
}

class DecodePagedCpu : public ::testing::TestWithParam<Case> {};

TEST_P(DecodePagedCpu, MatchesFloat64Reference) {
  const Case& c = GetParam();
  Problem p = make_problem(c.s);
  p.logit_cap = c.cap;
  Placed pl = place(p, KvLayout::kContiguous);
  Output out;
  ASSERT_TRUE(run_cpu(p, pl, c.splits, out).ok());
  // bf16 output rounding (2^-9 relative) on values of magnitude <= 1, plus fp32 accumulation.
  const double tol = p.s.qt == DType::kBF16 ? 8e-3 : 2e-3;
  expect_close(p, out, tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodePagedCpu,
    ::testing::Values(
        Case{"page24_splits2", with_page(shape(2, 8, 2, 128, 128, {100, 47}), 24), 2},
        Case{"gqa_group2", shape(2, 4, 2, 64, 128, {40, 77}), 2},
        Case{"gqa_group3_padded", shape(2, 6, 2, 128, 128, {33, 70})},
        Case{"group12_chunks", shape(1, 12, 1, 64, 64, {50}), 2},
        Case{"len_0_1_37_64", shape(4, 8, 2, 128, 128, {0, 1, 37, 64})},
        Case{"splits3", shape(3, 8, 2, 128, 128, {0, 100, 257}), 3},
        Case{"splits5_short", shape(2, 4, 1, 64, 64, {3, 40}), 5}, Case{"mha_group1", shape(2, 4, 4, 64, 64, {21, 50})},
        Case{"gqa_group4", shape(2, 8, 2, 128, 128, {33, 17})}, Case{"gqa_group8", shape(2, 16, 2, 128, 128, {48, 5})},
        Case{"mqa_group16", shape(1, 16, 1, 64, 64, {29})}, Case{"dk192_dv128", shape(2, 8, 2, 192, 128, {45, 19}), 2},
        Case{"dk64_dv256", shape(2, 4, 2, 64, 256, {31, 16})}, Case{"dk256_dv64", shape(1, 4, 1, 256, 64, {40})},
        Case{"fp16", shape(2, 8, 2, 128, 128, {37, 9}, DType::kFP16, DType::kFP16), 2},
        Case{"fp8_bf16q", shape(2, 8, 2, 128, 128, {37, 70}, DType::kFP8E4M3), 2},
        Case{"fp8_fp16q_dk192", shape(1, 4, 1, 192, 128, {50}, DType::kFP8E4M3, DType::kFP16)},
        Case{"logit_cap", shape(2, 8, 2, 128, 128, {37, 64}), 2, 0.5f}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// The same logical K/V through different physical layouts gives bit-identical results.
TEST(DecodePagedCpuLayouts, StridedViewsAreBitIdentical) {
  for (int splits : {1, 3}) {
    ProblemShape s = shape(3, 8, 2, 128, 128, {37, 0, 70});
    Problem p = make_problem(s);
    Output ref;
    ASSERT_TRUE(run_cpu(p, place(p, KvLayout::kContiguous), splits, ref).ok());
    for (KvLayout l : {KvLayout::kLayerNhd, KvLayout::kLayerHnd}) {
      for (int layer : {0, 1, 2}) {
        Output o;
        ASSERT_TRUE(run_cpu(p, place(p, l, 3, layer), splits, o).ok());
        EXPECT_EQ(o.o, ref.o) << "layout " << int(l) << " layer " << layer;
        EXPECT_EQ(std::memcmp(o.lse.data(), ref.lse.data(), o.lse.size() * 4), 0);
      }
    }
  }
}

// The balanced schedule is a GPU work split: the CPU twin computes such a call unsplit.
TEST(DecodePagedCpuLayouts, BalancedScheduleIsComputedUnsplit) {
  Problem p = make_problem(shape(3, 8, 2, 128, 128, {37, 0, 170}));
  const Placed pl = place(p, KvLayout::kLayerNhd, 3, 1);
  Output one, bal;
  ASSERT_TRUE(run_cpu(p, pl, 1, one).ok());
  const Status st = run_cpu(p, pl, kDecodePagedBalanced, bal);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(bal.o, one.o);
  EXPECT_EQ(std::memcmp(bal.lse.data(), one.lse.data(), one.lse.size() * 4), 0);
}

TEST(DecodePagedCpuLayouts, VAsSliceOfCombinedBuffer) {
  ProblemShape s = shape(2, 8, 2, 192, 128, {45, 16});
  s.v_is_k_prefix = true;
  Problem p = make_problem(s);
  Output ref, comb;
  ASSERT_TRUE(run_cpu(p, place(p, KvLayout::kContiguous), 2, ref).ok());
  ASSERT_TRUE(run_cpu(p, place(p, KvLayout::kCombined), 2, comb).ok());
  EXPECT_EQ(comb.o, ref.o);
  expect_close(p, comb, 8e-3);
}

// ---------------------------------------------------------------- validation
struct Fixture {
  Problem p = make_problem(shape(2, 8, 2, 128, 128, {37, 16}));
  Placed pl = place(p, KvLayout::kContiguous);
  std::vector<uint8_t> o = std::vector<uint8_t>(2 * 8 * 128 * 2);
  DecodePagedParams d() const {
    DecodePagedParams x = base_params(p, pl);
    x.q_base = p.q.data();
    x.k_base = pl.kbuf.data();
    x.v_base = pl.vbuf.data();
    x.o_base = const_cast<uint8_t*>(o.data());
    x.block_table = p.block_table.data();
    x.seq_lens = p.lens.data();
    return x;
  }
};

void expect_error(const DecodePagedParams& d, ErrorCode code, const char* needle) {
  const Status st = decode_paged_cpu(d);
  ASSERT_FALSE(st.ok()) << needle;
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
}

TEST(DecodePagedCpuValidate, AcceptsTheFixture) {
  Fixture f;
  EXPECT_TRUE(decode_paged_cpu(f.d()).ok());
}

TEST(DecodePagedCpuValidate, RejectsBadInput) {
  Fixture f;
  DecodePagedParams d = f.d();
  d.k.strides[3] = 2;
  expect_error(d, ErrorCode::kInvalidArgument, "stride(-1)");
  d = f.d();
  d.v.offset += 16;  // now ends past its region
  expect_error(d, ErrorCode::kOutOfRange, "past the region");
  d = f.d();
  d.k.strides[0] += 1;  // 2-byte stride step: not 16-byte aligned
  expect_error(d, ErrorCode::kMisaligned, "stride(0)");
  d = f.d();
  d.q.sizes[1] = 7;
  d.o.sizes[1] = 7;
  expect_error(d, ErrorCode::kInvalidArgument, "multiple of Hkv");
  d = f.d();
  d.v.sizes[3] = 96;
  expect_error(d, ErrorCode::kInvalidArgument, "Dv = 96");
  d = f.d();
  d.o.sizes[2] = 64;
  expect_error(d, ErrorCode::kInvalidArgument, "o (2,8,64)");
  d = f.d();
  d.k.dtype = DType::kFP16;
  expect_error(d, ErrorCode::kInvalidArgument, "k dtype fp16");
  d = f.d();
  d.num_splits = 4;
  expect_error(d, ErrorCode::kResourceExhausted, "workspace");
  d = f.d();
  d.num_splits = -2;
  expect_error(d, ErrorCode::kInvalidArgument, "num_splits = -2");
  d = f.d();
  d.max_seq_len = 1000;
  expect_error(d, ErrorCode::kInvalidArgument, "max_seq_len");
}

TEST(DecodePagedCpuValidate, RejectsBadTableContents) {
  Fixture f;
  std::vector<int32_t> bt = f.p.block_table;
  bt[1] = f.p.NB;  // second page of request 0 (len 37 uses 3 pages)
  DecodePagedParams d = f.d();
  d.block_table = bt.data();
  expect_error(d, ErrorCode::kOutOfRange, "block_table[0, 1]");
  std::vector<int32_t> lens = {37, -1};
  d = f.d();
  d.seq_lens = lens.data();
  expect_error(d, ErrorCode::kOutOfRange, "seq_lens[1]");
}

}  // namespace
}  // namespace kvferry::test
