// mla_fp4 CPU twins: the e2m1 codec against SGLang's quantizer restated literally (scale byte for
// every bf16 amax, codes for every bf16 value), hand-checked groups (ties, zeros, non-finite,
// overflow), the fp4 error bound over extreme scales, the cross-layer equivalence design (layer l
// of a region quantizes to the bytes a one-layer region gets, neighbours untouched), block lists,
// and the load conversions through convert_blocks_cpu.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels_test_util.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/fp4.h"

namespace kvferry {
namespace {

using kernels::ConvertKind;
using kernels::MlaFp4Params;
using test::Region;

constexpr float kE2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

uint16_t bf(float f) { return float_to_bf16(f); }
float fl(uint16_t h) { return bf16_to_float(h); }
uint16_t ld16(const uint8_t* p, int64_t i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
void st16(uint8_t* p, int64_t i, uint16_t v) { std::memcpy(p + 2 * i, &v, 2); }

// SGLang's batched_quantize for one group, restated step by step in fp32 as the compiled graph
// computes it (amax, clamp(amax / 6, 1e-10), ceil(log2), +127; x / 2^e; count of bounds reached),
// except that the scaled value is taken exactly (double): its fp32 quotient can underflow to -0.0
// for values below 2^-126 after scaling, where the sign of the zero code is the engine's.
uint8_t reference_group(const uint16_t* x, uint8_t* codes) {
  float amax = 0;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(fl(x[i])));
  const int e = static_cast<int>(std::ceil(std::log2(std::max(amax / 6.0f, 1e-10f))));
  const double bounds[7] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
  for (int i = 0; i < 16; ++i) {
    const double s = static_cast<double>(fl(x[i])) / std::ldexp(1.0, e);
    int m = 0;
    for (double b : bounds) m += std::fabs(s) >= b;
    codes[i] = static_cast<uint8_t>((s < 0 ? 8 : 0) | m);
  }
  return static_cast<uint8_t>(e + 127);
}

std::vector<uint8_t> unpack(const uint8_t* packed) {
  std::vector<uint8_t> c(16);
  for (int i = 0; i < 8; ++i) {
    c[2 * i] = packed[i] & 0x0f;
    c[2 * i + 1] = packed[i] >> 4;
  }
  return c;
}

TEST(Fp4Codec, AllSixteenCodesDecode) {
  for (int c = 0; c < 16; ++c) {
    const float v = kernels::e2m1_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(v, kE2m1[c]) << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << c;  // code 8 is -0
    // Scale byte 127 is 2^0: the bf16 of the code's value.
    EXPECT_EQ(kernels::mla_fp4_to_bf16(static_cast<uint8_t>(c), 127), bf(kE2m1[c])) << c;
  }
}

// Decode against upstream's arithmetic, bf16(float(e2m1) * exp2(byte - 127)) in fp32, for every code
// and every scale byte (subnormal results and overflow to inf included); 0xFF is the +inf scale.
TEST(Fp4Codec, DecodeMatchesFp32ProductForEveryScaleByte) {
  for (int sb = 0; sb < 256; ++sb)
    for (int c = 0; c < 16; ++c) {
      const float scale = sb == 255 ? INFINITY : static_cast<float>(std::ldexp(1.0, sb - 127));
      const float prod = kE2m1[c] * scale;  // exact or +-inf; 0 * inf is NaN
      const uint16_t got = kernels::mla_fp4_to_bf16(static_cast<uint8_t>(c), static_cast<uint8_t>(sb));
      if (std::isnan(prod)) {
        EXPECT_EQ(got, 0x7fc0) << "code " << c << " scale byte " << sb;
      } else {
        EXPECT_EQ(got, bf(prod)) << "code " << c << " scale byte " << sb;
        if (!std::isinf(fl(got))) {
          EXPECT_EQ(static_cast<double>(fl(got)), static_cast<double>(kE2m1[c]) * std::ldexp(1.0, sb - 127))
              << "code " << c << " scale byte " << sb << " is not exact";
        }
      }
    }
}

// The scale byte for every finite bf16 amax equals upstream's fp32 formula (this checks the claim
// that amax / 6 never rounds across a power of two).
TEST(Fp4Codec, GroupExponentMatchesUpstreamForEveryBf16Amax) {
  for (uint32_t a = 0; a < 0x7f80; ++a) {
    const float amax = fl(static_cast<uint16_t>(a));
    const int want = static_cast<int>(std::ceil(std::log2(std::max(amax / 6.0f, 1e-10f))));
    ASSERT_EQ(kernels::mla_fp4_group_exponent(static_cast<uint16_t>(a)), want) << "amax bits " << a;
  }
  EXPECT_EQ(kernels::mla_fp4_group_exponent(0) + 127, 94);        // all-zero group
  EXPECT_EQ(kernels::mla_fp4_group_exponent(0x7f7f) + 127, 253);  // bf16 max
  EXPECT_EQ(kernels::mla_fp4_group_exponent(bf(6.0f)), 0);
  EXPECT_EQ(kernels::mla_fp4_group_exponent(bf(6.0f * 1.0078125f)), 1);
}

// Every finite bf16 value, in a group whose exponent is its own and a few larger ones.
TEST(Fp4Codec, EncodeMatchesUpstreamForEveryBf16Value) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7fff) >= 0x7f80) continue;
    const int e0 = kernels::mla_fp4_group_exponent(static_cast<uint16_t>(h & 0x7fff));
    for (int de : {0, 1, 3, 40}) {
      const int e = e0 + de;
      if (e > 126) continue;
      uint16_t g[16];
      for (uint16_t& v : g) v = 0;
      g[0] = static_cast<uint16_t>(h);
      // Pins the group's exponent at e (6 * 2^126 is past bf16: bf16's max has exponent 126 too).
      g[5] = e == 126 ? uint16_t{0x7f7f} : bf(static_cast<float>(std::ldexp(6.0, e)));
      uint8_t want[16], packed[8];
      const uint8_t ws = reference_group(g, want);
      if (std::ldexp(std::fabs(static_cast<double>(fl(g[0]))), -e) < std::ldexp(1.0, -126)) continue;
      ASSERT_EQ(kernels::mla_fp4_quantize_group(g, packed), ws) << "bits " << h << " e " << e;
      ASSERT_EQ(unpack(packed)[0], want[0]) << "bits " << h << " e " << e;
      ASSERT_EQ(kernels::mla_fp4_encode(static_cast<uint16_t>(h), e), want[0]) << "bits " << h << " e " << e;
    }
  }
}

