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

/// Indexer scale: max(amax, 1e-4) / 448, optionally rounded up to a power of two (ue8m0).
KVFERRY_HOST_DEVICE float indexer_scale(float amax, bool ue8m0) {
  float s = div_rn(fmax_f(amax, 1e-4f), 448.0f);
  if (ue8m0) {
    uint32_t u = float_bits(s);
    if (u & 0x7fffffu) u = (u & 0xff800000u) + 0x800000u;  // next power of two (s is normal here)
    s = bits_float(u);
  }
  return s;
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

/// e4m3(x / s), saturating RNE.
KVFERRY_HOST_DEVICE uint8_t quant_e4m3(float x, float s) { return to_e4m3(div_rn(x, s)); }

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

// ---- amortised exact division and scaled dequantisation (the CUDA kernels' fast paths) ----
// Both give the same bits as div_rn / dequant_bf16 on the inputs their *_fast predicate accepts;
// the kernels take the scalar path for the rest (NaN, extreme exponents). CPU twins do not use
// them; tests/unit/kernels_fastmath_test.cpp checks the equalities on the host.

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

/// A divisor with its reciprocal. kind 1: s = +-2^k with 1/s normal, so x * (1/s) is exactly
/// x / s for every non-NaN x. kind 2: |s| in [2^-60, 2^61): y = RN(1/s) and two fma corrections
/// (Markstein: q within 1 ulp and y within 1/2 ulp give the correctly rounded quotient) for x = 0
/// or |x| in [2^-60, 2^61), where no step underflows or overflows. kind 0: no fast path.
struct Recip {
  float s = 1.0f;
  float y = 1.0f;
  int kind = 0;
};

KVFERRY_HOST_DEVICE bool fast_exponent(uint32_t bits) { return ((bits >> 23) & 0xffu) - 67u <= 120u; }

KVFERRY_HOST_DEVICE Recip make_recip(float s) {
  Recip r;
  r.s = s;
  const uint32_t u = float_bits(s);
  const uint32_t e = (u >> 23) & 0xffu;
  if ((u & 0x7fffffu) == 0 && e >= 1u && e <= 253u) {
    r.kind = 1;
    r.y = bits_float((u & 0x80000000u) | ((254u - e) << 23));
  } else if (fast_exponent(u)) {
    r.kind = 2;
    r.y = div_rn(1.0f, s);
  }
  return r;
}

/// Whether div_recip(x, r) == div_rn(x, r.s) is guaranteed (and the quotient is not NaN).
KVFERRY_HOST_DEVICE bool recip_fast(const Recip& r, float x) {
  const uint32_t u = float_bits(x);
  if (r.kind == 1) return (u & 0x7fffffffu) <= 0x7f800000u;
  return r.kind == 2 && (fast_exponent(u) || (u & 0x7fffffffu) == 0);
}

KVFERRY_HOST_DEVICE float div_recip(float x, const Recip& r) {
  const float q0 = mul_rn(x, r.y);
  if (r.kind == 1) return q0;
  const float r0 = fma_rn(-r.s, q0, x);
  const float q1 = fma_rn(r0, r.y, q0);
  const float r1 = fma_rn(-r.s, q1, x);
  const float q2 = fma_rn(r1, r.y, q1);
  return x == 0.0f ? q0 : q2;
}

/// A dequantisation scale: for |s| < 2^7 (finite), s * 2^120 is exact and
/// bits(e4m3 byte b without its bias fix-up) * s2 == e4m3_to_float(b) * s for every non-NaN b.
struct DqScale {
  float s = 1.0f;
  float s2 = 0.0f;
  bool fast = false;
};

KVFERRY_HOST_DEVICE DqScale make_dq_scale(float s) {
  DqScale d;
  d.s = s;
  d.fast = ((float_bits(s) >> 23) & 0xffu) <= 133u;
  if (d.fast) d.s2 = mul_rn(s, 0x1p120f);
  return d;
}

/// e4m3_to_float(b) * s for a non-NaN byte b (b & 0x7f != 0x7f) when d.fast: the byte's
/// exponent and mantissa placed in a float (value * 2^-120; subnormal e4m3 become subnormal
/// floats, exactly) times s * 2^120, one rounding.
KVFERRY_HOST_DEVICE float dq_fast(uint32_t b, const DqScale& d) {
  return mul_rn(bits_float(((b & 0x7fu) << 20) | ((b & 0x80u) << 24)), d.s2);
}

/// Whether any of the 4 bytes of w is an e4m3 NaN (0x7f / 0xff).
KVFERRY_HOST_DEVICE bool has_e4m3_nan(uint32_t w) { return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0; }

}  // namespace kvferry::kernels::detail
