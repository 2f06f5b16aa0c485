#pragma once
// MLA paged decode attention over a stride-aware cache view (kernels-spec §4, §9).
//
// For each request b and query head h, with n = seq_lens[b] tokens of the request's pages:
//   x_j   = sm_scale * <q[b,h,0:576], k_j[0:576]>                      (j < n)
//   o     = sum_j softmax(x)_j * k_j[0:512]                             (V = the first 512 of K)
//   lse   = ln(sum_j exp(x_j))                                          (natural log)
// Token j of request b lives at byte
//   cache_base + cache.offset + table[b][j / page] * cache.stride(0)*eb + (j % page) * cache.stride(1)*eb
// in 64-bit arithmetic, so a per-layer view of a block-major buffer (stride(0) = L*page*E, offset
// = layer*page bytes) reads exactly the same values as a contiguous per-layer cache.
//
// Dequantization (the contract both implementations follow):
//   mla_bf16    k_j[d] = the stored bf16 value; k_scale must be 1.
//   mla_fp8     k_j[d] = e4m3(byte d) * k_scale (per-tensor scale). The GPU keeps e4m3 as exact
//               fp16 or bf16 and folds k_scale into the logit scale and the output.
//   mla_fp8_ds  656 B entries: k_j[d] = e4m3(byte d) * scale[d / 128] for d < 512 (the exact
//               product), k_j[512 + i] = the stored bf16 rope value; k_scale must be 1. With all
//               scales 1.0 this equals mla_fp8 with k_scale 1 exactly, so the two caches give
//               bit-identical GPU output. (The wgmma kernels round each nope product before
//               their tensor-core products. The seesaw kernel rounds to fp16 after rounding the
//               scale to fp16: at most 2^-10 relative where scale and product are >= 2^-14
//               (fp16's normal range), 2^-25 absolute below; a scale above 146 (values beyond
//               65408 in magnitude) is read as 146. The depth-split kernel rounds to bf16, 2^-9
//               relative.)
// Length 0: o = 0 (all 512 values +0.0) and lse = -inf. Length 1: o = k_0[0:512], lse = x_0.
//
// Shapes: q [batch, heads, 576] bf16 contiguous; o [batch, heads, 512] bf16 contiguous; lse
// [batch, heads] fp32 contiguous; block_table [batch, block_table_stride] int32 of which the
// first ceil(seq_lens[b] / page) entries of row b are read; seq_lens [batch] int32.
// heads is one of 16, 32, 64, 128; any page size >= 1 (16, 32 and 64 are the tested ones).
//
// The GPU splits every request's tokens into num_splits chunks (split-KV) and runs one of three
// split kernels (DecodeMlaParams::mma and the format), then a second kernel that merges the
// splits' (o, lse) pairs. All compute in fp32 with an online softmax and 16-bit tensor-core
// operands, and read each K tile once for all the heads of a CTA:
//  - wgmma (Hopper, sm_90a; chosen for bf16 caches and from 32 heads, where it measured faster;
//    fewer than 64 heads are padded to 64 rows): one CTA per (request, split, 64 heads) with
//    two math warpgroups and a producer warpgroup (mbarrier hand-over). Q stays in shared memory;
//    each K tile is brought in once, in the 128-byte-swizzled layout that serves both as the
//    K-major operand of Q K^T and as the transposed V operand of P V. At 128 heads two CTAs share
//    each tile (the fp32 accumulators of 128 heads x 512 columns, 256 KiB, exceed an SM's
//    registers): adjacent in the grid, so the second read of a tile is an L2 hit, and for bf16
//    caches in the seesaw kernel a cluster of two that copies each tile once into both. Two kernels:
//    - seesaw (decode_mla/wgmma_seesaw.cu): 64-token tiles; warpgroup 0 computes S of the even
//      tiles, warpgroup 1 of the odd ones, over the whole depth, sharing one running row maximum,
//      and each owns 256 output columns, so one's softmax runs while the other's products keep the
//      tensor cores busy. Tiles come by tensor copies (cp.async where the page is not a power of
//      two >= 16, bf16 only); fp8 tiles land raw in the slots they fill (copies issued by the math
//      warp that frees the slots) and producer warps convert them in place to fp16 (mla_fp8
//      exactly, mla_fp8_ds as the fp16 rounding of each product), and the fp8 formats compute in
//      fp16: Q's nope part is fp16 scaled per head by a power of two (exact), P is fp16, and the
//      rope part (Q and tile) stays bf16.
//    - fp8 math (decode_mla/wgmma_seesaw_e4m3.cu; mla_fp8 with fp8_math = 1): the seesaw
//      schedule with both products in e4m3 on the raw tile, P V transposed (V^T from registers,
//      by ldmatrix.trans from the raw rows; P^T through shared memory), a producer lane per buffer
//      issuing each part's copies.
//    - depth-split (decode_mla/wgmma_depth_split.cu; fp8 caches whose pages tensor copies cannot
//      take, or wgmma_kernel = 2): 32-token tiles; each warpgroup computes the partial S over half
//      the depth, the halves are exchanged through shared memory and added (in either order the
//      same bits), and both run the same softmax. fp8 tiles are bulk-copied raw and converted by
//      three producer warps and the math warpgroups.
//  - mma.sync (m16n8k16; chosen for the fp8 caches at 16 heads, and where wgmma is unavailable),
//    two kernels:
//    - bf16 caches (decode_mla/mma_sync_bf16.cu): one CTA per (request, split, group of <= 64
//      heads) that brings each 32-token K tile into shared memory (bulk copies or cp.async,
//      double-buffered); 2 or 4 warps share 16 heads, splitting the QK depth (partial S tiles
//      added in a fixed order) and the output columns.
//    - fp8 caches (decode_mla/mma_sync_fp8.cu): the same CTA shape with four warps per 16 heads
//      and a producer warp that bulk-copies the raw fp8 tiles (full/empty mbarriers). The tiles
//      stay fp8 in shared memory: each warp converts the bytes it multiplies from ldmatrix
//      registers (exact e4m3 -> fp16) into fp16 mma operands. Q's nope part is fp16, scaled per head by a
//      power of two (exact); the rope part stays bf16 (a bf16 mma). The tile scales of
//      mla_fp8_ds are applied to each warp's partial S (a warp owns one 128-wide tile of the QK
//      depth) and to P for the warp's 128 output columns (the same tile), so no value is
//      rounded: k_j[d] enters as the exact product the contract defines.
// The CPU twin computes in float64.
#include <cstddef>
#include <cstdint>

