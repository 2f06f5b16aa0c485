#pragma once
// Tier: the one seam behind which every lower tier (G3 disk, G4 remote) sits (DESIGN.md §4). A
// tier moves whole blocks between host-pool slots (pinned host memory the caller owns) and its own
// storage, in batches: submit() queues reads and writes, poll() hands back one completion per
// block with its own Status. A tier keeps its own index of what it holds (lookup, erase, list),
// evicts LRU and returns the victims, reports capacity, occupancy and health, and rebuilds its
// index at start with recover(). The host pool stays the staging point: no tier touches a region.
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/layouts/status.h"
#include "kvferry/store/block_key.h"

namespace kvferry::store {

/// What a tier stores about a block, durably: enough to rebuild its index after a restart.
struct BlockRecord {
  std::string ns;           ///< namespace name (model|format family|tenant), at most 255 bytes
  BlockKey key;             ///< the engine's 128-bit content key
  std::string format;       ///< EntryFormat name of the stored bytes, at most 63 bytes
  uint64_t bytes = 0;       ///< the block's size
  uint64_t checksum = 0;    ///< XXH3-64 of the bytes (block_checksum)
  uint64_t generation = 0;  ///< write order, assigned by the tier (ignored in a write request)
};

enum class TierOp : uint8_t { kRead, kWrite };

/// One block to move. The buffer is pinned host memory owned by the caller (a host-pool slot); it
/// must stay valid and untouched until the block's completion. For O_DIRECT tiers it is 4 KiB
/// aligned and `buf_bytes` is at least `record.bytes` rounded up to 4 KiB (host-pool slots are).
struct TierRequest {
  TierOp op = TierOp::kRead;
  /// kWrite: the whole record (generation ignored). kRead: `ns` and `key`; the rest comes back in
  /// the completion.
  BlockRecord record;
  uint8_t* buf = nullptr;
  uint64_t buf_bytes = 0;
  uint64_t cookie = 0;  ///< handed back in the completion
};

/// The outcome of one request. kOk; kNotFound (read of an absent key: a miss); kAlreadyExists
/// (write of a key another write is storing now: treat as done); kResourceExhausted (no room even
/// after evicting); kChecksumMismatch or kDataLoss (a read found damaged or missing bytes: the block
/// is dropped from the tier, never served); kIo (the device failed); kCancelled (shutdown).
struct TierCompletion {
  uint64_t cookie = 0;
  TierOp op = TierOp::kRead;
  Status status;
  /// The stored record (for a read: what `buf` now holds; for a write: with its generation).
  BlockRecord record;
};

/// Capacity and occupancy, in bytes of the tier's storage (slot sizes, not block sizes).
struct TierUsage {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t blocks = 0;
  uint64_t pinned = 0;
};

/// Health and the tier's counters (exposed as metrics by the daemon).
struct TierHealth {
  bool ok = true;
  std::string reason;  ///< why the tier is degraded ("" when ok)
  uint64_t io_errors = 0;
  uint64_t checksum_failures = 0;  ///< blocks dropped because their bytes no longer matched
  uint64_t short_io_retries = 0;
  uint64_t evictions = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
};

/// A lower tier. submit/poll/lookup/... are thread-safe; completions of one tier are handed out by
/// poll() in the order they finish.
class Tier {
 public:
  virtual ~Tier() = default;
  /// "disk", "remote", ... (metric label).
  virtual std::string_view name() const = 0;

  /// Rebuilds the tier's index from what its storage holds (at start, before the first submit).
  /// Damaged entries are dropped and logged. Returns how many blocks it found.
  virtual Result<uint64_t> recover() = 0;

  /// Offers the caller's big pinned buffers (the host pool's chunks) for registration with the
  /// I/O engine, so requests whose buffer lies inside one skip per-I/O page pinning. Call before
  /// submitting I/O into them; a tier may ignore it. Replaces an earlier registration.
  virtual Status register_buffers(std::span<const iovec> buffers) = 0;

  /// Queues a batch. Every request gets exactly one completion through poll(), errors included;
  /// the call itself fails only when the tier is shut down. A write becomes visible (lookup hit)
  /// only when its completion is handed out, once it is as durable as the tier's policy says.
  virtual Status submit(std::span<const TierRequest> batch) = 0;

  /// Moves up to `max` finished completions into `out` (appended), waiting up to `wait` for the
  /// first one. Returns how many were appended.
  virtual size_t poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) = 0;

  /// The record of a block the tier holds (visible writes only), refreshing its LRU position.
  virtual std::optional<BlockRecord> lookup(std::string_view ns, const BlockKey& key) = 0;
  /// Drops a block; kNotFound when absent, kBusy while it is read, written or pinned.
  virtual Status erase(std::string_view ns, const BlockKey& key) = 0;
  /// Up to `limit` records, most recently used first (of `ns` when given).
  virtual std::vector<BlockRecord> list(std::optional<std::string_view> ns, size_t limit) const = 0;
  /// Pins a held block so eviction never takes it (counted); kNotFound when absent.
  virtual Status pin(std::string_view ns, const BlockKey& key) = 0;
  virtual Status unpin(std::string_view ns, const BlockKey& key) = 0;

  /// Evicts least recently used unpinned, idle blocks until `bytes` of storage are free (or none is
  /// left to evict) and returns them, so the caller can drop them from its own index.
  virtual std::vector<BlockRecord> evict(uint64_t bytes) = 0;
  /// Blocks the tier evicted on its own (to make room for a write) since the last call.
  virtual std::vector<BlockRecord> take_victims() = 0;

  virtual TierUsage usage() const = 0;
  virtual TierHealth health() const = 0;
};

}  // namespace kvferry::store
