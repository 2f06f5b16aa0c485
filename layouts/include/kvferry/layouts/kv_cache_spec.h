#pragma once
// KvCacheSpec: layers x blocks x block_size tokens of one EntryFormat, laid out block-major
// (NB, L, BS, E) or layer-major (L, NB, BS, E). The only place that knows how a block maps to
// bytes: per-layer views, a block's byte span(s), and coalesced byte runs for transports.
#include <cstdint>

#include "kvferry/layouts/entry_format.h"
#include "kvferry/layouts/host_device.h"
#include "kvferry/layouts/tensor_view.h"

#if !defined(__CUDA_ARCH__)
#include <algorithm>
#include <span>
#include <string>
#include <vector>
#include "kvferry/layouts/status.h"
#endif

namespace kvferry {

enum class Layout : uint8_t {
  kBlockMajor = 0,  ///< (NB, L, BS, E): all layers of a block in one contiguous range
  kLayerMajor = 1,  ///< (L, NB, BS, E): a block is L ranges, NB pages apart
};

/// A contiguous byte range of a region.
struct ByteRun {
  int64_t offset = 0;
  int64_t bytes = 0;
  bool operator==(const ByteRun&) const = default;
};

/// One contiguous copy from a source region to a destination region.
struct CopyRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t bytes = 0;
  bool operator==(const CopyRun&) const = default;
};

/// Shape of one KV cache allocation.
struct KvCacheSpec {
  int64_t layers = 1;
  int64_t blocks = 0;
  int64_t block_size = 64;  ///< tokens per block (page)
  EntryFormat format = EntryFormat::mla_bf16();
  Layout layout = Layout::kBlockMajor;

  /// Bytes of one layer's page (for MHA both planes).
  KVFERRY_HOST_DEVICE int64_t page_bytes() const { return block_size * format.bytes_per_token(); }
  /// Bytes of one MHA plane (K or V) of one layer's page.
  KVFERRY_HOST_DEVICE int64_t plane_bytes() const { return page_bytes() / 2; }
  /// Bytes of one block across all layers.
  KVFERRY_HOST_DEVICE int64_t block_bytes() const { return layers * page_bytes(); }
  /// Bytes of the whole region.
  KVFERRY_HOST_DEVICE int64_t region_bytes() const { return blocks * block_bytes(); }

  /// Byte offset of layer `layer`'s page of block `block`.
  KVFERRY_HOST_DEVICE int64_t page_offset(int64_t layer, int64_t block) const {
    return layout == Layout::kBlockMajor ? (block * layers + layer) * page_bytes()
                                         : (layer * blocks + block) * page_bytes();
  }
  /// Byte distance between block b and b+1 of one layer (the view's stride(0), in bytes).
  KVFERRY_HOST_DEVICE int64_t block_stride_bytes() const {
    return layout == Layout::kBlockMajor ? layers * page_bytes() : page_bytes();
  }

  /// Layer `layer`'s view `(NB, BS, E)` for token-interleaved formats (MLA, indexer).
  /// Strides `(block_stride, E, 1)` in elements, offset = page_offset(layer, 0). For kIndexerFp8
  /// and kMlaFp4 it spans the right bytes per page but a page holds planes (values, then scales):
  /// kMlaFp4's planes are mla_fp4_values_view and mla_fp4_scales_view.
  KVFERRY_HOST_DEVICE TensorView layer_view(int64_t layer) const {
    TensorView v;
    v.dtype = format.dtype;
    v.rank = 3;
    const int64_t eb = dtype_size(format.dtype);
    const int64_t e = format.entry_elems();
    v.sizes[0] = blocks;
    v.sizes[1] = block_size;
    v.sizes[2] = e;
    v.strides[0] = block_stride_bytes() / eb;
    v.strides[1] = e;
    v.strides[2] = 1;
    v.offset = page_offset(layer, 0);
    return v;
  }

