#pragma once
// Arena layouts of the data ops (proto::Op::kLookup .. kLs): what a client writes into its
// arena at `SubmitEntry::arena_offset` and what the daemon writes back. Little-endian, fixed
// width, 8-byte aligned (`arena_offset` must be a multiple of 8). Every op that takes keys
// writes one int16 ErrorCode per key after its input, at status_offset(); the completion's
// `arena_offset`/`count` point there and `done` counts the keys that succeeded.
//
//   op       | region        | input at arena_offset              | results
//   ---------+---------------+------------------------------------+----------------------------------
//   lookup   | the region    | Key[count]                         | int16[count] (kOk hit, kNotFound),
//            |               |                                    | result[0] = longest hit prefix
//   save     | the region    | Key[count], int64 block_id[count]  | int16[count]
//   load     | the region    | Key[count], int64 block_id[count]  | int16[count]
//   pin      | the region    | Key[count]                         | int16[count]
//   unpin    | the region    | Key[count]                         | int16[count]
//   evict    | the region,   | Key[count]; args[0] & kEvictAll:   | int16[count] (kOk evicted,
//            | 0 with        | every unpinned block of the        | kNotFound, kBusy pinned/in use);
//            | kEvictAllNs   | region's namespace (count 0);      | result[0] = blocks evicted
//            |               | kEvictAllNs: of every namespace    |
//   stats    | 0             | -; args[0] & kStatsTiers: the      | StatsWire at arena_offset, then
//            |               | lower tiers too, args[1] = most    | (kStatsTiers) TierStatsWire[n];
//            |               | TierStatsWire entries (0 = what    | count = 1 + n (1: the
//            |               | fits in the arena)                 | StatsWire alone)
//   ls       | region or 0   | args[0] = most entries             | LsEntry[count] at arena_offset
//            | (0 = every    |                                    | (count = entries written)
//            | namespace)    |                                    |
//   send     | the region    | Key[count], int64 block_id[count], | int16[count]: saved here and
//            |               | then (at request_bytes) the peer's | stored on the peer (verified);
//            |               | member id, args[1] bytes (<= 255); | with args[2] also loaded into
//            |               | args[2] != 0: the peer's region,   | that region of the peer
//            |               | its int64 block ids[count] after   |
//            |               | the id (8-aligned)                 |
//   peers    | 0             | args[0] = arena bytes to fill      | JSON text at arena_offset,
//            |               |                                    | result[0] = bytes written,
//            |               |                                    | result[1] = bytes of the whole text
//   load_    | the region    | Key[count], int64 block_id[count], | int16[count], one per entry: a
//   mapped   |               | then (at request_bytes) int32      | region block's entries share its
//            |               | part[count]                        | status (all or nothing)
//
// load_mapped: entry i puts part part[i] of the stored block Key[i] into region block block_id[i]
// (page sizes, tensor-parallel head slices, NHD/HND, MLA conversions; layouts/geometry.h says
// which tokens a part is). See OffloadService::load_mapped.
//
// stats: the StatsWire holds the host pool's figures (unchanged since the first release); with
// kStatsTiers one TierStatsWire per lower tier the daemon runs follows it (disk, then remote), none
// for a host-only daemon. A daemon that predates kStatsTiers ignores the bit and answers count 1.
//
// lookup with args[0] & kLookupWait waits up to args[1] ms for keys that are not stored yet (a
// peer's send landing); each key completes kOk once stored, kNotFound if still absent at the end.
//
// A block's namespace is `model|format family of the region|tenant` (model and tenant from the
// client's Hello; see Client::Options), so the region an op names picks the family.
#include <cstddef>
#include <cstdint>

namespace kvferry::ops {

/// A 128-bit block key chosen by the engine (e.g. a chained hash of the block's token ids).
struct Key {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Key&) const = default;
};
static_assert(sizeof(Key) == 16);

inline constexpr uint64_t kEvictAll = 1;              ///< evict args[0]: every unpinned block of the region's namespace
inline constexpr uint64_t kEvictAllNs = 2;            ///< evict args[0]: every unpinned block of every namespace
inline constexpr uint64_t kLookupWait = 1;            ///< lookup args[0]: wait up to args[1] ms for absent keys
inline constexpr uint64_t kMaxLookupWaitMs = 600000;  ///< the longest wait a lookup may ask for
inline constexpr uint64_t kMaxPeerName = 255;         ///< send: the longest peer member id
inline constexpr uint64_t kStatsTiers = 1;            ///< stats args[0]: TierStatsWire entries follow the StatsWire
inline constexpr uint32_t kMaxTierStats = 4;          ///< the most TierStatsWire entries a client asks for

