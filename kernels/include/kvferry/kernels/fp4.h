#pragma once
// mla_fp4: SGLang's FP4 MLA KV cache (MLAKVCacheLayout.FP4, kernels-spec §6.1). Each token's 576
// values are cut into 36 groups of 16 (nope groups 0..31, rope 32..35); a group keeps one ue8m0
// scale byte and 16 e2m1 codes, two per byte (element 2i in the low nibble of byte i).
//
// Quantization of a group with amax = max |x| (the semantics of SGLang's writer, see fp4_cpu.cpp):
//   e     = max(-33, ceil(log2(amax / 6)))        scale byte = e + 127 (94..253 for finite bf16)
//   code  = sign | m, m = the number of bounds {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} that |x| / 2^e
//           reaches (nearest e2m1 magnitude, ties away from zero); sign = x < 0 (so -0.0 -> +0, and
//           a negative value that rounds to zero keeps its sign: code 0x8)
//   decode: bf16(e2m1(code) * 2^(byte - 127)), exact, or +-inf past bf16's range (e = 126 and
//           |code| >= 4, i.e. groups with amax > 1.5 * 2^127)
// Bound: |x - decode(code)| <= 2^e * (0.25 if |x| / 2^e <= 2, 0.5 if <= 4, else 1), i.e. half the
// e2m1 step at |x|, for every finite x whose decode is finite.
// Non-finite input (kvferry's choice; upstream's result is undefined there): a group holding an
// inf or NaN gets scale byte 0xFF (scale +inf); its infinities keep their sign (code +-6 -> +-inf)
// and every other element is code 0, which decodes to NaN (0 * inf). A 0xFF scale decodes so
// whatever its codes.
//
// The CPU twins and the CUDA kernels share the scalar code below, which uses only integer
// arithmetic, comparisons and exact power-of-two products, so both give the same bytes.
#include <cstdint>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/entry_format.h"
#include "kvferry/layouts/host_device.h"

#if !defined(__CUDA_ARCH__)
#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#endif

