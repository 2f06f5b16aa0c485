#pragma once
// The daemon core (kvferry_daemon_core): the control socket, client sessions, the region
// registry and the ring service. `kvferryd`'s main only loads the config and wires signals;
// tests can run a Daemon in-process from a config built in code.
//
// Threads: run() drives a Boost.Asio event loop on the calling thread (accept, handshake, control
// messages, timers); the RingService thread serves the rings. stop() and reload() may be called
// from any thread. The loop never blocks on a client: replies wait in a bounded per-client queue
// and are written as the socket takes them (see daemon/README.md, "The control socket").
//
// Tenancy: a client's tenant, admin flag and quotas are settled at its Hello from SO_PEERCRED and
// the peer's supplementary groups (config: daemon.admin_*, tenants, limits.tenant), and written
// into its ClientChannel for the data path.
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "kvferry/config/config.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/layouts/status.h"

namespace kvferry::daemon {

/// The version string the daemon reports (KVFERRY_VERSION: project(VERSION), e.g. "0.1.0").
const char* version();

/// Sets the spdlog level from the config; the KVFERRY_LOG environment variable (trace, debug,
/// info, warn, error, off) wins over it.
void apply_log_level(config::LogLevel level);

class Daemon {
 public:
  /// Validates `cfg`, picks the region backend (device.backend; auto = CUDA when
  /// cuda_device_count() > 0), creates the configured regions and binds the socket.
  static Result<std::unique_ptr<Daemon>> create(const config::Config& cfg);
  /// Switches meant for tests, never for production.
  struct Options {
    bool test_faults = false;  ///< serve the fault knob op (proto::Op::kCorruptForTest)
    /// Tests only: sleep this long before each copy sub-batch of a save or load (makes
    /// limits.request_timeout reachable on demand).
    std::chrono::milliseconds test_copy_delay{0};
    /// Tests only: wrap the disk tier in a FaultTier with this spec (store::parse_fault_spec,
    /// e.g. "errno=EIO,rate=1,writes_only"); "" = none.
    std::string test_disk_faults;
    /// Data-path tuning (benchmarks): save/load workers (0 = 2), persistent hashing threads
    /// (-1 = default) and copy/hash sub-batch bytes (-1 = default, 0 = whole batches).
    int data_workers = 0;
    int hash_threads = -1;
    int64_t pipeline_bytes = -1;
  };
  static Result<std::unique_ptr<Daemon>> create(const config::Config& cfg, const Options& opts);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  /// Serves until stop(): notifies READY=1 once accepting, WATCHDOG=1 at half the watchdog
  /// interval, STOPPING=1 when asked to stop; drains the rings and returns.
  Status run();
  /// Asks run() to drain and return (thread- and signal-handler-safe via the event loop).
  void stop();
  /// Applies the reloadable keys of `cfg` (log level, allowed uids/gids, admin uids/gids,
  /// debug_read, tenants, socket mode, limits.max_clients, request_timeout, the tenant quotas and
  /// the connection limits, the host pool's watermarks, verify_on_load), logs the changed keys
  /// that need a restart, and closes the sessions the new allow-list or tenant mapping no longer
  /// admits. Thread-safe.
  void reload(const config::Config& cfg);
  /// Handles SIGTERM/SIGINT (stop) and SIGHUP (calls `on_hup`, which returns the new config or
  /// an error to log) inside the event loop. Call before run().
  void handle_signals(std::function<Result<config::Config>()> on_hup);

  /// A snapshot of version, uptime, every region and every client (as `kvferry status` shows it
  /// to an admin; a client that is not one sees only its own tenant's and the shared ones).
  proto::StatusReply status() const;
  const std::string& socket_path() const;
  /// The metrics in the Prometheus text format (what /metrics serves).
  std::string metrics_text() const;
  /// The bound port of /metrics and /healthz (0 when off).
  uint16_t metrics_port() const;

 private:
  struct Impl;
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::daemon
