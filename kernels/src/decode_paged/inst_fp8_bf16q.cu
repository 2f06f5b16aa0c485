// Paged decode kernels for bf16 q, fp8 e4m3 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged/kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_fp8_bf16q(int dk, int dv) { return pick_dk_dv<__nv_bfloat16, __nv_fp8_e4m3>(dk, dv); }
}  // namespace kvferry::decode_paged_detail
