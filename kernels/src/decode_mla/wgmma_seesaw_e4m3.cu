// Hopper MLA decode for mla_fp8 caches with fp8 tensor-core math (DecodeMlaParams::fp8_math; contract
// in decode_mla.h): the seesaw schedule of wgmma_seesaw.cu with both products in e4m3, so the
// cache bytes are multiplied as they land and no pass converts them.
//
// One CTA per (64 heads, split, request), 64-token tiles, two math warpgroups and a producer
// warpgroup. Q is rounded once to e4m3, per head times a power of two (its largest magnitude to
// [128, 256)), undone on S. Q and the tiles live in shared memory as five column blocks of
// [64 rows x 128 bytes] with the 128-byte swizzle: four of the nope bytes and one of the rope's 64
// bytes (S reads only those; the tensor copy's box runs past the entry and is zero-filled there),
// so a tile is, as it lands, the K-major B operand of S = Q K^T (m64n64k32 e4m3).
//
// P V runs transposed, O^T = V^T P^T (m64n64k32 e4m3): wgmma takes fp8 operands from shared memory
// only K-major, which the raw V (tokens x columns) is not, so V^T is the A operand in registers,
// gathered from the raw rows (ldmatrix.trans on byte pairs, one prmt per register); P^T is the B
// operand: P rounded to e4m3 in shared memory (heads x tokens, K-major). A warpgroup owns 256
// output columns as four m64 tiles of O^T (64 columns x 64 heads); thread (warp w, lane group g)
// holds columns 16 (4 w + i) + 2 g + h (tile i, row half h). The products' K index runs over each
// 16 tokens in ldmatrix's order (k = 4 q + e is token 8 (e / 2) + 2 q + e % 2), and P is stored
// in that order. The softmax rescales of O^T are per head (its N index): the factors go through
// shared memory.
//
// The schedule (per pair of tiles a = 2j, b = 2j + 1; integer references in the log2 domain, ref_of):
//   WG0: S(a); m0 = ref(m, rowmax S(a)); P(a) = 2^(S(a) - m0) -> Pa; O_L = O_L 2^(m - m0) + V_L(a)^T Pa
//   WG1: S(b); m1 = ref(m0, rowmax S(b)); P(b) = 2^(S(b) - m1) -> Pb; O_R = O_R 2^(m - m1) + V_R(b)^T Pb
//   WG0: P(a) 2^(m0 - m1) -> Pa2; O_L = O_L 2^(m0 - m1) + V_L(b)^T Pb
//   WG1: O_R += V_R(a)^T Pa2
// (About 0.6 of the exact kernel's time at 128 heads, near the floor timing-only builds gave this
// design: kernels/DESIGN.md §3.5.)
// A lane of the producer warpgroup per buffer issues the tensor copies of each part of a tile as
// soon as the warpgroup that reads it last releases it (part 0: V_L and the rope block, by
// warpgroup 0; part 1: V_R, by warpgroup 1), straight onto the blocks' full barriers.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "decode_mla/kernels.h"
#include "decode_mla/common.cuh"
#include "decode_mla/seesaw.cuh"
#include "decode_mla/wgmma.cuh"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry::mla_detail {
namespace {

constexpr int kN = 64;             // tokens per tile
constexpr int kM = 64;             // head rows per CTA
constexpr int kNb = 5;             // column blocks of a row: 4 x 128 nope bytes, the rope's 64 (+ 64 zero)
constexpr int kRopeCb = 4;         // the rope's column block
constexpr int kBlk = 64 * 128;     // one column block (64 rows x 128 bytes)
constexpr int kTile = kNb * kBlk;  // 40960, Q alike
constexpr int kThreads = 3 * 128;
// Shared memory after 1024-byte alignment: Q, two tiles, P(a), P(a) 2^(m0 - m1), P(b), then
// maxima [pair parity][warpgroup][64], rescale factors (alike), row sums [sum][warpgroup][64] (of
// P and of P rounded), Q's scales [64] and the barriers: full[buf][cb], empty[buf][part].
constexpr int kOffT = kTile;
constexpr int kOffP = 3 * kTile;
constexpr int kOffM = kOffP + 3 * kBlk;
constexpr int kOffF = kOffM + 4 * kM * 4;
constexpr int kOffL = kOffF + 4 * kM * 4;
constexpr int kOffQs = kOffL + 4 * kM * 4;
constexpr int kOffBar = kOffQs + kM * 4;
constexpr int kBars = 2 * kNb + 4;
constexpr int kSmem = 1024 + kOffBar + kBars * 8;
static_assert(kSmem <= 227 * 1024, "the layout fits an SM's shared memory");

// Column block visited i-th by S of a tile of parity `odd` (and copied i-th): even tiles V_L, rope,
// V_R; odd tiles V_R, V_L, rope (the order in which their parts are freed).
__host__ __device__ constexpr int visit(int odd, int i) {
  return odd ? (i < 2 ? i + 2 : i < 4 ? i - 2 : kRopeCb) : (i < 2 ? i : i == 2 ? kRopeCb : i - 1);
}
__host__ __device__ constexpr int part_of(int cb) { return cb == 2 || cb == 3 ? 1 : 0; }
static_assert(visit(0, 2) == kRopeCb && visit(0, 4) == 3 && visit(1, 0) == 2 && visit(1, 3) == 1, "visit order");

#define KF8_D                                       \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13," \
  "%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define KF8_MMA "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
// d (64 x 64 fp32) += A (64 x 32 e4m3, K-major smem) * B (64 x 32 e4m3, K-major smem)^T.
__device__ __forceinline__ void wg8_ss(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(KF8_MMA KF8_D ", %32, %33, 1, 1, 1;\n" : KVF_WG_F32(d, 0) : "l"(da), "l"(db));
}
#define KF8_W8(x, i)                                                                                              \
  "=f"(x[i + 0]), "=f"(x[i + 1]), "=f"(x[i + 2]), "=f"(x[i + 3]), "=f"(x[i + 4]), "=f"(x[i + 5]), "=f"(x[i + 6]), \
      "=f"(x[i + 7])
// d = A B^T (the first k step of an S: d is written, not read).
__device__ __forceinline__ void wg8_ss_first(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(KF8_MMA KF8_D ", %32, %33, 0, 1, 1;\n"
               : KF8_W8(d, 0), KF8_W8(d, 8), KF8_W8(d, 16), KF8_W8(d, 24)
               : "l"(da), "l"(db));
}
// d (64 x 64 fp32) += A (64 x 32 e4m3, registers) * B (64 x 32 e4m3, K-major smem)^T.
__device__ __forceinline__ void wg8_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(KF8_MMA KF8_D ", {%32,%33,%34,%35}, %36, 1, 1, 1;\n"
               : KVF_WG_F32(d, 0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#undef KF8_W8
#undef KF8_MMA
#undef KF8_D

// Two floats to e4m3 (round to nearest even, saturating), lo in the low byte.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// e4m3 pairs (lo in the low byte) -> floats.
__device__ __forceinline__ float2 e4m3x2_float2(uint16_t v) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(v));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
// A row's reference R (log2 domain) is an integer: the ceiling of its running maximum minus 8, so
// P = 2^(x - R) is at most 2^8 (e4m3 reaches 448) and the largest P of the row so far is above
// 2^7, far from e4m3's subnormals (below 2^-6). P rounds to e4m3 as 2^(x - R') does for any other
// integer R' wherever both are normal (the normal range is closed under powers of two), so the CPU
// twin, whose R comes from the row's final maximum, rounds every P that matters to the same e4m3
// value up to a power of two, and every rescale factor is an exact power of two.
__device__ __forceinline__ float ref_of(float m, float mx) { return fmaxf(m, ceilf(mx) - 8.0f); }
// 2^(m - n) for integers m <= n (m = -inf: 0), exact.
__device__ __forceinline__ float pow2_step(float m, float n) {
  return m == -INFINITY ? 0.0f : exp2i(max(static_cast<int>(m - n), -126));
}

template <bool SPLIT>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_seesaw_e4m3_kernel(const KParams p, const __grid_constant__ CUtensorMap tmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_dyn[];
  uint8_t* smem = KVFERRY_MLA_SMEM_ALIGN_1024(smem_dyn);
  const uint32_t q_u32 = smem_u32(smem), t_u32 = q_u32 + kOffT, p_u32 = q_u32 + kOffP;
  const uint32_t pa_u32 = p_u32, pa2_u32 = p_u32 + kBlk, pb_u32 = p_u32 + 2 * kBlk;
  // [pair parity][warpgroup][row]: m0, m1. The parity is what keeps warpgroup 0's next m0 from
  // overwriting this pair's while another of its warps still reads it for the per-head factors.
  float* sM = reinterpret_cast<float*>(smem + kOffM);
  float* sF = reinterpret_cast<float*>(smem + kOffF);  // [pair parity][warpgroup][row]: rescale factors
  float* sL = reinterpret_cast<float*>(smem + kOffL);  // [sum][warpgroup][row]: final row sums
  float* sQs = reinterpret_cast<float*>(smem + kOffQs);
  const uint32_t bars = q_u32 + kOffBar;
  auto full_bar = [&](int buf, int cb) { return bars + 8 * (buf * kNb + cb); };
  auto empty_bar = [&](int buf, int part) { return bars + 8 * (2 * kNb + buf * 2 + part); };

  const int hb = min(p.heads, kM);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wl = warp & 3, g = lane >> 2, tq = lane & 3;
  KVFERRY_MLA_CTA_PROLOGUE(kN, hb, kThreads, SPLIT);
  const int bp = min(p.page, kN);  // rows per tensor-copy box

  if (tid == 0) {
    for (int i = 0; i < 2 * kNb; ++i) mbar_init(full_bar(i / kNb, i % kNb), 1);  // the issuer's expect_tx
    for (int i = 0; i < 4; ++i) mbar_init(empty_bar(i >> 1, i & 1), 4);          // lane 0 of each releasing warp
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 2) {
    // Producer: lane 0 of warp 8 + buf issues buffer buf's tiles, each part once it was released.
    // The producer needs few registers (one issuing lane per buffer): the math warpgroups take 240,
    // which ptxas honours after setmaxnreg. At 56 / 224 warpgroup 1 spilled about 350 bytes and
    // the kernel ran 12-13 us slower (H200, 128 heads: 123.9-129.3 -> 110.8-111.3 us; 40 / 232:
    // 114.7-115.3).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (warp > 9 || lane != 0) return;
    const int buf = warp - 8;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap)) : "memory");
    const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
    const uint64_t policy = evict_first_policy();
    const uint32_t tile = t_u32 + buf * kTile;
    for (int t = buf; t < ntiles; t += 2) {
      const int tok0 = start + t * kN;
      const int nbox = (min(kN, end - tok0) + bp - 1) / bp;  // boxes wholly past the end are not copied
      int blk[kN / 16];
#pragma unroll
      for (int k = 0; k < kN / 16; ++k) blk[k] = k < nbox ? table[(tok0 + k * bp) >> p.page_shift] : 0;
#pragma unroll 1
      for (int i = 0; i < kNb; ++i) {
        const int cb = visit(buf, i);
        if (t >= 2 && (i == 0 || i == (buf ? 2 : 3)))  // a part's first block: wait for its release
          mbar_wait(empty_bar(buf, part_of(cb)), ((t >> 1) - 1) & 1);
        const uint32_t bar = full_bar(buf, cb);
        mbar_expect_tx(bar, static_cast<uint32_t>(nbox * bp * 128));
#pragma unroll 1
        for (int k = 0; k < nbox; ++k)
          tma_load(tile + cb * kBlk + k * bp * 128, &tmap, cb * 128, (tok0 + k * bp) & (p.page - 1), blk[k], bar,
                   policy);
      }
    }
    return;
  }

  // Math warpgroups.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  {
    // Q rows of this head group to e4m3, times 2^e per row (the largest magnitude to [128, 256));
    // rows past the heads are zero. Threads 4r .. 4r + 3 take row r, thread 4r + j its 16-byte
    // chunks j + 4k (8 values each; k < 18).
    const int r = tid >> 2, j = tid & 3;
    const uint4* qrow =
        reinterpret_cast<const uint4*>(p.q + (static_cast<int64_t>(b) * p.heads + head0 + min(r, hb - 1)) * kMlaDim);
    uint4 v[18];
    float mx = 0.0f;
