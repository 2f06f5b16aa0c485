// The daemon core (daemon.h): control socket, sessions, tenancy, region registry, ring service.
#include "daemon_impl.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>

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

/// A session's output queue holds at most this many frames or bytes; past either, the session's
/// requests are not read until the client reads its replies (limits.send_timeout then applies).
constexpr size_t kMaxQueuedFrames = 64;
constexpr size_t kMaxQueuedBytes = 8u << 20;
/// Longest tenant a Hello may claim.
constexpr size_t kMaxClaimedTenant = 128;
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

/// One connected client. Lives while the registry or a pending handler holds it. Everything here
/// runs on the event loop thread; `hello` and `ident` are also read by status() under `d.mu`.
struct Daemon::Impl::Session : std::enable_shared_from_this<Session> {
  Session(Impl& d, local_stream::socket s) : d(d), sock(std::move(s)) {}
  Impl& d;
  local_stream::socket sock;
  uint32_t id = 0;
  Creds creds;
  std::string name, claimed;
  Identity ident;
  /// Start of the handshake deadline: the accept, renewed by each StatusRequest answered before
  /// a Hello (so `kvferry status` completes, and an idle or half-sent status-only connection
  /// still goes after limits.handshake_timeout).
  Clock::time_point deadline_from = Clock::now();
  bool hello = false, closed = false;
  bool draining = false;  // refused or failed: no more reads, closed once the queue is sent
  std::shared_ptr<ClientChannel> channel;
  std::set<uint32_t> held;

  // Input: the header is read with recvmsg (it carries the fds), then the payload as it arrives.
  uint8_t hdr[proto::kHeaderBytes];
  size_t hdr_got = 0;
  bool in_payload = false;
  bool read_armed = false, read_paused = false;
  std::vector<UniqueFd> fds;  // descriptors that came with the current frame
  proto::Header header;
  std::vector<uint8_t> payload;

  // Output: frames waiting for the socket, written without ever blocking the loop.
  struct Out {
    proto::Frame bytes;
    std::vector<UniqueFd> fds;  // our own duplicates: they ride with the first byte
    size_t sent = 0;
    Clock::time_point queued;
  };
  std::deque<Out> outq;
  size_t out_bytes = 0;
  bool write_armed = false;

  int fd() { return sock.native_handle(); }
  bool queue_full() const { return outq.size() >= kMaxQueuedFrames || out_bytes >= kMaxQueuedBytes; }

  /// Queues `f` with duplicates of `borrowed` (so they stay valid until sent) and starts writing.
  /// Fails only when no descriptor can be duplicated (the daemon is out of fds).
  Status send(proto::Frame f, std::span<const int> borrowed = {}) {
    if (closed) return Status::Ok();
    Out o;
    for (int b : borrowed) {
      const int c = ::fcntl(b, F_DUPFD_CLOEXEC, 0);
      if (c < 0)
        return {ErrorCode::kResourceExhausted,
                std::string("duplicating a descriptor to send: ") + std::strerror(errno)};
      o.fds.emplace_back(c);
    }
    o.bytes = std::move(f);
    o.queued = Clock::now();
    out_bytes += o.bytes.size();
    outq.push_back(std::move(o));
    flush();
    return Status::Ok();
  }
  void send_error(const Status& st) { (void)send(proto::encode(proto::ErrorMsg{st.code(), st.message()})); }

