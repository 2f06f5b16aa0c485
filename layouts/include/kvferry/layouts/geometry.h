#pragma once
// Geometry maps: where the tokens and heads of a block of one geometry land in a block of another
// (page size, a tensor-parallel slice of the heads, NHD or HND), as byte runs between the two.
// Entry formats must match apart from the MHA slice and order (a format conversion runs first,
// see the offload service). Host-only.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry {

/// The planes of one layer's page: a page of BS tokens is its planes one after another, each
/// BS x width bytes. Every plane is token-major, except the two planes of an HND MHA page, which
/// are head-major ([H, BS, D]).
struct PagePlanes {
  int count = 1;
  int64_t width[2] = {0, 0};  ///< bytes per token of each plane
};

inline PagePlanes page_planes(const EntryFormat& f) {
  switch (f.kind) {
    case FormatKind::kMha: {
      const int64_t w = int64_t{f.heads} * f.head_dim * dtype_size(f.dtype);
      return {2, {w, w}};
    }
    case FormatKind::kIndexerFp8: return {2, {kIndexerHeadDim, kIndexerHeadDim / kIndexerQuantBlock * 4}};
    case FormatKind::kMlaFp4: return {2, {kMlaFp4ValueBytes, kMlaFp4ScaleBytes}};
    default: return {1, {f.bytes_per_token(), 0}};
  }
}

/// Whether blocks of `a` can be copied token by token (and head by head) into blocks of `b`
/// with no format conversion: the same entry format, where MHA caches may differ in their order
/// (NHD/HND) and in which heads of one model they hold.
inline bool same_entries(const EntryFormat& a, const EntryFormat& b) {
  if (a.kind != b.kind) return false;
  if (a.kind != FormatKind::kMha) return a == b;
  return a.dtype == b.dtype && a.head_dim == b.head_dim && a.total_heads() == b.total_heads();
}

/// "mha:bf16:8x128:nhd, 32 layers x 64 tokens": a geometry as error messages name it.
inline std::string geometry_name(const EntryFormat& f, int64_t layers, int64_t block_size) {
  return f.name() + ", " + std::to_string(layers) + " layers x " + std::to_string(block_size) + " tokens";
}

/// The heads [first, end) two MHA formats both hold (empty for other kinds: they have no head axis).
struct HeadRange {
  int32_t first = 0, end = 0;
  int32_t count() const { return end > first ? end - first : 0; }
};
inline HeadRange common_heads(const EntryFormat& a, const EntryFormat& b) {
  return {std::max(a.head_first, b.head_first), std::min(a.head_first + a.heads, b.head_first + b.heads)};
}

