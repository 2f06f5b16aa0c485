// CPU twins of the cache writers (write_mla, write_mha, indexer_write) and their validators.
#include <cstring>
#include <string>

#include "common/datapath_math.h"
#include "cpu/cpu_common.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

bool is_half(DType d) { return d == DType::kBF16 || d == DType::kFP16; }

uint16_t load_u16(const void* p, int64_t i) {
  uint16_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(p) + 2 * i, 2);
  return v;
}

}  // namespace

Status validate_write_mla(const WriteMlaParams& p) {
  using namespace detail;
  if (p.tokens < 0) return {ErrorCode::kInvalidArgument, "write_mla: tokens is negative"};
  KVFERRY_TRY(check_engine(p.engine, "write_mla"));
  if (!is_half(p.input_dtype))
    return {ErrorCode::kInvalidArgument,
            "write_mla: input dtype " + std::string(dtype_name(p.input_dtype)) + " is not bf16 or fp16"};
  if (p.mode == MlaWriteMode::kFp8Ds && p.input_dtype != DType::kBF16)
    return {ErrorCode::kInvalidArgument, "write_mla: mla_fp8_ds needs bf16 inputs"};
  KVFERRY_TRY(check_rows(p.kv_c, p.tokens, p.kv_c_stride, kMlaRank, 2, 16, "write_mla: kv_c"));
  KVFERRY_TRY(check_rows(p.k_pe, p.tokens, p.k_pe_stride, kMlaRope, 2, 16, "write_mla: k_pe"));
  if (p.tokens > 0 && p.slots == nullptr) return {ErrorCode::kInvalidArgument, "write_mla: slot mapping is null"};
  switch (p.mode) {
    case MlaWriteMode::kCopy:
      KVFERRY_TRY(check_cache(p.cache, "write_mla cache", 3, kMlaDim, 2, 16));
      if (p.cache.view.dtype != p.input_dtype)
        return {ErrorCode::kInvalidArgument, "write_mla: cache dtype " + std::string(dtype_name(p.cache.view.dtype)) +
                                                 " differs from the input dtype " +
                                                 std::string(dtype_name(p.input_dtype))};
      return Status::Ok();
    case MlaWriteMode::kFp8:
      if (!(p.scale > 0.0f) || !std::isfinite(p.scale))
        return {ErrorCode::kInvalidArgument, "write_mla: fp8 scale " + std::to_string(p.scale) + " is not positive"};
      return check_cache(p.cache, "write_mla cache", 3, kMlaFp8Bytes, 1, 16);
    case MlaWriteMode::kFp8Ds: return check_cache(p.cache, "write_mla cache", 3, kMlaDsBytes, 1, 16);
  }
  return {ErrorCode::kInvalidArgument, "write_mla: unknown mode"};
}

Status write_mla_cpu(const WriteMlaParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_write_mla(p));
  const int64_t bs = p.cache.view.size(1);
  KVFERRY_TRY(check_slots(p.slots, p.tokens, p.cache.view.size(0) * bs));
  const bool bf16 = p.input_dtype == DType::kBF16;
  parallel_for(p.tokens, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t s = p.slots[n];
      if (s < 0) continue;
      uint8_t* dst = p.cache.entry(s / bs, s % bs);
      const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
      const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
      switch (p.mode) {
        case MlaWriteMode::kCopy:
          std::memcpy(dst, nope, kMlaRank * 2);
          std::memcpy(dst + kMlaRank * 2, rope, kMlaRope * 2);
          break;
        case MlaWriteMode::kFp8:
          for (int i = 0; i < kMlaRank; ++i) dst[i] = quant_e4m3(half_to_float(load_u16(nope, i), bf16), p.scale);
          for (int i = 0; i < kMlaRope; ++i)
            dst[kMlaRank + i] = quant_e4m3(half_to_float(load_u16(rope, i), bf16), p.scale);
          break;
        case MlaWriteMode::kFp8Ds:
          for (int t = 0; t < kMlaTiles; ++t) {
            float amax = 0.0f;
            for (int i = t * kMlaTile; i < (t + 1) * kMlaTile; ++i)
              amax = fmax_f(amax, abs_f(bf16_to_float(load_u16(nope, i))));
            const float sc = ds_tile_scale(amax);
            for (int i = t * kMlaTile; i < (t + 1) * kMlaTile; ++i)
              dst[i] = quant_e4m3(bf16_to_float(load_u16(nope, i)), sc);
            std::memcpy(dst + kMlaDsScaleOffset + 4 * t, &sc, 4);
          }
          std::memcpy(dst + kMlaDsRopeOffset, rope, kMlaRope * 2);
          break;
      }
    }
  });
  return Status::Ok();
}

