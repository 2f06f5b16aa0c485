#pragma once
// Helpers of the data-path kernel tests: aligned buffers with seeded patterns, valid random
// entries of each MLA format, and cross-layer regions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <vector>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/entry_format.h"
#include "kvferry/layouts/kv_cache_spec.h"

namespace kvferry::test {

/// A 64-byte aligned byte buffer.
class Bytes {
 public:
  explicit Bytes(size_t n = 0) : n_(n), p_(static_cast<uint8_t*>(::operator new(n ? n : 1, std::align_val_t(64)))) {
    std::memset(p_, 0, n ? n : 1);
  }
  ~Bytes() { ::operator delete(p_, std::align_val_t(64)); }
  Bytes(const Bytes& o) : Bytes(o.n_) { std::memcpy(p_, o.p_, n_); }
  Bytes& operator=(const Bytes&) = delete;
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  int64_t ssize() const { return static_cast<int64_t>(n_); }
  bool operator==(const Bytes& o) const { return n_ == o.n_ && std::memcmp(p_, o.p_, n_) == 0; }

 private:
  size_t n_;
  uint8_t* p_;
};

inline void fill_random(uint8_t* p, size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(g() & 0xff);
}

/// n bf16 values of N(0, sigma) (as bits).
inline std::vector<uint16_t> random_bf16(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(d(g));
  return v;
}

/// Writes a random *valid* entry of `kind` at p (bf16: finite values; fp8: finite e4m3;
/// ds: finite e4m3, positive scales, finite bf16 rope; indexer: random bytes; fp4: bytes in
/// [0, 0xFC]). Not for MHA.
/// mla_fp4 pages are planes ([BS x 288 values][BS x 36 scales]), so the 324 bytes at token t's
/// entry offset (t * 324) are not that token's: filling every token of a page fills both planes.
/// Every byte is therefore drawn alike: any byte is an e2m1 pair, and a scale byte <= 0xFC
/// (2^125) keeps every decode finite in bf16 (0xFF is the non-finite marker; 0xFD and 0xFE
/// overflow bf16 with the larger codes, e.g. 6 * 2^126).
inline void random_entry(FormatKind kind, uint8_t* p, std::mt19937& g) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  auto e4m3 = [&] {
    uint8_t b;
    do b = static_cast<uint8_t>(g() & 0xff);
    while ((b & 0x7f) == 0x7f);
    return b;
  };
  if (kind == FormatKind::kMlaBf16) {
    for (int i = 0; i < kMlaDim; ++i) {
      const uint16_t h = float_to_bf16(d(g));
      std::memcpy(p + 2 * i, &h, 2);
    }
  } else if (kind == FormatKind::kMlaFp8) {
    for (int i = 0; i < kMlaFp8Bytes; ++i) p[i] = e4m3();
  } else if (kind == FormatKind::kIndexerFp8) {
    for (int i = 0; i < kIndexerBytes; ++i) p[i] = static_cast<uint8_t>(g() & 0xff);
  } else if (kind == FormatKind::kMlaFp4) {
    std::uniform_int_distribution<int> byte(0, 0xFC);
    for (int i = 0; i < kMlaFp4Bytes; ++i) p[i] = static_cast<uint8_t>(byte(g));
  } else {
    for (int i = 0; i < kMlaRank; ++i) p[i] = e4m3();
    for (int t = 0; t < kMlaTiles; ++t) {
      const float s = std::fabs(d(g)) * 0.01f + 1e-3f;
      std::memcpy(p + kMlaDsScaleOffset + 4 * t, &s, 4);
    }
    for (int i = 0; i < kMlaRope; ++i) {
      const uint16_t h = float_to_bf16(d(g));
      std::memcpy(p + kMlaDsRopeOffset + 2 * i, &h, 2);
    }
  }
}

