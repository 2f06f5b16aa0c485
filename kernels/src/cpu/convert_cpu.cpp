// CPU twin of the MLA format conversions (576 <-> 656, bf16 <-> 656) and the spec-level helper
// the daemon uses to convert staged blocks on the host.
#include <atomic>
#include <string>

#include "cpu/cpu_common.h"
#include "cpu/entry_ops.h"
#include "kvferry/kernels/convert.h"

namespace kvferry::kernels {
namespace {

struct KindShape {
  int64_t src_elems, src_eb, dst_elems, dst_eb;
};

KindShape shape_of(ConvertKind k) {
  switch (k) {
    case ConvertKind::kFp8ToDs: return {kMlaFp8Bytes, 1, kMlaDsBytes, 1};
    case ConvertKind::kDsToFp8: return {kMlaDsBytes, 1, kMlaFp8Bytes, 1};
    case ConvertKind::kBf16ToDs: return {kMlaDim, 2, kMlaDsBytes, 1};
    case ConvertKind::kDsToBf16: return {kMlaDsBytes, 1, kMlaDim, 2};
  }
  return {0, 0, 0, 0};
}

Status check_side(const CacheRef& c, const char* what, int64_t elems, int64_t eb, int64_t layers, int64_t stride) {
  KVFERRY_TRY(detail::check_cache(c, what, 3, elems, eb, 16));
  if (layers > 1) {
    if (stride <= 0 || stride % 16 != 0)
      return {ErrorCode::kInvalidArgument,
              std::string(what) + ": layer stride " + std::to_string(stride) + " B must be a positive multiple of 16"};
    CacheRef last = c;
    int64_t shift = 0;
    if (__builtin_mul_overflow(layers - 1, stride, &shift) ||
        __builtin_add_overflow(last.view.offset, shift, &last.view.offset))
      return {ErrorCode::kOverflow, std::string(what) + ": layer offsets overflow int64"};
    KVFERRY_TRY(detail::check_cache(last, what, 3, elems, eb, 16).with_context("last layer"));
  }
  return Status::Ok();
}

}  // namespace

Status validate_convert(const ConvertParams& p) {
  if (static_cast<int>(p.kind) > 3) return {ErrorCode::kInvalidArgument, "convert: unknown kind"};
  const KindShape s = shape_of(p.kind);
  if (p.layers < 1) return {ErrorCode::kInvalidArgument, "convert: layers must be >= 1"};
  if (p.count < 0) return {ErrorCode::kInvalidArgument, "convert: count is negative"};
  constexpr int64_t kMax31 = int64_t{1} << 31;  // the CUDA kernels walk entries in 32-bit parts
  if (p.layers >= kMax31 || p.count >= kMax31 || p.src.view.sizes[1] >= kMax31)
    return {ErrorCode::kOutOfRange, "convert: layers, count and the block size must each be below 2^31"};
  KVFERRY_TRY(check_side(p.src, "convert source", s.src_elems, s.src_eb, p.layers, p.src_layer_stride));
  KVFERRY_TRY(check_side(p.dst, "convert destination", s.dst_elems, s.dst_eb, p.layers, p.dst_layer_stride));
  if (p.src.view.size(1) != p.dst.view.size(1))
    return {ErrorCode::kInvalidArgument, "convert: source block size " + std::to_string(p.src.view.size(1)) +
                                             " differs from destination block size " +
                                             std::to_string(p.dst.view.size(1))};
  if ((p.src_blocks == nullptr) != (p.dst_blocks == nullptr))
    return {ErrorCode::kInvalidArgument, "convert: give both block lists or neither"};
  if (p.src_blocks == nullptr && (p.count > p.src.view.size(0) || p.count > p.dst.view.size(0)))
    return {ErrorCode::kOutOfRange, "convert: count " + std::to_string(p.count) + " exceeds the views' blocks"};
  return Status::Ok();
}

Status convert_cpu(const ConvertParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_convert(p));
  if (p.src_blocks) {
    for (int64_t i = 0; i < p.count; ++i) {
      if (p.src_blocks[i] < 0 || p.src_blocks[i] >= p.src.view.size(0))
        return {ErrorCode::kOutOfRange, "convert: source block " + std::to_string(p.src_blocks[i]) + " (entry " +
                                            std::to_string(i) + ") is outside the view's " +
                                            std::to_string(p.src.view.size(0)) + " blocks"};
      if (p.dst_blocks[i] < 0 || p.dst_blocks[i] >= p.dst.view.size(0))
        return {ErrorCode::kOutOfRange, "convert: destination block " + std::to_string(p.dst_blocks[i]) + " (entry " +
                                            std::to_string(i) + ") is outside the view's " +
                                            std::to_string(p.dst.view.size(0)) + " blocks"};
    }
  }
  const int64_t bs = p.src.view.size(1);
  parallel_for(p.layers * p.count, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t l = w / p.count, i = w % p.count;
      const int64_t sb = p.src_blocks ? p.src_blocks[i] : i;
      const int64_t db = p.dst_blocks ? p.dst_blocks[i] : i;
      bool ok = true;
      for (int64_t t = 0; t < bs; ++t) {
        const uint8_t* src = p.src.entry(sb, t) + l * p.src_layer_stride;
        uint8_t* dst = p.dst.entry(db, t) + l * p.dst_layer_stride;
        switch (p.kind) {
          case ConvertKind::kFp8ToDs: entry_fp8_to_ds(src, dst); break;
          case ConvertKind::kDsToFp8: ok &= entry_ds_to_fp8(src, dst); break;
          case ConvertKind::kBf16ToDs: entry_bf16_to_ds(src, dst); break;
          case ConvertKind::kDsToBf16: entry_ds_to_bf16(src, dst); break;
        }
      }
      if (!ok && p.not_lossless) std::atomic_ref<int32_t>(p.not_lossless[i]).store(1, std::memory_order_relaxed);
    }
  });
  return Status::Ok();
}

