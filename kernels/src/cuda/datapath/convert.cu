// CUDA kernels of the conversions 576 <-> 656 and bf16 <-> 656 on the direct, staged and bulk
// engines, and their launcher; CPU twin in cpu/convert_cpu.cpp (the fp4 kinds run there only).
// Shapes and measurements: kernels/DESIGN.md §2.3.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "common/datapath_math.h"
#include "common/mbarrier.cuh"
#include "cuda/datapath/engine_select.h"
#include "cuda/datapath/engines.cuh"
#include "cuda/datapath/primitives.cuh"
#include "kvferry/kernels/convert.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

using namespace detail;

// ---- entry operations only the conversions use (see primitives.cuh for the shared ones) ----

/// One 656 B entry as loaded for the conversion to 576 B: every lane 16 nope bytes and 2 rope
/// values, lanes 0-3 one tile scale each.
struct Ds8In {
  uint4 q = {};
  uint32_t scale = kOneF32Bits, rope = 0;
};
__device__ __forceinline__ Ds8In load_ds8(const uint8_t* src, int lane) {
  Ds8In in;
  in.q = ld_v16(src + 16 * lane);
  in.rope = *reinterpret_cast<const uint32_t*>(src + kMlaDsRopeOffset + 4 * lane);
  if (lane < 4) in.scale = *reinterpret_cast<const uint32_t*>(src + kMlaDsScaleOffset + 4 * lane);
  return in;
}
/// Both bf16 of `w` as e4m3 (low byte from the low half) and whether both are exact: the scalar
/// bf16_to_e4m3_exact for NaN/inf halves; otherwise the packed cvt, and exactness as "the e4m3
/// value read back (exactly, through f16) has the bits of the input float", which is what the
/// scalar round trip e4m3 -> bf16 == h means for finite input (e4m3 values are bf16-exact).
__device__ __forceinline__ uint32_t bf16x2_to_e4m3x2_exact(uint32_t w, bool& ok) {
  if ((w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u) {
    uint8_t a, b;
    ok &= bf16_to_e4m3_exact(static_cast<uint16_t>(w), &a);
    ok &= bf16_to_e4m3_exact(static_cast<uint16_t>(w >> 16), &b);
    return a | (static_cast<uint32_t>(b) << 8);
  }
  const float lo = bits_float(w << 16), hi = bits_float(w & 0xffff0000u);
  const uint32_t q = cvt_e4m3x2(lo, hi);
  const __half2_raw back = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(q), __NV_E4M3);
  ok &= float_bits(__half2float(__ushort_as_half(back.x))) == float_bits(lo) &&
        float_bits(__half2float(__ushort_as_half(back.y))) == float_bits(hi);
  return q;
}
/// -> 576 B; returns (to every lane) whether the entry was lossless.
__device__ __forceinline__ bool store_ds_as_fp8(const Ds8In& in, uint8_t* dst, int lane) {
  st_v16(dst + 16 * lane, in.q);
  bool ok = in.scale == kOneF32Bits;
  const uint32_t q = bf16x2_to_e4m3x2_exact(in.rope, ok);
  *reinterpret_cast<uint16_t*>(dst + kMlaRank + 2 * lane) = static_cast<uint16_t>(q);
  return __all_sync(kFull, ok);
}

/// One 576 B mla_fp8 entry as loaded for the conversion to 656 B: every lane 16 nope bytes and 2
/// rope bytes (the rope converted by all 32 lanes, one packed conversion each, rather than by 8
/// lanes x 8 values in a third round at a quarter of the warp: on an H200, 576 -> 656 on a layer
/// view 0.806 -> 0.825, and the fp8 -> bf16 gather's rope likewise 0.815 -> 0.865).
struct Fp8In {
  uint4 nope = {};
  uint32_t rope = 0;
};
/// src: a global or shared entry.
__device__ __forceinline__ Fp8In load_fp8(const uint8_t* src, int lane) {
  Fp8In in;
  in.nope = ld_v16(src + 16 * lane);
  in.rope = *reinterpret_cast<const uint16_t*>(src + kMlaRank + 2 * lane);
  return in;
}
/// -> 656 B: nope kept, scales 1.0, rope e4m3 -> bf16.
__device__ __forceinline__ void store_fp8_as_ds(const Fp8In& in, uint8_t* dst, int lane, const DqScale& one) {
  st_v16(dst + 16 * lane, in.nope);
  if (lane == 0) st_v16(dst + kMlaDsScaleOffset, make_uint4(kOneF32Bits, kOneF32Bits, kOneF32Bits, kOneF32Bits));
  *reinterpret_cast<uint32_t*>(dst + kMlaDsRopeOffset + 4 * lane) = dequant2<true>(in.rope, one);
}

