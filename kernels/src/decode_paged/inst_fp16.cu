// Paged decode kernels for fp16 q, fp16 cache (one translation unit per dtype pair keeps builds parallel).
#include "decode_paged/kernel.cuh"

namespace kvferry::decode_paged_detail {
KernelFn pick_fp16(int dk, int dv) { return pick_dk_dv<__half, __half>(dk, dv); }
}  // namespace kvferry::decode_paged_detail
