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

/// What random slots allow a cache writer: the writer's bytes moved without its conversion. Per
/// token n, `in_bytes` read from in + n * in_bytes (a warp per token from 512 input bytes, else a
/// thread per 16 bytes with four in flight: the faster shape for each size) and the first
/// `out_bytes` of them written to the entry of slots[n] (block slot / bs at out + block *
/// block_stride, entry slot % bs of `out_bytes`); with scale_bytes > 0 also `scale_bytes` more to the
/// block's scale region after its bs entries, as the indexer's values-then-scales block. Negative
/// slots write nothing. Every input byte is read, stored or not (as the writer reads it), with an
/// L2 evict-first policy where `evict_first` (as the quantising writers read). in_bytes,
/// out_bytes, block_stride and both pointers 16-byte aligned, out_bytes <= in_bytes, scale_bytes
/// in {0, 4}, tokens * in_bytes / 16 and slots below 2^32.
cudaError_t launch_scatter_ceiling(const void* in, int64_t in_bytes, void* out, int64_t block_stride, int64_t bs,
                                   int64_t out_bytes, int64_t scale_bytes, const int64_t* slots, int64_t tokens,
                                   bool evict_first, cudaStream_t stream);

/// What a conversion's traffic allows on its layout: `blocks` blocks, block i read as `src_bytes`
/// from src + i * src_stride and `dst_bytes` written to dst + i * dst_stride (16-byte units, each
/// source unit read once and each destination unit written once), without the conversion. A CTA per block, blocks taken
/// grid-stride in order (as the conversions take them), four units in flight per thread. Sizes, strides and pointers
/// 16-byte aligned.
cudaError_t launch_block_ceiling(const void* src, int64_t src_bytes, int64_t src_stride, void* dst, int64_t dst_bytes,
                                 int64_t dst_stride, int64_t blocks, cudaStream_t stream);

}  // namespace kvferry::bench
