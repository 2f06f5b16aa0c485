#pragma once
// What the two Hopper seesaw decode kernels share (wgmma_seesaw.cu; wgmma_seesaw_e4m3.cu, the fp8
// tensor-core variant): tensor copies and their maps, mbarrier arrives, named barriers of the two
// math warpgroups, the seesaw kernel's lazy softmax reference and a tile's softmax steps. Private
// to kernels/src.
#include <cuda.h>  // CUtensorMap (types only: the encoder is reached through the runtime)
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_mla/kernels.h"
#include "decode_mla/common.cuh"

namespace kvferry::mla_detail {

// The reference maximum a row's exponentials are taken against (log2 domain): the old one until a
// tile's maximum exceeds it by more than 8, so P stays at most 2^8 (in range for bf16 and fp16 alike;
// sums and O are fp32) and a warp whose rows all kept theirs skips the O rescales. The result is
// the same softmax against another reference, and the lse is taken against the final one (H200,
// 128 heads: bf16 136.1-137.3 -> 132.9-134.1 us, mla_fp8 -3 us, mla_fp8_ds -1.5 us).
__device__ __forceinline__ float lazy_max(float m, float mx) { return mx > m + 8.0f ? mx : m; }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }

// A 64-token tile's S in a thread's 32 wgmma accumulators (row r0 for e < 2, r0 + 8 otherwise;
// token 8 n + 2 tq + (e & 1) of the tile, which starts at token tok0) -> x in the log2 domain
// (times sr0 / sr1), -inf at the tokens from `end` on when the tile is the `last`; the rows'
// maxima over the quad. x is a copy, so S's registers are free for the next product.
__device__ __forceinline__ void tile_logits(const float (&s)[32], float (&x)[32], float sr0, float sr1, bool last,
                                            int tok0, int end, int tq, float& mx0, float& mx1) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("mov.b32 %0, %1;\n" : "=f"(x[i]) : "f"(s[i]));
  mx0 = -INFINITY;
  mx1 = -INFINITY;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[4 * n + e] *= e < 2 ? sr0 : sr1;
      if (last && tok0 + n * 8 + tq * 2 + (e & 1) >= end) x[4 * n + e] = -INFINITY;
    }
    mx0 = fmaxf(mx0, fmaxf(x[4 * n], x[4 * n + 1]));
    mx1 = fmaxf(mx1, fmaxf(x[4 * n + 2], x[4 * n + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}
// x <- 2^(x - reference) in place (nm0 for row r0, nm1 for r0 + 8); the row sums of this thread's values.
__device__ __forceinline__ void tile_exp2(float (&x)[32], float nm0, float nm1, float& rs0, float& rs1) {
  rs0 = 0.0f;
  rs1 = 0.0f;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    x[4 * n] = fast_exp2(x[4 * n] - nm0);
    x[4 * n + 1] = fast_exp2(x[4 * n + 1] - nm0);
    x[4 * n + 2] = fast_exp2(x[4 * n + 2] - nm1);
    x[4 * n + 3] = fast_exp2(x[4 * n + 3] - nm1);
    rs0 += x[4 * n] + x[4 * n + 1];
    rs1 += x[4 * n + 2] + x[4 * n + 3];
  }
}

// One tensor copy (TMA) of a [rows x 64] box of the cache view at (column c0, token-in-page c1,
// block c2), landing 128-byte swizzled at `dst`, completing on mbarrier `bar`, with L2 policy
// `policy`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}

// Lane 0 of the warp (`lane` == 0) arrives on the mbarrier at shared offset `bar`, predicated in
// the instruction rather than behind a branch; no memory clobber (see release in the kernel).
__device__ __forceinline__ void mbar_arrive_lane0(uint32_t bar, int lane) {
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"(lane));
}

// L2 evict-first for the tile copies: measured 157.0 against 159.7 us (evict-last 160.0) for bf16
// at 128 heads on an H200; for the fp8 copies the policy made no difference.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cuTensorMapEncodeTiled, reached through the runtime (nothing links libcuda); null if unavailable.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A [blocks][page][inner] view of the cache (element type `type`, byte strides of the view) with
// [min(page, 64) x box0] boxes (64-token tiles). False where the view does not suit TMA (page not a power of two >= 16)
// or encoding fails.
inline bool make_map(const KParams& k, CUtensorMap* map, CUtensorMapDataType type, const uint8_t* base, uint64_t inner,
                     CUtensorMapSwizzle swizzle, uint32_t box0 = 64) {
  if (k.page_shift < 4 || k.num_blocks < 1) return false;
  const EncodeTiled enc = encode_tiled();
  if (enc == nullptr) return false;
  const cuuint64_t dims[3] = {inner, static_cast<cuuint64_t>(k.page), static_cast<cuuint64_t>(k.num_blocks)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k.token_stride), static_cast<cuuint64_t>(k.block_stride)};
  const cuuint32_t box[3] = {box0, static_cast<cuuint32_t>(k.page < 64 ? k.page : 64), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  return enc(map, type, 3, const_cast<uint8_t*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace kvferry::mla_detail
