// Hopper MLA decode split kernel (contract in decode_mla.h): warpgroup MMA with a "seesaw"
// schedule over 64-token tiles, for bf16 caches and (tiles converted to fp16 in shared memory by
// the producer warps; see the producer) fp8 caches (kernels/DESIGN.md §3.3).
//
// fp8 caches compute in fp16 (F16), where e4m3 converts in one instruction per pair (bf16 took
// four): the nope blocks of the tiles are fp16 (exact for mla_fp8; mla_fp8_ds: each value times
// its fp16-rounded tile scale, rounded to fp16), Q's nope part is fp16 times a power of two per row
// (exact, undone on S), P is fp16, and the rope block stays bf16 (mla_fp8's e4m3 rope converted
// exactly, mla_fp8_ds's copied) with Q's rope part bf16, so its k steps are bf16 wgmmas into the
// same S accumulators.
//
// One CTA per (64 heads, split, request); fewer heads are padded to 64 rows (zero Q rows, never
// written out). Q (64 x 576, 16-bit) and two K tiles (64 tokens x 576) live in shared memory as nine
// column blocks of [64 rows x 128 B] with the 128-byte swizzle, so a tile is the K-major B operand
// of S = Q K^T and its first eight column blocks the N-major B operand of O = P V.
//
// Two math warpgroups share one running row maximum and split O by columns: warpgroup 0 owns
// O_L = O[:, 0:256], warpgroup 1 O_R = O[:, 256:512] (128 fp32 accumulators per thread). Tiles
// go in pairs (a = 2j, b = 2j + 1): warpgroup 0 computes S(a) over the whole depth, warpgroup 1
// S(b); nothing is exchanged but row maxima and P:
//   WG0: S(a); m0 = max(m, rowmax S(a)); P(a) = exp(S(a) - m0); O_L = O_L e^(m - m0) + P(a) V_L(a)
//   WG1: S(b); m1 = max(m0, rowmax S(b)); P(b) = exp(S(b) - m1) (stored over the rope block of
//        b's tile, which only S read); O_R = O_R e^(m - m1) + P(b) V_R(b)
//   WG0: P(a) e^(m0 - m1) into shared memory; O_L = O_L e^(m0 - m1) + P(b) V_L(b)
//   WG1: O_R += P(a) e^(m0 - m1) V_R(a)
// (max here is lazy_max: a row keeps its reference maximum unless a tile exceeds it by 8, log2)
// so one warpgroup's softmax runs while the other's products keep the tensor cores busy, and a
// tile's depth is read once per 64 tokens (the S exchange of a depth-split schedule is gone). A
// 64-token tile halves the Q bytes the tensor cores read per token against 32-token tiles.
//
// A producer warpgroup (56 registers via setmaxnreg; the math warpgroups get 224) copies each tile
// (tensor copies, or cp.async) straight into the swizzled layout, one column block at a time,
// publishing each on its own mbarrier, so S starts on the first block that landed (bf16 at 128
// heads: the two head groups' CTAs form a cluster and each copies half of every tile's blocks into
// both, see CL; with pages of 64+ rows one copy brings two adjacent column blocks, kCopyPairs).
// fp8 blocks land raw in the upper half of their slots and two producer warps per
// buffer convert each in place before publishing it; their copies are issued by the math warp that
// releases a part last. A tile's blocks are released in two parts: V_L and the rope block (also
// P(b)'s place) by warpgroup 0 once its products read them, V_R by warpgroup 1. S visits the blocks
// in the order they are freed (even tiles: V_L, rope, V_R; odd tiles: V_R, V_L, rope) and they are
// refilled in that order.
#include <cuda.h>  // CUtensorMap (types only: the encoder is reached through the runtime)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "decode_mla/kernels.h"
#include "decode_mla/common.cuh"
#include "decode_mla/seesaw.cuh"
#include "decode_mla/wgmma.cuh"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry::mla_detail {
namespace {

constexpr int kN = 64;                      // tokens per K tile
constexpr int kM = 64;                      // head rows per CTA (the wgmma M)
constexpr int kCb = kMlaDim / 64;           // column blocks of 64 bf16 = one 128-byte row (9)
constexpr int kCbBytes = 64 * 128;          // one column block of Q or of a tile (64 rows)
constexpr int kTileBytes = kCb * kCbBytes;  // 73728, Q alike
constexpr int kPBytes = kM * kN * 2;        // P (64 x 64 16-bit, one swizzled column block)
constexpr int kThreads = 3 * 128;
constexpr int kRope = 8;  // column block of the rope part
// How the producer fills the tiles (the kernel's `copy` argument): cp.async, tensor copies of one
// column block each, or (bf16, pages of 64+ rows) tensor copies of two adjacent column blocks
// (cb, cb + 1 for even cb < kRope, completing on cb's full barrier; the rope block alone) by a 4D
// map. Each tensor copy costs the copying thread a few hundred cycles whatever its size, so half
// as many copies shorten every refill (H200, bf16 at 128 heads: 144.0-146.7 -> 136.0-138.4 us).
constexpr int kCopyAsync = 0, kCopyBlocks = 1, kCopyPairs = 2;

// Shared memory after 1024-byte alignment: Q, two tiles, P(a), row maxima of the two warpgroups,
// row sums, 40 mbarriers.
constexpr int kOffK = kTileBytes;
constexpr int kOffP = 3 * kTileBytes;
constexpr int kOffM = kOffP + kPBytes;     // float [2][64]
constexpr int kOffL = kOffM + 2 * kM * 4;  // float [2][64]
constexpr int kOffBar = kOffL + 2 * kM * 4;
constexpr int kBars = 4 * kCb + 4;     // full[buf][cb], empty[buf][part], raw[buf][cb] (fp8 caches)
constexpr int kRawOff = kCbBytes / 2;  // fp8 caches: a block's raw bytes land in the upper half of its slot
// fp8 caches: release counts [buf][part] and block ids [buf][tile parity][box] of the tile the
// buffer refills next.
constexpr int kOffCnt = kOffBar + kBars * 8;
constexpr int kOffIds = kOffCnt + 16;
constexpr int kOffQs = kOffIds + 2 * 2 * (kN / 16) * 4;  // fp8 caches: float [64], see sQs
constexpr int kSmem = 1024 + kOffQs + kM * 4;
static_assert(kSmem <= 227 * 1024, "one CTA per SM");

// Column block visited i-th by S of a tile of parity `odd` (and refilled i-th by the producer).
__host__ __device__ constexpr int visit(int odd, int i) {
  return odd ? (i < 4 ? 4 + i : i - 4 + (i == 8 ? 4 : 0)) : (i < 4 ? i : i == 4 ? kRope : i - 1);
}
static_assert(visit(0, 4) == kRope && visit(0, 5) == 4 && visit(0, 8) == 7, "even order: V_L, rope, V_R");
static_assert(visit(1, 0) == 4 && visit(1, 4) == 0 && visit(1, 7) == 3 && visit(1, 8) == kRope,
              "odd order: V_R, V_L, rope");
// Part of column block cb: 0 (V_L and rope, released by warpgroup 0) or 1 (V_R, by warpgroup 1).
__host__ __device__ constexpr int part_of(int cb) { return cb >= 4 && cb < 8 ? 1 : 0; }

// The wgmma instructions come in two operand types: bf16 (bf16 caches; the rope block of fp8
// caches) and fp16 (F16: the nope blocks and P V of fp8 caches, see the kernel). One accumulator
// chain may mix them.
#define KF_MMA(SHAPE, T) "wgmma.mma_async.sync.aligned." SHAPE ".f32." T "." T " "
#define KF_S_D                                      \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13," \
  "%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

// d (64 x 64 fp32) += A (64 x 16, K-major smem) * B (64 x 16, K-major smem)^T.
template <bool F16>
__device__ __forceinline__ void wgmma_s(float (&d)[32], uint64_t da, uint64_t db) {
  if constexpr (F16)
    asm volatile(KF_MMA("m64n64k16", "f16") KF_S_D ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : KVF_WG_F32(d, 0)
                 : "l"(da), "l"(db));
  else
    asm volatile(KF_MMA("m64n64k16", "bf16") KF_S_D ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : KVF_WG_F32(d, 0)
                 : "l"(da), "l"(db));
}

// d = A B^T, the first k step of an S: d is written, not read, so S's registers are free between
// the softmax that last read them and the next S.
#define KF_W8(x, i)                                                                                               \
  "=f"(x[i + 0]), "=f"(x[i + 1]), "=f"(x[i + 2]), "=f"(x[i + 3]), "=f"(x[i + 4]), "=f"(x[i + 5]), "=f"(x[i + 6]), \
      "=f"(x[i + 7])
template <bool F16>
__device__ __forceinline__ void wgmma_s_first(float (&d)[32], uint64_t da, uint64_t db) {
  if constexpr (F16)
    asm volatile(KF_MMA("m64n64k16", "f16") KF_S_D ", %32, %33, 0, 1, 1, 0, 0;\n"
                 : KF_W8(d, 0), KF_W8(d, 8), KF_W8(d, 16), KF_W8(d, 24)
                 : "l"(da), "l"(db));
  else
    asm volatile(KF_MMA("m64n64k16", "bf16") KF_S_D ", %32, %33, 0, 1, 1, 0, 0;\n"
                 : KF_W8(d, 0), KF_W8(d, 8), KF_W8(d, 16), KF_W8(d, 24)
                 : "l"(da), "l"(db));
}
#undef KF_W8
#undef KF_S_D

#define KF_PV_D                                                                  \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                      \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"             \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"             \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"             \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"             \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"             \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define KF_PV_ACC KVF_WG_F32(d, 0), KVF_WG_F32(d, 32), KVF_WG_F32(d, 64), KVF_WG_F32(d, 96)

// d (64 x 256 fp32) += A (64 x 16, registers) * B (16 x 256, N-major smem).
template <bool F16>
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (F16)
    asm volatile(KF_MMA("m64n256k16", "f16") KF_PV_D ", {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
                 : KF_PV_ACC
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  else
    asm volatile(KF_MMA("m64n256k16", "bf16") KF_PV_D ", {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
                 : KF_PV_ACC
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// d (64 x 256 fp32) += A (64 x 16, K-major smem) * B (16 x 256, N-major smem).
template <bool F16>
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], uint64_t da, uint64_t db) {
  if constexpr (F16)
    asm volatile(KF_MMA("m64n256k16", "f16") KF_PV_D ", %128, %129, 1, 1, 1, 0, 1;\n" : KF_PV_ACC : "l"(da), "l"(db));
  else
    asm volatile(KF_MMA("m64n256k16", "bf16") KF_PV_D ", %128, %129, 1, 1, 1, 0, 1;\n" : KF_PV_ACC : "l"(da), "l"(db));
}
#undef KF_PV_ACC
#undef KF_PV_D
#undef KF_MMA

// Column blocks c2 and c2 + 1 of rows c1.. of cache block c3 by the 4D pair map (dims: 64 values,
// rows, column blocks, cache blocks), landing at `dst` in this CTA or (`mc`) in both CTAs of the
// cluster.
__device__ __forceinline__ void tma_load_pair(uint32_t dst, const CUtensorMap* map, int c1, int c2, int c3,
                                              uint32_t bar, bool mc, uint64_t policy) {
  if (mc)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster.L2::cache_hint "
        "[%0], [%1, {%2, %3, %4, %5}], [%6], %7, %8;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(uint16_t{3}), "l"(policy)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
        "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
        : "memory");
}
// The same copy landing at `dst` (and completing on `bar`) in every CTA of the cluster in `mask`.
__device__ __forceinline__ void tma_load_mc(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar,
                                            uint16_t mask, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4}], [%5], %6, %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask), "l"(policy)
      : "memory");
}
// The same on the mbarrier at shared offset `bar` of CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster_lane0(uint32_t bar, uint32_t rank, int lane) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, %1, 0;\n @p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n" ::"r"(remote),
      "r"(lane));
}
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts128(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

template <bool F16>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
  return F16 ? pack_f16(lo, hi) : pack_bf16(lo, hi);
}

