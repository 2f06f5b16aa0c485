#pragma once
// The data path: one thread that serves every client's submission ring, dispatches each request
// through one op table and posts completions. It spins for a bounded time after the last
// request, then flags every ring "sleeping" and waits on the rings' eventfds (epoll).
// Backpressure: when a client's completion ring is full, that client's submission ring is left
// alone until the client consumes completions; nothing is dropped.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/config/config.h"
#include "kvferry/connector/ring.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry::daemon {

/// One client's data channel: the ring memfd (mapped) and its two eventfds. Owned by the
/// client's session and, while registered, shared with the ring thread.
struct ClientChannel {
  uint32_t client_id = 0;
  std::string model;  ///< from the Hello (namespace), "" = default
  /// The effective tenant, set by the daemon at the Hello from the peer's credentials (never
  /// what the client merely claims): blocks, regions and namespaces of other tenants are out of reach.
  std::string tenant;
  /// Who owns what the client creates and whose quotas it spends: the tenant name with
  /// `tenants:` configured, else `uid:N` (so claimed sub-tenants of one uid share its quotas).
  std::string owner;
  uint32_t uid = 0;           ///< SO_PEERCRED uid
  bool admin = false;         ///< daemon.admin_uids/admin_gids: may list and evict every tenant's blocks
  config::TenantQuota quota;  ///< the tenant's quotas, defaults resolved (0 = no limit)
  /// State the data ops keep per client (its namespace leases); released with the channel, after
  /// the last worker that used it is done.
  std::shared_ptr<void> data_state;
  UniqueFd ring_fd, sq_efd, cq_efd;
  void* base = nullptr;
  uint64_t bytes = 0;
  ring::Geometry geometry;
  ring::Channel ch;
  std::atomic<uint64_t> ops{0};
  /// Requests handed to a worker whose completion is not posted yet (they hold a completion slot).
  std::atomic<uint32_t> deferred{0};
  ~ClientChannel();
  /// Creates the memfd (sealed size), maps and initializes it, and the eventfds.
  static Result<std::shared_ptr<ClientChannel>> create(uint32_t client_id, uint32_t entries, uint32_t arena_bytes);
};

/// Handles one request: fills `out` (id/op are preset, status defaults to kOk). Runs on the ring
/// thread; must not block.
using OpHandler = void (*)(ClientChannel& client, const ring::SubmitEntry& req, ring::CompletionEntry& out);

/// A handler that may finish later: returns true when `out` is complete now, false when it took the
/// request to a worker, which then calls RingService::post() exactly once with the completion.
/// Runs on the ring thread; must not block.
using DeferrableHandler = std::function<bool(const std::shared_ptr<ClientChannel>& client, const ring::SubmitEntry& req,
                                             ring::CompletionEntry& out)>;

class RingService {
 public:
  explicit RingService(std::chrono::microseconds spin);
  ~RingService();
  RingService(const RingService&) = delete;
  RingService& operator=(const RingService&) = delete;

  /// Installs `h` for op code `op` (< proto::kOpTableSize). Call before start().
  void set_handler(uint16_t op, OpHandler h);
  /// Installs a handler that may complete later through post(). Call before start().
  void set_handler(uint16_t op, DeferrableHandler h);
  /// Posts the completion of a deferred request (any thread). The ring thread pushes it to the
  /// client's completion ring (a slot was held for it) and rings the doorbell; a completion for
  /// a client that went away is dropped.
  void post(const std::shared_ptr<ClientChannel>& c, const ring::CompletionEntry& e);
  Status start();
  /// Serves what is already queued, then stops the thread. Idempotent.
  void stop();
  void add(std::shared_ptr<ClientChannel> c);
  /// Stops serving `c`. The ring thread may finish a pass that still uses it; the reference it
  /// holds keeps the mapping and the eventfds alive until then, so the caller may drop its own.
  void remove(const std::shared_ptr<ClientChannel>& c);
  void set_spin(std::chrono::microseconds spin) { spin_ns_.store(spin.count() * 1000); }

 private:
  void loop();
  size_t serve(const std::shared_ptr<ClientChannel>& c, bool* blocked);
  size_t drain_posted();

  std::array<OpHandler, 64> table_{};
  std::array<DeferrableHandler, 64> deferrable_{};
  std::mutex post_mu_;
  std::vector<std::pair<std::weak_ptr<ClientChannel>, ring::CompletionEntry>> posted_;  // guarded by post_mu_
  std::atomic<uint64_t> posted_count_{0};
  std::atomic<int64_t> spin_ns_;
  UniqueFd epfd_, wake_efd_;
  std::mutex mu_;
  std::vector<std::shared_ptr<ClientChannel>> clients_;  // guarded by mu_
  std::atomic<uint64_t> generation_{0};                  // bumped under mu_; read lock-free by the ring thread
  std::atomic<bool> stop_{false};
  std::vector<ClientChannel*> flagged_;  // ring thread only
  std::thread thread_;
};

}  // namespace kvferry::daemon
