// Validation and the CPU twin of the paged MHA/GQA decode.
#include "kvferry/kernels/decode_paged.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvferry {
namespace {

Status bad(const std::string& m) { return {ErrorCode::kInvalidArgument, m}; }

bool head_dim_ok(int64_t d) { return d == 64 || d == 128 || d == 192 || d == 256; }

bool is_half(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

Status check_view(const char* name, const void* base, int64_t region_bytes, const TensorView& v, int rank,
                  int64_t align) {
  if (v.rank != rank)
    return bad(std::string(name) + " has rank " + std::to_string(v.rank) + ", expected " + std::to_string(rank));
  bool empty = false;
  for (int i = 0; i < rank; ++i) empty = empty || v.sizes[i] == 0;
  if (base == nullptr && !empty) return bad(std::string(name) + " region pointer is null");
  if (align > 1 && base != nullptr && reinterpret_cast<uintptr_t>(base) % static_cast<uintptr_t>(align) != 0)
    return {ErrorCode::kMisaligned, std::string(name) + " region is not " + std::to_string(align) + "-byte aligned"};
  if (v.stride(-1) != 1)
    return bad(std::string(name) + " stride(-1) = " + std::to_string(v.stride(-1)) + ", must be 1 in " + v.to_string());
  return v.validate(region_bytes, align).with_context(name);
}

float load_elem(const uint8_t* p, DType t) {
  switch (t) {
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return bf16_to_float(h);
    }
    case DType::kFP16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return fp16_to_float(h);
    }
    case DType::kFP8E4M3: return e4m3_to_float(*p);
    default: return 0.0f;
  }
}

void store_half(uint8_t* p, DType t, float f) {
  const uint16_t h = t == DType::kBF16 ? float_to_bf16(f) : float_to_fp16(f);
  std::memcpy(p, &h, 2);
}

}  // namespace

