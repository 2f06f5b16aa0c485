// Paged decode kernels for fp16 q, fp8 e4m3 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged/kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_fp8_fp16q(int dk, int dv) { return pick_dk_dv<__half, __nv_fp8_e4m3>(dk, dv); }
}  // namespace kvferry::decode_paged_detail
