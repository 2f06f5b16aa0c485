// decode_mla_cpu against an independent float64 reference, edge lengths, garbage insensitivity and
// validation messages.
//
// Error bound: the CPU implementation computes in float64 and rounds o to bf16 once, so every o
// element is within one bf16 rounding of the reference: |o - ref| <= 2^-8 * |ref| (+1e-30), and
// lse within 1e-6 relative (one fp32 rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvferry/kernels/decode_mla.h"
#include "unit/decode_mla_case.h"

namespace kvferry {
namespace {

using test::MlaCase;

// The reference: its own addressing (kernels-spec §1.3: (block * L + layer) * page_bytes + t * E)
// and its own dequantization, all in double.
void reference(const MlaCase& c, std::vector<double>& o, std::vector<double>& lse) {
  const int64_t e_bytes = c.format.bytes_per_token();
  const int64_t page_bytes = c.page * e_bytes;
  o.assign(static_cast<size_t>(c.batch()) * c.heads * kMlaRank, 0.0);
  lse.assign(static_cast<size_t>(c.batch()) * c.heads, -std::numeric_limits<double>::infinity());
  for (int b = 0; b < c.batch(); ++b) {
    const int n = c.lens[b];
    std::vector<double> k(static_cast<size_t>(n) * kMlaDim);
    for (int j = 0; j < n; ++j) {
      const int64_t blk = c.table[b * c.table_stride + j / c.page];
      const uint8_t* e = c.region.data() + (blk * c.layers + c.layer) * page_bytes + (j % c.page) * e_bytes;
      double* kj = &k[static_cast<size_t>(j) * kMlaDim];
      for (int d = 0; d < kMlaDim; ++d) {
        if (c.format.kind == FormatKind::kMlaBf16) {
          uint16_t h;
          std::memcpy(&h, e + 2 * d, 2);
          kj[d] = bf16_to_float(h);
        } else if (c.format.kind == FormatKind::kMlaFp8) {
          kj[d] = static_cast<double>(e4m3_to_float(e[d])) * c.k_scale;
        } else if (d < kMlaRank) {
          float s;
          std::memcpy(&s, e + 512 + 4 * (d / 128), 4);
          kj[d] = static_cast<double>(e4m3_to_float(e[d])) * s;  // exact: 4 x 24 significant bits
        } else {
          uint16_t h;
          std::memcpy(&h, e + 528 + 2 * (d - 512), 2);
          kj[d] = bf16_to_float(h);
        }
      }
    }
    for (int h = 0; h < c.heads; ++h) {
      const size_t bh = static_cast<size_t>(b) * c.heads + h;
      if (n == 0) continue;
      std::vector<double> x(n);
      double m = -1e300;
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int d = 0; d < kMlaDim; ++d) s += bf16_to_float(c.q[bh * kMlaDim + d]) * k[j * kMlaDim + d];
        x[j] = s * c.sm_scale;
        m = std::max(m, x[j]);
      }
      double l = 0;
      for (int j = 0; j < n; ++j) l += std::exp(x[j] - m);
      for (int j = 0; j < n; ++j) {
        const double w = std::exp(x[j] - m) / l;
        for (int d = 0; d < kMlaRank; ++d) o[bh * kMlaRank + d] += w * k[j * kMlaDim + d];
      }
      lse[bh] = m + std::log(l);
    }
  }
}

