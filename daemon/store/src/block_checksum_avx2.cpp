// XXH3-64 built for AVX2 (this file alone is compiled with -mavx2); block_key.cpp calls it only
// when the CPU has AVX2. XXH3's value does not depend on the vector unit it runs on.
#if defined(__x86_64__)
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvferry::store {

uint64_t block_checksum_avx2(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace kvferry::store
#endif
