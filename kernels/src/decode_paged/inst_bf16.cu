// Paged decode kernels for bf16 q, bf16 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged/kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_bf16(int dk, int dv) { return pick_dk_dv<__nv_bfloat16, __nv_bfloat16>(dk, dv); }
}  // namespace kvferry::decode_paged_detail
