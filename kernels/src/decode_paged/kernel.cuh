#pragma once
// CUDA paged MHA/GQA decode over strided K/V views (kernel templates; instantiated per cache
// dtype in inst_*.cu, launched from launch.cu).
//
// One CTA (4 warps) per (request, kv head, chunk of up to 8 query heads, split); each K/V row is
// read from HBM once for the whole chunk. The warps work independently on interleaved 16-token
// tiles of the split, each with its own pipeline of stages in shared memory (~72 KB per CTA, so
// three CTAs share an SM for d128) and its own online softmax; the CTA merges the four warps at
// the end. Stages are filled without CTA barriers and completed on per-stage mbarriers: 2-byte
// caches by one-dimensional bulk copies (TMA, one per K or V row, counted in bytes); fp8 caches,
// whose short rows make one bulk copy per row copy-rate bound, by 16-byte cp.async (consecutive
// lanes on consecutive pieces of a row, each lane arriving once per stage).
//
// Math runs on tensor cores (mma.sync m16n8k16, fp32 accumulation) in a transposed form so the
// 8 query heads are the n = 8 side of the tile and no padding to 16 rows is needed:
//   S^T[16 tokens x 8 heads]  = K_tile[16 x Dk] . Q^T[Dk x 8]   (Q fragments live in registers)
//   O^T[Dv x 8 heads]        += V_tile^T[Dv x 16] . P^T[16 x 8]  (P^T from S^T by movmatrix)
// bf16 caches use bf16 mma (P rounded to bf16); fp16 caches fp16 mma. fp8 e4m3 caches are
// converted to fp16 in registers (exact) and use fp16 mma; a bf16 query is scaled by a power of
// two into fp16 range first (exact), the scale folded into the score scale. For fp8 V the
// ldmatrix.trans of byte pairs plus a byte permute yields V^T fragments whose rows are the
// even / odd head dims, which only changes where each accumulator lands.
//
// Two schedules (decode_paged.h): splits (grid [Hkv * head chunks * S, B], one piece per CTA)
// and balanced (a resident grid in groups of Hkv * head chunks CTAs, each CTA running the pieces
// of its token range one after another; its per-warp pipeline phases carry across pieces).
//
// Status (H200, bench/decode_mha_suite.cpp, calls timed back to back like the floor's copy):
// 0.93 of the d2d-rate floor for the Llama-3-8B-like bf16 case (3 splits), 0.96 for Dk 192 /
// Dv 128 (1 split), 0.80 for fp8 d128 (3 splits). The balanced schedule gave 0.91 / 0.925 / 0.78
// (0.905 / 0.91 / 0.76 before its CTAs were grouped to read the kv heads of a page together).
// Next steps for fp8: fewer, larger copies (a 2-D tensor-map box of 16 rows) or one CTA per
// pair of kv heads (256 contiguous bytes per token in NHD).
//
// All addressing is int64: row = base + page * stride_page + (n % page) * stride_token +
// head * stride_head, strides in bytes. The arithmetic does not depend on addresses, so any two
// placements of the same logical K/V give bit-identical results.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvferry/kernels/decode_paged.h"

