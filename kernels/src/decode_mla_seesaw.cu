// Hopper MLA decode split kernel for bf16 caches (contract in decode_mla.h): warpgroup MMA with a
// "seesaw" schedule over 64-token tiles.
//
// One CTA per (64 heads, split, request); fewer heads are padded to 64 rows (zero Q rows, never
// written out). Q (64 x 576 bf16) and two K tiles (64 tokens x 576) live in shared memory as nine
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
// so one warpgroup's softmax runs while the other's products keep the tensor cores busy, and a
// tile's depth is read once per 64 tokens (the S exchange of a depth-split schedule is gone). A
// 64-token tile halves the Q bytes the tensor cores read per token against 32-token tiles.
//
// A producer warpgroup (56 registers via setmaxnreg; the math warpgroups get 224) copies each tile
// with cp.async straight into the swizzled layout, one column block at a time, publishing each on
// its own mbarrier, so S starts on the first block that landed. A tile's blocks are released in two
// parts: V_L and the rope block (also P(b)'s place) by warpgroup 0 once its products read them, V_R
// by warpgroup 1. S visits the blocks in the order they are freed (even tiles: V_L, rope, V_R; odd
// tiles: V_R, V_L, rope) and the producer refills them in that order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "decode_mla_internal.h"
#include "decode_mla_ptx.cuh"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry::mla_detail {
namespace {

constexpr int kN = 64;                      // tokens per K tile
constexpr int kM = 64;                      // head rows per CTA (the wgmma M)
constexpr int kCb = kMlaDim / 64;           // column blocks of 64 bf16 = one 128-byte row (9)
constexpr int kCbBytes = 64 * 128;          // one column block of Q or of a tile (64 rows)
constexpr int kTileBytes = kCb * kCbBytes;  // 73728, Q alike
constexpr int kPBytes = kM * kN * 2;        // P (64 x 64 bf16, one swizzled column block)
constexpr int kThreads = 3 * 128;
constexpr int kRope = 8;  // column block of the rope part

// Shared memory after 1024-byte alignment: Q, two tiles, P(a), row maxima of the two warpgroups,
// row sums, 22 mbarriers.
constexpr int kOffK = kTileBytes;
constexpr int kOffP = 3 * kTileBytes;
constexpr int kOffM = kOffP + kPBytes;     // float [2][64]
constexpr int kOffL = kOffM + 2 * kM * 4;  // float [2][64]
constexpr int kOffBar = kOffL + 2 * kM * 4;
constexpr int kBars = 2 * kCb + 4;  // full[buf][cb], emptyA[buf], emptyB[buf]
constexpr int kSmem = 1024 + kOffBar + kBars * 8;
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

constexpr uint32_t kDescHi = (1024 >> 4) | (1u << 30);  // sbo 1024, 128-byte swizzle (bit 62)
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo) {
  return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ uint64_t desc(uint32_t lo) { return (static_cast<uint64_t>(kDescHi) << 32) | lo; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }

#define KF_F8(x, i)                                                                                               \
  "+f"(x[i + 0]), "+f"(x[i + 1]), "+f"(x[i + 2]), "+f"(x[i + 3]), "+f"(x[i + 4]), "+f"(x[i + 5]), "+f"(x[i + 6]), \
      "+f"(x[i + 7])
#define KF_F32(x, i) KF_F8(x, i), KF_F8(x, i + 8), KF_F8(x, i + 16), KF_F8(x, i + 24)

// d (64 x 64 fp32) = [d +] A (64 x 16, K-major smem) * B (64 x 16, K-major smem)^T.
__device__ __forceinline__ void wgmma_s(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KF_F32(d, 0)
      : "l"(da), "l"(db), "r"(accumulate));
}

#define KF_PV_D                                                                  \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                      \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"             \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"             \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"             \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"             \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"             \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"

