#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvferry/layouts/dtype.h"

namespace kvferry {
namespace {

// Independent reference: nearest finite e4m3 by exhaustive search, ties to the even code,
// saturating to +-448, NaN -> 0x7F with the sign.
uint8_t ref_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFF : 0x7F;
  const bool neg = std::signbit(x);
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return neg ? 0xFE : 0x7E;
  int best = 0;
  double best_d = 1e300;
  for (int c = 0; c < 0x7F; ++c) {  // non-negative finite codes 0x00..0x7E
    const double v = e4m3_to_float(static_cast<uint8_t>(c));
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (neg ? 0x80 : 0));
}

TEST(E4M3, AllCodesRoundTripThroughFloat) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t b = static_cast<uint8_t>(c);
    const float f = e4m3_to_float(b);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(float_to_e4m3(f) & 0x7F, 0x7F) << c;
      continue;
    }
    EXPECT_EQ(float_to_e4m3(f), b) << "code " << c << " value " << f;
  }
}

TEST(E4M3, KnownValues) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(-2.0f), 0xC0);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(E4M3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);  // would round to 480 without saturation
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
}

TEST(E4M3, TiesRoundToEven) {
  // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): goes to 1.0.
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  // 1.1875 lies between 1.125 (0x39) and 1.25 (0x3A, even): goes to 1.25.
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);
  // Subnormal tie: 1.5 * 2^-9 between 0x01 and 0x02 (even) -> 0x02; 0.5 * 2^-9 -> 0.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(float_to_e4m3(std::ldexp(0.5f, -9)), 0x00);
  // Tie at the subnormal/normal border: 7.5 * 2^-9 -> 8 * 2^-9 = 0x08 (even).
  EXPECT_EQ(float_to_e4m3(std::ldexp(7.5f, -9)), 0x08);
}

TEST(E4M3, MatchesExhaustiveReferenceOnMidpointsAndRandomValues) {
  std::vector<float> xs;
  for (int c = 0; c < 0x7E; ++c) {  // every midpoint and its float neighbours
    const float lo = e4m3_to_float(static_cast<uint8_t>(c)), hi = e4m3_to_float(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), -mid});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-500.0f, 500.0f);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (int i = 0; i < 20000; ++i) xs.push_back(i % 2 ? u(rng) : n(rng));
  for (float x : xs) ASSERT_EQ(float_to_e4m3(x), ref_e4m3(x)) << "x = " << x;
}

TEST(BF16, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  // 1 + 2^-8 is halfway between 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every non-NaN bf16 round-trips
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), h);
  }
}

TEST(FP16, MatchesTheCompilersConversionExhaustivelyAndOnRandomFloats) {
#ifndef __FLT16_MANT_DIG__  // g++ 12 has _Float16 on x86-64; clang 14 (which clang-tidy uses) has not
  GTEST_SKIP() << "this compiler has no _Float16 to compare with";
#else
  for (uint32_t h = 0; h < 0x10000; ++h) {
    _Float16 ref;
    const uint16_t hb = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hb, 2);
    const float f = fp16_to_float(hb);
    if (std::isnan(static_cast<float>(ref))) {
      ASSERT_TRUE(std::isnan(f));
      continue;
    }
    ASSERT_EQ(float_bits(f), float_bits(static_cast<float>(ref))) << h;
    ASSERT_EQ(float_to_fp16(f), hb) << h;
  }
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = bits_float(bits(rng));
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(float_to_fp16(f), rb) << "f = " << f;
  }
#endif
}

}  // namespace
}  // namespace kvferry
