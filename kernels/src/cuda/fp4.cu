// CUDA kernels of mla_fp4 (fp4.h): bf16 MLA entries <-> packed e2m1 values and ue8m0 scale bytes.
// sm_90 has no fp4 conversion instruction, so the codes come from fp4.h's scalar code, the same the
// CPU twins run (integer steps, comparisons, exact power-of-two products), so the bytes match.
//
// One warp per token entry, grid-stride over layers x blocks x tokens: lane g takes group g (the
// nope part, 32 groups) and lanes 0..3 then the four rope groups, so a warp's loads (32 B of bf16
// per lane) and stores (8 B of codes, 1 scale byte per lane) are contiguous runs. The entry's
// (layer, block, token) is split once per warp and iteration, not per group.
#include <cuda_runtime.h>

#include <cstring>

#include "kvferry/kernels/fp4.h"

namespace kvferry::kernels {
namespace {

constexpr int kThreads = 256;

struct Entry {
  uint8_t* bf16;
  uint8_t* values;
  uint8_t* scales;
};

__device__ __forceinline__ Entry locate(const MlaFp4Params& p, int64_t e, int64_t bs) {
  const int64_t t = e % bs, w = e / bs;
  const int64_t i = w % p.count, l = w / p.count;
  const int64_t hb = p.bf16_blocks ? p.bf16_blocks[i] : i;
  const int64_t fb = p.fp4_blocks ? p.fp4_blocks[i] : i;
  return {p.bf16.entry(hb, t) + l * p.bf16_layer_stride, p.values.entry(fb, t) + l * p.fp4_layer_stride,
          p.scales.entry(fb, t) + l * p.fp4_layer_stride};
}

/// 8 code bytes at a 4-byte aligned address (value rows are 4-byte aligned, 288 B long).
__device__ __forceinline__ void store8(uint8_t* d, const uint8_t* v) {
  uint32_t w[2];
  memcpy(w, v, 8);
  if ((reinterpret_cast<uintptr_t>(d) & 7u) == 0) {
    *reinterpret_cast<uint2*>(d) = make_uint2(w[0], w[1]);
  } else {
    reinterpret_cast<uint32_t*>(d)[0] = w[0];
    reinterpret_cast<uint32_t*>(d)[1] = w[1];
  }
}

__device__ __forceinline__ void load8(const uint8_t* s, uint8_t* v) {
  uint32_t w[2];
  if ((reinterpret_cast<uintptr_t>(s) & 7u) == 0) {
    const uint2 u = *reinterpret_cast<const uint2*>(s);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = reinterpret_cast<const uint32_t*>(s)[0];
    w[1] = reinterpret_cast<const uint32_t*>(s)[1];
  }
  memcpy(v, w, 8);
}

__global__ void __launch_bounds__(kThreads) quantize_mla_fp4_kernel(const MlaFp4Params p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.bf16.view.sizes[1];
  const int64_t n = p.layers * p.count * bs;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; e < n; e += warps) {
    const Entry en = locate(p, e, bs);
    for (int g = lane; g < kMlaFp4Groups; g += 32) {
      const uint4* src = reinterpret_cast<const uint4*>(en.bf16 + g * kMlaFp4Group * 2);  // 16-byte aligned
      const uint4 a = src[0], b = src[1];
      uint16_t x[kMlaFp4Group];
      memcpy(x, &a, 16);
      memcpy(x + 8, &b, 16);
      uint8_t packed[kMlaFp4Group / 2];
      en.scales[g] = mla_fp4_quantize_group(x, packed);
      store8(en.values + g * (kMlaFp4Group / 2), packed);
    }
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_mla_fp4_kernel(const MlaFp4Params p) {
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.bf16.view.sizes[1];
  const int64_t n = p.layers * p.count * bs;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; e < n; e += warps) {
    const Entry en = locate(p, e, bs);
    for (int g = lane; g < kMlaFp4Groups; g += 32) {
      uint8_t packed[kMlaFp4Group / 2];
      load8(en.values + g * (kMlaFp4Group / 2), packed);
      uint16_t x[kMlaFp4Group];
      mla_fp4_dequantize_group(packed, en.scales[g], x);
      uint4 a, b;
      memcpy(&a, x, 16);
      memcpy(&b, x + 8, 16);
      uint4* dst = reinterpret_cast<uint4*>(en.bf16 + g * kMlaFp4Group * 2);
      dst[0] = a;
      dst[1] = b;
    }
  }
}

/// One resident wave of `kernel` (at most enough warps for the entries), looping grid-stride.
template <auto kKernel>
cudaError_t launch(const MlaFp4Params& p, cudaStream_t stream) {
  const int64_t entries = p.layers * p.count * p.bf16.view.sizes[1];
  if (entries == 0) return cudaSuccess;
  static const int per_sm = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0) != cudaSuccess || b < 1) b = 1;
    return b;
  }();
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t want = (entries + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t cap = static_cast<int64_t>(sms) * per_sm;
  kKernel<<<static_cast<unsigned>(want < cap ? want : cap), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_mla_fp4(const MlaFp4Params& p, cudaStream_t stream) {
  return launch<quantize_mla_fp4_kernel>(p, stream);
}

cudaError_t launch_dequantize_mla_fp4(const MlaFp4Params& p, cudaStream_t stream) {
  return launch<dequantize_mla_fp4_kernel>(p, stream);
}

}  // namespace kvferry::kernels