#include "kvferry/layouts/entry_format.h"
#include "kvferry/layouts/status.h"
#include "kvferry/layouts/tensor_view.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry {

/// Arguments of one MLA decode call. Pointers are device pointers for launch_decode_mla and host
/// pointers for decode_mla_cpu. The call owns nothing; buffers must outlive it (GPU: until the
/// stream reaches it).
struct DecodeMlaParams {
  EntryFormat format = EntryFormat::mla_bf16();  ///< mla_bf16, mla_fp8 or mla_fp8_ds
  const void* cache_base = nullptr;              ///< base of the cache region
  int64_t region_bytes = 0;                      ///< bytes of the region (bounds check of `cache`)
  TensorView cache;                              ///< (blocks, page, E) in format.dtype elements
  const uint16_t* q = nullptr;                   ///< [batch, heads, 576] bf16 bits
  const int32_t* block_table = nullptr;          ///< [batch, block_table_stride]
  int64_t block_table_stride = 0;                ///< elements between rows of block_table
  const int32_t* seq_lens = nullptr;             ///< [batch], each in [0, block_table_stride * page]
  int32_t batch = 0;
  int32_t heads = 0;
  float sm_scale = 0.0f;  ///< the model's softmax scale (not necessarily 576^-0.5); finite and > 0
  float k_scale = 1.0f;   ///< per-tensor dequantization scale of mla_fp8 (1 for the others)
  uint16_t* o = nullptr;  ///< [batch, heads, 512] bf16 bits (written), 16-byte aligned
  float* lse = nullptr;   ///< [batch, heads] fp32 natural-log LSE (written)

