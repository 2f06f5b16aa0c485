#pragma once
// EntryFormat: what one token of one layer looks like in a KV cache page (kernels-spec §1, §5, §6).
#include <cstdint>

#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <string>
#include <string_view>
#include "kvferry/layouts/status.h"
#endif

namespace kvferry {

enum class FormatKind : uint8_t {
  kMlaBf16 = 0,     ///< 576 bf16: nope [0,1024) B, rope [1024,1152) B -> 1152 B
  kMlaFp8 = 1,      ///< 576 e4m3, per-tensor scale: nope [0,512), rope [512,576) -> 576 B
  kMlaFp8Ds = 2,    ///< 656 B: 512 e4m3 nope, 4 fp32 tile scales at 512, 64 bf16 rope at 528
  kMha = 3,         ///< K plane then V plane per page, heads x head_dim x dtype, NHD or HND
  kIndexerFp8 = 4,  ///< 132 B/token: per page all values (BS x 128 e4m3) then all fp32 scales
  kMlaFp4 = 5,      ///< SGLang FP4: 576 e2m1 (288 B) + 36 ue8m0 group scales; per page all values then all scales
};

/// Order of a per-page MHA plane: token-major (NHD: [BS, H, D]) or head-major (HND: [H, BS, D]).
enum class MhaOrder : uint8_t { kNHD = 0, kHND = 1 };

// MLA constants (DeepSeek V2/V3, Kimi-K2, GLM): kv_lora_rank 512, rope 64.
constexpr int kMlaRank = 512;
constexpr int kMlaRope = 64;
constexpr int kMlaDim = kMlaRank + kMlaRope;  // 576 elements per token
constexpr int kMlaTile = 128;                 // fp8_ds tile width (4 tiles of nope)
constexpr int kMlaTiles = kMlaRank / kMlaTile;
constexpr int kMlaBf16Bytes = 1152;
constexpr int kMlaFp8Bytes = 576;
constexpr int kMlaDsBytes = 656;
constexpr int kMlaDsScaleOffset = 512;  // 4 x fp32
constexpr int kMlaDsRopeOffset = 528;   // 64 x bf16
// mla_fp4 (SGLang MLAKVCacheLayout.FP4): element 2i in the low nibble of value byte i, one scale
// byte per 16 elements. A layer's page of BS tokens is [BS x 288 value bytes][BS x 36 scale bytes]
// (token t's values at t*288, its scales at BS*288 + t*36), as SGLang's per-layer value and scale
// buffers placed one after the other per page.
constexpr int kMlaFp4Group = 16;                                     // elements per scale byte
constexpr int kMlaFp4ValueBytes = kMlaDim / 2;                       // 288
constexpr int kMlaFp4ScaleBytes = kMlaDim / kMlaFp4Group;            // 36: nope groups 0..31, rope 32..35
constexpr int kMlaFp4Bytes = kMlaFp4ValueBytes + kMlaFp4ScaleBytes;  // 324 per token
constexpr int kIndexerHeadDim = 128;
constexpr int kIndexerQuantBlock = 128;
constexpr int kIndexerBytes = kIndexerHeadDim + kIndexerHeadDim / kIndexerQuantBlock * 4;  // 132

/// Byte ranges of one MLA-family entry.
struct MlaFields {
  int32_t nope_offset, nope_bytes;
  int32_t scale_offset, scale_bytes;  ///< 0 bytes when the format has no in-entry scale
  int32_t rope_offset, rope_bytes;
};

/// What one token entry of one layer looks like, with its sizes, fields and alignment.
struct EntryFormat {
  FormatKind kind = FormatKind::kMlaBf16;
  DType dtype = DType::kBF16;  ///< element type of the cache view (u8 for mixed formats)
  int32_t heads = 1;           ///< kMha: KV heads
  int32_t head_dim = kMlaDim;  ///< kMha: elements per head
  MhaOrder order = MhaOrder::kNHD;
  /// kMha under tensor parallelism: this cache holds heads [head_first, head_first + heads) of
  /// heads_total (0 = heads: all of them). A slice changes no byte layout, only which heads the
  /// bytes are; loads map heads between slices (layouts/geometry.h).
  int32_t head_first = 0;
  int32_t heads_total = 0;