namespace kvferry::kernels {

constexpr int kMlaFp4Groups = kMlaFp4ScaleBytes;  // 36 groups of 16 per token
constexpr int kMlaFp4MinExp = -33;                // SGLang's amax / 6 floor of 1e-10: ceil(log2(1e-10))
constexpr uint8_t kMlaFp4NonFinite = 0xFF;        // scale byte of a group holding inf or NaN

/// Value of e2m1 code `c` (its low 4 bits): bit 3 the sign, magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}.
KVFERRY_HOST_DEVICE float e2m1_to_float(uint8_t c) {
  const uint8_t m = c & 7;
  const float mag =
      m < 4 ? 0.5f * static_cast<float>(m) : static_cast<float>(2 << ((m - 4) >> 1)) * (m & 1 ? 1.5f : 1.0f);
  return c & 8 ? -mag : mag;
}

/// The group exponent e of a group whose largest bf16 magnitude has bits `amax` (sign cleared,
/// finite): max(-33, ceil(log2(amax / 6))), computed exactly from the bits (amax / 6 <= 2^e iff the
/// significand is <= 1.5 for e = E - 2, where amax = 1.f * 2^E).
KVFERRY_HOST_DEVICE int mla_fp4_group_exponent(uint16_t amax) {
  const int big_e = static_cast<int>(amax >> 7) - 127;  // zero and subnormals land far below -33
  const int e = (amax & 0x7f) <= 0x40 ? big_e - 2 : big_e - 1;
  return e < kMlaFp4MinExp ? kMlaFp4MinExp : e;
}

/// e2m1 code of bf16 `x` (bits) in a group of exponent e (finite x, |x| <= 6 * 2^e).
KVFERRY_HOST_DEVICE uint8_t mla_fp4_encode(uint16_t x, int e) {
  const uint16_t a = x & 0x7fff;
  // |x| * 2^-e: exact while normal; below 2^-126 it is far under the first bound either way.
  const float s = bf16_to_float(a) * bits_float(static_cast<uint32_t>(127 - e) << 23);
  const uint8_t m = static_cast<uint8_t>((s >= 0.25f) + (s >= 0.75f) + (s >= 1.25f) + (s >= 1.75f) + (s >= 2.5f) +
                                         (s >= 3.5f) + (s >= 5.0f));
  return static_cast<uint8_t>((x & 0x8000) && a != 0 ? m | 8 : m);
}

/// Quantizes 16 bf16 values (bits) into 8 packed bytes (`packed`, element 2i in the low nibble of
/// byte i) and returns the group's scale byte.
KVFERRY_HOST_DEVICE uint8_t mla_fp4_quantize_group(const uint16_t* x, uint8_t* packed) {
  uint16_t amax = 0;
  bool nonfinite = false;
  for (int i = 0; i < kMlaFp4Group; ++i) {
    const uint16_t a = x[i] & 0x7fff;
    nonfinite |= a >= 0x7f80;
    amax = a > amax ? a : amax;  // bf16 magnitude bits order like the values they encode
  }
  if (nonfinite) {
    for (int i = 0; i < kMlaFp4Group / 2; ++i) {
      const uint8_t lo = (x[2 * i] & 0x7fff) == 0x7f80 ? ((x[2 * i] >> 12) & 8) | 7 : 0;
      const uint8_t hi = (x[2 * i + 1] & 0x7fff) == 0x7f80 ? ((x[2 * i + 1] >> 12) & 8) | 7 : 0;
      packed[i] = static_cast<uint8_t>(lo | hi << 4);
    }
    return kMlaFp4NonFinite;
  }
  const int e = mla_fp4_group_exponent(amax);
  for (int i = 0; i < kMlaFp4Group / 2; ++i)
    packed[i] = static_cast<uint8_t>(mla_fp4_encode(x[2 * i], e) | mla_fp4_encode(x[2 * i + 1], e) << 4);
  return static_cast<uint8_t>(e + 127);
}

/// bf16 bits of e2m1 code `c` times 2^(scale - 127): exact, +-inf past bf16's range; scale 0xFF
/// (+inf) gives +-inf, or NaN (0x7fc0) for a zero code.
KVFERRY_HOST_DEVICE uint16_t mla_fp4_to_bf16(uint8_t c, uint8_t scale) {
  const uint16_t sign = c & 8 ? 0x8000 : 0;
  const int m = c & 7;
  if (scale == kMlaFp4NonFinite) return m == 0 ? 0x7fc0 : static_cast<uint16_t>(sign | 0x7f80);
  if (m == 0) return sign;
  // e2m1 magnitude (1 + h / 2) * 2^p: m = 1 -> 0.5 (p -1), 2, 3 -> 1, 1.5 (p 0), 4, 5 -> 2, 3, 6, 7 -> 4, 6.
  const int p = m / 2 - 1;
  const int h = m > 1 ? m & 1 : 0;
  const int e = static_cast<int>(scale) - 127 + p;
  if (e > 127) return static_cast<uint16_t>(sign | 0x7f80);
  if (e >= -126) return static_cast<uint16_t>(sign | (e + 127) << 7 | h << 6);
  return static_cast<uint16_t>(sign | (2 + h) << (e + 132));  // subnormal: (2 + h) * 2^(e - 1), units of 2^-133
}

/// Decodes one group: 8 packed bytes and its scale byte into 16 bf16 values (bits).
KVFERRY_HOST_DEVICE void mla_fp4_dequantize_group(const uint8_t* packed, uint8_t scale, uint16_t* out) {
  for (int i = 0; i < kMlaFp4Group / 2; ++i) {
    out[2 * i] = mla_fp4_to_bf16(packed[i] & 0x0f, scale);
    out[2 * i + 1] = mla_fp4_to_bf16(packed[i] >> 4, scale);
  }
}

/// Quantize (bf16 -> fp4) or dequantize (fp4 -> bf16) blocks: block bf16_blocks[i] of the bf16
/// side <-> block fp4_blocks[i] of the fp4 side (null lists: block i <-> block i for i < count),
/// for `layers` layers; layer l of a side is its views shifted by l * its layer stride (bytes;
/// KvCacheSpec::page_offset(1, 0), 0 when layers == 1). The views may have any block stride (a layer
/// of a block-major region) and need not come from one region: SGLang's separate per-layer value
/// and scale tensors are views too. Index arrays live where the code runs; the caller owns all
/// memory. Validation: bf16 rows 16-byte aligned, fp4 rows 4-byte aligned.
struct MlaFp4Params {
  CacheRef bf16;    ///< layer 0: (NB, BS, 576) bf16 entries
  CacheRef values;  ///< layer 0: (NB, BS, 288) u8 packed e2m1 (KvCacheSpec::mla_fp4_values_view)
  CacheRef scales;  ///< layer 0: (NB, BS, 36) u8 ue8m0 (KvCacheSpec::mla_fp4_scales_view)
  int64_t layers = 1;
  int64_t bf16_layer_stride = 0;  ///< bytes
  int64_t fp4_layer_stride = 0;   ///< bytes; shifts the value and the scale view alike
  const int64_t* bf16_blocks = nullptr;
  const int64_t* fp4_blocks = nullptr;
  int64_t count = 0;  ///< blocks
};

#if !defined(__CUDA_ARCH__)
/// Checks views, strides, alignment and bounds (not the block lists' entries: the CPU twins check
/// those on the host, the CUDA kernels trust them).
Status validate_mla_fp4(const MlaFp4Params& p);

/// CPU twins; host memory only.
Status quantize_mla_fp4_cpu(const MlaFp4Params& p, const CpuOptions& opt = {});
Status dequantize_mla_fp4_cpu(const MlaFp4Params& p, const CpuOptions& opt = {});

/// Params covering all layers of a bf16 MLA region (`bf16_spec`, format mla_bf16) and an mla_fp4
/// region (`fp4_spec`) with the same layers and block size; the block lists are left null.
Result<MlaFp4Params> make_mla_fp4_params(const void* bf16_base, const KvCacheSpec& bf16_spec, const void* fp4_base,
                                         const KvCacheSpec& fp4_spec);
#endif

#if defined(KVFERRY_WITH_CUDA)
/// CUDA kernels (software e2m1: sm_90 has no fp4 conversion), bit-identical to the CPU twins.
/// Asynchronous on `stream`; validate_mla_fp4 first.
cudaError_t launch_quantize_mla_fp4(const MlaFp4Params& p, cudaStream_t stream);
cudaError_t launch_dequantize_mla_fp4(const MlaFp4Params& p, cudaStream_t stream);
#endif

}  // namespace kvferry::kernels
