#pragma once
// The daemon's one read of a keyed data op's input (lookup, save, load, pin, unpin, evict, the
// test fault knob). The submission slot is already a daemon-side copy (RingService copies each
// slot once); the arena is client-writable memory, so the block lists are copied out of it once,
// here, and validated on the copy. Nothing later reads the arena's input again; the daemon only
// writes the per-key statuses back at `status_offset`, which is checked to lie inside the arena.
// Header-only so that the fuzz target over ring entries builds it alone.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvferry/connector/ops.h"
#include "kvferry/connector/ring.h"
#include "kvferry/layouts/status.h"

namespace kvferry::daemon {

/// A keyed request's input, in daemon memory.
struct KeyedRequest {
  std::vector<ops::Key> keys;
  std::vector<int64_t> block_ids;  ///< save and load only (one per key)
  uint64_t status_offset = 0;      ///< arena offset of the int16 statuses (count of them fit)
};

/// Validates `e`'s arena part (8-byte aligned, input and statuses inside an arena of
/// `arena_bytes`) and copies its keys (and block ids) out of `arena`. kMisaligned or kOutOfRange
/// with the numbers otherwise.
inline Result<KeyedRequest> take_keyed_request(const ring::SubmitEntry& e, const uint8_t* arena, uint32_t arena_bytes) {
  if (e.arena_offset % 8 != 0)
    return Result<KeyedRequest>(ErrorCode::kMisaligned,
                                "arena_offset " + std::to_string(e.arena_offset) + " is not 8-byte aligned");
  const uint64_t need = ops::request_bytes(e.op, e.count);  // count < 2^32: no overflow in 64 bits
  if (uint64_t{e.arena_offset} + need > arena_bytes)
    return Result<KeyedRequest>(ErrorCode::kOutOfRange, std::to_string(e.count) + " entries at arena offset " +
                                                            std::to_string(e.arena_offset) + " need " +
                                                            std::to_string(need) + " bytes, past the arena of " +
                                                            std::to_string(arena_bytes));
  KeyedRequest r;
  r.status_offset = ops::status_offset(e.op, e.arena_offset, e.count);
  if (e.count == 0) return r;  // nothing to copy (and memcpy may not take the empty vectors' null data)
  const uint8_t* p = arena + e.arena_offset;
  r.keys.resize(e.count);
  std::memcpy(r.keys.data(), p, e.count * sizeof(ops::Key));
  if (ops::has_block_ids(e.op)) {
    r.block_ids.resize(e.count);
    std::memcpy(r.block_ids.data(), p + e.count * sizeof(ops::Key), e.count * sizeof(int64_t));
  }
  return r;
}

/// Checks that `bytes` of results fit at `e.arena_offset` (8-byte aligned) in an arena of
/// `arena_bytes` (stats, ls).
inline Status check_result_area(const ring::SubmitEntry& e, uint32_t arena_bytes, uint64_t bytes) {
  if (e.arena_offset % 8 != 0)
    return {ErrorCode::kMisaligned, "arena_offset " + std::to_string(e.arena_offset) + " is not 8-byte aligned"};
  if (uint64_t{e.arena_offset} + bytes > arena_bytes)
    return {ErrorCode::kOutOfRange, std::to_string(bytes) + " result bytes at arena offset " +
                                        std::to_string(e.arena_offset) + " are past the arena of " +
                                        std::to_string(arena_bytes)};
  return Status::Ok();
}

}  // namespace kvferry::daemon
