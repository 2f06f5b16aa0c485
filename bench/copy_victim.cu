// Engine-like kernels for the interference figure of `kvferry-bench copy` (see copy_victim.h).
#include "copy_victim.h"

namespace kvferry::bench {
namespace {

__global__ void victim_stream(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += step) {
    float4 a = *reinterpret_cast<const float4*>(x + i);
    float4 b = *reinterpret_cast<float4*>(y + i);
    b.x = b.x * 0.999f + a.x;
    b.y = b.y * 0.999f + a.y;
    b.z = b.z * 0.999f + a.z;
    b.w = b.w * 0.999f + a.w;
    *reinterpret_cast<float4*>(y + i) = b;
  }
}

__global__ void victim_fma(float* out, int iters) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  float a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = 1.0f + 1e-3f * static_cast<float>((t + k) & 255);
  const float m = 0.9999f, c = 1e-4f;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = fmaf(a[k], m, c);
  }
  float s = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += a[k];
  out[t] = s;
}

}  // namespace

cudaError_t launch_victim_stream(float* y, const float* x, int64_t n, cudaStream_t stream) {
  int dev = 0, sms = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  victim_stream<<<static_cast<unsigned>(sms * 8), 256, 0, stream>>>(y, x, n & ~int64_t{3});
  return cudaGetLastError();
}

cudaError_t launch_victim_fma(float* out, int iters, int sms, cudaStream_t stream) {
  victim_fma<<<static_cast<unsigned>(sms * 4), 256, 0, stream>>>(out, iters);
  return cudaGetLastError();
}

}  // namespace kvferry::bench
