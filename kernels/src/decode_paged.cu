// CUDA paged MHA/GQA decode over strided K/V views.
//
// One CTA per (request, kv head, head chunk, split) serves the whole GQA group (up to 8 query
// heads), so each K/V row is read from HBM once. K/V tiles of 32 tokens are copied into shared
// memory with 16-byte cp.async in a 3-stage pipeline (several CTAs per SM keep enough bytes in
// flight); scores and P·V run from shared memory with fp32 accumulation and an online softmax
// in base 2. Splits write fp32 partials merged by LSE in a second kernel.
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

namespace kvferry {
namespace {

constexpr int kThreads = 128;
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
    fin_off = ml_off + 2 * kG * 4;
    total = fin_off + kThreads * 8 * 4;
  }
};

template <class QT, class CT, int DV>
__global__ void __launch_bounds__(kThreads, 3) decode_paged_kernel(const Args a) {
  constexpr int CB = Cvt<CT>::kBytes;
  constexpr int CHV = DV / 8;          // 8-element V chunks per row
  constexpr int NTG = kThreads / CHV;  // token groups in P·V
  constexpr int TPG = (kT + NTG - 1) / NTG;
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
  const int ng = min(kG, a.G - hc * kG);
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

  // Query rows as fp32 in shared memory (read as broadcasts).
  for (int i = tid; i < ng * a.Dk; i += kThreads) {
    const int g = i / a.Dk, d = i - g * a.Dk;
    qs[g * a.Dk + d] = q_to_float<QT>(a.q + b * a.q_sb + (h0 + g) * a.q_sh + int64_t{d} * sizeof(QT));
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
          src = kbase + int64_t{bt[pi]} * a.k_sp + int64_t{off} * a.k_st + kc * 16;
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
          src = vbase + int64_t{bt[pi]} * a.v_sp + int64_t{off} * a.v_st + vc * 16;
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

  // Online-softmax state of the heads this warp owns (g = warp, warp + 4), base-2 units.
  float m_r[2] = {ninf, ninf}, l_r[2] = {0.0f, 0.0f};
  // P·V accumulators: this thread's 8 columns of V for every head of the group.
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g)
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
      float part[kG];
#pragma unroll
      for (int g = 0; g < kG; ++g) part[g] = 0.0f;
      const uint8_t* krow = ks + lane * L.rsk;
      for (int c = warp; c < ck; c += kWarps) {
        constexpr int E = 16 / CB;  // elements per 16-byte chunk
        float kf[E];
#pragma unroll
        for (int h = 0; h < E / 8; ++h) Cvt<CT>::eight(krow + c * 16 + h * 8 * CB, kf + 8 * h);
        const int d0 = c * E;
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          if (g < ng) {
            const float4* qv = reinterpret_cast<const float4*>(qs + g * a.Dk + d0);
#pragma unroll
            for (int i = 0; i < E / 4; ++i) {
              const float4 x = qv[i];
              part[g] = fmaf(x.x, kf[4 * i], part[g]);
              part[g] = fmaf(x.y, kf[4 * i + 1], part[g]);
              part[g] = fmaf(x.z, kf[4 * i + 2], part[g]);
              part[g] = fmaf(x.w, kf[4 * i + 3], part[g]);
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kG; ++g)
        if (g < ng) red[(warp * kG + g) * kT + lane] = part[g];
    }
    __syncthreads();

    // 2. Scores, tile max and probabilities: warp w owns heads w and w + 4, lane = token.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = warp + r * kWarps;
      if (g < ng) {
        float x = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) x += red[(w * kG + g) * kT + lane];
        x *= a.score_scale;
        if (a.logit_cap > 0.0f) x = a.logit_cap * tanhf(x / a.logit_cap);
        x = t0 + lane < end ? x * kLog2e : ninf;
        const float mn = fmaxf(m_r[r], warp_max(x));
        const float al = exp2f(m_r[r] - mn);
        const float pr = exp2f(x - mn);
        l_r[r] = l_r[r] * al + warp_sum(pr);
        m_r[r] = mn;
        ps[g * kT + lane] = pr;
        if (lane == 0) alpha_s[g] = al;
      }
    }
    __syncthreads();

    // 3. acc = acc * alpha + P · V over this thread's token group.
    if (tg < NTG) {
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < ng) {
          const float al = alpha_s[g];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][i] *= al;
        }
      }
      const int valid = end - t0;
