// CUDA kernels of the gathers (copy, fp8 and 656 B dequantisation) and dequant_paged on the direct
// and staged engines, and their launchers; CPU twins in cpu/gather_cpu.cpp. Shapes and
// measurements: kernels/DESIGN.md §2.4.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/datapath_math.h"
#include "cuda/datapath/engine_select.h"
#include "cuda/datapath/engines.cuh"
#include "cuda/datapath/primitives.cuh"
#include "kvferry/kernels/gather.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

using namespace detail;

// ---- direct engine ----

// ---- gathers ----

__device__ __forceinline__ int64_t find_request(const int32_t* cu, int64_t batch, int64_t j) {
  int64_t lo = 0, hi = batch;  // cu[lo] <= j < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (cu[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/// Entry addresses of the kR rows from j0 (null past the end): one binary search, then the
/// block-table loads.
template <int kR>
struct Rows {
  const uint8_t* src[kR];
};
template <int kR>
__device__ __forceinline__ Rows<kR> locate_rows(const GatherParams& p, const Div& dbs, int64_t j0) {
  Rows<kR> out;
#pragma unroll
  for (int u = 0; u < kR; ++u) out.src[u] = nullptr;
  if (j0 >= p.total_rows) return out;
  int64_t r = find_request(p.cu_seq_lens, p.batch, j0);
  int64_t tok[kR], col[kR], req[kR];
#pragma unroll
  for (int u = 0; u < kR; ++u) {
    tok[u] = col[u] = 0;
    req[u] = r;
    const int64_t j = j0 + u;
    if (j >= p.total_rows) continue;
    while (p.cu_seq_lens[r + 1] <= j) ++r;
    req[u] = r;
    const int64_t pos = j - p.cu_seq_lens[r] + (p.seq_starts ? p.seq_starts[r] : 0);
    divmod(pos, dbs, col[u], tok[u]);
  }
#pragma unroll
  for (int u = 0; u < kR; ++u)
    if (j0 + u < p.total_rows)
      out.src[u] = p.cache.entry(p.block_table[req[u] * p.block_table_stride + col[u]], tok[u]);
  return out;
}

/// Raw copy (16-byte vectors) and fp8 -> bf16: an item is kR consecutive rows x up to 96 vectors
/// of each (rows longer than that take several items).
template <GatherMode kMode>
__global__ void __launch_bounds__(kThreads, 2) gather_kernel(const GatherParams p) {
  constexpr int kR = kMode == GatherMode::kCopy ? 2 : 4;  // rows per item
  using Vec = std::conditional_t<kMode == GatherMode::kCopy, uint4, uint2>;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = kMode == GatherMode::kCopy ? v.sizes[2] * eb / 16 : v.sizes[2] / 8;  // vectors per row
  const int64_t chunks = (n + 95) / 96;
  const int64_t dst_row = p.dst_stride * (kMode == GatherMode::kCopy ? eb : 2);
  const int64_t items = (p.total_rows + kR - 1) / kR * chunks;
  const DqScale dq = make_dq_scale(p.scale);
  struct In {
    Vec x[kR][3];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i / chunks * kR : p.total_rows); },
      [&](int64_t i, const Rows<kR>& r) {
        In in;
        const int64_t k0 = i % chunks * 96;
#pragma unroll
        for (int u = 0; u < kR; ++u)
#pragma unroll
          for (int c = 0; c < 3; ++c) {
            const int64_t k = k0 + lane + 32 * c;
            in.x[u][c] = Vec{};
            if (r.src[u] && k < n) in.x[u][c] = *reinterpret_cast<const Vec*>(r.src[u] + sizeof(Vec) * k);
          }
        return in;
      },
      [&](int64_t i, const Rows<kR>& r, const In& in) {
        const int64_t j0 = i / chunks * kR, k0 = i % chunks * 96;
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + j0 * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u)
#pragma unroll
          for (int c = 0; c < 3; ++c) {
            const int64_t k = k0 + lane + 32 * c;
            if (!r.src[u] || k >= n) continue;
            if constexpr (kMode == GatherMode::kCopy)
              st_v16(out + u * dst_row + 16 * k, in.x[u][c]);
            else
              st_v16(out + u * dst_row + 16 * k, dequant8(in.x[u][c], dq));
          }
      });
}

