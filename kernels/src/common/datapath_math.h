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

}  // namespace kvferry::kernels::detail