  static EntryFormat mla_bf16() { return {FormatKind::kMlaBf16, DType::kBF16, 1, kMlaDim, MhaOrder::kNHD}; }
  static EntryFormat mla_fp8() { return {FormatKind::kMlaFp8, DType::kFP8E4M3, 1, kMlaDim, MhaOrder::kNHD}; }
  static EntryFormat mla_fp8_ds() { return {FormatKind::kMlaFp8Ds, DType::kU8, 1, kMlaDsBytes, MhaOrder::kNHD}; }
  static EntryFormat indexer_fp8() { return {FormatKind::kIndexerFp8, DType::kU8, 1, kIndexerBytes, MhaOrder::kNHD}; }
  static EntryFormat mla_fp4() { return {FormatKind::kMlaFp4, DType::kU8, 1, kMlaFp4Bytes, MhaOrder::kNHD}; }
  static EntryFormat mha(int32_t heads, int32_t head_dim, DType dtype, MhaOrder order = MhaOrder::kNHD) {
    return {FormatKind::kMha, dtype, heads, head_dim, order};
  }
  /// An MHA cache holding heads [first, first + heads) of `total` (one tensor-parallel rank's).
  static EntryFormat mha_slice(int32_t heads, int32_t head_dim, DType dtype, MhaOrder order, int32_t first,
                               int32_t total) {
    EntryFormat f{FormatKind::kMha, dtype, heads, head_dim, order};
    f.head_first = first;
    f.heads_total = total == heads && first == 0 ? 0 : total;
    return f;
  }

  /// All heads of the model (kMha): heads_total, or heads when the cache holds all of them.
  KVFERRY_HOST_DEVICE int32_t total_heads() const { return heads_total > 0 ? heads_total : heads; }
  /// Whether this (kMha) cache holds only some of the model's heads.
  KVFERRY_HOST_DEVICE bool sliced() const { return kind == FormatKind::kMha && total_heads() != heads; }

  KVFERRY_HOST_DEVICE bool is_mla() const {
    return kind == FormatKind::kMlaBf16 || kind == FormatKind::kMlaFp8 || kind == FormatKind::kMlaFp8Ds ||
           kind == FormatKind::kMlaFp4;
  }

  /// Elements of `dtype` in the last dim of a per-layer view (one entry; for MHA one head). For
  /// kIndexerFp8 and kMlaFp4 the view's pages are not token-interleaved (values, then scales).
  KVFERRY_HOST_DEVICE int64_t entry_elems() const {
    switch (kind) {
      case FormatKind::kMlaBf16:
      case FormatKind::kMlaFp8: return kMlaDim;
      case FormatKind::kMlaFp8Ds: return kMlaDsBytes;
      case FormatKind::kIndexerFp8: return kIndexerBytes;
      case FormatKind::kMlaFp4: return kMlaFp4Bytes;
      case FormatKind::kMha: return head_dim;
    }
    return 0;
  }

  /// Bytes of one token of one layer (for MHA: K and V together).
  KVFERRY_HOST_DEVICE int64_t bytes_per_token() const {
    switch (kind) {
      case FormatKind::kMlaBf16: return kMlaBf16Bytes;
      case FormatKind::kMlaFp8: return kMlaFp8Bytes;
      case FormatKind::kMlaFp8Ds: return kMlaDsBytes;
      case FormatKind::kIndexerFp8: return kIndexerBytes;
      case FormatKind::kMlaFp4: return kMlaFp4Bytes;
      case FormatKind::kMha: return 2 * int64_t{heads} * head_dim * dtype_size(dtype);
    }
    return 0;
  }

