#pragma once
// Prefill gathers (kernels-spec §3, §7.3): cp_gather_cache (raw copy), gather_and_maybe_dequant_cache
// (fp8 x scale -> bf16), the 656 B -> bf16 upconvert gather, and the slot-list dequantize of a
// 656 B cache (dequantize_k_cache_paged). CUDA launchers and CPU twins, bit-identical.
#include <cstdint>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels {

enum class GatherMode : uint8_t {
  kCopy = 0,        ///< dst row = the entry's bytes (dst dtype = cache dtype)
  kDequantFp8 = 1,  ///< fp8 cache (E elements) -> bf16 rows: bf16(float(e4m3) * scale)
  kDequantDs = 2,   ///< 656 B cache -> bf16 rows of 576: nope e4m3 x tile scale, rope copied
};

/// dst row j of request r (cu_seq_lens[r] <= j < cu_seq_lens[r+1]) is token
/// p = j - cu_seq_lens[r] + (seq_starts ? seq_starts[r] : 0) of the request, found at block
/// block_table[r * block_table_stride + p / BS], token p % BS. Index arrays (int32) live where the
/// code runs. Rows must be 16-byte aligned for kDequant* modes.
struct GatherParams {
  CacheRef cache;  ///< (NB, BS, E)
  void* dst = nullptr;
  int64_t dst_stride = 0;  ///< elements of the dst dtype between rows
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  const int32_t* cu_seq_lens = nullptr;  ///< [batch + 1]
  const int32_t* seq_starts = nullptr;   ///< [batch] or null
  int64_t batch = 0;
  int64_t total_rows = 0;  ///< = cu_seq_lens[batch]; rows past it are not touched
  GatherMode mode = GatherMode::kCopy;
  float scale = 1.0f;                             ///< kDequantFp8
  DatapathEngine engine = DatapathEngine::kAuto;  ///< GPU only; kAuto = the measured default
};

/// dequantize_k_cache_paged: dst row i (576 bf16) = dequant of the 656 B entry at global slot
/// slots[i] (block slot / BS, token slot % BS). Negative slots leave the row untouched.
struct DequantPagedParams {
  CacheRef cache;  ///< u8 (NB, BS, 656)
  const int32_t* slots = nullptr;
  int64_t count = 0;
  void* dst = nullptr;  ///< bf16 rows
  int64_t dst_stride = 576;
  DatapathEngine engine = DatapathEngine::kAuto;  ///< GPU only; kAuto = the measured default
};

Status validate_gather(const GatherParams& p);
Status validate_dequant_paged(const DequantPagedParams& p);

/// CPU twins (also check cu_seq_lens, block ids and slots against the cache).
Status gather_cpu(const GatherParams& p, const CpuOptions& opt = {});
Status dequant_paged_cpu(const DequantPagedParams& p, const CpuOptions& opt = {});

#if defined(KVFERRY_WITH_CUDA)
cudaError_t launch_gather(const GatherParams& p, cudaStream_t stream);
cudaError_t launch_dequant_paged(const DequantPagedParams& p, cudaStream_t stream);
#endif

}  // namespace kvferry::kernels
