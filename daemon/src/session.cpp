// The session's code (session.h): non-blocking framing on the control socket, the Hello handshake,
// the session table's side of its life. The region requests it carries are in region_registry.cpp.
#include "session.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvferry::daemon {

namespace {

/// Longest tenant a Hello may claim.
constexpr size_t kMaxClaimedTenant = 128;

}  // namespace

Status Daemon::Impl::Session::send(proto::Frame f, std::span<const int> borrowed) {
  if (closed) return Status::Ok();
  Out o;
  for (int b : borrowed) {
    const int c = ::fcntl(b, F_DUPFD_CLOEXEC, 0);
    if (c < 0)
      return {ErrorCode::kResourceExhausted, std::string("duplicating a descriptor to send: ") + std::strerror(errno)};
    o.fds.emplace_back(c);
  }
  o.bytes = std::move(f);
  o.queued = Clock::now();
  out_bytes += o.bytes.size();
  outq.push_back(std::move(o));
  flush();
  return Status::Ok();
}

void Daemon::Impl::Session::flush() {
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

void Daemon::Impl::Session::arm_write() {
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

void Daemon::Impl::Session::close() {
  if (closed) return;
  closed = true;
  boost::system::error_code ec;
  sock.close(ec);  // pending waits complete with operation_aborted
  outq.clear();
  out_bytes = 0;
  d.release(*this);
}

void Daemon::Impl::Session::finish(const Status& st) {
  draining = true;
  send_error(st);
  if (!closed && outq.empty()) close();
}

void Daemon::Impl::Session::arm_read() {
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

void Daemon::Impl::Session::on_readable() {
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

void Daemon::Impl::Session::fail(const Status& st) {
  spdlog::warn("client {} ({}): {}; disconnecting it", id, creds_text(creds), st.to_string());
  finish(st);
}

void Daemon::Impl::Session::dispatch() {
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

Status Daemon::Impl::Session::handle() {
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
      return {ErrorCode::kProtocol, "message type " + std::to_string(header.type) + " is not something a client sends"};
  }
}

Status Daemon::Impl::Session::refuse(const Status& st) {
  spdlog::info("client {} ({}): Hello refused: {}", id, creds_text(creds), st.to_string());
  finish(st);
  return Status::Ok();
}

Status Daemon::Impl::Session::on_hello(uint32_t fm) {
  if (hello) return {ErrorCode::kProtocol, "a second Hello"};
  auto m = proto::decode_hello(payload, fm);
  if (!m.ok()) return m.status();
  const std::string want = m->has_namespace ? m->tenant : std::string();
  if (want.size() > kMaxClaimedTenant)
    return refuse({ErrorCode::kInvalidArgument,
                   "the Hello's tenant is longer than " + std::to_string(kMaxClaimedTenant) + " bytes"});
  uint32_t peer = 0;
  Result<Identity> who = Status(ErrorCode::kInternal, "no identity");
  if (!m->peer_token.empty()) {
    who = d.take_grant(m->peer_token, id, &peer);  // a peer daemon importing one region
  } else if (!d.allowed(creds)) {                  // admitted at accept only as this daemon's own uid
    return refuse({ErrorCode::kPermissionDenied,
                   creds_text(creds) + " is not allowed to connect (see daemon.allowed_uids and daemon.allowed_gids)"});
  } else {
    who = d.identify(creds, want);
  }
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
  if (!who->admin && !peer && quota.clients > 0 && same >= quota.clients)
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
    peer_region = peer;
    hello = true;
  }
  d.rings.add(channel);
  if (peer)
    spdlog::info("client {} '{}' connected ({}): a peer daemon importing region {} of tenant '{}'", id, name,
                 creds_text(creds), peer, ident.tenant);
  else
    spdlog::info("client {} '{}' connected ({}), tenant '{}'{}", id, name, creds_text(creds), ident.tenant,
                 ident.admin ? " (admin)" : "");
  if (Status st = send(proto::encode(w), fds3); !st.ok()) {
    close();  // no Welcome could go out: the client cannot use the session
    return Status::Ok();
  }
  return Status::Ok();
}

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
  drop_grants_locked(s.id);
  if (s.hello) spdlog::info("client {} '{}' disconnected", s.id, s.name);
  sessions.erase(s.id);
}

}  // namespace kvferry::daemon
