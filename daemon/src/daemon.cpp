// The daemon core (daemon.h): control socket, sessions, region registry, ring service.
#include <utility>  // before Asio (Boost 1.74 with C++20)

#include <boost/asio.hpp>

#include "kvferry/daemon/daemon.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "data_ops.h"
#include "kvferry/connector/wire_io.h"
#include "kvferry/daemon/notify.h"
#include "kvferry/daemon/region.h"
#include "kvferry/daemon/ring_service.h"
#include "kvferry/kernels/device.h"
#include "kvferry/store/http_server.h"

namespace kvferry::daemon {

namespace asio = boost::asio;
using local_stream = asio::local::stream_protocol;

const char* version() { return "0.1.0"; }

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

constexpr uint32_t kArenaBytes = 1u << 20;
constexpr auto kSpin = std::chrono::microseconds(50);

void op_ping(ClientChannel&, const ring::SubmitEntry& req, ring::CompletionEntry& out) { out.result[0] = req.args[0]; }

std::string creds_text(uint32_t uid, uint32_t gid, uint32_t pid) {
  return "uid " + std::to_string(uid) + " gid " + std::to_string(gid) + " pid " + std::to_string(pid);
}

}  // namespace

struct Daemon::Impl {
  struct Session;
  struct RegionEntry {
    std::shared_ptr<Region> region;
    bool from_config = false;
    uint32_t holders = 0;
  };

  config::Config cfg;
  RegionBackend backend = RegionBackend::kCpu;
  asio::io_context io{1};
  local_stream::acceptor acceptor{io};
  asio::signal_set signals{io};
  asio::steady_timer watchdog{io};
  std::chrono::microseconds watchdog_half{0};
  RingService rings{kSpin};
  std::unique_ptr<DataOps> data;            // after rings: its workers post to them
  std::unique_ptr<store::HttpServer> http;  // after io: it serves on it
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::function<Result<config::Config>()> on_hup;
  bool stopping = false;
  bool bound = false;

  mutable std::mutex mu;  // guards regions and sessions (status() reads them from any thread)
  std::map<uint32_t, RegionEntry> regions;
  std::map<uint32_t, std::shared_ptr<Session>> sessions;
  uint32_t next_region = 1;
  uint32_t next_client = 1;

  Status bind_socket();
  void accept();
  void do_stop();
  void arm_watchdog();
  void do_reload(const config::Config& next);
  bool allowed(uint32_t uid, uint32_t gid) const;
  void release(Session& s);
  proto::StatusReply snapshot() const;
  Result<std::shared_ptr<Region>> add_region(const std::string& name, const KvCacheSpec& spec, bool from_config);
};

/// One connected client. Lives while a read is pending (handlers hold a shared_ptr).
struct Daemon::Impl::Session : std::enable_shared_from_this<Session> {
  Session(Impl& d, local_stream::socket s) : d(d), sock(std::move(s)) {}
  Impl& d;
  local_stream::socket sock;
  uint32_t id = 0, uid = 0, gid = 0, pid = 0;
  std::string name;
  bool hello = false, closed = false;
  std::shared_ptr<ClientChannel> channel;
  std::set<uint32_t> held;
  uint8_t hdr[proto::kHeaderBytes];
  size_t hdr_got = 0;
  std::vector<UniqueFd> fds;  // descriptors that came with the current frame
  proto::Header header;
  std::vector<uint8_t> payload;

  int fd() { return sock.native_handle(); }

  void send(const proto::Frame& f, std::span<const int> fds = {}) {
    if (closed) return;
    Status st = proto::send_frame(fd(), f, fds, 2000);
    if (!st.ok()) {
      spdlog::debug("client {}: send failed: {}", id, st.to_string());
      close();
    }
  }
  void send_error(const Status& st) { send(proto::encode(proto::ErrorMsg{st.code(), st.message()})); }

  void close() {
    if (closed) return;
    closed = true;
    boost::system::error_code ec;
    sock.close(ec);
    d.release(*this);
  }

  /// Waits for the next header. The header is read with recvmsg so that descriptors sent with a
  /// frame's first byte (SCM_RIGHTS) are kept; Asio's reads would drop them. The payload follows
  /// with an exact-size async_read.
  void read_header() {
    auto self = shared_from_this();
    sock.async_wait(local_stream::socket::wait_read, [self](boost::system::error_code ec) {
      if (ec) return self->close();
      self->on_readable();
    });
  }