TEST(Fp4Codec, HandCheckedGroupAndNibbleOrder) {
  // amax 6 -> e = 0, scale byte 127; element 2i in the low nibble of byte i.
  const float x[16] = {6, -6, 3, 0.5f, -1.5f, 4, 0, 2, 1, -0.5f, 5.9f, 0.2f, -0.2f, -0.0f, 1.1f, -3.2f};
  const uint8_t codes[16] = {7, 0xf, 5, 1, 0xb, 6, 0, 4, 2, 9, 7, 0, 8, 0, 2, 0xd};
  uint16_t g[16];
  for (int i = 0; i < 16; ++i) g[i] = bf(x[i]);
  uint8_t packed[8];
  ASSERT_EQ(kernels::mla_fp4_quantize_group(g, packed), 127);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[i], codes[2 * i] | codes[2 * i + 1] << 4) << i;
  EXPECT_EQ(packed[0], 0xf7);
  uint16_t back[16];
  kernels::mla_fp4_dequantize_group(packed, 127, back);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(back[i], bf(kE2m1[codes[i]])) << i;
  EXPECT_EQ(back[12], 0x8000);  // -0.2 rounds to zero and keeps its sign: -0
  EXPECT_EQ(back[13], 0x0000);  // -0.0 is not < 0: +0
}

