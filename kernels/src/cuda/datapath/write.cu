// CUDA kernels of the cache writers (write_mla, write_mha, indexer_write) on the direct and staged
// engines, and their launchers; CPU twins in cpu/write_cpu.cpp. Shapes and measurements:
// kernels/DESIGN.md §2.2.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/datapath_math.h"
#include "cuda/datapath/engine_select.h"
#include "cuda/datapath/engines.cuh"
#include "cuda/datapath/primitives.cuh"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

using namespace detail;

// ---- direct engine ----

// ---- write_mla ----

template <MlaWriteMode kMode, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, kMode == MlaWriteMode::kCopy ? 2 : 3)
    write_mla_kernel(const WriteMlaParams p) {
  constexpr int kU = kMode == MlaWriteMode::kCopy ? 2 : 1;  // tokens per item
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const QDiv rc = make_qdiv(p.scale);
  const int64_t items = (p.tokens + kU - 1) / kU;
  struct In {
    uint4 v[kU][3];
  };
  pipeline(
      items, [&](int64_t i) { return load_slots<kU>(p.slots, i * kU, p.tokens); },
      [&](int64_t i, const Slots<kU, int64_t>&) {
        In in;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          in.v[u][0] = in.v[u][1] = in.v[u][2] = uint4{};
          const int64_t n = i * kU + u;
          if (n >= p.tokens) continue;
          const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
          const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
          if constexpr (kMode == MlaWriteMode::kFp8Ds) {
            const Bf16In b = load_bf16(nope, rope, lane);
            in.v[u][0] = b.a;
            in.v[u][1] = b.b;
            in.v[u][2] = b.rope;
          } else {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
              const int g = lane + 32 * k;
              if (g < 72) in.v[u][k] = g < 64 ? ld_v16(nope + 16 * g) : ld_v16(rope + 16 * (g - 64));
            }
          }
        }
        return in;
      },
      [&](int64_t, const Slots<kU, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!slot_ok(sl.s[u], limit)) continue;  // uniform over the warp
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          uint8_t* dst = p.cache.entry(blk, off);
          if constexpr (kMode == MlaWriteMode::kFp8Ds) {
            Bf16In b;
            b.a = in.v[u][0];
            b.b = in.v[u][1];
            b.rope = in.v[u][2];
            store_bf16_as_ds<false>(b, dst, lane);
          } else {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
              const int g = lane + 32 * k;
              if (g >= 72) continue;
              if constexpr (kMode == MlaWriteMode::kCopy) {
                st_v16(dst + 16 * g, in.v[u][k]);
              } else {
                float x[8];
                to_floats<kBf16>(in.v[u][k], x);
                st_v8(dst + 8 * g, quant8(x, rc));
              }
            }
          }
        }
      });
}

// ---- write_mha: an item is one token's K and V over 32 * kG 16-byte groups per plane ----