  void on_readable() {
    while (hdr_got < proto::kHeaderBytes) {
      iovec iov{hdr + hdr_got, proto::kHeaderBytes - hdr_got};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
      const ssize_t r = ::recvmsg(fd(), &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return read_header();  // partial: wait
      if (r <= 0) return close();
      for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
          fds.emplace_back(f);
        }
      }
      if (mh.msg_flags & MSG_CTRUNC) return fail({ErrorCode::kProtocol, "too many file descriptors in one frame"});
      hdr_got += static_cast<size_t>(r);
    }
    hdr_got = 0;
    auto h = proto::decode_header(hdr);
    if (!h.ok()) return fail(h.status());
    header = *h;
    payload.resize(h->length);
    if (h->length == 0) return dispatch();
    auto self = shared_from_this();
    asio::async_read(sock, asio::buffer(payload), [self](boost::system::error_code ec, size_t) {
      if (ec) return self->close();
      self->dispatch();
    });
  }

  /// A malformed message: tell the client why and disconnect it; the daemon serves on.
  void fail(const Status& st) {
    spdlog::warn("client {} ({}): {}; disconnecting it", id, creds_text(uid, gid, pid), st.to_string());
    send_error(st);
    close();
  }

  void dispatch() {
    Status st = handle();
    fds.clear();  // descriptors a message did not take are closed
    if (closed) return;
    if (!st.ok()) {
      if (st.code() == ErrorCode::kProtocol || st.code() == ErrorCode::kVersionMismatch) return fail(st);
      send_error(st);  // a request that failed: the connection stays usable
    }
    if (!closed) read_header();
  }

  Status handle() {
    const auto type = static_cast<proto::MsgType>(header.type);
    const uint32_t fm = header.field_mask;
    switch (type) {
      case proto::MsgType::kHello: return on_hello(fm);
      case proto::MsgType::kStatusRequest: send(proto::encode(d.snapshot())); return Status::Ok();
      case proto::MsgType::kGoodbye: close(); return Status::Ok();
      default: break;
    }
    if (!hello)
      return {ErrorCode::kProtocol, "message type " + std::to_string(header.type) + " before the Hello handshake"};
    switch (type) {
      case proto::MsgType::kMapRegion: {
        auto m = proto::decode_map_region(payload, fm);
        if (!m.ok()) return m.status();
        return map_region(m->region_id);
      }
      case proto::MsgType::kCreateRegion: {
        auto m = proto::decode_create_region(payload, fm);
        if (!m.ok()) return m.status();
        return create_region(*m);
      }
      case proto::MsgType::kRegisterRegion: {
        auto m = proto::decode_register_region(payload, fm);
        if (!m.ok()) return m.status();
        return register_region(*m);
      }
      case proto::MsgType::kDebugRead: {
        auto m = proto::decode_debug_read(payload, fm);
        if (!m.ok()) return m.status();
        return debug_read(*m);
      }
      default:
        return {ErrorCode::kProtocol,
                "message type " + std::to_string(header.type) + " is not something a client sends"};
    }
  }

  Status on_hello(uint32_t fm) {
    if (hello) return {ErrorCode::kProtocol, "a second Hello"};
    auto m = proto::decode_hello(payload, fm);
    if (!m.ok()) return m.status();
    size_t engines = 0;
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, s] : d.sessions) engines += s->hello ? 1 : 0;
    }
    if (engines >= d.cfg.limits.max_clients)
      return {ErrorCode::kResourceExhausted, "the daemon serves its limit of " +
                                                 std::to_string(d.cfg.limits.max_clients) +
                                                 " clients (limits.max_clients)"};
    auto ch = ClientChannel::create(id, d.cfg.limits.ring_entries, kArenaBytes);
    if (!ch.ok()) return ch.status().with_context("creating the client's rings");
    channel = *ch;
    if (m->has_namespace) {
      channel->model = m->model;
      channel->tenant = m->tenant;
    }
    name = m->client_name;
    hello = true;
    proto::Welcome w;
    w.client_id = id;
    w.ring_entries = channel->geometry.entries;
    w.ring_bytes = channel->bytes;
    w.arena_bytes = channel->geometry.arena_bytes;
    w.spin_us = static_cast<uint32_t>(kSpin.count());
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, e] : d.regions) w.regions.push_back(e.region->desc());
    }
    const int fds[3] = {channel->ring_fd.get(), channel->sq_efd.get(), channel->cq_efd.get()};
    d.rings.add(channel);
    spdlog::info("client {} '{}' connected ({})", id, name, creds_text(uid, gid, pid));
    send(proto::encode(w), fds);
    return Status::Ok();
  }

  Status send_region(const std::shared_ptr<Region>& r) {
    proto::RegionHandle h;
    h.region = r->desc();
    h.has_ipc_handle = r->ipc_handle(h.ipc_handle);
    const int fd = r->export_fd();
    if (fd >= 0) {
      const int fds[1] = {fd};
      send(proto::encode(h), fds);
    } else {
      send(proto::encode(h));
    }
    return Status::Ok();
  }

  Status map_region(uint32_t rid) {
    std::shared_ptr<Region> r;
    {
      std::lock_guard<std::mutex> g(d.mu);
      auto it = d.regions.find(rid);
      if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(rid)};
      r = it->second.region;
      if (held.insert(rid).second) ++it->second.holders;
    }
    return send_region(r);
  }

  Status create_region(const proto::CreateRegion& m) {
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [rid, e] : d.regions) {
        if (e.region->desc().name != m.name) continue;
        const auto& s = e.region->desc().spec;
        if (s.layers != m.spec.layers || s.blocks != m.spec.blocks || s.block_size != m.spec.block_size ||
            s.format != m.spec.format || s.layout != m.spec.layout)
          return {ErrorCode::kAlreadyExists, "region '" + m.name + "' exists with another spec"};
        auto r = e.region;
        if (held.insert(rid).second) ++e.holders;
        return send_region(r);
      }
    }
    auto r = d.add_region(m.name, m.spec, false);
    if (!r.ok()) return r.status();
    {
      std::lock_guard<std::mutex> g(d.mu);
      held.insert((*r)->desc().id);
      ++d.regions[(*r)->desc().id].holders;
    }
    return send_region(*r);
  }

  Status register_region(const proto::RegisterRegion& m) {
    const size_t want = m.backend == proto::Backend::kCudaIpc ? 0 : 1;
    if (fds.size() != want)
      return {ErrorCode::kInvalidArgument, "registering region '" + m.name + "' (" +
                                               std::string(proto::backend_name(m.backend)) + ") needs " +
                                               std::to_string(want) + " fd(s), got " + std::to_string(fds.size())};
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, e] : d.regions)
        if (e.region->desc().name == m.name)
          return {ErrorCode::kAlreadyExists, "a region named '" + m.name + "' exists"};
    }
    uint32_t rid;
    {
      std::lock_guard<std::mutex> g(d.mu);
      rid = d.next_region++;
    }
    auto r = import_region(rid, m, want ? std::move(fds[0]) : UniqueFd());
    if (!r.ok()) return r.status();
    {
      std::lock_guard<std::mutex> g(d.mu);
      d.regions[rid] = Impl::RegionEntry{*r, false, 1};
      held.insert(rid);
    }
    spdlog::info("client {} registered region {} '{}': {} bytes on {}", id, rid, m.name, (*r)->desc().bytes,
                 proto::backend_name(m.backend));
    proto::RegionHandle h;  // no fd back: the client has its buffer
    h.region = (*r)->desc();
    send(proto::encode(h));
    return Status::Ok();
  }

  Status debug_read(const proto::DebugRead& m) {
    std::shared_ptr<Region> r;
    {
      std::lock_guard<std::mutex> g(d.mu);
      auto it = d.regions.find(m.region_id);
      if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(m.region_id)};
      r = it->second.region;
    }
    std::vector<uint8_t> buf(m.bytes);
    KVFERRY_TRY(r->read(m.offset, buf));
    send(proto::encode_debug_read_reply(buf));
    return Status::Ok();
  }
};