// Ties go away from zero (the bounds are reached with >=), not to even: 0.25, 1.25, 2.5 and 5 differ
// from RNE (which FlashInfer's hardware cvt.rn.satfinite.e2m1x2 would give); just below a tie rounds down.
TEST(Fp4Codec, TiesRoundAwayFromZero) {
  const float ties[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (int e : {-33, -5, 0, 7, 120}) {
    for (int k = 0; k < 7; ++k)
      for (float sgn : {1.0f, -1.0f}) {
        const uint16_t t = bf(sgn * static_cast<float>(std::ldexp(ties[k], e)));
        const uint8_t s = sgn < 0 ? 8 : 0;
        EXPECT_EQ(kernels::mla_fp4_encode(t, e), s | (k + 1)) << ties[k] << " e " << e;
        const uint16_t below = static_cast<uint16_t>(t - 1);  // next bf16 toward zero
        EXPECT_EQ(kernels::mla_fp4_encode(below, e), s | k) << ties[k] << " e " << e;
      }
  }
}

TEST(Fp4Codec, ZerosAndTinyGroups) {
  uint16_t g[16] = {};
  g[3] = 0x8000;  // -0.0
  uint8_t packed[8];
  EXPECT_EQ(kernels::mla_fp4_quantize_group(g, packed), 94);  // 2^-33: SGLang's 1e-10 floor
  for (uint8_t b : packed) EXPECT_EQ(b, 0);
  // Bf16 subnormals keep the floor exponent; all of them are far below its first bound.
  for (uint16_t& v : g) v = 0x0001;
  g[1] = 0x807f;
  EXPECT_EQ(kernels::mla_fp4_quantize_group(g, packed), 94);
  EXPECT_EQ(packed[0], 0x80);  // 0x807f < 0: sign kept, magnitude 0
  // The floor still quantizes values at its scale: 6 * 2^-33 is code 7.
  g[0] = bf(static_cast<float>(std::ldexp(6.0, -33)));
  EXPECT_EQ(kernels::mla_fp4_quantize_group(g, packed), 94);
  EXPECT_EQ(packed[0] & 0x0f, 7);
}

// Inf and NaN: SGLang's code has no defined result there (log2(inf), a NaN max cast to uint8); the
// group is marked with scale 0xFF, infinities keep their sign and everything else decodes to NaN.
TEST(Fp4Codec, NonFiniteGroups) {
  uint16_t g[16];
  for (int i = 0; i < 16; ++i) g[i] = bf(static_cast<float>(i));
  g[2] = 0x7f80;   // +inf
  g[7] = 0xff80;   // -inf
  g[10] = 0x7fc1;  // NaN
  uint8_t packed[8];
  ASSERT_EQ(kernels::mla_fp4_quantize_group(g, packed), 0xFF);
  const auto c = unpack(packed);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(c[i], i == 2 ? 7 : i == 7 ? 0xf : 0) << i;
  uint16_t back[16];
  kernels::mla_fp4_dequantize_group(packed, 0xFF, back);
  for (int i = 0; i < 16; ++i) {
    if (i == 2)
      EXPECT_EQ(back[i], 0x7f80);
    else if (i == 7)
      EXPECT_EQ(back[i], 0xff80);
    else
      EXPECT_TRUE(std::isnan(fl(back[i]))) << i;
  }
  for (uint16_t& v : g) v = 0;
  g[9] = 0xffc0;  // a NaN alone
  EXPECT_EQ(kernels::mla_fp4_quantize_group(g, packed), 0xFF);
}

// Groups near bf16's top: amax <= 1.5 * 2^127 decodes finite; above, codes 4 and 6 at scale 2^126
// are 2^128 and more, which bf16 (as upstream's fp32 product) cannot hold: +-inf.
TEST(Fp4Codec, TopBinadeOverflowsToInf) {
  uint16_t g[16] = {};
  uint8_t packed[8];
  uint16_t back[16];
  g[0] = 0x7f40;  // 1.5 * 2^127 = 6 * 2^125
  g[1] = 0xff40;
  ASSERT_EQ(kernels::mla_fp4_quantize_group(g, packed), 125 + 127);
  kernels::mla_fp4_dequantize_group(packed, 125 + 127, back);
  EXPECT_EQ(back[0], 0x7f40);
  EXPECT_EQ(back[1], 0xff40);
  g[0] = 0x7f7f;  // bf16 max
  ASSERT_EQ(kernels::mla_fp4_quantize_group(g, packed), 126 + 127);
  kernels::mla_fp4_dequantize_group(packed, 126 + 127, back);
  EXPECT_EQ(back[0], 0x7f80);  // 3.98 * 2^126 -> code 4 -> 2^128
  EXPECT_EQ(back[1], 0xff40);  // 1.5 * 2^127 -> code 5 (3) at 2^126: finite
}

/// Half the e2m1 step at |x| / 2^e, times 2^e: the bound of one element.
double fp4_bound(double ax, int e) {
  const double s = std::ldexp(ax, -e);
  return std::ldexp(s <= 2 ? 0.25 : s <= 4 ? 0.5 : 1.0, e);
}

// Random groups over extreme scales (2^-140 .. 2^125 and mixed within a group): every element is
// within half an e2m1 step (times the group's scale) of its input; exactly representable groups
// round-trip exactly.
TEST(Fp4Codec, QuantizeDequantizeWithinTheFp4Bound) {
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(-140, 124);  // |x| stays below bf16's max
  for (int it = 0; it < 200000; ++it) {
    uint16_t x[16];
    const int e0 = ed(g);
    const bool mixed = it % 4 == 0;
    for (uint16_t& v : x) v = bf(static_cast<float>(std::ldexp(nd(g), mixed ? ed(g) : e0)));
    uint8_t packed[8];
    const uint8_t sb = kernels::mla_fp4_quantize_group(x, packed);
    ASSERT_NE(sb, 0xFF);
    const int e = sb - 127;
    uint16_t back[16];
    kernels::mla_fp4_dequantize_group(packed, sb, back);
    for (int i = 0; i < 16; ++i) {
      const double xi = fl(x[i]), di = fl(back[i]);
      if (std::isinf(di)) continue;  // the top binade (TopBinadeOverflowsToInf)
      ASSERT_LE(std::fabs(xi - di), fp4_bound(std::fabs(xi), e)) << "x " << xi << " deq " << di << " e " << e;
      ASSERT_TRUE(di == 0 || std::signbit(di) == std::signbit(xi));
    }
  }
  // Representable groups: codes times 2^e with a +-6 pinning the exponent.
  std::uniform_int_distribution<int> cd(0, 15);
  for (int it = 0; it < 20000; ++it) {
    const int e = std::uniform_int_distribution<int>(-33, 125)(g);
    uint16_t x[16];
    for (uint16_t& v : x) v = bf(static_cast<float>(std::ldexp(kE2m1[cd(g)], e)));
    x[it % 16] = bf(static_cast<float>(std::ldexp(it % 2 ? 6.0 : -6.0, e)));
    uint8_t packed[8];
    ASSERT_EQ(kernels::mla_fp4_quantize_group(x, packed), e + 127);
    uint16_t back[16];
    kernels::mla_fp4_dequantize_group(packed, static_cast<uint8_t>(e + 127), back);
    for (int i = 0; i < 16; ++i) ASSERT_EQ(back[i], x[i] == 0x8000 ? 0 : x[i]) << i << " e " << e;
  }
}

// ---- regions ----

/// Random finite bf16 entries with per-token scales spread over many binades.
void fill_bf16(Region& r, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(-30, 30);
  for (int64_t l = 0; l < r.spec.layers; ++l)
    for (int64_t b = 0; b < r.spec.blocks; ++b)
      for (int64_t t = 0; t < r.spec.block_size; ++t) {
        uint8_t* p = r.bytes.data() + r.spec.page_offset(l, b) + t * kMlaBf16Bytes;
        const int e = ed(g);
        for (int i = 0; i < kMlaDim; ++i) st16(p, i, bf(static_cast<float>(std::ldexp(nd(g), e))));
      }
}

MlaFp4Params layer_params(Region& h, Region& f, int64_t l) {
  MlaFp4Params p;
  p.bf16 = h.layer(l);
  p.values = {f.bytes.data(), f.bytes.ssize(), f.spec.mla_fp4_values_view(l)};
  p.scales = {f.bytes.data(), f.bytes.ssize(), f.spec.mla_fp4_scales_view(l)};
  p.count = h.spec.blocks;
  return p;
}

struct Case {
  int64_t layers, blocks, bs;
  Layout layout;
};

std::string name(const Case& c) {
  return "L" + std::to_string(c.layers) + " NB" + std::to_string(c.blocks) + " BS" + std::to_string(c.bs) +
         (c.layout == Layout::kBlockMajor ? " block_major" : " layer_major");
}

const Case kCases[] = {{1, 1, 64, Layout::kBlockMajor}, {3, 4, 64, Layout::kBlockMajor},
                       {3, 4, 3, Layout::kBlockMajor},  {5, 3, 16, Layout::kLayerMajor},
                       {61, 2, 1, Layout::kBlockMajor}, {2, 0, 64, Layout::kBlockMajor}};

// Quantizing layer l of a region writes exactly the bytes a one-layer region gets, and nothing else;
// dequantizing it reads only layer l (the other layers hold garbage).
TEST(Fp4Regions, CrossLayerViewsAreBitIdenticalToOneLayer) {
  for (const Case& c : kCases) {
    const auto hs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_bf16(), c.layout);
    const auto fs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_fp4(), c.layout);
    const auto hs1 = test::mk_spec(1, c.blocks, c.bs, EntryFormat::mla_bf16());
    const auto fs1 = test::mk_spec(1, c.blocks, c.bs, EntryFormat::mla_fp4());
    Region h(hs, 1), f(fs, 2);
    fill_bf16(h, 3);
    for (int64_t l : {int64_t{0}, c.layers / 2, c.layers - 1}) {
      Region h1(hs1, 4), f1(fs1, 5);
      test::copy_layer(h, l, h1, false);
      ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(layer_params(h1, f1, 0)).ok());
      Region expect(fs, 0);  // the region as before, with layer l replaced by the one-layer bytes
      std::memcpy(expect.bytes.data(), f.bytes.data(), f.bytes.size());
      test::copy_layer(expect, l, f1, true);
      ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(layer_params(h, f, l)).ok()) << name(c);
      EXPECT_TRUE(f.bytes == expect.bytes) << name(c) << " layer " << l;

      // Dequantize layer l of the region into a garbage bf16 region vs the one-layer result.
      Region back(hs, 7), back1(hs1, 8);
      ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(layer_params(back1, f1, 0)).ok());
      ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(layer_params(back, f, l)).ok());
      Region bl(hs1, 9);
      test::copy_layer(back, l, bl, false);
      EXPECT_TRUE(bl.bytes == back1.bytes) << name(c) << " layer " << l;
    }
  }
}