struct Out {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

Out run_cpu(const MlaCase& c) {
  Out r;
  r.o.assign(static_cast<size_t>(c.batch()) * c.heads * kMlaRank, 0xffff);  // poisoned (NaN)
  r.lse.assign(static_cast<size_t>(c.batch()) * c.heads, std::numeric_limits<float>::quiet_NaN());
  const Status st = decode_mla_cpu(c.params(r.o.data(), r.lse.data()));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

void expect_matches_reference(const MlaCase& c) {
  const Out r = run_cpu(c);
  std::vector<double> o, lse;
  reference(c, o, lse);
  for (size_t i = 0; i < o.size(); ++i) {
    const double got = bf16_to_float(r.o[i]);
    ASSERT_LE(std::abs(got - o[i]), std::ldexp(std::abs(o[i]), -8) + 1e-30)
        << c.format.name() << " o[" << i << "] = " << got << " vs " << o[i];
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      EXPECT_TRUE(std::isinf(r.lse[i]) && r.lse[i] < 0) << "lse[" << i << "] = " << r.lse[i];
    } else {
      EXPECT_NEAR(r.lse[i], lse[i], 1e-6 * std::max(1.0, std::abs(lse[i]))) << "lse[" << i << "]";
    }
  }
}

class DecodeMlaCpu : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeMlaCpu, MatchesFloat64Reference) {
  const auto [fmt, page] = GetParam();
  MlaCase c;
  c.format = fmt == 0 ? EntryFormat::mla_bf16() : fmt == 1 ? EntryFormat::mla_fp8() : EntryFormat::mla_fp8_ds();
  c.k_scale = fmt == 1 ? 0.75f : 1.0f;
  c.page = page;
  c.lens = {0, 1, page - 1, page + 3, 2 * page};
  c.layers = 3;
  c.layer = 1;
  c.seed = 100 + fmt * 10 + page;
  c.build();
  expect_matches_reference(c);
}

INSTANTIATE_TEST_SUITE_P(FormatsPages, DecodeMlaCpu,
                         ::testing::Combine(::testing::Values(0, 1, 2), ::testing::Values(16, 32, 64)));

TEST(DecodeMlaCpuEdges, LengthZeroGivesZeroAndMinusInf) {
  MlaCase c;
  c.lens = {0, 0};
  c.build();
  const Out r = run_cpu(c);
  for (uint16_t v : r.o) ASSERT_EQ(v, 0u);
  for (float v : r.lse) ASSERT_TRUE(std::isinf(v) && v < 0);
}

TEST(DecodeMlaCpuEdges, LengthOneReturnsTheEntry) {
  MlaCase c;
  c.lens = {1};
  c.build();
  const Out r = run_cpu(c);
  const uint8_t* e = c.region.data() + c.spec.page_offset(c.layer, c.table[0]);
  for (int h = 0; h < c.heads; ++h)
    for (int d = 0; d < kMlaRank; ++d) {
      uint16_t want;
      std::memcpy(&want, e + 2 * d, 2);
      ASSERT_EQ(r.o[h * kMlaRank + d], want) << "head " << h << " d " << d;
    }
}

TEST(DecodeMlaCpuEdges, GarbageElsewhereChangesNothing) {
  for (int fmt = 0; fmt < 3; ++fmt) {
    MlaCase clean, dirty;
    for (MlaCase* c : {&clean, &dirty}) {
      c->format = fmt == 0 ? EntryFormat::mla_bf16() : fmt == 1 ? EntryFormat::mla_fp8() : EntryFormat::mla_fp8_ds();
      c->page = 16;
      c->lens = {5, 37, 16};
      c->layers = 4;
      c->layer = 2;
      c->seed = 7 + fmt;
    }
    clean.garbage = false;
    clean.build();
    dirty.build();
    ASSERT_NE(clean.region, dirty.region);
    const Out a = run_cpu(clean), b = run_cpu(dirty);
    EXPECT_EQ(a.o, b.o) << clean.format.name();
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << clean.format.name();
  }
}

TEST(DecodeMlaCpuEdges, LayerViewEqualsContiguousCache) {
  MlaCase flat, multi;
  for (MlaCase* c : {&flat, &multi}) {
    c->lens = {70, 3};
    c->page = 32;
    c->seed = 99;
  }
  multi.layers = 5;
  multi.layer = 4;
  flat.build();
  multi.build();
  const Out a = run_cpu(flat), b = run_cpu(multi);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
}

