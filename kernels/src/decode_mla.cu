// CUDA MLA paged decode (contract in decode_mla.h).
//
// One CTA per (group of HB <= 64 heads, split, request). Every 32-token K tile is brought into
// shared memory once (bulk copies or cp.async, double-buffered; bf16 caches only, the fp8 caches
// have their own kernels) and used by all HB heads: four warps share 16 heads; warp w owns heads [16*(w/4), +16), the
// QK^T depth [144*(w%4), +144) for all 32 tokens (the four partial S tiles are added through shared memory in one fixed
// order) and output columns [128*(w%4), +128) of P.V. At most 128 registers per thread, so a 64-head CTA runs 16 warps
// on an SM. QK^T (576 deep) and P.V (V = the first 512 of the same tile) run on mma.sync m16n8k16 bf16 with fp32
// accumulation and an online softmax in the log2 domain. With more than one split the CTAs write fp32 (o, lse) partials
// and a small kernel merges them; with one split the CTA writes o, lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "decode_mla_internal.h"
#include "decode_mla_ptx.cuh"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry {
namespace {

using mla_detail::bulk_g2s;
using mla_detail::cp_async16;
using mla_detail::cp_async_commit;
using mla_detail::cp_async_wait;
using mla_detail::fence_proxy_async;
using mla_detail::kFmtBf16;
using mla_detail::kFmtDs;
using mla_detail::kFmtFp8;
using mla_detail::KParams;
using mla_detail::ldsm_x4;
using mla_detail::ldsm_x4_t;
using mla_detail::mbar_expect_tx;
using mla_detail::mbar_fence_init;
using mla_detail::mbar_init;
using mla_detail::mbar_wait;
using mla_detail::mma_bf16;
using mla_detail::named_barrier;
using mla_detail::out_row;
using mla_detail::pack_bf16;
using mla_detail::row_lse;
using mla_detail::smem_u32;
using mla_detail::split_tokens;
using mla_detail::store_lse;
using mla_detail::store_o2;
using mla_detail::write_empty_split;

constexpr int kTileN = 32;                      // tokens per K tile
constexpr int kRowPad = kMlaDim + 8;            // bf16 per shared row: 1168 B = 73 x 16 B (no bank conflicts)
constexpr int kRowBytes = kRowPad * 2;          // bytes per shared row
constexpr int kTileBytes = kTileN * kRowBytes;  // one bf16 K tile
// NW = warps per 16-head group (2 or 4): each owns kMlaRank / NW output columns and kMlaDim / NW of
// the QK depth; a group exchanges NW partial S tiles of 16 heads x 32 tokens (NW * 2 KiB).
template <int NW>
constexpr int group_s_bytes() {
  return NW * 4 * 32 * 16;
}

template <int HB, int NW>
constexpr int smem_bytes() {
  return 16 + HB * kRowBytes + 2 * kTileBytes + HB / 16 * group_s_bytes<NW>();
}

// Threads of a CTA of HB heads with NW warps per 16 heads.
template <int HB, int NW>
__host__ __device__ constexpr int threads() {
  return HB / 16 * NW * 32;
}
// CTAs per SM the kernel is compiled for: with four warps per group at most 128 registers per
// thread (a 64-head CTA runs 16 warps); with two, no cap (~240 registers, 128 accumulators).
template <int HB, int NW>
__host__ __device__ constexpr int min_ctas() {
  return NW == 4 ? 65536 / (threads<HB, NW>() * 128) : 1;
}

template <int HB, int NW, bool SPLIT, bool BULK>
__global__ void __launch_bounds__(threads<HB, NW>(), min_ctas<HB, NW>()) decode_mla_kernel(const KParams p) {
  constexpr int NT = threads<HB, NW>();
  constexpr int kWarpCols = kMlaRank / NW;  // output columns per warp (256 or 128)
  constexpr int kWarpDepth = kMlaDim / NW;  // QK depth per warp (288 or 144: 18 or 9 k16 steps)
  constexpr int RAW = kMlaBf16Bytes;
  constexpr int CH = RAW / 16;        // 16-byte chunks per cache entry
  constexpr int kDstRow = kRowBytes;  // row pitch of the tile the loader fills
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* sQ = smem + 16;            // smem[0, 16): the two stages' mbarriers
  uint8_t* sK = sQ + HB * kRowBytes;  // 2 stages
  // S partials: [group][warp][n-tile][lane] float4, each lane's own fragment (conflict-free).
  float4* sS = reinterpret_cast<float4*>(sK + 2 * kTileBytes);
  const uint32_t bar0 = smem_u32(smem);

  const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int2 range = split_tokens<kTileN>(p, b, split);
  const int start = range.x, end = range.y;
  const int head0 = hg * HB;

  if (start >= end) {  // nothing to attend to: an empty split, or a request of length 0
    write_empty_split<SPLIT, NT>(p, b, split, head0, HB, tid);
    return;
  }
  const int ntiles = (end - start + kTileN - 1) / kTileN;

  {  // Q rows of this head group
    const uint8_t* qsrc = reinterpret_cast<const uint8_t*>(p.q + (static_cast<int64_t>(b) * p.heads + head0) * kMlaDim);
    for (int c = tid; c < HB * (kMlaDim * 2 / 16); c += NT) {
      const int r = c / (kMlaDim * 2 / 16), col = c % (kMlaDim * 2 / 16);
      cp_async16(smem_u32(sQ + r * kRowBytes + col * 16), qsrc + r * (kMlaDim * 2) + col * 16, 16);
    }
  }

  const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
  if (BULK) {
    if (tid == 0) {
      mbar_init(bar0, 1);
      mbar_init(bar0 + 8, 1);
      mbar_fence_init();
    }
    __syncthreads();
  }
  // Warp 0 starts the bulk copies of tile t: one per valid token, all completing on the stage's
  // mbarrier. Rows past the end are zeroed instead (their bytes may be anything, even NaN, and V
  // is multiplied by p = 0, which would keep a NaN).
  // Block ids are read one tile ahead of their copies (lane i: the block of token i of the tile), so
  // the table load's latency is not paid in front of every tile's copies.
  auto fetch_blk = [&](int t) -> int32_t {
    const int tok = start + t * kTileN + lane;
    return t < ntiles && tok < end ? table[tok / p.page] : 0;
  };
  auto load_tile_bulk = [&](int t, int stage, int32_t lane_blk) {
    if (warp != 0) return;
    const int tok0 = start + t * kTileN;
    const int nvalid = min(kTileN, end - tok0);
    uint8_t* dst0 = sK + stage * kTileBytes;
    for (int i = lane; i < (kTileN - nvalid) * CH; i += 32)
      *reinterpret_cast<uint4*>(dst0 + (nvalid + i / CH) * kDstRow + (i % CH) * 16) = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncwarp();
    const uint32_t bar = bar0 + stage * 8;
    if (lane == 0) mbar_expect_tx(bar, static_cast<uint32_t>(nvalid * RAW));
    __syncwarp();
    if (lane < nvalid) {
      const int tok = tok0 + lane;
      const int64_t blk = lane_blk;
      const uint8_t* src = p.cache + blk * p.block_stride + static_cast<int64_t>(tok % p.page) * p.token_stride;
      bulk_g2s(smem_u32(dst0 + lane * kDstRow), src, RAW, bar);
    }
  };
  auto load_tile = [&](int t, int stage, int32_t lane_blk) {
    const int tok = start + t * kTileN + lane;
    const uint8_t* rb = nullptr;  // this lane's row (token) base; null past the split's end
    if (tok < end) {
      const int64_t blk = lane_blk;
      rb = p.cache + blk * p.block_stride + static_cast<int64_t>(tok % p.page) * p.token_stride;
    }
    const unsigned long long rbits = reinterpret_cast<unsigned long long>(rb);
    uint8_t* dst0 = sK + stage * kTileBytes;
    constexpr int kItems = kTileN * CH;
#pragma unroll 4
    for (int i = 0; i < (kItems + NT - 1) / NT; ++i) {
      const int c = tid + i * NT;
      const int r = min(c / CH, kTileN - 1), col = c % CH;
      const auto src = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, rbits, r));
      if (c < kItems) {
        const uint32_t d = smem_u32(dst0 + r * kDstRow + col * 16);
        // Rows past the end are zero-filled: their bytes may be anything (even NaN) and V is
        // multiplied by p = 0, which would keep a NaN.
        cp_async16(d, src ? src + col * 16 : p.cache, src ? 16 : 0);
      }
    }
  };

  if (BULK) {
    cp_async_commit();  // Q
    load_tile_bulk(0, 0, fetch_blk(0));
  } else {
    load_tile(0, 0, fetch_blk(0));
    cp_async_commit();
  }
  int32_t next_blk = fetch_blk(1);

  // Warp ch of head group hgl: QK over depth [144 ch, +144) for all 32 tokens of the tile, P V for
  // output columns [128 ch, +128).
  const int hgl = warp / NW, ch = warp % NW;
  const int g = lane >> 2, tq = lane & 3;
  const uint32_t q_addr = smem_u32(sQ) + (hgl * 16 + (lane & 15)) * kRowBytes + (lane >> 4) * 16 + ch * kWarpDepth * 2;
  // ldmatrix x4 of a 16-token x 16-deep K block: (tokens 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
  const uint32_t k_lane =
      ((lane & 7) + ((lane >> 4) & 1) * 8) * kRowBytes + ((lane >> 3) & 1) * 16 + ch * kWarpDepth * 2;
  const uint32_t v_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (ch * kWarpCols + (lane >> 4) * 8) * 2;
  float4* s_mine = sS + (hgl * NW + ch) * 4 * 32 + lane;
  const float4* s_group = sS + hgl * NW * 4 * 32 + lane;

  constexpr int kAccN = kWarpCols / 8;  // n8 tiles of this warp's output columns
  float acc[kAccN][4];
