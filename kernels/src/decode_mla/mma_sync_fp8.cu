// CUDA MLA paged decode for fp8 caches (mla_fp8, mla_fp8_ds) on mma.sync, converting in registers
// (contract in decode_mla.h; kernels/DESIGN.md §3.2).
//
// One CTA per (group of HB <= 64 heads, split, request), four warps per 16 heads, like the bf16
// kernel of mma_sync_bf16.cu, but the 32-token K tiles stay in fp8 in shared memory: the bulk copies
// (the TMA engine) fill kStages stages of raw entries, and each warp converts the bytes it
// multiplies straight from ldmatrix registers with the hardware e4m3x2 -> f16x2 conversion (exact)
// into fp16 mma operands. No converted tile is written or synchronised on, and a tile is half the
// shared-memory traffic of a bf16 one.
//
// Scales leave the inner loops:
//  - Q is fp16 for the nope part: each head's row is scaled by a power of two 2^e (exact) that puts
//    its largest value in [2^14, 2^15), and the rope part stays bf16 (scaled by the same 2^e).
//  - S = Q K^T per warp: warp w of a head group owns nope tile w (128 deep, 8 fp16 k-steps) and rope
//    k-step w (bf16), so its partial is ts * (q_nope . k_nope) + q_rope . k_rope, with ts the
//    token's tile scale (mla_fp8_ds) or 1 (mla_fp8, whose per-tensor scale is in scale_log2). The
//    four partials go through shared memory and warp w adds those of tokens 8 w .. 8 w + 7 (one
//    fixed order), times the row's 2^-e * scale_log2, and exponentiates them: each warp does a
//    quarter of the softmax and shares its P (fp16) with the group.
//  - Softmax against a lazy reference: P = 2^(x - m) with m the row's reference from earlier tiles,
//    kept while no x of the tile exceeds m + 8 (P <= 256 in fp16). The barrier after P is written
//    also ORs that test over the group (bar.red), so a tile that keeps every reference (all but the
//    first and rare jumps) exchanges no maxima and rescales no accumulators; one that does not
//    exchanges the rows' maxima, moves m to them and recomputes P. Each warp sums l over its own
//    tokens; the four parts are added at the end.
//  - P V per warp: output columns [128 w, +128) are exactly nope tile w, so V = ts * e4m3 and the
//    warp multiplies P by ts / R instead (fp16), with R a bound on its tile's scales so far, moved
//    to the tile's maximum when a scale exceeds it 16-fold (folded into the accumulators' rescale
//    like the softmax reference); o = acc * R * vscale / l.
// The rope of mla_fp8 (e4m3) and of mla_fp8_ds (bf16) enter the same bf16 mma with the same
// operand positions, and a unit scale multiplies exactly, so a mla_fp8 cache and the same cache
// requantised to mla_fp8_ds give bit-identical output.
//
// Operand layouts. ldmatrix (b16) over 16 bytes of fp8 gives a lane 4 consecutive bytes 4t..4t+3 of
// its token row: converted, they are the lane's two B registers, so the mma's k index runs over a
// permutation of the 16 depths (logical 2t, 2t+1, 2t+8, 2t+9 = physical 4t .. 4t+3), and the
// lane's A registers are read with the same permutation as one 8-byte load of its Q row. For P V,
// ldmatrix.trans over 8 tokens x 16 bytes gives a lane two tokens of two adjacent fp8 columns; a
// byte permute pairs each column's two tokens, the even columns feed one n8 tile and the odd ones
// another, and the epilogue writes a lane's four accumulators of a row to 4 adjacent columns.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "decode_mla/kernels.h"
#include "decode_mla/common.cuh"
#include "decode_mla/mma_sync_fp8_shape.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::mla_detail {
namespace {

constexpr int kTileN = kFp8TileN;
constexpr int kQOff = kFp8QOff;
constexpr float kLazyExp = 8.0f;  // P <= 2^8 against a row's reference (fp16 holds up to 65504)

template <CacheFormat FMT>
struct Raw;
template <>
struct Raw<kFmtFp8> {
  static constexpr int kBytes = kMlaFp8Bytes;
  static constexpr int kPitch = kFp8RawPitch(false);  // 592: 8 rows start in 8 different 16-byte bank groups
};
template <>
struct Raw<kFmtDs> {
  static constexpr int kBytes = kMlaDsBytes;
  static constexpr int kPitch = kFp8RawPitch(true);  // 656 = 16 mod 128 already
};

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ float lds32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

// The four warps of a head group (warp ch) exchange one value per row through x_row: v0 of row g,
// v1 of row g + 8 (one lane per quad writes); a and c get the group's four values of those rows,
// column ch from warp ch, after barrier kBar + gid.
template <int kBar>
__device__ __forceinline__ void exchange_rows(float* x_row, int g, int ch, int tq, int gid, float v0, float v1,
                                              float4& a, float4& c) {
  if (tq == 0) {
    x_row[g * 4 + ch] = v0;
    x_row[(g + 8) * 4 + ch] = v1;
  }
  named_barrier<kBar, 128>(gid);
  a = *reinterpret_cast<const float4*>(x_row + g * 4);
  c = *reinterpret_cast<const float4*>(x_row + (g + 8) * 4);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// fp16x2 holding e4m3 values -> bf16x2, exact (e4m3 is a subset of both).
__device__ __forceinline__ uint32_t f16x2_bf16x2(uint32_t h) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 v = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
/// Barrier ID0 + group of 128 threads that also returns whether `pred` held for any of them.
template <int ID0>
__device__ __forceinline__ bool bar_red_or(int group, bool pred) {
  uint32_t r;
#define KVFERRY_BAR_RED_OR(ID)                                                          \
  asm volatile(                                                                         \
      "{\n .reg .pred c, o;\n setp.ne.u32 c, %1, 0;\n bar.red.or.pred o, %2, 128, c;\n" \
      " selp.u32 %0, 1, 0, o;\n}\n"                                                     \
      : "=r"(r)                                                                         \
      : "r"(static_cast<uint32_t>(pred)), "n"(ID)                                       \
      : "memory")
  switch (group) {
    case 0: KVFERRY_BAR_RED_OR(ID0); break;
    case 1: KVFERRY_BAR_RED_OR(ID0 + 1); break;
    case 2: KVFERRY_BAR_RED_OR(ID0 + 2); break;
    default: KVFERRY_BAR_RED_OR(ID0 + 3); break;
  }
#undef KVFERRY_BAR_RED_OR
  return r != 0;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <CacheFormat FMT, int HB, bool SPLIT, int ST>
__global__ void __launch_bounds__(HB * 8 + 32, fp8_ctas_per_sm(FMT == kFmtDs, HB, ST))
    mma_sync_fp8_kernel(const KParams p) {
  constexpr int NC = HB * 8;   // consumer threads: four warps per 16 heads
  constexpr int NT = NC + 32;  // and a producer warp
  constexpr int RAW = Raw<FMT>::kBytes, PITCH = Raw<FMT>::kPitch;
  constexpr int kStageBytes = kTileN * PITCH;
  extern __shared__ __align__(128) uint8_t smem[];
  float* s_rowscale = reinterpret_cast<float*>(smem + 64);
  uint8_t* sQ = smem + kQOff;
  uint8_t* sRaw = sQ + HB / 16 * kFp8QGroupBytes;
  uint8_t* sX = sRaw + ST * kStageBytes;
  const uint32_t bar0 = smem_u32(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  KVFERRY_MLA_CTA_PROLOGUE(kTileN, HB, NT, SPLIT);

  // Stage s: full[s] at bar0 + 8 s (the producer's expect_tx and the copies' bytes), empty[s] at
  // bar0 + 32 + 8 s (one arrival per consumer warp once it is done with the tile).
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar0 + 8 * s, 1);
      mbar_init(bar0 + 32 + 8 * s, NC / 32);
    }
    mbar_fence_init();
  }
  __syncthreads();

  // The producer warp (the last) starts the bulk copies of each tile as soon as its stage is free:
  // one per valid token, all completing on the stage's full barrier. Rows past the end are zeroed
  // instead (their bytes may be anything, even NaN, and V is multiplied by p = 0, which would keep
  // a NaN; a zero row also has zero tile scales). Block ids are read a tile ahead of their copies
  // (lane i: the block of token i of the tile).
  const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
  auto fetch_blk = [&](int t) -> int32_t {
    const int tok = start + t * kTileN + lane;
    return t < ntiles && tok < end ? table[p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page] : 0;
  };
  auto load_tile = [&](int t, int32_t lane_blk) {
    const int tok0 = start + t * kTileN;
    const int nvalid = min(kTileN, end - tok0);
    const int stage = t % ST;
    uint8_t* dst0 = sRaw + stage * kStageBytes;
    for (int i = lane; i < (kTileN - nvalid) * (RAW / 16); i += 32)
      *reinterpret_cast<uint4*>(dst0 + (nvalid + i / (RAW / 16)) * PITCH + (i % (RAW / 16)) * 16) =
          make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncwarp();
    const uint32_t bar = bar0 + stage * 8;
    if (lane == 0) mbar_expect_tx(bar, static_cast<uint32_t>(nvalid * RAW));
    __syncwarp();
    if (lane < nvalid) {
      const int tok = tok0 + lane;
      const int in_page = p.page_shift >= 0 ? tok & (p.page - 1) : tok % p.page;
      const uint8_t* src =
          p.cache + static_cast<int64_t>(lane_blk) * p.block_stride + static_cast<int64_t>(in_page) * p.token_stride;
      bulk_g2s(smem_u32(dst0 + lane * PITCH), src, RAW, bar);
    }
  };
  if (warp == NC / 32) {
    int32_t blk = fetch_blk(0);
    for (int t = 0; t < ntiles; ++t) {
      if (t >= ST) mbar_wait(bar0 + 32 + (t % ST) * 8, (t / ST - 1) & 1);
      load_tile(t, blk);
      blk = fetch_blk(t + 1);
    }
    return;
  }

  // Q rows: fp16 nope and bf16 rope, both times 2^e; the row's 2^-e * scale_log2 goes to s_rowscale.
  for (int h = warp; h < HB; h += NC / 32) {
    const uint4* src = reinterpret_cast<const uint4*>(p.q + (static_cast<int64_t>(b) * p.heads + head0 + h) * kMlaDim);
    const uint4 c[2] = {src[lane], src[lane + 32]};
    const uint4 r = lane < 8 ? src[64 + lane] : make_uint4(0, 0, 0, 0);
    float mn = bf16x8_amax(c[1], bf16x8_amax(c[0], 0.0f)), mr = bf16x8_amax(r, 0.0f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      mn = fmaxf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
      mr = fmaxf(mr, __shfl_xor_sync(0xffffffffu, mr, o));
    }
    const int e = q_row_exponent(mn, mr);
    const float up = exp2i(e);
    // Fragment order: k-step ks (16 depths) of the group is 32 lanes x {a0, a1, a2, a3}, where the
    // lane (g, tq) of the mma holds rows g (a0, a2) and g + 8 (a1, a3) at physical depths 4 tq, +1
    // (a0, a1) and 4 tq + 2, +3 (a2, a3): one 16-byte load per lane and k-step.
    uint32_t* grp = reinterpret_cast<uint32_t*>(sQ + (h >> 4) * kFp8QGroupBytes);
    const int hr = h & 15;
    // The 8 values of chunk `c` (depths 8c .. 8c+7) as 4 pairs, to their words.
    auto store_chunk = [&](int c, const uint32_t(&o)[4]) {
      const int ks = c >> 1, tq0 = (c & 1) * 2;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int lf = (hr & 7) * 4 + tq0 + (i >> 1);
        grp[(ks * 32 + lf) * 4 + (i & 1) * 2 + (hr >> 3)] = o[i];
      }
    };
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      uint32_t o[4];
      bf16x8_scaled<true>(c[k], up, o);
      store_chunk(lane + 32 * k, o);
    }
    if (lane < 8) {
      uint32_t o[4];
      bf16x8_scaled<false>(r, up, o);
      store_chunk(64 + lane, o);
    }
    if (lane == 0) s_rowscale[h] = p.scale_log2 * exp2i(-e);
  }

  // Warp ch of head group hgl: S over nope tile ch and rope k-step ch for all 32 tokens; P V for
  // output columns [128 ch, +128).
  const int hgl = warp >> 2, ch = warp & 3;
  const int g = lane >> 2, tq = lane & 3;
  const uint32_t qf = smem_u32(sQ) + hgl * kFp8QGroupBytes + lane * 16;  // + 512 * k-step
  const uint32_t raw0 = smem_u32(sRaw);
  // ldmatrix rows: S: lane l addresses token l (matrix l / 8 = n8 tile of tokens); P V: tokens
  // (l & 7) + 8 ((l >> 3) & 1) at byte column + 16 (l >> 4).
  const uint32_t k_lane = lane * PITCH + 128 * ch;
  const uint32_t v_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * PITCH + 128 * ch + (lane >> 4) * 16;
  // The group's exchange area: the S partials [w][n][lane] (float4), P [i][lane] (fp16 A
  // fragments of tokens 16 i + 0..15, uint4; warp ch writes the half of n = ch) and one float per
  // row and warp [row][ch] (the tile's row maxima, or l at the end).
  uint8_t* const gx = sX + hgl * kFp8GroupXBytes;
  float4* const x_part = reinterpret_cast<float4*>(gx);
  const uint32_t x_p = smem_u32(gx + kFp8XPartBytes);
  uint2* const p_mine = reinterpret_cast<uint2*>(gx + kFp8XPartBytes + ((ch >> 1) * 32 + lane) * 16 + (ch & 1) * 8);
  float* const x_row = reinterpret_cast<float*>(gx + kFp8XPartBytes + kFp8XPBytes);
  const int gid = HB == 16 ? 0 : hgl;

  // acc[j][q][eo]: output columns 128 ch + 32 j + 16 q + {even, odd} x 8.
  float acc[4][2][2][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int eo = 0; eo < 2; ++eo) acc[j][q][eo][0] = acc[j][q][eo][1] = acc[j][q][eo][2] = acc[j][q][eo][3] = 0.0f;
  // The rows' reference m (log2 domain; P = 2^(x - m) <= 2^kLazyExp) and this warp's part of l.
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  float vref = FLT_MIN;                // mla_fp8_ds: R, a bound on the tile-ch scales so far
  float vinv = 1.0f / FLT_MIN;         // and 1 / R
  float row_s0 = 0.0f, row_s1 = 0.0f;  // the rows' 2^-e * scale_log2, read after the first barrier

  // Named barriers: 9 all consumer warps (here: Q rows and row scales written); per head group
  // 1..4 the S partials, 5..8 P written (a reduction: does any P need a new reference), 10..13 the
  // row maxima of a tile that moved a reference.
  asm volatile("bar.sync 9, %0;\n" ::"n"(NC) : "memory");
  row_s0 = s_rowscale[hgl * 16 + g];
  row_s1 = s_rowscale[hgl * 16 + g + 8];

  for (int t = 0; t < ntiles; ++t) {
    const int stage = t % ST;
    mbar_wait(bar0 + stage * 8, (t / ST) & 1);
    const uint32_t tile = raw0 + stage * kStageBytes;

    // This lane's tokens 8 n + 2 tq + {0, 1}: their tile-ch scales (mla_fp8_ds).
    float ts[4][2];
    if constexpr (FMT == kFmtDs) {
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) ts[n][i] = lds32f(tile + (8 * n + 2 * tq + i) * PITCH + kMlaDsScaleOffset + 4 * ch);
    }

    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kMlaTile / 16; ++kk) {
      const uint4 qa = lds128(qf + 512 * (8 * ch + kk));
      uint32_t kr[4];
      ldsm_x4(kr, tile + k_lane + 16 * kk);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        uint32_t b0, b1;
        e4m3x4_f16x4(kr[n], b0, b1);
        mma_f16(s[n], qa.x, qa.y, qa.z, qa.w, b0, b1);
      }
    }
    // mla_fp8_ds: the partial's tile scales, R (moved only when a scale exceeds it 16-fold, so
    // P ts / R <= 16 P), the accumulators' factor for its move and this tile's P factors ts / R.
    float vratio = 1.0f;
    uint32_t fpk[4];
    if constexpr (FMT == kFmtDs) {
      float mt = 0.0f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        s[n][0] *= ts[n][0];
        s[n][1] *= ts[n][1];
        s[n][2] *= ts[n][0];
        s[n][3] *= ts[n][1];
        mt = fmaxf(mt, fmaxf(ts[n][0], ts[n][1]));
      }
      if (__any_sync(0xffffffffu, mt > 16.0f * vref)) {  // warp-uniform; the first tile, then rarely
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));  // ts depends on tq only
        vratio = vref / mt;
        vref = mt;
        vinv = 1.0f / mt;
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) fpk[n] = pack_f16(ts[n][0] * vinv, ts[n][1] * vinv);
    }
    {  // rope k-step ch (bf16)
      const uint4 qa = lds128(qf + 512 * (kMlaRank / 16 + ch));
      if constexpr (FMT == kFmtFp8) {
        uint32_t kr[4];
        ldsm_x4(kr, tile + lane * PITCH + kMlaRank + 16 * ch);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          uint32_t b0, b1;
          e4m3x4_f16x4(kr[n], b0, b1);
          mma_bf16(s[n], qa.x, qa.y, qa.z, qa.w, f16x2_bf16x2(b0), f16x2_bf16x2(b1));
        }
      } else {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const uint2 kb = lds64(tile + (8 * n + g) * PITCH + kMlaDsRopeOffset + 32 * ch + 8 * tq);
          mma_bf16(s[n], qa.x, qa.y, qa.z, qa.w, kb.x, kb.y);
        }
      }
    }

    // The group's S: warp ch adds the four partials of tokens 8 ch .. 8 ch + 7 (rows g, g + 8 of
    // tokens 8 ch + 2 tq + {0, 1}) in one fixed order.