Status validate_decode_paged(const DecodePagedParams& p) {
  KVFERRY_TRY(check_view("q", p.q_base, p.q_region_bytes, p.q, 3, 0));
  KVFERRY_TRY(check_view("k", p.k_base, p.k_region_bytes, p.k, 4, 16));
  KVFERRY_TRY(check_view("v", p.v_base, p.v_region_bytes, p.v, 4, 16));
  KVFERRY_TRY(check_view("o", p.o_base, p.o_region_bytes, p.o, 3, 0));
  if (!is_half(p.q.dtype)) return bad("q dtype " + std::string(dtype_name(p.q.dtype)) + " is not bf16 or fp16");
  const bool fp8 = p.k.dtype == DType::kFP8E4M3;
  if (!fp8 && p.k.dtype != p.q.dtype)
    return bad("k dtype " + std::string(dtype_name(p.k.dtype)) + " is neither q's (" +
               std::string(dtype_name(p.q.dtype)) + ") nor fp8_e4m3");
  if (p.v.dtype != p.k.dtype)
    return bad("v dtype " + std::string(dtype_name(p.v.dtype)) + " differs from k's " +
               std::string(dtype_name(p.k.dtype)));
  if (p.o.dtype != p.q.dtype)
    return bad("o dtype " + std::string(dtype_name(p.o.dtype)) + " differs from q's " +
               std::string(dtype_name(p.q.dtype)));
  const int64_t B = p.q.size(0), Hq = p.q.size(1), Dk = p.q.size(2);
  const int64_t NB = p.k.size(0), P = p.k.size(1), Hkv = p.k.size(2), Dv = p.v.size(3);
  if (p.k.size(3) != Dk) return bad("k head dim " + std::to_string(p.k.size(3)) + " != q's " + std::to_string(Dk));
  if (!head_dim_ok(Dk)) return bad("Dk = " + std::to_string(Dk) + " is not one of 64, 128, 192, 256");
  if (!head_dim_ok(Dv)) return bad("Dv = " + std::to_string(Dv) + " is not one of 64, 128, 192, 256");
  if (p.v.size(0) != NB || p.v.size(1) != P || p.v.size(2) != Hkv)
    return bad("v " + p.v.to_string() + " does not match k " + p.k.to_string() + " in blocks, page or heads");
  if (P < 1 || P > (1 << 20)) return bad("page size " + std::to_string(P) + " is outside [1, 2^20]");
  if (NB > std::numeric_limits<int32_t>::max()) return bad("more than 2^31 blocks");
  if (Hkv < 1) return bad("k has no heads");
  if (Hq < 1 || Hq % Hkv != 0)
    return bad("Hq = " + std::to_string(Hq) + " is not a positive multiple of Hkv = " + std::to_string(Hkv));
  if (Hkv > 65535 || B > 65535) return bad("batch or kv heads past 65535");
  if (p.o.size(0) != B || p.o.size(1) != Hq || p.o.size(2) != Dv)
    return bad("o " + p.o.to_string() + " is not [B, Hq, Dv] = [" + std::to_string(B) + ", " + std::to_string(Hq) +
               ", " + std::to_string(Dv) + "]");
  if (B > 0) {
    if (p.block_table == nullptr) return bad("block_table is null");
    if (p.seq_lens == nullptr) return bad("seq_lens is null");
    if (p.max_blocks_per_seq < 0) return bad("max_blocks_per_seq is negative");
    if (p.block_table_stride < p.max_blocks_per_seq)
      return bad("block_table_stride " + std::to_string(p.block_table_stride) + " < max_blocks_per_seq " +
                 std::to_string(p.max_blocks_per_seq));
  }
  if (p.max_seq_len < 0 || static_cast<int64_t>(p.max_seq_len) > int64_t{p.max_blocks_per_seq} * P)
    return bad("max_seq_len " + std::to_string(p.max_seq_len) + " is outside [0, max_blocks_per_seq * page]");
  if (!std::isfinite(p.sm_scale)) return bad("sm_scale is not finite");
  if (!(p.logit_cap >= 0.0f) || !std::isfinite(p.logit_cap)) return bad("logit_cap must be finite and >= 0");
  if (fp8 && (!(p.k_scale > 0.0f) || !std::isfinite(p.k_scale) || !(p.v_scale > 0.0f) || !std::isfinite(p.v_scale)))
    return bad("fp8 k_scale / v_scale must be finite and > 0");
  if (p.num_splits < 0 && p.num_splits != kDecodePagedBalanced)
    return bad("num_splits = " + std::to_string(p.num_splits) + " is neither >= 0 nor kDecodePagedBalanced");
  if (const int64_t need = decode_paged_workspace_bytes(p); p.workspace_bytes < need)
    return {ErrorCode::kResourceExhausted,
            "workspace of " + std::to_string(p.workspace_bytes) + " bytes < " + std::to_string(need) + " needed for " +
                (p.num_splits == kDecodePagedBalanced ? std::string("the balanced schedule")
                                                      : std::to_string(p.num_splits) + " splits")};
  return Status::Ok();
}

int64_t decode_paged_workspace_bytes(const DecodePagedParams& p) {
  if (p.q.rank != 3 || p.k.rank != 4 || p.v.rank != 4) return 0;
  if (p.num_splits == kDecodePagedBalanced) {
    const int grid = decode_paged_balanced_grid(p);
    return grid > 0 ? decode_paged_balanced_workspace_bytes(p.q.size(0), p.q.size(1), p.k.size(2), p.v.size(3), grid)
                    : 0;
  }
  return decode_paged_workspace_bytes(p.q.size(0), p.q.size(1), p.v.size(3), p.num_splits);
}