namespace kvferry::decode_paged_detail {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTW = 16;                   // tokens per warp tile (the mma m side)
constexpr int kT = kDecodePagedTile;      // tokens per CTA round (kWarps tiles)
constexpr int kN = kDecodePagedMaxGroup;  // query heads per CTA (the mma n side)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kT == kWarps * kTW, "split chunks are whole CTA rounds");
static_assert(kN == 8, "the head chunk is the n = 8 side of m16n8k16");

struct Args {
  const uint8_t* q;          // at q.offset
  int64_t q_sb, q_sh;        // bytes
  const uint8_t* k;          // at k.offset + nothing else
  int64_t k_sp, k_st, k_sh;  // bytes
  const uint8_t* v;
  int64_t v_sp, v_st, v_sh;
  const int32_t* bt;
  int64_t bt_stride;
  int32_t max_blocks;
  const int32_t* lens;
  uint8_t* o;
  int64_t o_sb, o_sh;  // bytes
  float* lse;
  float score_scale;  // sm_scale * k_scale
  float logit_cap;
  float v_scale;
  int Hq, G, HC, Dk, P, S;
  int p_shift;   // log2(P) when P is a power of two, else -1
  int B, IH;     // requests; items per request (Hkv * HC)
  int balanced;  // 1: balanced schedule over gridDim.x == grid CTAs
  int grid;
  float* ws_o;    // split: [B, Hq, S, Dv]; balanced: [slots, kN, Dv]
  float* ws_lse;  // split: [B, Hq, S]; balanced: [slots, kN]
};

// Shared-memory plan. Rows are padded by 16 bytes: the 8 rows an ldmatrix reads at one column
// then fall into distinct 16-byte bank groups (row / 16 is odd for every supported width).
__host__ __device__ constexpr int row_k(int dk, int cb) { return dk * cb + 16; }
__host__ __device__ constexpr int row_v(int dv, int cb) { return dv * cb + 16; }
__host__ __device__ constexpr int stage_bytes(int dk, int dv, int cb) { return kTW * (row_k(dk, cb) + row_v(dv, cb)); }
// Stages per warp: ~72 KB of pipeline per CTA (three CTAs per SM for d128 bf16 and fp8), at least
// double buffering.
constexpr int kPipeBudget = 72 * 1024;
__host__ __device__ constexpr int num_stages(int dk, int dv, int cb) {
  return kPipeBudget / (kWarps * stage_bytes(dk, dv, cb)) < 2   ? 2
         : kPipeBudget / (kWarps * stage_bytes(dk, dv, cb)) > 8 ? 8
                                                                : kPipeBudget / (kWarps * stage_bytes(dk, dv, cb));
}
__host__ __device__ constexpr int merge_bytes(int dv) { return kWarps * kN * (dv + 2) * 4; }
__host__ __device__ constexpr int pipe_bytes(int dk, int dv, int cb) {
  return kWarps * num_stages(dk, dv, cb) * stage_bytes(dk, dv, cb);
}
// The per-stage mbarriers sit after both the pipeline and the merge buffer that aliases it.
__host__ __device__ constexpr int bar_off(int dk, int dv, int cb) {
  return pipe_bytes(dk, dv, cb) > merge_bytes(dv) ? pipe_bytes(dk, dv, cb) : merge_bytes(dv);
}
__host__ __device__ constexpr int smem_total(int dk, int dv, int cb) {
  return bar_off(dk, dv, cb) + kWarps * num_stages(dk, dv, cb) * 8;
}

template <class CT>
struct CacheTraits;
template <>
struct CacheTraits<__nv_bfloat16> {
  using MT = __nv_bfloat16;  // mma operand type
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false;
};
template <>
struct CacheTraits<__half> {
  using MT = __half;
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false;
};
template <>
struct CacheTraits<__nv_fp8_e4m3> {
  using MT = __half;  // e4m3 -> fp16 is exact
  static constexpr int kBytes = 1;
  static constexpr bool kFp8 = true;
};

template <class QT>
__device__ __forceinline__ float q_to_float(const uint8_t* p) {
  return static_cast<float>(*reinterpret_cast<const QT*>(p));
}

template <class QT>
__device__ __forceinline__ void store_q(uint8_t* p, float f) {
  *reinterpret_cast<QT*>(p) = static_cast<QT>(f);
}
template <>
__device__ __forceinline__ void store_q<__nv_bfloat16>(uint8_t* p, float f) {
  *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(f);
}
template <>
__device__ __forceinline__ void store_q<__half>(uint8_t* p, float f) {
  *reinterpret_cast<__half*>(p) = __float2half_rn(f);
}

// Two floats as one packed register of the mma type (lo in the low half).
template <class MT>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

template <class MT>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<MT, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// Four e4m3 bytes to two fp16x2 registers: lo = bytes 0,1; hi = bytes 2,3 (byte 0 -> low half).
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}

// One-dimensional bulk copy (TMA) of `bytes` (multiple of 16, 16-byte aligned ends) into shared
// memory; completion is counted in bytes on the mbarrier at `bar`.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// 16-byte cp.async (zero-filled when !valid; then nothing is read) and an arrival on the mbarrier
// at `bar` once every earlier cp.async of this thread has landed (the pending count is not raised:
// the barrier is initialised with one arrival per lane).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const uint32_t n = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(
          bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Programmatic dependent launch: the merge kernel is launched while the decode runs and waits
// here for its partials (a no-op when launched without the attribute).
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Request b's length clamped to its block table, and its units (warp tiles).
__device__ __forceinline__ int clamped_len(const Args& a, int b) {
  return max(0, min(__ldg(a.lens + b), a.max_blocks * a.P));
}
__device__ __forceinline__ int request_units(const Args& a, int b) { return (clamped_len(a, b) + kTW - 1) / kTW; }

