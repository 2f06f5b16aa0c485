#pragma once
// What the wgmma decode kernels share (wgmma_depth_split.cu, wgmma_seesaw.cu, and in part
// wgmma_seesaw_e4m3.cu): shared-memory matrix descriptors for the 128-byte swizzle, the wgmma fence / commit / wait
// wrappers, and the operand lists of their accumulator registers. Private to kernels/src.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "decode_mla/common.cuh"

namespace kvferry::mla_detail {

// wgmma shared-memory matrix descriptor, 128-byte swizzle. K-major operands: rows 128 B apart,
// 8-row groups `sbo` apart (lbo unused). N-major: 64-element column blocks `lbo` apart, 8-row (k)
// groups `sbo` apart.
// Every descriptor here has sbo = 1024, so the high word is a constant and a descriptor is its low
// word: the start address in 16-byte units (14 bits; shared addresses stay below 256 KiB, so adding
// an in-bounds byte offset / 16 to it never carries out) and lbo / 16.
constexpr uint32_t kDescHi = (1024 >> 4) | (1u << 30);  // sbo 1024, 128-byte swizzle (bit 62)
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo) {
  return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ uint64_t desc(uint32_t lo) { return (static_cast<uint64_t>(kDescHi) << 32) | lo; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Keeps the compiler from moving reads or writes of accumulators across a wgmma wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

/// 16 e4m3 bytes -> 16 bf16 words (times `s` when SCALED, rounded once from fp32). mla_fp8 skips
/// the multiply: a product by 1 is exact, so mla_fp8 and mla_fp8_ds with unit scales give the
/// tile the same bits.
template <bool SCALED>
__device__ __forceinline__ void convert16_words(const uint4 raw, float s, uint32_t (&out)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw hr =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
      const float2 f = __half22float2(__half2(hr));
      out[2 * i + h] = SCALED ? pack_bf16(__fmul_rn(f.x, s), __fmul_rn(f.y, s)) : pack_bf16(f.x, f.y);
    }
  }
}

/// 16 e4m3 bytes -> 16 fp16 words (8 fp16x2; low byte first), the seesaw kernel's fp8 tiles: the
/// hardware conversion (exact: every e4m3 value is an fp16 value), then for mla_fp8_ds (SCALED) one
/// fp16 product by the tile scale `s2` (an fp16x2 of two equal halves, see ds_scale_f16x2), rounded
/// once to fp16. A unit scale multiplies exactly, so mla_fp8 and mla_fp8_ds with unit scales give the
/// tile the same bits.
template <bool SCALED>
__device__ __forceinline__ void convert16_f16(const uint4 raw, uint32_t s2, uint32_t (&out)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    e4m3x4_f16x4(w[i], out[2 * i], out[2 * i + 1]);
    if constexpr (SCALED) {
      asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(out[2 * i]) : "r"(s2));
      asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(out[2 * i + 1]) : "r"(s2));
    }
  }
}
/// mla_fp8_ds tile scale `s` as the fp16x2 factor of convert16_f16: rounded to fp16, and at most
/// 146, so that 448 (the largest e4m3 magnitude) times it stays below fp16's 65504 (a tile with a
/// larger scale, i.e. values beyond 65408 in magnitude, is read as if its scale were 146; a NaN
/// scale stays NaN).
__device__ __forceinline__ uint32_t ds_scale_f16x2(float s) {
  const __half h = __float2half_rn(s > 146.0f ? 146.0f : s);
  const __half2 v = __halves2half2(h, h);
  return *reinterpret_cast<const uint32_t*>(&v);
}

/// The epilogue both wgmma kernels share: this thread's rows r0 = 16 w + g and r1 = r0 + 8 (rows
/// >= hb are padding) of the output half [256 wg, +256) from the m64n256 accumulators, times
/// inv0 / inv1, and (warpgroup 0, tq 0) their lse from the log2-domain maxima m0 / m1 and sums
/// l0 / l1. Needs decode_mla/common.cuh.
template <bool SPLIT>
__device__ __forceinline__ void store_out(const KParams& p, int b, int split, int head0, int hb, int wg, int r0, int tq,
                                          const float (&acc)[128], float m0, float m1, float l0, float l1) {
  const int r1 = r0 + 8;
  const float inv0 = p.vscale / l0, inv1 = p.vscale / l1;
  const float lse0 = row_lse(m0, l0), lse1 = row_lse(m1, l1);
  const int col0 = wg * 256 + tq * 2;
  const int64_t base = out_row<SPLIT>(p, b, split, head0);
  if (r0 < hb) {
#pragma unroll
    for (int n = 0; n < 32; ++n) store_o2<SPLIT>(p, base + r0, col0 + n * 8, acc[4 * n] * inv0, acc[4 * n + 1] * inv0);
    if (wg == 0 && tq == 0) store_lse<SPLIT>(p, base + r0, lse0);
  }
  if (r1 < hb) {
#pragma unroll
    for (int n = 0; n < 32; ++n)
      store_o2<SPLIT>(p, base + r1, col0 + n * 8, acc[4 * n + 2] * inv1, acc[4 * n + 3] * inv1);
    if (wg == 0 && tq == 0) store_lse<SPLIT>(p, base + r1, lse1);
  }
}

}  // namespace kvferry::mla_detail

// In-out operand lists of 8 and 32 fp32 accumulators x[i..] for the wgmma inline assembly.
#define KVF_WG_F8(x, i)                                                                                           \
  "+f"(x[i + 0]), "+f"(x[i + 1]), "+f"(x[i + 2]), "+f"(x[i + 3]), "+f"(x[i + 4]), "+f"(x[i + 5]), "+f"(x[i + 6]), \
      "+f"(x[i + 7])
#define KVF_WG_F32(x, i) KVF_WG_F8(x, i), KVF_WG_F8(x, i + 8), KVF_WG_F8(x, i + 16), KVF_WG_F8(x, i + 24)