#pragma unroll
  for (int n = 0; n < kAccN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    if (BULK) {
      if (t + 1 < ntiles) load_tile_bulk(t + 1, (t + 1) & 1, next_blk);
      next_blk = fetch_blk(t + 2);
      if (t == 0) cp_async_wait<0>();  // Q
      mbar_wait(bar0 + (t & 1) * 8, (t >> 1) & 1);
    } else if (t + 1 < ntiles) {
      load_tile(t + 1, (t + 1) & 1, next_blk);
      next_blk = fetch_blk(t + 2);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint8_t* tile = sK + (t & 1) * kTileBytes;
    const uint32_t tile_u32 = smem_u32(tile);

    // S = Q K^T for this warp's 16 heads and all 32 tokens over its quarter of the depth; the four
    // partial sums are exchanged through shared memory and added in one fixed order (w = 0..3), so
    // every warp of the group holds the same S.
    float s[4][4];
    {
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
      const uint32_t k_base = tile_u32 + k_lane;
#pragma unroll
      for (int kk = 0; kk < kWarpDepth / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, q_addr + kk * 32);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t bb[4];
          ldsm_x4(bb, k_base + j * 16 * kRowBytes + kk * 32);
          mma_bf16(s[2 * j], a[0], a[1], a[2], a[3], bb[0], bb[1]);
          mma_bf16(s[2 * j + 1], a[0], a[1], a[2], a[3], bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) s_mine[n * 32] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
      named_barrier<1, NW * 32>(hgl);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float4 t = s_group[n * 32];
#pragma unroll
        for (int w = 1; w < NW; ++w) {
          const float4 u = s_group[(w * 4 + n) * 32];
          t.x += u.x;
          t.y += u.y;
          t.z += u.z;
          t.w += u.w;
        }
        s[n][0] = t.x;
        s[n][1] = t.y;
        s[n][2] = t.z;
        s[n][3] = t.w;
      }
    }

    // Online softmax (log2 domain). Rows g (elements 0, 1) and g + 8 (elements 2, 3).
    const int tok0 = start + t * kTileN;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + n * 8 + tq * 2 + (e & 1);
        s[n][e] = tok < end ? s[n][e] * p.scale_log2 : -INFINITY;
      }
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);  // finite: every tile has a valid token
    const float al0 = exp2f(m0 - nm0), al1 = exp2f(m1 - nm1);
    m0 = nm0;
    m1 = nm1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      s[n][0] = exp2f(s[n][0] - nm0);
      s[n][1] = exp2f(s[n][1] - nm0);
      s[n][2] = exp2f(s[n][2] - nm1);
      s[n][3] = exp2f(s[n][3] - nm1);
      rs0 += s[n][0] + s[n][1];
      rs1 += s[n][2] + s[n][3];
    }
    l0 = l0 * al0 + rs0;
    l1 = l1 * al1 + rs1;
