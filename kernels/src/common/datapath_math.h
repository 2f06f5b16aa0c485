#pragma once
// Scalar math shared by the CUDA kernels and their CPU twins, so both round identically:
// fp32 arithmetic in the same order, IEEE division (__fdiv_rn on the device), layouts' exact
// conversions. Reductions use fmaxf, which is order-independent (NaN inputs are ignored alike).
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/host_device.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace kvferry::kernels::detail {

KVFERRY_HOST_DEVICE float div_rn(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, y);
#else
  return x / y;
#endif
}

KVFERRY_HOST_DEVICE float fmax_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

/// 2-byte float (bf16 or fp16 bits) -> float.
KVFERRY_HOST_DEVICE float half_to_float(uint16_t h, bool is_bf16) {
  return is_bf16 ? bf16_to_float(h) : fp16_to_float(h);
}

/// abs without touching NaN payload semantics that matter here (fmax ignores NaN anyway).
KVFERRY_HOST_DEVICE float abs_f(float x) { return bits_float(float_bits(x) & 0x7fffffffu); }

/// fp8_ds tile scale from the tile's amax: max(amax / 448, FLT_MIN).
KVFERRY_HOST_DEVICE float ds_tile_scale(float amax) { return fmax_f(div_rn(amax, 448.0f), FLT_MIN); }

/// s rounded up to a power of two (ue8m0 scales); s is a positive normal float here.
KVFERRY_HOST_DEVICE float ue8m0_round_up(float s) {
  uint32_t u = float_bits(s);
  if (u & 0x7fffffu) u = (u & 0xff800000u) + 0x800000u;
  return bits_float(u);
}

/// Indexer scale: max(amax, 1e-4) / 448, optionally rounded up to a power of two (ue8m0).
KVFERRY_HOST_DEVICE float indexer_scale(float amax, bool ue8m0) {
  const float s = div_rn(fmax_f(amax, 1e-4f), 448.0f);
  return ue8m0 ? ue8m0_round_up(s) : s;
}

/// float -> e4m3, saturating RNE. On sm_89+ the hardware cvt.rn.satfinite (the same rounding as
/// layouts' float_to_e4m3 for every non-NaN float: tests/gpu/kernels_fp8_exhaustive_test.cu checks
/// all 2^32 inputs); NaN goes through float_to_e4m3 so its sign is kept as on the host.
KVFERRY_HOST_DEVICE uint8_t to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVFERRY_SOFT_FP8)
  if (x != x) return float_to_e4m3(x);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  return float_to_e4m3(x);
#endif
}

/// e4m3(x / s), saturating RNE. A NaN x keeps its sign (as to_e4m3 does); a quotient that only
/// the division makes NaN (inf / inf, 0 / 0) is the NaN code 0x7f, since the host's division gives
/// such a NaN the sign bit and the device's does not (and a device division of a NaN x drops its sign).
KVFERRY_HOST_DEVICE uint8_t quant_e4m3(float x, float s) {
  if (x != x) return float_to_e4m3(x);
  const float q = div_rn(x, s);
  return q != q ? static_cast<uint8_t>(0x7f) : to_e4m3(q);
}

/// bf16 bits of float(e4m3) * s.
KVFERRY_HOST_DEVICE uint16_t dequant_bf16(uint8_t q, float s) { return float_to_bf16(e4m3_to_float(q) * s); }

/// bf16 bits of an e4m3 value (exact, no scale).
KVFERRY_HOST_DEVICE uint16_t e4m3_to_bf16(uint8_t q) { return float_to_bf16(e4m3_to_float(q)); }

/// The e4m3 byte whose value equals bf16 `h`, and whether it is exact (round trip bit-equal).
KVFERRY_HOST_DEVICE bool bf16_to_e4m3_exact(uint16_t h, uint8_t* out) {
  const uint8_t q = to_e4m3(bf16_to_float(h));
  *out = q;
  return e4m3_to_bf16(q) == h;
}