  // GPU only.
  int32_t num_splits = 0;     ///< KV splits per request; 0 = chosen from the device (auto)
  void* workspace = nullptr;  ///< fp32 scratch of decode_mla_workspace_bytes(); 16-byte aligned; may be null if 0
  size_t workspace_bytes = 0;
  /// mma.sync kernel for bf16 caches only (the fp8 one has a fixed layout): how K tiles reach
  /// shared memory: 1 = bulk copies (TMA engine, one per entry), 2 = cp.async (16 B per thread),
  /// 0 = auto: bulk copies at <= 32 heads (memory-bound, where they measured faster on an H200),
  /// cp.async otherwise. Both give bit-identical results.
  int32_t loader = 0;
  /// mma.sync kernel for bf16 caches only: warps per 16 heads: 2 (each owns 256 output columns
  /// and half the QK depth; ~240 registers), 4 (128 columns and a quarter of the depth; 128
  /// registers, twice the warps per SM), 0 = auto (2, which measured faster at every head count).
  /// Both give results within the same bounds; a call's choice is deterministic.
  int32_t group_warps = 0;
  /// Tensor-core path: 1 = the mma.sync kernels (any head count up to 64 per CTA; the knobs above
  /// apply to the bf16 one), 2 = the Hopper wgmma kernel (64 heads per CTA, fewer padded; needs
  /// sm_90a code and a compute capability 9.0 device; loader and group_warps are ignored), 0 = auto:
  /// wgmma where it measured faster (bf16 caches, and the fp8 caches from 32 heads; see
  /// decode_mla_resolved_mma), falling back to 1 where it is not available. A call's choice is
  /// deterministic; both paths keep the bit-identity promises.
  int32_t mma = 0;
  /// mla_fp8 only: 1 = fp8 tensor-core math, both products in e4m3 (twice the 16-bit rate, and the
  /// tiles are multiplied as they land): Q is rounded to e4m3 per head, times the power of two that
  /// puts its largest magnitude in [128, 256), and P = 2^(x - R) is rounded to e4m3, with x the
  /// logits in log2 units and R an integer reference (decode_mla_cpu: the ceiling of the row's
  /// maximum minus 8; the GPU's differs from it by an integer, so it rounds the same values); o is
  /// divided by the sum of the rounded P (so length 1 still gives k_0), the lse is taken from the
  /// unrounded sum. A different, looser contract than 0's: the rounding of Q moves each logit by a
  /// few percent of its terms' size, so on the tests' random data o moves from the exact result by
  /// about 0.035 (relative L2) and by 0.09-0.13 for sharp scores (the 1e-2 bound of 0 does not
  /// hold). The GPU stays within 3e-2 of decode_mla_cpu with fp8_math = 1 (measured 0.7-1.5e-2: a
  /// logit that differs in its last bits, from the fp8 tensor cores' accumulation, can round a P
  /// to the neighbouring e4m3 value). The GPU runs it at 64 and 128 heads with the wgmma path and
  /// tensor-copy pages (decode_mla/wgmma_seesaw_e4m3.cu); elsewhere it computes as with 0 (exact
  /// 16-bit operands). Opt-in, for engines that accept fp8 attention math; 0 = exact operands
  /// (default).
  int32_t fp8_math = 0;
  /// wgmma path only: which split kernel runs. 0 = auto and 1 = the seesaw kernel where it can run
  /// (bf16 caches; fp8 caches whose pages tensor copies take), the depth-split kernel otherwise;
  /// 2 = the depth-split kernel for every format (for comparison). fp8_math = 1 runs its own kernel
  /// either way where it applies. Within each format's error bounds; a call's choice is deterministic.
  int32_t wgmma_kernel = 0;
  /// Seesaw kernel only: how tiles reach shared memory. 0 = auto and 1 = tensor copies where the
  /// view allows them (a page that is a power of two >= 16), cp.async otherwise (bf16 caches only);
  /// 2 = cp.async (for comparison; fp8 caches then run on the depth-split kernel).
  int32_t seesaw_loader = 0;
  /// Depth-split kernel, fp8 caches only: how many of each 32-token tile's rows the producer
  /// warps convert to bf16 (the math warps convert the rest), 0..32. 12 measured fastest on an
  /// H200 at 128 heads (kernels/DESIGN.md §3.4). Does not change the output.
  int32_t conv_rows = 12;
};

constexpr int kDecodeMlaMaxSplits = 64;

/// Checks everything that can be checked without reading the tables: format, view rank, dtype,
/// entry width, strides (innermost 1, 16-byte aligned rows and blocks), the view inside the
/// region, head count, scales and non-null pointers. The message names the culprit.
Status validate_decode_mla(const DecodeMlaParams& p);

/// validate_decode_mla plus the host-visible tables: every seq_len in [0, block_table_stride *
/// page] and every block id that a request reads in [0, cache.size(0)).
Status validate_decode_mla_tables(const DecodeMlaParams& p);

/// CPU implementation with the same contract (float64 logits, softmax and sums; o rounded to bf16
/// once). Validates with validate_decode_mla_tables first.
Status decode_mla_cpu(const DecodeMlaParams& p);

/// Bytes of fp32 workspace for `num_splits` splits (0 when num_splits <= 1).
size_t decode_mla_workspace_bytes(int32_t batch, int32_t heads, int32_t num_splits);

/// The loader (1 bulk copies, 2 cp.async) a launch with `p` uses.
int32_t decode_mla_resolved_loader(const DecodeMlaParams& p);

/// The warps per 16 heads (2 or 4) a launch with `p` uses.
int32_t decode_mla_resolved_group_warps(const DecodeMlaParams& p);

/// The tensor-core path (1 mma.sync, 2 wgmma) an auto or explicit `p.mma` selects on a device
/// where wgmma is available.
int32_t decode_mla_resolved_mma(const DecodeMlaParams& p);

/// The number of splits an auto (num_splits == 0) launch uses on a device with `sm_count` SMs,
/// given the longest possible request (block_table_stride * page tokens).
int32_t decode_mla_auto_splits(const DecodeMlaParams& p, int sm_count);

#if defined(KVFERRY_WITH_CUDA)
/// Whether this build and the current device run the wgmma kernel (sm_90a code, compute 9.0).
bool decode_mla_wgmma_available();

/// Resolves p.num_splits (auto -> decode_mla_auto_splits on the current device).
int32_t decode_mla_splits(const DecodeMlaParams& p);

/// Launches the split kernel (and the merge kernel when splits > 1) on `stream`. Trusts its input
/// (call validate_decode_mla once per request shape); returns cudaErrorInvalidValue when the
/// workspace is too small or the shape is outside what the kernels handle.
cudaError_t launch_decode_mla(const DecodeMlaParams& p, cudaStream_t stream);
#endif

}  // namespace kvferry
