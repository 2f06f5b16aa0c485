// CPU twin of the MLA format conversions (576 <-> 656, bf16 <-> 656, the mla_fp4 ones) and the
// spec-level helper the daemon uses to convert staged blocks on the host.
#include <atomic>
#include <string>

#include "cpu/cpu_common.h"
#include "cpu/entry_ops.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/fp4.h"

namespace kvferry::kernels {
namespace {

struct Side {
  int64_t elems, eb;
  bool fp4;  ///< an mla_fp4 page view: (NB, BS, 324) u8, values then scales per page
};
struct KindShape {
  Side src, dst;
};

constexpr Side kBf16{kMlaDim, 2, false};
constexpr Side kFp8{kMlaFp8Bytes, 1, false};
constexpr Side kDs{kMlaDsBytes, 1, false};
constexpr Side kFp4{kMlaFp4Bytes, 1, true};

KindShape shape_of(ConvertKind k) {
  switch (k) {
    case ConvertKind::kFp8ToDs: return {kFp8, kDs};
    case ConvertKind::kDsToFp8: return {kDs, kFp8};
    case ConvertKind::kBf16ToDs: return {kBf16, kDs};
    case ConvertKind::kDsToBf16: return {kDs, kBf16};
    case ConvertKind::kBf16ToFp4: return {kBf16, kFp4};
    case ConvertKind::kFp4ToBf16: return {kFp4, kBf16};
    case ConvertKind::kFp8ToFp4: return {kFp8, kFp4};
    case ConvertKind::kFp4ToFp8: return {kFp4, kFp8};
    case ConvertKind::kDsToFp4: return {kDs, kFp4};
    case ConvertKind::kFp4ToDs: return {kFp4, kDs};
  }
  return {};
}

Status check_side(const CacheRef& c, const char* what, const Side& s, int64_t layers, int64_t stride) {
  const int64_t align = s.fp4 ? 4 : 16;  // fp4 pages are BS x 324 B: 4-byte aligned for every BS
  KVFERRY_TRY(detail::check_cache_layers(c, what, s.elems, s.eb, align, layers, stride));
  if (s.fp4 && c.view.sizes[1] > 1 && c.view.strides[1] != kMlaFp4Bytes)
    return {ErrorCode::kInvalidArgument,
            std::string(what) + ": mla_fp4 view " + c.view.to_string() + " must have dense pages (stride(1) = 324)"};
  return Status::Ok();
}

// ---- per-entry conversions through mla_fp4 (fp4.h's group code; `v`, `s`: the token's value
// and scale rows) ----

void entry_bf16_to_fp4(const uint8_t* src, uint8_t* v, uint8_t* s) {
  uint16_t x[kMlaFp4Group];
  for (int g = 0; g < kMlaFp4Groups; ++g) {
    std::memcpy(x, src + g * kMlaFp4Group * 2, sizeof x);
    s[g] = mla_fp4_quantize_group(x, v + g * kMlaFp4Group / 2);
  }
}

void entry_fp4_to_bf16(const uint8_t* v, const uint8_t* s, uint8_t* dst) {
  uint16_t x[kMlaFp4Group];
  for (int g = 0; g < kMlaFp4Groups; ++g) {
    mla_fp4_dequantize_group(v + g * kMlaFp4Group / 2, s[g], x);
    std::memcpy(dst + g * kMlaFp4Group * 2, x, sizeof x);
  }
}

void entry_fp8_to_fp4(const uint8_t* src, uint8_t* v, uint8_t* s) {
  const uint16_t* lut = detail::e4m3_bf16_table();
  uint16_t h[kMlaDim];
  for (int i = 0; i < kMlaDim; ++i) h[i] = lut[src[i]];
  entry_bf16_to_fp4(reinterpret_cast<const uint8_t*>(h), v, s);
}

/// False when a value is not an e4m3 value (the output is written either way).
bool entry_fp4_to_fp8(const uint8_t* v, const uint8_t* s, uint8_t* dst) {
  uint16_t h[kMlaDim];
  entry_fp4_to_bf16(v, s, reinterpret_cast<uint8_t*>(h));
  const uint8_t* to8 = detail::bf16_e4m3_table();
  const uint16_t* back = detail::e4m3_bf16_table();
  bool ok = true;
  for (int i = 0; i < kMlaDim; ++i) {
    dst[i] = to8[h[i]];
    ok &= back[dst[i]] == h[i];
  }
  return ok;
}

void entry_ds_to_fp4(const uint8_t* src, uint8_t* v, uint8_t* s) {
  alignas(16) uint8_t h[kMlaBf16Bytes];
  detail::entry_ds_to_bf16(src, h);
  entry_bf16_to_fp4(h, v, s);
}

void entry_fp4_to_ds(const uint8_t* v, const uint8_t* s, uint8_t* dst) {
  alignas(16) uint8_t h[kMlaBf16Bytes];
  entry_fp4_to_bf16(v, s, h);
  detail::entry_bf16_to_ds(h, dst);
}

}  // namespace

Status validate_convert(const ConvertParams& p) {
  if (static_cast<int>(p.kind) > 9) return {ErrorCode::kInvalidArgument, "convert: unknown kind"};
  const KindShape s = shape_of(p.kind);
  if (p.layers < 1) return {ErrorCode::kInvalidArgument, "convert: layers must be >= 1"};
  if (p.count < 0) return {ErrorCode::kInvalidArgument, "convert: count is negative"};
  KVFERRY_TRY(detail::check_engine(p.engine, "convert"));
  if (static_cast<int>(p.unit_order) > static_cast<int>(ConvertUnitOrder::kRanges))
    return {ErrorCode::kInvalidArgument, "convert: unit_order is not a ConvertUnitOrder"};
  constexpr int64_t kMax31 = int64_t{1} << 31;  // the CUDA kernels walk entries in 32-bit parts
  if (p.layers >= kMax31 || p.count >= kMax31 || p.src.view.sizes[1] >= kMax31)
    return {ErrorCode::kOutOfRange, "convert: layers, count and the block size must each be below 2^31"};
  KVFERRY_TRY(check_side(p.src, "convert source", s.src, p.layers, p.src_layer_stride));
  KVFERRY_TRY(check_side(p.dst, "convert destination", s.dst, p.layers, p.dst_layer_stride));
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

Status check_convert_on_device(ConvertKind kind) {
  if (is_fp4_convert(kind))
    return {ErrorCode::kUnsupported, "convert: the mla_fp4 conversions (kind " +
                                         std::to_string(static_cast<int>(kind)) +
                                         ") run on the host only (convert_cpu)"};
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
      // An mla_fp4 side's token t: values at t * 288, scales at BS * 288 + t * 36 of its page.
      const uint8_t* spage = p.src.entry(sb, 0) + l * p.src_layer_stride;
      uint8_t* dpage = p.dst.entry(db, 0) + l * p.dst_layer_stride;
      bool ok = true;
      for (int64_t t = 0; t < bs; ++t) {
        const uint8_t* src = p.src.entry(sb, t) + l * p.src_layer_stride;
        uint8_t* dst = p.dst.entry(db, t) + l * p.dst_layer_stride;
        const uint8_t* sv = spage + t * kMlaFp4ValueBytes;
        const uint8_t* ss = spage + bs * kMlaFp4ValueBytes + t * kMlaFp4ScaleBytes;
        uint8_t* dv = dpage + t * kMlaFp4ValueBytes;
        uint8_t* ds = dpage + bs * kMlaFp4ValueBytes + t * kMlaFp4ScaleBytes;
        switch (p.kind) {
          case ConvertKind::kFp8ToDs: entry_fp8_to_ds(src, dst); break;
          case ConvertKind::kDsToFp8: ok &= entry_ds_to_fp8(src, dst); break;
          case ConvertKind::kBf16ToDs: entry_bf16_to_ds(src, dst); break;
          case ConvertKind::kDsToBf16: entry_ds_to_bf16(src, dst); break;
          case ConvertKind::kBf16ToFp4: entry_bf16_to_fp4(src, dv, ds); break;
          case ConvertKind::kFp4ToBf16: entry_fp4_to_bf16(sv, ss, dst); break;
          case ConvertKind::kFp8ToFp4: entry_fp8_to_fp4(src, dv, ds); break;
          case ConvertKind::kFp4ToFp8: ok &= entry_fp4_to_fp8(sv, ss, dst); break;
          case ConvertKind::kDsToFp4: entry_ds_to_fp4(src, dv, ds); break;
          case ConvertKind::kFp4ToDs: entry_fp4_to_ds(sv, ss, dst); break;
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
  else if (s == FormatKind::kMlaBf16 && d == FormatKind::kMlaFp4)
    p.kind = ConvertKind::kBf16ToFp4;
  else if (s == FormatKind::kMlaFp4 && d == FormatKind::kMlaBf16)
    p.kind = ConvertKind::kFp4ToBf16;
  else if (s == FormatKind::kMlaFp8 && d == FormatKind::kMlaFp4)
    p.kind = ConvertKind::kFp8ToFp4;
  else if (s == FormatKind::kMlaFp4 && d == FormatKind::kMlaFp8)
    p.kind = ConvertKind::kFp4ToFp8;
  else if (s == FormatKind::kMlaFp8Ds && d == FormatKind::kMlaFp4)
    p.kind = ConvertKind::kDsToFp4;
  else if (s == FormatKind::kMlaFp4 && d == FormatKind::kMlaFp8Ds)
    p.kind = ConvertKind::kFp4ToDs;
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
  if (p.kind == ConvertKind::kDsToFp8 || p.kind == ConvertKind::kFp4ToFp8) {
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