Result<ConvertParams> make_convert_params(const void* src_base, const KvCacheSpec& src_spec, void* dst_base,
                                          const KvCacheSpec& dst_spec) {
  KVFERRY_TRY(src_spec.validate().with_context("convert source spec"));
  KVFERRY_TRY(dst_spec.validate().with_context("convert destination spec"));
  if (src_spec.layers != dst_spec.layers || src_spec.block_size != dst_spec.block_size)
    return Result<ConvertParams>(ErrorCode::kInvalidArgument,
                                 "convert: specs differ in layers or block_size (" + std::to_string(src_spec.layers) +
                                     "x" + std::to_string(src_spec.block_size) + " vs " +
                                     std::to_string(dst_spec.layers) + "x" + std::to_string(dst_spec.block_size) + ")");
  ConvertParams p;
  const FormatKind s = src_spec.format.kind, d = dst_spec.format.kind;
  if (s == FormatKind::kMlaFp8 && d == FormatKind::kMlaFp8Ds)
    p.kind = ConvertKind::kFp8ToDs;
  else if (s == FormatKind::kMlaFp8Ds && d == FormatKind::kMlaFp8)
    p.kind = ConvertKind::kDsToFp8;
  else if (s == FormatKind::kMlaBf16 && d == FormatKind::kMlaFp8Ds)
    p.kind = ConvertKind::kBf16ToDs;
  else if (s == FormatKind::kMlaFp8Ds && d == FormatKind::kMlaBf16)
    p.kind = ConvertKind::kDsToBf16;
  else
    return Result<ConvertParams>(ErrorCode::kUnsupported, "convert: no conversion from " + src_spec.format.name() +
                                                              " to " + dst_spec.format.name());
  p.src = {const_cast<void*>(src_base), src_spec.region_bytes(), src_spec.layer_view(0)};
  p.dst = {dst_base, dst_spec.region_bytes(), dst_spec.layer_view(0)};
  p.layers = src_spec.layers;
  p.src_layer_stride = src_spec.layers > 1 ? src_spec.page_offset(1, 0) - src_spec.page_offset(0, 0) : 0;
  p.dst_layer_stride = dst_spec.layers > 1 ? dst_spec.page_offset(1, 0) - dst_spec.page_offset(0, 0) : 0;
  return p;
}

Status convert_blocks_cpu(const void* src_base, const KvCacheSpec& src_spec, std::span<const int64_t> src_blocks,
                          void* dst_base, const KvCacheSpec& dst_spec, std::span<const int64_t> dst_blocks,
                          const CpuOptions& opt, std::vector<int64_t>* not_lossless) {
  if (src_blocks.size() != dst_blocks.size())
    return {ErrorCode::kInvalidArgument, "convert: " + std::to_string(src_blocks.size()) + " source blocks but " +
                                             std::to_string(dst_blocks.size()) + " destination blocks"};
  KVFERRY_ASSIGN_OR_RETURN(ConvertParams p, make_convert_params(src_base, src_spec, dst_base, dst_spec));
  p.src_blocks = src_blocks.data();
  p.dst_blocks = dst_blocks.data();
  p.count = static_cast<int64_t>(src_blocks.size());
  std::vector<int32_t> flags;
  if (p.kind == ConvertKind::kDsToFp8) {
    flags.assign(src_blocks.size(), 0);
    p.not_lossless = flags.data();
  }
  KVFERRY_TRY(convert_cpu(p, opt));
  if (not_lossless)
    for (size_t i = 0; i < flags.size(); ++i)
      if (flags[i]) not_lossless->push_back(static_cast<int64_t>(i));
  return Status::Ok();
}

}  // namespace kvferry::kernels