bool Daemon::Impl::allowed(uint32_t uid, uint32_t gid) const {
  const auto& u = cfg.daemon.allowed_uids;
  const auto& g = cfg.daemon.allowed_gids;
  if (u.empty() && g.empty()) return uid == 0 || uid == ::getuid();
  return std::find(u.begin(), u.end(), uid) != u.end() || std::find(g.begin(), g.end(), gid) != g.end();
}

void Daemon::Impl::release(Session& s) {
  if (s.channel) rings.remove(s.channel);
  if (data && s.hello) data->client_gone(s.id);
  std::lock_guard<std::mutex> g(mu);
  for (uint32_t rid : s.held) {
    auto it = regions.find(rid);
    if (it == regions.end()) continue;
    if (--it->second.holders == 0 && !it->second.from_config) {
      spdlog::info("region {} '{}' released (its last client left)", rid, it->second.region->desc().name);
      regions.erase(it);
    }
  }
  s.held.clear();
  if (s.hello) spdlog::info("client {} '{}' disconnected", s.id, s.name);
  sessions.erase(s.id);
}

Result<std::shared_ptr<Region>> Daemon::Impl::add_region(const std::string& name, const KvCacheSpec& spec,
                                                         bool from_config) {
  uint32_t id;
  {
    std::lock_guard<std::mutex> g(mu);
    id = next_region++;
  }
  auto r = create_region(id, name, spec, backend, cfg.device.gpu);
  if (!r.ok()) return r.status();
  std::lock_guard<std::mutex> g(mu);
  regions[id] = RegionEntry{*r, from_config, 0};
  spdlog::info("region {} '{}': {} x {} blocks x {} tokens of {}, {} bytes on {}", id, name, spec.layers, spec.blocks,
               spec.block_size, spec.format.name(), (*r)->desc().bytes, proto::backend_name((*r)->desc().backend));
  return r;
}