/// A region described by a spec, filled with a seeded byte pattern.
struct Region {
  KvCacheSpec spec;
  Bytes bytes;
  Region(const KvCacheSpec& s, uint32_t seed) : spec(s), bytes(static_cast<size_t>(s.region_bytes())) {
    fill_random(bytes.data(), bytes.size(), seed);
  }
  kernels::CacheRef layer(int64_t l) { return {bytes.data(), bytes.ssize(), spec.layer_view(l)}; }
  kernels::CacheRef plane(int64_t l, bool v) { return {bytes.data(), bytes.ssize(), spec.kv_view(l, v)}; }
};

/// Fills every entry of `r` with random but valid values of its format (random_entry).
inline void fill_valid(Region& r, uint32_t seed) {
  std::mt19937 g(seed);
  const int64_t e = r.spec.format.bytes_per_token();
  for (int64_t l = 0; l < r.spec.layers; ++l)
    for (int64_t b = 0; b < r.spec.blocks; ++b)
      for (int64_t t = 0; t < r.spec.block_size; ++t)
        random_entry(r.spec.format.kind, r.bytes.data() + r.spec.page_offset(l, b) + t * e, g);
}

inline KvCacheSpec mk_spec(int64_t layers, int64_t blocks, int64_t bs, EntryFormat f,
                           Layout layout = Layout::kBlockMajor) {
  KvCacheSpec s;
  s.layers = layers;
  s.blocks = blocks;
  s.block_size = bs;
  s.format = f;
  s.layout = layout;
  return s;
}

/// Copies layer `l` of `r` into a contiguous one-layer region (or back when to_region).
inline void copy_layer(Region& r, int64_t l, Region& one, bool to_region) {
  const int64_t page = r.spec.page_bytes();
  for (int64_t b = 0; b < r.spec.blocks; ++b) {
    uint8_t* a = r.bytes.data() + r.spec.page_offset(l, b);
    uint8_t* c = one.bytes.data() + one.spec.page_offset(0, b);
    if (to_region)
      std::memcpy(a, c, static_cast<size_t>(page));
    else
      std::memcpy(c, a, static_cast<size_t>(page));
  }
}

/// True when every page of every layer but `l` of `a` equals the same page of `b`.
inline bool others_equal(const Region& a, const Region& b, int64_t l) {
  const int64_t page = a.spec.page_bytes();
  for (int64_t ll = 0; ll < a.spec.layers; ++ll) {
    if (ll == l) continue;
    for (int64_t blk = 0; blk < a.spec.blocks; ++blk)
      if (std::memcmp(a.bytes.data() + a.spec.page_offset(ll, blk), b.bytes.data() + b.spec.page_offset(ll, blk),
                      static_cast<size_t>(page)) != 0)
        return false;
  }
  return true;
}

/// True when layer `l` of `r` equals the one-layer region `one` page by page.
inline bool layer_equal(const Region& r, int64_t l, const Region& one) {
  const int64_t page = r.spec.page_bytes();
  for (int64_t b = 0; b < r.spec.blocks; ++b)
    if (std::memcmp(r.bytes.data() + r.spec.page_offset(l, b), one.bytes.data() + one.spec.page_offset(0, b),
                    static_cast<size_t>(page)) != 0)
      return false;
  return true;
}

/// `count` distinct slots of NB*BS in random order, with every 7th replaced by -1 (padding).
inline std::vector<int64_t> random_slots(int64_t total, int64_t count, uint32_t seed) {
  std::vector<int64_t> all(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) all[static_cast<size_t>(i)] = i;
  std::mt19937 g(seed);
  std::shuffle(all.begin(), all.end(), g);
  all.resize(static_cast<size_t>(count));
  for (size_t i = 3; i < all.size(); i += 7) all[i] = -1;
  return all;
}

/// Layer indices to try for L layers: first, middle, last (deduplicated).
inline std::vector<int64_t> probe_layers(int64_t layers) {
  std::vector<int64_t> v{0};
  if (layers > 2) v.push_back(layers / 2);
  if (layers > 1) v.push_back(layers - 1);
  return v;
}

}  // namespace kvferry::test