// First unit of CTA c of a balanced grid of n CTAs over w units: floor(c * w / n), no overflow.
__host__ __device__ __forceinline__ int64_t range_lo(int64_t w, int n, int c) {
  return (w / n) * c + ((w % n) * c) / n;
}

// The CTA of the balanced grid whose range [range_lo(c), range_lo(c + 1)) holds unit x < w.
__device__ __forceinline__ int range_owner(int64_t w, int n, int64_t x) {
  int c = static_cast<int>(static_cast<double>(x) * n / static_cast<double>(w));
  c = min(max(c, 0), n - 1);
  while (c + 1 < n && range_lo(w, n, c + 1) <= x) ++c;
  while (c > 0 && range_lo(w, n, c) > x) --c;
  return c;
}

// Block-wide (kThreads threads): units of all requests, and of the requests before `upto`.
__device__ __forceinline__ void unit_sums(const Args& a, int upto, int64_t& total, int64_t& before, int64_t* red) {
  int64_t t = 0, bf = 0;
  for (int b = threadIdx.x; b < a.B; b += kThreads) {
    const int64_t u = request_units(a, b);
    t += u;
    if (b < upto) bf += u;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    t += __shfl_xor_sync(0xffffffffu, t, o);
    bf += __shfl_xor_sync(0xffffffffu, bf, o);
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red[warp] = t;
    red[kWarps + warp] = bf;
  }
  __syncthreads();
  total = 0;
  before = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    total += red[w];
    before += red[kWarps + w];
  }
  __syncthreads();  // red may be reused
}

// Block-wide: the request whose units hold unit x (< total) and the units before it.
__device__ __forceinline__ int find_request(const Args& a, int64_t x, int64_t& pre, int64_t* red, int* found) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) *found = -1;
  __syncthreads();
  int64_t base = 0;
  for (int c0 = 0; c0 < a.B; c0 += kThreads) {
    const int b = c0 + static_cast<int>(threadIdx.x);
    const int64_t u = b < a.B ? request_units(a, b) : 0;
    int64_t inc = u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t n = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += n;
    }
    if (lane == 31) red[warp] = inc;
    __syncthreads();
    int64_t wbase = 0, ctot = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      wbase += w < warp ? red[w] : 0;
      ctot += red[w];
    }
    const int64_t p = base + wbase + inc - u;
    if (u > 0 && p <= x && x < p + u) {
      *found = b;
      red[kWarps] = p;
    }
    __syncthreads();
    const int fb = *found;
    if (fb >= 0) {
      pre = red[kWarps];
      return fb;
    }
    base += ctot;
  }
  pre = base;
  return -1;
}