constexpr uint32_t kOneF32Bits = 0x3f800000u;

// ---- the CUDA kernels' fast paths: quantisation through a reciprocal with Markstein corrections,
// exact one-multiply division by powers of two, scales divided by 448 the same way ----
// Each gives the scalar math's bits (quant_e4m3, ds_tile_scale, indexer_scale) wherever it
// reports success; the kernels take the scalar path for the rest (NaN, overflow, extreme scales).
// CPU twins do not use them; tests/unit/kernels_fastmath_test.cpp checks the equalities on the
// host and tests/gpu/kernels_fp8_exhaustive_test.cu for every float on the device.

KVFERRY_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

KVFERRY_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KVFERRY_HOST_DEVICE float recip_rn(float s) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(s);
#else
  return 1.0f / s;
#endif
}

/// Two floats -> two e4m3 bytes (a in the low byte), saturating RNE; the packed hardware cvt on
/// sm_89+, which equals to_e4m3 for every non-NaN input (a NaN gives 0x7f whatever its sign).
KVFERRY_HOST_DEVICE uint32_t cvt_e4m3x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVFERRY_SOFT_FP8)
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
#else
  const uint32_t lo = a != a ? 0x7fu : float_to_e4m3(a);
  const uint32_t hi = b != b ? 0x7fu : float_to_e4m3(b);
  return lo | (hi << 8);
#endif
}

/// A quantisation divisor s with y = RN(1/s). fast: |s| in [2^-80, 2^80], where quot_fast below
/// needs no per-value range check.
struct QDiv {
  float s = 1.0f;
  float y = 1.0f;
  bool fast = false;
};

KVFERRY_HOST_DEVICE QDiv make_qdiv(float s) {
  QDiv d;
  d.s = s;
  const uint32_t e = (float_bits(s) >> 23) & 0xffu;
  d.fast = e >= 47u && e <= 206u;
  if (d.fast) d.y = recip_rn(s);
  return d;
}

/// x / s through y: q0 = RN(x * y) is within 1.5 ulp, and two Markstein corrections (residual by
/// fma, exact while q is within an ulp or so) give RN(x / s) wherever no step leaves the normal
/// range. With d.fast that holds for every x with |x / s| >= 2^-11 that does not overflow; smaller
/// quotients come out as tiny values of the right sign, which e4m3 rounds to the same signed zero
/// as RN(x / s); overflow gives NaN (a 0x7f byte after the cvt); zero keeps its sign.
KVFERRY_HOST_DEVICE float quot_fast(float x, const QDiv& d) {
  const float q0 = mul_rn(x, d.y);
  const float r0 = fma_rn(-d.s, q0, x);
  const float q1 = fma_rn(r0, d.y, q0);
  const float r1 = fma_rn(-d.s, q1, x);
  const float q2 = fma_rn(r1, d.y, q1);
  return x == 0.0f ? q0 : q2;
}

/// RN(x / s) where s = ds_tile_scale(amax) is an mla_fp8_ds tile scale (d = make_qdiv(s), d.fast)
/// and x one of its tile's own values: x and amax bf16, |x| <= amax. One Markstein correction of
/// q0 = RN(x * y) is enough there, where quot_fast needs two for a general divisor (q0 can be 1.5
/// ulp off): every such pair (every positive finite bf16 amax with a fast scale, every bf16 x of
/// either sign with |x| <= amax: 7.1 * 10^8 pairs) gives RN(x / s) bit for bit, and the same e4m3
/// byte for the quotients below 2^-11 that leave the normal range; the unit test
/// KernelsFastMath.DsTileQuotientIsExact checks all of them (KernelsGpuFp8 on the device). Zero keeps
/// its sign (the residual is negated, s * q - x, so a zero x adds -0 to q0 = +-0); NaN stays NaN.
KVFERRY_HOST_DEVICE float quot_ds(float x, const QDiv& d) {
  const float q0 = mul_rn(x, d.y);
  const float r0 = fma_rn(d.s, q0, -x);
  return fma_rn(-r0, d.y, q0);
}

