#pragma once
// What the MLA decode's CUDA translation units share: the kernels' parameter block and each
// kernel's launcher, which launch.cu picks from (kernels/DESIGN.md §3.1). Private to kernels/src.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvferry::mla_detail {

/// The cache format a decode kernel is built for (its FMT template argument).
enum CacheFormat : int { kFmtBf16 = 0, kFmtFp8 = 1, kFmtDs = 2 };

struct KParams {
  const uint8_t* cache;  // region base + view offset
  int64_t block_stride;  // bytes
  int64_t token_stride;  // bytes
  int32_t page;
  int32_t page_shift;  // log2(page) when page is a power of two, else -1 (the wgmma kernel shifts then)
  const uint16_t* q;
  const int32_t* table;
  int64_t table_stride;
  const int32_t* seq_lens;
  int32_t heads;
  int32_t splits;
  float scale_log2;  // sm_scale * k_scale * log2(e)
  float vscale;      // k_scale for mla_fp8, else 1
  uint16_t* o;
  float* lse;
  float* part_o;       // [batch, splits, heads, 512]
  float* part_lse;     // [batch, splits, heads]
  int32_t conv_rows;   // depth-split, fp8 caches: rows of each tile the producer warps convert (DecodeMlaParams)
  int64_t num_blocks;  // blocks of the cache view (the seesaw kernel's tensor map)
};

/// Launches the depth-split wgmma kernel (wgmma_depth_split.cu; one CTA of two math warpgroups and
/// a producer warpgroup per request, split and 64 heads; fewer heads are padded to 64 rows) for cache format `fmt`.
/// Writes o/lse with one split, the fp32 partials otherwise (the caller merges). Needs a device of compute
/// capability 9.0 and code built for sm_90a.
cudaError_t launch_wgmma_depth_split(const KParams& k, CacheFormat fmt, int batch, cudaStream_t stream);

/// Launches the seesaw wgmma split kernel (wgmma_seesaw.cu): one CTA of two math warpgroups
/// and a producer warpgroup per request, split and 64 heads, over 64-token tiles, for cache format
/// `fmt`. Writes o/lse with one split, the fp32 partials otherwise (the caller merges). Needs a
/// device of compute capability 9.0 and code built for sm_90a. `tensor_copies` false makes the
/// producer copy with cp.async (DecodeMlaParams::seesaw_loader = 2). fp8 caches need tensor copies
/// (a page that is a power of two >= 16, and `tensor_copies`): otherwise it returns
/// cudaErrorNotSupported having launched nothing, and the caller takes launch_wgmma_depth_split.
cudaError_t launch_wgmma_seesaw(const KParams& k, CacheFormat fmt, int batch, bool tensor_copies, cudaStream_t stream);

/// Launches the seesaw kernel's fp8 tensor-core variant (wgmma_seesaw_e4m3.cu) for an mla_fp8 cache
/// (DecodeMlaParams::fp8_math): Q and P rounded to e4m3, the tiles multiplied as they land. Same
/// grid and outputs as launch_wgmma_seesaw; cudaErrorNotSupported (nothing launched) where tensor copies
/// cannot take the view.
cudaError_t launch_wgmma_seesaw_e4m3(const KParams& k, int batch, cudaStream_t stream);

/// Launches the mma.sync kernel for fp8 caches (fmt kFmtFp8 or kFmtDs) that converts the fp8 tile
/// in registers (mma_sync_fp8.cu): one CTA per request, split and group of up to 64 heads. Writes
/// o/lse with one split, the fp32 partials otherwise (the caller merges).
cudaError_t launch_mma_sync_fp8(const KParams& k, CacheFormat fmt, int batch, cudaStream_t stream);

/// Launches the mma.sync kernel for bf16 caches (mma_sync_bf16.cu): one CTA per request, split and
/// group of up to 64 heads, `nw` (2 or 4) warps per 16 heads, its K tiles by bulk copies (`bulk`)
/// or cp.async. Writes o/lse with one split, the fp32 partials otherwise (the caller merges).
cudaError_t launch_mma_sync_bf16(const KParams& k, int batch, bool bulk, int nw, cudaStream_t stream);

}  // namespace kvferry::mla_detail