  /// Alignment in bytes that entries (and so pages and block strides) keep.
  KVFERRY_HOST_DEVICE int64_t alignment() const {
    switch (kind) {
      case FormatKind::kMlaBf16:
      case FormatKind::kMlaFp8:
      case FormatKind::kMlaFp8Ds: return 16;
      case FormatKind::kIndexerFp8:
      case FormatKind::kMlaFp4: return 4;  // 324 = 4 x 81: pages of any block size stay 4-byte aligned
      case FormatKind::kMha: return dtype_size(dtype);
    }
    return 1;
  }

  /// Field layout of an MLA entry (kind must be MLA). kMlaFp4: the ranges inside the token's row
  /// of the value plane (KvCacheSpec::mla_fp4_values_view); its scales are not in that row but in
  /// the page's scale plane (KvCacheSpec::mla_fp4_scales_view), so scale_bytes is 0 here.
  KVFERRY_HOST_DEVICE MlaFields mla_fields() const {
    switch (kind) {
      case FormatKind::kMlaBf16: return {0, kMlaRank * 2, 0, 0, kMlaRank * 2, kMlaRope * 2};
      case FormatKind::kMlaFp8: return {0, kMlaRank, 0, 0, kMlaRank, kMlaRope};
      case FormatKind::kMlaFp8Ds:
        return {0, kMlaRank, kMlaDsScaleOffset, kMlaTiles * 4, kMlaDsRopeOffset, kMlaRope * 2};
      case FormatKind::kMlaFp4: return {0, kMlaRank / 2, 0, 0, kMlaRank / 2, kMlaRope / 2};
      default: return {0, 0, 0, 0, 0, 0};
    }
  }

  KVFERRY_HOST_DEVICE bool operator==(const EntryFormat& o) const {
    if (kind != o.kind) return false;
    if (kind != FormatKind::kMha) return true;
    return dtype == o.dtype && heads == o.heads && head_dim == o.head_dim && order == o.order &&
           head_first == o.head_first && total_heads() == o.total_heads();
  }
  KVFERRY_HOST_DEVICE bool operator!=(const EntryFormat& o) const { return !(*this == o); }

#if !defined(__CUDA_ARCH__)
  /// "mla_fp8_ds", "mha:bf16:8x128:nhd", or a tensor-parallel slice "mha:bf16:4x128:nhd:slice=4/8"
  /// (heads 4..7 of 8). Parsed back by parse().
  std::string name() const {
    switch (kind) {
      case FormatKind::kMlaBf16: return "mla_bf16";
      case FormatKind::kMlaFp8: return "mla_fp8";
      case FormatKind::kMlaFp8Ds: return "mla_fp8_ds";
      case FormatKind::kIndexerFp8: return "indexer_fp8";
      case FormatKind::kMlaFp4: return "mla_fp4";
      case FormatKind::kMha:
        return "mha:" + std::string(dtype_name(dtype)) + ":" + std::to_string(heads) + "x" + std::to_string(head_dim) +
               (order == MhaOrder::kNHD ? ":nhd" : ":hnd") +
               (sliced() || head_first != 0
                    ? ":slice=" + std::to_string(head_first) + "/" + std::to_string(total_heads())
                    : std::string());
    }
    return "?";
  }