template <class QT, class CT, int DK, int DV>
__global__ void __launch_bounds__(kThreads) decode_paged_kernel(const Args a) {
  using Tr = CacheTraits<CT>;
  using MT = typename Tr::MT;
  constexpr int CB = Tr::kBytes;
  constexpr bool F8 = Tr::kFp8;
  constexpr int RK = row_k(DK, CB), RV = row_v(DV, CB);
  constexpr int STAGE = stage_bytes(DK, DV, CB);
  constexpr int NST = num_stages(DK, DV, CB);
  constexpr int KS = DK / 16;                          // k-steps of S^T
  constexpr int MTV = DV / 16;                         // m-tiles of O^T
  constexpr int CK = DK * CB / 16, CV = DV * CB / 16;  // 16-byte chunks per row
  static_assert(CK % 2 == 0 && CV % 2 == 0, "rows are whole pairs of 16-byte chunks");
  // fp8 rows (64-256 bytes) are filled by 16-byte cp.async: one bulk copy per short row is
  // limited by the copy rate, not by bytes. 2-byte caches use one bulk copy per row.
  constexpr bool kCpAsync = F8;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int64_t s_red[2 * kWarps + 1];
  __shared__ int s_found;

  griddep_launch_dependents();  // the merge kernel may start its prologue now
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;  // mma fragment row / column pair
  const float ninf = -INFINITY;

  // Split schedule: an empty split (or empty sequence) has defined outputs and reads nothing.
  if (!a.balanced) {
    const int s = blockIdx.x % a.S, rest = blockIdx.x / a.S;
    const int hc = rest % a.HC, kvh = rest / a.HC, b = blockIdx.y;
    const int h0 = kvh * a.G + hc * kN, ng = min(kN, a.G - hc * kN);
    const int len = clamped_len(a, b);
    const int chunk = (((len + a.S - 1) / a.S) + kT - 1) / kT * kT;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    if (start >= end) {
      for (int i = tid; i < ng * DV; i += kThreads) {
        const int g = i / DV, d = i - g * DV, h = h0 + g;
        if (a.S == 1) {
          store_q<QT>(a.o + b * a.o_sb + h * a.o_sh + int64_t{d} * sizeof(QT), 0.0f);
          if (a.lse != nullptr && d == 0) a.lse[int64_t{b} * a.Hq + h] = ninf;
        } else {
          const int64_t row = (int64_t{b} * a.Hq + h) * a.S + s;
          a.ws_o[row * DV + d] = 0.0f;
          if (d == 0) a.ws_lse[row] = ninf;
        }
      }
      return;
    }
  }

  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t wsm = sbase + warp * NST * STAGE;
  // Per-warp stage barriers. `seq` counts the stages this warp has consumed over all its pieces:
  // use q of the pipeline sits in stage q % NST, in phase (q / NST) & 1 of its barrier.
  const uint32_t bars = sbase + bar_off(DK, DV, CB) + warp * NST * 8;
  if (lane == 0) {
    for (int st = 0; st < NST; ++st) mbar_init(bars + st * 8, kCpAsync ? 32 : 1);
    mbar_init_fence();
  }
  __syncwarp();
  uint32_t seq = 0;

  // One piece: tokens [start, end) (end > start) of request b for kv head kvh and head chunk hc.
  // direct: o and lse are written; else fp32 partials at wo[head * wo_hs + d], wl[head * wl_hs].
  auto piece = [&](int b, int kvh, int hc, int start, int end, bool direct, float* wo, int64_t wo_hs, float* wl,
                   int64_t wl_hs) {
    const int h0 = kvh * a.G + hc * kN;
    const int ng = min(kN, a.G - hc * kN);  // heads written (kN - ng padding heads have q = 0)

    // Q^T as mma B fragments (n = head gq). Column pair (tq) of k-step c holds head dims
    //   16c + 2tq, +1 | 16c + 8 + 2tq, +1   (2-byte cache: ldmatrix pairs)
    //   16c + 4tq, +1 | 16c + 4tq + 2, +3   (fp8 cache: 4 bytes per ldmatrix element pair)
    uint32_t qf[KS][2];
    float score_scale = a.score_scale;
    {
      float qv[KS][4];
      const bool hv = gq < ng;
      const uint8_t* qrow = a.q + b * a.q_sb + (h0 + (hv ? gq : 0)) * a.q_sh;
      float amax = 0.0f;
#pragma unroll
      for (int c = 0; c < KS; ++c) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int d = F8 ? 16 * c + 4 * tq + j : 16 * c + 2 * tq + (j & 1) + 8 * (j >> 1);
          qv[c][j] = hv ? q_to_float<QT>(qrow + int64_t{d} * sizeof(QT)) : 0.0f;
          amax = fmaxf(amax, fabsf(qv[c][j]));
        }
      }
      float qscale = 1.0f;
      if constexpr (F8 && std::is_same_v<QT, __nv_bfloat16>) {
        // bf16 q into fp16 range by a power of two (exact): |q| * qscale < 2^15.
        amax = warp_max(amax);
        if (amax > 0.0f && amax < INFINITY) {
          int e = 0;
          (void)frexpf(amax, &e);
          qscale = ldexpf(1.0f, max(-100, min(100, 15 - e)));
        }
        score_scale = a.score_scale / qscale;
      }
#pragma unroll
      for (int c = 0; c < KS; ++c) {
        qf[c][0] = pack2<MT>(qv[c][0] * qscale, qv[c][1] * qscale);
        qf[c][1] = pack2<MT>(qv[c][2] * qscale, qv[c][3] * qscale);
      }
    }

    const int32_t* bt = a.bt + int64_t{b} * a.bt_stride;
    const uint8_t* kbase = a.k + kvh * a.k_sh;
    const uint8_t* vbase = a.v + kvh * a.v_sh;

    // Warp tile i of this warp: tokens [start + (warp + i * kWarps) * kTW, +kTW). Lane l copies
    // row l % 16 of K (l < 16) or V (l >= 16) with one bulk copy; rows past the end are not read
    // (K rows are masked, V rows are zeroed so that 0 * garbage cannot make a NaN).
    auto load = [&](int stage, int i) {
      const int r = lane & (kTW - 1);
      const bool is_v = lane >= kTW;
      const int n0 = start + (warp + i * kWarps) * kTW;
      const int nvalid = min(kTW, end - n0);
      const uint32_t bar = bars + stage * 8;
      if constexpr (kCpAsync) {
        // Lane l finds the address of K row l (l < 16) or V row l - 16; the warp then copies the
        // tile in 16-byte pieces, consecutive lanes on consecutive pieces of a row. Rows past the
        // end are zero-filled (K rows are masked anyway).
        const uint8_t* row = is_v ? vbase : kbase;
        if (r < nvalid) {
          const int n = n0 + r;
          int pi, off;
          if (a.p_shift >= 0) {
            pi = n >> a.p_shift;
            off = n & (a.P - 1);
          } else {
            pi = n / a.P;
            off = n - pi * a.P;
          }
          const int64_t pg = __ldg(bt + pi);
          row = is_v ? vbase + pg * a.v_sp + int64_t{off} * a.v_st : kbase + pg * a.k_sp + int64_t{off} * a.k_st;
        }
        const uint32_t sk = wsm + stage * STAGE, sv = sk + kTW * RK;
        const unsigned long long ra = reinterpret_cast<unsigned long long>(row);
#pragma unroll
        for (int j = 0; j < kTW * CK / 32; ++j) {
          const int idx = lane + 32 * j, rr = idx / CK, c = idx - rr * CK;
          const auto src = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, ra, rr));
          cp_async16(sk + rr * RK + c * 16, src + (rr < nvalid ? c * 16 : 0), rr < nvalid);
        }