// ---- direct engine ----

/// The stride S of an EntryWalk in its radix (computed by the launcher: kernel parameters cost no
/// registers).
struct WalkStep {
  uint32_t sl = 0, sb = 0, st = 0;
};

/// A warp's entries w0, w0 + S, w0 + 2 S, ... of a conversion, each as (layer l, block b, token t)
/// with w = (l * count + b) * bs + t: one mixed-radix addition of S per item instead of two
/// divisions per entry (on an H200 the divisions and their 64-bit checks were a third of the
/// bf16 -> 656 conversion's instructions, which bound its issue rate).
struct EntryWalk {
  // 32-bit (validate_convert keeps layers, count and the block size below 2^31); the block size,
  // count and S come from the parameters rather than registers: the walk's state lives across
  // the whole loop next to two pipelined items, and held fields spilled.
  uint32_t l = 0, b = 0, t = 0;  // the current entry
  __device__ __forceinline__ void init(int64_t w0, const Div& dbs, const Div& dcount) {
    int64_t q, r0, r1;
    divmod(w0, dbs, q, r0);
    t = static_cast<uint32_t>(r0);
    divmod(q, dcount, q, r1);
    b = static_cast<uint32_t>(r1);
    l = q < int64_t{1} << 31 ? static_cast<uint32_t>(q) : 0x80000000u;  // past every layer
  }
  /// Brings tt back below bs (with the carries) after at most bs was added to it.
  __device__ __forceinline__ static void carry(uint32_t& ll, uint32_t& bb, uint32_t& tt, uint32_t bs, uint32_t count) {
    if (tt >= bs) {
      tt -= bs;
      if (++bb == count) {
        bb = 0;
        ++ll;
      }
    }
  }
  __device__ __forceinline__ void next(const WalkStep& s, uint32_t bs, uint32_t count) {
    t += s.st;
    b += s.sb;
    if (t >= bs) {
      t -= bs;
      ++b;
    }
    if (b >= count) {
      b -= count;
      ++l;
    }
    l = l + s.sl < 0x80000000u ? l + s.sl : 0x80000000u;
  }
};

/// Entries per item of convert_kernel: one for bf16 -> 656 (issue-bound on its quantisation),
/// two for the others.
constexpr int convert_direct_entries(ConvertKind kind) { return kind == ConvertKind::kBf16ToDs ? 1 : 2; }