  /// MHA: layer `layer`'s K (`v_plane` false) or V plane as `(NB, BS, H, D)` with the plane's
  /// NHD or HND strides.
  KVFERRY_HOST_DEVICE TensorView kv_view(int64_t layer, bool v_plane) const {
    TensorView v;
    v.dtype = format.dtype;
    v.rank = 4;
    const int64_t eb = dtype_size(format.dtype);
    const int64_t h = format.heads, d = format.head_dim;
    v.sizes[0] = blocks;
    v.sizes[1] = block_size;
    v.sizes[2] = h;
    v.sizes[3] = d;
    v.strides[0] = block_stride_bytes() / eb;
    if (format.order == MhaOrder::kNHD) {
      v.strides[1] = h * d;
      v.strides[2] = d;
    } else {
      v.strides[1] = d;
      v.strides[2] = block_size * d;
    }
    v.strides[3] = 1;
    v.offset = page_offset(layer, 0) + (v_plane ? plane_bytes() : 0);
    return v;
  }

  /// kMlaFp4: byte offset of the scale plane inside a layer's page (after the BS x 288 value bytes).
  KVFERRY_HOST_DEVICE int64_t mla_fp4_scale_plane_offset() const { return block_size * kMlaFp4ValueBytes; }

  /// kMlaFp4: layer `layer`'s packed e2m1 values `(NB, BS, 288)` u8, strides
  /// `(block_stride, 288, 1)`, offset = page_offset(layer, 0).
  KVFERRY_HOST_DEVICE TensorView mla_fp4_values_view(int64_t layer) const {
    return plane_view(layer, 0, kMlaFp4ValueBytes);
  }
  /// kMlaFp4: layer `layer`'s ue8m0 scale bytes `(NB, BS, 36)` u8 (nope groups 0..31, rope 32..35),
  /// strides `(block_stride, 36, 1)`, offset = page_offset(layer, 0) + mla_fp4_scale_plane_offset().
  KVFERRY_HOST_DEVICE TensorView mla_fp4_scales_view(int64_t layer) const {
    return plane_view(layer, mla_fp4_scale_plane_offset(), kMlaFp4ScaleBytes);
  }

  /// A u8 `(NB, BS, row)` view of dense rows of `row` bytes starting `shift` bytes into each of
  /// layer `layer`'s pages.
  KVFERRY_HOST_DEVICE TensorView plane_view(int64_t layer, int64_t shift, int64_t row) const {
    TensorView v;
    v.dtype = DType::kU8;
    v.rank = 3;
    v.sizes[0] = blocks;
    v.sizes[1] = block_size;
    v.sizes[2] = row;
    v.strides[0] = block_stride_bytes();
    v.strides[1] = row;
    v.strides[2] = 1;
    v.offset = page_offset(layer, 0) + shift;
    return v;
  }

#if !defined(__CUDA_ARCH__)
  /// Checks every size is positive, the format is valid and region_bytes() fits in int64.
  Status validate() const {
    KVFERRY_TRY(format.validate());
    if (layers < 1) return {ErrorCode::kInvalidArgument, "layers = " + std::to_string(layers) + " must be >= 1"};
    if (blocks < 0) return {ErrorCode::kInvalidArgument, "blocks = " + std::to_string(blocks) + " is negative"};
    if (block_size < 1)
      return {ErrorCode::kInvalidArgument, "block_size = " + std::to_string(block_size) + " must be >= 1"};
    int64_t page = 0, blk = 0, total = 0;
    if (__builtin_mul_overflow(block_size, format.bytes_per_token(), &page) ||
        __builtin_mul_overflow(page, layers, &blk) || __builtin_mul_overflow(blk, blocks, &total))
      return {ErrorCode::kOverflow, "region of " + std::to_string(blocks) + " blocks x " + std::to_string(layers) +
                                        " layers x " + std::to_string(block_size) + " tokens x " +
                                        std::to_string(format.bytes_per_token()) + " B overflows int64"};
    return Status::Ok();
  }

  Status check_layer(int64_t layer) const {
    if (layer < 0 || layer >= layers)
      return {ErrorCode::kOutOfRange, "layer " + std::to_string(layer) + " is out of range: the spec has " +
                                          std::to_string(layers) + " layers"};
    return Status::Ok();
  }

  Status check_block(int64_t block) const {
    if (block < 0 || block >= blocks)
      return {ErrorCode::kOutOfRange, "block " + std::to_string(block) + " is out of range: the region has " +
                                          std::to_string(blocks) + " blocks"};
    return Status::Ok();
  }

