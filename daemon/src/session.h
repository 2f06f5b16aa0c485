#pragma once
// Daemon::Impl::Session: one control-socket connection, from accept to close: its framing and
// output queue, the Hello handshake and the requests it carries.
#include "daemon_impl.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kvferry/connector/protocol.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry::daemon {

/// A session's output queue holds at most this many frames or bytes; past either, the session's
/// requests are not read until the client reads its replies (limits.send_timeout then applies).
constexpr size_t kMaxQueuedFrames = 64;
constexpr size_t kMaxQueuedBytes = 8u << 20;

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
  /// An import session of a peer daemon on this host (its Hello carried a granted token): the one
  /// region it may map; 0 for every other session.
  uint32_t peer_region = 0;

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
  Status send(proto::Frame f, std::span<const int> borrowed = {});
  void send_error(const Status& st) { (void)send(proto::encode(proto::ErrorMsg{st.code(), st.message()})); }

  /// Writes what the socket takes now; the rest waits for it to become writable. A frame's fds
  /// go with its first byte (as proto::send_frame sends them); a partial write keeps the rest.
  void flush();
  void arm_write();
  void close();

  /// Sends `st` and closes once it is written (or limits.send_timeout passes); reads stop now.
  void finish(const Status& st);

  /// Waits for the socket to become readable, unless the output queue is full (then the client
  /// must read its replies first; flush() resumes reading).
  void arm_read();

  /// Reads what has arrived of the current frame. The header is read with recvmsg so that
  /// descriptors sent with a frame's first byte (SCM_RIGHTS) are kept; the payload follows in
  /// pieces of at most kReadChunk, never past its length (the next frame's first byte may carry
  /// descriptors), the buffer growing only by what arrived.
  void on_readable();

  /// A malformed message: tell the client why and disconnect it; the daemon serves on.
  void fail(const Status& st);
  void dispatch();
  Status handle();

  /// A Hello that may not proceed: the client hears why, then the connection closes.
  Status refuse(const Status& st);
  Status on_hello(uint32_t fm);

  // The region requests (MapRegion, CreateRegion, RegisterRegion, DebugRead) and their checks
  // (region_registry.cpp).
  static bool visible(const Identity& who, const RegionEntry& e);
  Status denied_region(uint32_t rid, const std::string& rname) const;
  Status send_region(const std::shared_ptr<Region>& r);

  /// Holds region `rid` for this session and sends its handle; the hold is undone when the
  /// handle cannot be queued.
  Status hold_and_send(uint32_t rid, const std::shared_ptr<Region>& r);
  Status map_region(uint32_t rid);

  /// Regions and their bytes this session's owner may still add (admins: no quota).
  Status check_region_quota(uint64_t bytes, const std::string& rname) const;
  Status create_region(const proto::CreateRegion& m);
  Status register_region(const proto::RegisterRegion& m);
  Status debug_read(const proto::DebugRead& m);
};

}  // namespace kvferry::daemon
