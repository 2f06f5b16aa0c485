// The timing gate of launch_gate.h.
#include "launch_gate.h"

namespace kvferry::bench {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void gate_kernel(uint64_t ns) {
  const uint64_t t0 = global_ns();
  for (int i = 0; i < (1 << 20) && global_ns() - t0 < ns; ++i) __nanosleep(500);  // bounded: ~0.5 s at most
}

}  // namespace

cudaError_t launch_gate(uint64_t ns, cudaStream_t stream) {
  gate_kernel<<<1, 32, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace kvferry::bench