#pragma unroll
      for (int j = 0; j < TPG; ++j) {
        const int t = tg + j * NTG;
        if (t < kT && t < valid) {
          float vf[8];
          Cvt<CT>::eight(vs + t * L.rsv + cc * 8 * CB, vf);
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            if (g < ng) {
              const float pr = ps[g * kT + t];
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(pr, vf[i], acc[g][i]);
            }
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Final: sum the token groups' partial accumulators per head, normalise, write.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int g = warp + r * kWarps;
    if (g < ng && lane == 0) {
      ml_s[2 * g] = m_r[r];
      ml_s[2 * g + 1] = l_r[r];
    }
  }
#pragma unroll
  for (int g = 0; g < kG; ++g) {
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
__global__ void __launch_bounds__(kThreads) decode_paged_merge_kernel(const Args a, int dv) {
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

template <class QT, class CT>
KernelFn pick_dv(int dv) {
  switch (dv) {
    case 64: return decode_paged_kernel<QT, CT, 64>;
    case 128: return decode_paged_kernel<QT, CT, 128>;
    case 192: return decode_paged_kernel<QT, CT, 192>;
    case 256: return decode_paged_kernel<QT, CT, 256>;
    default: return nullptr;
  }
}

KernelFn pick_kernel(DType qt, DType ct, int dv) {
  if (qt == DType::kBF16 && ct == DType::kBF16) return pick_dv<__nv_bfloat16, __nv_bfloat16>(dv);
  if (qt == DType::kFP16 && ct == DType::kFP16) return pick_dv<__half, __half>(dv);
  if (qt == DType::kBF16 && ct == DType::kFP8E4M3) return pick_dv<__nv_bfloat16, __nv_fp8_e4m3>(dv);
  if (qt == DType::kFP16 && ct == DType::kFP8E4M3) return pick_dv<__half, __nv_fp8_e4m3>(dv);
  return nullptr;
}

int smem_bytes(const DecodePagedParams& p) {
  return Smem(static_cast<int>(p.k.size(3)), static_cast<int>(p.v.size(3)), static_cast<int>(dtype_size(p.k.dtype)))
      .total;
}

cudaError_t prepare(KernelFn fn, int smem) {
  // Raise the dynamic shared-memory cap once to the largest plan (Dk = Dv = 256, 2-byte cache).
  (void)smem;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              Smem(256, 256, 2).total);
}

}  // namespace

int decode_paged_choose_splits(const DecodePagedParams& p) {
  KernelFn fn = pick_kernel(p.q.dtype, p.k.dtype, static_cast<int>(p.v.size(3)));
  if (fn == nullptr || p.q.rank != 3 || p.k.rank != 4) return 1;
  const int smem = smem_bytes(p);
  int dev = 0, sms = 0, occ = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      prepare(fn, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, reinterpret_cast<const void*>(fn), kThreads, smem) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  const int64_t G = p.q.size(1) / std::max<int64_t>(1, p.k.size(2));
  const int64_t base = p.q.size(0) * p.k.size(2) * ((G + kG - 1) / kG);
  const int64_t resident = std::max(1, occ) * int64_t{sms};
  const int64_t tiles = (p.max_seq_len + kT - 1) / kT;
  if (base <= 0 || tiles <= 0) return 1;
  // Cost of S splits: waves * (tiles per split + a per-CTA overhead of ~4 tiles), plus a merge.
  const int smax = static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(1, tiles / 4)));
  int best = 1;
  double best_cost = 1e300;
  for (int S = 1; S <= smax; ++S) {
    const double waves = static_cast<double>((base * S + resident - 1) / resident);
    const double cost = waves * (static_cast<double>((tiles + S - 1) / S) + 4.0) + (S > 1 ? 2.0 : 0.0);
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = S;
    }
  }
  return best;
}