#pragma unroll
    for (int n = 0; n < kAccN; ++n) {
      acc[n][0] *= al0;
      acc[n][1] *= al0;
      acc[n][2] *= al1;
      acc[n][3] *= al1;
    }

    // O += P V for this warp's 128 columns.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t a[4] = {pack_bf16(s[2 * i][0], s[2 * i][1]), pack_bf16(s[2 * i][2], s[2 * i][3]),
                             pack_bf16(s[2 * i + 1][0], s[2 * i + 1][1]), pack_bf16(s[2 * i + 1][2], s[2 * i + 1][3])};
#pragma unroll
      for (int np = 0; np < kAccN / 2; ++np) {
        uint32_t bb[4];
        ldsm_x4_t(bb, tile_u32 + i * 16 * kRowBytes + v_lane + np * 32);
        mma_bf16(acc[2 * np], a[0], a[1], a[2], a[3], bb[0], bb[1]);
        mma_bf16(acc[2 * np + 1], a[0], a[1], a[2], a[3], bb[2], bb[3]);
      }
    }
    __syncthreads();  // the next iteration's load overwrites this stage (and the S partials)
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = p.vscale / l0, inv1 = p.vscale / l1;
  const int h0 = head0 + hgl * 16 + g;
  const float lse0 = row_lse(m0, l0), lse1 = row_lse(m1, l1);
  const int64_t r0 = out_row<SPLIT>(p, b, split, h0), r1 = r0 + 8;
  const int col0 = ch * kWarpCols + tq * 2;
