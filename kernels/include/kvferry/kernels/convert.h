#pragma once
// Format conversion of whole blocks between MLA entry formats (kernels-spec §7):
//   576 -> 656  requantize_fp8_to_ds: nope bytes kept, scales 1.0, rope e4m3 -> bf16 (lossless)
//   656 -> 576  the reverse, lossless only when every scale is 1.0 and every rope bf16 is an
//               e4m3 value; blocks that are not are reported (their output is unspecified)
//   bf16 -> 656 quantize_ds (tile scale max(amax/448, FLT_MIN), e4m3 RNE, rope copied)
//   656 -> bf16 dequantize_ds (bf16(float(e4m3) * scale), rope copied)
//   bf16 <-> fp4 (mla_fp4, fp4.h): quantize to e2m1 + ue8m0 group scales / dequantize (exact)
//   576 -> fp4  e4m3 -> bf16 (exact, per-tensor scale taken as 1 as for 576 -> 656), then quantize
//   656 -> fp4  dequantize_ds to bf16, then quantize (two roundings: bf16, then e2m1)
//   fp4 -> 656  dequantize to bf16 (exact), then quantize_ds
//   fp4 -> 576  dequantize to bf16, then e4m3 RNE saturating; reported like 656 -> 576 for blocks
//               where some value is not an e4m3 value (outside e4m3's range or precision)
// Reads and writes strided views, for a whole region or a list of blocks, for one layer or all.
// The fp4 kinds run on the host only (convert_cpu); launch_convert implements kinds 0..3.
#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels {

enum class ConvertKind : uint8_t {
  kFp8ToDs = 0,    ///< mla_fp8 (576 B) -> mla_fp8_ds (656 B)
  kDsToFp8 = 1,    ///< mla_fp8_ds -> mla_fp8, reporting blocks that are not lossless
  kBf16ToDs = 2,   ///< mla_bf16 -> mla_fp8_ds
  kDsToBf16 = 3,   ///< mla_fp8_ds -> mla_bf16
  kBf16ToFp4 = 4,  ///< mla_bf16 -> mla_fp4
  kFp4ToBf16 = 5,  ///< mla_fp4 -> mla_bf16 (exact)
  kFp8ToFp4 = 6,   ///< mla_fp8 -> mla_fp4 (through bf16)
  kFp4ToFp8 = 7,   ///< mla_fp4 -> mla_fp8, reporting blocks that are not lossless
  kDsToFp4 = 8,    ///< mla_fp8_ds -> mla_fp4 (through bf16)
  kFp4ToDs = 9,    ///< mla_fp4 -> mla_fp8_ds (through bf16)
};

/// The order in which the bulk conversion engine's CTAs take their units (GPU only). Every order
/// gives the same bytes; they differ in speed only (kernels/DESIGN.md §2.3).
enum class ConvertUnitOrder : uint8_t {
  kAuto = 0,        ///< ranges for a whole view whose blocks lie apart (a layer view of a block-major
                    ///< buffer, no block lists), grid-stride otherwise (the measured default)
  kGridStride = 1,  ///< the grid strides over the units, so it sweeps a contiguous cache in order
  kRanges = 2,      ///< one range of consecutive units per CTA
};

/// Whether `kind` converts from or to mla_fp4.
constexpr bool is_fp4_convert(ConvertKind k) { return static_cast<int>(k) >= 4 && static_cast<int>(k) <= 9; }

/// Converts block src_blocks[i] of `src` into block dst_blocks[i] of `dst` (null lists: block i ->
/// block i for i < count), for `layers` layers: layer l of a side is its view shifted by
/// l * layer_stride bytes (KvCacheSpec::page_offset(1, 0); 0 when layers == 1). Index arrays
/// (int64) and `not_lossless` live where the code runs. An mla_fp4 side is its KvCacheSpec's
/// layer_view, (NB, BS, 324) u8 whose pages hold [BS x 288 values][BS x 36 scales] (rows dense,
/// 4-byte aligned); the other sides' rows are 16-byte aligned.
struct ConvertParams {
  ConvertKind kind = ConvertKind::kFp8ToDs;
  CacheRef src;  ///< layer 0 view (NB, BS, E_src)
  CacheRef dst;  ///< layer 0 view (NB, BS, E_dst)
  int64_t layers = 1;
  int64_t src_layer_stride = 0;  ///< bytes
  int64_t dst_layer_stride = 0;  ///< bytes
  const int64_t* src_blocks = nullptr;
  const int64_t* dst_blocks = nullptr;
  int64_t count = 0;  ///< blocks to convert
  /// kDsToFp8, kFp4ToFp8: per listed block, set to 1 when any of its entries was not lossless; entries
  /// already 1 stay 1 (the caller zeroes it first). May be null.
  int32_t* not_lossless = nullptr;
  /// GPU only: the engine (kAuto: bulk where the views allow it, else staged, direct for
  /// kBf16ToDs) and the bulk engine's unit order. Neither changes the output.
  DatapathEngine engine = DatapathEngine::kAuto;
  ConvertUnitOrder unit_order = ConvertUnitOrder::kAuto;
};

Status validate_convert(const ConvertParams& p);

/// kUnsupported for the kinds launch_convert does not implement (the fp4 kinds: convert those on
/// the host with convert_cpu), Ok otherwise.
Status check_convert_on_device(ConvertKind kind);

/// CPU twin; host memory only.
Status convert_cpu(const ConvertParams& p, const CpuOptions& opt = {});

/// Daemon helper: converts blocks `src_blocks[i]` of a region described by `src_spec` at
/// `src_base` into `dst_blocks[i]` of `dst_spec` at `dst_base`, all layers, on the host. The specs
/// must have the same layers and block_size; their formats pick the kind. For kDsToFp8 and
/// kFp4ToFp8 the indices (into the lists) of blocks that were not lossless are appended to
/// `not_lossless`.
Status convert_blocks_cpu(const void* src_base, const KvCacheSpec& src_spec, std::span<const int64_t> src_blocks,
                          void* dst_base, const KvCacheSpec& dst_spec, std::span<const int64_t> dst_blocks,
                          const CpuOptions& opt = {}, std::vector<int64_t>* not_lossless = nullptr);

/// Builds the ConvertParams covering all layers of two specs (the lists are left null).
Result<ConvertParams> make_convert_params(const void* src_base, const KvCacheSpec& src_spec, void* dst_base,
                                          const KvCacheSpec& dst_spec);

#if defined(KVFERRY_WITH_CUDA)
/// Kinds 0..3 only (check_convert_on_device); others return cudaErrorInvalidValue.
cudaError_t launch_convert(const ConvertParams& p, cudaStream_t stream);
#endif

}  // namespace kvferry::kernels
