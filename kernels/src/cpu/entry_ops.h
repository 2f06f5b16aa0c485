#pragma once
// Per-entry conversions of the MLA formats used by the CPU twins (gather, dequantize, convert).
#include <cstdint>
#include <cstring>

#include "common/datapath_math.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels::detail {

inline uint16_t ld16(const uint8_t* p, int64_t i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
inline void st16(uint8_t* p, int64_t i, uint16_t v) { std::memcpy(p + 2 * i, &v, 2); }

/// 576 bf16 (1152 B) -> 656 B mla_fp8_ds.
inline void entry_bf16_to_ds(const uint8_t* src, uint8_t* dst) {
  for (int t = 0; t < kMlaTiles; ++t) {
    float amax = 0.0f;
    for (int i = t * kMlaTile; i < (t + 1) * kMlaTile; ++i) amax = fmax_f(amax, abs_f(bf16_to_float(ld16(src, i))));
    const float sc = ds_tile_scale(amax);
    for (int i = t * kMlaTile; i < (t + 1) * kMlaTile; ++i) dst[i] = quant_e4m3(bf16_to_float(ld16(src, i)), sc);
    std::memcpy(dst + kMlaDsScaleOffset + 4 * t, &sc, 4);
  }
  std::memcpy(dst + kMlaDsRopeOffset, src + kMlaRank * 2, kMlaRope * 2);
}

/// 656 B mla_fp8_ds -> 576 bf16 (1152 B).
inline void entry_ds_to_bf16(const uint8_t* src, uint8_t* dst) {
  float sc[kMlaTiles];
  std::memcpy(sc, src + kMlaDsScaleOffset, sizeof sc);
  for (int i = 0; i < kMlaRank; ++i) st16(dst, i, dequant_bf16(src[i], sc[i / kMlaTile]));
  std::memcpy(dst + kMlaRank * 2, src + kMlaDsRopeOffset, kMlaRope * 2);
}

/// 576 B mla_fp8 -> 656 B mla_fp8_ds: nope kept, scales 1.0, rope e4m3 -> bf16.
inline void entry_fp8_to_ds(const uint8_t* src, uint8_t* dst) {
  std::memcpy(dst, src, kMlaRank);
  for (int t = 0; t < kMlaTiles; ++t) std::memcpy(dst + kMlaDsScaleOffset + 4 * t, &kOneF32Bits, 4);
  for (int i = 0; i < kMlaRope; ++i) st16(dst + kMlaDsRopeOffset, i, e4m3_to_bf16(src[kMlaRank + i]));
}

/// 656 B -> 576 B; false when the entry is not lossless (a scale != 1.0 or a rope value that is
/// not an e4m3 value). The output is written either way.
inline bool entry_ds_to_fp8(const uint8_t* src, uint8_t* dst) {
  bool ok = true;
  std::memcpy(dst, src, kMlaRank);
  for (int t = 0; t < kMlaTiles; ++t) {
    uint32_t u;
    std::memcpy(&u, src + kMlaDsScaleOffset + 4 * t, 4);
    ok &= u == kOneF32Bits;
  }
  for (int i = 0; i < kMlaRope; ++i) ok &= bf16_to_e4m3_exact(ld16(src + kMlaDsRopeOffset, i), dst + kMlaRank + i);
  return ok;
}

}  // namespace kvferry::kernels::detail