/// Appends the runs that copy tokens [src_token, src_token + tokens) of block `src_block` of
/// `src` into tokens [dst_token, dst_token + tokens) of block `dst_block` of `dst`, in every
/// layer and plane, for the heads both hold (MHA). Offsets are into each side's buffer plus
/// `src_base` / `dst_base` (a block in a pool slot: a one-block spec at the slot's offset). Runs
/// that follow each other on both sides merge, but never into a run from before this call.
/// The formats must be same_entries(); layer counts equal; token ranges inside the blocks.
inline Status push_token_runs(std::vector<CopyRun>* runs, const KvCacheSpec& src, int64_t src_block, int64_t src_token,
                              const KvCacheSpec& dst, int64_t dst_block, int64_t dst_token, int64_t tokens,
                              int64_t src_base = 0, int64_t dst_base = 0) {
  if (!same_entries(src.format, dst.format))
    return {ErrorCode::kUnsupported,
            "no token map from " + src.format.name() + " to " + dst.format.name() + " without a format conversion"};
  if (src.layers != dst.layers)
    return {ErrorCode::kInvalidArgument,
            "no token map between " + std::to_string(src.layers) + " and " + std::to_string(dst.layers) + " layers"};
  KVFERRY_TRY(src.check_block(src_block).with_context("source"));
  KVFERRY_TRY(dst.check_block(dst_block).with_context("destination"));
  if (tokens < 0 || src_token < 0 || dst_token < 0 || src_token + tokens > src.block_size ||
      dst_token + tokens > dst.block_size)
    return {ErrorCode::kOutOfRange,
            "tokens [" + std::to_string(src_token) + ", " + std::to_string(src_token + tokens) + ") -> [" +
                std::to_string(dst_token) + ", " + std::to_string(dst_token + tokens) + ") do not fit blocks of " +
                std::to_string(src.block_size) + " and " + std::to_string(dst.block_size) + " tokens"};
  const size_t floor = runs->size();
  auto push = [runs, floor](int64_t s, int64_t d, int64_t n) {
    if (n <= 0) return;
    if (runs->size() > floor && runs->back().src + runs->back().bytes == s &&
        runs->back().dst + runs->back().bytes == d)
      runs->back().bytes += n;
    else
      runs->push_back({s, d, n});
  };
  const PagePlanes sp = page_planes(src.format), dp = page_planes(dst.format);
  const bool mha = src.format.kind == FormatKind::kMha;
  const HeadRange hr = mha ? common_heads(src.format, dst.format) : HeadRange{};
  if (mha && hr.count() == 0) return Status::Ok();
  const int64_t hd = mha ? int64_t{src.format.head_dim} * dtype_size(src.format.dtype) : 0;
  for (int64_t l = 0; l < src.layers; ++l) {
    int64_t s_plane = src_base + src.page_offset(l, src_block);
    int64_t d_plane = dst_base + dst.page_offset(l, dst_block);
    for (int p = 0; p < sp.count; ++p) {
      if (!mha) {
        const int64_t w = sp.width[p];
        push(s_plane + src_token * w, d_plane + dst_token * w, tokens * w);
      } else {
        const int64_t sh = src.format.heads, dh = dst.format.heads;
        const bool s_nhd = src.format.order == MhaOrder::kNHD, d_nhd = dst.format.order == MhaOrder::kNHD;
        // Byte offset of (token t, head h) in a plane of `heads` heads from `first`, `bs` tokens.
        auto at = [hd](bool nhd, int64_t heads, int64_t first, int64_t bs, int64_t t, int64_t h) {
          return nhd ? (t * heads + (h - first)) * hd : ((h - first) * bs + t) * hd;
        };
        const int64_t sf = src.format.head_first, df = dst.format.head_first;
        if (s_nhd && d_nhd) {
          for (int64_t t = 0; t < tokens; ++t)
            push(s_plane + at(true, sh, sf, src.block_size, src_token + t, hr.first),
                 d_plane + at(true, dh, df, dst.block_size, dst_token + t, hr.first), hr.count() * hd);
        } else if (!s_nhd && !d_nhd) {
          for (int64_t h = hr.first; h < hr.end; ++h)
            push(s_plane + at(false, sh, sf, src.block_size, src_token, h),
                 d_plane + at(false, dh, df, dst.block_size, dst_token, h), tokens * hd);
        } else {
          for (int64_t t = 0; t < tokens; ++t)
            for (int64_t h = hr.first; h < hr.end; ++h)
              push(s_plane + at(s_nhd, sh, sf, src.block_size, src_token + t, h),
                   d_plane + at(d_nhd, dh, df, dst.block_size, dst_token + t, h), hd);
        }
      }
      s_plane += src.block_size * sp.width[p];
      d_plane += dst.block_size * dp.width[p];
    }
  }
  return Status::Ok();
}

/// Which tokens of a stored block of `stored_tokens` go where in a region block of
/// `region_tokens`, for part `part` of a mapped load: with stored blocks at least as large, part p
/// is the stored tokens [p * R, (p + 1) * R), the whole region block; with smaller stored blocks,
/// the whole stored block fills region tokens [p * S, (p + 1) * S). One page size must divide the
/// other.
struct TokenSpan {
  int64_t src_token = 0, dst_token = 0, tokens = 0;
};
inline Result<TokenSpan> token_span(int64_t stored_tokens, int64_t region_tokens, int64_t part) {
  const int64_t s = stored_tokens, r = region_tokens;
  if (s < 1 || r < 1 || (s >= r ? s % r : r % s) != 0)
    return Result<TokenSpan>(ErrorCode::kUnsupported, "pages of " + std::to_string(s) + " and " + std::to_string(r) +
                                                          " tokens: one page size must divide the other");
  const int64_t parts = s >= r ? s / r : r / s;
  if (part < 0 || part >= parts)
    return Result<TokenSpan>(ErrorCode::kOutOfRange, "part " + std::to_string(part) + " is out of range: a " +
                                                         std::to_string(s) + "-token stored block and " +
                                                         std::to_string(r) + "-token region blocks make " +
                                                         std::to_string(parts) + " parts");
  if (s >= r) return TokenSpan{part * r, 0, r};
  return TokenSpan{0, part * s, s};
}

}  // namespace kvferry
