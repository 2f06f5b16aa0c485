// CPU twins of the gathers (cp_gather_cache, gather_and_maybe_dequant_cache, 656 -> bf16
// upconvert gather, dequantize_k_cache_paged) and their validators.
#include <algorithm>
#include <cstring>
#include <string>

#include "cpu/cpu_common.h"
#include "cpu/entry_ops.h"
#include "kvferry/kernels/gather.h"

namespace kvferry::kernels {

Status validate_gather(const GatherParams& p) {
  using namespace detail;
  if (p.batch < 0 || p.total_rows < 0)
    return {ErrorCode::kInvalidArgument, "gather: batch and total_rows must not be negative"};
  KVFERRY_TRY(check_engine(p.engine, "gather"));
  if (p.batch > 0 && (p.block_table == nullptr || p.cu_seq_lens == nullptr))
    return {ErrorCode::kInvalidArgument, "gather: block_table and cu_seq_lens are required"};
  if (p.block_table_stride < 0) return {ErrorCode::kInvalidArgument, "gather: block_table_stride is negative"};
  const int64_t e = p.cache.view.size(-1);
  switch (p.mode) {
    case GatherMode::kCopy: {
      const int64_t eb = dtype_size(p.cache.view.dtype);
      KVFERRY_TRY(check_cache(p.cache, "gather cache", 3, e, eb, eb));
      return check_rows(p.dst, p.total_rows, p.dst_stride, e, eb, eb, "gather: dst");
    }
    case GatherMode::kDequantFp8:
      if (e % 8 != 0)
        return {ErrorCode::kInvalidArgument, "gather: fp8 entry of " + std::to_string(e) + " is not a multiple of 8"};
      KVFERRY_TRY(check_cache(p.cache, "gather cache", 3, e, 1, 8));
      if (!std::isfinite(p.scale)) return {ErrorCode::kInvalidArgument, "gather: scale is not finite"};
      return check_rows(p.dst, p.total_rows, p.dst_stride, e, 2, 16, "gather: dst");
    case GatherMode::kDequantDs:
      KVFERRY_TRY(check_cache(p.cache, "gather cache", 3, kMlaDsBytes, 1, 16));
      return check_rows(p.dst, p.total_rows, p.dst_stride, kMlaDim, 2, 16, "gather: dst");
  }
  return {ErrorCode::kInvalidArgument, "gather: unknown mode"};
}

Status gather_cpu(const GatherParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_gather(p));
  const TensorView& v = p.cache.view;
  const int64_t nb = v.size(0), bs = v.size(1), e = v.size(2);
  if (p.batch > 0) {
    if (p.cu_seq_lens[0] != 0) return {ErrorCode::kInvalidArgument, "gather: cu_seq_lens[0] is not 0"};
    if (p.cu_seq_lens[p.batch] != p.total_rows)
      return {ErrorCode::kInvalidArgument, "gather: cu_seq_lens[batch] = " + std::to_string(p.cu_seq_lens[p.batch]) +
                                               " but total_rows = " + std::to_string(p.total_rows)};
    for (int64_t r = 0; r < p.batch; ++r) {
      const int64_t len = p.cu_seq_lens[r + 1] - p.cu_seq_lens[r];
      if (len < 0)
        return {ErrorCode::kInvalidArgument, "gather: cu_seq_lens decreases at request " + std::to_string(r)};
      const int64_t start = p.seq_starts ? p.seq_starts[r] : 0;
      if (start < 0) return {ErrorCode::kInvalidArgument, "gather: seq_starts[" + std::to_string(r) + "] is negative"};
      if (len == 0) continue;
      const int64_t last_blk = (start + len - 1) / bs;
      if (last_blk >= p.block_table_stride)
        return {ErrorCode::kOutOfRange, "gather: request " + std::to_string(r) + " needs block-table column " +
                                            std::to_string(last_blk) + " past its " +
                                            std::to_string(p.block_table_stride) + " columns"};
      for (int64_t c = start / bs; c <= last_blk; ++c) {
        const int64_t b = p.block_table[r * p.block_table_stride + c];
        if (b < 0 || b >= nb)
          return {ErrorCode::kOutOfRange, "gather: block id " + std::to_string(b) + " of request " + std::to_string(r) +
                                              " is outside the cache's " + std::to_string(nb) + " blocks"};
      }
    }
  } else if (p.total_rows != 0) {
    return {ErrorCode::kInvalidArgument, "gather: total_rows > 0 with no requests"};
  }
  const int64_t dst_eb = p.mode == GatherMode::kCopy ? dtype_size(v.dtype) : 2;
  parallel_for(p.total_rows, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int32_t* hi = std::upper_bound(p.cu_seq_lens, p.cu_seq_lens + p.batch + 1, static_cast<int32_t>(j));
      const int64_t r = (hi - p.cu_seq_lens) - 1;
      const int64_t pos = j - p.cu_seq_lens[r] + (p.seq_starts ? p.seq_starts[r] : 0);
      const int64_t blk = p.block_table[r * p.block_table_stride + pos / bs];
      const uint8_t* src = p.cache.entry(blk, pos % bs);
      uint8_t* dst = static_cast<uint8_t*>(p.dst) + j * p.dst_stride * dst_eb;
      switch (p.mode) {
        case GatherMode::kCopy: std::memcpy(dst, src, static_cast<size_t>(e * dst_eb)); break;
        case GatherMode::kDequantFp8:
          for (int64_t i = 0; i < e; ++i) st16(dst, i, float_to_bf16(e4m3_float_table()[src[i]] * p.scale));
          break;
        case GatherMode::kDequantDs: entry_ds_to_bf16(src, dst); break;
      }
    }
  });
  return Status::Ok();
}

Status validate_dequant_paged(const DequantPagedParams& p) {
  using namespace detail;
  if (p.count < 0) return {ErrorCode::kInvalidArgument, "dequant_paged: count is negative"};
  KVFERRY_TRY(check_engine(p.engine, "dequant_paged"));
  if (p.count > 0 && p.slots == nullptr) return {ErrorCode::kInvalidArgument, "dequant_paged: slots is null"};
  KVFERRY_TRY(check_cache(p.cache, "dequant_paged cache", 3, kMlaDsBytes, 1, 16));
  return check_rows(p.dst, p.count, p.dst_stride, kMlaDim, 2, 16, "dequant_paged: dst");
}

Status dequant_paged_cpu(const DequantPagedParams& p, const CpuOptions& opt) {
  using namespace detail;
  KVFERRY_TRY(validate_dequant_paged(p));
  const int64_t bs = p.cache.view.size(1), limit = p.cache.view.size(0) * bs;
  for (int64_t i = 0; i < p.count; ++i)
    if (p.slots[i] >= limit)
      return {ErrorCode::kOutOfRange, "dequant_paged: slot " + std::to_string(p.slots[i]) + " of row " +
                                          std::to_string(i) + " is past the cache's " + std::to_string(limit) +
                                          " slots"};
  parallel_for(p.count, opt.threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = p.slots[i];
      if (s < 0) continue;
      entry_ds_to_bf16(p.cache.entry(s / bs, s % bs), static_cast<uint8_t*>(p.dst) + i * p.dst_stride * 2);
    }
  });
  return Status::Ok();
}

}  // namespace kvferry::kernels