template <bool kFp8, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, 2) write_mha_kernel(const WriteMhaParams p) {
  // 16-byte groups per lane and plane in flight: 4, one item per token at 8 x 128 (fp8 with 2,
  // two items per token: 0.819 of the D2D copy against 0.866 with 4 on an H200, contiguous cache).
  constexpr int kG = 4;
  const int lane = threadIdx.x & 31;
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.sizes[1], h = kv.sizes[2], d = kv.sizes[3];
  const Div dbs = make_div(bs);
  const int64_t limit = kv.sizes[0] * bs;
  const int64_t gpd = d / 8, groups = h * gpd;
  const int64_t chunks = (groups + 32 * kG - 1) / (32 * kG);
  const Div dchunks = make_div(chunks), dgpd = make_div(gpd);
  const int64_t eb = kFp8 ? 1 : 2;
  const QDiv rk = make_qdiv(p.k_scale), rv = make_qdiv(p.v_scale);
  const int64_t hsk = p.k_cache.view.strides[2] * eb, hsv = p.v_cache.view.strides[2] * eb;
  const int64_t items = p.tokens * chunks;
  struct In {
    uint4 a[kG], b[kG];
  };
  pipeline(
      items,
      [&](int64_t i) {
        int64_t n = 0, c = 0;
        if (i < items) divmod(i, dchunks, n, c);
        return i < items ? p.slots[n] : int64_t{-1};
      },
      [&](int64_t i, int64_t) {
        In in = {};
        if (i >= items) return in;
        int64_t n, c;
        divmod(i, dchunks, n, c);
        const uint8_t* sk = static_cast<const uint8_t*>(p.key) + n * p.key_stride * 2;
        const uint8_t* sv = static_cast<const uint8_t*>(p.value) + n * p.value_stride * 2;
#pragma unroll
        for (int k = 0; k < kG; ++k) {
          const int64_t g = c * 32 * kG + lane + 32 * k;
          if (g < groups) {
            in.a[k] = ld_v16(sk + 16 * g);
            in.b[k] = ld_v16(sv + 16 * g);
          }
        }
        return in;
      },
      [&](int64_t i, int64_t s, const In& in) {
        if (!slot_ok(s, limit)) return;
        int64_t n, c, blk, off;
        divmod(i, dchunks, n, c);
        divmod(s, dbs, blk, off);
        uint8_t* ek = p.k_cache.entry(blk, off);
        uint8_t* ev = p.v_cache.entry(blk, off);
#pragma unroll
        for (int k = 0; k < kG; ++k) {
          const int64_t g = c * 32 * kG + lane + 32 * k;
          if (g >= groups) continue;
          int64_t hh, kg;
          divmod(g, dgpd, hh, kg);
          uint8_t* dk = ek + hh * hsk + kg * 8 * eb;
          uint8_t* dv = ev + hh * hsv + kg * 8 * eb;
          if constexpr (!kFp8) {
            st_v16(dk, in.a[k]);
            st_v16(dv, in.b[k]);
          } else {
            float x[8];
            to_floats<kBf16>(in.a[k], x);
            st_v8_once(dk, quant8(x, rk));
            to_floats<kBf16>(in.b[k], x);
            st_v8_once(dv, quant8(x, rv));
          }
        }
      });
}

// ---- indexer ----

/// The slots of an indexer item's rows: row u * kPer + sub of item i (item of kOps * kPer rows),
/// -1 past the end.
template <int kOps, int kPer>
__device__ __forceinline__ Slots<kOps, int64_t> indexer_slots(const IndexerWriteParams& p, int64_t i, int sub) {
  Slots<kOps, int64_t> o;
#pragma unroll
  for (int u = 0; u < kOps; ++u) {
    const int64_t n = i * (kOps * kPer) + u * kPer + sub;
    o.s[u] = n < p.tokens ? p.slots[n] : -1;
  }
  return o;
}

/// The indexer for rows that are not 16-byte aligned: 8-byte loads, 32 lanes per 128-value row,
/// kRows rows per item.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, 3) indexer_write_narrow_kernel(const IndexerWriteParams p) {
  constexpr int kVec = 8;                             // bytes per load
  constexpr int kLanes = 2 * kIndexerHeadDim / kVec;  // lanes per row
  constexpr int kPer = 32 / kLanes;                   // rows per warp-wide access
  constexpr int kE = kVec / 2;                        // values per lane
  constexpr int kOps = 2;                             // accesses per lane and item
  constexpr int kRows = kOps * kPer;                  // rows per item
  const int lane = threadIdx.x & 31, hl = lane % kLanes, sub = lane / kLanes;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const uint8_t* const k = static_cast<const uint8_t*>(p.k);
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  struct In {
    uint2 raw[kOps];
  };
  pipeline(
      items, [&](int64_t i) { return indexer_slots<kOps, kPer>(p, i, sub); },
      [&](int64_t i, const Slots<kOps, int64_t>&) {
        In in;
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          const int64_t n = i * kRows + u * kPer + sub;
          in.raw[u] = uint2{};
          if (n < p.tokens) in.raw[u] = ld_v8(k + n * row_bytes + kVec * hl);
        }
        return in;
      },
      [&](int64_t, const Slots<kOps, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          uint16_t hv[kE];
          memcpy(hv, &in.raw[u], kVec);
          float x[kE];
          float amax = 0.0f;
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            x[e] = half_bits_to_float<kBf16>(hv[e]);
            amax = fmax_f(amax, abs_f(x[e]));
          }
#pragma unroll
          for (int m = kLanes / 2; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (slot_ok(sl.s[u], limit)) {
            const float sc = indexer_scale_fast(amax, p.ue8m0);
            const QDiv r = make_qdiv(sc);
            const bool pow2 = p.ue8m0 && is_pow2_scale(sc);
            int64_t blk, off;
            divmod(sl.s[u], dbs, blk, off);
            uint8_t* block = p.cache.entry(blk, 0);
            uint8_t* vals = block + off * kIndexerHeadDim + kE * hl;
            *reinterpret_cast<uint32_t*>(vals) = pow2 ? quant4<Quot::kPow2>(x, r) : quant4(x, r);
            if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
          }
        }
      });
}