// d (64 x 256 fp32) += A (64 x 16 bf16, registers) * B (16 x 256, N-major smem).
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " KF_PV_D
               ", {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
               : KF_F32(d, 0), KF_F32(d, 32), KF_F32(d, 64), KF_F32(d, 96)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// d (64 x 256 fp32) += A (64 x 16 bf16, K-major smem) * B (16 x 256, N-major smem).
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " KF_PV_D ", %128, %129, 1, 1, 1, 0, 1;\n"
               : KF_F32(d, 0), KF_F32(d, 32), KF_F32(d, 64), KF_F32(d, 96)
               : "l"(da), "l"(db));
}
#undef KF_PV_D
#undef KF_F32
#undef KF_F8

template <bool SPLIT>
__global__ void __launch_bounds__(kThreads, 1) decode_mla_seesaw_kernel(const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_dyn[];
  // The swizzle pattern repeats every 1024 bytes of the shared address: align the tiles to it.
  uint8_t* smem = smem_dyn + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023);
  const uint32_t q_u32 = smem_u32(smem), k_u32 = q_u32 + kOffK, p_u32 = q_u32 + kOffP;
  float* sM = reinterpret_cast<float*>(smem + kOffM);  // [warpgroup][row]: m0 (WG0), m1 (WG1)
  float* sL = reinterpret_cast<float*>(smem + kOffL);  // [warpgroup][row]: final row sums
  const uint32_t bars = q_u32 + kOffBar;
  auto full_bar = [&](int buf, int cb) { return bars + 8 * (buf * kCb + cb); };
  auto empty_bar = [&](int buf, int part) { return bars + 8 * (2 * kCb + buf * 2 + part); };

  const int hb = min(p.heads, kM);
  const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup index broadcast from lane 0, so the compiler knows it is warp-uniform.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wl = warp & 3, g = lane >> 2, tq = lane & 3;
  const int2 range = split_tokens<kN>(p, b, split);
  const int start = range.x, end = range.y;
  const int head0 = hg * hb;
  if (start >= end) {  // nothing to attend to: an empty split, or a request of length 0
    write_empty_split<SPLIT, kThreads>(p, b, split, head0, hb, tid);
    return;
  }
  const int ntiles = (end - start + kN - 1) / kN;

  if (tid == 0) {
    for (int i = 0; i < 2 * kCb; ++i) mbar_init(bars + 8 * i, 64);  // each thread of a producer pair
    for (int i = 0; i < 4; ++i) mbar_init(empty_bar(i >> 1, i & 1), 4);  // lane 0 of the releasing warpgroup's warps
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 2) {
    // Producer: warps 8-9 fill the even tiles' buffer, warps 10-11 the odd tiles'. Thread pt of a
    // pair copies chunk pt % 8 of rows pt / 8 + 8 k (k < 8) of every column block, so a warp's
    // copies cover whole 128-byte row segments. Each thread's copies of a block arrive on the
    // block's full barrier when they land (cp.async.mbarrier.arrive.noinc): the producer never
    // waits for its own copies, it blocks only on a part's release, and every free byte of its
    // buffer is in flight.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int odd = (warp - 8) >> 1, pt = tid & 63, c = pt & 7, r0 = pt >> 3;
    const int32_t* table = p.table + static_cast<int64_t>(b) * p.table_stride;
    // Byte offsets of this thread's rows of tile t from the cache base, -1 past the end.
    auto row_offsets = [&](int t, int64_t (&off)[8]) {
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
    fence_proxy_async();
    bar_sync(1);
  }

  float s[32];
  const uint32_t q_lo = desc_lo(q_u32, 16), k_lo = desc_lo(k_u32, 16);
  // Issues S(t) = Q K(t)^T over the whole depth, block by block as the producer publishes them.
  auto issue_s = [&](auto odd_c, int t) {
    constexpr int ODD = decltype(odd_c)::value;
    const int buf = t & 1;
    const uint32_t par = (t >> 1) & 1;
    const uint32_t tile_lo = k_lo + buf * (kTileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < kCb; ++i) {
      const int cb = visit(ODD, i);
      mbar_wait(full_bar(buf, cb), par);
      fence_proxy_async();  // the block's cp.async writes (generic proxy) before the wgmma reads
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t off = (cb * kCbBytes + kk * 32) >> 4;
        wgmma_s(s, desc(q_lo + off), desc(tile_lo + off), i > 0 || kk > 0);
      }
    }
    wgmma_commit();
  };

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
  auto load_s = [&](int t, float (&x)[32], float& mx0, float& mx1) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("mov.b32 %0, %1;\n" : "=f"(x[i]) : "f"(s[i]));
    const bool last = t == ntiles - 1;
    const int tok0 = start + t * kN;
    mx0 = -INFINITY;
    mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[4 * n + e] *= p.scale_log2;
        if (last && tok0 + n * 8 + tq * 2 + (e & 1) >= end) x[4 * n + e] = -INFINITY;
      }
      mx0 = fmaxf(mx0, fmaxf(x[4 * n], x[4 * n + 1]));
      mx1 = fmaxf(mx1, fmaxf(x[4 * n + 2], x[4 * n + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  };
  // x <- exp2(x - max) in place; returns the row sums of this thread's values.
  auto exponentiate = [&](float (&x)[32], float nm0, float nm1, float& rs0, float& rs1) {
    rs0 = 0.0f;
    rs1 = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      x[4 * n] = fast_exp2(x[4 * n] - nm0);
      x[4 * n + 1] = fast_exp2(x[4 * n + 1] - nm0);
      x[4 * n + 2] = fast_exp2(x[4 * n + 2] - nm1);
      x[4 * n + 3] = fast_exp2(x[4 * n + 3] - nm1);
      rs0 += x[4 * n] + x[4 * n + 1];
      rs1 += x[4 * n + 2] + x[4 * n + 3];
    }
  };
  auto pack_pa = [&](const float (&x)[32]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pa[i][0] = pack_bf16(x[8 * i], x[8 * i + 1]);
      pa[i][1] = pack_bf16(x[8 * i + 2], x[8 * i + 3]);
      pa[i][2] = pack_bf16(x[8 * i + 4], x[8 * i + 5]);
      pa[i][3] = pack_bf16(x[8 * i + 6], x[8 * i + 7]);
    }
  };
  // P (times f0 / f1 per row) as bf16 into a swizzled [64 rows x 64 tokens] K-major block at `dst`.
  auto store_p = [&](const float (&x)[32], float f0, float f1, uint32_t dst) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const uint32_t a0 = dst + r0 * 128 + (((n ^ g) << 4) | (tq << 2));
      const uint32_t a1 = a0 + 8 * 128;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"(pack_bf16(x[4 * n] * f0, x[4 * n + 1] * f0)) : "memory");
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(pack_bf16(x[4 * n + 2] * f1, x[4 * n + 3] * f1))
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
    for (int ks = 0; ks < 4; ++ks) wgmma_pv_rs(acc, pa[ks], desc(vt + ((ks * 16 * 128) >> 4)));
    wgmma_commit();
  };
  auto issue_pv_ss = [&](int t, uint32_t p_addr) {
    const uint32_t vt = v_lo + (t & 1) * (kTileBytes >> 4), pl = desc_lo(p_addr, 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_pv_ss(acc, desc(pl + ((ks * 32) >> 4)), desc(vt + ((ks * 16 * 128) >> 4)));
    wgmma_commit();
  };
  auto release = [&](int t, int part) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar(t & 1, part));
  };

  const int npairs = (ntiles + 1) / 2;
  float x[32];
  if (wg == 0) {
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1;
      const bool has_b = bt < ntiles;
      issue_s(std::integral_constant<int, 0>{}, a);
      wgmma_wait<0>();
      float mx0, mx1;
      load_s(a, x, mx0, mx1);
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);  // finite: every tile has a valid token
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
      issue_pv_rs(a);
      float g0 = 1.0f, g1 = 1.0f;  // e^(m0 - m1)
      if (has_b) {
        bar_sync(3);  // m1 and P(b) ready
        const float q0 = sM[kM + r0], q1 = sM[kM + r1];
        g0 = fast_exp2(m0 - q0);
        g1 = fast_exp2(m1 - q1);
        m0 = q0;
        m1 = q1;
      }
      wgmma_wait<0>();  // P.V_L(a) read V_L(a) and pa
      fence_regs(acc);
      fence_pa();
      release(a, 0);
      if (j > 0) bar_sync(5);  // warpgroup 1's P.V_R of the previous pair read P
      store_p(x, g0, g1, p_u32);
      bar_arrive(4);  // P(a) ready for warpgroup 1
      if (has_b) {
        l0 *= g0;
        l1 *= g1;
        rescale(g0, g1);
        issue_pv_ss(bt, k_u32 + (bt & 1) * kTileBytes + kRope * kCbBytes);
        wgmma_wait<0>();
        fence_regs(acc);
        release(bt, 0);
      }
    }
  } else {
    for (int j = 0; j < npairs; ++j) {
      const int a = 2 * j, bt = a + 1;
      const bool has_b = bt < ntiles;
      float mx0 = -INFINITY, mx1 = -INFINITY;
      if (has_b) {
        issue_s(std::integral_constant<int, 1>{}, bt);
        wgmma_wait<0>();
        load_s(bt, x, mx0, mx1);
      }
      bar_sync(2);  // m0 of this pair
      const float q0 = sM[r0], q1 = sM[r1];
      const float n0 = fmaxf(q0, mx0), n1 = fmaxf(q1, mx1);
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
        store_p(x, 1.0f, 1.0f, k_u32 + (bt & 1) * kTileBytes + kRope * kCbBytes);  // over the rope block S read
        bar_arrive(3);  // m1 and P(b) ready for warpgroup 0
        pack_pa(x);
        issue_pv_rs(bt);
      }
      bar_sync(4);  // P(a) scaled to m1
      issue_pv_ss(a, p_u32);
      if (has_b) {
        wgmma_wait<1>();  // P.V_R(b)
        fence_pa();
        release(bt, 1);
      }
      wgmma_wait<0>();  // P.V_R(a) read V_R(a) and P
      fence_regs(acc);
      release(a, 1);
      if (j + 1 < npairs) bar_arrive(5);
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
  const float inv0 = p.vscale / l0, inv1 = p.vscale / l1;
  constexpr float kLn2 = 0.6931471805599453f;
  const float lse0 = (m0 + log2f(l0)) * kLn2, lse1 = (m1 + log2f(l1)) * kLn2;
  const int col0 = wg * 256 + tq * 2;
  const int64_t base = out_row<SPLIT>(p, b, split, head0);
  if (r0 < hb) {
#pragma unroll
    for (int n = 0; n < 32; ++n) store_o2<SPLIT>(p, base + r0, col0 + n * 8, acc[4 * n] * inv0, acc[4 * n + 1] * inv0);
    if (wg == 0 && tq == 0) store_lse<SPLIT>(p, base + r0, lse0);
  }
  if (r1 < hb) {
#pragma unroll
    for (int n = 0; n < 32; ++n)
      store_o2<SPLIT>(p, base + r1, col0 + n * 8, acc[4 * n + 2] * inv1, acc[4 * n + 3] * inv1);
    if (wg == 0 && tq == 0) store_lse<SPLIT>(p, base + r1, lse1);
  }
#else
  __trap();  // built without sm_90a: launch_seesaw is never chosen for such a build (see decode_mla.cu)
#endif
}

template <bool SPLIT>
cudaError_t launch_one(const KParams& k, int batch, cudaStream_t stream) {
  const dim3 grid(k.heads > kM ? k.heads / kM : 1, k.splits, batch);
  static const cudaError_t attr =
      cudaFuncSetAttribute(decode_mla_seesaw_kernel<SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) {
    (void)cudaGetLastError();  // not left for the next launch's check
    return attr;
  }
  decode_mla_seesaw_kernel<SPLIT><<<grid, kThreads, kSmem, stream>>>(k);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_seesaw(const KParams& k, int batch, cudaStream_t stream) {
  return k.splits > 1 ? launch_one<true>(k, batch, stream) : launch_one<false>(k, batch, stream);
}

}  // namespace kvferry::mla_detail
