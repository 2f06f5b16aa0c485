#pragma once
// BlockKey: the 128-bit content key an engine chooses for a block (a chained prefix hash of token
// ids), and the namespace it lives in (model + format fingerprint + tenant) so that unrelated
// models never share blocks.
#include <cstdint>
#include <functional>
#include <string>

namespace kvferry::store {

struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const BlockKey&) const = default;
  /// 32 hex digits, hi first.
  std::string hex() const;
};

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const noexcept {
    return std::hash<uint64_t>()(k.hi * 0x9E3779B97F4A7C15ull ^ k.lo);
  }
};

/// Interned namespace id (see BlockIndex::intern_namespace).
using NamespaceId = uint32_t;

struct NsKey {
  NamespaceId ns = 0;
  BlockKey key;
  bool operator==(const NsKey&) const = default;
};

struct NsKeyHash {
  size_t operator()(const NsKey& k) const noexcept {
    // The keys are already hashes; mix in the namespace so equal keys of two namespaces spread.
    uint64_t h = k.key.lo ^ (k.key.hi * 0x9e3779b97f4a7c15ull) ^ (uint64_t{k.ns} << 32 | k.ns);
    h ^= h >> 31;
    return static_cast<size_t>(h * 0xbf58476d1ce4e5b9ull);
  }
};

/// XXH3-64 of `bytes` at `data`: the checksum every block carries once it leaves the device.
/// Uses the AVX2 build of XXH3 where the CPU has it (the same value, about twice the speed of the
/// SSE2 baseline: hashing has to keep up with PCIe).
uint64_t block_checksum(const void* data, size_t bytes);
/// The baseline (SSE2 / scalar) build of the same XXH3-64, for tests.
uint64_t block_checksum_baseline(const void* data, size_t bytes);
/// Which build block_checksum uses: "avx2" or "baseline".
const char* block_checksum_impl();

}  // namespace kvferry::store