// All layers at once (make_mla_fp4_params) equal layer by layer; more threads give the same bytes;
// the result round-trips within the bound.
TEST(Fp4Regions, AllLayersAndThreadsAgree) {
  for (const Case& c : kCases) {
    const auto hs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_bf16(), c.layout);
    const auto fs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_fp4(), c.layout);
    Region h(hs, 11), a(fs, 12), b(fs, 12);
    fill_bf16(h, 13);
    auto all = kernels::make_mla_fp4_params(h.bytes.data(), hs, a.bytes.data(), fs);
    ASSERT_TRUE(all.ok()) << all.status().to_string();
    all->count = c.blocks;
    ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(*all, {3}).ok());
    for (int64_t l = 0; l < c.layers; ++l) ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(layer_params(h, b, l)).ok());
    EXPECT_TRUE(a.bytes == b.bytes) << name(c);
    Region back(hs, 14);
    auto inv = kernels::make_mla_fp4_params(back.bytes.data(), hs, a.bytes.data(), fs);
    ASSERT_TRUE(inv.ok());
    inv->count = c.blocks;
    ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(*inv, {2}).ok());
    for (int64_t l = 0; l < c.layers; ++l)
      for (int64_t blk = 0; blk < c.blocks; ++blk)
        for (int64_t t = 0; t < c.bs; ++t) {
          const uint8_t* x = h.bytes.data() + hs.page_offset(l, blk) + t * kMlaBf16Bytes;
          const uint8_t* d = back.bytes.data() + hs.page_offset(l, blk) + t * kMlaBf16Bytes;
          const uint8_t* sc =
              a.bytes.data() + fs.page_offset(l, blk) + fs.mla_fp4_scale_plane_offset() + t * kMlaFp4ScaleBytes;
          for (int i = 0; i < kMlaDim; ++i) {
            const double xi = fl(ld16(x, i)), di = fl(ld16(d, i));
            ASSERT_LE(std::fabs(xi - di), fp4_bound(std::fabs(xi), sc[i / 16] - 127)) << name(c);
          }
        }
  }
}