#pragma unroll
  for (int n = 0; n < kAccN; ++n) {
    store_o2<SPLIT>(p, r0, col0 + n * 8, acc[n][0] * inv0, acc[n][1] * inv0);
    store_o2<SPLIT>(p, r1, col0 + n * 8, acc[n][2] * inv1, acc[n][3] * inv1);
  }
  if (ch == 0 && tq == 0) {
    store_lse<SPLIT>(p, r0, lse0);
    store_lse<SPLIT>(p, r1, lse1);
  }
}

// Merges the splits of one (request, head): o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - M).
// Every load is issued before it is needed: each warp reads the (up to 64) split lse values at
// once, one or two per lane, and reduces them with shuffles; the o partials of the non-empty
// splits (a prefix: a split is empty only when it starts past the request's end) are read without
// a data-dependent branch, so the unrolled loop keeps several loads in flight. (The previous
// loop read one lse, then one partial, per split in turn: about 8 us of latency at 6 splits.)
__global__ void __launch_bounds__(128) decode_mla_merge(const KParams p) {
  static_assert(kDecodeMlaMaxSplits <= 64, "two split lse values per lane");
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int lane = threadIdx.x & 31;
  const float* lse_s = p.part_lse + b * p.splits * p.heads + h;
  const float l0 = lane < p.splits ? lse_s[static_cast<int64_t>(lane) * p.heads] : -INFINITY;
  const float l1 = lane + 32 < p.splits ? lse_s[static_cast<int64_t>(lane + 32) * p.heads] : -INFINITY;
  float mx = fmaxf(l0, l1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  uint16_t* o = p.o + bh * kMlaRank + threadIdx.x * 4;
  if (mx == -INFINITY) {  // length 0
    *reinterpret_cast<uint2*>(o) = make_uint2(0, 0);
    if (threadIdx.x == 0) p.lse[bh] = -INFINITY;
    return;
  }
  const float w0 = l0 == -INFINITY ? 0.0f : expf(l0 - mx), w1 = l1 == -INFINITY ? 0.0f : expf(l1 - mx);
  float w_sum = w0 + w1;
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o2);
  const unsigned live0 = __ballot_sync(0xffffffffu, l0 != -INFINITY),
                 live1 = __ballot_sync(0xffffffffu, l1 != -INFINITY);
  const int ns = live1 != 0 ? 64 - __clz(live1) : 32 - __clz(live0);  // non-empty splits: a prefix
  __shared__ float ws[64];
  if (threadIdx.x < 32) {
    ws[lane] = w0;
    ws[lane + 32] = w1;
  }
  __syncthreads();
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* part = p.part_o + (b * p.splits * p.heads + h) * kMlaRank + threadIdx.x * 4;
#pragma unroll 8
  for (int s = 0; s < ns; ++s) {
    const float w = ws[s];
    const float4 v = *reinterpret_cast<const float4*>(part + static_cast<int64_t>(s) * p.heads * kMlaRank);
    a.x += w * v.x;
    a.y += w * v.y;
    a.z += w * v.z;
    a.w += w * v.w;
  }
  const float inv = 1.0f / w_sum;
  *reinterpret_cast<uint2*>(o) = make_uint2(pack_bf16(a.x * inv, a.y * inv), pack_bf16(a.z * inv, a.w * inv));
  if (threadIdx.x == 0) p.lse[bh] = mx + logf(w_sum);
}

