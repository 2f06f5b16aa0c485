#pragma once
// Test inputs for decode_mla: a block-major cache region of `layers` layers in which one layer
// holds the requests' pages, seeded random queries, block tables and garbage everywhere else.
// Shared by the unit (CPU) and gpu tests.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvferry/kernels/decode_mla.h"
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/kv_cache_spec.h"

namespace kvferry::test {

struct MlaCase {
  EntryFormat format = EntryFormat::mla_bf16();
  int heads = 16;
  int page = 16;
  std::vector<int32_t> lens;  // one per request
  int layers = 1;             // block-major region of this many layers
  int layer = 0;              // the layer the requests read
  int spare_blocks = 3;       // blocks nobody reads
  float sm_scale = 0.15f;
  float k_scale = 1.0f;
  int fp8_math = 0;     // DecodeMlaParams::fp8_math
  bool garbage = true;  // unused bytes (other layers, pages, table entries, tail tokens) are garbage
  uint64_t seed = 1;

  // Built by build().
  KvCacheSpec spec;
  std::vector<uint8_t> region;  // the whole block-major region
  std::vector<uint16_t> q;
  std::vector<int32_t> table;
  int64_t table_stride = 0;
  int64_t blocks = 0;

  int batch() const { return static_cast<int>(lens.size()); }

  // A random finite entry value of the format, as stored bytes (eb bytes at dst).
  static void random_entry(FormatKind kind, std::mt19937_64& rng, uint8_t* e) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    switch (kind) {
      case FormatKind::kMlaBf16:
        for (int d = 0; d < kMlaDim; ++d) {
          const uint16_t h = float_to_bf16(u(rng));
          std::memcpy(e + 2 * d, &h, 2);
        }
        break;
      case FormatKind::kMlaFp8:
        for (int d = 0; d < kMlaDim; ++d) e[d] = float_to_e4m3(2.0f * u(rng));
        break;
      case FormatKind::kMlaFp8Ds: {
        for (int d = 0; d < kMlaRank; ++d) e[d] = float_to_e4m3(400.0f * u(rng));
        for (int t = 0; t < kMlaTiles; ++t) {
          const float s = (1.0f + 0.5f * u(rng)) / 300.0f;
          std::memcpy(e + kMlaDsScaleOffset + 4 * t, &s, 4);
        }
        for (int i = 0; i < kMlaRope; ++i) {
          const uint16_t h = float_to_bf16(u(rng));
          std::memcpy(e + kMlaDsRopeOffset + 2 * i, &h, 2);
        }
        break;
      }
      default: break;
    }
  }

  void build() {
    std::mt19937_64 rng(seed);                            // the data: the same whatever the layout
    std::mt19937_64 rng_g(seed ^ 0x9e3779b97f4a7c15ull);  // the garbage
    const int64_t e_bytes = format.bytes_per_token();
    int64_t pages = 0;
    int64_t max_pages = 1;
    for (int32_t n : lens) {
      pages += (n + page - 1) / page;
      max_pages = std::max<int64_t>(max_pages, (n + page - 1) / page);
    }
    blocks = pages + spare_blocks;
    spec = KvCacheSpec{layers, blocks, page, format, Layout::kBlockMajor};
    region.assign(static_cast<size_t>(spec.region_bytes()), 0);
    if (garbage) {  // NaN-rich garbage: 0xFF is NaN in bf16 and e4m3, and a NaN fp32 scale
      for (size_t i = 0; i + 8 <= region.size(); i += 8) {
        uint64_t v = rng_g() | 0x8080808080808080ull;  // negative, often huge or NaN (0xFF)
        v |= (rng_g() & 0x0101010101010101ull) * 0x7f;
        std::memcpy(&region[i], &v, 8);
      }
    }
    // Pages of the requests in a random order.
    std::vector<int32_t> perm(static_cast<size_t>(blocks));
    for (int64_t i = 0; i < blocks; ++i) perm[i] = static_cast<int32_t>(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    table_stride = max_pages + 2;
    table.assign(static_cast<size_t>(batch() * table_stride), garbage ? 0x7fffffff : 0);
    if (garbage)
      for (int64_t i = 0; i < static_cast<int64_t>(table.size()); ++i) table[i] = (i % 2) ? -1 : 0x7fffffff;
    int64_t next = 0;
    for (int b = 0; b < batch(); ++b) {
      const int64_t np = (lens[b] + page - 1) / page;
      for (int64_t i = 0; i < np; ++i) {
        const int32_t blk = perm[next++];
        table[b * table_stride + i] = blk;
        const int64_t page_off = spec.page_offset(layer, blk);
        const int64_t valid = std::min<int64_t>(page, lens[b] - i * page);
        for (int64_t t = 0; t < valid; ++t) random_entry(format.kind, rng, &region[page_off + t * e_bytes]);
      }
    }
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    q.resize(static_cast<size_t>(batch()) * heads * kMlaDim);
    for (auto& x : q) x = float_to_bf16(u(rng));
  }

  // For mla_fp8_ds: how far rounding every nope value e4m3 * scale to bf16 (2^-9 relative, as the
  // wgmma kernel does before its bf16 products) can move x_j of (b, h), at most, over the request's
  // tokens: sm_scale * 2^-9 * max_j sum_d |q_d k_jd|. 0 for the other formats.
  double ds_round_bound(int b, int h) const {
    if (format.kind != FormatKind::kMlaFp8Ds) return 0.0;
    const int64_t e_bytes = format.bytes_per_token();
    const uint16_t* qh = &q[(static_cast<size_t>(b) * heads + h) * kMlaDim];
    double worst = 0.0;
    for (int32_t j = 0; j < lens[b]; ++j) {
      const uint8_t* e = &region[spec.page_offset(layer, table[b * table_stride + j / page]) + (j % page) * e_bytes];
      double sum = 0.0;
      for (int d = 0; d < kMlaRank; ++d) {
        float s;
        std::memcpy(&s, e + kMlaDsScaleOffset + 4 * (d / kMlaTile), 4);
        sum += std::abs(static_cast<double>(bf16_to_float(qh[d])) * e4m3_to_float(e[d]) * s);
      }
      worst = std::max(worst, sum);
    }
    return sm_scale * worst / 512.0;
  }

  // Params over this case's host buffers (o and lse supplied by the caller).
  DecodeMlaParams params(uint16_t* o, float* lse) const {
    DecodeMlaParams p;
    p.format = format;
    p.cache_base = region.data();
    p.region_bytes = static_cast<int64_t>(region.size());
    p.cache = spec.layer_view(layer);
    p.q = q.data();
    p.block_table = table.data();
    p.block_table_stride = table_stride;
    p.seq_lens = lens.data();
    p.batch = batch();
    p.heads = heads;
    p.sm_scale = sm_scale;
    p.k_scale = k_scale;
    p.fp8_math = fp8_math;
    p.o = o;
    p.lse = lse;
    return p;
  }
};

// Relative L2 distance of request r's o (bf16 bits, [batch, heads, 512] as the case's) from a
// reference whose element i is ref(i); the absolute distance where the reference is all zero (an
// empty request), so 0 means equal there too.
template <class Ref>
double request_rel_l2(const MlaCase& c, int r, const std::vector<uint16_t>& o, Ref ref) {
  double num = 0, den = 0;
  const size_t per = static_cast<size_t>(c.heads) * kMlaRank;
  for (size_t i = static_cast<size_t>(r) * per; i < static_cast<size_t>(r + 1) * per; ++i) {
    const double x = bf16_to_float(o[i]), y = ref(i);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(den > 0 ? num / den : num);
}

}  // namespace kvferry::test