/// fp8 -> bf16 rows of 576 entries (mla_fp8), 2 rows per item, laid out like the 656 B gather so
/// every warp-wide store is 512 contiguous bytes: lane l takes values [8l, 8l + 8) and
/// [256 + 8l, 256 + 8l + 8), and rope values 2l, 2l + 1. (The generic row loop spends a quarter
/// of its third access idle on 72-vector rows and holds 118 registers.)
__global__ void __launch_bounds__(kThreads, 3) gather_fp8_576_kernel(const GatherParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  const DqScale dq = make_dq_scale(p.scale);
  struct In {
    uint2 a[kR], b[kR];
    uint32_t r[kR];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, const Rows<kR>& rows) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          in.a[u] = in.b[u] = uint2{};
          in.r[u] = 0;
          if (!rows.src[u]) continue;
          in.a[u] = ld_v8(rows.src[u] + 8 * lane);
          in.b[u] = ld_v8(rows.src[u] + 256 + 8 * lane);
          in.r[u] = *reinterpret_cast<const uint16_t*>(rows.src[u] + kMlaRank + 2 * lane);
        }
        return in;
      },
      [&](int64_t i, const Rows<kR>& rows, const In& in) {
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + i * kR * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!rows.src[u]) continue;
          uint8_t* const o = out + u * dst_row;
          st_v16(o + 16 * lane, dequant8(in.a[u], dq));
          st_v16(o + 512 + 16 * lane, dequant8(in.b[u], dq));
          *reinterpret_cast<uint32_t*>(o + kMlaRank * 2 + 4 * lane) = dequant2(in.r[u], dq);
        }
      });
}

/// 656 B -> bf16 rows, kR rows per item.
__global__ void __launch_bounds__(kThreads, 3) gather_ds_kernel(const GatherParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  struct In {
    DsIn e[kR];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, const Rows<kR>& r) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) in.e[u] = load_ds(r.src[u], lane);
        return in;
      },
      [&](int64_t i, const Rows<kR>& r, const In& in) {
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + i * kR * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) store_ds_as_bf16(in.e[u], out + u * dst_row, lane);
      });
}

/// Raw copy of rows not 16-byte aligned (kVec-byte accesses), kR rows per warp and trip.
template <int kVec>
__global__ void __launch_bounds__(kThreads) gather_copy_narrow_kernel(const GatherParams p) {
  constexpr int kR = 4;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = v.sizes[2] * eb / kVec;
  const int64_t dst_row = p.dst_stride * eb;
  for (int64_t j0 = global_warp() * kR; j0 < p.total_rows; j0 += total_warps() * kR) {
    const Rows<kR> r = locate_rows<kR>(p, dbs, j0);
    uint8_t* const out = static_cast<uint8_t*>(p.dst) + j0 * dst_row;
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      const uint8_t* s = r.src[u];
      if (!s) continue;
      uint8_t* dst = out + u * dst_row;
      for (int64_t k = lane; k < n; k += 32) {
        if constexpr (kVec == 4)
          reinterpret_cast<uint32_t*>(dst)[k] = reinterpret_cast<const uint32_t*>(s)[k];
        else if constexpr (kVec == 2)
          reinterpret_cast<uint16_t*>(dst)[k] = reinterpret_cast<const uint16_t*>(s)[k];
        else
          dst[k] = s[k];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 3) dequant_paged_kernel(const DequantPagedParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1], limit = p.cache.view.sizes[0] * bs;
  const Div dbs = make_div(bs);
  const int64_t items = (p.count + kR - 1) / kR;
  struct In {
    DsIn e[kR];
  };
  pipeline(
      items, [&](int64_t i) { return load_slots<kR>(p.slots, i * kR, p.count); },
      [&](int64_t, const Slots<kR, int32_t>& sl) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!slot_ok(sl.s[u], limit)) continue;
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          in.e[u] = load_ds(p.cache.entry(blk, off), lane);
        }
        return in;
      },
      [&](int64_t i, const Slots<kR, int32_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (slot_ok(sl.s[u], limit))
            store_ds_as_bf16(in.e[u], static_cast<uint8_t*>(p.dst) + (i * kR + u) * p.dst_stride * 2, lane);
      });
}

// ---- staged engine ----

/// Raw copy (16-byte vectors) and fp8 -> bf16 (8-byte vectors) gathers: an item is one row's run of
/// up to 72 vectors.
template <GatherMode kMode>
__global__ void __launch_bounds__(kThreads) gather_staged_kernel(const GatherParams p) {
  constexpr int kVec = kMode == GatherMode::kCopy ? 16 : 8;
  constexpr int kBytes = 72 * kVec;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = kMode == GatherMode::kCopy ? v.sizes[2] * eb / 16 : v.sizes[2] / 8;  // vectors per row
  const int64_t chunks = (n + 71) / 72;
  const int64_t dst_row = p.dst_stride * (kMode == GatherMode::kCopy ? eb : 2);
  const int64_t items = p.total_rows * chunks;
  const DqScale dq = make_dq_scale(p.scale);
  staged(
      items, [&](int64_t i) { return locate_rows<1>(p, dbs, i < items ? i / chunks : p.total_rows); },
      [&](int64_t i, int stage, const Rows<1>& r) {
        uint8_t* st = ring_stage(ring, stage);
        if (!r.src[0]) return;
        const int64_t k0 = i % chunks * 72;
        const int64_t m = n - k0 < 72 ? n - k0 : 72;
        for (int k = lane; k < m; k += 32) {
          if constexpr (kMode == GatherMode::kCopy)
            cp16(st + 16 * k, r.src[0] + 16 * (k0 + k));
          else
            cp8(st + 8 * k, r.src[0] + 8 * (k0 + k));
        }
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t j = i / chunks, k0 = i % chunks * 72;
        const int64_t m = n - k0 < 72 ? n - k0 : 72;
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + j * dst_row + 16 * k0;
        for (int k = lane; k < m; k += 32) {
          if constexpr (kMode == GatherMode::kCopy)
            st_v16(out + 16 * k, lds16(st + 16 * k));
          else
            st_v16(out + 16 * k, dequant8(lds8(st + 8 * k), dq));
        }
      });
}