// fp8_math = 1 (decode_mla.h): Q and P rounded to e4m3. Against the exact float64 reference the
// output moves, but boundedly (the rounding happens, and stays a few percent on random data);
// length 1 still returns the entry; Q rows whose values e4m3 holds exactly (after the row's power
// of two) give the exact logits, so a length-1 lse equals the reference's.
TEST(DecodeMlaCpuFp8Math, RoundsQAndPBoundedly) {
  MlaCase c;
  c.format = EntryFormat::mla_fp8();
  c.k_scale = 0.75f;
  c.lens = {0, 1, 37, 300};
  c.fp8_math = 1;
  c.seed = 77;
  c.build();
  const Out r = run_cpu(c);
  MlaCase e = c;
  e.fp8_math = 0;
  const Out exact = run_cpu(e);
  std::vector<double> o, lse;
  reference(c, o, lse);
  const size_t per = static_cast<size_t>(c.heads) * kMlaRank;
  for (int b = 0; b < c.batch(); ++b) {
    if (c.lens[b] == 0) {
      for (size_t i = b * per; i < (b + 1) * per; ++i) ASSERT_EQ(r.o[i], 0u);
    } else if (c.lens[b] == 1) {
      for (size_t i = b * per; i < (b + 1) * per; ++i) ASSERT_EQ(r.o[i], exact.o[i]) << "length 1: the entry";
    } else {
      const double err = request_rel_l2(c, b, r.o, [&](size_t i) { return o[i]; });
      EXPECT_GT(err, 1e-3) << "request " << b << ": Q and P were not rounded";
      EXPECT_LT(err, 6e-2) << "request " << b;
    }
  }
}

TEST(DecodeMlaCpuFp8Math, ExactlyRepresentableQKeepsTheLogits) {
  MlaCase c;
  c.format = EntryFormat::mla_fp8();
  c.lens = {1, 1};
  c.fp8_math = 1;
  c.seed = 78;
  c.build();
  // +-(1 + m / 8) 2^k, k in [-7, 0]: 4 significant bits, which e4m3 holds after any row scale that
  // keeps the smallest normal.
  uint64_t st = 12345;
  for (auto& v : c.q) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    const int m = static_cast<int>(st >> 60) & 7, k = -static_cast<int>((st >> 50) & 7);
    v = float_to_bf16(std::ldexp((st >> 40) & 1 ? -(1.0f + m / 8.0f) : 1.0f + m / 8.0f, k));
  }
  const Out r = run_cpu(c);
  std::vector<double> o, lse;
  reference(c, o, lse);
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(r.lse[i], lse[i], 1e-6 * std::max(1.0, std::abs(lse[i])));
}

TEST(DecodeMlaCpuValidate, NamesTheCulprit) {
  MlaCase c;
  c.lens = {20};
  c.build();
  std::vector<uint16_t> o(c.heads * kMlaRank);
  std::vector<float> lse(c.heads);
  auto expect_error = [&](DecodeMlaParams p, const char* what) {
    const Status st = decode_mla_cpu(p);
    ASSERT_FALSE(st.ok()) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st.to_string();
  };
  DecodeMlaParams p = c.params(o.data(), lse.data());
  ASSERT_TRUE(decode_mla_cpu(p).ok());
  {
    DecodeMlaParams x = p;
    x.heads = 24;
    expect_error(x, "heads");
  }
  {
    DecodeMlaParams x = p;
    x.fp8_math = 1;  // a bf16 cache
    expect_error(x, "fp8_math = 1 applies to mla_fp8");
  }
  {
    DecodeMlaParams x = p;
    x.fp8_math = 2;
    expect_error(x, "fp8_math = 2");
  }
  {
    DecodeMlaParams x = p;
    x.o = o.data() + 1;  // 2-byte aligned
    expect_error(x, "o is not 16-byte aligned");
  }
  {
    DecodeMlaParams x = p;
    x.format = EntryFormat::mla_fp8();
    expect_error(x, "dtype");
  }
  {
    DecodeMlaParams x = p;
    x.cache.strides[2] = 2;
    expect_error(x, "stride(2)");
  }
  {
    DecodeMlaParams x = p;
    x.k_scale = 0.5f;
    expect_error(x, "k_scale");
  }
  for (float bad_scale : {0.0f, -0.1f, std::numeric_limits<float>::infinity()}) {
    DecodeMlaParams x = p;
    x.sm_scale = bad_scale;
    expect_error(x, "sm_scale");
  }
  {
    DecodeMlaParams x = p;
    x.mma = 3;
    expect_error(x, "mma");
  }
  {
    DecodeMlaParams x = p;
    x.region_bytes -= 16;
    expect_error(x, "region");
  }
  {
    std::vector<int32_t> lens = {static_cast<int32_t>(c.table_stride * c.page + 1)};
    DecodeMlaParams x = p;
    x.seq_lens = lens.data();
    expect_error(x, "seq_lens[0]");
  }
  {
    std::vector<int32_t> table = c.table;
    table[1] = static_cast<int32_t>(c.blocks);
    DecodeMlaParams x = p;
    x.block_table = table.data();
    expect_error(x, "block_table[0][1]");
  }
  {
    DecodeMlaParams x = p;
    x.format = EntryFormat::mha(8, 128, DType::kBF16);
    expect_error(x, "format");
  }
  {
    DecodeMlaParams x = p;
    x.loader = 3;
    expect_error(x, "loader");
  }
  {
    DecodeMlaParams x = p;
    x.group_warps = 3;
    expect_error(x, "group_warps");
  }
  {
    DecodeMlaParams x = p;
    x.cache.strides[1] = kMlaDim + 4;  // rows 1160 B apart: not 16-byte aligned
    x.cache.sizes[0] = 1;
    expect_error(x, "16-byte");
  }
}