#pragma unroll
    for (int n = 0; n < 4; ++n) x_part[(ch * 4 + n) * 32 + lane] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
    named_barrier<1, 128>(gid);
    float4 r = x_part[ch * 32 + lane];
#pragma unroll
    for (int w = 1; w < 4; ++w) {
      const float4 u = x_part[(w * 4 + ch) * 32 + lane];
      r.x += u.x;
      r.y += u.y;
      r.z += u.z;
      r.w += u.w;
    }
    const int tok0 = start + t * kTileN;
    if (tok0 + kTileN > end) {  // only a split's last tile has tokens past the end
      const int tk = tok0 + ch * 8 + tq * 2;
      if (tk >= end) r.x = r.z = -INFINITY;
      if (tk + 1 >= end) r.y = r.w = -INFINITY;
    }
    // Online softmax (log2 domain) of x = s * row scale against the rows' reference m, kept while
    // no x of the group's tile exceeds m + kLazyExp: then no maxima are exchanged and nothing is
    // rescaled. The P barrier ORs that test over the group; where it holds (the first tile, where
    // m = -inf gives x - m = +inf or NaN, and rare jumps after) m moves to the rows' maxima and P
    // is recomputed.
    float p0 = fmaf(r.x, row_s0, -m0), p1 = fmaf(r.y, row_s0, -m0);
    float p2 = fmaf(r.z, row_s1, -m1), p3 = fmaf(r.w, row_s1, -m1);
    const bool over = fmaxf(fmaxf(p0, p1), fmaxf(p2, p3)) > kLazyExp;
    p0 = fast_exp2(p0);
    p1 = fast_exp2(p1);
    p2 = fast_exp2(p2);
    p3 = fast_exp2(p3);
    *p_mine = make_uint2(pack_f16(p0, p1), pack_f16(p2, p3));
    float al0 = vratio, al1 = vratio;
    if (bar_red_or<5>(gid, over)) {  // the group's verdict: uniform
      float mx0 = fmaxf(r.x, r.y), mx1 = fmaxf(r.z, r.w);
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      float4 a, c;
      exchange_rows<10>(x_row, g, ch, tq, gid, mx0, mx1, a, c);
      // Finite: every tile has a valid token. The maximum of x is the row scale (> 0) times that of s.
      const float nm0 = fmaxf(m0, fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)) * row_s0);
      const float nm1 = fmaxf(m1, fmaxf(fmaxf(c.x, c.y), fmaxf(c.z, c.w)) * row_s1);
      const float e0 = fast_exp2(m0 - nm0), e1 = fast_exp2(m1 - nm1);
      m0 = nm0;
      m1 = nm1;
      p0 = fast_exp2(fmaf(r.x, row_s0, -nm0));
      p1 = fast_exp2(fmaf(r.y, row_s0, -nm0));
      p2 = fast_exp2(fmaf(r.z, row_s1, -nm1));
      p3 = fast_exp2(fmaf(r.w, row_s1, -nm1));
      *p_mine = make_uint2(pack_f16(p0, p1), pack_f16(p2, p3));
      l0 *= e0;
      l1 *= e1;
      al0 *= e0;
      al1 *= e1;
      named_barrier<10, 128>(gid);
    }
    l0 += p0 + p1;  // this warp's tokens; the group's four parts are added at the end
    l1 += p2 + p3;
    uint32_t pa[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 v = lds128(x_p + (i * 32 + lane) * 16);
      pa[i][0] = v.x;
      pa[i][1] = v.y;
      pa[i][2] = v.z;
      pa[i][3] = v.w;
    }
    if constexpr (FMT == kFmtDs) {  // P' = P ts / R (fp16)
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        pa[n >> 1][(n & 1) * 2] = hmul2(pa[n >> 1][(n & 1) * 2], fpk[n]);
        pa[n >> 1][(n & 1) * 2 + 1] = hmul2(pa[n >> 1][(n & 1) * 2 + 1], fpk[n]);
      }
    }
    // Rescale the accumulators only when a reference (or R) moved.
    if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
          for (int eo = 0; eo < 2; ++eo) {
            acc[j][q][eo][0] *= al0;
            acc[j][q][eo][1] *= al0;
            acc[j][q][eo][2] *= al1;
            acc[j][q][eo][3] *= al1;
          }
    }

    // O += P V for this warp's 128 columns (fp16 P, V converted from the ldmatrix.trans registers).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t vr[4];
        ldsm_x4_t(vr, tile + i * 16 * PITCH + v_lane + 32 * j);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          // vr[2q]: tokens 2tq, 2tq+1 (of 16 i + 0..7) x columns 2g, 2g+1 of the 16-byte group; vr[2q+1]: tokens + 8.
          const uint32_t x0 = __byte_perm(vr[2 * q], 0, 0x3120), x1 = __byte_perm(vr[2 * q + 1], 0, 0x3120);
          uint32_t e0, o0, e1, o1;
          e4m3x4_f16x4(x0, e0, o0);
          e4m3x4_f16x4(x1, e1, o1);
          mma_f16(acc[j][q][0], pa[i][0], pa[i][1], pa[i][2], pa[i][3], e0, e1);
          mma_f16(acc[j][q][1], pa[i][0], pa[i][1], pa[i][2], pa[i][3], o0, o1);
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(bar0 + 32 + stage * 8);  // this warp is done with the stage
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  {  // the group's l: its four warps' parts in one order (every warp read the last maxima before
     // its last barrier)
    float4 a, c;
    exchange_rows<1>(x_row, g, ch, tq, gid, l0, l1, a, c);
    l0 = ((a.x + a.y) + a.z) + a.w;
    l1 = ((c.x + c.y) + c.z) + c.w;
  }
  const float vs = FMT == kFmtDs ? vref : p.vscale;
  const float inv0 = vs / l0, inv1 = vs / l1;
  const int h0 = head0 + hgl * 16 + g;
  const float lse0 = row_lse(m0, l0), lse1 = row_lse(m1, l1);
  const int64_t r0 = out_row<SPLIT>(p, b, split, h0);
  const int64_t r1 = r0 + 8;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float(&e)[4] = acc[j][q][0];
      const float(&o)[4] = acc[j][q][1];
      const int col = 128 * ch + 32 * j + 16 * q + 4 * tq;
      if constexpr (SPLIT) {
        *reinterpret_cast<float4*>(p.part_o + r0 * kMlaRank + col) =
            make_float4(e[0] * inv0, o[0] * inv0, e[1] * inv0, o[1] * inv0);
        *reinterpret_cast<float4*>(p.part_o + r1 * kMlaRank + col) =
            make_float4(e[2] * inv1, o[2] * inv1, e[3] * inv1, o[3] * inv1);
      } else {
        *reinterpret_cast<uint2*>(p.o + r0 * kMlaRank + col) =
            make_uint2(pack_bf16(e[0] * inv0, o[0] * inv0), pack_bf16(e[1] * inv0, o[1] * inv0));
        *reinterpret_cast<uint2*>(p.o + r1 * kMlaRank + col) =
            make_uint2(pack_bf16(e[2] * inv1, o[2] * inv1), pack_bf16(e[3] * inv1, o[3] * inv1));
      }
    }
  if (ch == 0 && tq == 0) {
    store_lse<SPLIT>(p, r0, lse0);
    store_lse<SPLIT>(p, r1, lse1);
  }
}

