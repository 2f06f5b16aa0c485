#include "kvferry/store/block_key.h"

#include <cstdio>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvferry::store {

std::string BlockKey::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

#if defined(__x86_64__)
uint64_t block_checksum_avx2(const void* data, size_t bytes);  // block_checksum_avx2.cpp (-mavx2)
#endif

namespace {
using HashFn = uint64_t (*)(const void*, size_t);
HashFn pick() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return &block_checksum_avx2;
#endif
  return &block_checksum_baseline;
}
HashFn hash_fn() {
  static const HashFn f = pick();
  return f;
}
}  // namespace

uint64_t block_checksum_baseline(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }
uint64_t block_checksum(const void* data, size_t bytes) { return hash_fn()(data, bytes); }
const char* block_checksum_impl() { return hash_fn() == &block_checksum_baseline ? "baseline" : "avx2"; }

}  // namespace kvferry::store
