#pragma once
// OffloadService: the daemon's save / load / lookup of blocks between a region (G1) and the host
// pool (G2). Saves copy each block (all layers) into a pool slot, checksum it (XXH3-64) and make it
// visible; loads verify the checksum and copy it back into any block of any compatible region,
// converting the MLA format on the way when the stored one differs (576 -> 656, bf16 -> 656,
// 656 -> bf16, 656 -> 576 where lossless). Every block gets its own Status, so an engine recomputes
// exactly the blocks that failed. Thread-safe.
//
// Pipelining: a batch is split into sub-batches of about `pipeline_bytes`. A save enqueues the
// DMA of every sub-batch (a few ahead) on the caller's own stream and hashes sub-batch k (on a
// persistent pool of hashing threads) while k+1.. are still copying; a load verifies sub-batch
// k+1 while k is copying, so a damaged block still never reaches the region. Each concurrent
// caller (data worker) gets its own stream, so one worker's DMA overlaps another's hashing.
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/metrics.h"

namespace kvferry::store {

/// How the daemon reaches a region's bytes.
struct RegionAccess {
  uint8_t* base = nullptr;  ///< host pointer (CPU backend) or device pointer (CUDA backend)
  KvCacheSpec spec;
  bool device = false;  ///< base is CUDA device memory
};

/// The namespace family of a format: blocks of formats of one family hold the same values and can
/// be converted into each other ("mla" for mla_bf16 / mla_fp8 / mla_fp8_ds); other formats are
/// their own family ("mha:bf16:8x128:nhd", "indexer_fp8").
std::string format_family(const EntryFormat& f);

/// Whether a block stored as `from` can be loaded into a region of `to` (same layers and block
/// size; same format, or a supported conversion).
Status check_loadable(const BlockShape& from, const BlockShape& to);

class OffloadService {
 public:
  struct Options {
    bool checksum = true;        ///< compute checksums on save
    bool verify_on_load = true;  ///< verify them on load
    int cpu_threads = 0;         ///< threads for hashing and host conversion (0 = hardware, max 16)
    bool use_cuda = false;       ///< regions may be device memory (creates a stream and a copier)
    /// Sub-batch size of the copy/hash pipeline (at least one block per hashing thread; 0 = the
    /// whole batch). 128 MiB: on the H200 host, 2 GiB of 4 MiB blocks saved/loaded at 0.98/0.95
    /// of the bare copy with it, 0.91/0.84 (4 GiB) with 32 MiB; 1 MiB blocks >= 1.0 with either.
    int64_t pipeline_bytes = int64_t{128} << 20;
    /// Persistent hashing threads besides the caller (-1 = cpu_threads - 1).
    int hash_threads = -1;
    /// Tests only: sleep this long before each sub-batch (makes deadlines reachable).
    std::chrono::milliseconds test_delay{0};
  };
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

  /// `index` and `metrics` outlive the service.
  static Result<std::unique_ptr<OffloadService>> create(BlockIndex& index, Registry& metrics, Options opts);
  ~OffloadService();

  /// Saves block_ids[i] of `region` under keys[i]. Per block: ok (also when it was stored already),
  /// kResourceExhausted (pool full of pinned/in-use blocks), kOutOfRange (bad block id), ...
  /// Past `deadline`, the blocks not yet committed fail with kTimeout and stay invisible (copies
  /// already in flight are waited for first, so no slot is reused under a running DMA).
  std::vector<Status> save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                           std::span<const int64_t> block_ids, Clock::time_point deadline = kNoDeadline);
  /// Loads keys[i] into block_ids[i] of `region`. Per block: ok, kNotFound (a miss),
  /// kChecksumMismatch (the stored copy is damaged: it is dropped, never returned),
  /// kUnsupported (no conversion between the stored and the region's format), ...
  /// Past `deadline`, the blocks whose copy has not started fail with kTimeout and their target
  /// blocks are left untouched.
  /// `verified` (empty, or one flag per key): 1 = the caller holds this block and its bytes were
  /// checked against the stored checksum after they last landed in the slot (a promotion the
  /// lower tier verified), so they are not hashed again; every other block is verified as usual.
  std::vector<Status> load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                           std::span<const int64_t> block_ids, Clock::time_point deadline = kNoDeadline,
                           std::span<const uint8_t> verified = {});

  /// integrity.verify_on_load may change at run time (SIGHUP).
  void set_verify_on_load(bool on);

  BlockIndex& index() { return index_; }

 private:
  struct Impl;
  OffloadService(BlockIndex& index, std::unique_ptr<Impl> impl);
  BlockIndex& index_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::store