template <ConvertKind kKind>
__global__ void __launch_bounds__(kThreads, kKind == ConvertKind::kDsToFp8 || kKind == ConvertKind::kDsToBf16 ? 2
                                            : kKind == ConvertKind::kBf16ToDs                                 ? 4
                                                                                                              : 3)
    convert_kernel(const ConvertParams p, const WalkStep ws) {
  constexpr int kU = convert_direct_entries(kKind);
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.src.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t entries = p.layers * p.count * bs;
  const Div dcount = make_div(p.count);
  const int64_t items = (entries + kU - 1) / kU;
  const DqScale one = make_dq_scale(1.0f);
  struct Where {
    const uint8_t* src[kU];
    uint8_t* dst[kU];
    int64_t blk[kU];
  };
  using E = std::conditional_t<kKind == ConvertKind::kFp8ToDs, Fp8In,
                               std::conditional_t<kKind == ConvertKind::kDsToFp8, Ds8In,
                                                  std::conditional_t<kKind == ConvertKind::kBf16ToDs, Bf16In, DsIn>>>;
  struct In {
    E e[kU];
  };
  EntryWalk walk;
  walk.init(global_warp() * kU, dbs, dcount);
  pipeline(
      items,
      [&](int64_t) {  // pipeline calls it once per item of the warp's, in order, then past the end
        Where a;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          a.src[u] = nullptr;
          a.dst[u] = nullptr;
          a.blk[u] = 0;
          uint32_t l = walk.l, b = walk.b, t = walk.t + u;
          if (u > 0) EntryWalk::carry(l, b, t, static_cast<uint32_t>(bs), static_cast<uint32_t>(p.count));
          if (l >= p.layers) continue;
          const int64_t sb = p.src_blocks ? p.src_blocks[b] : b;
          const int64_t db = p.dst_blocks ? p.dst_blocks[b] : b;
          a.src[u] = p.src.entry(sb, t) + l * p.src_layer_stride;
          a.dst[u] = p.dst.entry(db, t) + l * p.dst_layer_stride;
          a.blk[u] = b;
        }
        walk.next(ws, static_cast<uint32_t>(p.src.view.sizes[1]), static_cast<uint32_t>(p.count));
        return a;
      },
      [&](int64_t, const Where& a) {
        In in;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!a.src[u]) continue;
          if constexpr (kKind == ConvertKind::kFp8ToDs)
            in.e[u] = load_fp8(a.src[u], lane);
          else if constexpr (kKind == ConvertKind::kDsToFp8)
            in.e[u] = load_ds8(a.src[u], lane);
          else if constexpr (kKind == ConvertKind::kBf16ToDs)
            in.e[u] = load_bf16(a.src[u], a.src[u] + kMlaRank * 2, lane);
          else
            in.e[u] = load_ds(a.src[u], lane);
        }
        return in;
      },
      [&](int64_t, const Where& a, const In& in) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!a.src[u]) continue;
          if constexpr (kKind == ConvertKind::kFp8ToDs) {
            store_fp8_as_ds(in.e[u], a.dst[u], lane, one);
          } else if constexpr (kKind == ConvertKind::kDsToFp8) {
            const bool ok = store_ds_as_fp8(in.e[u], a.dst[u], lane);
            if (!ok && lane == 0 && p.not_lossless) p.not_lossless[a.blk[u]] = 1;
          } else if constexpr (kKind == ConvertKind::kBf16ToDs) {
            store_bf16_as_ds<true>(in.e[u], a.dst[u], lane);
          } else {
            store_ds_as_bf16(in.e[u], a.dst[u], lane);
          }
        }
      });
}

// ---- staged engine ----

/// convert_entries(kind) entries per item, convert_ring(kind) stages. For 576 <-> 656 and
/// 656 -> bf16, 4 entries per item (2.3-2.6 KB of one block's entries) in a ring of 4-5 stages
/// (2 CTAs per SM, bounded by shared memory) against 2 entries and 4 stages (5 CTAs per SM): on an
/// H200, contiguous cache, 576 -> 656 0.818 -> 0.873 (5 stages; 0.836 with 4), 656 -> 576
/// 0.764 -> 0.876 (with one not_lossless store per item and block), 656 -> bf16 0.843 -> 0.868
/// (layer views 0.79 -> 0.81, 0.77 -> 0.83, 0.80 -> 0.82); 8 entries and 2 stages, or 4 and 3,
/// measured between the two, and 2 or 4 entries for bf16 -> 656 lower than 1 (0.725, 0.685).
constexpr int convert_entries(ConvertKind kind) { return kind == ConvertKind::kBf16ToDs ? 1 : 4; }
constexpr int convert_ring(ConvertKind kind) { return kind == ConvertKind::kFp8ToDs ? 5 : kStages; }

