// The daemon's life (daemon.h): create, run, stop, reload and signals; the accept loop, the sweep
// of handshake and send deadlines, the watchdog and the status snapshot. Daemon::Impl: daemon_impl.h.
#include "daemon_impl.h"
#include "session.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "kvferry/connector/wire_io.h"
#include "kvferry/daemon/notify.h"
#include "kvferry/kernels/device.h"
#include "kvferry/version.h"

namespace kvferry::daemon {

const char* version() { return KVFERRY_VERSION; }

void apply_log_level(config::LogLevel level) {
  static const spdlog::level::level_enum map[] = {spdlog::level::trace, spdlog::level::debug, spdlog::level::info,
                                                  spdlog::level::warn,  spdlog::level::err,   spdlog::level::off};
  auto lv = map[static_cast<int>(level) <= 5 ? static_cast<int>(level) : 2];
  if (const char* env = std::getenv("KVFERRY_LOG"); env && *env) {
    auto e = spdlog::level::from_str(env);
    if (e != spdlog::level::off || std::string_view(env) == "off") lv = e;
  }
  spdlog::set_level(lv);
}

namespace {

/// Pause of the accept loop after an error such as EMFILE.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
/// Period of the sweep over handshake and send deadlines (while any is pending).
constexpr auto kSweepPeriod = std::chrono::milliseconds(100);

void op_ping(ClientChannel&, const ring::SubmitEntry& req, ring::CompletionEntry& out) { out.result[0] = req.args[0]; }

/// Sends a small frame once without waiting (a just-accepted socket's buffer is empty): for
/// refusals made before a session exists.
void send_best_effort(int fd, const Status& st) {
  const proto::Frame f = proto::encode(proto::ErrorMsg{st.code(), st.message()});
  (void)::send(fd, f.data(), f.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace

proto::StatusReply Daemon::Impl::snapshot(const Viewer* v) const {
  proto::StatusReply s;
  s.version = version();
  s.uptime_ms = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count());
  s.pid = static_cast<uint32_t>(::getpid());
  s.backend = backend == RegionBackend::kCuda ? "cuda" : "cpu";
  const bool all = !v || v->admin;
  std::lock_guard<std::mutex> g(mu);
  for (auto& [_, e] : regions)
    if (all || e.owner.empty() || e.owner == v->owner)
      s.regions.push_back({e.region->desc(), e.holders, e.from_config});
  for (auto& [_, c] : sessions) {
    if (!c->hello) continue;
    if (!all && (v->owner.empty() || c->ident.owner != v->owner)) continue;
    s.clients.push_back({c->id, c->name, c->creds.pid, c->creds.uid, c->channel ? c->channel->ops.load() : 0});
  }
  return s;
}

Status Daemon::Impl::bind_socket() {
  const std::string& path = cfg.daemon.socket;
  if (path.size() >= sizeof(sockaddr_un{}.sun_path))
    return {ErrorCode::kConfig, "daemon.socket path '" + path + "' is longer than a Unix socket path may be"};
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return {ErrorCode::kConfig, "daemon.socket '" + path + "' exists and is not a socket"};
    int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    const bool live = ::connect(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(probe);
    if (live) return {ErrorCode::kAlreadyExists, "another daemon is serving '" + path + "'"};
    ::unlink(path.c_str());  // stale socket of a daemon that died
  }
  boost::system::error_code ec;
  acceptor.open(local_stream(), ec);
  if (!ec) acceptor.bind(local_stream::endpoint(path), ec);
  if (!ec) acceptor.listen(128, ec);
  if (ec) return {ErrorCode::kIo, "binding '" + path + "': " + ec.message()};
  bound = true;
  if (::chmod(path.c_str(), cfg.daemon.socket_mode) != 0) return errno_status("chmod(daemon.socket)", errno);
  if (!cfg.daemon.group.empty()) {
    group* gr = ::getgrnam(cfg.daemon.group.c_str());
    if (!gr) return {ErrorCode::kConfig, "daemon.group '" + cfg.daemon.group + "' does not exist"};
    if (::chown(path.c_str(), static_cast<uid_t>(-1), gr->gr_gid) != 0)
      return errno_status("chown(daemon.socket)", errno);
  }
  reserve_fd.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return Status::Ok();
}

void Daemon::Impl::accept() {
  if (stopping) return;
  acceptor.async_accept([this](boost::system::error_code ec, local_stream::socket s) {
    if (ec == asio::error::operation_aborted || stopping) return;
    if (!ec) {
      guarded("accept", [&] { on_accept(std::move(s)); });
      return accept();
    }
    if (ec.value() == ECONNABORTED || ec.value() == EINTR || ec.value() == EAGAIN) return accept();
    guarded("accept", [&] { pause_accepting(ec); });
    if (!accept_pause_armed) accept();  // the pause could not be armed: better a busy loop than none
  });
}

/// Out of descriptors (or another accept error): the pending connection cannot be taken, and
/// accepting again at once would spin. The reserved fd is given up so that one pending
/// connection can be accepted and closed at once (its client sees the close instead of waiting
/// in the backlog), then taken back; accepting resumes after kAcceptBackoff. One log line a
/// second at most. Connected clients are served all along.
void Daemon::Impl::pause_accepting(const boost::system::error_code& ec) {
  const bool out_of_fds = ec.value() == EMFILE || ec.value() == ENFILE;
  if (out_of_fds) {
    reserve_fd.reset();
    const int c = ::accept4(acceptor.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) {
      ::close(c);
      ++shed;
    }
    reserve_fd.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
  uint64_t held = 0;
  if (accept_log.allow(&held))
    spdlog::warn("accept: {}{}; {} connection(s) shed so far, {} similar line(s) held back; pausing accepts for {} ms",
                 ec.message(), out_of_fds ? " (out of file descriptors)" : "", shed, held, kAcceptBackoff.count());
  accept_pause.expires_after(kAcceptBackoff);
  accept_pause_armed = true;
  accept_pause.async_wait([this](boost::system::error_code e) {
    accept_pause_armed = false;
    if (!e && !stopping) accept();
  });
}

void Daemon::Impl::on_accept(local_stream::socket s) {
  auto sess = std::make_shared<Session>(*this, std::move(s));
  ucred cr{};
  socklen_t len = sizeof cr;
  if (::getsockopt(sess->fd(), SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
    spdlog::warn("SO_PEERCRED: {}", std::strerror(errno));
    boost::system::error_code ig;
    sess->sock.close(ig);
    return;
  }
  sess->creds.uid = cr.uid;
  sess->creds.gid = cr.gid;
  sess->creds.pid = static_cast<uint32_t>(cr.pid);
  sess->creds.groups = peer_groups(sess->fd(), cr);
  auto refuse = [&](const Status& st) {
    uint64_t held = 0;
    if (refuse_log.allow(&held))
      spdlog::warn("refused a connection: {}{}", st.message(),
                   held ? " (" + std::to_string(held) + " more refusals held back)" : std::string());
    send_best_effort(sess->fd(), st);
    boost::system::error_code ig;
    sess->sock.close(ig);
  };
  // This daemon's own uid is admitted to the Hello: a peer daemon of this host running as the same
  // service user imports regions with a granted token (any other Hello is then checked there).
  if (!allowed(sess->creds) && sess->creds.uid != ::geteuid())
    return refuse(
        {ErrorCode::kPermissionDenied,
         creds_text(sess->creds) + " is not allowed to connect (see daemon.allowed_uids and daemon.allowed_gids)"});
  size_t unauthenticated = 0;
  {
    std::lock_guard<std::mutex> g(mu);
    for (auto& [_, x] : sessions) unauthenticated += x->hello ? 0 : 1;
  }
  if (unauthenticated >= cfg.limits.max_unauthenticated)
    return refuse({ErrorCode::kResourceExhausted,
                   "the daemon holds " + std::to_string(unauthenticated) +
                       " connections without a Hello (limits.max_unauthenticated); try again later"});
  {
    std::lock_guard<std::mutex> g(mu);
    sess->id = next_client++;
    sessions[sess->id] = sess;
  }
  sess->arm_read();
  arm_sweep();  // limits.handshake_timeout
}

void Daemon::Impl::arm_sweep() {
  if (sweep_armed || stopping) return;
  sweep_armed = true;
  sweep.expires_after(kSweepPeriod);
  sweep.async_wait([this](boost::system::error_code ec) {
    sweep_armed = false;
    if (ec || stopping) return;
    guarded("sweep", [&] { sweep_once(); });
  });
}

/// Closes connections past their handshake deadline and sessions whose oldest reply has waited
/// past limits.send_timeout; re-arms itself while any deadline is pending.
void Daemon::Impl::sweep_once() {
  const auto now = Clock::now();
  size_t late = 0;
  bool pending = false;
  for (auto& s : all_sessions()) {
    if (s->closed) continue;
    if (!s->outq.empty()) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - s->outq.front().queued);
      if (waited >= cfg.limits.send_timeout) {
        spdlog::warn(
            "client {} '{}' ({}): a reply waited {} ms unsent ({} queued; it does not read its socket); "
            "disconnecting it (limits.send_timeout)",
            s->id, s->name, creds_text(s->creds), waited.count(), s->outq.size());
        s->close();
        continue;
      }
      pending = true;
    }
    if (!s->hello && !s->draining) {
      if (now - s->deadline_from >= cfg.limits.handshake_timeout) {
        ++late;
        spdlog::debug("client {} ({}): no Hello within limits.handshake_timeout; closing it", s->id,
                      creds_text(s->creds));
        s->close();
        continue;
      }
      pending = true;
    }
  }
  if (late)
    spdlog::warn("closed {} connection(s) that did not complete the handshake within {} ms (limits.handshake_timeout)",
                 late, cfg.limits.handshake_timeout.count());
  if (pending) arm_sweep();
}

void Daemon::Impl::arm_watchdog() {
  if (watchdog_half.count() <= 0) return;
  watchdog.expires_after(watchdog_half);
  watchdog.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping) return;
    Notifier::notify("WATCHDOG=1");
    arm_watchdog();
  });
}