TEST(Fp4Regions, BlockListsMapBlocks) {
  const auto hs = test::mk_spec(3, 6, 8, EntryFormat::mla_bf16());
  const auto fs = test::mk_spec(3, 5, 8, EntryFormat::mla_fp4(), Layout::kLayerMajor);
  Region h(hs, 21), f(fs, 22), g(fs, 22);
  fill_bf16(h, 23);
  const std::vector<int64_t> hb{5, 0, 3}, fb{1, 4, 2};
  auto p = kernels::make_mla_fp4_params(h.bytes.data(), hs, f.bytes.data(), fs);
  ASSERT_TRUE(p.ok());
  p->bf16_blocks = hb.data();
  p->fp4_blocks = fb.data();
  p->count = 3;
  ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(*p).ok());
  for (size_t i = 0; i < hb.size(); ++i) {  // one block at a time, by shifting the views
    auto q = kernels::make_mla_fp4_params(h.bytes.data(), hs, g.bytes.data(), fs);
    q->bf16.view.offset += hb[i] * hs.block_stride_bytes();
    q->values.view.offset += fb[i] * fs.block_stride_bytes();
    q->scales.view.offset += fb[i] * fs.block_stride_bytes();
    q->bf16.view.sizes[0] = q->values.view.sizes[0] = q->scales.view.sizes[0] = 1;
    q->count = 1;
    ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(*q).ok());
  }
  EXPECT_TRUE(f.bytes == g.bytes);
  const std::vector<int64_t> bad{9, 0, 0};
  p->bf16_blocks = bad.data();
  EXPECT_EQ(kernels::quantize_mla_fp4_cpu(*p).code(), ErrorCode::kOutOfRange);
}

