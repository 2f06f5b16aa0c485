// The CUDA kernels' fast paths (certified one-multiply quantisation, scaled e4m3 dequantisation) give
// the same bits as the scalar math of the CPU twins wherever their predicates accept the input.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>
#include <cfloat>
#include <cmath>

#include "common/datapath_math.h"

namespace kvferry {
namespace {

using namespace kernels::detail;

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }

/// quant2_fast agrees with the exact e4m3(x / s) wherever it claims to; returns how often it
/// claimed (the kernels' fast path rate).
double check_quant(float s, const std::vector<float>& xs) {
  const QDiv d = make_qdiv(s);
  int64_t claimed = 0;
  for (size_t i = 0; i + 1 < xs.size(); i += 2) {
    uint32_t got = 0;
    if (!d.fast || !quant2_fast(xs[i], xs[i + 1], d, &got)) continue;
    ++claimed;
    const uint32_t want = quant_e4m3(xs[i], s) | (static_cast<uint32_t>(quant_e4m3(xs[i + 1], s)) << 8);
    EXPECT_EQ(got, want) << "x bits 0x" << std::hex << float_bits(xs[i]) << " 0x" << float_bits(xs[i + 1])
                         << " s bits 0x" << float_bits(s);
    if (got != want) return -1.0;
  }
  const size_t pairs = xs.size() / 2;
  return static_cast<double>(claimed) / static_cast<double>(pairs);
}

TEST(KernelsFastMath, QuantisedNaNIsTheSameOnHostAndDevice) {
  // A NaN input keeps its sign; a NaN that the division makes is 0x7f (the device's division
  // gives no sign where the host's does).
  EXPECT_EQ(quant_e4m3(bits_float(0x7fc00000u), 0.5f), 0x7f);
  EXPECT_EQ(quant_e4m3(bits_float(0xffc00000u), 0.5f), 0xff);
  EXPECT_EQ(quant_e4m3(bits_float(0xff800001u), INFINITY), 0xff);
  EXPECT_EQ(quant_e4m3(INFINITY, INFINITY), 0x7f);
  EXPECT_EQ(quant_e4m3(-INFINITY, INFINITY), 0x7f);
  EXPECT_EQ(quant_e4m3(0.0f, 0.0f), 0x7f);
  EXPECT_EQ(quant_e4m3(-1.0f, INFINITY), 0x80);  // -0
  EXPECT_EQ(quant_e4m3(1e6f, 1.0f), 0x7e);       // saturates
}

TEST(KernelsFastMath, FastQuantisationIsExact) {
  std::mt19937 g(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Every bit pattern class: random bits (NaN, inf, subnormals, huge), Gaussian data.
  std::vector<float> bits(200000), gauss(200000);
  for (float& x : bits) x = bits_float(static_cast<uint32_t>(g()));
  for (float& x : gauss) x = normal(g);
  for (float s : {0.037f, 0.1f, 3.0f, 1.7f, 0.5f, 1.0f, 448.0f, 1.0f / 448.0f, 0x1p-60f, 0x1.fffffep60f, -0.3f,
                  0x1p-80f, 0x1.fffffep-80f, 0x1.fffffep79f, 0x1p80f}) {
    EXPECT_GE(check_quant(s, bits), 0.0);
    EXPECT_GE(check_quant(s, gauss), 0.0);
  }
  // The kernels' own divisors: tile scales amax/448 of Gaussian tiles; the fast path must be the rule.
  for (int k = 0; k < 300; ++k) {
    std::vector<float> tile(128);
    float amax = 0.0f;
    for (float& x : tile) {
      x = bf16_to_float(float_to_bf16(normal(g) * 3.0f));
      amax = std::fmax(amax, std::fabs(x));
    }
    EXPECT_EQ(check_quant(ds_tile_scale(amax), tile), 1.0);
    EXPECT_GE(check_quant(bits_float(static_cast<uint32_t>(g())), bits), 0.0);
  }
  // Quotients at and next to every e4m3 rounding tie and binade edge: x = s * (tie +- a few ulps).
  for (int k = 0; k < 400; ++k) {
    const float s = bits_float((static_cast<uint32_t>(g()) & 0x807fffffu) | ((47u + g() % 160u) << 23));
    std::vector<float> xs;
    for (uint32_t b = 0; b < 0x7f; ++b) {
      const float v = e4m3_to_float(static_cast<uint8_t>(b)), w = e4m3_to_float(static_cast<uint8_t>(b + 1));
      for (float t : {v, 0.5f * (v + w)})
        for (int dd = -3; dd <= 3; ++dd) {
          const float x = bits_float(float_bits(t * s) + static_cast<uint32_t>(dd));
          xs.push_back(x);
          xs.push_back(-x);
        }
    }
    EXPECT_GE(check_quant(s, xs), 0.0);
  }
  // NaN, infinities and overflowing quotients never take the fast path; signed zeros do.
  uint32_t out = 0;
  EXPECT_FALSE(quant2_fast(bits_float(0x7fc00000u), 1.0f, make_qdiv(0.5f), &out));
  EXPECT_FALSE(quant2_fast(1.0f, bits_float(0xffc00001u), make_qdiv(0.5f), &out));
  EXPECT_FALSE(quant2_fast(1.0f, INFINITY, make_qdiv(0.3f), &out));
  EXPECT_FALSE(quant2_fast(0x1p100f, 1.0f, make_qdiv(0x1p-60f), &out));
  ASSERT_TRUE(quant2_fast(-0.0f, 0.0f, make_qdiv(0.3f), &out));
  EXPECT_EQ(out, 0x0080u);
  EXPECT_FALSE(make_qdiv(0.0f).fast);
  EXPECT_FALSE(make_qdiv(1e-40f).fast);
  EXPECT_FALSE(make_qdiv(0x1p-81f).fast);
  EXPECT_TRUE(make_qdiv(0x1p-80f).fast);
  EXPECT_FALSE(make_qdiv(INFINITY).fast);
}

// quot_ds (one Markstein correction) is exact for what mla_fp8_ds quantises: every positive finite
// bf16 tile maximum whose scale the fast path takes, and every bf16 value of either sign up to it.
// The quotient's bits equal the IEEE division's wherever it is at least 2^-11 (the normal range of
// every step), and its e4m3 byte equals quant_e4m3's everywhere. Exhaustive (about 7 * 10^8 pairs).
TEST(KernelsFastMath, DsTileQuotientIsExact) {
  int64_t pairs = 0, amaxes = 0;
  for (uint32_t ha = 1; ha < 0x7f80u; ++ha) {
    const float amax = bf16_to_float(static_cast<uint16_t>(ha));
    const float s = ds_tile_scale(amax);
    const QDiv d = make_qdiv(s);
    if (!d.fast) continue;
    ++amaxes;
    int64_t bad = 0;
    uint32_t first = 0;
    for (uint32_t hx = 0; hx <= ha; ++hx)
      for (uint32_t sign : {0u, 0x8000u}) {
        const float x = bf16_to_float(static_cast<uint16_t>(hx | sign));
        const float q = quot_ds(x, d), want = x / s;
        const bool ok = to_e4m3(q) == quant_e4m3(x, s) && (std::fabs(want) < 0x1p-11f || same_bits(q, want));
        if (!ok && bad++ == 0) first = hx | sign;
        ++pairs;
      }
    ASSERT_EQ(bad, 0) << "amax bf16 0x" << std::hex << ha << ": first wrong x bf16 0x" << first;
  }
  EXPECT_EQ(amaxes, 0x6bdf - 0x1be0 + 1);  // every amax whose scale lies in [2^-80, 2^80)
  EXPECT_GT(pairs, 700000000);
  // Signed zeros keep their sign, NaN stays NaN.
  EXPECT_EQ(float_bits(quot_ds(-0.0f, make_qdiv(0.3f))), 0x80000000u);
  EXPECT_EQ(float_bits(quot_ds(0.0f, make_qdiv(0.3f))), 0u);
  EXPECT_TRUE(std::isnan(quot_ds(bits_float(0x7fc00000u), make_qdiv(0.3f))));
}

TEST(KernelsFastMath, DequantScaleAndNanBytes) {
  // The hardware e4m3 path is taken for finite scales only (checked bit for bit on the GPU by
  // kernels_datapath_gpu_test); NaN bytes are recognised four at a time.
  EXPECT_TRUE(make_dq_scale(0.037f).fast);
  EXPECT_TRUE(make_dq_scale(0x1.fffffep127f).fast);
  EXPECT_TRUE(make_dq_scale(-2.5f).fast);
  EXPECT_FALSE(make_dq_scale(INFINITY).fast);
  EXPECT_FALSE(make_dq_scale(bits_float(0x7fc00000u)).fast);
  EXPECT_TRUE(has_e4m3_nan(0x0000007fu));
  EXPECT_TRUE(has_e4m3_nan(0xff000000u));
  EXPECT_TRUE(has_e4m3_nan(0x017f0100u));
  EXPECT_FALSE(has_e4m3_nan(0x7e7e7e7eu));
  EXPECT_FALSE(has_e4m3_nan(0xfe80fe00u));
}

TEST(KernelsFastMath, FastScalesAreExact) {
  // Tile and indexer amax values are maxima of bf16/fp16 magnitudes: every bf16 and fp16 value,
  // plus random floats, give the scalar scales' bits.
  std::vector<float> amax;
  for (uint32_t h = 0; h < 0x8000u; ++h) {
    amax.push_back(bf16_to_float(static_cast<uint16_t>(h)));
    amax.push_back(fp16_to_float(static_cast<uint16_t>(h)));
  }
  std::mt19937 g(13);
  for (int k = 0; k < 200000; ++k) amax.push_back(bits_float(static_cast<uint32_t>(g()) & 0x7fffffffu));
  for (float a : amax) {
    ASSERT_EQ(float_bits(ds_tile_scale_fast(a)), float_bits(ds_tile_scale(a)))
        << "amax bits 0x" << std::hex << float_bits(a);
    for (bool ue8m0 : {false, true})
      ASSERT_EQ(float_bits(indexer_scale_fast(a, ue8m0)), float_bits(indexer_scale(a, ue8m0)))
          << "amax bits 0x" << std::hex << float_bits(a);
  }
}

TEST(KernelsFastMath, PowerOfTwoQuantisationIsExact) {
  std::mt19937 g(14);
  std::vector<float> xs(100000);
  for (float& x : xs) x = bits_float(static_cast<uint32_t>(g()));
  for (int k = -40; k <= 20; ++k) {
    const float s = std::ldexp(1.0f, k);
    ASSERT_TRUE(is_pow2_scale(s));
    const QDiv d = make_qdiv(s);
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      uint32_t got = 0;
      if (!quant2_fast<Quot::kPow2>(xs[i], xs[i + 1], d, &got)) continue;
      ASSERT_EQ(got, quant_e4m3(xs[i], s) | (static_cast<uint32_t>(quant_e4m3(xs[i + 1], s)) << 8))
          << "x bits 0x" << std::hex << float_bits(xs[i]) << " 0x" << float_bits(xs[i + 1]) << " s " << s;
    }
  }
  EXPECT_FALSE(is_pow2_scale(3.0f));
  EXPECT_FALSE(is_pow2_scale(-2.0f));
  EXPECT_FALSE(is_pow2_scale(0x1p-90f));
}

}  // namespace
}  // namespace kvferry
