#pragma once
// Paged decode attention for MHA / GQA / MQA over K and V given as two separate strided views
// (kernels-spec §4.3 math, §9 strided contract). One query token per request.
//
//   q  [B, Hq, Dk]               bf16 | fp16 (any strides, last dim contiguous)
//   K  [blocks, page, Hkv, Dk]   dtype of q, or fp8 e4m3 (per-tensor k_scale)
//   V  [blocks, page, Hkv, Dv]   dtype of K (per-tensor v_scale when fp8)
//   o  [B, Hq, Dv]               dtype of q
//   lse[B, Hq]                   fp32, natural log; -inf (and o = 0) for an empty sequence
//
// K and V carry their own int64 page / token / head strides, so the same call runs on a layer
// view of a block-major (cross-layer) buffer, on HND or NHD planes, and on V as a slice of a
// combined K/V entry. Token n of request b lives at
//   base + K.offset + (page * K.stride(0) + (n % page_size) * K.stride(1) + h * K.stride(2)) * elem,
//   page = block_table[b * block_table_stride + n / page_size]   (widened to int64 first).
//
// Split-KV: request b's tokens are cut into `num_splits` chunks of
// decode_paged_split_chunk(len, S) tokens; each split produces (o_s, lse_s) and the splits are
// merged by LSE. The CPU twin and the CUDA launcher follow the same split rule.
//
// Balanced schedule (num_splits = kDecodePagedBalanced): the device's resident CTA slots in
// groups of Hkv * head-chunks CTAs (decode_paged_balanced_grid), the 16-token tiles of all
// requests laid end to end and cut into one equal range per group, each CTA of a group serving
// one kv head (and head chunk) of its range: every CTA reads the same number of K/V bytes
// whatever the batch and lengths (no partial last wave), and the CTAs of a group read the same
// pages together. A request held by one group is written directly; a request cut between groups
// is merged by LSE. The CPU twin computes a balanced call unsplit (results agree within rounding).
// On the H200 benchmark batches (uniform lengths) it ran 2-3 % slower than the best split count,
// so the launcher does not choose it; it is for callers whose lengths vary widely.
#include <cstdint>

#include "kvferry/layouts/status.h"
#include "kvferry/layouts/tensor_view.h"

namespace kvferry {

/// Tokens per round of the CUDA kernel (4 warps x 16); split chunks are rounded up to a multiple of it.
constexpr int kDecodePagedTile = 64;
/// Query heads one CTA serves at once (a larger GQA group is cut into chunks of this many).
constexpr int kDecodePagedMaxGroup = 8;
/// Tokens per unit of the balanced schedule (one warp tile).
constexpr int kDecodePagedBalancedTile = 16;
/// DecodePagedParams::num_splits value that selects the balanced schedule (CUDA; see above).
constexpr int kDecodePagedBalanced = -1;

/// Everything one decode call needs. Pointers are host memory for decode_paged_cpu and device
/// memory for launch_decode_paged; the caller owns every buffer.
struct DecodePagedParams {
  const void* q_base = nullptr;  ///< region holding q
  int64_t q_region_bytes = 0;
  TensorView q;  ///< [B, Hq, Dk]

  const void* k_base = nullptr;  ///< region holding K (16-byte aligned)
  int64_t k_region_bytes = 0;
  TensorView k;  ///< [blocks, page, Hkv, Dk]

  const void* v_base = nullptr;  ///< region holding V (may be K's region)
  int64_t v_region_bytes = 0;
  TensorView v;  ///< [blocks, page, Hkv, Dv]

  const int32_t* block_table = nullptr;  ///< [B, max_blocks_per_seq] page ids
  int64_t block_table_stride = 0;        ///< elements between rows (>= max_blocks_per_seq)
  int32_t max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  ///< [B] KV lengths, each in [0, max_blocks_per_seq * page]
  int32_t max_seq_len = 0;            ///< an upper bound of seq_lens (host side; picks the splits)

  void* o_base = nullptr;  ///< region receiving o
  int64_t o_region_bytes = 0;
  TensorView o;          ///< [B, Hq, Dv]
  float* lse = nullptr;  ///< [B, Hq] fp32 contiguous; may be null

