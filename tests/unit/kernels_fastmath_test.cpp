// The CUDA kernels' fast paths (amortised reciprocal division, scaled e4m3 dequantisation) give
// the same bits as the scalar math of the CPU twins wherever their predicates accept the input.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/datapath_math.h"

namespace kvferry {
namespace {

using namespace kernels::detail;

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }

void check_divisor(float s, std::mt19937& g, int samples) {
  const Recip r = make_recip(s);
  int64_t checked = 0;
  for (int i = 0; i < samples; ++i) {
    const float x = bits_float(static_cast<uint32_t>(g()));
    if (!recip_fast(r, x)) continue;
    ++checked;
    ASSERT_TRUE(same_bits(div_recip(x, r), div_rn(x, s)))
        << "x bits 0x" << std::hex << float_bits(x) << " s bits 0x" << float_bits(s);
  }
  if (r.kind != 0) {
    EXPECT_GT(checked, 0);
  }
}

TEST(KernelsFastMath, ReciprocalDivisionIsExact) {
  std::mt19937 g(11);
  // The kernels' own divisors: tile scales amax/448 of bf16 amax values, fixed test scales, powers of two.
  for (float s : {0.037f, 0.1f, 3.0f, 1.7f, 0.5f, 1.0f, 448.0f, 1.0f / 448.0f, 0x1p-60f, 0x1.fffffep60f, -0.3f})
    check_divisor(s, g, 200000);
  for (int k = 0; k < 300; ++k) {
    const float amax = bf16_to_float(static_cast<uint16_t>(g() & 0x7fff));
    check_divisor(ds_tile_scale(amax), g, 20000);
    check_divisor(bits_float(static_cast<uint32_t>(g())), g, 20000);
  }
  // Quotients near binade edges and e4m3 rounding ties: x = s * m (m of few bits) and neighbours.
  for (int k = 0; k < 2000; ++k) {
    const float s = bits_float((static_cast<uint32_t>(g()) & 0x807fffffu) | ((100u + g() % 50u) << 23));
    const Recip r = make_recip(s);
    for (int m = 1; m < 64; ++m) {
      const float x0 = s * (static_cast<float>(m) * 0.0625f);
      for (int d = -2; d <= 2; ++d) {
        const float x = bits_float(float_bits(x0) + static_cast<uint32_t>(d));
        if (!recip_fast(r, x)) continue;
        ASSERT_TRUE(same_bits(div_recip(x, r), div_rn(x, s)))
            << "x bits 0x" << std::hex << float_bits(x) << " s bits 0x" << float_bits(s);
      }
    }
  }
  EXPECT_EQ(make_recip(bits_float(0x7fc00000u)).kind, 0);
  EXPECT_EQ(make_recip(0.0f).kind, 0);
  EXPECT_FALSE(recip_fast(make_recip(0.5f), bits_float(0x7fc00001u)));
  EXPECT_TRUE(recip_fast(make_recip(0.3f), -0.0f));
  EXPECT_TRUE(same_bits(div_recip(-0.0f, make_recip(0.3f)), -0.0f));
}

TEST(KernelsFastMath, ScaledDequantIsExact) {
  std::mt19937 g(12);
  std::vector<float> scales = {0.037f, 1.7f, 0.5f, 1.0f, 0x1.fffffep6f, FLT_MIN, 1e-40f, 0.0f, -2.5f};
  for (int k = 0; k < 2000; ++k) scales.push_back(bits_float(static_cast<uint32_t>(g())));
  for (float s : scales) {
    const DqScale d = make_dq_scale(s);
    if (!d.fast) {
      EXPECT_FALSE(std::fabs(s) < 128.0f) << s;
      continue;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      if ((b & 0x7fu) == 0x7fu) continue;
      ASSERT_EQ(float_to_bf16(dq_fast(b, d)), dequant_bf16(static_cast<uint8_t>(b), s))
          << "byte " << b << " s bits 0x" << std::hex << float_bits(s);
    }
  }
  EXPECT_TRUE(has_e4m3_nan(0x0000007fu));
  EXPECT_TRUE(has_e4m3_nan(0xff000000u));
  EXPECT_TRUE(has_e4m3_nan(0x017f0100u));
  EXPECT_FALSE(has_e4m3_nan(0x7e7e7e7eu));
  EXPECT_FALSE(has_e4m3_nan(0xfe80fe00u));
}

}  // namespace
}  // namespace kvferry