Status decode_paged_cpu(const DecodePagedParams& p) {
  KVFERRY_TRY(validate_decode_paged(p));
  const int64_t B = p.q.size(0), Hq = p.q.size(1), Dk = p.q.size(2);
  const int64_t NB = p.k.size(0), P = p.k.size(1), Hkv = p.k.size(2), Dv = p.v.size(3);
  const int64_t G = Hq / Hkv;
  const int S = p.num_splits < 1 ? 1 : p.num_splits;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t len = p.seq_lens[b];
    if (len < 0 || len > int64_t{p.max_blocks_per_seq} * P || len > p.max_seq_len)
      return {ErrorCode::kOutOfRange, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) +
                                          " is outside [0, min(max_seq_len, max_blocks_per_seq * page)]"};
    for (int64_t i = 0; i < (len + P - 1) / P; ++i) {
      const int32_t pg = p.block_table[b * p.block_table_stride + i];
      if (pg < 0 || pg >= NB)
        return {ErrorCode::kOutOfRange, "block_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                                            std::to_string(pg) + " is outside [0, " + std::to_string(NB) + ")"};
    }
  }
  const auto* qb = static_cast<const uint8_t*>(p.q_base);
  const auto* kb = static_cast<const uint8_t*>(p.k_base);
  const auto* vb = static_cast<const uint8_t*>(p.v_base);
  auto* ob = static_cast<uint8_t*>(p.o_base);
  const bool fp8 = p.k.dtype == DType::kFP8E4M3;
  const float ks = fp8 ? p.k_scale : 1.0f, vs = fp8 ? p.v_scale : 1.0f;
  const float ninf = -std::numeric_limits<float>::infinity();

  std::vector<float> q(static_cast<size_t>(Dk)), kf(static_cast<size_t>(Dk)), acc(static_cast<size_t>(Dv)),
      out(static_cast<size_t>(Dv)), part_o(static_cast<size_t>(S * Dv)), part_lse(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b) {
    const int32_t len = p.seq_lens[b];
    const int32_t chunk = decode_paged_split_chunk(len, S);
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / G;
      for (int64_t d = 0; d < Dk; ++d) q[d] = load_elem(qb + p.q.offset_at(b, h, d), p.q.dtype);
      for (int s = 0; s < S; ++s) {
        const int64_t start = int64_t{s} * chunk, end = std::min<int64_t>(len, start + chunk);
        float m = ninf, l = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t n = start; n < end; ++n) {
          const int64_t pg = p.block_table[b * p.block_table_stride + n / P];
          const int64_t off = n % P;
          float x = 0.0f;
          for (int64_t d = 0; d < Dk; ++d) x += q[d] * load_elem(kb + p.k.offset_at(pg, off, g, d), p.k.dtype);
          x *= p.sm_scale * ks;
          if (p.logit_cap > 0.0f) x = p.logit_cap * std::tanh(x / p.logit_cap);
          const float mn = std::max(m, x);
          const float alpha = std::exp(m - mn), pr = std::exp(x - mn);
          l = l * alpha + pr;
          for (int64_t d = 0; d < Dv; ++d)
            acc[d] = acc[d] * alpha + pr * load_elem(vb + p.v.offset_at(pg, off, g, d), p.v.dtype);
          m = mn;
        }
        if (end > start) {
          for (int64_t d = 0; d < Dv; ++d) part_o[s * Dv + d] = acc[d] / l * vs;
          part_lse[s] = m + std::log(l);
        } else {
          for (int64_t d = 0; d < Dv; ++d) part_o[s * Dv + d] = 0.0f;
          part_lse[s] = ninf;
        }
      }
      // LSE merge in split order; empty splits (-inf) contribute nothing.
      float M = ninf;
      for (int s = 0; s < S; ++s) M = std::max(M, part_lse[s]);
      float W = 0.0f;
      std::fill(out.begin(), out.end(), 0.0f);
      if (M != ninf) {
        for (int s = 0; s < S; ++s) {
          if (part_lse[s] == ninf) continue;
          const float w = std::exp(part_lse[s] - M);
          W += w;
          for (int64_t d = 0; d < Dv; ++d) out[d] += w * part_o[s * Dv + d];
        }
        for (int64_t d = 0; d < Dv; ++d) out[d] /= W;
      }
      for (int64_t d = 0; d < Dv; ++d) store_half(ob + p.o.offset_at(b, h, d), p.o.dtype, out[d]);
      if (p.lse != nullptr) p.lse[b * Hq + h] = M == ninf ? ninf : M + std::log(W);
    }
  }
  return Status::Ok();
}

#if !defined(KVFERRY_WITH_CUDA)
int decode_paged_choose_splits(const DecodePagedParams&) { return 1; }
int decode_paged_balanced_grid(const DecodePagedParams&) { return 0; }
#endif

}  // namespace kvferry