template <int HB, int NW, bool SPLIT, bool BULK>
cudaError_t launch_split(const KParams& k, int batch, cudaStream_t stream) {
  constexpr int NT = threads<HB, NW>();
  constexpr int smem = smem_bytes<HB, NW>();
  const cudaError_t attr = mla_detail::allow_dynamic_smem<decode_mla_kernel<HB, NW, SPLIT, BULK>>(smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(k.heads / HB, k.splits, batch);
  decode_mla_kernel<HB, NW, SPLIT, BULK><<<grid, NT, smem, stream>>>(k);
  return cudaGetLastError();
}

template <int NW, bool SPLIT, bool BULK>
cudaError_t launch_hb(const KParams& k, int batch, cudaStream_t stream) {
  switch (k.heads) {
    case 16: return launch_split<16, NW, SPLIT, BULK>(k, batch, stream);
    case 32: return launch_split<32, NW, SPLIT, BULK>(k, batch, stream);
    case 64:
    case 128: return launch_split<64, NW, SPLIT, BULK>(k, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <int NW>
cudaError_t launch_nw(const KParams& k, int batch, bool bulk, cudaStream_t stream) {
  if (bulk)
    return k.splits > 1 ? launch_hb<NW, true, true>(k, batch, stream) : launch_hb<NW, false, true>(k, batch, stream);
  return k.splits > 1 ? launch_hb<NW, true, false>(k, batch, stream) : launch_hb<NW, false, false>(k, batch, stream);
}

cudaError_t launch_bf16(const KParams& k, int batch, bool bulk, int nw, cudaStream_t stream) {
  return nw == 4 ? launch_nw<4>(k, batch, bulk, stream) : launch_nw<2>(k, batch, bulk, stream);
}

// The wgmma kernel exists only in sm_90a code (KVFERRY_MLA_WGMMA, set by kernels/decode_mla.cmake
// when CMAKE_CUDA_ARCHITECTURES lists 90a) and runs only on a device of compute capability 9.0.
bool wgmma_available() {
#if defined(KVFERRY_MLA_WGMMA)
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
           minor == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool decode_mla_wgmma_available() { return wgmma_available(); }

int32_t decode_mla_splits(const DecodeMlaParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  static const int sm_count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 1;
    return n;
  }();
  return decode_mla_auto_splits(p, sm_count);
}

cudaError_t launch_decode_mla(const DecodeMlaParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return cudaSuccess;
  if (p.heads != 16 && p.heads != 32 && p.heads != 64 && p.heads != 128) return cudaErrorInvalidValue;
  const int32_t splits = decode_mla_splits(p);
  if (splits < 1 || splits > kDecodeMlaMaxSplits) return cudaErrorInvalidValue;
  const size_t need = decode_mla_workspace_bytes(p.batch, p.heads, splits);
  if (need > 0 && (p.workspace == nullptr || p.workspace_bytes < need)) return cudaErrorInvalidValue;
  KParams k{};
  const int64_t eb = p.cache.elem_bytes();
  k.cache = static_cast<const uint8_t*>(p.cache_base) + p.cache.offset;
  k.block_stride = p.cache.stride(0) * eb;
  k.token_stride = p.cache.stride(1) * eb;
  k.page = static_cast<int32_t>(p.cache.size(1));
  k.num_blocks = p.cache.size(0);
  k.page_shift = (k.page & (k.page - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(k.page)) : -1;
  k.q = p.q;
  k.table = p.block_table;
  k.table_stride = p.block_table_stride;
  k.seq_lens = p.seq_lens;
  k.heads = p.heads;
  k.splits = splits;
  const bool fp8 = p.format.kind == FormatKind::kMlaFp8;
  k.vscale = fp8 ? p.k_scale : 1.0f;
  k.scale_log2 = p.sm_scale * k.vscale * 1.4426950408889634f;
  k.o = p.o;
  k.lse = p.lse;
  if (splits > 1) {
    k.part_o = static_cast<float*>(p.workspace);
    k.part_lse = k.part_o + static_cast<int64_t>(p.batch) * splits * p.heads * kMlaRank;
  }
  if (p.loader < 0 || p.loader > 2) return cudaErrorInvalidValue;
  const bool bulk = decode_mla_resolved_loader(p) == 1;
  if (p.group_warps != 0 && p.group_warps != 2 && p.group_warps != 4) return cudaErrorInvalidValue;
  const int nw = decode_mla_resolved_group_warps(p);
  if (p.mma < 0 || p.mma > 2) return cudaErrorInvalidValue;
  const int fmt = p.format.kind == FormatKind::kMlaBf16    ? kFmtBf16
                  : p.format.kind == FormatKind::kMlaFp8   ? kFmtFp8
                  : p.format.kind == FormatKind::kMlaFp8Ds ? kFmtDs
                                                           : -1;
  if (fmt < 0) return cudaErrorInvalidValue;
  cudaError_t err;
  const int mma = p.mma == 0 && !wgmma_available() ? 1 : decode_mla_resolved_mma(p);
  if (mma == 2) {
    if (!wgmma_available()) return cudaErrorInvalidDeviceFunction;
    // The seesaw kernel, where it can run (fp8 caches need tensor copies); wgmma_kernel = 2
    // selects the depth-split one.
    if (p.wgmma_kernel < 0 || p.wgmma_kernel > 2 || p.seesaw_loader < 0 || p.seesaw_loader > 2)
      return cudaErrorInvalidValue;
    k.conv_rows = p.conv_rows;  // launch_wgmma checks its range
    err = cudaErrorNotSupported;
    if (fmt == kFmtFp8 && p.fp8_math == 1 && p.heads >= 64) err = mla_detail::launch_f8(k, p.batch, stream);
    if (err == cudaErrorNotSupported && p.wgmma_kernel != 2)
      err = mla_detail::launch_seesaw(k, fmt, p.batch, p.seesaw_loader != 2, stream);
    if (err == cudaErrorNotSupported) err = mla_detail::launch_wgmma(k, fmt, p.batch, stream);
  } else {
    err = fmt == kFmtBf16 ? launch_bf16(k, p.batch, bulk, nw, stream)
                          : mla_detail::launch_fp8_regs(k, fmt, p.batch, stream);
  }
  if (err != cudaSuccess || splits == 1) return err;
  decode_mla_merge<<<static_cast<unsigned>(p.batch) * p.heads, 128, 0, stream>>>(k);
  return cudaGetLastError();
}

}  // namespace kvferry