cudaError_t launch_decode_paged(const DecodePagedParams& p, cudaStream_t stream) {
  const int dv = static_cast<int>(p.v.size(3));
  KernelFn fn = pick_kernel(p.q.dtype, p.k.dtype, dv);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const int B = static_cast<int>(p.q.size(0)), Hq = static_cast<int>(p.q.size(1));
  const int Hkv = static_cast<int>(p.k.size(2));
  if (B == 0 || Hq == 0) return cudaSuccess;
  int S = p.num_splits;
  if (S == 0) S = decode_paged_choose_splits(p);
  if (S > 1 && (p.workspace == nullptr || p.workspace_bytes < decode_paged_workspace_bytes(B, Hq, dv, S)))
    return cudaErrorInvalidValue;
  const int64_t ce = dtype_size(p.k.dtype), qe = dtype_size(p.q.dtype);
  Args a{};
  a.q = static_cast<const uint8_t*>(p.q_base) + p.q.offset;
  a.q_sb = p.q.stride(0) * qe;
  a.q_sh = p.q.stride(1) * qe;
  a.k = static_cast<const uint8_t*>(p.k_base) + p.k.offset;
  a.k_sp = p.k.stride(0) * ce;
  a.k_st = p.k.stride(1) * ce;
  a.k_sh = p.k.stride(2) * ce;
  a.v = static_cast<const uint8_t*>(p.v_base) + p.v.offset;
  a.v_sp = p.v.stride(0) * ce;
  a.v_st = p.v.stride(1) * ce;
  a.v_sh = p.v.stride(2) * ce;
  a.bt = p.block_table;
  a.bt_stride = p.block_table_stride;
  a.max_blocks = p.max_blocks_per_seq;
  a.lens = p.seq_lens;
  a.o = static_cast<uint8_t*>(p.o_base) + p.o.offset;
  a.o_sb = p.o.stride(0) * qe;
  a.o_sh = p.o.stride(1) * qe;
  a.lse = p.lse;
  const bool fp8 = p.k.dtype == DType::kFP8E4M3;
  a.score_scale = p.sm_scale * (fp8 ? p.k_scale : 1.0f);
  a.logit_cap = p.logit_cap;
  a.v_scale = fp8 ? p.v_scale : 1.0f;
  a.Hq = Hq;
  a.G = Hq / Hkv;
  a.HC = (a.G + kG - 1) / kG;
  a.Dk = static_cast<int>(p.q.size(2));
  a.P = static_cast<int>(p.k.size(1));
  a.S = S;
  a.p_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((1 << sh) == a.P) a.p_shift = sh;
  a.ws_lse = static_cast<float*>(p.workspace);
  a.ws_o = a.ws_lse + int64_t{B} * Hq * S;
  const int smem = smem_bytes(p);
  // Per call: the attribute belongs to the current device's context, and the call is cheap.
  if (const cudaError_t e = prepare(fn, smem); e != cudaSuccess) return e;
  const int64_t blocks_x = int64_t{Hkv} * a.HC * S;
  if (blocks_x > 0x7fffffff) return cudaErrorInvalidValue;
  fn<<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(B)), kThreads, smem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || S == 1) return e;
  if (p.q.dtype == DType::kBF16)
    decode_paged_merge_kernel<__nv_bfloat16><<<dim3(Hq, B), kThreads, 0, stream>>>(a, dv);
  else
    decode_paged_merge_kernel<__half><<<dim3(Hq, B), kThreads, 0, stream>>>(a, dv);
  return cudaGetLastError();
}

}  // namespace kvferry