  /// The byte ranges holding block `block` across all layers: one run block-major, L runs
  /// layer-major (in layer order).
  Result<std::vector<ByteRun>> block_runs(int64_t block) const {
    KVFERRY_TRY(check_block(block));
    if (layout == Layout::kBlockMajor) return std::vector<ByteRun>{{page_offset(0, block), block_bytes()}};
    std::vector<ByteRun> runs;
    runs.reserve(static_cast<size_t>(layers));
    for (int64_t l = 0; l < layers; ++l) runs.push_back({page_offset(l, block), page_bytes()});
    return runs;
  }

  /// The byte runs covering `blocks` (any order, duplicates allowed): sorted by offset, with
  /// adjacent ranges merged, so no two runs touch or overlap.
  Result<std::vector<ByteRun>> coalesce(std::span<const int64_t> block_ids) const {
    std::vector<ByteRun> pieces;
    pieces.reserve(block_ids.size() * (layout == Layout::kBlockMajor ? 1 : static_cast<size_t>(layers)));
    for (int64_t b : block_ids) {
      KVFERRY_TRY(check_block(b));
      if (layout == Layout::kBlockMajor) {
        pieces.push_back({page_offset(0, b), block_bytes()});
      } else {
        for (int64_t l = 0; l < layers; ++l) pieces.push_back({page_offset(l, b), page_bytes()});
      }
    }
    std::sort(pieces.begin(), pieces.end(), [](const ByteRun& a, const ByteRun& b) { return a.offset < b.offset; });
    std::vector<ByteRun> runs;
    for (const ByteRun& p : pieces) {
      if (!runs.empty() && p.offset <= runs.back().offset + runs.back().bytes) {
        runs.back().bytes = std::max(runs.back().bytes, p.offset + p.bytes - runs.back().offset);
      } else {
        runs.push_back(p);
      }
    }
    return runs;
  }
#endif
};

#if !defined(__CUDA_ARCH__)
/// The copies that move `src_blocks[i]` of `src` to `dst_blocks[i]` of `dst`, for every i, in
/// list order, merging neighbours that are contiguous on both sides. Both specs must have the
/// same page_bytes() and layers (the format may differ only when the caller converts).
inline Result<std::vector<CopyRun>> copy_plan(const KvCacheSpec& src, std::span<const int64_t> src_blocks,
                                              const KvCacheSpec& dst, std::span<const int64_t> dst_blocks) {
  if (src_blocks.size() != dst_blocks.size())
    return Result<std::vector<CopyRun>>(ErrorCode::kInvalidArgument,
                                        "copy_plan: " + std::to_string(src_blocks.size()) + " source blocks but " +
                                            std::to_string(dst_blocks.size()) + " destination blocks");
  if (src.page_bytes() != dst.page_bytes() || src.layers != dst.layers)
    return Result<std::vector<CopyRun>>(
        ErrorCode::kInvalidArgument, "copy_plan: source pages are " + std::to_string(src.layers) + " x " +
                                         std::to_string(src.page_bytes()) + " B but destination pages are " +
                                         std::to_string(dst.layers) + " x " + std::to_string(dst.page_bytes()) + " B");
  std::vector<CopyRun> runs;
  auto push = [&runs](int64_t s, int64_t d, int64_t n) {
    if (!runs.empty() && runs.back().src + runs.back().bytes == s && runs.back().dst + runs.back().bytes == d) {
      runs.back().bytes += n;
    } else {
      runs.push_back({s, d, n});
    }
  };
  const bool whole = src.layout == Layout::kBlockMajor && dst.layout == Layout::kBlockMajor;
  for (size_t i = 0; i < src_blocks.size(); ++i) {
    KVFERRY_TRY(src.check_block(src_blocks[i]).with_context("source"));
    KVFERRY_TRY(dst.check_block(dst_blocks[i]).with_context("destination"));
    if (whole) {
      push(src.page_offset(0, src_blocks[i]), dst.page_offset(0, dst_blocks[i]), src.block_bytes());
    } else {
      for (int64_t l = 0; l < src.layers; ++l)
        push(src.page_offset(l, src_blocks[i]), dst.page_offset(l, dst_blocks[i]), src.page_bytes());
    }
  }
  return runs;
}
#endif

}  // namespace kvferry
