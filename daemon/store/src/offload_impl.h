#pragma once
// OffloadService::Impl, which saves and loads (offload.cpp) and mapped loads (offload_mapped.cpp)
// share: options, counters, the hashing pool and the movers, and the helpers both pipelines use.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/offload.h"
#include "mover.h"
#include "task_pool.h"

namespace kvferry::store {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Contiguous ranges [begin, end) of a batch's items of about `target` bytes each (>= 1 item).
std::vector<std::pair<size_t, size_t>> split(size_t n, uint64_t item_bytes, int64_t target);

/// Appends the runs that move one block of `spec` (all layers) to/from a contiguous slot at
/// `slot_offset` (slot side block-major). `to_slot` picks the direction. The block's runs merge
/// among themselves, never with an earlier block's, so a mover can move one block alone (one that
/// moves a sub-batch at once merges across its blocks).
void push_block_runs(std::vector<CopyRun>* runs, const KvCacheSpec& spec, int64_t block, int64_t slot_offset,
                     bool to_slot);

/// Every block of a request whose key and block-id lists differ in length gets the same error.
std::vector<Status> mismatched_lists(const char* op, size_t keys, size_t ids);

struct OffloadService::Impl {
  /// Per-op phase totals (microseconds), for the timing breakdown of the bench and /metrics.
  struct Phases {
    Counter *prepare, *enqueue, *dma_wait, *hash, *total;
    Phases(Registry& m, const char* op) {
      auto c = [&](const char* phase) {
        return &m.counter("kvferry_transfer_phase_microseconds_total",
                          "Time data workers spent per phase of saves and loads (dma_wait: blocked on the copy "
                          "engine; hash: checksums on the worker's critical path)",
                          std::string("op=\"") + op + "\",phase=\"" + phase + "\"");
      };
      prepare = c("prepare");
      enqueue = c("enqueue");
      dma_wait = c("dma_wait");
      hash = c("hash");
      total = c("total");
    }
  };

  Impl(BlockIndex& idx, Registry& m, Options o)
      : index(idx),
        opts(o),
        verify_on_load(o.verify_on_load),
        saved_blocks(m.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"host\"")),
        saved_bytes(m.counter("kvferry_bytes_saved_total", "Bytes saved", "tier=\"host\"")),
        loaded_blocks(m.counter("kvferry_blocks_loaded_total", "Blocks loaded", "tier=\"host\"")),
        loaded_bytes(m.counter("kvferry_bytes_loaded_total", "Bytes loaded", "tier=\"host\"")),
        load_misses(m.counter("kvferry_load_misses_total", "Loads of blocks that were not stored")),
        converted(m.counter("kvferry_blocks_converted_total", "Blocks converted to another format on load")),
        remapped(m.counter("kvferry_blocks_remapped_total",
                           "Region blocks loaded from stored blocks of another geometry (page size, head slice or "
                           "head layout)")),
        checksum_failures(m.counter("kvferry_checksum_failures_total", "Stored blocks whose checksum did not match")),
        save_failures(m.counter("kvferry_save_failures_total", "Blocks that could not be saved")),
        timeouts(m.counter("kvferry_transfer_timeouts_total", "Blocks failed because limits.request_timeout passed")),
        save_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"save\"")),
        load_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"load\"")),
        save_phase(m, "save"),
        load_phase(m, "load") {
    if (opts.cpu_threads <= 0)
      opts.cpu_threads = static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency())));
    if (opts.hash_threads < 0) opts.hash_threads = opts.cpu_threads - 1;
    hashers = std::make_unique<TaskPool>(opts.hash_threads);
  }

  BlockIndex& index;
  Options opts;
  std::atomic<bool> verify_on_load;
  std::unique_ptr<TaskPool> hashers;
  Counter &saved_blocks, &saved_bytes, &loaded_blocks, &loaded_bytes, &load_misses, &converted, &remapped,
      &checksum_failures, &save_failures, &timeouts;
  Histogram &save_seconds, &load_seconds;
  Phases save_phase, load_phase;

  void test_delay() const {
    if (opts.test_delay.count() > 0) std::this_thread::sleep_for(opts.test_delay);
  }
  /// Bytes per sub-batch for blocks of `bb`: pipeline_bytes, but at least one block per hashing
  /// thread (hashing is per block; fewer blocks would leave threads idle while the DMA waits).
  int64_t sub_batch_bytes(uint64_t bb) const {
    if (opts.pipeline_bytes <= 0) return 0;
    return std::max<int64_t>(opts.pipeline_bytes, static_cast<int64_t>(bb) * (opts.hash_threads + 1));
  }

  static Status timed_out(const char* op) {
    return op[0] == 's' ? Status(ErrorCode::kTimeout,
                                 "limits.request_timeout passed before this block's save finished; it was not stored")
                        : Status(ErrorCode::kTimeout,
                                 "limits.request_timeout passed before this block's load started; its target block "
                                 "was not written");
  }

  std::unique_ptr<Mover> host;    // host regions
  std::unique_ptr<Mover> device;  // device regions; null when CUDA is not built
  Status no_device;               // why device is null

  /// An op of the mover for `region`'s memory.
  Result<std::unique_ptr<MoveOp>> begin(const RegionAccess& region, bool to_pool) {
    if (!region.device) return host->begin(region, to_pool);
    if (!device) return Status(no_device.code(), "device region but " + no_device.message());
    return device->begin(region, to_pool);
  }
};

}  // namespace kvferry::store
