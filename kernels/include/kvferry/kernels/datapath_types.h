#pragma once
// Types shared by the data-path kernels (write, gather, convert, indexer, copy_blocks).
// Every kernel addresses entry (block b, token t) of a cache view as
//   base + view.offset + (b * stride(0) + t * stride(1)) * elem_bytes
// in 64-bit arithmetic, so a layer view of a block-major buffer works like a contiguous cache.
#include <cstdint>

#include "kvferry/layouts/tensor_view.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry::kernels {

/// A cache view inside a region: `base` is the region's first byte, `bytes` its size (used only
/// by validation), `view` the `(NB, BS, E)` (or `(NB, BS, H, D)` for MHA planes) view with its
/// byte offset from `base`. The caller owns the memory; kernels never free it.
struct CacheRef {
  void* base = nullptr;
  int64_t bytes = 0;
  TensorView view;

  KVFERRY_HOST_DEVICE uint8_t* entry(int64_t block, int64_t token) const {
    return static_cast<uint8_t*>(base) + view.offset +
           (block * view.strides[0] + token * view.strides[1]) * dtype_size(view.dtype);
  }
};

/// Which engine a data-path launcher runs (GPU only; the CPU twins ignore it). Every engine gives
/// the CPU twins' bits; they differ in speed only (kernels/DESIGN.md §2.1 says which won where).
enum class DatapathEngine : uint8_t {
  kAuto = 0,    ///< the engine that measured faster for the kernel (the default)
  kDirect = 1,  ///< "direct": a warp keeps its next item in registers
  kStaged = 2,  ///< "staged": items stream through a per-warp ring of shared memory filled by cp.async
  kBulk = 3,    ///< "bulk": the conversions (kinds 0..3) on sm_90 through a per-CTA ring of bulk
                ///< copies, where the device and the views allow it; the other kernels take their default
};

/// Options of the CPU twins. `threads` <= 1 runs on the calling thread; more splits the work over
/// that many short-lived threads (the daemon converts staged blocks this way).
struct CpuOptions {
  int threads = 1;
};

}  // namespace kvferry::kernels