// Tensor-copy boxes of bp rows (min(page, 64)) in the tile starting at token tok0: boxes wholly
// past `end` are not copied.
__device__ __forceinline__ int tile_nbox(int tok0, int end, int bp) { return (min(kN, end - tok0) + bp - 1) / bp; }
// The boxes of that tile: box k at block blk[k], row in_page[k].
__device__ __forceinline__ int tile_boxes(const KParams& p, const int32_t* table, int tok0, int end, int bp,
                                          int (&blk)[kN / 16], int (&in_page)[kN / 16]) {
  const int nbox = tile_nbox(tok0, end, bp);
#pragma unroll
  for (int k = 0; k < kN / 16; ++k) {
    const int tok = tok0 + k * bp;
    blk[k] = k < nbox ? table[tok >> p.page_shift] : 0;
    in_page[k] = tok & (p.page - 1);
  }
  return nbox;
}

// fp8 caches: a converting warp's half of a column block of a tile, converted in place (cw 0: rows
// 0-31, cw 1: rows 32-63). The block's raw bytes (64 rows x 64 e4m3, rows 64 B apart) are in the
// upper half of its 8 KiB slot; its 16-bit rows go to the whole slot, swizzled. Lane (rr, c) takes
// 16-byte chunk c of rows 32 cw + rr + 8 k (raw_chunk): a quarter warp reads 128 contiguous raw
// bytes and writes its 32-byte halves to distinct banks (convert_row_chunk). Rows 32-63 overwrite
// raw rows (and mla_fp8_ds's scale copy lies under rows 0-31 of the part's last block), so both
// warps of the pair load their raw rows (and the caller their scales) before the pair's barrier
// `bar_id`, and store after it. mla_fp8_ds: sc[k] is the scale of row 32 cw + rr + 8 k.
__device__ __forceinline__ uint32_t raw_chunk(uint32_t slot, int cw, int rr, int c, int k) {
  return slot + kRawOff + (32 * cw + rr + 8 * k) * 64 + 16 * c;
}
__device__ __forceinline__ void convert_row_chunk(uint32_t slot, int r, int c, const uint32_t (&w)[8]) {
  const uint32_t row = slot + r * 128;
  sts128(row + (((2 * c) ^ (r & 7)) << 4), w[0], w[1], w[2], w[3]);
  sts128(row + (((2 * c + 1) ^ (r & 7)) << 4), w[4], w[5], w[6], w[7]);
}
// mla_fp8's rope block, to bf16 (it meets Q's bf16 rope part in bf16 wgmmas).
__device__ __forceinline__ void convert_rope_half(uint32_t slot, int lane, int cw, int bar_id) {
  const int rr = lane >> 2, c = lane & 3;
  uint4 raw[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) raw[k] = lds128(raw_chunk(slot, cw, rr, c, k));
  asm volatile("bar.sync %0, 64;\n" ::"r"(bar_id) : "memory");  // the pair has read its raw rows
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t w[8];
    convert16_words<false>(raw[k], 1.0f, w);
    convert_row_chunk(slot, 32 * cw + rr + 8 * k, c, w);
  }
  fence_proxy_async();  // the tensor cores read these rows
}
// The two nope column blocks of one 128-wide tile (scales sc alike), to fp16, in slots a and b,
// pipelined: b's raw rows are loaded while a's are converted (a's stores leave b's slot alone),
// and a second pair barrier orders both warps' loads of b before its stores. One proxy fence after
// both blocks' stores, then the caller publishes both: a fence per block held S(a)'s first block
// less long but cost the converters more (H200, 128 heads, three alternating runs: mla_fp8
// 186.2-187.7 -> 184.6-185.0 us, mla_fp8_ds 202.3-202.7 -> 197.8-199.1).
template <CacheFormat FMT>
__device__ __forceinline__ void convert_two(uint32_t a, uint32_t b, const float (&sc)[4], int lane, int cw,
                                            int bar_id) {
  const int rr = lane >> 2, c = lane & 3;
  uint4 raw[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) raw[k] = lds128(raw_chunk(a, cw, rr, c, k));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(bar_id) : "memory");  // the pair has read these raw rows
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t w[8];
      if constexpr (FMT == kFmtDs)
        convert16_f16<true>(raw[k], ds_scale_f16x2(sc[k]), w);
      else
        convert16_f16<false>(raw[k], 0u, w);
      if (h == 0) raw[k] = lds128(raw_chunk(b, cw, rr, c, k));
      convert_row_chunk(h ? b : a, 32 * cw + rr + 8 * k, c, w);
    }
  }
  fence_proxy_async();  // the tensor cores read these rows: one fence for both blocks
}
// The epilogue through shared memory (the tile buffers, free once both warpgroups' last products
// completed): each math thread writes its rows r0 and r1 of its output half, times inv0 / inv1
// (bf16 o, or fp32 partials with SPLIT), to `stage` (rows padded by 16 bytes, so a warp's eight
// rows fall in distinct banks); after a barrier of the 256 math threads every output row (hb of them,
// consecutive in memory) is written by 16-byte vector stores, consecutive threads taking consecutive
// chunks. Stored from the accumulators directly, each warp-wide store wrote 16 bytes to each of
// eight rows 1 KiB apart: the epilogue took 5-7 us of a 128-head call (H200, clock64 stamps).
// Warpgroup 0's tq 0 threads write the lse.
template <bool SPLIT>
__device__ __forceinline__ void store_out_staged(const KParams& p, int b, int split, int head0, int hb, int wg, int r0,
                                                 int tq, const float (&acc)[128], float m0, float m1, float l0,
                                                 float l1, uint32_t stage, int tid) {
  constexpr int kEb = SPLIT ? 4 : 2;         // output bytes per value
  constexpr int kRowBytes = kMlaRank * kEb;  // one output row
  constexpr int kPitch = kRowBytes + 16;     // its staged pitch
  static_assert(kM * kPitch <= 2 * kTileBytes, "the staged output fits the tile buffers");
  const int r1 = r0 + 8;
  const float inv0 = p.vscale / l0, inv1 = p.vscale / l1;
  const int col0 = wg * 256 + tq * 2;
  const uint32_t a0 = stage + r0 * kPitch + col0 * kEb, a1 = a0 + 8 * kPitch;
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    if constexpr (SPLIT) {
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a0 + n * 8 * kEb), "f"(acc[4 * n] * inv0),
                   "f"(acc[4 * n + 1] * inv0)
                   : "memory");
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a1 + n * 8 * kEb), "f"(acc[4 * n + 2] * inv1),
                   "f"(acc[4 * n + 3] * inv1)
                   : "memory");
    } else {
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0 + n * 8 * kEb),
                   "r"(pack_bf16(acc[4 * n] * inv0, acc[4 * n + 1] * inv0))
                   : "memory");
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1 + n * 8 * kEb),
                   "r"(pack_bf16(acc[4 * n + 2] * inv1, acc[4 * n + 3] * inv1))
                   : "memory");
    }
  }
  const int64_t base = out_row<SPLIT>(p, b, split, head0);
  if (wg == 0 && tq == 0) {
    if (r0 < hb) store_lse<SPLIT>(p, base + r0, row_lse(m0, l0));
    if (r1 < hb) store_lse<SPLIT>(p, base + r1, row_lse(m1, l1));
  }
  bar_sync(1);
  constexpr int kChunks = kRowBytes / 16;
  uint8_t* const dst = SPLIT ? reinterpret_cast<uint8_t*>(p.part_o + base * kMlaRank)
                             : reinterpret_cast<uint8_t*>(p.o + base * kMlaRank);
  for (int i = tid; i < hb * kChunks; i += 256) {
    const int row = i / kChunks, c = i % kChunks;
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * kRowBytes + c * 16) =
        lds128(stage + row * kPitch + c * 16);
  }
}

