// CUDA kernels of the data path: cache writers, gathers, format conversions, indexer writer.
// One warp per token entry, 16-byte vector accesses; every entry addressed through the view's
// strides in 64-bit (CacheRef::entry). The scalar math is the CPU twins' (common/datapath_math.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/datapath_math.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/gather.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint4 ld_v16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void st_v16(uint8_t* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ uint2 ld_v8(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ void st_v8(uint8_t* p, uint2 v) { *reinterpret_cast<uint2*>(p) = v; }

struct H8 {
  uint16_t h[8];
};
__device__ __forceinline__ H8 unpack(uint4 v) {
  H8 r;
  memcpy(r.h, &v, 16);
  return r;
}
__device__ __forceinline__ uint4 pack16(const uint16_t* h) {
  uint4 v;
  memcpy(&v, h, 16);
  return v;
}
__device__ __forceinline__ uint2 pack8(const uint8_t* b) {
  uint2 v;
  memcpy(&v, b, 8);
  return v;
}

/// q = a / b, r = a % b for a >= 0, b > 0: 32-bit division when both fit (64-bit division is a
/// long software sequence that would dominate these memory-bound kernels).
__device__ __forceinline__ void divmod(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if (((a | b) >> 32) == 0) {
    const uint32_t q32 = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    q = q32;
    r = a - static_cast<int64_t>(q32) * b;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ int64_t total_warps() { return (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5; }

unsigned grid_for(int64_t items) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t want = (items + kWarps - 1) / kWarps;
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

// ---- warp-cooperative entry operations (lane in [0, 32)) ----

/// 512 bf16 nope at `nope` and 64 bf16 rope at `rope` -> one 656 B entry.
__device__ __forceinline__ void warp_bf16_to_ds(const uint8_t* nope, const uint8_t* rope, uint8_t* dst, int lane) {
  const H8 a = unpack(ld_v16(nope + 32 * lane));
  const H8 b = unpack(ld_v16(nope + 32 * lane + 16));
  float x[16];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    x[k] = bf16_to_float(a.h[k]);
    x[8 + k] = bf16_to_float(b.h[k]);
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) amax = fmax_f(amax, abs_f(x[k]));
#pragma unroll
  for (int m = 4; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
  const float sc = ds_tile_scale(amax);
  uint8_t q[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) q[k] = quant_e4m3(x[k], sc);
  uint4 qv;
  memcpy(&qv, q, 16);
  st_v16(dst + 16 * lane, qv);
  if ((lane & 7) == 0) *reinterpret_cast<float*>(dst + kMlaDsScaleOffset + 4 * (lane >> 3)) = sc;
  if (lane < 8) st_v16(dst + kMlaDsRopeOffset + 16 * lane, ld_v16(rope + 16 * lane));
}

/// One 656 B entry -> 576 bf16 (1152 B).
__device__ __forceinline__ void warp_ds_to_bf16(const uint8_t* src, uint8_t* dst, int lane) {
  const uint4 qv = ld_v16(src + 16 * lane);
  const float sc = *reinterpret_cast<const float*>(src + kMlaDsScaleOffset + 4 * (lane >> 3));
  uint8_t q[16];
  memcpy(q, &qv, 16);
  uint16_t h[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) h[k] = dequant_bf16(q[k], sc);
  st_v16(dst + 32 * lane, pack16(h));
  st_v16(dst + 32 * lane + 16, pack16(h + 8));
  if (lane < 8) st_v16(dst + kMlaRank * 2 + 16 * lane, ld_v16(src + kMlaDsRopeOffset + 16 * lane));
}

/// 576 B mla_fp8 -> 656 B: nope kept, scales 1.0, rope e4m3 -> bf16.
__device__ __forceinline__ void warp_fp8_to_ds(const uint8_t* src, uint8_t* dst, int lane) {
  st_v16(dst + 16 * lane, ld_v16(src + 16 * lane));
  if (lane == 0) st_v16(dst + kMlaDsScaleOffset, make_uint4(kOneF32Bits, kOneF32Bits, kOneF32Bits, kOneF32Bits));
  if (lane < 8) {
    const uint2 r = ld_v8(src + kMlaRank + 8 * lane);
    uint8_t q[8];
    memcpy(q, &r, 8);
    uint16_t h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = e4m3_to_bf16(q[k]);
    st_v16(dst + kMlaDsRopeOffset + 16 * lane, pack16(h));
  }
}

/// 656 B -> 576 B; returns (to every lane) whether the entry was lossless.
__device__ __forceinline__ bool warp_ds_to_fp8(const uint8_t* src, uint8_t* dst, int lane) {
  st_v16(dst + 16 * lane, ld_v16(src + 16 * lane));
  bool ok = true;
  if (lane == 0) {
    const uint4 s = ld_v16(src + kMlaDsScaleOffset);
    ok = s.x == kOneF32Bits && s.y == kOneF32Bits && s.z == kOneF32Bits && s.w == kOneF32Bits;
  }
  if (lane < 8) {
    const H8 h = unpack(ld_v16(src + kMlaDsRopeOffset + 16 * lane));
    uint8_t q[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) ok &= bf16_to_e4m3_exact(h.h[k], &q[k]);
    st_v8(dst + kMlaRank + 8 * lane, pack8(q));
  }
  return __all_sync(kFull, ok);
}

// ---- write_mla ----

template <int kMode>
__global__ void __launch_bounds__(kThreads) write_mla_kernel(const WriteMlaParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const bool bf16 = p.input_dtype == DType::kBF16;
  for (int64_t n = global_warp(); n < p.tokens; n += total_warps()) {
    const int64_t s = p.slots[n];
    if (s < 0 || s >= limit) continue;
    int64_t blk, off;
    divmod(s, bs, blk, off);
    uint8_t* dst = p.cache.entry(blk, off);
    const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
    const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
    if constexpr (kMode == 0) {
      for (int v = lane; v < 72; v += 32)
        st_v16(dst + 16 * v, v < 64 ? ld_v16(nope + 16 * v) : ld_v16(rope + 16 * (v - 64)));
    } else if constexpr (kMode == 1) {
      for (int g = lane; g < 72; g += 32) {
        const H8 h = unpack(g < 64 ? ld_v16(nope + 16 * g) : ld_v16(rope + 16 * (g - 64)));
        uint8_t q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = quant_e4m3(half_to_float(h.h[k], bf16), p.scale);
        st_v8(dst + 8 * g, pack8(q));
      }
    } else {
      warp_bf16_to_ds(nope, rope, dst, lane);
    }
  }
}

// ---- write_mha ----

template <bool kFp8>
__global__ void __launch_bounds__(kThreads) write_mha_kernel(const WriteMhaParams p) {
  const int lane = threadIdx.x & 31;
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.sizes[1], h = kv.sizes[2], d = kv.sizes[3];
  const int64_t limit = kv.sizes[0] * bs;
  const int64_t gpd = d / 8, groups = h * gpd;
  const int64_t eb = kFp8 ? 1 : 2;
  const bool bf16 = p.input_dtype == DType::kBF16;
  for (int64_t w = global_warp(); w < 2 * p.tokens; w += total_warps()) {
    const int64_t n = w >> 1;
    const int plane = static_cast<int>(w & 1);
    const int64_t s = p.slots[n];
    if (s < 0 || s >= limit) continue;
    const CacheRef& c = plane == 0 ? p.k_cache : p.v_cache;
    const uint8_t* src = static_cast<const uint8_t*>(plane == 0 ? p.key : p.value) +
                         n * (plane == 0 ? p.key_stride : p.value_stride) * 2;
    const float sc = plane == 0 ? p.k_scale : p.v_scale;
    int64_t blk, off;
    divmod(s, bs, blk, off);
    uint8_t* entry = c.entry(blk, off);
    const int64_t hstride = c.view.strides[2] * eb;
    for (int64_t g = lane; g < groups; g += 32) {
      int64_t hh, kg;
      divmod(g, gpd, hh, kg);
      const int64_t k8 = kg * 8;
      const uint4 v = ld_v16(src + (hh * d + k8) * 2);
      uint8_t* dst = entry + hh * hstride + k8 * eb;
      if constexpr (!kFp8) {
        st_v16(dst, v);
      } else {
        const H8 x = unpack(v);
        uint8_t q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = quant_e4m3(half_to_float(x.h[k], bf16), sc);
        st_v8(dst, pack8(q));
      }
    }
  }
}

// ---- indexer ----

__global__ void __launch_bounds__(kThreads) indexer_write_kernel(const IndexerWriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const bool bf16 = p.input_dtype == DType::kBF16;
  for (int64_t n = global_warp(); n < p.tokens; n += total_warps()) {
    const int64_t s = p.slots[n];
    if (s < 0 || s >= limit) continue;
    int64_t blk, off;
    divmod(s, bs, blk, off);
    uint8_t* block = p.cache.entry(blk, 0);
    const uint2 raw = ld_v8(static_cast<const uint8_t*>(p.k) + n * p.k_stride * 2 + 8 * lane);
    uint16_t hv[4];
    memcpy(hv, &raw, 8);
    float x[4];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = half_to_float(hv[k], bf16);
      amax = fmax_f(amax, abs_f(x[k]));
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
    const float sc = indexer_scale(amax, p.ue8m0);
    uint8_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = quant_e4m3(x[k], sc);
    uint32_t qv;
    memcpy(&qv, q, 4);
    *reinterpret_cast<uint32_t*>(block + off * kIndexerHeadDim + 4 * lane) = qv;
    if (lane == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
  }
}

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

template <int kMode, int kVec>
__global__ void __launch_bounds__(kThreads) gather_kernel(const GatherParams p) {
  const int lane = threadIdx.x & 31;
  const TensorView& v = p.cache.view;
  const int64_t bs = v.sizes[1], e = v.sizes[2];
  const int64_t eb = dtype_size(v.dtype);
  const int64_t dst_eb = kMode == 0 ? eb : 2;
  for (int64_t j = global_warp(); j < p.total_rows; j += total_warps()) {
    const int64_t r = find_request(p.cu_seq_lens, p.batch, j);
    const int64_t pos = j - p.cu_seq_lens[r] + (p.seq_starts ? p.seq_starts[r] : 0);
    int64_t col, tok;
    divmod(pos, bs, col, tok);
    const int64_t blk = p.block_table[r * p.block_table_stride + col];
    const uint8_t* src = p.cache.entry(blk, tok);
    uint8_t* dst = static_cast<uint8_t*>(p.dst) + j * p.dst_stride * dst_eb;
    if constexpr (kMode == 0) {
      const int64_t n = e * eb / kVec;
      for (int64_t k = lane; k < n; k += 32) {
        if constexpr (kVec == 16)
          st_v16(dst + 16 * k, ld_v16(src + 16 * k));
        else if constexpr (kVec == 4)
          reinterpret_cast<uint32_t*>(dst)[k] = reinterpret_cast<const uint32_t*>(src)[k];
        else if constexpr (kVec == 2)
          reinterpret_cast<uint16_t*>(dst)[k] = reinterpret_cast<const uint16_t*>(src)[k];
        else
          dst[k] = src[k];
      }
    } else if constexpr (kMode == 1) {
      for (int64_t g = lane; g < e / 8; g += 32) {
        const uint2 r8 = ld_v8(src + 8 * g);
        uint8_t q[8];
        memcpy(q, &r8, 8);
        uint16_t h[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = dequant_bf16(q[k], p.scale);
        st_v16(dst + 16 * g, pack16(h));
      }
    } else {
      warp_ds_to_bf16(src, dst, lane);
    }
  }
}

__global__ void __launch_bounds__(kThreads) dequant_paged_kernel(const DequantPagedParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1], limit = p.cache.view.sizes[0] * bs;
  for (int64_t i = global_warp(); i < p.count; i += total_warps()) {
    const int64_t s = p.slots[i];
    if (s < 0 || s >= limit) continue;
    int64_t blk, off;
    divmod(s, bs, blk, off);
    warp_ds_to_bf16(p.cache.entry(blk, off), static_cast<uint8_t*>(p.dst) + i * p.dst_stride * 2, lane);
  }
}

// ---- conversions ----

template <int kKind>
__global__ void __launch_bounds__(kThreads) convert_kernel(const ConvertParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.src.view.sizes[1];
  const int64_t items = p.layers * p.count * bs;
  for (int64_t w = global_warp(); w < items; w += total_warps()) {
    int64_t q, t, l, i;
    divmod(w, bs, q, t);
    divmod(q, p.count, l, i);
    const int64_t sb = p.src_blocks ? p.src_blocks[i] : i;
    const int64_t db = p.dst_blocks ? p.dst_blocks[i] : i;
    const uint8_t* src = p.src.entry(sb, t) + l * p.src_layer_stride;
    uint8_t* dst = p.dst.entry(db, t) + l * p.dst_layer_stride;
    if constexpr (kKind == 0) {
      warp_fp8_to_ds(src, dst, lane);
    } else if constexpr (kKind == 1) {
      const bool ok = warp_ds_to_fp8(src, dst, lane);
      if (!ok && lane == 0 && p.not_lossless) p.not_lossless[i] = 1;
    } else if constexpr (kKind == 2) {
      warp_bf16_to_ds(src, src + kMlaRank * 2, dst, lane);
    } else {
      warp_ds_to_bf16(src, dst, lane);
    }
  }
}

bool aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0; }

}  // namespace

cudaError_t launch_write_mla(const WriteMlaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const unsigned grid = grid_for(p.tokens);
  switch (p.mode) {
    case MlaWriteMode::kCopy: write_mla_kernel<0><<<grid, kThreads, 0, stream>>>(p); break;
    case MlaWriteMode::kFp8: write_mla_kernel<1><<<grid, kThreads, 0, stream>>>(p); break;
    case MlaWriteMode::kFp8Ds: write_mla_kernel<2><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_write_mha(const WriteMhaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const unsigned grid = grid_for(2 * p.tokens);
  if (p.k_cache.view.dtype == DType::kFP8E4M3)
    write_mha_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  else
    write_mha_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_indexer_write(const IndexerWriteParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  indexer_write_kernel<<<grid_for(p.tokens), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_gather(const GatherParams& p, cudaStream_t stream) {
  if (p.total_rows == 0) return cudaSuccess;
  const unsigned grid = grid_for(p.total_rows);
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
        gather_kernel<0, 16><<<grid, kThreads, 0, stream>>>(p);
      else if (fits(4))
        gather_kernel<0, 4><<<grid, kThreads, 0, stream>>>(p);
      else if (fits(2))
        gather_kernel<0, 2><<<grid, kThreads, 0, stream>>>(p);
      else
        gather_kernel<0, 1><<<grid, kThreads, 0, stream>>>(p);
      break;
    }
    case GatherMode::kDequantFp8: gather_kernel<1, 8><<<grid, kThreads, 0, stream>>>(p); break;
    case GatherMode::kDequantDs: gather_kernel<2, 16><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_dequant_paged(const DequantPagedParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  dequant_paged_kernel<<<grid_for(p.count), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_convert(const ConvertParams& p, cudaStream_t stream) {
  const int64_t items = p.layers * p.count * p.src.view.sizes[1];
  if (items == 0) return cudaSuccess;
  const unsigned grid = grid_for(items);
  switch (p.kind) {
    case ConvertKind::kFp8ToDs: convert_kernel<0><<<grid, kThreads, 0, stream>>>(p); break;
    case ConvertKind::kDsToFp8: convert_kernel<1><<<grid, kThreads, 0, stream>>>(p); break;
    case ConvertKind::kBf16ToDs: convert_kernel<2><<<grid, kThreads, 0, stream>>>(p); break;
    case ConvertKind::kDsToBf16: convert_kernel<3><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvferry::kernels