// mla_fp4 is an MLA format the decode does not read: refused as unsupported, by name, before any
// byte of the cache is touched.
TEST(DecodeMlaCpuValidate, RefusesMlaFp4AsUnsupported) {
  MlaCase c;
  c.format = EntryFormat::mla_fp4();
  c.lens = {20};
  c.build();
  std::vector<uint16_t> o(c.heads * kMlaRank);
  std::vector<float> lse(c.heads);
  const DecodeMlaParams p = c.params(o.data(), lse.data());
  for (const Status& st : {validate_decode_mla(p), decode_mla_cpu(p)}) {
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), ErrorCode::kUnsupported) << st.to_string();
    EXPECT_NE(st.message().find("mla_fp4"), std::string::npos) << st.to_string();
  }
}

// Auto: wgmma, except for the fp8 caches at 16 heads (decode_mla_resolved_mma's measurements).
TEST(DecodeMlaPath, AutoPicksMmaSyncForSixteenHeadFp8CachesOnly) {
  DecodeMlaParams p;
  for (EntryFormat f : {EntryFormat::mla_bf16(), EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds()}) {
    p.format = f;
    for (int heads : {16, 32, 64, 128}) {
      p.heads = heads;
      p.mma = 0;
      EXPECT_EQ(f.kind == FormatKind::kMlaBf16 || heads >= 32 ? 2 : 1, decode_mla_resolved_mma(p))
          << f.name() << " heads " << heads;
      p.mma = 1;
      EXPECT_EQ(1, decode_mla_resolved_mma(p));
      p.mma = 2;
      EXPECT_EQ(2, decode_mla_resolved_mma(p));
    }
  }
}

TEST(DecodeMlaPath, WgmmaSplitsFillOneCtaPerSm) {
  MlaCase c;
  c.heads = 128;
  c.page = 64;
  c.lens = {64};
  c.build();
  std::vector<uint16_t> o(1);
  std::vector<float> lse(1);
  DecodeMlaParams p = c.params(o.data(), lse.data());
  p.batch = 64;
  p.block_table_stride = 4096 / 64;  // auto splits only look at the longest possible request
  // 64 requests x 2 head groups = 128 CTAs: one wave on 132 SMs, no split needed.
  EXPECT_EQ(1, decode_mla_auto_splits(p, 132));
  p.heads = 64;  // 64 CTAs: two splits fill the machine
  EXPECT_EQ(2, decode_mla_auto_splits(p, 132));
}

}  // namespace
}  // namespace kvferry
