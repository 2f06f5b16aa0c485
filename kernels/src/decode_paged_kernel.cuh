#pragma once
// CUDA paged MHA/GQA decode over strided K/V views (kernel templates; instantiated per cache
// dtype in decode_paged_inst_*.cu, launched from decode_paged.cu).
//
// One CTA (8 warps) per (request, kv head, head chunk, split) serves the whole GQA group (up to
// 8 query heads, a compile-time NG so the inner loops have no head guards), so each K/V row is
// read from HBM once. K/V tiles of 32 tokens are copied into shared memory with 16-byte
// cp.async in a 3-stage pipeline; scores and P·V run from shared memory with fp32
// accumulation and an online softmax in base 2. Splits write fp32 partials merged by LSE in a
// second kernel.
//
// Status: ~0.50 of the d2d-rate floor on an H200 for the Llama-3-8B-like case (bench/
// decode_mha_suite.cpp has the table). Still instruction/latency-bound (fp8 is barely faster
// than bf16); the next steps are mma.sync m16n8k16 for Q·K and P·V (8x fewer math
// instructions per token), packed bf16x2 math, and 64-token tiles to halve the barriers.
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

#include "kvferry/kernels/decode_paged.h"

namespace kvferry::decode_paged_detail {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kT = kDecodePagedTile;  // tokens per tile
constexpr int kStages = 3;
constexpr int kG = kDecodePagedMaxGroup;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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
  int p_shift;    // log2(P) when P is a power of two, else -1
  float* ws_o;    // [B, Hq, S, Dv]
  float* ws_lse;  // [B, Hq, S]
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

// Eight cache elements (16 bytes of bf16/fp16, or 8 bytes of fp8) to floats.
template <class CT>
struct Cvt;

template <>
struct Cvt<__nv_bfloat16> {
  static constexpr int kBytes = 2;
  __device__ __forceinline__ static void eight(const uint8_t* s, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(s);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h;
      memcpy(&h, &w[i], 4);
      const float2 x = __bfloat1622float2(h);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
};

template <>
struct Cvt<__half> {
  static constexpr int kBytes = 2;
  __device__ __forceinline__ static void eight(const uint8_t* s, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(s);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 x = __half22float2(h);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
};

template <>
struct Cvt<__nv_fp8_e4m3> {
  static constexpr int kBytes = 1;
  __device__ __forceinline__ static void eight(const uint8_t* s, float* f) {
    const uint2 u = *reinterpret_cast<const uint2*>(s);
    const uint32_t w[2] = {u.x, u.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // e4m3 -> fp16 is exact (every e4m3 value is an fp16 value).
        const __half2_raw r =
            __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j)), __NV_E4M3);
        __half2 h;
        memcpy(&h, &r, 4);
        const float2 x = __half22float2(h);
        f[4 * i + 2 * j] = x.x;
        f[4 * i + 2 * j + 1] = x.y;
      }
    }
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Shared-memory plan (bytes); rows are padded by 16 bytes so that 8 consecutive rows read at
// the same column fall into distinct 16-byte bank groups.
struct Smem {
  int rsk, rsv, k_off, v_off, q_off, red_off, p_off, a_off, ml_off, fin_off, total;
  __host__ __device__ Smem(int dk, int dv, int cbytes) {
    rsk = dk * cbytes + 16;
    rsv = dv * cbytes + 16;
    k_off = 0;
    v_off = k_off + kStages * kT * rsk;
    q_off = v_off + kStages * kT * rsv;
    red_off = q_off + kG * dk * 4;
    p_off = red_off + kWarps * kG * kT * 4;
    a_off = p_off + kG * kT * 4;
    ml_off = a_off + kG * 4;
    total = ml_off + 2 * kG * 4;
    fin_off = 0;  // after the main loop: aliases the K/V stages (>= kThreads * 8 floats)
  }
};

template <class QT, class CT, int DV, int NG>
__global__ void __launch_bounds__(kThreads, NG >= 8 ? 2 : 3) decode_paged_kernel(const Args a) {
  static_assert(NG >= 1 && NG <= kG && NG <= kWarps, "group chunk");
  constexpr int CB = Cvt<CT>::kBytes;
  constexpr int CHV = DV / 8;          // 8-element V chunks per row
  constexpr int NTG = kThreads / CHV;  // token groups in P·V
  constexpr int TPG = (kT + NTG - 1) / NTG;
  static_assert(kStages * kT * (64 * 1 + 16) * 2 >= kThreads * 8 * 4, "fin must fit in the stages");
  extern __shared__ __align__(16) uint8_t smem[];
  const Smem L(a.Dk, DV, CB);
  float* qs = reinterpret_cast<float*>(smem + L.q_off);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  float* ps = reinterpret_cast<float*>(smem + L.p_off);
  float* alpha_s = reinterpret_cast<float*>(smem + L.a_off);
  float* ml_s = reinterpret_cast<float*>(smem + L.ml_off);
  float* fin = reinterpret_cast<float*>(smem + L.fin_off);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x % a.S;
  const int rest = blockIdx.x / a.S;
  const int hc = rest % a.HC;
  const int kvh = rest / a.HC;
  const int b = blockIdx.y;
  const int h0 = kvh * a.G + hc * kG;
  const int ng = min(NG, a.G - hc * kG);  // heads written (NG - ng padding heads have q = 0)
  const int len = max(0, min(a.lens[b], a.max_blocks * a.P));
  const int chunk = (((len + a.S - 1) / a.S) + kT - 1) / kT * kT;
  const int start = s * chunk;
  const int end = min(len, start + chunk);
  const float ninf = -INFINITY;

  if (start >= end) {  // empty split (or empty sequence): defined outputs, nothing read
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

  // Query rows as fp32 in shared memory (read as broadcasts); padding heads are zero.
  for (int i = tid; i < NG * a.Dk; i += kThreads) {
    const int g = i / a.Dk, d = i - g * a.Dk;
    qs[g * a.Dk + d] = g < ng ? q_to_float<QT>(a.q + b * a.q_sb + (h0 + g) * a.q_sh + int64_t{d} * sizeof(QT)) : 0.0f;
  }

  const int32_t* bt = a.bt + int64_t{b} * a.bt_stride;
  const uint8_t* kbase = a.k + kvh * a.k_sh;
  const uint8_t* vbase = a.v + kvh * a.v_sh;
  const int ck = a.Dk * CB / 16;  // 16-byte chunks per K row
  constexpr int ckv = DV * CB / 16;
  const int kstep = kThreads / ck, kc = tid % ck, kt0 = tid / ck;
  constexpr int vstep = kThreads / ckv;
  const int vc = tid % ckv, vt0 = tid / ckv;

  auto page_of = [&](int n, int& pi, int& off) {
    if (a.p_shift >= 0) {
      pi = n >> a.p_shift;
      off = n & (a.P - 1);
    } else {
      pi = n / a.P;
      off = n - pi * a.P;
    }
  };
  auto load_tile = [&](int stage, int t0) {
    uint8_t* ks = smem + L.k_off + stage * kT * L.rsk;
    uint8_t* vs = smem + L.v_off + stage * kT * L.rsv;
    if (kt0 < kstep) {
#pragma unroll 4
      for (int t = kt0; t < kT; t += kstep) {
        const int n = t0 + t;
        const bool ok = n < end;
        const uint8_t* src = kbase;
        if (ok) {
          int pi, off;
          page_of(n, pi, off);
          src = kbase + int64_t{__ldg(bt + pi)} * a.k_sp + int64_t{off} * a.k_st + kc * 16;
        }
        cp_async16(ks + t * L.rsk + kc * 16, src, ok);
      }
    }
    if (vt0 < vstep) {
#pragma unroll 4
      for (int t = vt0; t < kT; t += vstep) {
        const int n = t0 + t;
        const bool ok = n < end;
        const uint8_t* src = vbase;
        if (ok) {
          int pi, off;
          page_of(n, pi, off);
          src = vbase + int64_t{__ldg(bt + pi)} * a.v_sp + int64_t{off} * a.v_st + vc * 16;
        }
        cp_async16(vs + t * L.rsv + vc * 16, src, ok);
      }
    }
  };

  const int ntiles = (end - start + kT - 1) / kT;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < ntiles) load_tile(st, start + st * kT);
    cp_async_commit();
  }