TEST(Fp4Regions, ValidationRejectsBadViews) {
  const auto hs = test::mk_spec(2, 4, 8, EntryFormat::mla_bf16());
  const auto fs = test::mk_spec(2, 4, 8, EntryFormat::mla_fp4());
  Region h(hs, 1), f(fs, 2);
  auto ok = kernels::make_mla_fp4_params(h.bytes.data(), hs, f.bytes.data(), fs);
  ASSERT_TRUE(ok.ok());
  ok->count = 4;
  ASSERT_TRUE(kernels::validate_mla_fp4(*ok).ok());
  auto p = *ok;
  p.count = 5;
  EXPECT_EQ(kernels::validate_mla_fp4(p).code(), ErrorCode::kOutOfRange);
  p = *ok;
  p.values.view.offset += 2;
  EXPECT_EQ(kernels::validate_mla_fp4(p).code(), ErrorCode::kMisaligned);
  p = *ok;
  p.scales.view.sizes[2] = 32;
  EXPECT_FALSE(kernels::validate_mla_fp4(p).ok());
  p = *ok;
  p.layers = 3;  // the third layer runs past the regions
  EXPECT_FALSE(kernels::validate_mla_fp4(p).ok());
  p = *ok;
  p.bf16_blocks = &p.count;
  EXPECT_EQ(kernels::validate_mla_fp4(p).code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(kernels::make_mla_fp4_params(f.bytes.data(), fs, h.bytes.data(), hs).ok());
  EXPECT_FALSE(
      kernels::make_mla_fp4_params(h.bytes.data(), hs, f.bytes.data(), test::mk_spec(2, 4, 16, EntryFormat::mla_fp4()))
          .ok());
}

// ---- load conversions ----

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST(Fp4Convert, Bf16AndFp4ThroughConvertBlocksMatchTheKernels) {
  for (const Case& c : kCases) {
    const auto hs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_bf16(), c.layout);
    const auto fs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_fp4(),
                                  c.layout == Layout::kBlockMajor ? Layout::kLayerMajor : Layout::kBlockMajor);
    Region h(hs, 31), viaconv(fs, 32), direct(fs, 32);
    fill_bf16(h, 33);
    const auto ids = iota(c.blocks);
    const Status st = kernels::convert_blocks_cpu(h.bytes.data(), hs, ids, viaconv.bytes.data(), fs, ids, {2});
    ASSERT_TRUE(st.ok()) << name(c) << ": " << st.to_string();
    auto p = kernels::make_mla_fp4_params(h.bytes.data(), hs, direct.bytes.data(), fs);
    p->count = c.blocks;
    ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(*p).ok());
    EXPECT_TRUE(viaconv.bytes == direct.bytes) << name(c);
    Region b1(hs, 34), b2(hs, 34);
    ASSERT_TRUE(kernels::convert_blocks_cpu(viaconv.bytes.data(), fs, ids, b1.bytes.data(), hs, ids).ok());
    auto q = kernels::make_mla_fp4_params(b2.bytes.data(), hs, direct.bytes.data(), fs);
    q->count = c.blocks;
    ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(*q).ok());
    EXPECT_TRUE(b1.bytes == b2.bytes) << name(c);
  }
}