Status validate_write_mha(const WriteMhaParams& p) {
  using namespace detail;
  if (p.tokens < 0) return {ErrorCode::kInvalidArgument, "write_mha: tokens is negative"};
  KVFERRY_TRY(check_engine(p.engine, "write_mha"));
  if (!is_half(p.input_dtype))
    return {ErrorCode::kInvalidArgument,
            "write_mha: input dtype " + std::string(dtype_name(p.input_dtype)) + " is not bf16 or fp16"};
  const TensorView& kv = p.k_cache.view;
  const DType cd = kv.dtype;
  if (cd != p.input_dtype && cd != DType::kFP8E4M3)
    return {ErrorCode::kInvalidArgument,
            "write_mha: cache dtype " + std::string(dtype_name(cd)) + " is neither the input dtype nor fp8_e4m3"};
  if (p.v_cache.view.dtype != cd) return {ErrorCode::kInvalidArgument, "write_mha: K and V planes differ in dtype"};
  const int64_t eb = dtype_size(cd);
  const int64_t align = eb == 1 ? 8 : 16;
  if (kv.rank != 4) return {ErrorCode::kInvalidArgument, "write_mha: K view " + kv.to_string() + " is not rank 4"};
  const int64_t d = kv.size(3), h = kv.size(2);
  if (d % 8 != 0)
    return {ErrorCode::kInvalidArgument, "write_mha: head_dim " + std::to_string(d) + " is not a multiple of 8"};
  KVFERRY_TRY(check_cache(p.k_cache, "write_mha K plane", 4, d, eb, align));
  KVFERRY_TRY(check_cache(p.v_cache, "write_mha V plane", 4, d, eb, align));
  for (int i = 0; i < 4; ++i)
    if (p.v_cache.view.sizes[i] != kv.sizes[i])
      return {ErrorCode::kInvalidArgument,
              "write_mha: V view " + p.v_cache.view.to_string() + " differs in shape from K view " + kv.to_string()};
  if (p.tokens > 0 && p.slots == nullptr) return {ErrorCode::kInvalidArgument, "write_mha: slot mapping is null"};
  KVFERRY_TRY(check_rows(p.key, p.tokens, p.key_stride, h * d, 2, 16, "write_mha: key"));
  KVFERRY_TRY(check_rows(p.value, p.tokens, p.value_stride, h * d, 2, 16, "write_mha: value"));
  if (cd == DType::kFP8E4M3 &&
      (!(p.k_scale > 0.0f) || !(p.v_scale > 0.0f) || !std::isfinite(p.k_scale) || !std::isfinite(p.v_scale)))
    return {ErrorCode::kInvalidArgument, "write_mha: fp8 scales must be positive and finite"};
  return Status::Ok();
}

Status write_mha_cpu(const WriteMhaParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_write_mha(p));
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.size(1), h = kv.size(2), d = kv.size(3);
  KVFERRY_TRY(check_slots(p.slots, p.tokens, kv.size(0) * bs));
  const bool fp8 = kv.dtype == DType::kFP8E4M3;
  const bool bf16 = p.input_dtype == DType::kBF16;
  const int64_t eb = dtype_size(kv.dtype);
  parallel_for(p.tokens, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t s = p.slots[n];
      if (s < 0) continue;
      for (int plane = 0; plane < 2; ++plane) {
        const CacheRef& c = plane == 0 ? p.k_cache : p.v_cache;
        const uint8_t* src = static_cast<const uint8_t*>(plane == 0 ? p.key : p.value) +
                             n * (plane == 0 ? p.key_stride : p.value_stride) * 2;
        const float sc = plane == 0 ? p.k_scale : p.v_scale;
        uint8_t* entry = c.entry(s / bs, s % bs);
        for (int64_t hh = 0; hh < h; ++hh) {
          uint8_t* dst = entry + hh * c.view.strides[2] * eb;
          const uint8_t* row = src + hh * d * 2;
          if (!fp8) {
            std::memcpy(dst, row, static_cast<size_t>(d * 2));
          } else {
            for (int64_t i = 0; i < d; ++i) dst[i] = quant_e4m3(half_to_float(load_u16(row, i), bf16), sc);
          }
        }
      }
    }
  });
  return Status::Ok();
}

Status validate_indexer_write(const IndexerWriteParams& p) {
  using namespace detail;
  if (p.tokens < 0) return {ErrorCode::kInvalidArgument, "indexer_write: tokens is negative"};
  KVFERRY_TRY(check_engine(p.engine, "indexer_write"));
  if (!is_half(p.input_dtype))
    return {ErrorCode::kInvalidArgument,
            "indexer_write: input dtype " + std::string(dtype_name(p.input_dtype)) + " is not bf16 or fp16"};
  KVFERRY_TRY(check_rows(p.k, p.tokens, p.k_stride, kIndexerHeadDim, 2, 8, "indexer_write: k"));
  KVFERRY_TRY(check_cache(p.cache, "indexer_write cache", 3, kIndexerBytes, 1, 4));
  if (p.cache.view.stride(1) != kIndexerBytes)
    return {ErrorCode::kInvalidArgument, "indexer_write: cache view " + p.cache.view.to_string() +
                                             " must have stride(1) == 132 (a block is values then scales)"};
  if (p.tokens > 0 && p.slots == nullptr) return {ErrorCode::kInvalidArgument, "indexer_write: slot mapping is null"};
  return Status::Ok();
}

Status indexer_write_cpu(const IndexerWriteParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_indexer_write(p));
  const int64_t bs = p.cache.view.size(1);
  KVFERRY_TRY(check_slots(p.slots, p.tokens, p.cache.view.size(0) * bs));
  const bool bf16 = p.input_dtype == DType::kBF16;
  parallel_for(p.tokens, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t s = p.slots[n];
      if (s < 0) continue;
      const int64_t off = s % bs;
      uint8_t* block = p.cache.entry(s / bs, 0);
      const uint8_t* row = static_cast<const uint8_t*>(p.k) + n * p.k_stride * 2;
      float amax = 0.0f;
      for (int i = 0; i < kIndexerHeadDim; ++i) amax = fmax_f(amax, abs_f(half_to_float(load_u16(row, i), bf16)));
      const float sc = indexer_scale(amax, p.ue8m0);
      uint8_t* vals = block + off * kIndexerHeadDim;
      for (int i = 0; i < kIndexerHeadDim; ++i) vals[i] = quant_e4m3(half_to_float(load_u16(row, i), bf16), sc);
      std::memcpy(block + bs * kIndexerHeadDim + off * 4, &sc, 4);
    }
  });
  return Status::Ok();
}

}  // namespace kvferry::kernels