template <ConvertKind kKind>
__global__ void __launch_bounds__(kThreads) convert_staged_kernel(const ConvertParams p) {
  constexpr int kU = convert_entries(kKind);
  constexpr int kSt = convert_ring(kKind);
  constexpr int kSrc = kKind == ConvertKind::kFp8ToDs    ? kMlaFp8Bytes
                       : kKind == ConvertKind::kBf16ToDs ? kMlaDim * 2
                                                         : kMlaDsBytes;
  constexpr int kHdr = 16 * kU;  // destination pointer and block index per entry
  constexpr int kBytes = kHdr + kU * kSrc;
  __shared__ __align__(16) uint8_t ring[kWarps][kSt][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.src.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t entries = p.layers * p.count * bs;
  const Div dcount = make_div(p.count);
  const int64_t items = (entries + kU - 1) / kU;
  const DqScale one = make_dq_scale(1.0f);
  struct Where {
    const uint8_t* src[kU];
    uint8_t* dst[kU];
    int64_t blk[kU];
  };
  staged<kSt>(
      items,
      [&](int64_t i) {
        Where a;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          a.src[u] = nullptr;
          a.dst[u] = nullptr;
          a.blk[u] = 0;
          const int64_t w = i * kU + u;
          if (w >= entries) continue;
          int64_t q, t, l, b;
          divmod(w, dbs, q, t);
          divmod(q, dcount, l, b);
          const int64_t sb = p.src_blocks ? p.src_blocks[b] : b;
          const int64_t db = p.dst_blocks ? p.dst_blocks[b] : b;
          a.src[u] = p.src.entry(sb, t) + l * p.src_layer_stride;
          a.dst[u] = p.dst.entry(db, t) + l * p.dst_layer_stride;
          a.blk[u] = b;
        }
        return a;
      },
      [&](int64_t, int stage, const Where& a) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (lane == 0) {
            reinterpret_cast<uint8_t**>(st)[2 * u] = a.dst[u];
            reinterpret_cast<int64_t*>(st)[2 * u + 1] = a.blk[u];
          }
          if (a.src[u]) warp_cp16(st + kHdr + u * kSrc, a.src[u], kSrc / 16, lane);
        }
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        int64_t flagged = -1;  // the block this item last reported not lossless
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          uint8_t* dst = reinterpret_cast<uint8_t* const*>(st)[2 * u];
          if (!dst) continue;
          const uint8_t* e = st + kHdr + u * kSrc;
          if constexpr (kKind == ConvertKind::kFp8ToDs) {
            store_fp8_as_ds(load_fp8(e, lane), dst, lane, one);
          } else if constexpr (kKind == ConvertKind::kDsToFp8) {
            const Ds8In in = load_ds8(e, lane);
            // One not_lossless store per item and block, not per entry: the flags of the blocks in
            // flight share a few L2 lines, which every warp's stores met (0.756 -> 0.814 of the
            // D2D copy with 2 entries per item, before the 4-entry items).
            const bool ok = store_ds_as_fp8(in, dst, lane);
            const int64_t b = reinterpret_cast<const int64_t*>(st)[2 * u + 1];
            if (!ok && b != flagged) {
              if (lane == 0 && p.not_lossless) p.not_lossless[b] = 1;
              flagged = b;
            }
          } else if constexpr (kKind == ConvertKind::kBf16ToDs) {
            store_bf16_as_ds<true>(load_bf16(e, e + kMlaRank * 2, lane), dst, lane);
          } else {
            store_ds_as_bf16(load_ds(e, lane), dst, lane);
          }
        }
      });
}

// ---- bulk engine ----

// Conversions on the bulk engine: a unit is kConvUnit consecutive entries of one (layer, block),
// whose source bytes are one contiguous range and come in one bulk copy. The warps convert its
// entries (kStrided: warp w entries w, w + kW, ...; else a run of consecutive ones each) and store
// them: kStore: into the warp's shared-memory buffer (two, alternating) and then with one bulk
// copy (the destination's entries are contiguous too), else directly.
constexpr int conv_src_bytes(ConvertKind kind) {
  return kind == ConvertKind::kFp8ToDs ? kMlaFp8Bytes : kind == ConvertKind::kBf16ToDs ? kMlaDim * 2 : kMlaDsBytes;
}
constexpr int conv_dst_bytes(ConvertKind kind) {
  return kind == ConvertKind::kDsToFp8 ? kMlaFp8Bytes : kind == ConvertKind::kDsToBf16 ? kMlaDim * 2 : kMlaDsBytes;
}
/// Dynamic shared memory of convert_bulk_kernel: the input ring, the output stages, the barriers.
constexpr int conv_bulk_smem(ConvertKind kind, bool store, int unit, int stages, int warps) {
  return stages * unit * conv_src_bytes(kind) +
         (store ? 2 * warps * ((unit + warps - 1) / warps) * conv_dst_bytes(kind) : 0) + 8 * 2 * stages;
}

