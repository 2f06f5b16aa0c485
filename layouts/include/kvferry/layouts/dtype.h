#pragma once
// Element types and exact, deterministic scalar conversions shared by host and device code, so
// that CPU and CUDA kernels agree bit for bit. All float -> narrow conversions round to nearest,
// ties to even (RNE).
#include <cstdint>
#include <cstring>
#include <string_view>

#include "kvferry/layouts/host_device.h"

namespace kvferry {

/// Element type of a view. Copies dispatch on dtype_size(), math kernels on the dtype.
enum class DType : uint8_t {
  kU8 = 0,
  kBF16 = 1,
  kFP16 = 2,
  kFP32 = 3,
  kFP8E4M3 = 4,  ///< float8_e4m3fn: 1-4-3, bias 7, max finite 448, no inf, NaN = 0x7F/0xFF
  kI32 = 5,
  kI64 = 6,
};

KVFERRY_HOST_DEVICE constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kU8:
    case DType::kFP8E4M3: return 1;
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32:
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kU8: return "u8";
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

KVFERRY_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVFERRY_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---------------------------------------------------------------- bf16
/// float -> bf16 bits, RNE; NaN stays a (quiet) NaN. Same result as __float2bfloat16_rn.
KVFERRY_HOST_DEVICE uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// bf16 bits -> float, exact.
KVFERRY_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---------------------------------------------------------------- fp16
/// float -> IEEE binary16 bits, RNE, overflow to inf, subnormals kept; NaN stays NaN.
KVFERRY_HOST_DEVICE uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                               // below 2^-14: subnormal
    if (a < 0x33000000u) return sign;                                  // below 2^-25: rounds to 0
    const uint32_t e = a >> 23;                                        // 102..112
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  r -= 0x38000000u;  // rebias exponent 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

/// IEEE binary16 bits -> float, exact.
KVFERRY_HOST_DEVICE float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24
    return bits_float(float_bits(v) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

// ---------------------------------------------------------------- fp8 e4m3 (fn)
constexpr float kE4M3Max = 448.0f;

/// float -> e4m3fn bits, RNE, saturating to +-448 (also for +-inf); NaN -> 0x7F (sign kept).
/// Same result as __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
KVFERRY_HOST_DEVICE uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448: saturate
  if (a < 0x3c800000u) {                                            // below 2^-6: subnormal
    // value = q * 2^-9 with q in [0, 8]; q == 8 encodes the smallest normal (0x08).
    const float t = bits_float(a) * 512.0f;  // exact (power-of-two scale), t < 8
    uint32_t q = static_cast<uint32_t>(t);
    const float frac = t - static_cast<float>(q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // RNE at mantissa bit 20
  const uint32_t e = ((r >> 23) & 0xffu) - 127u + 7u;
  const uint32_t m = (r >> 20) & 7u;
  if (e > 15u || (e == 15u && m == 7u)) return static_cast<uint8_t>(sign | 0x7eu);
  return static_cast<uint8_t>(sign | (e << 3) | m);
}

/// e4m3fn bits -> float, exact. 0x7F/0xFF -> NaN.
KVFERRY_HOST_DEVICE float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 7u;
  if (e == 15u && m == 7u) return bits_float(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = static_cast<float>(m) * (1.0f / 512.0f);
    return bits_float(float_bits(v) | sign);
  }
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

}  // namespace kvferry
