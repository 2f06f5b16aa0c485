#pragma once
// Device code every MLA decode kernel shares (mma_sync_bf16.cu, mma_sync_fp8.cu,
// wgmma_depth_split.cu, wgmma_seesaw.cu, wgmma_seesaw_e4m3.cu): PTX wrappers (cp.async, mbarriers and bulk copies from
// common/mbarrier.cuh, named barriers, ldmatrix, mma.sync), the fp8 caches' conversions of e4m3 and of Q rows, and the
// split bookkeeping every kernel does the same way (a split's token range, the output of an empty split, the o/lse
// stores), and the launchers' shared-memory opt-in. Private to kernels/src.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "common/mbarrier.cuh"
#include "decode_mla/kernels.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::mla_detail {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes global -> shared; bytes past `src_bytes` are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

using kernels::ptx::bulk_g2s;
using kernels::ptx::mbar_arrive;
using kernels::ptx::mbar_expect_tx;
using kernels::ptx::mbar_fence_init;
using kernels::ptx::mbar_init;
using kernels::ptx::mbar_wait;

/// Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async) before later
/// async-proxy accesses (bulk copies, the tensor cores' wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/// Barrier `ID0 + group` of THREADS threads, with an immediate id (group 0..3), so a kernel
/// reserves only the ids it uses (0 is __syncthreads).
template <int ID0, int THREADS>
__device__ __forceinline__ void named_barrier(int group) {
  switch (group) {
    case 0: asm volatile("bar.sync %0, %1;\n" ::"n"(ID0), "n"(THREADS) : "memory"); break;
    case 1: asm volatile("bar.sync %0, %1;\n" ::"n"(ID0 + 1), "n"(THREADS) : "memory"); break;
    case 2: asm volatile("bar.sync %0, %1;\n" ::"n"(ID0 + 2), "n"(THREADS) : "memory"); break;
    default: asm volatile("bar.sync %0, %1;\n" ::"n"(ID0 + 3), "n"(THREADS) : "memory"); break;
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// c += A B, m16n8k16, bf16 operands (A in registers a0..a3, B in b0, b1), fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/// 2^x, approximate (ex2.approx.ftz: 2 ulp; 0 for -inf), for the softmax.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
/// Four e4m3 bytes (low byte first) -> two fp16x2 (bytes 0, 1 and 2, 3; low half first), exact:
/// the hardware conversion reads each 16-bit half of the register in place.
__device__ __forceinline__ void e4m3x4_f16x4(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
/// 2^e for e in [-126, 127], exact.
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }
/// The smallest x with |v| < 2^x for a finite v (subnormals and zero give -126).
__device__ __forceinline__ int exp_above(float v) { return max((__float_as_int(v) >> 23) & 0xff, 1) - 126; }
/// The largest of m and the magnitudes of 8 bf16 values.
__device__ __forceinline__ float bf16x8_amax(const uint4& v, float m) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = fmaxf(m, fabsf(__uint_as_float(w[i] << 16)));
    m = fmaxf(m, fabsf(__uint_as_float(w[i] & 0xffff0000u)));
  }
  return m;
}
/// 8 bf16 values times `up` (a power of two), as 4 words of fp16 (F16) or bf16 pairs.
template <bool F16>
__device__ __forceinline__ void bf16x8_scaled(const uint4& v, float up, uint32_t (&o)[4]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(w[i] << 16) * up, hi = __uint_as_float(w[i] & 0xffff0000u) * up;
    o[i] = F16 ? pack_f16(lo, hi) : pack_bf16(lo, hi);
  }
}
/// The exponent e that puts a Q row into fp16 for the fp8 decode kernels: its nope part's largest
/// magnitude `mn` times 2^e in [2^14, 2^15) (exact, and far from fp16's limit), unless the rope
/// part's largest magnitude `mr` times 2^e would leave fp32 / bf16 range.
__device__ __forceinline__ int q_row_exponent(float mn, float mr) {
  return max(-126, min(min(15 - exp_above(mn), 127 - exp_above(mr)), 126));
}

/// The tokens [x, y) of request b that split `split` attends to: every split but the last covers
/// the same whole number of TILE-token tiles; x >= y for an empty split or a request of length 0.
template <int TILE>
__device__ __forceinline__ int2 split_tokens(const KParams& p, int b, int split) {
  const int len = p.seq_lens[b];
  const int chunk = ((len + p.splits - 1) / p.splits + TILE - 1) / TILE * TILE;
  const int start = split * chunk;
  return make_int2(start, min(len, start + chunk));
}

