#pragma once
// The data ops of kvferryd (lookup, save, load, pin, unpin, evict, stats, ls and the test fault
// knob): the host pool, the block index, the offload service and the metrics, wired into the
// ring service's op table. Arena layouts: kvferry/connector/ops.h.
//
// Threads: lookups, pins, evictions, stats and ls run on the ring thread (they take the index's
// metadata lock only, never wait behind a copy); saves and loads go to a small worker pool and
// complete through RingService::post, so one client's transfer never stalls another's lookups.
// A save or load gets limits.request_timeout from the moment its request left the ring: the
// blocks not done by then fail with kTimeout (never half-visible).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "kvferry/config/config.h"
#include "kvferry/daemon/region.h"
#include "kvferry/daemon/ring_service.h"
#include "kvferry/layouts/status.h"

namespace kvferry::daemon {

class DataOps {
 public:
  struct Options {
    bool cuda = false;                             ///< regions may be device memory; pin the pool
    bool test_faults = false;                      ///< serve kCorruptForTest
    int workers = 2;                               ///< save/load threads (each with its own CUDA stream)
    int hash_threads = -1;                         ///< persistent hashing threads (-1 = the service's default)
    int64_t pipeline_bytes = -1;                   ///< copy/hash sub-batch bytes (-1 = the service's default)
    std::chrono::milliseconds test_copy_delay{0};  ///< tests only: a sleep before each sub-batch
    /// Tests only: a FaultTier spec (store::parse_fault_spec) wrapped around the disk tier.
    std::string test_disk_faults;
    /// Resolves a region id (nullptr when there is none).
    /// Resolves a region id for a client: nullptr when there is none or the client may not
    /// reach it (another tenant's).
    std::function<std::shared_ptr<Region>(const ClientChannel&, uint32_t)> find_region;
    /// The region `id` as a client of `tenant` would reach it (a peer's send landing in it): its
    /// owner's, or a shared one; nullptr otherwise.
    std::function<std::shared_ptr<Region>(const std::string& tenant, uint32_t)> find_region_for_tenant;
    /// Connected clients (for the metrics).
    std::function<uint64_t()> clients;
    /// Region-to-region sends from peers on this host (store::RemoteStoreOptions::grant_import and
    /// on_local_landed): the daemon's session registry grants imports of its regions on `socket`
    /// and checks the blocks a peer says it copied. Any empty: peers are not offered imports.
    std::function<Result<std::string>(const std::string& tenant, uint32_t region)> grant_import;
    std::function<std::vector<Status>(const std::string& token, const std::string& tenant, uint32_t region,
                                      std::span<const int64_t> ids)>
        check_landed;
    std::string socket;
  };

  /// Creates the host pool (populated and pinned now, progress logged), the index, the offload
  /// service and, with tiers.disk.path set, the disk tier (recovered before this returns, its
  /// block count and time logged) from `cfg` (tiers.host, tiers.disk, integrity) and, with
  /// tiers.remote.listen set, the remote tier (joined to its cluster before this returns).
  static Result<std::unique_ptr<DataOps>> create(const config::Config& cfg, Options opts);
  ~DataOps();

  /// Installs the op handlers. Call before rings.start().
  void install(RingService& rings);
  /// A client went away: drop its pins (its saves in flight complete or abort on their own).
  void client_gone(uint32_t client_id);
  /// Applies the reloadable keys it uses (tiers.host watermarks, integrity.verify_on_load,
  /// limits.request_timeout) to the running index and service.
  Status reload(const config::Config& cfg);
  /// Finishes the saves and loads already queued, then stops the workers. Idempotent.
  void stop();

  /// Prometheus text of every metric.
  std::string render_metrics() const;
  /// /healthz: true and a one-line summary while the workers run.
  bool healthy(std::string* body) const;

 private:
  struct Impl;
  explicit DataOps(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::daemon
