// Paged decode kernels for fp16 q, fp16 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged_kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_fp16(int dv, int ng) { return pick_dv_ng<__half, __half>(dv, ng); }
}  // namespace kvferry::decode_paged_detail
