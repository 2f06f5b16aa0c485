#pragma once
// PTX wrappers for shared-memory mbarriers and bulk copies (the TMA engine), shared by the MLA
// decode kernels (decode_mla/common.cuh) and the data path's bulk engine
// (cuda/datapath/engines.cuh). Bulk copies need sm_90; built for an older architecture they trap
// (the launchers do not pick them there). Private to kernels/src.
#include <cstdint>

namespace kvferry::kernels::ptx {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// Makes the inits visible to the other threads (and the async proxy) before their first use.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/// Arrives and expects `bytes` more of transaction (bulk-copy) completions in the current phase.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

/// One bulk copy (the TMA engine) of `bytes` (a multiple of 16; both addresses 16-byte aligned)
/// global -> shared, completing on mbarrier `bar`: one instruction moves the whole range, and the
/// bytes in flight are not bounded by per-thread miss tracking as cp.async's are.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  __trap();
#endif
}

}  // namespace kvferry::kernels::ptx