  float sm_scale = 1.0f;
  float logit_cap = 0.0f;  ///< > 0: x = cap * tanh(x / cap)
  float k_scale = 1.0f;    ///< fp8 K: k = e4m3 * k_scale (ignored otherwise)
  float v_scale = 1.0f;    ///< fp8 V: v = e4m3 * v_scale (ignored otherwise)

  /// >= 1 splits per request; kDecodePagedBalanced; 0 lets the CUDA launcher choose (see
  /// decode_paged_choose_splits; the workspace must then fit its choice).
  int num_splits = 1;
  void* workspace = nullptr;    ///< split partials, decode_paged_workspace_bytes(p); unused when num_splits == 1
  int64_t workspace_bytes = 0;  ///< bytes available at `workspace`
};

/// Checks shapes, dtypes, head dims, alignment and that every view lies inside its region (no
/// int64 overflow); the message names the culprit. Block-table and length *contents* are checked
/// by decode_paged_cpu (host memory); the CUDA launcher trusts them (it clamps lengths to the
/// block table's capacity).
Status validate_decode_paged(const DecodePagedParams& p);

/// Tokens in each split of a request of `len` tokens cut into `num_splits` splits:
/// round_up(ceil(len / num_splits), kDecodePagedTile). Split s covers [s*chunk, min(len, (s+1)*chunk)).
inline int32_t decode_paged_split_chunk(int32_t len, int num_splits) {
  if (num_splits < 1) num_splits = 1;
  const int32_t c = (len + num_splits - 1) / num_splits;
  return (c + kDecodePagedTile - 1) / kDecodePagedTile * kDecodePagedTile;
}

/// Bytes of split workspace a call with `num_splits` needs: fp32 partial outputs and LSEs.
inline int64_t decode_paged_workspace_bytes(int64_t batch, int64_t q_heads, int64_t dv, int num_splits) {
  if (num_splits <= 1) return 0;
  return batch * q_heads * num_splits * (dv + 1) * static_cast<int64_t>(sizeof(float));
}

/// Bytes of workspace of the balanced schedule on a grid of `grid` CTAs: fp32 partials of
/// (items + grid) slots of kDecodePagedMaxGroup heads, items = batch * kv_heads * head chunks.
inline int64_t decode_paged_balanced_workspace_bytes(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t dv,
                                                     int64_t grid) {
  if (kv_heads < 1) return 0;
  const int64_t chunks = (q_heads / kv_heads + kDecodePagedMaxGroup - 1) / kDecodePagedMaxGroup;
  return (batch * kv_heads * chunks + grid) * kDecodePagedMaxGroup * (dv + 1) * static_cast<int64_t>(sizeof(float));
}

/// CTAs of a balanced call of `p` on the current device: a multiple of Hkv * head chunks within
/// its resident CTA slots (fewer for small problems: at least 16 tiles per group by
/// max_seq_len); 0 without CUDA.
int decode_paged_balanced_grid(const DecodePagedParams& p);

/// Workspace bytes a call of `p` needs for its p.num_splits (balanced: on the current device).
int64_t decode_paged_workspace_bytes(const DecodePagedParams& p);

/// CPU twin of launch_decode_paged: same contract, fp32 accumulation, same split rule and LSE
/// merge. Also validates block ids and lengths. Writes every element of o (and lse).
Status decode_paged_cpu(const DecodePagedParams& p);

/// Number of splits the CUDA launcher picks for `p` on the current device (fills the SMs given
/// B * Hkv * head chunks CTAs and max_seq_len; never the balanced schedule, which measured
/// slower on uniform batches); 1 without CUDA.
int decode_paged_choose_splits(const DecodePagedParams& p);

}  // namespace kvferry

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>

namespace kvferry {
/// Launches the decode on `stream` (asynchronous; buffers must stay alive until it completes).
/// Does not re-validate: call validate_decode_paged once at the request boundary. Returns
/// cudaErrorInvalidValue when the workspace is too small for num_splits (> 1 or balanced).
cudaError_t launch_decode_paged(const DecodePagedParams& p, cudaStream_t stream);
}  // namespace kvferry
#endif