/// The divisors a quantising path may assume: any (quot_fast), a power of two with an exact
/// reciprocal (one multiply: x * y is x / s), or an mla_fp8_ds tile scale over the tile's own bf16
/// values (quot_ds).
enum class Quot { kAny, kPow2, kDsTile };

template <Quot kQ>
KVFERRY_HOST_DEVICE float quot(float x, const QDiv& d) {
  if constexpr (kQ == Quot::kPow2) return mul_rn(x, d.y);
  if constexpr (kQ == Quot::kDsTile) return quot_ds(x, d);
  return quot_fast(x, d);
}

/// RN(a / 448) by quot_fast: exact for a in [2^-90, 2^100], where no step leaves the normal range.
KVFERRY_HOST_DEVICE float div448_fast(float a) {
  QDiv d;
  d.s = 448.0f;
  d.y = recip_rn(448.0f);
  d.fast = true;
  return quot_fast(a, d);
}

/// ds_tile_scale with the division by 448 done by div448_fast where that is exact; equal to
/// ds_tile_scale for every amax.
KVFERRY_HOST_DEVICE float ds_tile_scale_fast(float amax) {
  const uint32_t e = (float_bits(amax) >> 23) & 0xffu;
  if (e < 37u || e > 226u || (float_bits(amax) >> 31) != 0u) return ds_tile_scale(amax);
  return fmax_f(div448_fast(amax), FLT_MIN);
}

/// indexer_scale likewise (its amax is at least 1e-4 after the clamp).
KVFERRY_HOST_DEVICE float indexer_scale_fast(float amax, bool ue8m0) {
  const float a = fmax_f(amax, 1e-4f);
  if (((float_bits(a) >> 23) & 0xffu) > 226u) return indexer_scale(amax, ue8m0);
  const float s = div448_fast(a);
  return ue8m0 ? ue8m0_round_up(s) : s;
}

/// e4m3(x / s) for two values (a in the low byte) when d.fast; false (and the caller divides
/// exactly) where a byte came out as the cvt's NaN code 0x7f: a NaN input or an overflow.
/// kQ: what the divisor is known to be (Quot::kPow2: RN(x * y) is RN(x / s) for every x, overflow
/// saturating in the cvt exactly as the division would; Quot::kDsTile: quot_ds's conditions hold).
template <Quot kQ = Quot::kAny>
KVFERRY_HOST_DEVICE bool quant2_fast(float a, float b, const QDiv& d, uint32_t* out) {
  const uint32_t c = cvt_e4m3x2(quot<kQ>(a, d), quot<kQ>(b, d));
  *out = c;
  return (((c & 0x7f7fu) + 0x0101u) & 0x8080u) == 0;
}

/// Whether s is a power of two with a normal reciprocal (then make_qdiv's y is exactly 1/s).
KVFERRY_HOST_DEVICE bool is_pow2_scale(float s) {
  const uint32_t u = float_bits(s);
  const uint32_t e = (u >> 23) & 0xffu;
  return (u & 0x807fffffu) == 0 && e >= 47u && e <= 206u;
}

/// A dequantisation scale; fast: finite, so the CUDA kernels' hardware e4m3 -> f16 conversion and
/// one fp32 multiply give dequant_bf16's bits for every non-NaN byte.
struct DqScale {
  float s = 1.0f;
  bool fast = false;
};

KVFERRY_HOST_DEVICE DqScale make_dq_scale(float s) {
  DqScale d;
  d.s = s;
  d.fast = (float_bits(s) & 0x7f800000u) != 0x7f800000u;
  return d;
}

/// Whether any of the 4 bytes of w is an e4m3 NaN (0x7f / 0xff).
KVFERRY_HOST_DEVICE bool has_e4m3_nan(uint32_t w) { return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0; }

}  // namespace kvferry::kernels::detail