  /// Writes what the socket takes now; the rest waits for it to become writable. A frame's fds
  /// go with its first byte (as proto::send_frame sends them); a partial write keeps the rest.
  void flush() {
    while (!outq.empty() && !closed) {
      Out& o = outq.front();
      iovec iov{o.bytes.data() + o.sent, o.bytes.size() - o.sent};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
      if (!o.fds.empty()) {
        const size_t n = std::min<size_t>(o.fds.size(), proto::kMaxFds);
        mh.msg_control = cbuf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * n);
        cmsghdr* c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * n);
        for (size_t i = 0; i < n; ++i) {
          const int f = o.fds[i].get();
          std::memcpy(CMSG_DATA(c) + i * sizeof(int), &f, sizeof f);
        }
      }
      const ssize_t r = ::sendmsg(fd(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_write();
        spdlog::debug("client {}: send failed: {}", id, std::strerror(errno));
        return close();
      }
      o.fds.clear();  // the kernel holds its own references now
      o.sent += static_cast<size_t>(r);
      if (o.sent == o.bytes.size()) {
        out_bytes -= o.bytes.size();
        outq.pop_front();
      }
    }
    if (closed) return;
    if (outq.empty() && draining) return close();
    if (read_paused && !queue_full()) {
      read_paused = false;
      arm_read();
    }
  }

  void arm_write() {
    if (write_armed || closed) return;
    write_armed = true;
    d.arm_sweep();  // limits.send_timeout
    sock.async_wait(local_stream::socket::wait_write, [self = shared_from_this()](boost::system::error_code ec) {
      guarded("control socket write", [&] {
        self->write_armed = false;
        if (self->closed) return;
        if (ec) return self->close();
        self->flush();
      });
    });
  }

  void close() {
    if (closed) return;
    closed = true;
    boost::system::error_code ec;
    sock.close(ec);  // pending waits complete with operation_aborted
    outq.clear();
    out_bytes = 0;
    d.release(*this);
  }

  /// Sends `st` and closes once it is written (or limits.send_timeout passes); reads stop now.
  void finish(const Status& st) {
    draining = true;
    send_error(st);
    if (!closed && outq.empty()) close();
  }

  /// Waits for the socket to become readable, unless the output queue is full (then the client
  /// must read its replies first; flush() resumes reading).
  void arm_read() {
    if (closed || draining || read_armed) return;
    if (queue_full()) {
      read_paused = true;
      return;
    }
    read_armed = true;
    sock.async_wait(local_stream::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      guarded("control socket read", [&] {
        self->read_armed = false;
        if (self->closed) return;
        if (ec) return self->close();
        self->on_readable();
      });
    });
  }

  /// Reads what has arrived of the current frame. The header is read with recvmsg so that
  /// descriptors sent with a frame's first byte (SCM_RIGHTS) are kept; the payload follows in
  /// pieces of at most kReadChunk, never past its length (the next frame's first byte may carry
  /// descriptors), the buffer growing only by what arrived.
  void on_readable() {
    if (draining) return;
    if (!in_payload) {
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
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return arm_read();  // partial: wait
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
        if (fds.size() > static_cast<size_t>(proto::kMaxFds))
          return fail({ErrorCode::kProtocol, "too many file descriptors in one frame"});
        hdr_got += static_cast<size_t>(r);
      }
      hdr_got = 0;
      auto h = proto::decode_header(hdr);
      if (!h.ok()) return fail(h.status());
      header = *h;
      payload.clear();
      in_payload = true;
    }
    while (payload.size() < header.length) {
      const size_t want = std::min<size_t>(d.scratch.size(), header.length - payload.size());
      const ssize_t r = ::recv(fd(), d.scratch.data(), want, MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return arm_read();
      if (r <= 0) return close();
      payload.insert(payload.end(), d.scratch.begin(), d.scratch.begin() + r);
    }
    in_payload = false;
    dispatch();
  }

  /// A malformed message: tell the client why and disconnect it; the daemon serves on.
  void fail(const Status& st) {
    spdlog::warn("client {} ({}): {}; disconnecting it", id, creds_text(creds), st.to_string());
    finish(st);
  }

  void dispatch() {
    Status st;
    try {
      st = handle();
    } catch (const std::exception& e) {
      st = Status(ErrorCode::kInternal, std::string("handling the request: ") + e.what());
    }
    fds.clear();  // descriptors a message did not take are closed
    if (payload.capacity() > kReadChunk) std::vector<uint8_t>().swap(payload);
    if (closed) return;
    if (!st.ok()) {
      if (st.code() == ErrorCode::kProtocol || st.code() == ErrorCode::kVersionMismatch) return fail(st);
      send_error(st);  // a request that failed: the connection stays usable
    }
    arm_read();
  }

  Status handle() {
    const auto type = static_cast<proto::MsgType>(header.type);
    const uint32_t fm = header.field_mask;
    switch (type) {
      case proto::MsgType::kHello: return on_hello(fm);
      case proto::MsgType::kStatusRequest: {
        // Allowed before the Hello (the CLI), filtered by what the caller's credentials may see.
        const Viewer v = hello ? Viewer{ident.admin, ident.owner} : d.viewer_for(creds);
        KVFERRY_TRY(send(proto::encode(d.snapshot(&v))));
        if (!hello) deadline_from = Clock::now();
        return Status::Ok();
      }
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

  /// A Hello that may not proceed: the client hears why, then the connection closes.
  Status refuse(const Status& st) {
    spdlog::info("client {} ({}): Hello refused: {}", id, creds_text(creds), st.to_string());
    finish(st);
    return Status::Ok();
  }

  Status on_hello(uint32_t fm) {
    if (hello) return {ErrorCode::kProtocol, "a second Hello"};
    auto m = proto::decode_hello(payload, fm);
    if (!m.ok()) return m.status();
    const std::string want = m->has_namespace ? m->tenant : std::string();
    if (want.size() > kMaxClaimedTenant)
      return refuse({ErrorCode::kInvalidArgument,
                     "the Hello's tenant is longer than " + std::to_string(kMaxClaimedTenant) + " bytes"});
    auto who = d.identify(creds, want);
    if (!who.ok()) return refuse(who.status());
    const config::TenantQuota quota = d.quota_for(*who);
    size_t engines = 0, same = 0;
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, s] : d.sessions) {
        if (!s->hello) continue;
        ++engines;
        same += s->ident.owner == who->owner && !s->ident.admin ? 1 : 0;
      }
    }
    if (engines >= d.cfg.limits.max_clients)
      return refuse({ErrorCode::kResourceExhausted, "the daemon serves its limit of " +
                                                        std::to_string(d.cfg.limits.max_clients) +
                                                        " clients (limits.max_clients)"});
    if (!who->admin && quota.clients > 0 && same >= quota.clients)
      return refuse({ErrorCode::kResourceExhausted,
                     "tenant '" + who->owner + "' has its quota of " + std::to_string(quota.clients) +
                         " clients connected (quota.clients, default limits.tenant.clients)"});
    auto ch = ClientChannel::create(id, d.cfg.limits.ring_entries, kArenaBytes);
    if (!ch.ok()) return refuse(ch.status().with_context("creating the client's rings"));
    auto c = *ch;
    c->model = m->has_namespace ? m->model : std::string();
    c->tenant = who->tenant;
    c->owner = who->owner;
    c->uid = creds.uid;
    c->admin = who->admin;
    c->quota = who->admin ? config::TenantQuota{} : quota;
    proto::Welcome w;
    w.client_id = id;
    w.ring_entries = c->geometry.entries;
    w.ring_bytes = c->bytes;
    w.arena_bytes = c->geometry.arena_bytes;
    w.spin_us = static_cast<uint32_t>(kSpin.count());
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, e] : d.regions)
        if (visible(*who, e)) w.regions.push_back(e.region->desc());
    }
    const int fds3[3] = {c->ring_fd.get(), c->sq_efd.get(), c->cq_efd.get()};
    {
      std::lock_guard<std::mutex> g(d.mu);
      channel = c;
      name = m->client_name;
      claimed = want;
      ident = *who;
      hello = true;
    }
    d.rings.add(channel);
    spdlog::info("client {} '{}' connected ({}), tenant '{}'{}", id, name, creds_text(creds), ident.tenant,
                 ident.admin ? " (admin)" : "");
    if (Status st = send(proto::encode(w), fds3); !st.ok()) {
      close();  // no Welcome could go out: the client cannot use the session
      return Status::Ok();
    }
    return Status::Ok();
  }

  static bool visible(const Identity& who, const RegionEntry& e) {
    return who.admin || e.owner.empty() || e.owner == who.owner;
  }

  Status denied_region(uint32_t rid, const std::string& rname) const {
    return {ErrorCode::kPermissionDenied, "region " + std::to_string(rid) + " '" + rname +
                                              "' belongs to another tenant than '" + ident.owner + "' (" +
                                              creds_text(creds) + ")"};
  }

  Status send_region(const std::shared_ptr<Region>& r) {
    proto::RegionHandle h;
    h.region = r->desc();
    h.has_ipc_handle = r->ipc_handle(h.ipc_handle);
    const int fd = r->export_fd();
    if (fd >= 0) {
      const int one[1] = {fd};
      return send(proto::encode(h), one);
    }
    return send(proto::encode(h));
  }

  /// Holds region `rid` for this session and sends its handle; the hold is undone when the
  /// handle cannot be queued.
  Status hold_and_send(uint32_t rid, const std::shared_ptr<Region>& r) {
    bool fresh = false;
    {
      std::lock_guard<std::mutex> g(d.mu);
      auto it = d.regions.find(rid);
      if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(rid)};
      fresh = held.insert(rid).second;
      if (fresh) ++it->second.holders;
    }
    Status st = send_region(r);
    if (!st.ok() && fresh) {
      std::lock_guard<std::mutex> g(d.mu);
      held.erase(rid);
      if (auto it = d.regions.find(rid); it != d.regions.end()) --it->second.holders;
    }
    return st;
  }

  Status map_region(uint32_t rid) {
    std::shared_ptr<Region> r;
    {
      std::lock_guard<std::mutex> g(d.mu);
      auto it = d.regions.find(rid);
      if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(rid)};
      if (!visible(ident, it->second)) return denied_region(rid, it->second.region->desc().name);
      r = it->second.region;
    }
    if (r->offset() != 0)
      return {ErrorCode::kUnsupported, "region '" + r->desc().name + "' was registered at offset " +
                                           std::to_string(r->offset()) +
                                           " inside its buffer; only the client that registered it maps it"};
    return hold_and_send(rid, r);
  }

  /// Regions and their bytes this session's owner may still add (admins: no quota).
  Status check_region_quota(uint64_t bytes, const std::string& rname) const {
    if (ident.admin) return Status::Ok();
    const config::TenantQuota q = d.quota_for(ident);
    uint64_t n = 0, used = 0;
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [_, e] : d.regions) {
        if (e.from_config || e.owner != ident.owner) continue;
        ++n;
        used += e.region->desc().bytes;
      }
    }
    if (q.regions > 0 && n + 1 > q.regions)
      return {ErrorCode::kResourceExhausted, "region '" + rname + "': tenant '" + ident.owner + "' has its quota of " +
                                                 std::to_string(q.regions) +
                                                 " regions (quota.regions, default limits.tenant.regions)"};
    if (q.region_bytes > 0 && (bytes > q.region_bytes || used > q.region_bytes - bytes))
      return {ErrorCode::kResourceExhausted,
              "region '" + rname + "': " + std::to_string(bytes) + " bytes over tenant '" + ident.owner +
                  "''s quota of " + std::to_string(q.region_bytes) + " region bytes (" + std::to_string(used) +
                  " in use; quota.region_bytes, default limits.tenant.region_bytes)"};
    return Status::Ok();
  }

  Status create_region(const proto::CreateRegion& m) {
    {
      std::shared_ptr<Region> r;
      uint32_t rid = 0;
      {
        std::lock_guard<std::mutex> g(d.mu);
        for (auto& [id2, e] : d.regions) {
          if (e.region->desc().name != m.name) continue;
          if (!visible(ident, e)) return denied_region(id2, m.name);
          const auto& s = e.region->desc().spec;
          if (s.layers != m.spec.layers || s.blocks != m.spec.blocks || s.block_size != m.spec.block_size ||
              s.format != m.spec.format || s.layout != m.spec.layout)
            return {ErrorCode::kAlreadyExists, "region '" + m.name + "' exists with another spec"};
          r = e.region;
          rid = id2;
          break;
        }
      }
      if (r) return hold_and_send(rid, r);
    }
    if (m.spec.validate().ok()) KVFERRY_TRY(check_region_quota(static_cast<uint64_t>(m.spec.region_bytes()), m.name));
    auto r = d.add_region(m.name, m.spec, false, ident.owner);
    if (!r.ok()) return r.status();
    const uint32_t rid = (*r)->desc().id;
    Status st = hold_and_send(rid, *r);
    if (!st.ok()) {
      std::lock_guard<std::mutex> g(d.mu);
      if (auto it = d.regions.find(rid); it != d.regions.end() && it->second.holders == 0) d.regions.erase(it);
    }
    return st;
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
    uint64_t bytes = m.alloc_bytes;
    if (m.spec.validate().ok()) bytes = std::max(bytes, static_cast<uint64_t>(m.spec.region_bytes()));
    KVFERRY_TRY(check_region_quota(bytes, m.name));
    uint32_t rid;
    {
      std::lock_guard<std::mutex> g(d.mu);
      rid = d.next_region++;
    }
    auto r = import_region(rid, m, want ? std::move(fds[0]) : UniqueFd());
    if (!r.ok()) return r.status();
    proto::RegionHandle h;  // no fd back: the client has its buffer
    h.region = (*r)->desc();
    {
      std::lock_guard<std::mutex> g(d.mu);
      d.regions[rid] = Impl::RegionEntry{*r, false, 1, ident.owner};
      held.insert(rid);
    }
    spdlog::info("client {} registered region {} '{}' for '{}': {} bytes on {}", id, rid, m.name, ident.owner,
                 (*r)->desc().bytes, proto::backend_name(m.backend));
    return send(proto::encode(h));
  }

  Status debug_read(const proto::DebugRead& m) {
    if (!d.cfg.daemon.debug_read)
      return {ErrorCode::kUnsupported, "DebugRead is off on this daemon (daemon.debug_read: false)"};
    std::shared_ptr<Region> r;
    {
      std::lock_guard<std::mutex> g(d.mu);
      auto it = d.regions.find(m.region_id);
      if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(m.region_id)};
      if (!visible(ident, it->second)) return denied_region(m.region_id, it->second.region->desc().name);
      r = it->second.region;
    }
    std::vector<uint8_t> buf(m.bytes);
    KVFERRY_TRY(r->read(m.offset, buf));
    return send(proto::encode_debug_read_reply(buf));
  }
};