/// 656 B -> bf16 rows, 2 rows per item.
__global__ void __launch_bounds__(kThreads) gather_ds_staged_kernel(const GatherParams p) {
  constexpr int kR = 2;
  constexpr int kBytes = kR * kMlaDsBytes;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  staged(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, int stage, const Rows<kR>& r) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) warp_cp16(st + u * kMlaDsBytes, r.src[u], kMlaDsBytes / 16, lane);
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (i * kR + u >= p.total_rows) continue;
          store_ds_as_bf16(load_ds(st + u * kMlaDsBytes, lane), static_cast<uint8_t*>(p.dst) + (i * kR + u) * dst_row,
                           lane);
        }
      });
}

__global__ void __launch_bounds__(kThreads) dequant_paged_staged_kernel(const DequantPagedParams p) {
  constexpr int kR = 2;
  constexpr int kBytes = 16 + kR * kMlaDsBytes;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1], limit = p.cache.view.sizes[0] * bs;
  const Div dbs = make_div(bs);
  const int64_t items = (p.count + kR - 1) / kR;
  staged(
      items, [&](int64_t i) { return load_slots<kR>(p.slots, i * kR, p.count); },
      [&](int64_t, int stage, const Slots<kR, int32_t>& sl) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (lane == 0) reinterpret_cast<int64_t*>(st)[u] = sl.s[u];
          if (!slot_ok(sl.s[u], limit)) continue;
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          warp_cp16(st + 16 + u * kMlaDsBytes, p.cache.entry(blk, off), kMlaDsBytes / 16, lane);
        }
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!slot_ok(reinterpret_cast<const int64_t*>(st)[u], limit)) continue;
          store_ds_as_bf16(load_ds(st + 16 + u * kMlaDsBytes, lane),
                           static_cast<uint8_t*>(p.dst) + (i * kR + u) * p.dst_stride * 2, lane);
        }
      });
}

}  // namespace

cudaError_t launch_gather(const GatherParams& p, cudaStream_t stream) {
  if (p.total_rows == 0) return cudaSuccess;
  const int64_t n = p.total_rows;
  const bool sg = use_staged(p.engine, false);
  switch (p.mode) {
    case GatherMode::kCopy: {
      const TensorView& v = p.cache.view;
      const int64_t eb = dtype_size(v.dtype);
      const int64_t row = v.sizes[2] * eb;
      const uint8_t* first = static_cast<const uint8_t*>(p.cache.base) + v.offset;
      auto fits = [&](int64_t a) {
        return row % a == 0 && (v.strides[0] * eb) % a == 0 && (v.strides[1] * eb) % a == 0 && aligned(first, a) &&
               aligned(p.dst, a) && (p.dst_stride * eb) % a == 0;
      };
      if (fits(16))
        return sg ? go<gather_staged_kernel<GatherMode::kCopy>>(p, n, 1, stream)
                  : go<gather_kernel<GatherMode::kCopy>>(p, n, 2, stream);
      if (fits(4)) return go<gather_copy_narrow_kernel<4>>(p, n, 4, stream);
      if (fits(2)) return go<gather_copy_narrow_kernel<2>>(p, n, 4, stream);
      return go<gather_copy_narrow_kernel<1>>(p, n, 4, stream);
    }
    case GatherMode::kDequantFp8:
      if (!sg && p.cache.view.sizes[2] == kMlaDim) return go<gather_fp8_576_kernel>(p, n, 2, stream);
      return sg ? go<gather_staged_kernel<GatherMode::kDequantFp8>>(p, n, 1, stream)
                : go<gather_kernel<GatherMode::kDequantFp8>>(p, n, 4, stream);
    case GatherMode::kDequantDs:
      return sg ? go<gather_ds_staged_kernel>(p, n, 2, stream) : go<gather_ds_kernel>(p, n, 2, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_dequant_paged(const DequantPagedParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  return use_staged(p.engine, false) ? go<dequant_paged_staged_kernel>(p, p.count, 2, stream)
                                     : go<dequant_paged_kernel>(p, p.count, 2, stream);
}

}  // namespace kvferry::kernels