// fp8 -> fp4 is e4m3 -> bf16 (exact) -> fp4; ds -> fp4 is the ds dequantization -> fp4; fp4 -> ds
// is the exact fp4 dequantization -> bf16 -> ds.
TEST(Fp4Convert, ThroughBf16) {
  const auto s8 = test::mk_spec(3, 4, 8, EntryFormat::mla_fp8());
  const auto sds = test::mk_spec(3, 4, 8, EntryFormat::mla_fp8_ds());
  const auto sbf = test::mk_spec(3, 4, 8, EntryFormat::mla_bf16());
  const auto s4 = test::mk_spec(3, 4, 8, EntryFormat::mla_fp4(), Layout::kLayerMajor);
  const auto ids = iota(4);
  using test::fill_valid;
  for (const KvCacheSpec* src : {&s8, &sds}) {
    Region a(*src, 41), mid(sbf, 42), want(s4, 43), got(s4, 44);
    fill_valid(a, 45);
    if (src == &sds) {
      ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), sds, ids, mid.bytes.data(), sbf, ids).ok());
    } else {  // there is no fp8 -> bf16 conversion: widen by hand (exact)
      for (int64_t l = 0; l < 3; ++l)
        for (int64_t b = 0; b < 4; ++b)
          for (int64_t t = 0; t < 8; ++t)
            for (int i = 0; i < kMlaDim; ++i)
              st16(mid.bytes.data() + sbf.page_offset(l, b) + t * kMlaBf16Bytes, i,
                   bf(e4m3_to_float(a.bytes.data()[s8.page_offset(l, b) + t * kMlaFp8Bytes + i])));
    }
    ASSERT_TRUE(kernels::convert_blocks_cpu(mid.bytes.data(), sbf, ids, want.bytes.data(), s4, ids).ok());
    ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), *src, ids, got.bytes.data(), s4, ids).ok());
    EXPECT_TRUE(got.bytes == want.bytes) << src->format.name();
  }
  Region f(s4, 51), mid(sbf, 52), want(sds, 53), got(sds, 54);
  Region h(sbf, 55);
  fill_bf16(h, 56);
  ASSERT_TRUE(kernels::convert_blocks_cpu(h.bytes.data(), sbf, ids, f.bytes.data(), s4, ids).ok());
  ASSERT_TRUE(kernels::convert_blocks_cpu(f.bytes.data(), s4, ids, mid.bytes.data(), sbf, ids).ok());
  ASSERT_TRUE(kernels::convert_blocks_cpu(mid.bytes.data(), sbf, ids, want.bytes.data(), sds, ids).ok());
  ASSERT_TRUE(kernels::convert_blocks_cpu(f.bytes.data(), s4, ids, got.bytes.data(), sds, ids).ok());
  EXPECT_TRUE(got.bytes == want.bytes);
}

// fp4 -> fp8 is exact when every decoded value is an e4m3 value; blocks that are not are reported.
// fp8 -> fp4 -> fp8 of e4m3 values that fp4 holds exactly comes back bit for bit.
TEST(Fp4Convert, Fp4ToFp8ReportsLoss) {
  const auto s8 = test::mk_spec(2, 3, 4, EntryFormat::mla_fp8());
  const auto s4 = test::mk_spec(2, 3, 4, EntryFormat::mla_fp4());
  const auto ids = iota(3);
  Region a(s8, 61), f(s4, 62), back(s8, 63);
  std::mt19937 g(64);
  // e4m3 values of the form e2m1 * 2^k, k in [-6, 6] per 16-group, a +-6 * 2^k in each group.
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t t = 0; t < 4; ++t) {
        uint8_t* p = a.bytes.data() + s8.page_offset(l, b) + t * kMlaFp8Bytes;
        for (int grp = 0; grp < kernels::kMlaFp4Groups; ++grp) {
          const int k = std::uniform_int_distribution<int>(-6, 6)(g);
          for (int i = 0; i < 16; ++i) {
            const float v = i == 3 ? 6.0f : kE2m1[g() % 8] * (g() % 2 ? 1.0f : -1.0f) + 0.0f;
            p[grp * 16 + i] = float_to_e4m3(static_cast<float>(std::ldexp(v, k)));
          }
        }
      }
  // Block 1 of layer 1 gets a group of 448s: scale 2^7, 448 / 128 = 3.5 -> 4 -> 512, past e4m3: lossy.
  uint8_t* big = a.bytes.data() + s8.page_offset(1, 1);
  for (int i = 0; i < 16; ++i) big[i] = 0x7e;
  ASSERT_TRUE(kernels::convert_blocks_cpu(a.bytes.data(), s8, ids, f.bytes.data(), s4, ids).ok());
  std::vector<int64_t> bad;
  ASSERT_TRUE(kernels::convert_blocks_cpu(f.bytes.data(), s4, ids, back.bytes.data(), s8, ids, {}, &bad).ok());
  // The first block and the last are lossless and bit-exact.
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t b : {0, 2})
      EXPECT_EQ(std::memcmp(a.bytes.data() + s8.page_offset(l, b), back.bytes.data() + s8.page_offset(l, b),
                            static_cast<size_t>(s8.page_bytes())),
                0)
          << l << " " << b;
  EXPECT_EQ(bad, std::vector<int64_t>({1}));
}