void Daemon::Impl::do_stop() {
  if (stopping) return;
  stopping = true;
  spdlog::info("stopping: draining the rings");
  Notifier::notify("STOPPING=1");
  boost::system::error_code ec;
  acceptor.close(ec);
  signals.cancel(ec);
  watchdog.cancel();
  sweep.cancel();
  accept_pause.cancel();
  if (http) http->stop();
  if (data) data->stop();  // saves and loads already queued finish and post their completions
  rings.stop();
  for (auto& s : all_sessions()) s->close();
  io.stop();
}

/// After a reload: a session whose credentials the allow-list no longer admits, or whose tenant
/// mapping changed (tenants, admin lists), is closed. Its channel's tenant and admin flag are
/// read by the ring thread without a lock, so they are never changed in place.
void Daemon::Impl::recheck_sessions() {
  for (auto& s : all_sessions()) {
    if (s->closed) continue;
    if (!allowed(s->creds) && !s->peer_region) {
      spdlog::warn(
          "client {} '{}' ({}): no longer allowed after the reload (daemon.allowed_uids, "
          "daemon.allowed_gids); disconnecting it",
          s->id, s->name, creds_text(s->creds));
      s->close();
      continue;
    }
    if (!s->hello) continue;
    auto who = identify(s->creds, s->claimed);
    if (who.ok() && who->tenant == s->ident.tenant && who->owner == s->ident.owner && who->admin == s->ident.admin)
      continue;
    spdlog::warn("client {} '{}' ({}): its tenant '{}'{} no longer holds after the reload ({}); disconnecting it",
                 s->id, s->name, creds_text(s->creds), s->ident.tenant, s->ident.admin ? " (admin)" : "",
                 who.ok() ? "it would now be tenant '" + who->tenant + "'" + (who->admin ? " (admin)" : "")
                          : who.status().message());
    s->close();
  }
}