#pragma unroll
    for (int k = 0; k < 18; ++k) {
      v[k] = r < hb ? qrow[j + 4 * k] : make_uint4(0, 0, 0, 0);
      mx = bf16x8_amax(v[k], mx);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const int e = max(-126, min(8 - exp_above(mx), 126));
    const float up = exp2i(e);
#pragma unroll
    for (int k = 0; k < 18; ++k) {
      const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
      uint32_t o[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x0 = __uint_as_float(w[2 * h] << 16) * up, x1 = __uint_as_float(w[2 * h] & 0xffff0000u) * up;
        const float x2 = __uint_as_float(w[2 * h + 1] << 16) * up,
                    x3 = __uint_as_float(w[2 * h + 1] & 0xffff0000u) * up;
        o[h] = static_cast<uint32_t>(e4m3x2(x0, x1)) | (static_cast<uint32_t>(e4m3x2(x2, x3)) << 16);
      }
      const int d = 8 * (j + 4 * k);  // byte of the row
      const uint32_t a = q_u32 + (d >> 7) * kBlk + r * 128 + ((((d & 127) >> 4) ^ (r & 7)) << 4) + (d & 8);
      asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(a), "r"(o[0]), "r"(o[1]) : "memory");
    }
    if (j == 0) sQs[r] = p.scale_log2 * exp2i(-e);
    fence_proxy_async();
    bar_sync(1);
  }

  float s[32];
  const uint32_t q_lo = desc_lo(q_u32, 16), t_lo = desc_lo(t_u32, 16);
  // Issues S(t) = Q K(t)^T as one wgmma group, each block as soon as it landed.
  auto issue_s = [&](auto odd_c, int t) {
    constexpr int ODD = decltype(odd_c)::value;
    const int buf = t & 1;
    const uint32_t par = (t >> 1) & 1;
    const uint32_t tile_lo = t_lo + buf * (kTile >> 4);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < kNb; ++i) {
      const int cb = visit(ODD, i);
      mbar_wait(full_bar(buf, cb), par);
#pragma unroll
      for (int kk = 0; kk < (cb == kRopeCb ? 2 : 4); ++kk) {
        const uint32_t off = (cb * kBlk + kk * 32) >> 4;
        if (i == 0 && kk == 0)
          wg8_ss_first(s, desc(q_lo + off), desc(tile_lo + off));
        else
          wg8_ss(s, desc(q_lo + off), desc(tile_lo + off));
      }
    }
    wgmma_commit();
  };
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;

  float acc[4][32];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 32; ++k) acc[i][k] = 0.0f;
  auto fence_acc = [&]() {
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_regs(acc[i]);
  };
  // Rows r0 and r1 of this warp's 16 (S layout): reference maxima, sums of P (the lse) and of P
  // rounded to e4m3 (what O is divided by, so the weights sum to 1 as multiplied; warpgroup 1's
  // copy of P(a) is rounded again after its exact power-of-two scaling, which differs only where
  // that lands below e4m3's normal range, a weight under 2^-14 of the row's largest).
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f, u0 = 0.0f, u1 = 0.0f;
  const int r0 = wl * 16 + g, r1 = r0 + 8;

  // O^T columns (heads) of this thread: 8 n + 2 tq + c. Rescales them by the factors at `f`
  // (shared, per head); skipped by a warp whose factors are all 1.
  auto rescale_heads = [&](const float* f) {
    bool any = false;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float2 fv = *reinterpret_cast<const float2*>(f + 8 * n + 2 * tq);
      any |= fv.x != 1.0f || fv.y != 1.0f;
    }
    if (__any_sync(0xffffffffu, any)) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 fv = *reinterpret_cast<const float2*>(f + 8 * n + 2 * tq);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[i][4 * n] *= fv.x;
          acc[i][4 * n + 1] *= fv.y;
          acc[i][4 * n + 2] *= fv.x;
          acc[i][4 * n + 3] *= fv.y;
        }
      }
    }
  };
  // S(t) (completed) -> x = S scaled to the log2 domain, masked past the end; row maxima.
  auto load_s = [&](int t, float(&x)[32], float& mx0, float& mx1) {
    tile_logits(s, x, sQs[r0], sQs[r1], t == ntiles - 1, start + t * kN, end, tq, mx0, mx1);
  };
  auto exponentiate = [&](float(&x)[32], float nm0, float nm1, float& rs0, float& rs1) {
    tile_exp2(x, nm0, nm1, rs0, rs1);
  };
  // P as e4m3 pairs pk (x[2i], x[2i + 1] -> pk[i]) into a swizzled [64 heads x 64 k] K-major block,
  // k in the products' token order (each 16 tokens: k = 4 q + e is token 8 (e / 2) + 2 q + e % 2).
  // Byte offset of this thread's row r0 pair of tokens 8 n + 2 tq in such a block (row r1: + 8 * 128).
  auto p_off = [&](int n) {
    return static_cast<uint32_t>(r0 * 128 + ((((n >> 1) ^ g) << 4) | (4 * tq + 2 * (n & 1))));
  };
  // In that order the pairs of tokens 8 n + 2 tq (n even) and 8 (n + 1) + 2 tq are one word.
  auto store_pk = [&](const uint16_t(&pk)[16], uint32_t dst) {
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      const uint32_t a0 = dst + p_off(n);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0),
                   "r"(static_cast<uint32_t>(pk[2 * n]) | (static_cast<uint32_t>(pk[2 * n + 2]) << 16))
                   : "memory");
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0 + 8 * 128),
                   "r"(static_cast<uint32_t>(pk[2 * n + 1]) | (static_cast<uint32_t>(pk[2 * n + 3]) << 16))
                   : "memory");
    }
    fence_proxy_async();
  };
  // P to e4m3 pairs; returns this thread's row sums of the rounded values.
  auto round_p = [&](const float(&x)[32], uint16_t(&pk)[16], float& us0, float& us1) {
    us0 = 0.0f;
    us1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      pk[i] = e4m3x2(x[2 * i], x[2 * i + 1]);
      const float2 v = e4m3x2_float2(pk[i]);
      (i & 1 ? us1 : us0) += v.x + v.y;  // pk[2n]: row r0, pk[2n + 1]: row r1
    }
  };
  // O^T half += V_half(t)^T P^T, P^T from the block at `pbuf`. The A fragments come from the raw
  // rows of the tile (see lbase below): this thread's columns 16 (4 wl + i) + 2 g + h of the
  // warpgroup's half, tokens 32 ks + 16 h' + 8 (e / 2) + 2 tq + e % 2 for byte e; tokens past the end
  // read as 0 (P is 0 there, but 0 * NaN is not). The fragments stay live until the caller's wait.
  uint32_t va[2][4][4];
  auto fence_va = [&]() {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(va[ks][i][e])::"memory");
  };
  // V^T fragments by ldmatrix.trans on byte pairs: lane l gives the row address of 8 x 8 matrix
  // l / 8 (tokens 8 (l / 8) + l % 8 of each 32) of the 16 columns of O^T tile i; thread (g, q)
  // receives columns 2 g, 2 g + 1 of tokens 2 q, 2 q + 1 (+ 8, + 16, + 24 from the other matrices),
  // which two prmt turn into the A fragments of rows g (column 2 g) and g + 8 (2 g + 1) with the
  // tokens in the products' order. Warp wl's tile i holds columns 16 (4 wl + i) .. + 15 of the half.
  uint32_t lbase[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int rr = lane & 7, c = 4 * (wl & 1) + i;  // c: 16-byte chunk of the column block before the swizzle
    lbase[i] = t_u32 + (2 * wg + (wl >> 1)) * kBlk + (8 * (lane >> 3) + rr) * 128 + ((c ^ rr) << 4);
  }
  auto issue_pv = [&](int t, uint32_t pbuf) {
    const uint32_t boff = (t & 1) * kTile;
    const int lim = end - (start + t * kN);  // tokens of the tile before the end
    const bool tail = t == ntiles - 1 && lim < kN;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      // Tail: byte e of the first (second) two fragments is token 32 ks (+ 16) + 8 (e / 2) + 2 tq + e % 2.
      uint32_t keep[2] = {~0u, ~0u};
      if (tail) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          keep[h] = 0u;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (32 * ks + 16 * h + 8 * (e >> 1) + 2 * tq + (e & 1) < lim) keep[h] |= 0xFFu << (8 * e);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t r[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(lbase[i] + boff + ks * 32 * 128));
        va[ks][i][0] = prmt(r[0], r[1], 0x6420) & keep[0];
        va[ks][i][1] = prmt(r[0], r[1], 0x7531) & keep[0];
        va[ks][i][2] = prmt(r[2], r[3], 0x6420) & keep[1];
        va[ks][i][3] = prmt(r[2], r[3], 0x7531) & keep[1];
      }
    }
    const uint32_t pl = desc_lo(pbuf, 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) wg8_rs(acc[i], va[ks][i], desc(pl + 2 * ks));
    wgmma_commit();
  };
  auto release = [&](int t, int part) { mbar_arrive_lane0(empty_bar(t & 1, part), lane); };

  const int npairs = (ntiles + 1) / 2;
  if (wg == 0) {
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1, par = j & 1;
      const bool has_b = bt < ntiles;
      float* const m_wg0 = sM + par * 2 * kM;
      float* const m_wg1 = m_wg0 + kM;
      float* const f_wg0 = sF + par * 2 * kM;
      float x[32];
      issue_s(I0{}, a);
      wgmma_wait<0>();  // S(a) (and every product before it)
      fence_acc();
      fence_va();
      float mx0, mx1;
      load_s(a, x, mx0, mx1);
      const float n0 = ref_of(m0, mx0), n1 = ref_of(m1, mx1);
      const float f0 = pow2_step(m0, n0), f1 = pow2_step(m1, n1);
      m0 = n0;
      m1 = n1;
      if (tq == 0) {
        m_wg0[r0] = n0;
        m_wg0[r1] = n1;
        f_wg0[r0] = f0;
        f_wg0[r1] = f1;
      }
      bar_arrive(2);  // m0 ready for warpgroup 1
      float rs0, rs1;
      exponentiate(x, n0, n1, rs0, rs1);
      l0 = l0 * f0 + rs0;
      l1 = l1 * f1 + rs1;
      uint16_t pk[16];  // P(a) as e4m3
      float us0, us1;
      round_p(x, pk, us0, us1);
      u0 = u0 * f0 + us0;
      u1 = u1 * f1 + us1;
      store_pk(pk, pa_u32);
      asm volatile("bar.sync 6, 128;\n" ::: "memory");  // warpgroup 0: Pa and the factors stored
      rescale_heads(f_wg0);
      issue_pv(a, pa_u32);
      release(a, 0);  // S(a) completed, V_L(a) is in registers
      float g0 = 1.0f, g1 = 1.0f;
      if (has_b) {
        bar_sync(3);  // m1 and P(b) ready
        const float q0 = m_wg1[r0], q1 = m_wg1[r1];
        g0 = pow2_step(m0, q0);
        g1 = pow2_step(m1, q1);
        m0 = q0;
        m1 = q1;
      }
      if (j > 0) bar_sync(5);  // warpgroup 1 read Pa2 of the previous pair
      {
        // P(a) 2^(m0 - m1) into Pa2: this thread's values of Pa read back and scaled (exact: a power of two).
        uint16_t pk[16];
#pragma unroll
        for (int n = 0; n < 8; n += 2)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t w;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w) : "r"(pa_u32 + p_off(n) + h * 8 * 128));
            pk[2 * n + h] = static_cast<uint16_t>(w);
            pk[2 * n + 2 + h] = static_cast<uint16_t>(w >> 16);
          }
        if (has_b) {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const float2 v2 = e4m3x2_float2(pk[i]);
            const float gi = (i & 1) ? g1 : g0;  // pk[2n] holds row r0, pk[2n + 1] row r1
            pk[i] = e4m3x2(v2.x * gi, v2.y * gi);
          }
        }
        store_pk(pk, pa2_u32);
      }
      bar_arrive(4);    // P(a) 2^(m0 - m1) ready for warpgroup 1
      wgmma_wait<0>();  // V_L(a)^T Pa
      fence_acc();
      fence_va();
      if (has_b) {
        l0 *= g0;
        l1 *= g1;
        u0 *= g0;
        u1 *= g1;
        // O^T's heads to m1: 2^(m0 - m1) per head (this pair's maxima of both warpgroups).
        float2 gh[8];
        bool any = false;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const float2 a0 = *reinterpret_cast<const float2*>(m_wg0 + 8 * n + 2 * tq);
          const float2 a1 = *reinterpret_cast<const float2*>(m_wg1 + 8 * n + 2 * tq);
          gh[n] = make_float2(pow2_step(a0.x, a1.x), pow2_step(a0.y, a1.y));
          any |= gh[n].x != 1.0f || gh[n].y != 1.0f;
        }
        if (__any_sync(0xffffffffu, any)) {
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int n = 0; n < 8; ++n) {
              acc[i][4 * n] *= gh[n].x;
              acc[i][4 * n + 1] *= gh[n].y;
              acc[i][4 * n + 2] *= gh[n].x;
              acc[i][4 * n + 3] *= gh[n].y;
            }
        }
      }
      if (has_b) {
        issue_pv(bt, pb_u32);
        release(bt, 0);  // S(b) completed before P(b) was published; V_L(b) is in registers
        wgmma_wait<0>();
        fence_acc();
        fence_va();
      }
    }
  } else {
    if (ntiles > 1) issue_s(I1{}, 1);
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1, par = j & 1;
      const bool has_b = bt < ntiles, next_b = bt + 2 < ntiles;
      float* const m_wg0 = sM + par * 2 * kM;
      float* const m_wg1 = m_wg0 + kM;
      float* const f_wg1 = sF + par * 2 * kM + kM;
      float x[32];
      float mx0 = -INFINITY, mx1 = -INFINITY;
      wgmma_wait<0>();  // S(b)
      if (has_b) load_s(bt, x, mx0, mx1);
      bar_sync(2);  // m0 of this pair
      const float n0 = ref_of(m_wg0[r0], mx0), n1 = ref_of(m_wg0[r1], mx1);
      const float f0 = pow2_step(m0, n0), f1 = pow2_step(m1, n1);
      m0 = n0;
      m1 = n1;
      l0 *= f0;
      l1 *= f1;
      u0 *= f0;
      u1 *= f1;
      if (tq == 0) {
        m_wg1[r0] = n0;
        m_wg1[r1] = n1;
        f_wg1[r0] = f0;
        f_wg1[r1] = f1;
      }
      if (has_b) {
        float rs0, rs1;
        exponentiate(x, n0, n1, rs0, rs1);
        l0 += rs0;
        l1 += rs1;
        uint16_t pk[16];
        float us0, us1;
        round_p(x, pk, us0, us1);
        u0 += us0;
        u1 += us1;
        store_pk(pk, pb_u32);
      }
      asm volatile("bar.sync 7, 128;\n" ::: "memory");  // warpgroup 1: m1, its factors and Pb stored
      if (has_b) bar_arrive(3);                         // m1 and P(b) ready for warpgroup 0
      fence_acc();
      rescale_heads(f_wg1);
      // V_R(b)^T Pb (when there is a b), then V_R(a)^T Pa2, from one call site.
#pragma unroll 1
      for (int u = has_b ? 0 : 1; u < 2; ++u) {
        if (u == 1) bar_sync(4);  // P(a) 2^(m0 - m1)
        const int t = u ? a : bt;
        issue_pv(t, u ? pa2_u32 : pb_u32);
        release(t, 1);  // V_R(t) is in registers (S(t) completed)
        wgmma_wait<0>();
        fence_acc();
        fence_va();
      }
      if (j + 1 < npairs) bar_arrive(5);  // Pa2 read
      if (next_b) issue_s(I1{}, bt + 2);
    }
  }

  // Row sums: this thread's partials, the quad's, then the two warpgroups' (same order in both).
  for (int o = 1; o < 4; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    u0 += __shfl_xor_sync(0xffffffffu, u0, o);
    u1 += __shfl_xor_sync(0xffffffffu, u1, o);
  }
  if (tq == 0) {
    sL[wg * kM + r0] = l0;
    sL[wg * kM + r1] = l1;
    sL[(2 + wg) * kM + r0] = u0;
    sL[(2 + wg) * kM + r1] = u1;
  }
  bar_sync(1);
  // The epilogue through shared memory (Q, the tiles and P, free now): O^T value (tile i, row
  // 16 wl + g + 8 h, head 8 n + 2 tq + c) is column 256 wg + 16 (4 wl + i) + 2 g + h of head row
  // 8 n + 2 tq + c; its two h values are adjacent columns.
  constexpr int kEb = SPLIT ? 4 : 2;
  constexpr int kRowBytes = kMlaRank * kEb;
  constexpr int kPitch = kRowBytes + 16;
  static_assert(kM * kPitch <= kOffM, "the staged output fits below the softmax state");
  float inv[16];
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int h = 8 * n + 2 * tq + c;
      inv[2 * n + c] = p.vscale / (sL[2 * kM + h] + sL[3 * kM + h]);
    }
  const int64_t base = out_row<SPLIT>(p, b, split, head0);
  if (wg == 0 && tq == 0) {
    if (r0 < hb) store_lse<SPLIT>(p, base + r0, row_lse(m0, sL[r0] + sL[kM + r0]));
    if (r1 < hb) store_lse<SPLIT>(p, base + r1, row_lse(m1, sL[r1] + sL[kM + r1]));
  }
  const uint32_t stage = q_u32;
  const int col0 = wg * 256 + 16 * 4 * wl + 2 * g;  // tile i adds 16 i
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 8 * n + 2 * tq + c;
        const float iv = inv[2 * n + c];
        const uint32_t a = stage + h * kPitch + (col0 + 16 * i) * kEb;
        const float v0 = acc[i][4 * n + c] * iv, v1 = acc[i][4 * n + c + 2] * iv;
        if constexpr (SPLIT)
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(v0), "f"(v1) : "memory");
        else
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(pack_bf16(v0, v1)) : "memory");
      }
  bar_sync(1);
  constexpr int kChunks = kRowBytes / 16;
  uint8_t* const dst = SPLIT ? reinterpret_cast<uint8_t*>(p.part_o + base * kMlaRank)
                             : reinterpret_cast<uint8_t*>(p.o + base * kMlaRank);
  for (int i = tid; i < hb * kChunks; i += 256) {
    const int row = i / kChunks, c = i % kChunks;
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage + row * kPitch + c * 16));
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * kRowBytes + c * 16) = v;
  }
