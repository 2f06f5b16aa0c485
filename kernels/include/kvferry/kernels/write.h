#pragma once
// Cache writers: concat_and_cache_mla (bf16 / mla_fp8 / mla_fp8_ds), the MHA K/V writer and
// indexer_k_quant_and_cache. Each has a CUDA launcher and a CPU twin with the same contract and
// bit-identical output. Tokens whose slot is negative are skipped (CUDA-graph padding); slot s
// addresses block s / BS, token s % BS of the cache view. Slots of one call must be distinct
// (two tokens writing one slot leave either one, as in the engines' own writers).
#include <cstdint>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels {

/// What write_mla stores at a slot (kernels-spec §2).
enum class MlaWriteMode : uint8_t {
  kCopy = 0,   ///< cache bf16/fp16 (E = 576), same dtype as the inputs: bit copies of nope then rope
  kFp8 = 1,    ///< cache mla_fp8 (E = 576 bytes): e4m3(x / scale), RNE, saturating to +-448
  kFp8Ds = 2,  ///< cache mla_fp8_ds (E = 656 bytes): per-128 tile scale max(amax/448, FLT_MIN)
};

/// concat_and_cache_mla. Inputs are rows of 2-byte floats (`input_dtype` bf16 or fp16; kFp8Ds
/// needs bf16), 16-byte aligned, innermost stride 1; `slots` (int64, `tokens` entries) lives
/// where the code runs (device memory for the launcher, host for the CPU twin).
struct WriteMlaParams {
  const void* kv_c = nullptr;  ///< [tokens, 512]
  int64_t kv_c_stride = 512;   ///< elements between rows
  const void* k_pe = nullptr;  ///< [tokens, 64]
  int64_t k_pe_stride = 64;
  DType input_dtype = DType::kBF16;
  const int64_t* slots = nullptr;
  int64_t tokens = 0;
  CacheRef cache;  ///< (NB, BS, E): bf16/fp16 576, or u8/fp8 576, or u8 656
  MlaWriteMode mode = MlaWriteMode::kCopy;
  float scale = 1.0f;                             ///< kFp8 only
  DatapathEngine engine = DatapathEngine::kAuto;  ///< GPU only; kAuto = the measured default
};

/// MHA/GQA writer: K and V rows `[tokens, heads, head_dim]` into the K and V planes (views
/// `(NB, BS, H, D)` from KvCacheSpec::kv_view, NHD or HND). Same dtype: bit copy; fp8 cache:
/// e4m3(float(x) / scale). head_dim must be a multiple of 8; rows 16-byte aligned.
struct WriteMhaParams {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t key_stride = 0;    ///< elements between tokens (heads * head_dim when packed)
  int64_t value_stride = 0;  ///< elements between tokens
  DType input_dtype = DType::kBF16;
  const int64_t* slots = nullptr;
  int64_t tokens = 0;
  CacheRef k_cache;  ///< K plane view (NB, BS, H, D)
  CacheRef v_cache;  ///< V plane view (NB, BS, H, D); may share base with k_cache
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  DatapathEngine engine = DatapathEngine::kAuto;  ///< GPU only; kAuto = the measured default
};

/// indexer_k_quant_and_cache (kernels-spec §5): k rows [tokens, 128] bf16/fp16 into a u8 cache
/// view (NB, BS, 132) whose block b starts at b * stride(0): values (BS x 128 e4m3, token-major)
/// then BS fp32 scales. s = max(amax, 1e-4) / 448; with ue8m0 rounded up to a power of two.
struct IndexerWriteParams {
  const void* k = nullptr;
  int64_t k_stride = 128;
  DType input_dtype = DType::kBF16;
  const int64_t* slots = nullptr;
  int64_t tokens = 0;
  CacheRef cache;
  bool ue8m0 = false;
  DatapathEngine engine = DatapathEngine::kAuto;  ///< GPU only; kAuto = the measured default
};

/// Shape checks shared by the launcher and the CPU twin (not the slot values: the CPU twin checks
/// those; the CUDA kernels skip slots outside [0, NB*BS)). The message names the culprit.
Status validate_write_mla(const WriteMlaParams& p);
Status validate_write_mha(const WriteMhaParams& p);
Status validate_indexer_write(const IndexerWriteParams& p);

/// CPU twins: validate (also every slot < NB*BS), then write. Host memory only.
Status write_mla_cpu(const WriteMlaParams& p, const CpuOptions& opt = {});
Status write_mha_cpu(const WriteMhaParams& p, const CpuOptions& opt = {});
Status indexer_write_cpu(const IndexerWriteParams& p, const CpuOptions& opt = {});

#if defined(KVFERRY_WITH_CUDA)
/// CUDA launchers: asynchronous on `stream`; the caller validated the params.
cudaError_t launch_write_mla(const WriteMlaParams& p, cudaStream_t stream);
cudaError_t launch_write_mha(const WriteMhaParams& p, cudaStream_t stream);
cudaError_t launch_indexer_write(const IndexerWriteParams& p, cudaStream_t stream);
#endif

}  // namespace kvferry::kernels