std::vector<std::shared_ptr<Daemon::Impl::Session>> Daemon::Impl::all_sessions() const {
  std::vector<std::shared_ptr<Session>> all;
  std::lock_guard<std::mutex> g(mu);
  all.reserve(sessions.size());
  for (auto& [_, s] : sessions) all.push_back(s);
  return all;
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
                                                         bool from_config, const std::string& owner) {
  uint32_t id;
  {
    std::lock_guard<std::mutex> g(mu);
    id = next_region++;
  }
  auto r = create_region(id, name, spec, backend, cfg.device.gpu);
  if (!r.ok()) return r.status();
  std::lock_guard<std::mutex> g(mu);
  regions[id] = RegionEntry{*r, from_config, 0, owner};
  spdlog::info("region {} '{}': {} x {} blocks x {} tokens of {}, {} bytes on {}, {}", id, name, spec.layers,
               spec.blocks, spec.block_size, spec.format.name(), (*r)->desc().bytes,
               proto::backend_name((*r)->desc().backend), owner.empty() ? "shared" : "owned by '" + owner + "'");
  return r;
}

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
  if (!allowed(sess->creds))
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
    if (!allowed(s->creds)) {
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
    // A data op reaches a region only as map_region would: its owner's, a shared one, or any
    // for an admin. Another tenant's region is as absent as one that does not exist.
    o.find_region = [d](const ClientChannel& c, uint32_t id) -> std::shared_ptr<Region> {
      std::lock_guard<std::mutex> g(d->mu);
      auto it = d->regions.find(id);
      if (it == d->regions.end()) return nullptr;
      const bool reach = c.admin || it->second.owner.empty() || it->second.owner == c.owner;
      return reach ? it->second.region : nullptr;
    };
    // A peer's send lands in a region only as a client of the blocks' tenant would reach it.
    o.find_region_for_tenant = [d](const std::string& tenant, uint32_t id) -> std::shared_ptr<Region> {
      // The owner a client of `tenant` has (identify): the tenant itself, "uid:N" for a
      // per-uid tenant ("uid:N/claimed" included), the admins' owner for the empty one.
      std::string owner = tenant.empty() ? kAdminOwner : tenant;
      if (owner.rfind("uid:", 0) == 0) owner = owner.substr(0, owner.find('/'));
      std::lock_guard<std::mutex> g(d->mu);
      auto it = d->regions.find(id);
      if (it == d->regions.end()) return nullptr;
      const bool reach = it->second.owner.empty() || it->second.owner == owner;
      return reach ? it->second.region : nullptr;
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
