// CPU twins of the mla_fp4 quantize / dequantize kernels.
//
// Whose bytes these are: SGLang's MLA FP4 pool (MLATokenToKVPoolFP4 in
// sgl-project/sglang python/sglang/srt/mem_cache/memory_pool.py) writes a token through
// set_mla_kv_buffer: KVFP4QuantizeUtil.batched_quantize of the nope and of the rope part (the
// class is FP4MXBlock16KVQuantizeUtil, alias BlockFP4KVQuantizeUtil, in
// python/sglang/srt/layers/quantization/kvfp4_tensor.py since PR #21954; added by PR #10078), then
// set_mla_kv_buffer_triton / set_mla_kv_scale_buffer_triton (python/sglang/srt/mem_cache/utils.py)
// place nope then rope in the (m, 288) value row and the (m, 36) scale row. As 512 is a multiple of
// 16, that is the same as quantizing the 576 values in 36 groups of 16. batched_quantize, per group:
// scale exponent ceil(log2(clamp(amax / 6, min=1e-10))) stored + 127 as a uint8 (ue8m0, no global
// scale), values x / 2^e, magnitude = how many of the bounds 0.25 ... 5 it reaches (ties away from
// zero, not RNE), sign = value < 0, packed as (odd << 4) + even. batched_dequantize: table value
// times exp2(byte - 127) in fp32, then .to(bf16). fp4.h restates this as exact integer steps: amax
// / 6 of a bf16 amax is never within 0.5 % of a power of two unless it is one, so the fp32 division
// and log2 upstream cannot round across an exponent.
//
// FlashInfer's FP4 code differs and is not this format: its NVFP4 KV path (nvfp4_kv_quantize, used
// by SGLang's NVFP4 recipe for MHA) keeps e4m3 group scales under a per-layer fp32 global scale,
// and its MXFP4 helpers (flashinfer/cute_dsl/fp4_common.py cvt_f32_to_ue8m0: ceil(log2) + 127
// clamped to [0, 255]) round the e2m1 codes with the hardware cvt.rn.satfinite.e2m1x2.f32, i.e.
// RNE: it differs from SGLang's MLA writer on the ties 0.25, 1.25, 2.5 and 5 (times 2^e).
#include <cstring>
#include <string>

#include "cpu/cpu_common.h"
#include "kvferry/kernels/fp4.h"

namespace kvferry::kernels {
namespace {

Status check_side(const CacheRef& c, const char* what, int64_t row, int64_t eb, int64_t align, int64_t layers,
                  int64_t stride) {
  KVFERRY_TRY(detail::check_cache_layers(c, what, row, eb, align, layers, stride));
  if (c.view.strides[1] * eb < row && c.view.sizes[1] > 1)
    return {ErrorCode::kInvalidArgument, std::string(what) + ": rows of " + c.view.to_string() + " overlap"};
  return Status::Ok();
}

Status check_lists(const MlaFp4Params& p) {
  if (!p.bf16_blocks) return Status::Ok();
  for (int64_t i = 0; i < p.count; ++i) {
    if (p.bf16_blocks[i] < 0 || p.bf16_blocks[i] >= p.bf16.view.size(0))
      return {ErrorCode::kOutOfRange, "mla_fp4: bf16 block " + std::to_string(p.bf16_blocks[i]) + " (entry " +
                                          std::to_string(i) + ") is outside the view's " +
                                          std::to_string(p.bf16.view.size(0)) + " blocks"};
    if (p.fp4_blocks[i] < 0 || p.fp4_blocks[i] >= p.values.view.size(0))
      return {ErrorCode::kOutOfRange, "mla_fp4: fp4 block " + std::to_string(p.fp4_blocks[i]) + " (entry " +
                                          std::to_string(i) + ") is outside the views' " +
                                          std::to_string(p.values.view.size(0)) + " blocks"};
  }
  return Status::Ok();
}

// Runs fn(bf16 entry, value row, scale row) for every token of every listed block and layer.
template <class Fn>
void for_each_entry(const MlaFp4Params& p, const CpuOptions& opt, Fn&& fn) {
  const int64_t bs = p.bf16.view.size(1);
  detail::parallel_for(p.layers * p.count, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t l = w / p.count, i = w % p.count;
      const int64_t hb = p.bf16_blocks ? p.bf16_blocks[i] : i;
      const int64_t fb = p.fp4_blocks ? p.fp4_blocks[i] : i;
      for (int64_t t = 0; t < bs; ++t)
        fn(p.bf16.entry(hb, t) + l * p.bf16_layer_stride, p.values.entry(fb, t) + l * p.fp4_layer_stride,
           p.scales.entry(fb, t) + l * p.fp4_layer_stride);
    }
  });
}

}  // namespace