void Daemon::Impl::do_reload(const config::Config& next) {
  for (const std::string& k : config::non_reloadable_changes(cfg, next))
    spdlog::warn("reload: '{}' changed but needs a restart; keeping the running value", k);
  for (const std::string& k : config::reloadable_changes(cfg, next)) spdlog::info("reload: applying '{}'", k);
  cfg.daemon.log_level = next.daemon.log_level;
  cfg.limits.max_clients = next.limits.max_clients;
  if (data) {
    config::Config applied = cfg;  // the data path's keys; a rejected value keeps the running one
    applied.host.high_watermark = next.host.high_watermark;
    applied.host.low_watermark = next.host.low_watermark;
    applied.integrity.verify_on_load = next.integrity.verify_on_load;
    applied.limits.request_timeout = next.limits.request_timeout;
    if (Status st = data->reload(applied); st.ok()) {
      cfg.host.high_watermark = applied.host.high_watermark;
      cfg.host.low_watermark = applied.host.low_watermark;
      cfg.integrity.verify_on_load = applied.integrity.verify_on_load;
      cfg.limits.request_timeout = applied.limits.request_timeout;
    } else {
      spdlog::error("reload: {}; keeping the running values", st.to_string());
    }
  }
  cfg.daemon.allowed_uids = next.daemon.allowed_uids;
  cfg.daemon.allowed_gids = next.daemon.allowed_gids;
  cfg.daemon.admin_uids = next.daemon.admin_uids;
  cfg.daemon.admin_gids = next.daemon.admin_gids;
  cfg.daemon.debug_read = next.daemon.debug_read;
  cfg.tenants = next.tenants;
  cfg.limits.tenant = next.limits.tenant;  // control-plane checks at once; channel quotas for new clients
  cfg.limits.handshake_timeout = next.limits.handshake_timeout;
  cfg.limits.max_unauthenticated = next.limits.max_unauthenticated;
  cfg.limits.send_timeout = next.limits.send_timeout;
  if (cfg.daemon.socket_mode != next.daemon.socket_mode) {
    cfg.daemon.socket_mode = next.daemon.socket_mode;
    if (::chmod(cfg.daemon.socket.c_str(), cfg.daemon.socket_mode) != 0)
      spdlog::warn("reload: chmod of the socket failed: {}", std::strerror(errno));
  }
  apply_log_level(cfg.daemon.log_level);
  recheck_sessions();
}

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() {
  if (!impl_) return;
  if (impl_->data) impl_->data->stop();
  impl_->rings.stop();
  if (impl_->bound) ::unlink(impl_->cfg.daemon.socket.c_str());
}

