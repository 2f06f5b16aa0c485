// The MLA paged decode's entry point (contract in decode_mla.h): checks the call, picks the kernel
// (kernels/DESIGN.md §3.1: decode_mla_resolved_mma and DecodeMlaParams' choices) and launches it,
// then merges the splits' partials.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_mla/common.cuh"
#include "decode_mla/kernels.h"
#include "kvferry/kernels/decode_mla.h"

namespace kvferry {
namespace {

using mla_detail::kFmtBf16;
using mla_detail::kFmtDs;
using mla_detail::kFmtFp8;
using mla_detail::KParams;
using mla_detail::pack_bf16;

// Merges the splits of one (request, head): o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - M).
// Every load is issued before it is needed: each warp reads the (up to 64) split lse values at
// once, one or two per lane, and reduces them with shuffles; the o partials of the non-empty
// splits (a prefix: a split is empty only when it starts past the request's end) are read without
// a data-dependent branch, so the unrolled loop keeps several loads in flight. (The previous
// loop read one lse, then one partial, per split in turn: about 8 us of latency at 6 splits.)
__global__ void __launch_bounds__(128) decode_mla_merge(const KParams p) {
  static_assert(kDecodeMlaMaxSplits <= 64, "two split lse values per lane");
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int lane = threadIdx.x & 31;
  const float* lse_s = p.part_lse + b * p.splits * p.heads + h;
  const float l0 = lane < p.splits ? lse_s[static_cast<int64_t>(lane) * p.heads] : -INFINITY;
  const float l1 = lane + 32 < p.splits ? lse_s[static_cast<int64_t>(lane + 32) * p.heads] : -INFINITY;
  float mx = fmaxf(l0, l1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  uint16_t* o = p.o + bh * kMlaRank + threadIdx.x * 4;
  if (mx == -INFINITY) {  // length 0
    *reinterpret_cast<uint2*>(o) = make_uint2(0, 0);
    if (threadIdx.x == 0) p.lse[bh] = -INFINITY;
    return;
  }
  const float w0 = l0 == -INFINITY ? 0.0f : expf(l0 - mx), w1 = l1 == -INFINITY ? 0.0f : expf(l1 - mx);
  float w_sum = w0 + w1;
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o2);
  const unsigned live0 = __ballot_sync(0xffffffffu, l0 != -INFINITY),
                 live1 = __ballot_sync(0xffffffffu, l1 != -INFINITY);
  const int ns = live1 != 0 ? 64 - __clz(live1) : 32 - __clz(live0);  // non-empty splits: a prefix
  __shared__ float ws[64];
  if (threadIdx.x < 32) {
    ws[lane] = w0;
    ws[lane + 32] = w1;
  }
  __syncthreads();
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* part = p.part_o + (b * p.splits * p.heads + h) * kMlaRank + threadIdx.x * 4;
#pragma unroll 8
  for (int s = 0; s < ns; ++s) {
    const float w = ws[s];
    const float4 v = *reinterpret_cast<const float4*>(part + static_cast<int64_t>(s) * p.heads * kMlaRank);
    a.x += w * v.x;
    a.y += w * v.y;
    a.z += w * v.z;
    a.w += w * v.w;
  }
  const float inv = 1.0f / w_sum;
  *reinterpret_cast<uint2*>(o) = make_uint2(pack_bf16(a.x * inv, a.y * inv), pack_bf16(a.z * inv, a.w * inv));
  if (threadIdx.x == 0) p.lse[bh] = mx + logf(w_sum);
}

// The wgmma kernel exists only in sm_90a code (KVFERRY_MLA_WGMMA, set by kernels/decode_mla.cmake
// when CMAKE_CUDA_ARCHITECTURES lists 90a) and runs only on a device of compute capability 9.0.
bool wgmma_available() {
#if defined(KVFERRY_MLA_WGMMA)
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
           minor == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool decode_mla_wgmma_available() { return wgmma_available(); }

int32_t decode_mla_splits(const DecodeMlaParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  static const int sm_count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 1;
    return n;
  }();
  return decode_mla_auto_splits(p, sm_count);
}

cudaError_t launch_decode_mla(const DecodeMlaParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return cudaSuccess;
  if (p.heads != 16 && p.heads != 32 && p.heads != 64 && p.heads != 128) return cudaErrorInvalidValue;
  const int32_t splits = decode_mla_splits(p);
  if (splits < 1 || splits > kDecodeMlaMaxSplits) return cudaErrorInvalidValue;
  const size_t need = decode_mla_workspace_bytes(p.batch, p.heads, splits);
  if (need > 0 && (p.workspace == nullptr || p.workspace_bytes < need)) return cudaErrorInvalidValue;
  KParams k{};
  const int64_t eb = p.cache.elem_bytes();
  k.cache = static_cast<const uint8_t*>(p.cache_base) + p.cache.offset;
  k.block_stride = p.cache.stride(0) * eb;
  k.token_stride = p.cache.stride(1) * eb;
  k.page = static_cast<int32_t>(p.cache.size(1));
  k.num_blocks = p.cache.size(0);
  k.page_shift = (k.page & (k.page - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(k.page)) : -1;
  k.q = p.q;
  k.table = p.block_table;
  k.table_stride = p.block_table_stride;
  k.seq_lens = p.seq_lens;
  k.heads = p.heads;
  k.splits = splits;
  const bool fp8 = p.format.kind == FormatKind::kMlaFp8;
  k.vscale = fp8 ? p.k_scale : 1.0f;
  k.scale_log2 = p.sm_scale * k.vscale * 1.4426950408889634f;
  k.o = p.o;
  k.lse = p.lse;
  if (splits > 1) {
    k.part_o = static_cast<float*>(p.workspace);
    k.part_lse = k.part_o + static_cast<int64_t>(p.batch) * splits * p.heads * kMlaRank;
  }
  if (p.loader < 0 || p.loader > 2) return cudaErrorInvalidValue;
  const bool bulk = decode_mla_resolved_loader(p) == 1;
  if (p.group_warps != 0 && p.group_warps != 2 && p.group_warps != 4) return cudaErrorInvalidValue;
  const int nw = decode_mla_resolved_group_warps(p);
  if (p.mma < 0 || p.mma > 2) return cudaErrorInvalidValue;
  mla_detail::CacheFormat fmt;
  switch (p.format.kind) {
    case FormatKind::kMlaBf16: fmt = kFmtBf16; break;
    case FormatKind::kMlaFp8: fmt = kFmtFp8; break;
    case FormatKind::kMlaFp8Ds: fmt = kFmtDs; break;
    default: return cudaErrorInvalidValue;
  }
  cudaError_t err;
  const int mma = p.mma == 0 && !wgmma_available() ? 1 : decode_mla_resolved_mma(p);
  if (mma == 2) {
    if (!wgmma_available()) return cudaErrorInvalidDeviceFunction;
    // The seesaw kernel, where it can run (fp8 caches need tensor copies); wgmma_kernel = 2
    // selects the depth-split one.
    if (p.wgmma_kernel < 0 || p.wgmma_kernel > 2 || p.seesaw_loader < 0 || p.seesaw_loader > 2)
      return cudaErrorInvalidValue;
    k.conv_rows = p.conv_rows;  // launch_wgmma_depth_split checks its range
    err = cudaErrorNotSupported;
    if (fmt == kFmtFp8 && p.fp8_math == 1 && p.heads >= 64)
      err = mla_detail::launch_wgmma_seesaw_e4m3(k, p.batch, stream);
    if (err == cudaErrorNotSupported && p.wgmma_kernel != 2)
      err = mla_detail::launch_wgmma_seesaw(k, fmt, p.batch, p.seesaw_loader != 2, stream);
    if (err == cudaErrorNotSupported) err = mla_detail::launch_wgmma_depth_split(k, fmt, p.batch, stream);
  } else {
    err = fmt == kFmtBf16 ? mla_detail::launch_mma_sync_bf16(k, p.batch, bulk, nw, stream)
                          : mla_detail::launch_mma_sync_fp8(k, fmt, p.batch, stream);
  }
  if (err != cudaSuccess || splits == 1) return err;
  decode_mla_merge<<<static_cast<unsigned>(p.batch) * p.heads, 128, 0, stream>>>(k);
  return cudaGetLastError();
}

}  // namespace kvferry