/// The indexer for 16-byte aligned rows: 8 lanes per 128-value row (each two 16-byte runs 64
/// values apart, so 8 lanes read and write one contiguous run of the row), 4 rows per warp-wide
/// access, 8 rows per item. Twice the values per lane of a 16-lane layout halve the per-row
/// work (maximum, scale, reciprocal, slot division) per value, which bound that kernel's issue rate.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, kBf16 ? 3 : 2) indexer_write_wide_kernel(const IndexerWriteParams p) {
  constexpr int kOps = 2, kRows = 4 * kOps;
  const int lane = threadIdx.x & 31, hl = lane & 7, sub = lane >> 3;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const uint8_t* const k = static_cast<const uint8_t*>(p.k);
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  struct In {
    uint4 a[kOps], b[kOps];
  };
  pipeline(
      items, [&](int64_t i) { return indexer_slots<kOps, 4>(p, i, sub); },
      [&](int64_t i, const Slots<kOps, int64_t>& sl) {
        In in;
        // A run: the item's rows go to consecutive slots (a prefill's); those read plainly, the
        // others evict-first (see ld_v16_once).
        const int64_t s0 = __shfl_sync(kFull, sl.s[0], 0);
        bool run = s0 >= 0;
#pragma unroll
        for (int u = 0; u < kOps; ++u) run &= sl.s[u] == s0 + 4 * u + sub;
        run = __all_sync(kFull, run);
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          const int64_t n = i * kRows + 4 * u + sub;
          in.a[u] = in.b[u] = uint4{};
          if (n >= p.tokens) continue;
          const uint8_t* const row = k + n * row_bytes + 16 * hl;
          if (run) {
            in.a[u] = ld_v16(row);
            in.b[u] = ld_v16(row + 128);
          } else {
            in.a[u] = ld_v16_once(row);
            in.b[u] = ld_v16_once(row + 128);
          }
        }
        return in;
      },
      [&](int64_t, const Slots<kOps, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          float x[16];
          to_floats<kBf16>(in.a[u], x);
          to_floats<kBf16>(in.b[u], x + 8);
          float amax = 0.0f;
          bool nan = false;  // a NaN among this lane's 16 values
          if constexpr (kBf16) {
            // The magnitudes' largest bits by integer maxima of the bf16 pairs: a NaN sorts above
            // the infinity, so one comparison finds it (and only then the NaN-ignoring maximum).
            const uint32_t mb = bf16_mag16_bits(in.a[u], in.b[u]);
            nan = mb > 0x7f80u;
            amax = nan ? bf16_amax16(in.a[u], in.b[u]) : __uint_as_float(mb << 16);
          } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) amax = fmax_f(amax, abs_f(x[e]));
            nan = f16_has_nan16(in.a[u], in.b[u]);
          }
#pragma unroll
          for (int m = 4; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (!slot_ok(sl.s[u], limit)) continue;
          const float sc = indexer_scale_fast(amax, p.ue8m0);
          const bool pow2 = p.ue8m0 && is_pow2_scale(sc);
          QDiv r;
          if (pow2) {  // the exact reciprocal of a power of two, without the division
            r.s = sc;
            r.y = bits_float(((254u - ((float_bits(sc) >> 23) & 0xffu)) << 23));
            r.fast = true;
          } else {
            r = make_qdiv(sc);
          }
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          uint8_t* block = p.cache.entry(blk, 0);
          uint8_t* vals = block + off * kIndexerHeadDim + 8 * hl;
          if (pow2 && !nan) {
            st_v8_once(vals, quant8_pow2(x, r.y));
            st_v8_once(vals + 64, quant8_pow2(x + 8, r.y));
          } else {
            st_v8_once(vals, pow2 ? quant8<Quot::kPow2>(x, r) : quant8(x, r));
            st_v8_once(vals + 64, pow2 ? quant8<Quot::kPow2>(x + 8, r) : quant8(x + 8, r));
          }
          // The scale keeps the normal policy: its line is shared by the block's other rows.
          if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
        }
      });
}

// ---- staged engine ----