Result<std::unique_ptr<Daemon>> Daemon::create(const config::Config& cfg) { return create(cfg, Options{}); }

Result<std::unique_ptr<Daemon>> Daemon::create(const config::Config& cfg, const Options& opts) {
  auto impl = std::make_unique<Impl>();
  impl->cfg = cfg;
  auto g = ring::Geometry::make(cfg.limits.ring_entries, kArenaBytes);
  if (!g.ok()) return Status(ErrorCode::kConfig, "limits.ring_entries: " + g.status().message());
  switch (cfg.device.backend) {
    case config::Backend::kCpu: impl->backend = RegionBackend::kCpu; break;
    case config::Backend::kCuda:
      if (cuda_device_count() <= 0)
        return Status(ErrorCode::kUnavailable, "device.backend is cuda but " + cuda_summary());
      impl->backend = RegionBackend::kCuda;
      break;
    case config::Backend::kAuto:
      impl->backend = cuda_device_count() > 0 ? RegionBackend::kCuda : RegionBackend::kCpu;
      break;
  }
  spdlog::info("kvferryd {}: region backend {} ({})", version(),
               impl->backend == RegionBackend::kCuda ? "cuda" : "cpu (memfd)", cuda_summary());
  for (const auto& rc : cfg.regions) {
    auto r = impl->add_region(rc.name, rc.spec, true, rc.tenant);
    if (!r.ok()) return r.status().with_context("regions: '" + rc.name + "'");
  }
  impl->rings.set_handler(static_cast<uint16_t>(proto::Op::kPing), &op_ping);
  {
    Impl* d = impl.get();
    DataOps::Options o;
    o.cuda = impl->backend == RegionBackend::kCuda;
    o.test_faults = opts.test_faults;
    o.test_copy_delay = opts.test_copy_delay;
    o.test_disk_faults = opts.test_disk_faults;
    if (opts.data_workers > 0) o.workers = opts.data_workers;
    o.hash_threads = opts.hash_threads;
    o.pipeline_bytes = opts.pipeline_bytes;
    o.find_region = [d](const ClientChannel& c, uint32_t id) { return d->find_region(c, id); };
    o.find_region_for_tenant = [d](const std::string& tenant, uint32_t id) {
      return d->find_region_for_tenant(tenant, id);
    };
    o.grant_import = [d](const std::string& tenant, uint32_t region) { return d->grant_import(tenant, region); };
    o.check_landed = [d](const std::string& token, const std::string& tenant, uint32_t region,
                         std::span<const int64_t> ids) { return d->check_landed(token, tenant, region, ids); };
    {
      std::error_code ec;
      const auto abs = std::filesystem::absolute(cfg.daemon.socket, ec);
      o.socket = ec ? cfg.daemon.socket : abs.string();
    }
    o.clients = [d]() -> uint64_t {
      std::lock_guard<std::mutex> g(d->mu);
      uint64_t n = 0;
      for (auto& [_, s] : d->sessions) n += s->hello ? 1 : 0;
      return n;
    };
    auto data = DataOps::create(cfg, std::move(o));
    if (!data.ok()) return data.status();
    impl->data = std::move(*data);
    impl->data->install(impl->rings);
    if (opts.test_faults) spdlog::warn("test faults are enabled (--enable-test-faults): never in production");
  }
  if (!cfg.daemon.metrics_listen.empty()) {
    DataOps* data = impl->data.get();
    store::HttpServer::Handlers h;
    h.metrics = [data] { return data->render_metrics(); };
    h.health = [data](std::string* body) { return data->healthy(body); };
    auto http = store::HttpServer::start(impl->io, cfg.daemon.metrics_listen, std::move(h));
    if (http.ok()) {
      impl->http = std::move(*http);
      spdlog::info("metrics on http://{}/metrics (port {})", cfg.daemon.metrics_listen, impl->http->port());
    } else {
      // The data path does not depend on the metrics: serve on without them, loudly.
      spdlog::error("daemon.metrics_listen '{}': {}; serving without /metrics", cfg.daemon.metrics_listen,
                    http.status().to_string());
    }
  }
  KVFERRY_TRY(impl->bind_socket());
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

Status Daemon::run() {
  Impl& d = *impl_;
  KVFERRY_TRY(d.rings.start());
  d.accept();
  const auto fallback = std::chrono::duration_cast<std::chrono::microseconds>(d.cfg.limits.watchdog);
  d.watchdog_half = (Notifier::active() ? Notifier::watchdog_interval(fallback) : fallback) / 2;
  spdlog::info("serving on {} ({} region(s), {} ring slots per client)", d.cfg.daemon.socket, d.regions.size(),
               d.cfg.limits.ring_entries);
  Notifier::notify("READY=1\nSTATUS=serving");
  d.arm_watchdog();
  d.io.run();
  d.rings.stop();
  if (d.bound) {
    ::unlink(d.cfg.daemon.socket.c_str());
    d.bound = false;
  }
  spdlog::info("stopped");
  return Status::Ok();
}

void Daemon::stop() {
  asio::post(impl_->io, [d = impl_.get()] { d->do_stop(); });
}

void Daemon::reload(const config::Config& cfg) {
  asio::post(impl_->io, [d = impl_.get(), cfg] { guarded("reload", [&] { d->do_reload(cfg); }); });
}

void Daemon::handle_signals(std::function<Result<config::Config>()> on_hup) {
  Impl& d = *impl_;
  d.on_hup = std::move(on_hup);
  d.signals.add(SIGTERM);
  d.signals.add(SIGINT);
  d.signals.add(SIGHUP);
  struct Waiter {
    Impl* d;
    void operator()(boost::system::error_code ec, int sig) const {
      if (ec) return;
      if (sig == SIGHUP) {
        guarded("SIGHUP", [&] {
          spdlog::info("SIGHUP: reloading the configuration");
          if (!d->on_hup) return;
          auto next = d->on_hup();
          if (next.ok())
            d->do_reload(*next);
          else
            spdlog::error("reload failed, keeping the running configuration: {}", next.status().to_string());
        });
        d->signals.async_wait(*this);
        return;
      }
      spdlog::info("signal {}: shutting down", sig);
      d->do_stop();
    }
  };
  d.signals.async_wait(Waiter{&d});
}

proto::StatusReply Daemon::status() const { return impl_->snapshot(nullptr); }
const std::string& Daemon::socket_path() const { return impl_->cfg.daemon.socket; }
std::string Daemon::metrics_text() const { return impl_->data ? impl_->data->render_metrics() : std::string(); }
uint16_t Daemon::metrics_port() const { return impl_->http ? impl_->http->port() : 0; }

}  // namespace kvferry::daemon