// TMA: tiles come by tensor copies (pages a power of two >= 16); otherwise by cp.async (bf16 only).
// fp8 caches: `tmap` maps the raw entries as bytes ([blocks][page][entry bytes], 64-byte boxes, no
// swizzle); mla_fp8_ds's bf16 rope comes through `rope` ([blocks][page][64] bf16, swizzled).
// CL (bf16 by tensor copies, 128 heads): the two head groups of a request run as a cluster of two
// CTAs that share the tiles: CTA r copies the column blocks cb with cb % 2 == r into both CTAs'
// shared memory (multicast), each CTA expects all of a tile's bytes on its own barriers, and a
// part is refilled once both CTAs released it (each releasing warp arrives on both CTAs' empty
// barriers).
template <CacheFormat FMT, bool SPLIT, bool CL>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_seesaw_kernel(const KParams p, const __grid_constant__ CUtensorMap tmap,
                        const __grid_constant__ CUtensorMap map2, const int copy) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_dyn[];
  uint8_t* smem = KVFERRY_MLA_SMEM_ALIGN_1024(smem_dyn);
  const uint32_t q_u32 = smem_u32(smem), k_u32 = q_u32 + kOffK, p_u32 = q_u32 + kOffP;
  float* sM = reinterpret_cast<float*>(smem + kOffM);  // [warpgroup][row]: m0 (WG0), m1 (WG1)
  float* sL = reinterpret_cast<float*>(smem + kOffL);  // [warpgroup][row]: final row sums
  const uint32_t bars = q_u32 + kOffBar;
  auto full_bar = [&](int buf, int cb) { return bars + 8 * (buf * kCb + cb); };
  auto empty_bar = [&](int buf, int part) { return bars + 8 * (2 * kCb + buf * 2 + part); };
  auto raw_bar = [&](int buf, int cb) { return bars + 8 * (2 * kCb + 4 + buf * kCb + cb); };
  uint32_t* const rel_cnt = reinterpret_cast<uint32_t*>(smem + kOffCnt);  // fp8: [buf][part]
  int32_t* const next_ids = reinterpret_cast<int32_t*>(smem + kOffIds);   // fp8: [buf][parity][box]
  float* const sQs = reinterpret_cast<float*>(smem + kOffQs);             // fp8: [row] scale_log2 * 2^-e
  constexpr bool F16 = FMT != kFmtBf16;  // fp16 tensor-core math for the nope part and P V
  // map2: mla_fp8_ds's bf16 rope; bf16 with kCopyPairs, the column-block pair map.
  const CUtensorMap& rope = map2;

  const int hb = min(p.heads, kM);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup index broadcast from lane 0, so the compiler knows it is warp-uniform.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wl = warp & 3, g = lane >> 2, tq = lane & 3;
  KVFERRY_MLA_CTA_PROLOGUE(kN, hb, kThreads, SPLIT);
  const int bp = min(p.page, kN);  // rows per tensor-copy box
  // fp8 caches: issues the tensor copies of part `part` of tile t into buffer t & 1 (ids: the
  // tile's block ids in shared memory, read as they are used: the math warps issue this between
  // their products). Its raw column blocks land in the upper halves of their slots on their raw
  // barriers; mla_fp8_ds's part also brings bytes [512, 576) of every row (the four tile scales
  // first) to the lower half of the part's last converted block (3 or 7), with its first block, and
  // its bf16 rope straight to the rope block.
  auto issue_part = [&](int t, int part, const int32_t* ids) {
    const int buf = t & 1, tok0 = start + t * kN, nfirst = buf ? 4 : 5;
    const int nbox = tile_nbox(tok0, end, bp);
    const uint32_t tile = k_u32 + buf * kTileBytes;
    const bool first_part = part == (buf ? 1 : 0);  // the part S visits first
#pragma unroll 1
    for (int i = first_part ? 0 : nfirst; i < (first_part ? nfirst : kCb); ++i) {
      const int cb = visit(buf, i);
      const bool rope_bf16 = FMT == kFmtDs && cb == kRope;
      const bool scales = FMT == kFmtDs && !rope_bf16 && (i == 0 || i == nfirst);  // the part's first block
      const uint32_t bar = rope_bf16 ? full_bar(buf, kRope) : raw_bar(buf, cb);
      mbar_expect_tx(bar, static_cast<uint32_t>(nbox * bp * (rope_bf16 ? 128 : scales ? 128 : 64)));
      const uint32_t sc_slot = tile + (part_of(cb) ? 7 : 3) * kCbBytes;
#pragma unroll 1
      for (int k = 0; k < nbox; ++k) {
        const int blk = ids[k], in_page = (tok0 + k * bp) & (p.page - 1);
        const uint64_t policy = evict_first_policy();
        if (rope_bf16) {
          tma_load(tile + kRope * kCbBytes + k * bp * 128, &rope, 0, in_page, blk, bar, policy);
        } else {
          tma_load(tile + cb * kCbBytes + kRawOff + k * bp * 64, &tmap, cb * 64, in_page, blk, bar, policy);
          if (scales) tma_load(sc_slot + k * bp * 64, &tmap, kMlaRank, in_page, blk, bar, policy);
        }
      }
    }
  };

  if (tid == 0) {
    // full: the TMA thread's expect_tx, each thread of a cp.async producer pair, or (fp8) each lane
    // of the buffer's two converting warps; mla_fp8_ds's rope block comes by a tensor copy unconverted.
    for (int i = 0; i < 2 * kCb; ++i)
      mbar_init(bars + 8 * i, FMT == kFmtBf16 ? (copy ? 1 : 64) : FMT == kFmtDs && i % kCb == kRope ? 1 : 64);
    for (int i = 0; i < 2 * kCb; ++i) mbar_init(raw_bar(i / kCb, i % kCb), 1);
    for (int i = 0; i < 4; ++i)  // lane 0 of the releasing warpgroup's warps (in both CTAs of a cluster)
      mbar_init(empty_bar(i >> 1, i & 1), CL ? 8 : 4);
    for (int i = 0; i < 4; ++i) rel_cnt[i] = 0;
    mbar_fence_init();
  }
  if constexpr (CL)
    cluster_sync_all();  // both CTAs' barriers are set up before either copies or arrives remotely
  else
    __syncthreads();

  if (wg == 2) {
    // Producer: warps 8-9 fill the even tiles' buffer, warps 10-11 the odd tiles'. Thread pt of a
    // pair copies chunk pt % 8 of rows pt / 8 + 8 k (k < 8) of every column block, so a warp's
    // copies cover whole 128-byte row segments. Each thread's copies of a block arrive on the
    // block's full barrier when they land (cp.async.mbarrier.arrive.noinc): the producer never
    // waits for its own copies, it blocks only on a part's release, and every free byte of its
    // buffer is in flight.
    if constexpr (FMT != kFmtBf16) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
      // fp8 caches (tensor copies only): warps 8 + buf (rows 0-31 of each block) and 10 + buf
      // (rows 32-63) convert buffer buf's tiles. A released part's raw column blocks all land at
      // once, each in the upper half of its own slot on its own raw barrier; the pair turns each
      // into fp16 (bf16: mla_fp8's rope) in place, in the order S visits them, two blocks of a
      // 128-wide tile at a time (convert_two), and publishes each on the block's full barrier. The copies of a part are
      // issued by the math warp that releases it last (the producer warps never wait for a release, so a part is copied
      // as soon as it is free while they convert); lane 0 of warp 8 + buf issues the buffer's first tile and looks up
      // the block ids of the tile after the one it converts (next_ids). (The producers tried and rejected, a converting
      // warp per buffer among them: kernels/DESIGN.md §3.3.)
      const int buf = warp & 1, cw = (warp >> 1) & 1, bar_id = 8 + buf;
      const uint32_t tile = k_u32 + buf * kTileBytes;
      const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
      auto ids_of = [&](int t) { return next_ids + (buf * 2 + ((t >> 1) & 1)) * (kN / 16); };
      // Lane k < 4: the block id of box k of tile t (0 past the end).
      auto box_id = [&](int t) {
        const int tok = start + t * kN + lane * bp;
        return lane < kN / 16 && tok < end ? table[tok >> p.page_shift] : 0;
      };
      if (cw == 0 && buf < ntiles) {  // the buffer's first tile
        if (lane < kN / 16) ids_of(buf)[lane] = box_id(buf);
        __syncwarp();
        if (lane == 0) {
          issue_part(buf, 0, ids_of(buf));
          issue_part(buf, 1, ids_of(buf));
        }
      }
      for (int t = buf; t < ntiles; t += 2) {
        const uint32_t par = (t >> 1) & 1;
        // Lane k < 4 of warp 8 + buf looks up box k of tile t + 2, stored after the first block.
        const int nxt = cw == 0 && t + 2 < ntiles ? box_id(t + 2) : 0;
        // The blocks in S's order, two of one 128-wide tile (cb, cb + 1) at a time, then the rope.
#pragma unroll 1
        for (int i = 0; i < kCb; i += visit(buf, i) == kRope ? 1 : 2) {
          const int cb = visit(buf, i);
          if (FMT == kFmtDs && cb == kRope) continue;
          mbar_wait(raw_bar(buf, cb), par);
          if (cb != kRope) mbar_wait(raw_bar(buf, cb + 1), par);
          if (i == 0 && cw == 0 && lane < kN / 16 && t + 2 < ntiles)
            // Read by the math warps after they have waited for this tile's blocks (the arrives
            // below release it); a parity slot per tile, as a part of tile t may still be issued
            // from the other slot's ids after this point.
            ids_of(t + 2)[lane] = nxt;
          float sc[4] = {};
          if constexpr (FMT == kFmtDs) {
            const uint32_t sc_slot = tile + (part_of(cb) ? 7 : 3) * kCbBytes;
#pragma unroll
            for (int k = 0; k < 4; ++k)
              asm volatile("ld.shared.f32 %0, [%1];\n"
                           : "=f"(sc[k])
                           : "r"(sc_slot + (32 * cw + (lane >> 2) + 8 * k) * 64 + 4 * (cb >> 1)));
          }
          if (cb == kRope) {  // mla_fp8's rope, to bf16
            convert_rope_half(tile + cb * kCbBytes, lane, cw, bar_id);
            mbar_arrive(full_bar(buf, cb));
          } else {
            convert_two<FMT>(tile + cb * kCbBytes, tile + (cb + 1) * kCbBytes, sc, lane, cw, bar_id);
            mbar_arrive(full_bar(buf, cb));
            mbar_arrive(full_bar(buf, cb + 1));
          }
        }
      }
      return;
    }
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int odd = (warp - 8) >> 1, pt = tid & 63, c = pt & 7, r0 = pt >> 3;
    const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
    if (copy) {
      // One thread per buffer: a box of min(page, 64) rows per column block and page of the tile;
      // boxes wholly past the end are not copied (the math warps zero those rows).
      if ((pt & 31) != 0 || (pt >> 5) != 0) return;
      // The maps into the descriptor cache before the first copy (H200, bf16 at 128 heads: the
      // block map -2 us, then the pair map another -3.6 us; issued by thread 0 at the kernel's
      // start the block map's gained nothing).
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap)) : "memory");
      if (copy == kCopyPairs)
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map2)) : "memory");
      const int bp = min(p.page, kN);
      const uint64_t policy = evict_first_policy();
      const uint32_t rank = CL ? cluster_rank() : 0;
      for (int t = odd; t < ntiles; t += 2) {
        int blk[kN / 16], in_page[kN / 16];
        const int nbox = tile_boxes(p, table, start + t * kN, end, bp, blk, in_page);
        const uint32_t dst = k_u32 + odd * kTileBytes;
#pragma unroll 1
        for (int i = 0; i < kCb; ++i) {
          const int cb = visit(odd, i);
          if (t >= 2 && (i == 0 || i == (odd ? 4 : 5)))  // first block of a part: wait for its release
            mbar_wait(empty_bar(odd, part_of(cb)), ((t >> 1) - 1) & 1);
          const uint32_t bar = full_bar(odd, cb);
          if (copy == kCopyPairs) {                 // one box (bp == kN) per copy
            if (cb != kRope && (cb & 1)) continue;  // came with cb - 1
            mbar_expect_tx(bar, static_cast<uint32_t>(nbox * bp * 128 * (cb == kRope ? 1 : 2)));
            // Pairs 0-1 and 4-5 from CTA 0, 2-3 and 6-7 from CTA 1, the rope block from CTA `odd`:
            // five copies each per pair of tiles.
            if (CL && static_cast<uint32_t>(cb == kRope ? odd : (cb >> 1) & 1) != rank) continue;
            if (cb != kRope) {
              tma_load_pair(dst + cb * kCbBytes, &map2, in_page[0], cb, blk[0], bar, CL, policy);
              continue;
            }
          } else {
            mbar_expect_tx(bar, static_cast<uint32_t>(nbox * bp * 128));
            if (CL && static_cast<uint32_t>(cb & 1) != rank) continue;  // the other CTA copies it to both
          }
#pragma unroll
          for (int k = 0; k < kN / 16; ++k) {
            if (k >= nbox) continue;
            if constexpr (CL)
              tma_load_mc(dst + cb * kCbBytes + k * bp * 128, &tmap, cb * 64, in_page[k], blk[k], bar, 3, policy);
            else
              tma_load(dst + cb * kCbBytes + k * bp * 128, &tmap, cb * 64, in_page[k], blk[k], bar, policy);
          }
        }
      }
      if constexpr (CL) {
        // Stay until both CTAs released this buffer's last tile: the other CTA's warps arrive on
        // this CTA's barriers, and must not find it gone.
        const int last = odd + ((ntiles - 1 - odd) / 2) * 2;
        if (last < ntiles)
          for (int part = 0; part < 2; ++part) mbar_wait(empty_bar(odd, part), (last >> 1) & 1);
      }
      return;
    }
    // Byte offsets of this thread's rows of tile t from the cache base, -1 past the end.
    auto row_offsets = [&](int t, int64_t(&off)[8]) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int tok = start + t * kN + r0 + 8 * k;
        off[k] = -1;
        if (t < ntiles && tok < end) {
          const int32_t blk = table[p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page];
          const int in_page = p.page_shift >= 0 ? tok & (p.page - 1) : tok % p.page;
          off[k] = static_cast<int64_t>(blk) * p.block_stride + static_cast<int64_t>(in_page) * p.token_stride + c * 16;
        }
      }
    };
    const uint32_t dst = k_u32 + odd * kTileBytes + r0 * 128 + ((c ^ (r0 & 7)) << 4);
    int64_t off[8];
    row_offsets(odd, off);
    for (int t = odd; t < ntiles; t += 2) {
#pragma unroll 1
      for (int i = 0; i < kCb; ++i) {
        const int cb = visit(odd, i);
        if (t >= 2 && (i == 0 || i == (odd ? 4 : 5)))  // first block of a part: wait for its release
          mbar_wait(empty_bar(odd, part_of(cb)), ((t >> 1) - 1) & 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          // Rows past the end are zero-filled: V is multiplied by p = 0, which would keep a NaN.
          cp_async16(dst + cb * kCbBytes + k * 8 * 128, off[k] >= 0 ? p.cache + off[k] + cb * 128 : p.cache,
                     off[k] >= 0 ? 16 : 0);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full_bar(odd, cb)) : "memory");
      }
      row_offsets(t + 2, off);
    }
    return;
  }

  // Math warpgroups.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  {  // Q rows of this head group, swizzled; rows past the heads are zero
    const uint8_t* qsrc = reinterpret_cast<const uint8_t*>(p.q + (static_cast<int64_t>(b) * p.heads + head0) * kMlaDim);
    for (int c = tid; c < kM * (kMlaDim * 2 / 16); c += 256) {
      const int r = c / (kMlaDim * 2 / 16), col = c % (kMlaDim * 2 / 16);
      cp_async16(q_u32 + (col >> 3) * kCbBytes + r * 128 + (((col & 7) ^ (r & 7)) << 4),
                 r < hb ? qsrc + r * (kMlaDim * 2) + col * 16 : qsrc, r < hb ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    if constexpr (F16) {
      // fp8 caches: the nope part to fp16 and the rope part kept bf16, both times 2^e (exact; e from
      // the row's magnitudes, q_row_exponent), in place; scale_log2 * 2^-e goes to sQs. Threads
      // 4r .. 4r + 3 take row r, thread 4r + j its 16-byte chunks j + 4k (k < 16: nope, 16 and 17:
      // rope).
      bar_sync(1);
      constexpr int kChunks = kMlaDim * 2 / 16 / 4;  // 18
      const int r = tid >> 2, j = tid & 3;
      auto chunk = [&](int k) {
        const int col = j + 4 * k;
        return q_u32 + (col >> 3) * kCbBytes + r * 128 + (((col & 7) ^ (r & 7)) << 4);
      };
      float mn = 0.0f, mr = 0.0f;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (k < 16)
          mn = bf16x8_amax(lds128(chunk(k)), mn);
        else
          mr = bf16x8_amax(lds128(chunk(k)), mr);
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        mn = fmaxf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mr = fmaxf(mr, __shfl_xor_sync(0xffffffffu, mr, o));
      }
      const int e = q_row_exponent(mn, mr);
      const float up = exp2i(e);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        uint32_t w[4];
        if (k < 16)
          bf16x8_scaled<true>(lds128(chunk(k)), up, w);
        else
          bf16x8_scaled<false>(lds128(chunk(k)), up, w);
        sts128(chunk(k), w[0], w[1], w[2], w[3]);
      }
      if (j == 0) sQs[r] = p.scale_log2 * exp2i(-e);
    }
    fence_proxy_async();
    bar_sync(1);
  }

  float s[32];
  const uint32_t q_lo = desc_lo(q_u32, 16), k_lo = desc_lo(k_u32, 16);
  // Issues S(t) = Q K(t)^T over the whole depth, block by block as the producer publishes them.
  // Issues the blocks of S(t) = Q K(t)^T of one part of the tile (PART 0: the blocks visited
  // first; 1: the rest) as one wgmma group, each block as soon as the producer published it.
  auto issue_s = [&](auto odd_c, auto part_c, int t) {
    constexpr int ODD = decltype(odd_c)::value, PART = decltype(part_c)::value;
    constexpr int kSplit = ODD ? 4 : 5;  // blocks of the first part
    const int buf = t & 1;
    const uint32_t par = (t >> 1) & 1;
    const uint32_t tile_lo = k_lo + buf * (kTileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int i = PART ? kSplit : 0; i < (PART ? kCb : kSplit); ++i) {
      const int cb = visit(ODD, i);
      // kCopyPairs: an odd block landed with the block before it, on that block's barrier.
      if (FMT != kFmtBf16 || copy != kCopyPairs || cb == kRope || !(cb & 1)) mbar_wait(full_bar(buf, cb), par);
      // The cp.async producer's writes (generic proxy) need a proxy fence before the wgmma reads
      // them. Tensor copies land through the async proxy, and the fp8 converters fence their own
      // stores before they arrive, so their blocks need none (128 heads, on an H100: bf16 178.7 ->
      // 176.4 us without the fence there; the fp8 formats moved within their run-to-run spread).
      if (FMT == kFmtBf16 && !copy) fence_proxy_async();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t off = (cb * kCbBytes + kk * 32) >> 4;
        if (i == 0 && kk == 0)  // never the rope block
          wgmma_s_first<F16>(s, desc(q_lo + off), desc(tile_lo + off));
        else if (F16 && cb != kRope)
          wgmma_s<true>(s, desc(q_lo + off), desc(tile_lo + off));
        else
          wgmma_s<false>(s, desc(q_lo + off), desc(tile_lo + off));
      }
    }
    wgmma_commit();
  };
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // rows g and g + 8 of this warp's 16
  const int r0 = wl * 16 + g, r1 = r0 + 8;
  uint32_t pa[4][4];  // P as wgmma A fragments (k steps of 16 tokens)
  auto fence_pa = [&]() {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[i][e])::"memory");
  };
  auto rescale = [&](float f0, float f1) {  // skipped by a warp whose rows kept their maxima
    if (__any_sync(0xffffffffu, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        acc[4 * n] *= f0;
        acc[4 * n + 1] *= f0;
        acc[4 * n + 2] *= f1;
        acc[4 * n + 3] *= f1;
      }
    }
  };
  // S(t) (completed) -> x = S scaled to the log2 domain, masked past the end; row maxima.
  auto load_s = [&](int t, float(&x)[32], float& mx0, float& mx1) {
    // To the log2 domain: fp8 caches also undo their Q rows' 2^e (sQs, read here to spare registers).
    tile_logits(s, x, F16 ? sQs[r0] : p.scale_log2, F16 ? sQs[r1] : p.scale_log2, t == ntiles - 1, start + t * kN, end,
                tq, mx0, mx1);
  };
  // x <- exp2(x - max) in place; returns the row sums of this thread's values.
  auto exponentiate = [&](float(&x)[32], float nm0, float nm1, float& rs0, float& rs1) {
    tile_exp2(x, nm0, nm1, rs0, rs1);
  };
  auto pack_pa = [&](const float(&x)[32]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pa[i][0] = pack16<F16>(x[8 * i], x[8 * i + 1]);
      pa[i][1] = pack16<F16>(x[8 * i + 2], x[8 * i + 3]);
      pa[i][2] = pack16<F16>(x[8 * i + 4], x[8 * i + 5]);
      pa[i][3] = pack16<F16>(x[8 * i + 6], x[8 * i + 7]);
    }
  };
  // P (times f0 / f1 per row) as bf16 (fp16: F16) into a swizzled [64 rows x 64 tokens] K-major
  // block at `dst`.
  auto store_p = [&](const float(&x)[32], float f0, float f1, uint32_t dst) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const uint32_t a0 = dst + r0 * 128 + (((n ^ g) << 4) | (tq << 2));
      const uint32_t a1 = a0 + 8 * 128;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"(pack16<F16>(x[4 * n] * f0, x[4 * n + 1] * f0))
                   : "memory");
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(pack16<F16>(x[4 * n + 2] * f1, x[4 * n + 3] * f1))
                   : "memory");
    }
    fence_proxy_async();
  };
  // O half += P V_half(t): P from registers (pa) or from a shared block (p_lo, K-major).
  const uint32_t v_lo = desc_lo(k_u32 + wg * 4 * kCbBytes, kCbBytes);
  auto issue_pv_rs = [&](int t) {
    const uint32_t vt = v_lo + (t & 1) * (kTileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_pv_rs<F16>(acc, pa[ks], desc(vt + ((ks * 16 * 128) >> 4)));
    wgmma_commit();
  };
  auto issue_pv_ss = [&](int t, uint32_t p_addr) {
    const uint32_t vt = v_lo + (t & 1) * (kTileBytes >> 4), pl = desc_lo(p_addr, 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_pv_ss<F16>(acc, desc(pl + ((ks * 32) >> 4)), desc(vt + ((ks * 16 * 128) >> 4)));
    wgmma_commit();
  };
  // The last tile's V rows past the end hold whatever the page held there (or nothing copied):
  // P is 0 there, but 0 * NaN is not, so each warpgroup zeroes its V half of those rows before
  // its product of that tile reads them (S has read the tile by then).
  const int nlast = end - (start + (ntiles - 1) * kN);
  auto zero_tail = [&](int t) {
    if (t != ntiles - 1 || nlast == kN) return;
    const uint32_t base = k_u32 + (t & 1) * kTileBytes + wg * 4 * kCbBytes;
    for (int i = tid & 127; i < (kN - nlast) * 4 * 8; i += 128) {
      const uint32_t a = base + (i >> 3 & 3) * kCbBytes + (nlast + (i >> 5)) * 128 + (i & 7) * 16;
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
    }
    fence_proxy_async();
    asm volatile("bar.sync %0, 128;\n" ::"r"(6 + wg) : "memory");  // this warpgroup only
  };
  auto release = [&](int t, int part) {
    if constexpr (FMT == kFmtBf16) {
      // Lane 0's arrives, predicated rather than behind a branch and a warp sync (H200, 128
      // heads: 145.1-145.8 -> 144.2-145.2 us in two calls of alternating runs). The product wait
      // before each call (volatile asm, as the arrives are) orders the reads they release.
      mbar_arrive_lane0(empty_bar(t & 1, part), lane);
      if constexpr (CL) mbar_arrive_cluster_lane0(empty_bar(t & 1, part), cluster_rank() ^ 1, lane);
    } else {
      __syncwarp();
      if (lane != 0) return;
      // The last of the warpgroup's four warps to release the part issues its refill.
      uint32_t old;
      asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
                   : "=r"(old)
                   : "r"(smem_u32(rel_cnt + (t & 1) * 2 + part))
                   : "memory");
      if ((old & 3) == 3 && t + 2 < ntiles)
        issue_part(t + 2, part, next_ids + ((t & 1) * 2 + (((t + 2) >> 1) & 1)) * (kN / 16));
    }
  };

  // Each warpgroup waits for a product as soon as the buffer part it read can be refilled and
  // releases that part. Warpgroup 1 queues P.V_R(a) behind P.V_R(b) and releases both parts before
  // it issues S(b + 2), whose waits for landed blocks would otherwise hold back the release of
  // V_R(a), the part S(a + 2) waits for last (H200, 128 heads: bf16 154.3 -> 152.4 us, mla_fp8
  // 199.9 -> 197.1). (Warpgroup 0 queueing S(a + 2) behind P.V_L(b) made ptxas spill 530-1040
  // bytes: bf16 199 us.)
  // mla_fp8_ds orders the products of a pair P.V_R(b), P.V_L(a), ... (warpgroup 1 issues P.V_R(b)
  // before it signals P(b); warpgroup 0 issues P.V_L(a) only after that signal), so the part S(b + 2)
  // visits first is freed first (H200, 128 heads: 214.3-214.7 -> 209.3-210.6 us). bf16 and mla_fp8 lose
  // with it (bf16 151.5 -> 166 us: V_L(a), which S(a + 2) visits first, is then freed late).
  constexpr bool kDsOrder = FMT == kFmtDs;
  const int npairs = (ntiles + 1) / 2;
  if (wg == 0) {
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1;
      const bool has_b = bt < ntiles;
      float x[32];
      issue_s(I0{}, I0{}, a);
      issue_s(I0{}, I1{}, a);
      wgmma_wait<0>();  // S(a)
      float mx0, mx1;
      load_s(a, x, mx0, mx1);
      const float n0 = lazy_max(m0, mx0), n1 = lazy_max(m1, mx1);  // finite: every tile has a valid token
      const float f0 = fast_exp2(m0 - n0), f1 = fast_exp2(m1 - n1);
      m0 = n0;
      m1 = n1;
      if (tq == 0) {
        sM[r0] = n0;
        sM[r1] = n1;
      }
      bar_arrive(2);  // m0 ready for warpgroup 1
      float rs0, rs1;
      exponentiate(x, n0, n1, rs0, rs1);
      l0 = l0 * f0 + rs0;
      l1 = l1 * f1 + rs1;
      fence_regs(acc);
      rescale(f0, f1);
      pack_pa(x);
      zero_tail(a);
      auto finish_pv_la = [&]() {
        wgmma_wait<0>();  // P.V_L(a) read V_L(a), the rope block and pa
        fence_regs(acc);
        fence_pa();
        release(a, 0);
      };
      // mla_fp8_ds: P.V_L(a) goes behind warpgroup 1's P.V_R(b) (kDsOrder, see there).
      if constexpr (!kDsOrder) {
        issue_pv_rs(a);
        finish_pv_la();
      }
      float g0 = 1.0f, g1 = 1.0f;  // e^(m0 - m1)
      if (has_b) {
        bar_sync(3);  // m1 and P(b) ready
        const float q0 = sM[kM + r0], q1 = sM[kM + r1];
        g0 = fast_exp2(m0 - q0);
        g1 = fast_exp2(m1 - q1);
        m0 = q0;
        m1 = q1;
      }
      if constexpr (kDsOrder) issue_pv_rs(a);
      if (j > 0) bar_sync(5);  // warpgroup 1's P.V_R of the previous pair read P
      store_p(x, g0, g1, p_u32);
      bar_arrive(4);  // P(a) ready for warpgroup 1
      if constexpr (kDsOrder) finish_pv_la();
      if (has_b) {
        l0 *= g0;
        l1 *= g1;
        rescale(g0, g1);
        zero_tail(bt);
        issue_pv_ss(bt, k_u32 + (bt & 1) * kTileBytes + kRope * kCbBytes);
        wgmma_wait<0>();  // P.V_L(b)
        fence_regs(acc);
        release(bt, 0);
      }
    }
  } else {
    if (ntiles > 1) {
      issue_s(I1{}, I0{}, 1);
      issue_s(I1{}, I1{}, 1);
    }
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1;
      const bool has_b = bt < ntiles, next_b = bt + 2 < ntiles;
      float x[32];
      float mx0 = -INFINITY, mx1 = -INFINITY;
      if (has_b) {
        wgmma_wait<0>();  // S(b)
        load_s(bt, x, mx0, mx1);
      }
      bar_sync(2);  // m0 of this pair
      const float q0 = sM[r0], q1 = sM[r1];
      const float n0 = lazy_max(q0, mx0), n1 = lazy_max(q1, mx1);
      const float f0 = fast_exp2(m0 - n0), f1 = fast_exp2(m1 - n1);
      m0 = n0;
      m1 = n1;
      l0 *= f0;
      l1 *= f1;
      fence_regs(acc);
      rescale(f0, f1);
      if (has_b) {
        if (tq == 0) {
          sM[kM + r0] = n0;
          sM[kM + r1] = n1;
        }
        float rs0, rs1;
        exponentiate(x, n0, n1, rs0, rs1);
        l0 += rs0;
        l1 += rs1;
        auto start_pv_rb = [&]() {
          pack_pa(x);
          zero_tail(bt);
          issue_pv_rs(bt);
        };
        if constexpr (kDsOrder) start_pv_rb();
        store_p(x, 1.0f, 1.0f, k_u32 + (bt & 1) * kTileBytes + kRope * kCbBytes);  // over the rope block S read
        bar_arrive(3);                                                             // m1 and P(b) ready for warpgroup 0
        if constexpr (!kDsOrder) start_pv_rb();
      }
      bar_sync(4);  // P(a) scaled to m1
      zero_tail(a);
      issue_pv_ss(a, p_u32);
      // P.V_R(b) and P.V_R(a) in flight: each part released as soon as its product is done, and
      // only then S(b + 2), which blocks on its blocks' landing.
      if (has_b) {
        wgmma_wait<1>();  // P.V_R(b)
        fence_pa();
        release(bt, 1);
      }
      wgmma_wait<0>();  // P.V_R(a)
      fence_regs(acc);
      release(a, 1);
      if (j + 1 < npairs) bar_arrive(5);  // P read
      if (next_b) {
        issue_s(I1{}, I0{}, bt + 2);
        issue_s(I1{}, I1{}, bt + 2);
      }
    }
  }

  // Row sums: this thread's partials, the quad's, then the two warpgroups' (same order in both).
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (tq == 0) {
    sL[wg * kM + r0] = l0;
    sL[wg * kM + r1] = l1;
  }
  bar_sync(1);
  l0 = sL[r0] + sL[kM + r0];
  l1 = sL[r1] + sL[kM + r1];
  store_out_staged<SPLIT>(p, b, split, head0, hb, wg, r0, tq, acc, m0, m1, l0, l1, k_u32, tid);
