#pragma once
// Engine-like kernels that `kvferry-bench copy` times in one process while another process
// offloads blocks (the interference figure). Built only with CUDA.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace kvferry::bench {

/// Memory-bound: y[i] = y[i] * 0.999 + x[i] over n floats (12 bytes moved per element), all SMs.
cudaError_t launch_victim_stream(float* y, const float* x, int64_t n, cudaStream_t stream);

/// Arithmetic-bound (a GEMM's inner loop without its memory traffic): 8 independent FMA chains of
/// `iters` steps per thread on 4 CTAs of 256 threads per multiprocessor; writes one float per thread.
cudaError_t launch_victim_fma(float* out, int iters, int sms, cudaStream_t stream);

}  // namespace kvferry::bench