// write_mla: one token per item; stage = slot (16 B header), then 1024 B nope + 128 B rope.
template <MlaWriteMode kMode, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) write_mla_staged_kernel(const WriteMlaParams p) {
  constexpr int kBytes = 16 + 1152;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const QDiv rc = make_qdiv(p.scale);
  staged(
      p.tokens, [](int64_t) { return NoIndex{}; },
      [&](int64_t n, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (n >= p.tokens) return;
        const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
        const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
        warp_cp16(st + 16, nope, 64, lane);
        if (lane < 8) cp16(st + 16 + 1024 + 16 * lane, rope + 16 * lane);
        if (lane == 8) cp8(st, p.slots + n);
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t s = *reinterpret_cast<const int64_t*>(st);
        if (!slot_ok(s, limit)) return;
        int64_t blk, off;
        divmod(s, dbs, blk, off);
        uint8_t* dst = p.cache.entry(blk, off);
        const uint8_t* d = st + 16;
        if constexpr (kMode == MlaWriteMode::kFp8Ds) {
          store_bf16_as_ds<false>(load_bf16(d, d + 1024, lane), dst, lane);
        } else {
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const int g = lane + 32 * k;
            if (g >= 72) continue;
            if constexpr (kMode == MlaWriteMode::kCopy) {
              st_v16(dst + 16 * g, lds16(d + 16 * g));
            } else {
              float x[8];
              to_floats<kBf16>(lds16(d + 16 * g), x);
              st_v8(dst + 8 * g, quant8(x, rc));
            }
          }
        }
      });
}

// write_mha: an item is one token's 32 16-byte groups of K and of V; stage = slot, K, V.
template <bool kFp8, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) write_mha_staged_kernel(const WriteMhaParams p) {
  constexpr int kBytes = 16 + 1024;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.sizes[1], h = kv.sizes[2], d = kv.sizes[3];
  const Div dbs = make_div(bs);
  const int64_t limit = kv.sizes[0] * bs;
  const int64_t gpd = d / 8, groups = h * gpd;
  const int64_t chunks = (groups + 31) / 32;
  const Div dchunks = make_div(chunks), dgpd = make_div(gpd);
  const int64_t eb = kFp8 ? 1 : 2;
  const QDiv rk = make_qdiv(p.k_scale), rv = make_qdiv(p.v_scale);
  const int64_t hsk = p.k_cache.view.strides[2] * eb, hsv = p.v_cache.view.strides[2] * eb;
  const int64_t items = p.tokens * chunks;
  staged(
      items, [](int64_t) { return NoIndex{}; },
      [&](int64_t i, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (i >= items) return;
        int64_t n, c;
        divmod(i, dchunks, n, c);
        const int64_t g = c * 32 + lane;
        if (g < groups) {
          cp16(st + 16 + 16 * lane, static_cast<const uint8_t*>(p.key) + n * p.key_stride * 2 + 16 * g);
          cp16(st + 16 + 512 + 16 * lane, static_cast<const uint8_t*>(p.value) + n * p.value_stride * 2 + 16 * g);
        }
        if (lane == 0) cp8(st, p.slots + n);
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t s = *reinterpret_cast<const int64_t*>(st);
        if (!slot_ok(s, limit)) return;
        int64_t n, c, blk, off, hh, kg;
        divmod(i, dchunks, n, c);
        const int64_t g = c * 32 + lane;
        if (g >= groups) return;
        divmod(s, dbs, blk, off);
        divmod(g, dgpd, hh, kg);
        uint8_t* dk = p.k_cache.entry(blk, off) + hh * hsk + kg * 8 * eb;
        uint8_t* dv = p.v_cache.entry(blk, off) + hh * hsv + kg * 8 * eb;
        const uint4 a = lds16(st + 16 + 16 * lane), b = lds16(st + 16 + 512 + 16 * lane);
        if constexpr (!kFp8) {
          st_v16(dk, a);
          st_v16(dv, b);
        } else {
          float x[8];
          to_floats<kBf16>(a, x);
          st_v8(dk, quant8(x, rk));
          to_floats<kBf16>(b, x);
          st_v8(dv, quant8(x, rv));
        }
      });
}