#else
  __trap();  // built without sm_90a: launch_wgmma_seesaw is never chosen for such a build (see launch.cu)
#endif
}

// bf16, pages of 64+ rows: the 4D map of column-block pairs (dims: 64 values, rows, column blocks
// 128 bytes apart, cache blocks; box: the tile's 64 rows of two column blocks, which land as two
// consecutive swizzled blocks).
bool make_pair_map(const KParams& k, CUtensorMap* map) {
  if (k.page < kN || k.num_blocks < 1) return false;
  const EncodeTiled enc = encode_tiled();
  if (enc == nullptr) return false;
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(k.page), kCb, static_cast<cuuint64_t>(k.num_blocks)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(k.token_stride), 128, static_cast<cuuint64_t>(k.block_stride)};
  const cuuint32_t box[4] = {64, kN, 2, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<uint8_t*>(k.cache), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The kernel's tensor maps and how it copies (kCopy*): bf16, the whole 576 values swizzled (and
// the pair map when it applies); fp8 caches, the raw entries as bytes and (mla_fp8_ds) the bf16
// rope swizzled. kCopyAsync when no tensor map can be made.
template <CacheFormat FMT>
int make_maps(const KParams& k, CUtensorMap* map, CUtensorMap* map2) {
  if constexpr (FMT == kFmtBf16) {
    if (!make_map(k, map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, k.cache, kMlaDim, CU_TENSOR_MAP_SWIZZLE_128B))
      return kCopyAsync;
    return make_pair_map(k, map2) ? kCopyPairs : kCopyBlocks;
  }
  const uint64_t bytes = FMT == kFmtFp8 ? kMlaFp8Bytes : kMlaDsBytes;
  if (!make_map(k, map, CU_TENSOR_MAP_DATA_TYPE_UINT8, k.cache, bytes, CU_TENSOR_MAP_SWIZZLE_NONE)) return kCopyAsync;
  return FMT != kFmtDs || make_map(k, map2, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, k.cache + kMlaDsRopeOffset, kMlaRope,
                                   CU_TENSOR_MAP_SWIZZLE_128B)
             ? kCopyBlocks
             : kCopyAsync;
}

template <CacheFormat FMT, bool SPLIT, bool CL>
cudaError_t launch_kernel(const KParams& k, int batch, cudaStream_t stream, const CUtensorMap& map,
                          const CUtensorMap& map2, int copy) {
  constexpr auto kernel = wgmma_seesaw_kernel<FMT, SPLIT, CL>;
  const cudaError_t attr = allow_dynamic_smem<kernel>(kSmem);
  if (attr != cudaSuccess) return attr;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = cta_grid(k, kM, batch);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  if (CL) {
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 2;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, k, map, map2, copy);
}

template <CacheFormat FMT, bool SPLIT>
cudaError_t launch_one(const KParams& k, int batch, bool tensor_copies, cudaStream_t stream) {
  // Without tensor copies (DecodeMlaParams::seesaw_loader = 2) the producer uses cp.async; fp8
  // caches need tensor copies.
  CUtensorMap map{}, map2{};
  const int copy = tensor_copies ? make_maps<FMT>(k, &map, &map2) : kCopyAsync;
  if (FMT != kFmtBf16 && copy == kCopyAsync) return cudaErrorNotSupported;
  // bf16 by tensor copies at 128 heads: the two head groups as a cluster sharing the tile copies
  // (faster on an H200: kernels/DESIGN.md §3.3); a device that cannot place the cluster gets the
  // plain launch.
  if constexpr (FMT == kFmtBf16) {
    if (copy != kCopyAsync && k.heads == 2 * kM) {
      if (launch_kernel<FMT, SPLIT, true>(k, batch, stream, map, map2, copy) == cudaSuccess) return cudaSuccess;
      (void)cudaGetLastError();
    }
  }
  return launch_kernel<FMT, SPLIT, false>(k, batch, stream, map, map2, copy);
}

template <CacheFormat FMT>
cudaError_t launch_fmt(const KParams& k, int batch, bool tensor_copies, cudaStream_t stream) {
  return k.splits > 1 ? launch_one<FMT, true>(k, batch, tensor_copies, stream)
                      : launch_one<FMT, false>(k, batch, tensor_copies, stream);
}

}  // namespace

cudaError_t launch_wgmma_seesaw(const KParams& k, CacheFormat fmt, int batch, bool tensor_copies, cudaStream_t stream) {
  switch (fmt) {
    case kFmtBf16: return launch_fmt<kFmtBf16>(k, batch, tensor_copies, stream);
    case kFmtFp8: return launch_fmt<kFmtFp8>(k, batch, tensor_copies, stream);
    case kFmtDs: return launch_fmt<kFmtDs>(k, batch, tensor_copies, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvferry::mla_detail
