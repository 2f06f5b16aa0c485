#pragma once
// Test problems for the paged MHA/GQA decode, shared by the unit (CPU) and gpu tests: logical
// q/K/V contents (seeded, non-zero), placed into a chosen physical layout with garbage
// neighbours, plus an independent float64 reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvferry/kernels/decode_paged.h"
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/tensor_view.h"

namespace kvferry::test {

/// Where K and V live.
enum class KvLayout {
  kContiguous,  ///< two contiguous [NB, P, Hkv, D] buffers
  kLayerNhd,    ///< layer `layer` of a block-major [NB, L, {K,V}, P, Hkv, D] buffer
  kLayerHnd,    ///< layer `layer` of a block-major [NB, L, {K,V}, Hkv, P, D] buffer
  kCombined,    ///< one [NB, P, Hkv, Dk] buffer; V = its first Dv dims (needs Dv <= Dk, V = K[..., :Dv])
};

struct ProblemShape {
  int B = 2, Hq = 8, Hkv = 2, Dk = 128, Dv = 128, P = 16;
  DType qt = DType::kBF16, ct = DType::kBF16;
  std::vector<int32_t> lens = {37, 64};
  int extra_blocks = 3;        ///< pages beyond what the lengths need (unused, random garbage)
  bool v_is_k_prefix = false;  ///< logical V = K[..., :Dv] (for kCombined comparisons)
  uint32_t seed = 1;
};

inline uint16_t to_half_bits(float f, DType t) { return t == DType::kBF16 ? float_to_bf16(f) : float_to_fp16(f); }
inline float half_bits_to_float(uint16_t h, DType t) { return t == DType::kBF16 ? bf16_to_float(h) : fp16_to_float(h); }

/// Logical contents: raw element bits, contiguous [NB, P, Hkv, D] for K/V and [B, Hq, Dk] for q.
struct Problem {
  ProblemShape s;
  int NB = 0, max_blocks = 0, max_len = 0;
  std::vector<uint8_t> q, k, v;  // raw element bytes
  std::vector<int32_t> block_table, lens;
  float sm_scale = 0, logit_cap = 0, k_scale = 1, v_scale = 1;