TEST(Fp4Convert, KindsAndDeviceSupport) {
  const auto s4 = test::mk_spec(1, 1, 4, EntryFormat::mla_fp4());
  const std::pair<EntryFormat, ConvertKind> to4[] = {{EntryFormat::mla_bf16(), ConvertKind::kBf16ToFp4},
                                                     {EntryFormat::mla_fp8(), ConvertKind::kFp8ToFp4},
                                                     {EntryFormat::mla_fp8_ds(), ConvertKind::kDsToFp4}};
  const std::pair<EntryFormat, ConvertKind> from4[] = {{EntryFormat::mla_bf16(), ConvertKind::kFp4ToBf16},
                                                       {EntryFormat::mla_fp8(), ConvertKind::kFp4ToFp8},
                                                       {EntryFormat::mla_fp8_ds(), ConvertKind::kFp4ToDs}};
  Region f(s4, 1);
  for (const auto& [fmt, kind] : to4) {
    Region o(test::mk_spec(1, 1, 4, fmt), 2);
    auto p = kernels::make_convert_params(o.bytes.data(), o.spec, f.bytes.data(), s4);
    ASSERT_TRUE(p.ok()) << fmt.name();
    EXPECT_EQ(p->kind, kind);
    EXPECT_TRUE(kernels::is_fp4_convert(kind));
    EXPECT_EQ(kernels::check_convert_on_device(kind).code(), ErrorCode::kUnsupported);
  }
  for (const auto& [fmt, kind] : from4) {
    Region o(test::mk_spec(1, 1, 4, fmt), 2);
    auto p = kernels::make_convert_params(f.bytes.data(), s4, o.bytes.data(), o.spec);
    ASSERT_TRUE(p.ok()) << fmt.name();
    EXPECT_EQ(p->kind, kind);
    EXPECT_EQ(kernels::check_convert_on_device(kind).code(), ErrorCode::kUnsupported);
  }
  EXPECT_TRUE(kernels::check_convert_on_device(ConvertKind::kBf16ToDs).ok());
  EXPECT_FALSE(kernels::is_fp4_convert(ConvertKind::kDsToFp8));
  // An fp4 side must be a dense page view.
  Region h(test::mk_spec(1, 2, 4, EntryFormat::mla_bf16()), 3), f2(test::mk_spec(1, 2, 4, EntryFormat::mla_fp4()), 4);
  auto p = kernels::make_convert_params(h.bytes.data(), h.spec, f2.bytes.data(), f2.spec);
  ASSERT_TRUE(p.ok());
  p->count = 1;
  ASSERT_TRUE(kernels::validate_convert(*p).ok());
  p->dst.view.strides[1] = 328;
  p->src.view.sizes[0] = p->dst.view.sizes[0] = 1;
  const Status st = kernels::validate_convert(*p);
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.message().find("dense"), std::string::npos) << st.to_string();
  EXPECT_EQ(kernels::make_convert_params(f.bytes.data(), s4, f.bytes.data(), s4).status().code(),
            ErrorCode::kUnsupported);
}

}  // namespace
}  // namespace kvferry
