// Ceiling kernels of the kernels suite (see shape_ceiling.h).
#include "shape_ceiling.h"

#include <cuda_runtime.h>

namespace kvferry::bench {
namespace {

template <int kR, int kW>
__global__ void __launch_bounds__(256)
    shape_stream(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t units) {
  constexpr int kU = 2;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < units; u0 += kU * step) {
    uint4 v[kU][kR];
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = u0 + k * step, w = u / 32 * 32 * kR + u % 32;
#pragma unroll
      for (int r = 0; r < kR; ++r) v[k][r] = u < units ? in[w + 32 * r] : uint4{};
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = u0 + k * step;
      if (u >= units) continue;
      uint4 a = v[k][0];
#pragma unroll
      for (int r = 1; r < kR; ++r) {
        a.x ^= v[k][r].x;
        a.y ^= v[k][r].y;
        a.z ^= v[k][r].z;
        a.w ^= v[k][r].w;
      }
      const int64_t w = u / 32 * 32 * kW + u % 32;
#pragma unroll
      for (int r = 0; r < kW; ++r) {
        a.x += 1u;
        out[w + 32 * r] = a;
      }
    }
  }
}

template <int kR, int kW>
cudaError_t go(const void* in, void* out, int64_t units, cudaStream_t stream) {
  int dev = 0, sms = 132, per = 4;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  (void)cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, shape_stream<kR, kW>, 256, 0);
  shape_stream<kR, kW><<<static_cast<unsigned>(sms * (per > 0 ? per : 1)), 256, 0, stream>>>(
      static_cast<const uint4*>(in), static_cast<uint4*>(out), units);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_shape_stream(const void* in, void* out, int64_t units, int reads, int writes, cudaStream_t stream) {
  if (units % 32 != 0) return cudaErrorInvalidValue;
  switch (reads * 8 + writes) {
    case 9: return go<1, 1>(in, out, units, stream);
    case 10: return go<1, 2>(in, out, units, stream);
    case 17: return go<2, 1>(in, out, units, stream);
    case 33: return go<4, 1>(in, out, units, stream);
    case 12: return go<1, 4>(in, out, units, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvferry::bench