template <CacheFormat FMT, int HB, bool SPLIT, int ST>
cudaError_t launch_st(const KParams& k, int batch, cudaStream_t stream) {
  constexpr int smem = fp8_smem_bytes(FMT == kFmtDs, HB, ST);
  const cudaError_t attr = allow_dynamic_smem<mma_sync_fp8_kernel<FMT, HB, SPLIT, ST>>(smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid = cta_grid(k, HB, batch);
  mma_sync_fp8_kernel<FMT, HB, SPLIT, ST><<<grid, HB * 8 + 32, smem, stream>>>(k);
  return cudaGetLastError();
}

template <CacheFormat FMT, int HB, bool SPLIT>
cudaError_t launch_hb(const KParams& k, int batch, cudaStream_t stream) {
  return launch_st<FMT, HB, SPLIT, fp8_stages(HB)>(k, batch, stream);
}

template <CacheFormat FMT, bool SPLIT>
cudaError_t launch_heads(const KParams& k, int batch, cudaStream_t stream) {
  switch (k.heads) {
    case 16: return launch_hb<FMT, 16, SPLIT>(k, batch, stream);
    case 32: return launch_hb<FMT, 32, SPLIT>(k, batch, stream);
    case 64:
    case 128: return launch_hb<FMT, 64, SPLIT>(k, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_mma_sync_fp8(const KParams& k, CacheFormat fmt, int batch, cudaStream_t stream) {
  const bool split = k.splits > 1;
  if (fmt == kFmtFp8)
    return split ? launch_heads<kFmtFp8, true>(k, batch, stream) : launch_heads<kFmtFp8, false>(k, batch, stream);
  if (fmt == kFmtDs)
    return split ? launch_heads<kFmtDs, true>(k, batch, stream) : launch_heads<kFmtDs, false>(k, batch, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvferry::mla_detail