  // Online-softmax state of head g = warp (base-2 units); lanes hold copies.
  float m_r = ninf, l_r = 0.0f;
  // P·V accumulators: this thread's 8 columns of V for every head of the chunk.
  float acc[NG][8];
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  const int cc = tid % CHV, tg = tid / CHV;

  for (int it = 0; it < ntiles; ++it) {
    const int nxt = it + kStages - 1;
    if (nxt < ntiles) load_tile(nxt % kStages, start + nxt * kT);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();
    const int stage = it % kStages;
    const int t0 = start + it * kT;
    const uint8_t* ks = smem + L.k_off + stage * kT * L.rsk;
    const uint8_t* vs = smem + L.v_off + stage * kT * L.rsv;

    // 1. Partial dot products: lane = token, warps split the K row by 16-byte chunks.
    {
      float part[NG];
#pragma unroll
      for (int g = 0; g < NG; ++g) part[g] = 0.0f;
      const uint8_t* krow = ks + lane * L.rsk;
#pragma unroll 2
      for (int c = warp; c < ck; c += kWarps) {
        constexpr int E = 16 / CB;  // elements per 16-byte chunk
        float kf[E];
#pragma unroll
        for (int h = 0; h < E / 8; ++h) Cvt<CT>::eight(krow + c * 16 + h * 8 * CB, kf + 8 * h);
        const float4* qv = reinterpret_cast<const float4*>(qs + c * E);
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
          for (int i = 0; i < E / 4; ++i) {
            const float4 x = qv[g * (a.Dk / 4) + i];
            part[g] = fmaf(x.x, kf[4 * i], part[g]);
            part[g] = fmaf(x.y, kf[4 * i + 1], part[g]);
            part[g] = fmaf(x.z, kf[4 * i + 2], part[g]);
            part[g] = fmaf(x.w, kf[4 * i + 3], part[g]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < NG; ++g) red[(warp * NG + g) * kT + lane] = part[g];
    }
    __syncthreads();

    // 2. Scores, tile max and probabilities: warp g owns head g, lane = token.
    if (warp < NG) {
      const int g = warp;
      float x = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) x += red[(w * NG + g) * kT + lane];
      x *= a.score_scale;
      if (a.logit_cap > 0.0f) x = a.logit_cap * tanhf(x / a.logit_cap);
      x = t0 + lane < end ? x * kLog2e : ninf;
      const float mn = fmaxf(m_r, warp_max(x));
      const float al = exp2f(m_r - mn);
      const float pr = exp2f(x - mn);
      l_r = l_r * al + warp_sum(pr);
      m_r = mn;
      ps[g * kT + lane] = pr;
      if (lane == 0) alpha_s[g] = al;
    }
    __syncthreads();

    // 3. acc = acc * alpha + P · V over this thread's token group.
    if (tg < NTG) {
      const int valid = end - t0;
      float vf[TPG][8];
#pragma unroll
      for (int j = 0; j < TPG; ++j) {
        const int t = tg + j * NTG;
        if (t < kT && t < valid) {
          Cvt<CT>::eight(vs + t * L.rsv + cc * 8 * CB, vf[j]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) vf[j][i] = 0.0f;
        }
      }
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        const float al = alpha_s[g];
        float pr[TPG];
#pragma unroll
        for (int j = 0; j < TPG; ++j) {
          const int t = tg + j * NTG;
          pr[j] = (t < kT && t < valid) ? ps[g * kT + t] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float x = acc[g][i] * al;
#pragma unroll
          for (int j = 0; j < TPG; ++j) x = fmaf(pr[j], vf[j][i], x);
          acc[g][i] = x;
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are reused as `fin` below

  // Final: sum the token groups' partial accumulators per head, normalise, write.
  if (warp < NG && lane == 0) {
    ml_s[2 * warp] = m_r;
    ml_s[2 * warp + 1] = l_r;
  }
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    if (g < ng) {
      if (tg < NTG) {
#pragma unroll
        for (int i = 0; i < 8; ++i) fin[tg * DV + cc * 8 + i] = acc[g][i];
      }
      __syncthreads();
      const float m = ml_s[2 * g], l = ml_s[2 * g + 1];
      const int h = h0 + g;
      for (int d = tid; d < DV; d += kThreads) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < NTG; ++j) sum += fin[j * DV + d];
        const float out = sum / l * a.v_scale;
        if (a.S == 1) {
          store_q<QT>(a.o + b * a.o_sb + h * a.o_sh + int64_t{d} * sizeof(QT), out);
        } else {
          a.ws_o[((int64_t{b} * a.Hq + h) * a.S + s) * DV + d] = out;
        }
      }
      if (tid == 0) {
        const float lse = (m + log2f(l)) * kLn2;
        if (a.S == 1) {
          if (a.lse != nullptr) a.lse[int64_t{b} * a.Hq + h] = lse;
        } else {
          a.ws_lse[(int64_t{b} * a.Hq + h) * a.S + s] = lse;
        }
      }
      __syncthreads();
    }
  }
}

// LSE merge of the split partials, in split order; empty splits (-inf) contribute nothing.
template <class QT>
__global__ void __launch_bounds__(128) decode_paged_merge_kernel(const Args a, int dv) {
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

using KernelFn = void (*)(Args);

/// Group-chunk template size for a GQA group of G heads (chunks of at most kG).
inline int group_chunk(int G) { return G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8; }

template <class QT, class CT, int DV>
KernelFn pick_ng(int ng) {
  switch (ng) {
    case 1: return decode_paged_kernel<QT, CT, DV, 1>;
    case 2: return decode_paged_kernel<QT, CT, DV, 2>;
    case 4: return decode_paged_kernel<QT, CT, DV, 4>;
    case 8: return decode_paged_kernel<QT, CT, DV, 8>;
    default: return nullptr;
  }
}

template <class QT, class CT>
KernelFn pick_dv_ng(int dv, int ng) {
  switch (dv) {
    case 64: return pick_ng<QT, CT, 64>(ng);
    case 128: return pick_ng<QT, CT, 128>(ng);
    case 192: return pick_ng<QT, CT, 192>(ng);
    case 256: return pick_ng<QT, CT, 256>(ng);
    default: return nullptr;
  }
}

// One per cache/query dtype pair, each in its own translation unit (decode_paged_inst_*.cu).
KernelFn pick_bf16(int dv, int ng);
KernelFn pick_fp16(int dv, int ng);
KernelFn pick_fp8_bf16q(int dv, int ng);
KernelFn pick_fp8_fp16q(int dv, int ng);

}  // namespace kvferry::decode_paged_detail
