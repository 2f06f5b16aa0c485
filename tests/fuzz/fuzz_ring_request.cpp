// libFuzzer target for the daemon's read of a ring entry: the input is a submission slot (64
// bytes) followed by an arena. take_keyed_request must refuse or copy exactly what lies inside
// the arena; a copy must match the arena's bytes and leave room for the statuses.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../../daemon/src/ring_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  if (size < sizeof(ring::SubmitEntry)) return 0;
  ring::SubmitEntry e;
  std::memcpy(&e, data, sizeof e);
  const uint8_t* arena = data + sizeof e;
  const auto arena_bytes = static_cast<uint32_t>(size - sizeof e);
  for (uint16_t op : {e.op, uint16_t{16}, uint16_t{17}, uint16_t{18}, uint16_t{21}}) {
    e.op = op;
    auto r = daemon::take_keyed_request(e, arena, arena_bytes);
    if (!r.ok()) {
      if (r.status().code() != ErrorCode::kMisaligned && r.status().code() != ErrorCode::kOutOfRange) std::abort();
      continue;
    }
    if (r->keys.size() != e.count) std::abort();
    if (ops::has_block_ids(op) != (r->block_ids.size() == e.count) && e.count) std::abort();
    if (r->status_offset + uint64_t{e.count} * sizeof(int16_t) > arena_bytes) std::abort();
    if (e.count && std::memcmp(r->keys.data(), arena + e.arena_offset, e.count * sizeof(ops::Key)) != 0) std::abort();
    if (!r->block_ids.empty() && std::memcmp(r->block_ids.data(), arena + e.arena_offset + e.count * sizeof(ops::Key),
                                             e.count * sizeof(int64_t)) != 0)
      std::abort();
  }
  (void)daemon::check_result_area(e, arena_bytes, 136);
  return 0;
}