/// Whether `op` carries block ids after its keys (save, load, send, load_mapped).
inline constexpr bool has_block_ids(uint16_t op) { return op == 17 || op == 18 || op == 25 || op == 27; }
/// load_mapped: bytes of the int32 parts that follow its request_bytes.
inline constexpr uint64_t parts_bytes(uint64_t count) { return (count * sizeof(int32_t) + 7) / 8 * 8; }
/// Bytes of the input of `count` keys of `op`.
inline constexpr uint64_t input_bytes(uint16_t op, uint64_t count) {
  return count * (sizeof(Key) + (has_block_ids(op) ? sizeof(int64_t) : 0));
}
/// Where the per-key int16 statuses of a request at `arena_offset` go.
inline constexpr uint64_t status_offset(uint16_t op, uint64_t arena_offset, uint64_t count) {
  return arena_offset + input_bytes(op, count);
}
/// Arena bytes one request of `count` keys of `op` uses (input + statuses, rounded to 8).
inline constexpr uint64_t request_bytes(uint16_t op, uint64_t count) {
  return (input_bytes(op, count) + count * sizeof(int16_t) + 7) / 8 * 8;
}

/// The answer of stats (all counters since the daemon started).
struct StatsWire {
  uint64_t entries;         ///< blocks stored
  uint64_t writing;         ///< blocks being written
  uint64_t pinned;          ///< pinned blocks
  uint64_t used_bytes;      ///< host pool bytes in use
  uint64_t capacity_bytes;  ///< host pool capacity
  uint64_t evictions;       ///< blocks evicted
  uint64_t evicted_bytes;
  uint64_t lookups;  ///< keys looked up
  uint64_t hits;
  uint64_t misses;
  uint64_t blocks_saved;
  uint64_t bytes_saved;
  uint64_t blocks_loaded;
  uint64_t bytes_loaded;
  uint64_t checksum_failures;
  uint64_t clients;
  uint64_t pool_pinned;  ///< 1 when the pool is page-locked for DMA
};
static_assert(sizeof(StatsWire) % 8 == 0);

/// TierStatsWire::flags bits.
inline constexpr uint32_t kTierPresent = 1;  ///< the daemon runs this tier (always set in an answer)
inline constexpr uint32_t kTierHealthy = 2;  ///< the tier works (clear: degraded, see `reason`)
inline constexpr uint32_t kTierStorage = 4;  ///< capacity_bytes .. bytes_read hold the tier's storage figures
inline constexpr uint32_t kTierPeers = 8;    ///< member .. errors hold the remote tier's cluster figures

/// One lower tier in the answer of stats with kStatsTiers (counters since the daemon started).
/// The disk tier fills the storage part, the remote tier the cluster part (its blocks live in
/// the host pool, so it has no storage of its own); `flags` says which.
struct TierStatsWire {
  char tier[8];  ///< "disk", "remote", NUL-terminated
  uint32_t flags;
  uint32_t reserved;
  // kTierStorage
  uint64_t capacity_bytes;  ///< the tier's storage (slot sizes, not block sizes)
  uint64_t used_bytes;
  uint64_t blocks;  ///< blocks the tier holds
  uint64_t pinned;
  uint64_t evictions;
  uint64_t io_errors;
  uint64_t checksum_failures;  ///< blocks dropped because their bytes no longer matched
  uint64_t bytes_written;
  uint64_t bytes_read;
  // kTierPeers
  uint64_t peers_live;  ///< other members that are live or connected
  uint64_t peers_lost;  ///< other members unreachable or gone
  uint64_t blocks_out;  ///< pushed to peers, summed over them
  uint64_t bytes_out;
  uint64_t blocks_in;  ///< fetched from peers
  uint64_t bytes_in;
  uint64_t errors;  ///< blocks that failed on a peer's account
  char member[64];  ///< this daemon's member id, NUL-terminated (truncated)
  char reason[64];  ///< why the tier is degraded ("" while healthy; truncated)
};
static_assert(sizeof(TierStatsWire) == 272 && sizeof(TierStatsWire) % 8 == 0);

/// One stored block as ls lists it.
struct LsEntry {
  Key key;
  uint64_t bytes;
  uint32_t pins;
  uint32_t reserved;
  char ns[96];      ///< namespace, NUL-terminated (truncated)
  char format[32];  ///< stored entry format name
  char tier[8];     ///< "host"
};
static_assert(sizeof(LsEntry) == 168);

}  // namespace kvferry::ops