  int64_t qe() const { return dtype_size(s.qt); }
  int64_t ce() const { return dtype_size(s.ct); }
  float k_at(int64_t blk, int64_t t, int64_t h, int64_t d) const {
    return elem(k, ((blk * s.P + t) * s.Hkv + h) * s.Dk + d);
  }
  float v_at(int64_t blk, int64_t t, int64_t h, int64_t d) const {
    if (s.v_is_k_prefix) return elem(k, ((blk * s.P + t) * s.Hkv + h) * s.Dk + d);
    return elem(v, ((blk * s.P + t) * s.Hkv + h) * s.Dv + d);
  }
  float q_at(int64_t b, int64_t h, int64_t d) const {
    uint16_t x;
    std::memcpy(&x, &q[static_cast<size_t>(((b * s.Hq + h) * s.Dk + d) * 2)], 2);
    return half_bits_to_float(x, s.qt);
  }
  float elem(const std::vector<uint8_t>& buf, int64_t i) const {
    if (s.ct == DType::kFP8E4M3) return e4m3_to_float(buf[static_cast<size_t>(i)]);
    uint16_t x;
    std::memcpy(&x, &buf[static_cast<size_t>(i * 2)], 2);
    return half_bits_to_float(x, s.ct);
  }
};

inline Problem make_problem(const ProblemShape& s) {
  Problem p;
  p.s = s;
  std::mt19937 rng(s.seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  p.lens = s.lens;
  for (int32_t l : s.lens) p.max_len = std::max(p.max_len, l);
  p.max_blocks = std::max(1, (p.max_len + s.P - 1) / s.P);
  p.NB = s.B * p.max_blocks + s.extra_blocks;
  // A random page permutation so that consecutive pages of a request are not adjacent.
  std::vector<int32_t> perm(static_cast<size_t>(p.NB));
  for (int i = 0; i < p.NB; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  p.block_table.assign(static_cast<size_t>(s.B * p.max_blocks), -1);
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < p.max_blocks; ++i) p.block_table[b * p.max_blocks + i] = perm[b * p.max_blocks + i];
  auto fill = [&](std::vector<uint8_t>& buf, int64_t n, DType t, float amp) {
    buf.resize(static_cast<size_t>(n * dtype_size(t)));
    for (int64_t i = 0; i < n; ++i) {
      const float f = u(rng) * amp;
      if (t == DType::kFP8E4M3) {
        buf[i] = float_to_e4m3(f);
      } else {
        const uint16_t h = to_half_bits(f, t);
        std::memcpy(&buf[i * 2], &h, 2);
      }
    }
  };
  const float camp = s.ct == DType::kFP8E4M3 ? 8.0f : 1.0f;
  fill(p.q, int64_t{s.B} * s.Hq * s.Dk, s.qt, 2.0f);
  fill(p.k, int64_t{p.NB} * s.P * s.Hkv * s.Dk, s.ct, camp);
  if (!s.v_is_k_prefix) fill(p.v, int64_t{p.NB} * s.P * s.Hkv * s.Dv, s.ct, camp);
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(s.Dk));
  if (s.ct == DType::kFP8E4M3) {
    p.k_scale = 0.125f;
    p.v_scale = 0.0625f;
  }
  return p;
}

/// Independent float64 reference: full softmax per (b, h), no splits. o [B, Hq, Dv], lse [B, Hq].
inline void reference(const Problem& p, std::vector<double>& o, std::vector<double>& lse) {
  const auto& s = p.s;
  const int G = s.Hq / s.Hkv;
  o.assign(static_cast<size_t>(s.B * s.Hq * s.Dv), 0.0);
  lse.assign(static_cast<size_t>(s.B * s.Hq), -std::numeric_limits<double>::infinity());
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.Hq; ++h) {
      const int g = h / G;
      const int len = p.lens[b];
      if (len == 0) continue;
      std::vector<double> x(static_cast<size_t>(len));
      double m = -std::numeric_limits<double>::infinity();
      for (int n = 0; n < len; ++n) {
        const int blk = p.block_table[b * p.max_blocks + n / s.P];
        double dot = 0;
        for (int d = 0; d < s.Dk; ++d) dot += double(p.q_at(b, h, d)) * p.k_at(blk, n % s.P, g, d) * p.k_scale;
        dot *= p.sm_scale;
        if (p.logit_cap > 0) dot = p.logit_cap * std::tanh(dot / p.logit_cap);
        x[n] = dot;
        m = std::max(m, dot);
      }
      double l = 0;
      for (int n = 0; n < len; ++n) l += std::exp(x[n] - m);
      for (int n = 0; n < len; ++n) {
        const int blk = p.block_table[b * p.max_blocks + n / s.P];
        const double w = std::exp(x[n] - m) / l;
        for (int d = 0; d < s.Dv; ++d) o[(b * s.Hq + h) * s.Dv + d] += w * p.v_at(blk, n % s.P, g, d) * p.v_scale;
      }
      lse[b * s.Hq + h] = m + std::log(l);
    }
}

/// Physical K/V buffers for one layout, with garbage everywhere the views do not address.
struct Placed {
  std::vector<uint8_t> kbuf, vbuf;  ///< vbuf empty when V shares K's buffer
  TensorView k, v;
  bool shared = false;
};

inline void put(std::vector<uint8_t>& buf, const TensorView& view, const Problem& p, const std::vector<uint8_t>& src,
                int D) {
  const int64_t e = p.ce();
  for (int64_t blk = 0; blk < p.NB; ++blk)
    for (int64_t t = 0; t < p.s.P; ++t)
      for (int64_t h = 0; h < p.s.Hkv; ++h)
        std::memcpy(&buf[static_cast<size_t>(view.offset_at(blk, t, h, 0))],
                    &src[static_cast<size_t>(((blk * p.s.P + t) * p.s.Hkv + h) * D * e)], static_cast<size_t>(D * e));
}