Status validate_mla_fp4(const MlaFp4Params& p) {
  if (p.layers < 1) return {ErrorCode::kInvalidArgument, "mla_fp4: layers must be >= 1"};
  if (p.count < 0) return {ErrorCode::kInvalidArgument, "mla_fp4: count is negative"};
  KVFERRY_TRY(check_side(p.bf16, "mla_fp4 bf16", kMlaDim, 2, 16, p.layers, p.bf16_layer_stride));
  KVFERRY_TRY(check_side(p.values, "mla_fp4 values", kMlaFp4ValueBytes, 1, 4, p.layers, p.fp4_layer_stride));
  KVFERRY_TRY(check_side(p.scales, "mla_fp4 scales", kMlaFp4ScaleBytes, 1, 4, p.layers, p.fp4_layer_stride));
  // The CUDA kernels walk layers x count x BS x 36 groups with one int64 index.
  int64_t groups = 0;
  if (__builtin_mul_overflow(p.layers, p.count, &groups) ||
      __builtin_mul_overflow(groups, p.bf16.view.sizes[1], &groups) ||
      __builtin_mul_overflow(groups, int64_t{kMlaFp4Groups}, &groups))
    return {ErrorCode::kOverflow, "mla_fp4: layers x count x block size x 36 overflows int64"};
  if (p.bf16.view.size(1) != p.values.view.size(1) || p.values.view.size(1) != p.scales.view.size(1))
    return {ErrorCode::kInvalidArgument, "mla_fp4: block sizes differ (bf16 " + std::to_string(p.bf16.view.size(1)) +
                                             ", values " + std::to_string(p.values.view.size(1)) + ", scales " +
                                             std::to_string(p.scales.view.size(1)) + ")"};
  if (p.values.view.size(0) != p.scales.view.size(0))
    return {ErrorCode::kInvalidArgument, "mla_fp4: the value view has " + std::to_string(p.values.view.size(0)) +
                                             " blocks but the scale view " + std::to_string(p.scales.view.size(0))};
  if ((p.bf16_blocks == nullptr) != (p.fp4_blocks == nullptr))
    return {ErrorCode::kInvalidArgument, "mla_fp4: give both block lists or neither"};
  if (p.bf16_blocks == nullptr && (p.count > p.bf16.view.size(0) || p.count > p.values.view.size(0)))
    return {ErrorCode::kOutOfRange, "mla_fp4: count " + std::to_string(p.count) + " exceeds the views' blocks"};
  return Status::Ok();
}

Status quantize_mla_fp4_cpu(const MlaFp4Params& p, const CpuOptions& opt) {
  KVFERRY_TRY(validate_mla_fp4(p));
  KVFERRY_TRY(check_lists(p));
  for_each_entry(p, opt, [](const uint8_t* src, uint8_t* values, uint8_t* scales) {
    uint16_t x[kMlaFp4Group];
    for (int g = 0; g < kMlaFp4Groups; ++g) {
      std::memcpy(x, src + g * kMlaFp4Group * 2, sizeof x);
      scales[g] = mla_fp4_quantize_group(x, values + g * kMlaFp4Group / 2);
    }
  });
  return Status::Ok();
}

Status dequantize_mla_fp4_cpu(const MlaFp4Params& p, const CpuOptions& opt) {
  KVFERRY_TRY(validate_mla_fp4(p));
  KVFERRY_TRY(check_lists(p));
  for_each_entry(p, opt, [](uint8_t* dst, const uint8_t* values, const uint8_t* scales) {
    uint16_t x[kMlaFp4Group];
    for (int g = 0; g < kMlaFp4Groups; ++g) {
      mla_fp4_dequantize_group(values + g * kMlaFp4Group / 2, scales[g], x);
      std::memcpy(dst + g * kMlaFp4Group * 2, x, sizeof x);
    }
  });
  return Status::Ok();
}

Result<MlaFp4Params> make_mla_fp4_params(const void* bf16_base, const KvCacheSpec& bf16_spec, const void* fp4_base,
                                         const KvCacheSpec& fp4_spec) {
  KVFERRY_TRY(bf16_spec.validate().with_context("mla_fp4 bf16 spec"));
  KVFERRY_TRY(fp4_spec.validate().with_context("mla_fp4 spec"));
  if (bf16_spec.format.kind != FormatKind::kMlaBf16 || fp4_spec.format.kind != FormatKind::kMlaFp4)
    return Result<MlaFp4Params>(ErrorCode::kInvalidArgument, "mla_fp4: expected an mla_bf16 and an mla_fp4 spec, got " +
                                                                 bf16_spec.format.name() + " and " +
                                                                 fp4_spec.format.name());
  if (bf16_spec.layers != fp4_spec.layers || bf16_spec.block_size != fp4_spec.block_size)
    return Result<MlaFp4Params>(ErrorCode::kInvalidArgument,
                                "mla_fp4: specs differ in layers or block_size (" + std::to_string(bf16_spec.layers) +
                                    "x" + std::to_string(bf16_spec.block_size) + " vs " +
                                    std::to_string(fp4_spec.layers) + "x" + std::to_string(fp4_spec.block_size) + ")");
  MlaFp4Params p;
  void* hb = const_cast<void*>(bf16_base);
  void* fb = const_cast<void*>(fp4_base);
  p.bf16 = {hb, bf16_spec.region_bytes(), bf16_spec.layer_view(0)};
  p.values = {fb, fp4_spec.region_bytes(), fp4_spec.mla_fp4_values_view(0)};
  p.scales = {fb, fp4_spec.region_bytes(), fp4_spec.mla_fp4_scales_view(0)};
  p.layers = bf16_spec.layers;
  p.bf16_layer_stride = bf16_spec.layers > 1 ? bf16_spec.page_offset(1, 0) - bf16_spec.page_offset(0, 0) : 0;
  p.fp4_layer_stride = fp4_spec.layers > 1 ? fp4_spec.page_offset(1, 0) - fp4_spec.page_offset(0, 0) : 0;
  return p;
}

}  // namespace kvferry::kernels