proto::StatusReply Daemon::Impl::snapshot() const {
  proto::StatusReply s;
  s.version = version();
  s.uptime_ms = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count());
  s.pid = static_cast<uint32_t>(::getpid());
  s.backend = backend == RegionBackend::kCuda ? "cuda" : "cpu";
  std::lock_guard<std::mutex> g(mu);
  for (auto& [_, e] : regions) s.regions.push_back({e.region->desc(), e.holders, e.from_config});
  for (auto& [_, c] : sessions)
    if (c->hello) s.clients.push_back({c->id, c->name, c->pid, c->uid, c->channel ? c->channel->ops.load() : 0});
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
  return Status::Ok();
}

void Daemon::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, local_stream::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted && !stopping) {
        spdlog::warn("accept: {}", ec.message());
        accept();
      }
      return;
    }
    auto sess = std::make_shared<Session>(*this, std::move(s));
    ucred cr{};
    socklen_t len = sizeof cr;
    if (::getsockopt(sess->fd(), SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
      spdlog::warn("SO_PEERCRED: {}", std::strerror(errno));
      boost::system::error_code ig;
      sess->sock.close(ig);
      return accept();
    }
    sess->uid = cr.uid;
    sess->gid = cr.gid;
    sess->pid = static_cast<uint32_t>(cr.pid);
    if (!allowed(cr.uid, cr.gid)) {
      Status st(ErrorCode::kPermissionDenied, creds_text(cr.uid, cr.gid, sess->pid) +
                                                  " is not allowed to connect (see daemon.allowed_uids and "
                                                  "daemon.allowed_gids)");
      spdlog::warn("refused a connection: {}", st.message());
      (void)proto::send_frame(sess->fd(), proto::encode(proto::ErrorMsg{st.code(), st.message()}), {}, 500);
      boost::system::error_code ig;
      sess->sock.close(ig);
      return accept();
    }
    {
      std::lock_guard<std::mutex> g(mu);
      sess->id = next_client++;
      sessions[sess->id] = sess;
    }
    sess->read_header();
    accept();
  });
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
  if (http) http->stop();
  if (data) data->stop();  // saves and loads already queued finish and post their completions
  rings.stop();
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> g(mu);
    for (auto& [_, s] : sessions) all.push_back(s);
  }
  for (auto& s : all) s->close();
  io.stop();
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
  if (cfg.daemon.socket_mode != next.daemon.socket_mode) {
    cfg.daemon.socket_mode = next.daemon.socket_mode;
    if (::chmod(cfg.daemon.socket.c_str(), cfg.daemon.socket_mode) != 0)
      spdlog::warn("reload: chmod of the socket failed: {}", std::strerror(errno));
  }
  apply_log_level(cfg.daemon.log_level);
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
    auto r = impl->add_region(rc.name, rc.spec, true);
    if (!r.ok()) return r.status().with_context("regions: '" + rc.name + "'");
  }
  impl->rings.set_handler(static_cast<uint16_t>(proto::Op::kPing), &op_ping);
  {
    Impl* d = impl.get();
    DataOps::Options o;
    o.cuda = impl->backend == RegionBackend::kCuda;
    o.test_faults = opts.test_faults;
    o.test_copy_delay = opts.test_copy_delay;
    if (opts.data_workers > 0) o.workers = opts.data_workers;
    o.hash_threads = opts.hash_threads;
    o.pipeline_bytes = opts.pipeline_bytes;
    o.find_region = [d](uint32_t id) -> std::shared_ptr<Region> {
      std::lock_guard<std::mutex> g(d->mu);
      auto it = d->regions.find(id);
      return it == d->regions.end() ? nullptr : it->second.region;
    };
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
  asio::post(impl_->io, [d = impl_.get(), cfg] { d->do_reload(cfg); });
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
        spdlog::info("SIGHUP: reloading the configuration");
        if (d->on_hup) {
          auto next = d->on_hup();
          if (next.ok())
            d->do_reload(*next);
          else
            spdlog::error("reload failed, keeping the running configuration: {}", next.status().to_string());
        }
        d->signals.async_wait(*this);
        return;
      }
      spdlog::info("signal {}: shutting down", sig);
      d->do_stop();
    }
  };
  d.signals.async_wait(Waiter{&d});
}

proto::StatusReply Daemon::status() const { return impl_->snapshot(); }
const std::string& Daemon::socket_path() const { return impl_->cfg.daemon.socket; }
std::string Daemon::metrics_text() const { return impl_->data ? impl_->data->render_metrics() : std::string(); }
uint16_t Daemon::metrics_port() const { return impl_->http ? impl_->http->port() : 0; }

}  // namespace kvferry::daemon