#else
  __trap();  // built without sm_90a: launch_wgmma_seesaw_e4m3 is never chosen for such a build (see launch.cu)
#endif
}

template <bool SPLIT>
cudaError_t launch_kernel(const KParams& k, int batch, cudaStream_t stream, const CUtensorMap& map) {
  constexpr auto kernel = wgmma_seesaw_e4m3_kernel<SPLIT>;
  const cudaError_t attr = allow_dynamic_smem<kernel>(kSmem);
  if (attr != cudaSuccess) return attr;
  kernel<<<cta_grid(k, kM, batch), kThreads, kSmem, stream>>>(k, map);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_wgmma_seesaw_e4m3(const KParams& k, int batch, cudaStream_t stream) {
  // The raw entries as bytes, [128 x min(page, 64)] boxes with the 128-byte swizzle; the rope's
  // box runs 64 bytes past the entry, which the copy fills with zeros.
  CUtensorMap map{};
  if (!make_map(k, &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, k.cache, kMlaFp8Bytes, CU_TENSOR_MAP_SWIZZLE_128B, 128))
    return cudaErrorNotSupported;
  return k.splits > 1 ? launch_kernel<true>(k, batch, stream, map) : launch_kernel<false>(k, batch, stream, map);
}

}  // namespace kvferry::mla_detail
