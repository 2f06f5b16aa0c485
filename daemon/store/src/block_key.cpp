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

uint64_t block_checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace kvferry::store