__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#else
  __trap();
#endif
}

template <ConvertKind kKind, bool kStore, int kConvUnit, int kSt, bool kStrided = false, int kW = kWarps>
__global__ void __launch_bounds__(kW * 32, 2) convert_bulk_kernel(const ConvertParams p, bool ranges) {
  static_assert(!(kStore && kStrided), "a warp's bulk store needs its entries consecutive");
  constexpr int kSrc = conv_src_bytes(kKind), kDst = conv_dst_bytes(kKind);
  constexpr int kStage = kConvUnit * kSrc;
  constexpr int kPer = (kConvUnit + kW - 1) / kW;  // entries per warp and unit
  constexpr int kOut = kPer * kDst;                // a warp's output buffer
  extern __shared__ __align__(128) uint8_t smem[];
  auto* ring = reinterpret_cast<uint8_t(*)[kStage]>(smem);
  uint8_t* const out = smem + kSt * kStage;  // kStore: 2 buffers of kOut per warp
  auto* bars = reinterpret_cast<uint64_t*>(out + (kStore ? 2 * kW * kOut : 0));
  const int64_t bs = p.src.view.sizes[1];
  const int64_t chunks = (bs + kConvUnit - 1) / kConvUnit;  // units per (layer, block)
  const Div dchunks = make_div(chunks), dcount = make_div(p.count);
  const int64_t units = p.layers * p.count * chunks;
  const DqScale one = make_dq_scale(1.0f);
  const int64_t dstep = p.dst.view.strides[1] * dtype_size(p.dst.view.dtype);
  struct Unit {
    int64_t l, b, t0;
    int count;
  };
  auto locate = [&](int64_t u) {
    Unit w;
    int64_t q, c;
    divmod(u, dchunks, q, c);
    divmod(q, dcount, w.l, w.b);
    w.t0 = c * kConvUnit;
    w.count = static_cast<int>(bs - w.t0 < kConvUnit ? bs - w.t0 : kConvUnit);
    return w;
  };
  bulk_units<kStage, kSt>(
      units, ring, bars,
      [&](int64_t u, uint32_t st, uint32_t bar, int lane) {
        if (lane != 0) return;
        const Unit w = locate(u);
        const int64_t sb = p.src_blocks ? p.src_blocks[w.b] : w.b;
        const uint32_t bytes = static_cast<uint32_t>(w.count * kSrc);
        mbar_expect_tx(bar, bytes);
        ptx::bulk_g2s(st, p.src.entry(sb, w.t0) + w.l * p.src_layer_stride, bytes, bar);
      },
      [&](int64_t u, int64_t k, const uint8_t* st, int warp, int lane) {
        const Unit w = locate(u);
        // The warp's entries: [e0, e1) of the unit, consecutive in the destination too; kStrided:
        // e0, e0 + 8, ... instead.
        const int e0 = kStrided ? warp : warp * kPer;
        const int e1 = kStrided ? w.count : (e0 + kPer < w.count ? e0 + kPer : w.count);
        // kStore: every unit is whole (the launcher takes the bulk engine only for block sizes
        // that are multiples of the unit), so each warp stores at every unit and its buffers
        // alternate with its bulk groups; a warp skipping a unit would break wait_group.read 1.
        if (e0 >= e1) return;
        const int64_t db = p.dst_blocks ? p.dst_blocks[w.b] : w.b;
        uint8_t* const dst0 = p.dst.entry(db, w.t0 + e0) + w.l * p.dst_layer_stride;
        uint8_t* const ob = out + (2 * warp + static_cast<int>(k & 1)) * kOut;
        if constexpr (kStore) {
          // This buffer's previous store (two of the warp's stores ago) must have read it.
          if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
          __syncwarp();
        }
        bool lossless = true;
        for (int e = e0; e < e1; e += kStrided ? kW : 1) {
          const uint8_t* src = st + e * kSrc;
          uint8_t* dst = kStore ? ob + (e - e0) * kDst : dst0 + (e - e0) * dstep;  // dst0: entry e0
          if constexpr (kKind == ConvertKind::kFp8ToDs) {
            store_fp8_as_ds(load_fp8(src, lane), dst, lane, one);
          } else if constexpr (kKind == ConvertKind::kDsToFp8) {
            lossless &= store_ds_as_fp8(load_ds8(src, lane), dst, lane);
          } else if constexpr (kKind == ConvertKind::kBf16ToDs) {
            store_bf16_as_ds<true>(load_bf16(src, src + kMlaRank * 2, lane), dst, lane);
          } else {
            store_ds_as_bf16(load_ds(src, lane), dst, lane);
          }
        }
        if constexpr (kKind == ConvertKind::kDsToFp8) {
          if (!lossless && lane == 0 && p.not_lossless) p.not_lossless[w.b] = 1;
        }
        if constexpr (kStore) {
          // The bulk copy reads the buffer through the async proxy: fence the warp's writes first.
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          __syncwarp();
          if (lane == 0) bulk_store(dst0, smem_addr(ob), static_cast<uint32_t>((e1 - e0) * kDst));
        }
      },
      ranges);
  if (kStore && (threadIdx.x & 31) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/// Launches bulk-engine kernel kK over `units` units (one per CTA and trip) with `smem` bytes of
/// dynamic shared memory: at most one wave of the CTAs that fit. The shared-memory opt-in and the
/// occupancy belong to a device, so they are kept per device (0: not yet known; devices past 15
/// ask every time). use_bulk has checked that `smem` fits the device.
template <auto kK, class P, class... A>
cudaError_t go_bulk(const P& p, int64_t units, int smem, cudaStream_t stream, int threads, A... args) {
  static std::atomic<int> per_sm_of[16];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  int per_sm = dev >= 0 && dev < 16 ? per_sm_of[dev].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    e = cudaFuncSetAttribute(kK, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kK, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kK, threads, smem);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return e;
    }
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    if (dev >= 0 && dev < 16) per_sm_of[dev].store(per_sm, std::memory_order_relaxed);
  }
  kK<<<one_wave(units, per_sm), threads, smem, stream>>>(p, args...);
  return cudaGetLastError();
}

