#pragma once
// A gate for timing short kernels: one warp that sleeps on the GPU's global timer for a given
// time, so the launches queued behind it (an event, the kernel under test, the closing event) are
// all in the stream before it ends, and the events time the kernels rather than the host's launch
// latency (the blocking-kernel method). Built only with CUDA.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace kvferry::bench {

/// Holds `stream` for about `ns` nanoseconds (one warp on one multiprocessor, no memory traffic).
cudaError_t launch_gate(uint64_t ns, cudaStream_t stream);

}  // namespace kvferry::bench
