// Hopper MLA decode, the depth-split kernel for every cache format (bf16, mla_fp8, mla_fp8_ds;
// contract in decode_mla.h; kernels/DESIGN.md §3.4): warpgroup MMA (wgmma, sm_90a).
//
// One CTA per (64 heads, split, request); fewer heads are padded to 64 rows (zero Q rows, never
// written out). Two consumer warpgroups do the math; Q (64 x 576 bf16) stays in shared memory and
// every 32-token K tile is brought in once for all 64 heads. Tiles and Q are stored as nine column
// blocks of 64 values, 128-byte rows with the 128-byte swizzle, so the same bytes are the K-major B
// operand of S = Q K^T and the N-major (transposed) B operand of O = P V.
//   S:  warpgroup w computes the partial S over depth [288 w, +288) (18 x m64n32k16, A = Q and B
//       = K from shared memory); the two partials are exchanged through shared memory and added
//       (a + b == b + a, so both warpgroups hold the same S bits).
//   P.V: both run the same online softmax; warpgroup w owns output columns [256 w, +256): 2 x
//       m64n256k16 with P as the register A operand (the S accumulator layout is the A fragment
//       layout) and 128 fp32 accumulators per thread.
// Profiled on an H200, the math warps' instruction stream limits a tile more than the tensor
// cores do (issue slots half busy, ~5-7 cycles per issued instruction at 12 warps per SM), so the
// per-tile instructions are kept few: wgmma descriptors are a constant high word and a low word offset by compile-time
// steps, the producer's and the conversion's indices are stepped without division.
//  - bf16 cache: S(t+1) is issued just before P.V(t) and awaited alone, so the softmax of tile
//    t+1 runs while the tensor cores run P.V(t) (two P fragment sets).
//  - fp8 caches: P.V(t) is in flight while tile t+1 is converted and its S issued.
// A third, producer warpgroup (56 registers via setmaxnreg; the math warpgroups get 224) feeds the
// tiles through full/empty mbarriers, so no math thread spends issue slots or stalls on loads:
//  - bf16 cache: it copies each tile with cp.async straight into the swizzled layout (three
//    stages; lane l of producer warp w copies chunks l, l+32, l+64 of rows 8w..8w+7), publishing
//    a tile once it landed and before it blocks on a busy stage.
//  - fp8 caches: one producer warp lands the raw rows by bulk copies (one per token, two raw
//    stages); a tile is converted to bf16 (exact for e4m3; mla_fp8_ds multiplies by its tile
//    scale in fp32 and rounds once) by the other three producer warps (rows [0, conv_rows), as
//    soon as P.V has released the bf16 buffer) and by the 256 math threads (the other rows, while
//    the tensor cores run the previous tile's P.V). conv_rows is DecodeMlaParams::conv_rows,
//    default 12 of 32: the split that measured fastest on an H200 (kernels/DESIGN.md §3.4).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "decode_mla/kernels.h"
#include "decode_mla/common.cuh"
#include "decode_mla/wgmma.cuh"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry::mla_detail {
namespace {

constexpr int kN = 32;                        // tokens per K tile
constexpr int kM = 64;                        // head rows per CTA (the wgmma M)
constexpr int kChunks = kMlaDim * 2 / 16;     // 16-byte chunks of a bf16 row (72)
constexpr int kCb = kMlaDim / 64;             // column blocks of 64 bf16 = one 128-byte row (9)
constexpr int kQBytes = kCb * kM * 128;       // 73728
constexpr int kTileBytes = kCb * kN * 128;    // 36864
constexpr int kSBytes = 2 * 4 * 4 * 32 * 16;  // S partials: [warpgroup][warp][n8 tile][lane] float4
constexpr int kQkSteps = kMlaDim / 16 / 2;    // k16 steps of S per warpgroup (18)

// Two math warpgroups and a producer warpgroup. Shared memory: Q, bf16 tile stages (three for a
// bf16 cache; two for fp8 caches, plus two raw stages), two S exchange buffers, six mbarriers
// (200-221 KiB: one CTA per SM).
constexpr int kProducerThreads = 128;
constexpr int kWsThreads = 2 * 128 + kProducerThreads;
constexpr int kWsStages = 3;
template <CacheFormat FMT>
constexpr int entry_bytes() {
  return FMT == kFmtBf16 ? kMlaBf16Bytes : FMT == kFmtFp8 ? kMlaFp8Bytes : kMlaDsBytes;
}
template <CacheFormat FMT>
constexpr int ws_smem_bytes() {
  return FMT == kFmtBf16 ? 1024 + kQBytes + kWsStages * kTileBytes + 2 * kSBytes + 128
                         : 1024 + kQBytes + 2 * kTileBytes + 2 * kN * entry_bytes<FMT>() + 2 * kSBytes + 128;
}

// Byte offset of 16-byte chunk `c` (0..71) of row `r` in a [rows x 576] bf16 tile stored as nine
// column blocks of [rows x 128 B] with the 128-byte swizzle (chunk c%8 of a row lands at (c%8) ^ (r%8)).
template <int ROWS>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// d (64 x 32 fp32) = [d +] A (64 x 16, K-major smem) * B (32 x 16, K-major smem)^T.
__device__ __forceinline__ void wgmma_qk(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 256 fp32) += A (64 x 16 bf16, registers) * B (16 x 256, N-major smem).
__device__ __forceinline__ void wgmma_pv(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127},"
      " {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : KVF_WG_F32(d, 0), KVF_WG_F32(d, 32), KVF_WG_F32(d, 64), KVF_WG_F32(d, 96)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// 16 e4m3 bytes -> 16 bf16 (convert16_words), two 16-byte stores.
template <bool SCALED>
__device__ __forceinline__ void convert16(const uint4 raw, float s, uint8_t* d0, uint8_t* d1) {
  uint32_t out[8];
  convert16_words<SCALED>(raw, s, out);
  *reinterpret_cast<uint4*>(d0) = make_uint4(out[0], out[1], out[2], out[3]);
  *reinterpret_cast<uint4*>(d1) = make_uint4(out[4], out[5], out[6], out[7]);
}

// Converts rows [r0, r1) of a raw fp8 tile into the swizzled bf16 tile `dst`, chunk `ct` + NT i
// per thread (ct < NT), the (row, chunk) pair stepped without division. Rows >= nvalid are zero.
// The math threads' loop is unrolled; the producer's is not (it runs under 56 registers).
template <CacheFormat FMT, int NT>
__device__ __forceinline__ void convert_rows(const uint8_t* raw, uint8_t* dst, int nvalid, int r0, int r1, int ct) {
  constexpr int kUnroll = NT >= 256 ? 8 : 1;
  constexpr int RAW = entry_bytes<FMT>();
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if constexpr (FMT == kFmtFp8) {
    constexpr int CH = RAW / 16;  // 36 raw chunks per row -> bf16 chunks 2 col, 2 col + 1
    int r = r0 + ct / CH, col = ct % CH;
#pragma unroll kUnroll
    for (int i = 0; i < (kN * CH + NT - 1) / NT; ++i, r += NT / CH, col += NT % CH) {
      if (col >= CH) {
        col -= CH;
        ++r;
      }
      if (r >= r1) break;
      uint8_t* d0 = dst + swz<kN>(r, 2 * col);
      uint8_t* d1 = dst + swz<kN>(r, 2 * col + 1);
      if (r < nvalid) {
        convert16<false>(*reinterpret_cast<const uint4*>(raw + r * RAW + col * 16), 1.0f, d0, d1);
      } else {
        *reinterpret_cast<uint4*>(d0) = zero;
        *reinterpret_cast<uint4*>(d1) = zero;
      }
    }
  } else if constexpr (FMT == kFmtDs) {
    constexpr int kPer = kMlaRank / 16 + kMlaRope * 2 / 16;  // 32 nope chunks + 8 rope chunks
    int r = r0 + ct / kPer, col = ct % kPer;
#pragma unroll kUnroll
    for (int i = 0; i < (kN * kPer + NT - 1) / NT; ++i, r += NT / kPer, col += NT % kPer) {
      if (col >= kPer) {
        col -= kPer;
        ++r;
      }
      if (r >= r1) break;
      const uint8_t* row = raw + r * RAW;
      if (col < kMlaRank / 16) {
        uint8_t* d0 = dst + swz<kN>(r, 2 * col);
        uint8_t* d1 = dst + swz<kN>(r, 2 * col + 1);
        if (r < nvalid) {
          const float sc = reinterpret_cast<const float*>(row + kMlaDsScaleOffset)[col / (kMlaTile / 16)];
          convert16<true>(*reinterpret_cast<const uint4*>(row + col * 16), sc, d0, d1);
        } else {
          *reinterpret_cast<uint4*>(d0) = zero;
          *reinterpret_cast<uint4*>(d1) = zero;
        }
      } else {
        const int rc = col - kMlaRank / 16;
        *reinterpret_cast<uint4*>(dst + swz<kN>(r, kMlaRank * 2 / 16 + rc)) =
            r < nvalid ? *reinterpret_cast<const uint4*>(row + kMlaDsRopeOffset + rc * 16) : zero;
      }
    }
  }
}

template <CacheFormat FMT, bool SPLIT>
__global__ void __launch_bounds__(kWsThreads, 1) wgmma_depth_split_kernel(const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kBf = FMT == kFmtBf16;
  constexpr int NB = kBf ? kWsStages : 2, NR = kBf ? 0 : 2, RAW = entry_bytes<FMT>();
  constexpr int NRS = NR > 0 ? NR : 1;  // raw stages as a divisor (unused for bf16)
  extern __shared__ uint8_t smem_dyn[];
  uint8_t* smem = KVFERRY_MLA_SMEM_ALIGN_1024(smem_dyn);
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + kQBytes;
  uint8_t* sRaw = sK + NB * kTileBytes;                          // fp8: raw stages
  float4* sS = reinterpret_cast<float4*>(sRaw + NR * kN * RAW);  // two exchange buffers (by tile parity)
  const uint32_t bars = smem_u32(sS) + 2 * kSBytes;              // full[3], empty[3], fp8: conv[2], done[2] mbarriers
  auto full_bar = [&](int i) { return bars + 8 * i; };
  auto empty_bar = [&](int i) { return bars + 24 + 8 * i; };
  auto conv_bar = [&](int i) { return bars + 48 + 8 * i; };  // producer rows of bf16 buffer i converted
  auto done_bar = [&](int i) { return bars + 64 + 8 * i; };  // P.V has read bf16 buffer i
  const int conv_rows = kBf ? 0 : p.conv_rows;

  const int hb = min(p.heads, kM);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup index broadcast from lane 0, so the compiler knows it is warp-uniform and keeps
  // the wgmma descriptors derived from it in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wl = warp & 3, g = lane >> 2, tq = lane & 3;
  KVFERRY_MLA_CTA_PROLOGUE(kN, hb, kWsThreads, SPLIT);

  if (tid == 0) {
    for (int i = 0; i < (kBf ? NB : NR); ++i) {  // fp8: full/empty of the raw stages
      mbar_init(full_bar(i), kBf ? kProducerThreads : 1);
      // lane 0 of each consumer warp (and, for an fp8 raw stage, of each converting producer warp)
      mbar_init(empty_bar(i), conv_rows > 0 ? 8 + 3 : 8);
    }
    if (conv_rows > 0)
      for (int i = 0; i < 2; ++i) {
        mbar_init(conv_bar(i), 3);  // lane 0 of producer warps 1-3
        mbar_init(done_bar(i), 8);  // lane 0 of each consumer warp
      }
    mbar_fence_init();
  }
  __syncthreads();

  if (warp >= 8) {
    // Producer warpgroup: copies every tile into its stage (cp.async straight into the swizzled
    // layout, one tile ahead of the one it publishes), then signals full[]; waits on empty[]
    // before reusing a stage. It needs few registers, so the consumers get more.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int pw = warp - 8;  // producer warp 0..3
    static_assert(kN == 4 * 8 && kChunks == 2 * 32 + 8, "the bf16 producer's row and chunk mapping");
    const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
    // Token -> (page, slot): a shift and a mask when the page is a power of two.
    auto in_page = [&](int tok) { return p.page_shift >= 0 ? tok & (p.page - 1) : tok % p.page; };
    auto fetch_blk = [&](int t) -> int32_t {
      const int tok = start + t * kN + lane;
      return t < ntiles && tok < end ? table[p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page] : 0;
    };
    if constexpr (!kBf) {
      // fp8: one warp issues a bulk copy per token of each raw tile; the math warpgroups convert.
      if (warp == 8) {
        int32_t blk = fetch_blk(0);
        for (int t = 0; t < ntiles; ++t) {
          const int32_t nblk = fetch_blk(t + 1);
          if (t >= NR) mbar_wait(empty_bar(t % NRS), (t / NRS - 1) & 1);
          const int tok0 = start + t * kN, nvalid = min(kN, end - tok0);
          const uint32_t bar = full_bar(t % NRS);
          if (lane == 0) mbar_expect_tx(bar, static_cast<uint32_t>(nvalid * RAW));
          __syncwarp();
          if (lane < nvalid)
            bulk_g2s(smem_u32(sRaw + (t % NRS) * (kN * RAW) + lane * RAW),
                     p.cache + static_cast<int64_t>(blk) * p.block_stride +
                         static_cast<int64_t>(in_page(tok0 + lane)) * p.token_stride,
                     RAW, bar);
          blk = nblk;
        }
      } else if (conv_rows > 0) {
        // Producer warps 1-3 convert rows [0, conv_rows) of every tile into its bf16 buffer as soon
        // as P.V has released that buffer, ahead of the math warps, which convert the rest.
        for (int t = 0; t < ntiles; ++t) {
          if (t >= 2) mbar_wait(done_bar(t % 2), (t / 2 - 1) & 1);
          mbar_wait(full_bar(t % NRS), (t / NRS) & 1);
          const int nvalid = min(kN, end - (start + t * kN));
          convert_rows<FMT, 96>(sRaw + (t % NRS) * (kN * RAW), sK + (t % NB) * kTileBytes, nvalid, 0, conv_rows,
                                tid - 9 * 32);
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) {
            mbar_arrive(empty_bar(t % NRS));
            mbar_arrive(conv_bar(t % 2));
          }
        }
      }
    } else {
      int32_t blk = fetch_blk(0);
      int published = 0;  // tiles [0, published) have been signalled full
      for (int t = 0; t <= ntiles; ++t) {
        if (t < ntiles) {
          const int32_t nblk = fetch_blk(t + 1);
          if (t >= NB) {
            // Publish tile t-1 (copied an iteration ago) before blocking on the stage of tile t, not
            // after copying tile t: the math warps wait for it as soon as they free that stage.
            if (published < t) {
              cp_async_wait<0>();
              fence_proxy_async();
              mbar_arrive(full_bar((t - 1) % NB));
              published = t;
            }
            mbar_wait(empty_bar(t % NB), (t / NB - 1) & 1);
          }
          const int tok = start + t * kN + lane;
          const uint8_t* rb = nullptr;
          if (tok < end)
            rb = p.cache + static_cast<int64_t>(blk) * p.block_stride +
                 static_cast<int64_t>(in_page(tok)) * p.token_stride;
          const unsigned long long rbits = reinterpret_cast<unsigned long long>(rb);
          // Producer warp pw copies rows 8 pw .. 8 pw + 7; lane l copies chunks l, l + 32 and
          // (l < 8) l + 64 of each, which share the in-row swizzle slot l % 8 and lie 4 column
          // blocks apart: no per-chunk division, and the swizzle of row 8 pw + j is l % 8 ^ j.
          const uint32_t dst = smem_u32(sK + (t % NB) * kTileBytes) + (lane >> 3) * (kN * 128) + pw * 8 * 128;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const auto src = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, rbits, pw * 8 + j));
            const uint32_t d = dst + j * 128 + (((lane & 7) ^ j) << 4);
#pragma unroll
            for (int k = 0; k < 3; ++k) {
              // Rows past the end are zero-filled: V is multiplied by p = 0, which would keep a NaN.
              if (k < 2 || lane < 8)
                cp_async16(d + k * 4 * (kN * 128), src ? src + (lane + 32 * k) * 16 : p.cache, src ? 16 : 0);
            }
          }
          blk = nblk;
        }
        cp_async_commit();
        if (t >= 1 && published < t) {  // tile t-1 landed: publish it
          cp_async_wait<1>();
          fence_proxy_async();
          mbar_arrive(full_bar((t - 1) % NB));
          published = t;
        }
      }
    }
    return;
  }

  // Consumer warpgroups 0 and 1.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  {  // Q rows of this head group, swizzled; rows past the heads are zero
    const uint8_t* qsrc = reinterpret_cast<const uint8_t*>(p.q + (static_cast<int64_t>(b) * p.heads + head0) * kMlaDim);
    const uint32_t q_u32 = smem_u32(sQ);
    for (int c = tid; c < kM * kChunks; c += 2 * 128) {
      const int r = c / kChunks, col = c % kChunks;
      cp_async16(q_u32 + swz<kM>(r, col), r < hb ? qsrc + r * (kMlaDim * 2) + col * 16 : qsrc, r < hb ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
  }

  const uint32_t q_u32 = smem_u32(sQ), k_u32 = smem_u32(sK);
  float s[16];
  // Issues S(t) (partial over this warpgroup's half of the depth) into s. The descriptors are
  // the low words of Q's and the stage's bases plus compile-time offsets (one add each): the depth
  // half is a template argument, chosen by a warp-uniform branch.
  const uint32_t q_lo = desc_lo(q_u32, 16), k_lo = desc_lo(k_u32, 16);
  auto qk_steps = [&](auto wgc, int t) {
    constexpr int WG = decltype(wgc)::value;
    const uint32_t tile_lo = k_lo + (t % NB) * (kTileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQkSteps; ++kk) {
      const int ks = WG * kQkSteps + kk;
      const uint32_t off = (ks & 3) * 32;  // k16 step inside the 128-byte row
      wgmma_qk(s, desc(q_lo + (((ks >> 2) * (kM * 128) + off) >> 4)),
               desc(tile_lo + (((ks >> 2) * (kN * 128) + off) >> 4)), kk > 0);
    }
  };
  auto issue_qk = [&](int t) {
    if (wg == 0)
      qk_steps(std::integral_constant<int, 0>{}, t);
    else
      qk_steps(std::integral_constant<int, 1>{}, t);
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  uint32_t pa[2][4], pn[2][4];  // P(t) as A fragments; bf16: P(t+1) is built while P.V(t) runs
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  float4* s_mine = sS + (wg * 4 + wl) * 4 * 32 + lane;
  const float4* s_other = sS + ((1 - wg) * 4 + wl) * 4 * 32 + lane;
  constexpr int kSPar = kSBytes / 16;  // float4s of one exchange buffer

  // After S(t) completed: full S from the two partials, online softmax (log2 domain; rows g and g+8
  // of this warp's 16), P(t) into the A fragments `pn`; returns the factors the accumulators must
  // be scaled by once P.V(t-1) has completed.
  auto softmax = [&](int t, uint32_t(&pn)[2][4], float& al0, float& al1) {
    // The S accumulators are only read here (copied after the wait by volatile moves that cannot be
    // hoisted above it): an ordinary write to them while P.V(t-1) is in flight would make the
    // compiler serialize every wgmma.
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) asm volatile("mov.b32 %0, %1;\n" : "=f"(x[i]) : "f"(s[i]));
#pragma unroll
    for (int n = 0; n < 4; ++n)
      s_mine[(t & 1) * kSPar + n * 32] = make_float4(x[4 * n], x[4 * n + 1], x[4 * n + 2], x[4 * n + 3]);
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the consumers only
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float4 u = s_other[(t & 1) * kSPar + n * 32];
      x[4 * n] += u.x;
      x[4 * n + 1] += u.y;
      x[4 * n + 2] += u.z;
      x[4 * n + 3] += u.w;
    }
    const int tok0 = start + t * kN;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + n * 8 + tq * 2 + (e & 1);
        x[4 * n + e] = tok < end ? x[4 * n + e] * p.scale_log2 : -INFINITY;
      }
      mx0 = fmaxf(mx0, fmaxf(x[4 * n], x[4 * n + 1]));
      mx1 = fmaxf(mx1, fmaxf(x[4 * n + 2], x[4 * n + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);  // finite: every tile has a valid token
    al0 = exp2f(m0 - nm0);
    al1 = exp2f(m1 - nm1);
    m0 = nm0;
    m1 = nm1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      x[4 * n] = exp2f(x[4 * n] - nm0);
      x[4 * n + 1] = exp2f(x[4 * n + 1] - nm0);
      x[4 * n + 2] = exp2f(x[4 * n + 2] - nm1);
      x[4 * n + 3] = exp2f(x[4 * n + 3] - nm1);
      rs0 += x[4 * n] + x[4 * n + 1];
      rs1 += x[4 * n + 2] + x[4 * n + 3];
    }
    l0 = l0 * al0 + rs0;
    l1 = l1 * al1 + rs1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pn[i][0] = pack_bf16(x[8 * i], x[8 * i + 1]);
      pn[i][1] = pack_bf16(x[8 * i + 2], x[8 * i + 3]);
      pn[i][2] = pack_bf16(x[8 * i + 4], x[8 * i + 5]);
      pn[i][3] = pack_bf16(x[8 * i + 6], x[8 * i + 7]);
    }
  };
  // Once the row maxima stop growing the factors are exactly 1 and multiplying by them changes no
  // bit, so a warp whose rows all kept their maxima skips the 128 multiplies.
  auto rescale = [&](float al0, float al1) {
    if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        acc[4 * n] *= al0;
        acc[4 * n + 1] *= al0;
        acc[4 * n + 2] *= al1;
        acc[4 * n + 3] *= al1;
      }
    }
  };
  auto fence_pa = [&]() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[i][e])::"memory");
  };
  // V columns [256 wg, +256) = column blocks 4 wg .. 4 wg + 3 (lbo apart), tokens 16 j .. 16 j + 15.
  const uint32_t v_lo = desc_lo(k_u32 + wg * 4 * (kN * 128), kN * 128);
  auto issue_pv = [&](int t) {
    const uint32_t vtile_lo = v_lo + (t % NB) * (kTileBytes >> 4);
    wgmma_pv(acc, pa[0], desc(vtile_lo));
    wgmma_pv(acc, pa[1], desc(vtile_lo + ((16 * 128) >> 4)));
    wgmma_commit();
  };

  // fp8: raw tile t (landed by bulk copies) converted into bf16 buffer t % 2: rows [conv_rows, 32)
  // by the 256 math threads, rows [0, conv_rows) by producer warps 1-3 (awaited on conv[t % 2]);
  // made visible to the async proxy, raw stage handed back. Rows past the end are zero.
  auto convert_tile = [&](int t) {
    mbar_wait(full_bar(t % NRS), (t / NRS) & 1);
    const int nvalid = min(kN, end - (start + t * kN));
    convert_rows<FMT, 256>(sRaw + (t % NRS) * (kN * RAW), sK + (t % NB) * kTileBytes, nvalid, conv_rows, kN, tid);
    fence_proxy_async();
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if (lane == 0) mbar_arrive(empty_bar(t % NRS));
    if (conv_rows > 0) mbar_wait(conv_bar(t % 2), (t / 2) & 1);
  };

  if constexpr (kBf)
    mbar_wait(full_bar(0), 0);
  else
    convert_tile(0);
  issue_qk(0);
  wgmma_commit();
  wgmma_wait<0>();
  {
    float al0, al1;
    softmax(0, pa, al0, al1);  // the accumulators are still 0
  }
  if constexpr (kBf) {
    // S(t+1) is issued just before P.V(t) and awaited alone, so the softmax of tile t+1 runs while
    // the tensor cores run P.V(t). The commit groups are unconditional (empty after the last tile)
    // so that the compiler sees which group each wait covers and keeps the wgmmas asynchronous.
    for (int t = 0; t < ntiles; ++t) {
      const bool more = t + 1 < ntiles;
      if (more) {
        mbar_wait(full_bar((t + 1) % NB), ((t + 1) / NB) & 1);
        issue_qk(t + 1);
      }
      wgmma_commit();
      wgmma_fence();
      issue_pv(t);
      wgmma_wait<1>();  // S(t+1); P.V(t) may still run
      float al0 = 1.0f, al1 = 1.0f;
      if (more) softmax(t + 1, pn, al0, al1);
      wgmma_wait<0>();
      fence_regs(acc);
      fence_pa();
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar(t % NB));  // P.V(t) and S(t) have read buffer t % NB
      if (more) {
        rescale(al0, al1);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[i][e] = pn[i][e];
      }
    }
  } else {
    // fp8: the conversion of tile t+1 (the math threads' main work) runs while P.V(t) does.
    for (int t = 0; t < ntiles; ++t) {
      wgmma_fence();
      issue_pv(t);
      if (t + 1 < ntiles) {
        convert_tile(t + 1);
        issue_qk(t + 1);
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_regs(acc);
      fence_pa();
      __syncwarp();
      if (conv_rows > 0 && lane == 0) mbar_arrive(done_bar(t % 2));  // P.V(t) and S(t) read buffer t % 2
      if (t + 1 < ntiles) {
        float al0, al1;
        softmax(t + 1, pa, al0, al1);
        rescale(al0, al1);
      }
    }
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  store_out<SPLIT>(p, b, split, head0, hb, wg, wl * 16 + g, tq, acc, m0, m1, l0, l1);
#else
  __trap();  // built without sm_90a: launch_wgmma_depth_split is never chosen for such a build (see launch.cu)
#endif
}

template <CacheFormat FMT, bool SPLIT>
cudaError_t launch_one(const KParams& k, int batch, cudaStream_t stream) {
  const dim3 grid = cta_grid(k, kM, batch);
  constexpr int smem = ws_smem_bytes<FMT>();
  const cudaError_t attr = allow_dynamic_smem<wgmma_depth_split_kernel<FMT, SPLIT>>(smem);
  if (attr != cudaSuccess) return attr;
  wgmma_depth_split_kernel<FMT, SPLIT><<<grid, kWsThreads, smem, stream>>>(k);
  return cudaGetLastError();
}

template <CacheFormat FMT>
cudaError_t launch_fmt(const KParams& k, int batch, cudaStream_t stream) {
  return k.splits > 1 ? launch_one<FMT, true>(k, batch, stream) : launch_one<FMT, false>(k, batch, stream);
}

}  // namespace

cudaError_t launch_wgmma_depth_split(const KParams& k, CacheFormat fmt, int batch, cudaStream_t stream) {
  if (k.conv_rows < 0 || k.conv_rows > kN) return cudaErrorInvalidValue;
  switch (fmt) {
    case kFmtBf16: return launch_fmt<kFmtBf16>(k, batch, stream);
    case kFmtFp8: return launch_fmt<kFmtFp8>(k, batch, stream);
    case kFmtDs: return launch_fmt<kFmtDs>(k, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvferry::mla_detail
