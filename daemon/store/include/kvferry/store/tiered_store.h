#pragma once
// TieredStore: the host pool (G2, BlockIndex + OffloadService) over one lower tier (a Tier: the
// disk, G3), as the daemon's data ops see it (DESIGN.md §4).
//
// The BlockIndex stays the index of the host pool; the lower tier keeps its own index of records
// (namespace *name*, key, format, bytes, XXH3), which survives a restart. A block lives on the host,
// on the lower tier, or on both (the index entry's on_lower flag). So:
// - save: copies into host slots as before. Write-back (default): before a step of a save needs
//   room, the least recently used host blocks without a lower copy are written down (demoted) and
//   only then may their slots be reused; a save larger than the whole pool streams through it.
//   Write-through: every saved block is also written down before the save completes.
// - load: host misses that the lower tier holds are read into host slots (promoted, checksum
//   verified by the tier), held, and then loaded like any host block (format conversion included).
// - pipelining: a save or load moves in steps (Options::step_bytes). The lower tier's I/O of one
//   step overlaps the host work of the next: a write-through step's writes run while the next step
//   copies and hashes, a write-back step's room for the next step is written down while it copies,
//   and a load reads the next step's blocks while the previous one is copied into the region. A
//   call returns only once all of its I/O has completed, so what a completed save promises (its
//   blocks on the lower tier under write-through) is as before.
// - lookup, ls, evict see both tiers; a namespace is resolved by name, so a block written by a
//   client long gone is found by any later client of the same namespace.
// Errors of the lower tier fail its blocks only: a failed demotion lets the host drop the block
// (counted), a failed promotion is that block's error (a miss for kNotFound); the host keeps
// serving. Thread-safe: the data workers call save/load concurrently; lookup/ls/evict run on the
// ring thread and never wait for I/O.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/store/block_index.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/offload.h"
#include "kvferry/store/tier.h"

namespace kvferry::store {

/// How far one save or load call goes before it gives its worker back: past `bytes` of blocks,
/// at the first step boundary where `yield()` returns true, the call waits for its I/O and
/// returns the statuses of the blocks it did (a prefix); the caller calls again with the rest.
/// Default: the whole request.
struct TransferTurn {
  uint64_t bytes = 0;           ///< 0 = never yield
  std::function<bool()> yield;  ///< asked at step boundaries once `bytes` are done
};

class TieredStore {
 public:
  struct Options {
    bool write_through = false;  ///< saves also write to the lower tier before they complete
    bool checksums = true;       ///< the service hashes saves (else demotion hashes for the tier)
    /// Largest step of a save or load through the pool, in bytes (0 = an eighth of the pool, at
    /// most 32 MiB). A worker holds the step it copies and two or more whose I/O is in flight
    /// (up to 32 blocks, within half of the pool), so two workers' pipelines fit side by side.
    uint64_t step_bytes = 0;
    /// The lower tier checks every read's bytes against the record's XXH3 as they land before it
    /// reports kOk (DiskTier does; a test wrapper that corrupts reads does not): a promoted block
    /// is then not hashed again on its way to the region. Blocks that were already on the host are
    /// always verified (integrity.verify_on_load).
    bool trust_lower_reads = false;
  };
  using Turn = TransferTurn;
  using Clock = std::chrono::steady_clock;

  /// `index`, `svc` and `metrics` outlive the store. `lower` may be null (host only: every call
  /// goes straight to the index and the service).
  TieredStore(BlockIndex& index, OffloadService& svc, Registry& metrics, std::unique_ptr<Tier> lower, Options opts);
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  /// The lower tier (nullptr when none).
  Tier* lower() const { return lower_.get(); }

  /// OffloadService::save through the tiers (see above). Per-block statuses, one per key unless
  /// `turn` made the call stop early (then a prefix).
  std::vector<Status> save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                           std::span<const int64_t> block_ids, Clock::time_point deadline, const Turn& turn = {});
  /// OffloadService::load through the tiers. A block whose lower copy failed its checksum is
  /// reported as kChecksumMismatch and dropped; one found nowhere is kNotFound. A prefix when
  /// `turn` made the call stop early.
  std::vector<Status> load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                           std::span<const int64_t> block_ids, Clock::time_point deadline, const Turn& turn = {});

  /// OffloadService::load_mapped through the tiers: stored blocks found only on the lower tier
  /// are promoted first (in steps of region blocks whose stored blocks fit a step), then mapped.
  /// One status per entry.
  std::vector<Status> load_mapped(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                  std::span<const int64_t> block_ids, std::span<const int32_t> parts,
                                  Clock::time_point deadline);

  /// Presence on either tier and the longest prefix of hits.
  LookupResult lookup(NamespaceId ns, std::span<const BlockKey> keys);
  /// Drops a block from every tier. kOk when some tier dropped it, kBusy when it is in use
  /// (pinned, read or written), kNotFound when no tier holds it.
  Status evict(NamespaceId ns, const BlockKey& key);
  /// Drops every idle block of the namespaces `filter(name, tenant)` accepts. Returns how many
  /// (a block on both tiers counts once per tier it left).
  uint64_t evict_all(const std::function<bool(const std::string& name, const std::string& tenant)>& filter);
  /// Up to `limit` blocks of the accepted namespaces: host ones first (tier "host" or
  /// "host+disk"), then the lower tier's own ("disk").
  std::vector<ListEntry> list(const std::function<bool(const std::string& name, const std::string& tenant)>& filter,
                              size_t limit) const;

  /// The tenant part of a namespace name (model|family|tenant).
  static std::string tenant_of(const std::string& ns_name);
  /// The lower tier's record format for blocks of `shape` ("mla_fp8@61x64"), and back.
  static std::string record_format(const BlockShape& shape);
  static std::optional<BlockShape> shape_of(std::string_view record_format);

 private:
  struct Impl;
  std::unique_ptr<Tier> lower_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::store