#pragma unroll
        for (int j = 0; j < kTW * CV / 32; ++j) {
          const int idx = lane + 32 * j, rr = idx / CV, c = idx - rr * CV;
          const auto src = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, ra, kTW + rr));
          cp_async16(sv + rr * RV + c * 16, src + (rr < nvalid ? c * 16 : 0), rr < nvalid);
        }
        cp_async_arrive(bar);
        return;
      }
      if (lane == 0) {
        proxy_fence();  // this stage's earlier generic reads (ordered by __syncwarp) before the async writes
        mbar_arrive_tx(bar, static_cast<uint32_t>(nvalid * (DK + DV) * CB));
      }
      __syncwarp();
      const uint32_t dst = wsm + stage * STAGE + (is_v ? kTW * RK + r * RV : r * RK);
      if (r < nvalid) {
        const int n = n0 + r;
        int pi, off;
        if (a.p_shift >= 0) {
          pi = n >> a.p_shift;
          off = n & (a.P - 1);
        } else {
          pi = n / a.P;
          off = n - pi * a.P;
        }
        const int64_t pg = __ldg(bt + pi);
        const uint8_t* src =
            is_v ? vbase + pg * a.v_sp + int64_t{off} * a.v_st : kbase + pg * a.k_sp + int64_t{off} * a.k_st;
        bulk_g2s(dst, src, static_cast<uint32_t>((is_v ? DV : DK) * CB), bar);
      } else if (is_v) {
        uint4* z = reinterpret_cast<uint4*>(smem + (dst - sbase));
#pragma unroll
        for (int j = 0; j < CV; ++j) z[j] = make_uint4(0, 0, 0, 0);
      }
    };

    const int ntiles = (end - start + kTW - 1) / kTW;
    const int nw = ntiles > warp ? (ntiles - warp + kWarps - 1) / kWarps : 0;
#pragma unroll
    for (int st = 0; st < NST - 1; ++st)
      if (st < nw) load(static_cast<int>((seq + st) % NST), st);

    // O^T accumulators: o[mt][0..1] = (dim dmap(mt, 0), heads 2tq, 2tq+1), o[mt][2..3] = dim dmap(mt, 1).
    float o[MTV][4];
#pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) o[mt][j] = 0.0f;
    float m0 = ninf, m1 = ninf, l0 = 0.0f, l1 = 0.0f;  // heads 2tq, 2tq+1 (base-2 units)
    const float cap = a.logit_cap;

    for (int i = 0; i < nw; ++i) {
      {
        const int nx = i + NST - 1;
        if (nx < nw) load(static_cast<int>((seq + nx) % NST), nx);
      }
      const uint32_t use = seq + i;
      const int stage = static_cast<int>(use % NST);
      mbar_wait(bars + stage * 8, (use / NST) & 1u);
      __syncwarp();
      const uint32_t ks = wsm + stage * STAGE, vs = ks + kTW * RK;
      const int n0 = start + (warp + i * kWarps) * kTW;

      // S^T = K . Q^T: rows gq, gq + 8 (tokens), columns 2tq, 2tq+1 (heads).
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      {
        const uint32_t kaddr = ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * RK + 16 * (lane >> 4);
        if constexpr (!F8) {
#pragma unroll
          for (int c = 0; c < KS; ++c) {
            uint32_t af[4];
            ldsm_x4(af, kaddr + c * 32);
            mma16816<MT>(sc, af, qf[c][0], qf[c][1]);
          }
        } else {
#pragma unroll
          for (int c = 0; c < KS; c += 2) {
            uint32_t r[4], af[4];
            ldsm_x4(r, kaddr + c * 16);
            e4m3x4_to_f16(r[0], af[0], af[2]);
            e4m3x4_to_f16(r[1], af[1], af[3]);
            mma16816<MT>(sc, af, qf[c][0], qf[c][1]);
            e4m3x4_to_f16(r[2], af[0], af[2]);
            e4m3x4_to_f16(r[3], af[1], af[3]);
            mma16816<MT>(sc, af, qf[c + 1][0], qf[c + 1][1]);
          }
        }
      }

      // Online softmax per head over this tile (max across the 8 row groups of the warp).
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v = sc[j] * score_scale;
        if (cap > 0.0f) v = cap * tanhf(v / cap);
        x[j] = n0 + gq + 8 * (j >> 1) < end ? v * kLog2e : ninf;
      }
      float mx0 = fmaxf(x[0], x[2]), mx1 = fmaxf(x[1], x[3]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);  // finite: the tile has a valid token
      const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
      m0 = mn0;
      m1 = mn1;
      const float p0 = exp2f(x[0] - mn0), p1 = exp2f(x[1] - mn1), p2 = exp2f(x[2] - mn0), p3 = exp2f(x[3] - mn1);
      l0 = l0 * al0 + (p0 + p2);
      l1 = l1 * al1 + (p1 + p3);
#pragma unroll
      for (int mt = 0; mt < MTV; ++mt) {
        o[mt][0] *= al0;
        o[mt][1] *= al1;
        o[mt][2] *= al0;
        o[mt][3] *= al1;
      }
      // P^T as the B fragment: transpose the (token, head) pairs into (head, token) pairs.
      const uint32_t pb0 = movmatrix_t(pack2<MT>(p0, p1));
      const uint32_t pb1 = movmatrix_t(pack2<MT>(p2, p3));

      // O^T += V^T . P^T
      if constexpr (!F8) {
        const uint32_t vaddr = vs + ((lane & 7) + 8 * (lane >> 4)) * RV + 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int mt = 0; mt < MTV; ++mt) {
          uint32_t af[4];
          ldsm_x4_t(af, vaddr + mt * 32);
          mma16816<MT>(o[mt], af, pb0, pb1);
        }
      } else {
        const uint32_t vaddr = vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * RV + 16 * (lane >> 4);
#pragma unroll
        for (int mt = 0; mt < MTV; mt += 2) {
          uint32_t r[4], af[4];
          ldsm_x4_t(r, vaddr + mt * 16);
          // r = bytes (tok 2tq, dim 2gq), (2tq, 2gq+1), (2tq+1, 2gq), (2tq+1, 2gq+1): pair by dim.
          e4m3x4_to_f16(__byte_perm(r[0], 0, 0x3120), af[0], af[1]);
          e4m3x4_to_f16(__byte_perm(r[1], 0, 0x3120), af[2], af[3]);
          mma16816<MT>(o[mt], af, pb0, pb1);
          e4m3x4_to_f16(__byte_perm(r[2], 0, 0x3120), af[0], af[1]);
          e4m3x4_to_f16(__byte_perm(r[3], 0, 0x3120), af[2], af[3]);
          mma16816<MT>(o[mt + 1], af, pb0, pb1);
        }
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
    }
    seq += static_cast<uint32_t>(nw);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    __syncthreads();  // every copy was waited for; the stages are reused for the merge below

    // Merge the four warps: mo[warp][head][dim], ml[warp][head] = (m, l).
    float* mo = reinterpret_cast<float*>(smem);
    float* ml = mo + kWarps * kN * DV;
