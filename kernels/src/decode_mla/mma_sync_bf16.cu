// MLA paged decode on mma.sync for bf16 caches (contract in decode_mla.h; which kernel runs where:
// kernels/DESIGN.md §3.1, this one §3.2).
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
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_mla/common.cuh"
#include "decode_mla/kernels.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::mla_detail {
namespace {

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
__global__ void __launch_bounds__(threads<HB, NW>(), min_ctas<HB, NW>()) mma_sync_bf16_kernel(const KParams p) {
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

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  KVFERRY_MLA_CTA_PROLOGUE(kTileN, HB, NT, SPLIT);

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

template <int HB, int NW, bool SPLIT, bool BULK>
cudaError_t launch_split(const KParams& k, int batch, cudaStream_t stream) {
  constexpr int NT = threads<HB, NW>();
  constexpr int smem = smem_bytes<HB, NW>();
  const cudaError_t attr = allow_dynamic_smem<mma_sync_bf16_kernel<HB, NW, SPLIT, BULK>>(smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid = cta_grid(k, HB, batch);
  mma_sync_bf16_kernel<HB, NW, SPLIT, BULK><<<grid, NT, smem, stream>>>(k);
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

}  // namespace

cudaError_t launch_mma_sync_bf16(const KParams& k, int batch, bool bulk, int nw, cudaStream_t stream) {
  return nw == 4 ? launch_nw<4>(k, batch, bulk, stream) : launch_nw<2>(k, batch, bulk, stream);
}

}  // namespace kvferry::mla_detail