inline Placed place(const Problem& p, KvLayout layout, int layers = 3, int layer = 1, uint32_t seed = 99) {
  const auto& s = p.s;
  const int64_t e = p.ce();
  const int64_t NB = p.NB, P = s.P, H = s.Hkv, Dk = s.Dk, Dv = s.Dv;
  Placed out;
  std::mt19937 rng(seed);
  auto garbage = [&](std::vector<uint8_t>& b, int64_t n) {
    b.resize(static_cast<size_t>(n));
    for (auto& x : b) x = static_cast<uint8_t>(rng() & 0x77);  // finite in every dtype
  };
  const std::vector<uint8_t>& vsrc = s.v_is_k_prefix ? p.k : p.v;
  const int vsrc_d = s.v_is_k_prefix ? s.Dk : s.Dv;
  auto v_from = [&](std::vector<uint8_t>& buf, const TensorView& view) {
    for (int64_t blk = 0; blk < NB; ++blk)
      for (int64_t t = 0; t < P; ++t)
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(&buf[static_cast<size_t>(view.offset_at(blk, t, h, 0))],
                      &vsrc[static_cast<size_t>(((blk * P + t) * H + h) * vsrc_d * e)], static_cast<size_t>(Dv * e));
  };
  switch (layout) {
    case KvLayout::kContiguous: {
      out.k = contiguous_view(s.ct, {NB, P, H, Dk});
      out.v = contiguous_view(s.ct, {NB, P, H, Dv});
      garbage(out.kbuf, NB * P * H * Dk * e);
      garbage(out.vbuf, NB * P * H * Dv * e);
      break;
    }
    case KvLayout::kLayerNhd:
    case KvLayout::kLayerHnd: {
      const int64_t kplane = P * H * Dk, vplane = P * H * Dv, per_layer = kplane + vplane;
      const int64_t blk_stride = layers * per_layer;
      const bool hnd = layout == KvLayout::kLayerHnd;
      const int64_t ks[4] = {blk_stride, hnd ? Dk : H * Dk, hnd ? P * Dk : Dk, 1};
      const int64_t vs[4] = {blk_stride, hnd ? Dv : H * Dv, hnd ? P * Dv : Dv, 1};
      const int64_t ksz[4] = {NB, P, H, Dk}, vsz[4] = {NB, P, H, Dv};
      out.k = make_view(s.ct, 4, ksz, ks, layer * per_layer * e);
      out.v = make_view(s.ct, 4, vsz, vs, (layer * per_layer + kplane) * e);
      garbage(out.kbuf, NB * blk_stride * e);
      out.shared = true;
      break;
    }
    case KvLayout::kCombined: {
      out.k = contiguous_view(s.ct, {NB, P, H, Dk});
      out.v = out.k.narrow_last(Dv);
      garbage(out.kbuf, NB * P * H * Dk * e);
      out.shared = true;
      break;
    }
  }
  put(out.kbuf, out.k, p, p.k, s.Dk);
  if (layout == KvLayout::kCombined) return out;  // V is K's prefix: already in place
  v_from(out.shared ? out.kbuf : out.vbuf, out.v);
  return out;
}

/// Fills the parameters except the region pointers of K/V/q/o (set by the caller).
inline DecodePagedParams base_params(const Problem& p, const Placed& pl) {
  DecodePagedParams d;
  const auto& s = p.s;
  d.q = contiguous_view(s.qt, {s.B, s.Hq, s.Dk});
  d.q_region_bytes = static_cast<int64_t>(p.q.size());
  d.k = pl.k;
  d.k_region_bytes = static_cast<int64_t>(pl.kbuf.size());
  d.v = pl.v;
  d.v_region_bytes = static_cast<int64_t>(pl.shared ? pl.kbuf.size() : pl.vbuf.size());
  d.o = contiguous_view(s.qt, {s.B, s.Hq, s.Dv});
  d.o_region_bytes = int64_t{s.B} * s.Hq * s.Dv * p.qe();
  d.block_table_stride = p.max_blocks;
  d.max_blocks_per_seq = p.max_blocks;
  d.max_seq_len = p.max_len;
  d.sm_scale = p.sm_scale;
  d.logit_cap = p.logit_cap;
  d.k_scale = p.k_scale;
  d.v_scale = p.v_scale;
  return d;
}

/// Host-side run of the CPU twin on a placement. o as raw bits, lse fp32.
struct Output {
  std::vector<uint8_t> o;
  std::vector<float> lse;
  float o_at(const Problem& p, size_t i) const {
    uint16_t h;
    std::memcpy(&h, &o[i * 2], 2);
    return half_bits_to_float(h, p.s.qt);
  }
};

inline Status run_cpu(const Problem& p, const Placed& pl, int splits, Output& out) {
  DecodePagedParams d = base_params(p, pl);
  out.o.assign(static_cast<size_t>(d.o_region_bytes), 0xAB);  // poison
  out.lse.assign(static_cast<size_t>(p.s.B * p.s.Hq), 12345.0f);
  d.q_base = p.q.data();
  d.k_base = pl.kbuf.data();
  d.v_base = pl.shared ? pl.kbuf.data() : pl.vbuf.data();
  d.o_base = out.o.data();
  d.lse = out.lse.data();
  d.block_table = p.block_table.data();
  d.seq_lens = p.lens.data();
  d.num_splits = splits;
  std::vector<uint8_t> ws(static_cast<size_t>(decode_paged_workspace_bytes(d)));
  d.workspace = ws.data();
  d.workspace_bytes = static_cast<int64_t>(ws.size());
  return decode_paged_cpu(d);
}

}  // namespace kvferry::test
