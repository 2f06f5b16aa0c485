#pragma once
// Ceiling kernels of `kvferry-bench kernels`: plain coalesced streams with a given read:write
// shape, so each data-path kernel's figure can be read next to what its traffic shape allows on
// the same GPU. Built only with CUDA.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace kvferry::bench {

/// Streams `units` units, each `reads` 16-byte loads from `in` and `writes` 16-byte stores to
/// `out` (reads, writes in {1, 2, 4}), warp-coalesced, one resident wave grid-stride, loads of two
/// units in flight per thread. `in` holds units * reads * 16 bytes, `out` units * writes * 16.
cudaError_t launch_shape_stream(const void* in, void* out, int64_t units, int reads, int writes, cudaStream_t stream);

}  // namespace kvferry::bench
