#pragma once
// Daemon::Impl, which the daemon core's files share: the event loop and its timers, the control
// socket, the sessions and the region registry (one mutex for both), the ring service and the data path.
#include <utility>  // before Asio (Boost 1.74 with C++20)

#include <boost/asio.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "data_ops.h"
#include "kvferry/daemon/daemon.h"
#include "kvferry/daemon/region.h"
#include "kvferry/daemon/ring_service.h"
#include "kvferry/store/http_server.h"
#include "tenancy.h"

namespace kvferry::daemon {

namespace asio = boost::asio;
using local_stream = asio::local::stream_protocol;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kArenaBytes = 1u << 20;
constexpr auto kSpin = std::chrono::microseconds(50);
/// A payload is read in pieces of at most this, so the buffer grows with what actually arrived.
constexpr size_t kReadChunk = 64 * 1024;

/// Runs `f`, turning any exception into a log line: nothing thrown may cross an Asio handler.
template <class F>
void guarded(const char* where, F&& f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    try {
      spdlog::error("{}: {}", where, e.what());
    } catch (...) {
    }
  } catch (...) {
    try {
      spdlog::error("{}: unknown exception", where);
    } catch (...) {
    }
  }
}

/// At most one log line a second for a repeating event; counts the lines it held back.
struct Throttle {
  Clock::time_point last{};
  uint64_t held = 0;
  /// True when a line may be written now; `*held_back` = lines held back since the last one.
  bool allow(uint64_t* held_back) {
    const auto now = Clock::now();
    if (last != Clock::time_point{} && now - last < std::chrono::seconds(1)) {
      ++held;
      return false;
    }
    last = now;
    *held_back = std::exchange(held, 0);
    return true;
  }
};

struct Daemon::Impl {
  struct Session;
  struct RegionEntry {
    std::shared_ptr<Region> region;
    bool from_config = false;
    uint32_t holders = 0;
    std::string owner;  ///< "" = shared by every tenant (config regions without a tenant)
  };
  /// Whose view a status reply is: nullptr = everything (in-process callers).
  struct Viewer {
    bool admin = false;
    std::string owner;  ///< "" = sees shared regions only and no clients
  };

  config::Config cfg;
  RegionBackend backend = RegionBackend::kCpu;
  asio::io_context io{1};
  local_stream::acceptor acceptor{io};
  asio::signal_set signals{io};
  asio::steady_timer watchdog{io};
  asio::steady_timer sweep{io};         // handshake and send deadlines
  asio::steady_timer accept_pause{io};  // back-off of the accept loop after EMFILE and the like
  std::chrono::microseconds watchdog_half{0};
  RingService rings{kSpin};
  std::unique_ptr<DataOps> data;            // after rings: its workers post to them
  std::unique_ptr<store::HttpServer> http;  // after io: it serves on it
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::function<Result<config::Config>()> on_hup;
  bool stopping = false;
  bool bound = false;
  bool sweep_armed = false;
  bool accept_pause_armed = false;
  UniqueFd reserve_fd;  // given up at EMFILE so one pending connection can be accepted and shed
  Throttle accept_log, refuse_log;
  uint64_t shed = 0;  // connections accepted only to be closed at fd exhaustion
  /// Where payload bytes land before they are appended to their session's frame (event loop only).
  std::vector<uint8_t> scratch = std::vector<uint8_t>(kReadChunk);

  mutable std::mutex mu;  // guards regions, sessions and each session's hello/identity (status() reads them)
  std::map<uint32_t, RegionEntry> regions;
  std::map<uint32_t, std::shared_ptr<Session>> sessions;
  uint32_t next_region = 1;
  uint32_t next_client = 1;

  // The control socket, the sweep, the watchdog, stop and reload (daemon.cpp).
  Status bind_socket();
  void accept();
  void on_accept(local_stream::socket s);
  void pause_accepting(const boost::system::error_code& ec);
  void arm_sweep();
  void sweep_once();
  void do_stop();
  void arm_watchdog();
  void do_reload(const config::Config& next);
  void recheck_sessions();
  proto::StatusReply snapshot(const Viewer* v) const;

  // Credentials and tenancy (tenancy.cpp).
  bool allowed(const Creds& c) const;
  bool is_admin(const Creds& c) const;
  Result<Identity> identify(const Creds& c, const std::string& claimed) const;
  config::TenantQuota quota_for(const Identity& id) const;
  Viewer viewer_for(const Creds& c) const;

  // The session table (session.cpp).
  void release(Session& s);
  std::vector<std::shared_ptr<Session>> all_sessions() const;

  // The region registry (region_registry.cpp).
  Result<std::shared_ptr<Region>> add_region(const std::string& name, const KvCacheSpec& spec, bool from_config,
                                             const std::string& owner);
  /// The region a data op of `c` names: reached only as map_region would, its owner's, a shared
  /// one, or any for an admin. Another tenant's region is as absent as one that does not exist.
  std::shared_ptr<Region> find_region(const ClientChannel& c, uint32_t id) const;
  /// The region a peer's send names: reached only as a client of the blocks' tenant would.
  std::shared_ptr<Region> find_region_for_tenant(const std::string& tenant, uint32_t id) const;

  // Imports of this daemon's regions by peer daemons on its host, for region-to-region sends
  // (tiers.remote.local_transfer; peer_import.cpp). A grant is asked for over the remote tier's
  // authenticated channel and used once, by the Hello of the importing session, which may then map
  // that region only; it lives until that session closes (an unused one lapses after a while).
  struct PeerGrant {
    std::string tenant;
    uint32_t region = 0;
    std::weak_ptr<Region> what;  // the region as it was granted (a replaced one is another)
    Clock::time_point lapses;    // an unused grant is dropped then
    uint32_t session = 0;        // the import session that used it (0: not yet)
  };
  std::map<std::string, PeerGrant> grants;  // by token; guarded by mu
  /// A token for a peer's import of region `region` as a client of `tenant` reaches it.
  Result<std::string> grant_import(const std::string& tenant, uint32_t region);
  /// The Hello of session `session` carries `token`: the identity it acts as and the one region it
  /// may map, or why not (unknown, used, lapsed).
  Result<Identity> take_grant(const std::string& token, uint32_t session, uint32_t* region);
  /// A peer says it copied blocks `ids` into region `region` through the import `token` granted:
  /// one status per id (the import still names that region, each id is in it).
  std::vector<Status> check_landed(const std::string& token, const std::string& tenant, uint32_t region,
                                   std::span<const int64_t> ids) const;
  /// Drops the grants of a closed session and the unused ones that lapsed (mu held).
  void drop_grants_locked(uint32_t session);
};

}  // namespace kvferry::daemon