#pragma unroll
    for (int mt = 0; mt < MTV; ++mt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int head = 2 * tq + (j & 1), hi = j >> 1;
        const int d = F8 ? 16 * mt + 2 * gq + hi : 16 * mt + gq + 8 * hi;
        mo[(warp * kN + head) * DV + d] = o[mt][j];
      }
    }
    if (gq == 0) {
      ml[(warp * kN + 2 * tq) * 2] = m0;
      ml[(warp * kN + 2 * tq) * 2 + 1] = l0;
      ml[(warp * kN + 2 * tq + 1) * 2] = m1;
      ml[(warp * kN + 2 * tq + 1) * 2 + 1] = l1;
    }
    __syncthreads();
    for (int idx = tid; idx < ng * DV; idx += kThreads) {
      const int head = idx / DV, d = idx - head * DV, h = h0 + head;
      float M = ninf;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, ml[(w * kN + head) * 2]);
      float L = 0.0f, acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = ml[(w * kN + head) * 2];
        if (mw != ninf) {  // a warp without tiles contributes nothing
          const float e = exp2f(mw - M);
          L += e * ml[(w * kN + head) * 2 + 1];
          acc += e * mo[(w * kN + head) * DV + d];
        }
      }
      const float out = acc / L * a.v_scale;
      const float lse = (M + log2f(L)) * kLn2;
      if (direct) {
        store_q<QT>(a.o + b * a.o_sb + h * a.o_sh + int64_t{d} * sizeof(QT), out);
        if (a.lse != nullptr && d == 0) a.lse[int64_t{b} * a.Hq + h] = lse;
      } else {
        wo[head * wo_hs + d] = out;
        if (d == 0) wl[head * wl_hs] = lse;
      }
    }
    proxy_fence();    // the merge buffer's generic accesses before the next piece's bulk copies
    __syncthreads();  // ... and every thread is done with it
  };

  if (!a.balanced) {
    const int s = blockIdx.x % a.S, rest = blockIdx.x / a.S;
    const int hc = rest % a.HC, kvh = rest / a.HC, b = blockIdx.y;
    const int len = clamped_len(a, b);
    const int chunk = (((len + a.S - 1) / a.S) + kT - 1) / kT * kT;
    const int start = s * chunk;
    const int end = min(len, start + chunk);
    const int64_t row = (int64_t{b} * a.Hq + kvh * a.G + hc * kN) * a.S + s;
    piece(b, kvh, hc, start, end, a.S == 1, a.ws_o + row * DV, int64_t{a.S} * DV, a.ws_lse + row, a.S);
    return;
  }

  // Balanced schedule: the units of all requests laid end to end are cut into M equal ranges,
  // one per group of IH CTAs (CTA = group * IH + ih serves kv head / head chunk ih), and each
  // range is cut at request ends into pieces. The IH CTAs of a group run together on the same
  // tokens, so they read the K/V pages of all heads at about the same time (whole DRAM rows of
  // an NHD page), as the split schedule's neighbouring CTAs do.
  int64_t total = 0, unused = 0;
  unit_sums(a, 0, total, unused, s_red);
  const int ih = static_cast<int>(blockIdx.x) % a.IH, grp = static_cast<int>(blockIdx.x) / a.IH;
  const int ngrp = a.grid / a.IH;
  const int64_t lo = range_lo(total, ngrp, grp), hi = grp + 1 < ngrp ? range_lo(total, ngrp, grp + 1) : total;
  if (lo >= hi) return;
  int64_t pre = 0;
  int b = find_request(a, lo, pre, s_red, &s_found);
  if (b < 0) return;  // not reached: lo < total
  int nt = request_units(a, b);
  int t = static_cast<int>(lo - pre);
  const int kvh = ih / a.HC, hc = ih - kvh * a.HC;
  for (int64_t pos = lo;;) {
    const int t1 = static_cast<int>(min(int64_t{nt}, t + (hi - pos)));
    const int64_t slot = (int64_t{b} + grp) * a.IH + ih;  // unique per (request, group): see the merge
    piece(b, kvh, hc, t * kTW, min(clamped_len(a, b), t1 * kTW), t == 0 && t1 == nt, a.ws_o + slot * kN * DV, DV,
          a.ws_lse + slot * kN, 1);
    pos += t1 - t;
    if (pos >= hi) break;
    t = 0;
    do {
      nt = request_units(a, ++b);
    } while (nt == 0);
  }
}