/// go() for the direct conversion kernels, which also take their EntryWalk stride: the grid's
/// warps times `per_warp` entries, in the radix (block size, count).
template <auto kK>
cudaError_t go_walk(const ConvertParams& p, int64_t items, int64_t per_warp, cudaStream_t stream) {
  const unsigned grid = grid_for<kK>(items, per_warp);
  const int64_t s = static_cast<int64_t>(grid) * kWarps * per_warp, bs = p.src.view.sizes[1];
  WalkStep ws;
  ws.st = static_cast<uint32_t>(s % bs);
  ws.sb = static_cast<uint32_t>(s / bs % p.count);
  const int64_t sl = s / bs / p.count;
  ws.sl = sl < (int64_t{1} << 31) ? static_cast<uint32_t>(sl) : 0x80000000u;
  kK<<<grid, kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

/// Kind kKind on the direct engine, or with `staged` on the staged one, over `n` entries.
template <ConvertKind kKind>
cudaError_t go_convert(const ConvertParams& p, int64_t n, bool staged, cudaStream_t stream) {
  return staged ? go<convert_staged_kernel<kKind>>(p, n, convert_entries(kKind), stream)
                : go_walk<convert_kernel<kKind>>(p, n, convert_direct_entries(kKind), stream);
}

/// Kind kKind on the bulk engine: units of kUnit entries, kSt stages, kW warps per CTA, stored by
/// bulk copies with kStore, warp w taking entries w, w + kW, ... with kStrided (convert_bulk_kernel).
template <ConvertKind kKind, bool kStore, int kUnit, int kSt, bool kStrided, int kW = kWarps>
cudaError_t go_convert_bulk(const ConvertParams& p, bool ranges, cudaStream_t stream) {
  const int64_t units = p.layers * p.count * (p.src.view.sizes[1] / kUnit);
  return go_bulk<convert_bulk_kernel<kKind, kStore, kUnit, kSt, kStrided, kW>>(
      p, units, conv_bulk_smem(kKind, kStore, kUnit, kSt, kW), stream, kW * 32, ranges);
}

}  // namespace

