// Paged decode kernels for bf16 q, bf16 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged_kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_bf16(int dv, int ng) { return pick_dv_ng<__nv_bfloat16, __nv_bfloat16>(dv, ng); }
}  // namespace kvferry::decode_paged_detail