  Status validate() const {
    if (kind != FormatKind::kMha) return Status::Ok();
    if (dtype != DType::kBF16 && dtype != DType::kFP16 && dtype != DType::kFP8E4M3)
      return {ErrorCode::kInvalidArgument,
              "mha dtype " + std::string(dtype_name(dtype)) + " is not one of bf16, fp16, fp8_e4m3"};
    if (heads < 1 || heads > 1024)
      return {ErrorCode::kInvalidArgument, "mha heads " + std::to_string(heads) + " is outside [1, 1024]"};
    if (head_dim < 1 || head_dim > 1024)
      return {ErrorCode::kInvalidArgument, "mha head_dim " + std::to_string(head_dim) + " is outside [1, 1024]"};
    if (head_first < 0 || heads_total < 0 || heads_total > 1024 || head_first + heads > total_heads())
      return {ErrorCode::kInvalidArgument, "mha slice of heads [" + std::to_string(head_first) + ", " +
                                               std::to_string(head_first + heads) + ") does not fit in " +
                                               std::to_string(total_heads()) + " heads"};
    return Status::Ok();
  }

  /// Parses a name(): mla_bf16 | mla_fp8 | mla_fp8_ds | mla_fp4 | indexer_fp8 |
  /// mha:DTYPE:HxD[:nhd|:hnd][:slice=A/T].
  static Result<EntryFormat> parse(std::string_view s) {
    if (s == "mla_bf16") return mla_bf16();
    if (s == "mla_fp8") return mla_fp8();
    if (s == "mla_fp8_ds") return mla_fp8_ds();
    if (s == "indexer_fp8") return indexer_fp8();
    if (s == "mla_fp4") return mla_fp4();
    const std::string bad = "unknown format '" + std::string(s) +
                            "' (expected mla_bf16, mla_fp8, mla_fp8_ds, mla_fp4, indexer_fp8 or "
                            "mha:DTYPE:HxD[:nhd|:hnd][:slice=FIRST/TOTAL])";
    if (s.substr(0, 4) != "mha:") return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
    std::string_view rest = s.substr(4);
    const auto c1 = rest.find(':');
    if (c1 == std::string_view::npos) return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
    const std::string_view dt = rest.substr(0, c1);
    rest = rest.substr(c1 + 1);
    DType dtype;
    if (dt == "bf16")
      dtype = DType::kBF16;
    else if (dt == "fp16")
      dtype = DType::kFP16;
    else if (dt == "fp8_e4m3" || dt == "fp8")
      dtype = DType::kFP8E4M3;
    else
      return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
    auto num = [](std::string_view v, int32_t* out) {
      if (v.empty() || v.size() > 6) return false;
      int32_t n = 0;
      for (char ch : v) {
        if (ch < '0' || ch > '9') return false;
        n = n * 10 + (ch - '0');
      }
      *out = n;
      return true;
    };
    MhaOrder order = MhaOrder::kNHD;
    int32_t first = 0, total = 0;
    bool has_slice = false;
    const auto c2 = rest.find(':');
    if (c2 != std::string_view::npos) {
      std::string_view opts = rest.substr(c2 + 1);
      rest = rest.substr(0, c2);
      while (!opts.empty()) {
        const auto c = opts.find(':');
        const std::string_view o = opts.substr(0, c);
        opts = c == std::string_view::npos ? std::string_view() : opts.substr(c + 1);
        if (o == "hnd") {
          order = MhaOrder::kHND;
        } else if (o == "nhd") {
          order = MhaOrder::kNHD;
        } else if (o.substr(0, 6) == "slice=" && !has_slice) {
          const std::string_view v = o.substr(6);
          const auto sl = v.find('/');
          if (sl == std::string_view::npos || !num(v.substr(0, sl), &first) || !num(v.substr(sl + 1), &total))
            return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
          has_slice = true;
        } else {
          return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
        }
      }
    }
    const auto x = rest.find('x');
    if (x == std::string_view::npos) return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
    int32_t h = 0, d = 0;
    if (!num(rest.substr(0, x), &h) || !num(rest.substr(x + 1), &d))
      return Result<EntryFormat>(ErrorCode::kInvalidArgument, bad);
    EntryFormat f = has_slice ? mha_slice(h, d, dtype, order, first, total) : mha(h, d, dtype, order);
    Status st = f.validate();
    if (!st.ok()) return st;
    return f;
  }
#endif
};

}  // namespace kvferry