cudaError_t launch_convert(const ConvertParams& p, cudaStream_t stream) {
  const int64_t n = p.layers * p.count * p.src.view.sizes[1];
  if (n == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, p.kind != ConvertKind::kBf16ToDs);
  // The bulk engine where both sides' entries are contiguous within a block (16-byte aligned
  // ranges) and the block size is a multiple of the unit; unit and ring per kind as measured
  // fastest on an H200 (kernels/DESIGN.md §2.3): whole blocks of 64 entries in two
  // stages, stored by bulk copies for 576 <-> 656 and by the warps for 656 -> bf16; for bf16 ->
  // 656 (issue-bound) 32 entries in three stages (16 in six for smaller blocks) and 16 warps per
  // CTA, each taking every sixteenth entry. For blocks of 16 or 32 entries the others stay
  // staged: with units of 16 entries the bulk engine measured as fast or slower there.
  auto contiguous = [](const CacheRef& c, int64_t entry_bytes, int64_t layer_stride) {
    const int64_t eb = dtype_size(c.view.dtype);
    return c.view.strides[1] * eb == entry_bytes && aligned(c.entry(0, 0), 16) && (c.view.strides[0] * eb) % 16 == 0 &&
           layer_stride % 16 == 0;
  };
  const ConvertKind kind = p.kind;
  const int64_t bs = p.src.view.sizes[1];
  // (use_bulk's shared memory: the largest ring of the four, 576 -> 656's with its store buffers.)
  if (kind <= ConvertKind::kDsToBf16 && bs % (kind == ConvertKind::kBf16ToDs ? 16 : 64) == 0 &&
      use_bulk(p.engine, true, conv_bulk_smem(ConvertKind::kFp8ToDs, true, 64, 2, kWarps),
               reinterpret_cast<const void*>(&convert_bulk_kernel<ConvertKind::kFp8ToDs, true, 64, 2>)) &&
      contiguous(p.src, conv_src_bytes(kind), p.src_layer_stride) &&
      contiguous(p.dst, conv_dst_bytes(kind), p.dst_layer_stride)) {
    // Unit order: for a whole view whose blocks lie apart (a layer view of a block-major buffer,
    // no block list), one range of consecutive units per CTA; otherwise grid-stride, so the grid
    // sweeps a contiguous cache in order: ranges gain a little on layer views read in order and
    // lose on contiguous caches and on shuffled lists (kernels/DESIGN.md §2.3).
    // ConvertParams::unit_order forces one.
    auto apart = [bs](const CacheRef& c, int64_t entry_bytes) {
      return c.view.strides[0] * dtype_size(c.view.dtype) != bs * entry_bytes;
    };
    const bool ranges = p.unit_order != ConvertUnitOrder::kAuto
                            ? p.unit_order == ConvertUnitOrder::kRanges
                            : !p.src_blocks && !p.dst_blocks &&
                                  (apart(p.src, conv_src_bytes(kind)) || apart(p.dst, conv_dst_bytes(kind)));
    switch (kind) {
      case ConvertKind::kFp8ToDs: return go_convert_bulk<ConvertKind::kFp8ToDs, true, 64, 2, false>(p, ranges, stream);
      case ConvertKind::kDsToFp8: return go_convert_bulk<ConvertKind::kDsToFp8, true, 64, 2, false>(p, ranges, stream);
      case ConvertKind::kBf16ToDs:
        return bs % 32 == 0 ? go_convert_bulk<ConvertKind::kBf16ToDs, false, 32, 3, true, 16>(p, ranges, stream)
                            : go_convert_bulk<ConvertKind::kBf16ToDs, false, 16, 6, true, 16>(p, ranges, stream);
      case ConvertKind::kDsToBf16:
        return go_convert_bulk<ConvertKind::kDsToBf16, false, 64, 2, false>(p, ranges, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (p.kind) {
    case ConvertKind::kFp8ToDs: return go_convert<ConvertKind::kFp8ToDs>(p, n, sg, stream);
    case ConvertKind::kDsToFp8: return go_convert<ConvertKind::kDsToFp8>(p, n, sg, stream);
    case ConvertKind::kBf16ToDs: return go_convert<ConvertKind::kBf16ToDs>(p, n, sg, stream);
    case ConvertKind::kDsToBf16: return go_convert<ConvertKind::kDsToBf16>(p, n, sg, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvferry::kernels
