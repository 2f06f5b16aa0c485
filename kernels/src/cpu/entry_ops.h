#pragma once
// Per-entry conversions of the MLA formats used by the CPU twins (gather, dequantize, convert).
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/datapath_math.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels::detail {

inline uint16_t ld16(const uint8_t* p, int64_t i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
inline void st16(uint8_t* p, int64_t i, uint16_t v) { std::memcpy(p + 2 * i, &v, 2); }

/// e4m3 byte -> bf16 bits, all 256 values (exact; the same as e4m3_to_bf16).
inline const uint16_t* e4m3_bf16_table() {
  static const auto table = [] {
    struct T {
      uint16_t v[256];
    } t{};
    for (int i = 0; i < 256; ++i) t.v[i] = e4m3_to_bf16(static_cast<uint8_t>(i));
    return t;
  }();
  return table.v;
}

/// e4m3 byte -> float, all 256 values (exact; the same bits as e4m3_to_float).
inline const float* e4m3_float_table() {
  static const auto table = [] {
    struct T {
      float v[256];
    } t{};
    for (int i = 0; i < 256; ++i) t.v[i] = e4m3_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return table.v;
}

/// bf16 bits -> the e4m3 byte nearest (to_e4m3 of its value), all 65536 values.
inline const uint8_t* bf16_e4m3_table() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = to_e4m3(bf16_to_float(static_cast<uint16_t>(h)));
    return t;
  }();
  return table.data();
}

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
  const float* lut = e4m3_float_table();
  float sc[kMlaTiles];
  std::memcpy(sc, src + kMlaDsScaleOffset, sizeof sc);
  uint16_t out[kMlaRank];
  for (int i = 0; i < kMlaRank; ++i) out[i] = float_to_bf16(lut[src[i]] * sc[i / kMlaTile]);  // = dequant_bf16
  std::memcpy(dst, out, sizeof out);
  std::memcpy(dst + kMlaRank * 2, src + kMlaDsRopeOffset, kMlaRope * 2);
}

/// 576 B mla_fp8 -> 656 B mla_fp8_ds: nope kept, scales 1.0, rope e4m3 -> bf16.
inline void entry_fp8_to_ds(const uint8_t* src, uint8_t* dst) {
  const uint16_t* lut = e4m3_bf16_table();
  std::memcpy(dst, src, kMlaRank);
  for (int t = 0; t < kMlaTiles; ++t) std::memcpy(dst + kMlaDsScaleOffset + 4 * t, &kOneF32Bits, 4);
  uint16_t rope[kMlaRope];
  for (int i = 0; i < kMlaRope; ++i) rope[i] = lut[src[kMlaRank + i]];
  std::memcpy(dst + kMlaDsRopeOffset, rope, sizeof rope);
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
  const uint8_t* to8 = bf16_e4m3_table();
  const uint16_t* back = e4m3_bf16_table();
  for (int i = 0; i < kMlaRope; ++i) {  // = bf16_to_e4m3_exact
    const uint16_t h = ld16(src + kMlaDsRopeOffset, i);
    const uint8_t q = to8[h];
    dst[kMlaRank + i] = q;
    ok &= back[q] == h;
  }
  return ok;
}

}  // namespace kvferry::kernels::detail