// LSE merge of the split partials, in split order; empty splits (-inf) contribute nothing.
template <class QT>
__global__ void __launch_bounds__(128) decode_paged_merge_kernel(const Args a, int dv) {
  griddep_wait();
  const int b = blockIdx.y, h = blockIdx.x;
  const int64_t row = int64_t{b} * a.Hq + h;
  const float* lse_s = a.ws_lse + row * a.S;
  const float ninf = -INFINITY;
  float M = ninf;
  for (int s = 0; s < a.S; ++s) M = fmaxf(M, lse_s[s]);
  float W = 0.0f;
  for (int s = 0; s < a.S; ++s)
    if (lse_s[s] != ninf) W += expf(lse_s[s] - M);
  for (int d = threadIdx.x; d < dv; d += blockDim.x) {
    float o = 0.0f;
    if (M != ninf) {
      for (int s = 0; s < a.S; ++s)
        if (lse_s[s] != ninf) o += expf(lse_s[s] - M) * a.ws_o[(row * a.S + s) * dv + d];
      o /= W;
    }
    store_q<QT>(a.o + b * a.o_sb + h * a.o_sh + int64_t{d} * sizeof(QT), o);
  }
  if (threadIdx.x == 0 && a.lse != nullptr) a.lse[row] = M == ninf ? ninf : M + logf(W);
}

// Merge of the balanced schedule, one block per (head, request): an empty request gets o = 0 and
// lse = -inf; a request held by one group was written by its CTAs; a request cut between groups
// g0..g1 has its partials in slots (b + g) * IH + ih. Those are distinct: were (b, g) and
// (b', g - (b' - b)) both pieces with b' > b, group g would start before request b ends and
// group g - (b' - b) < g end after request b' starts, which is at or after request b's end.
template <class QT>
__global__ void __launch_bounds__(kThreads) decode_paged_merge_balanced_kernel(const Args a, int dv) {
  __shared__ int64_t s_red[2 * kWarps];
  const int b = blockIdx.y, h = blockIdx.x;
  int64_t total = 0, before = 0;
  unit_sums(a, b, total, before, s_red);
  const int kvh = h / a.G, gi = h - kvh * a.G, hc = gi / kN, g = gi - hc * kN;
  const int ih = kvh * a.HC + hc;
  const int nt = request_units(a, b);
  const int ngrp = a.grid / a.IH;
  griddep_wait();
  uint8_t* orow = a.o + b * a.o_sb + h * a.o_sh;
  const float ninf = -INFINITY;
  if (nt == 0) {
    for (int d = threadIdx.x; d < dv; d += blockDim.x) store_q<QT>(orow + int64_t{d} * sizeof(QT), 0.0f);
    if (threadIdx.x == 0 && a.lse != nullptr) a.lse[int64_t{b} * a.Hq + h] = ninf;
    return;
  }
  const int g0 = range_owner(total, ngrp, before), g1 = range_owner(total, ngrp, before + nt - 1);
  if (g0 == g1) return;
  const int64_t slot0 = (int64_t{b} + g0) * a.IH + ih, step = int64_t{a.IH} * kN;  // floats between groups
  const float* wl = a.ws_lse + slot0 * kN + g;
  const float* wo = a.ws_o + (slot0 * kN + g) * dv;
  const int ns = g1 - g0 + 1;
  float M = ninf;
  for (int s = 0; s < ns; ++s) M = fmaxf(M, wl[s * step]);
  float W = 0.0f;
  for (int s = 0; s < ns; ++s) W += expf(wl[s * step] - M);
  for (int d = threadIdx.x; d < dv; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < ns; ++s) o += expf(wl[s * step] - M) * wo[s * step * dv + d];
    store_q<QT>(orow + int64_t{d} * sizeof(QT), o / W);
  }
  if (threadIdx.x == 0 && a.lse != nullptr) a.lse[int64_t{b} * a.Hq + h] = M + logf(W);
}

using KernelFn = void (*)(Args);

template <class QT, class CT, int DK>
KernelFn pick_dv(int dv) {
  switch (dv) {
    case 64: return decode_paged_kernel<QT, CT, DK, 64>;
    case 128: return decode_paged_kernel<QT, CT, DK, 128>;
    case 192: return decode_paged_kernel<QT, CT, DK, 192>;
    case 256: return decode_paged_kernel<QT, CT, DK, 256>;
    default: return nullptr;
  }
}

template <class QT, class CT>
KernelFn pick_dk_dv(int dk, int dv) {
  switch (dk) {
    case 64: return pick_dv<QT, CT, 64>(dv);
    case 128: return pick_dv<QT, CT, 128>(dv);
    case 192: return pick_dv<QT, CT, 192>(dv);
    case 256: return pick_dv<QT, CT, 256>(dv);
    default: return nullptr;
  }
}

// One per cache/query dtype pair, each in its own translation unit (inst_*.cu).
KernelFn pick_bf16(int dk, int dv);
KernelFn pick_fp16(int dk, int dv);
KernelFn pick_fp8_bf16q(int dk, int dv);
KernelFn pick_fp8_fp16q(int dk, int dv);

}  // namespace kvferry::decode_paged_detail