// indexer (16-byte aligned rows): 4 rows per item; stage = 4 slots, then 4 x 256 B.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) indexer_write_staged_kernel(const IndexerWriteParams p) {
  constexpr int kRows = 4;
  constexpr int kBytes = 32 + kRows * 256;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31, hl = lane & 15, sub = lane >> 4;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  staged(
      items, [](int64_t) { return NoIndex{}; },
      [&](int64_t i, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (i >= items) return;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int r = 2 * k + sub;
          const int64_t n = i * kRows + r;
          if (n < p.tokens)
            cp16(st + 32 + 256 * r + 16 * hl, static_cast<const uint8_t*>(p.k) + n * row_bytes + 16 * hl);
        }
        if (lane < kRows) {
          const int64_t n = i * kRows + lane;
          if (n < p.tokens)
            cp8(st + 8 * lane, p.slots + n);
          else
            *reinterpret_cast<int64_t*>(st + 8 * lane) = -1;
        }
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int r = 2 * k + sub;
          const int64_t s = reinterpret_cast<const int64_t*>(st)[r];
          const H8 hv = unpack(lds16(st + 32 + 256 * r + 16 * hl));
          float x[8];
          float amax = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            x[e] = half_bits_to_float<kBf16>(hv.h[e]);
            amax = fmax_f(amax, abs_f(x[e]));
          }
#pragma unroll
          for (int m = 8; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (slot_ok(s, limit)) {
            const float sc = indexer_scale_fast(amax, p.ue8m0);
            const QDiv r = make_qdiv(sc);
            int64_t blk, off;
            divmod(s, dbs, blk, off);
            uint8_t* block = p.cache.entry(blk, 0);
            st_v8(block + off * kIndexerHeadDim + 8 * hl,
                  p.ue8m0 && is_pow2_scale(sc) ? quant8<Quot::kPow2>(x, r) : quant8(x, r));
            if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
          }
        }
      });
}

}  // namespace

cudaError_t launch_write_mla(const WriteMlaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, false);
  const bool bf16 = p.input_dtype == DType::kBF16;
  switch (p.mode) {
    case MlaWriteMode::kCopy:
      return sg ? go<write_mla_staged_kernel<MlaWriteMode::kCopy>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<MlaWriteMode::kCopy>>(p, p.tokens, 2, stream);
    case MlaWriteMode::kFp8:
      if (!bf16)
        return sg ? go<write_mla_staged_kernel<MlaWriteMode::kFp8, false>>(p, p.tokens, 1, stream)
                  : go<write_mla_kernel<MlaWriteMode::kFp8, false>>(p, p.tokens, 1, stream);
      return sg ? go<write_mla_staged_kernel<MlaWriteMode::kFp8>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<MlaWriteMode::kFp8>>(p, p.tokens, 1, stream);
    case MlaWriteMode::kFp8Ds:
      // Three CTAs per SM where four fit. With random slots each 656 B entry shares a sector with a
      // neighbour written at another time; since the quotient takes one correction (quot_ds), a
      // fourth CTA's stores in flight cost more than its warps gain (kernels/DESIGN.md §2.2).
      return sg ? go<write_mla_staged_kernel<MlaWriteMode::kFp8Ds>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<MlaWriteMode::kFp8Ds>>(p, p.tokens, 1, stream, 3);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_write_mha(const WriteMhaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, false);
  if (p.k_cache.view.dtype == DType::kFP8E4M3) {
    if (p.input_dtype != DType::kBF16)
      return sg ? go<write_mha_staged_kernel<true, false>>(p, p.tokens, 1, stream)
                : go<write_mha_kernel<true, false>>(p, p.tokens, 1, stream);
    return sg ? go<write_mha_staged_kernel<true>>(p, p.tokens, 1, stream)
              : go<write_mha_kernel<true>>(p, p.tokens, 1, stream);
  }
  return sg ? go<write_mha_staged_kernel<false>>(p, p.tokens, 1, stream)
            : go<write_mha_kernel<false>>(p, p.tokens, 1, stream);
}

cudaError_t launch_indexer_write(const IndexerWriteParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool bf16 = p.input_dtype == DType::kBF16;
  if (!aligned(p.k, 16) || (p.k_stride * 2) % 16 != 0)
    return bf16 ? go<indexer_write_narrow_kernel<true>>(p, p.tokens, 2, stream)
                : go<indexer_write_narrow_kernel<false>>(p, p.tokens, 2, stream);
  if (!bf16)
    return use_staged(p.engine, false) ? go<indexer_write_staged_kernel<false>>(p, p.tokens, 4, stream)
                                       : go<indexer_write_wide_kernel<false>>(p, p.tokens, 8, stream);
  return use_staged(p.engine, false) ? go<indexer_write_staged_kernel<true>>(p, p.tokens, 4, stream)
                                     : go<indexer_write_wide_kernel<true>>(p, p.tokens, 8, stream);
}

}  // namespace kvferry::kernels
