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
/// be converted or mapped into each other: "mla" for mla_bf16 / mla_fp8 / mla_fp8_ds / mla_fp4;
/// for MHA "mha:DTYPE:TOTALxD" (order and head slice dropped, so tensor-parallel ranks and NHD /
/// HND caches of one model share blocks, e.g. "mha:bf16:8x128"); other formats are their own
/// family ("indexer_fp8").
std::string format_family(const EntryFormat& f);

/// Whether a block stored as `from` can be loaded into a region of `to` (same layers and block
/// size; same format, or a supported conversion).
Status check_loadable(const BlockShape& from, const BlockShape& to);

/// Whether a block stored as `from` can go into blocks of `to` through a mapped load: the same
/// layers; page sizes that divide each other; the same entries apart from the MHA head slice and
/// order (which must share a head), or an MLA format conversion. The error names both geometries.
Status check_mappable(const BlockShape& from, const BlockShape& to);

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

  /// A load across geometries: entry i puts part parts[i] of the stored block keys[i] into region
  /// block block_ids[i] (layouts/geometry.h token_span: with stored pages larger than the region's,
  /// part p is the stored tokens [p R, (p+1) R); with smaller ones, the stored block fills region
  /// tokens [p S, (p+1) S)), the heads both hold (MHA tensor-parallel slices), NHD <-> HND, and
  /// the MLA format conversions of load(). Several entries may fill one region block (smaller
  /// pages, or head slices that ranks saved) and one key may feed several. A region block is
  /// written only when all its entries can be: together they must cover each of its tokens and
  /// heads exactly once, else every entry of it fails (kInvalidArgument naming the gap or the
  /// overlap); a missing, damaged or unmappable stored block fails every entry of the region
  /// blocks it feeds, naming the entry and both geometries, and leaves them untouched.
  /// Per-entry statuses. `verified` as in load(), one flag per entry.
  std::vector<Status> load_mapped(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                  std::span<const int64_t> block_ids, std::span<const int32_t> parts,
                                  Clock::time_point deadline = kNoDeadline, std::span<const uint8_t> verified = {});

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
