#pragma once
// Which engine a data-path launcher runs (kernels/DESIGN.md §2.1 has the measurements): each
// launcher passes its kernel's default, DatapathEngine in the params may force another. Host code.
// Private to kernels/src.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvferry/kernels/datapath_types.h"

namespace kvferry::kernels::detail {

/// Whether a launcher with direct and staged kernels runs the staged one: `by_default` (the engine
/// that measured faster for the kernel) unless the params force direct or staged; kBulk forces
/// nothing on a kernel without a bulk engine.
bool use_staged(DatapathEngine e, bool by_default);

/// Whether a launcher with a bulk-engine kernel runs it: where the params do not force direct or
/// staged, `by_default` (or kBulk) asks for it, and the device runs it: bulk copies need sm_90, a
/// CTA needs `smem` bytes of shared memory, and the build must have compiled the kernels for sm_90
/// (code built for an older architecture and JIT-compiled would trap). `bulk_kernel`: one of the
/// caller's bulk-engine kernels, whose build is asked about once per process (every bulk kernel is
/// built by the same flags).
bool use_bulk(DatapathEngine e, bool by_default, int smem, const void* bulk_kernel);

/// Whether `p` is a multiple of `a` bytes.
inline bool aligned(const void* p, int64_t a) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0;
}

}  // namespace kvferry::kernels::detail