/// Row of (request b, split, head h) in the kernel's output: of the fp32 partials [batch, splits,
/// heads] with SPLIT, of o / lse [batch, heads] otherwise.
template <bool SPLIT>
__device__ __forceinline__ int64_t out_row(const KParams& p, int b, int split, int h) {
  return SPLIT ? (static_cast<int64_t>(b) * p.splits + split) * p.heads + h : static_cast<int64_t>(b) * p.heads + h;
}
/// Output columns col, col + 1 of `row`: fp32 partials with SPLIT, bf16 o otherwise.
template <bool SPLIT>
__device__ __forceinline__ void store_o2(const KParams& p, int64_t row, int col, float x, float y) {
  if constexpr (SPLIT)
    *reinterpret_cast<float2*>(p.part_o + row * kMlaRank + col) = make_float2(x, y);
  else
    *reinterpret_cast<uint32_t*>(p.o + row * kMlaRank + col) = pack_bf16(x, y);
}
/// A row's natural-log lse from its log2-domain maximum m and its sum l.
__device__ __forceinline__ float row_lse(float m, float l) {
  constexpr float kLn2 = 0.6931471805599453f;
  return (m + log2f(l)) * kLn2;
}
template <bool SPLIT>
__device__ __forceinline__ void store_lse(const KParams& p, int64_t row, float v) {
  (SPLIT ? p.part_lse : p.lse)[row] = v;
}

/// What a CTA with nothing to attend to (an empty split, or a request of length 0) writes for
/// heads [head0, head0 + nh) of request b: lse = -inf (a partial the merge skips, with SPLIT)
/// and, with one split, o = 0. NT threads share the stores.
template <bool SPLIT, int NT>
__device__ __forceinline__ void write_empty_split(const KParams& p, int b, int split, int head0, int nh, int tid) {
  for (int i = tid; i < nh; i += NT) store_lse<SPLIT>(p, out_row<SPLIT>(p, b, split, head0 + i), -INFINITY);
  if (!SPLIT)
    for (int i = tid; i < nh * kMlaRank / 8; i += NT)
      reinterpret_cast<uint4*>(p.o + (static_cast<int64_t>(b) * p.heads + head0) * kMlaRank)[i] =
          make_uint4(0, 0, 0, 0);
}

// The prologue every decode kernel opens with, once it has its parameters `p` and its thread index
// `tid` (the wgmma kernels also their warpgroup index): declares the CTA's request b (blockIdx.z),
// its split (blockIdx.y), the first of its NH heads head0 (head group blockIdx.x) and the split's
// tokens [start, end) of the request in ntiles TILE-token tiles; a CTA with nothing to attend to
// (an empty split, or a request of length 0) writes what write_empty_split writes (NT threads,
// output per SPLIT) and returns.
// A macro, as is KVFERRY_MLA_SMEM_ALIGN_1024, rather than inline functions: as functions the same
// statements compiled to other instruction orders and register allocations in four of the five
// kernels (their SASS compared kernel by kernel), and a prologue helper that changed the kernels'
// code measured slower before (kernels/DESIGN.md §3.3); the macros keep every kernel's code as
// measured.
#define KVFERRY_MLA_CTA_PROLOGUE(TILE, NH, NT, SPLIT)            \
  const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z; \
  const int2 range = split_tokens<TILE>(p, b, split);            \
  const int start = range.x, end = range.y;                      \
  const int head0 = hg * NH;                                     \
  if (start >= end) { /* nothing to attend to */                 \
    write_empty_split<SPLIT, NT>(p, b, split, head0, NH, tid);   \
    return;                                                      \
  }                                                              \
  const int ntiles = (end - start + TILE - 1) / TILE

// The dynamic shared memory `smem_dyn` from its first 1024-byte boundary: the 128-byte swizzle of
// the tensor copies and of the wgmma operands repeats every 1024 bytes of the shared address.
#define KVFERRY_MLA_SMEM_ALIGN_1024(smem_dyn) ((smem_dyn) + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023))

/// The grid of a decode kernel whose CTAs take `hb` heads each: head groups, splits, requests.
inline dim3 cta_grid(const KParams& k, int hb, int batch) {
  return dim3(k.heads > hb ? k.heads / hb : 1, k.splits, batch);
}

/// Raises kKernel's dynamic shared-memory cap to `bytes` on the current device, once per device
/// (the attribute belongs to the device's context, so a second GPU needs its own call); a failure
/// is returned, cleared rather than left for the next launch's error check, and tried again on the
/// next call.
template <auto kKernel>
cudaError_t allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: device d (devices past 63 call every time)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) (void)cudaGetLastError();
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  done.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}
}  // namespace kvferry::mla_detail
