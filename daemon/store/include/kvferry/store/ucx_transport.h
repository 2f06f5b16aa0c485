#pragma once
// UcxTransport: the remote tier's wire (DESIGN.md §4, issue 38). One UCX context and worker per
// daemon, driven by one progress thread (the worker's event fd, armed, with a bounded epoll wait)
// that keeps running while the daemon only serves: over UCX's TCP transport a one-sided get
// completes only when the target's worker progresses. The host pool is registered once; its packed
// rkey goes to a peer in the connect handshake, after both sides proved the shared secret (an
// HMAC-SHA256 over both nonces and what they send). Blocks move as one-sided gets (or puts) of
// whole byte runs between the two pools, one flush per batch; small control traffic (lookup,
// reserve, commit, notify) travels as active messages (remote_wire.h).
//
// Every operation has a deadline. A peer whose endpoint fails (its process died, the link broke)
// gives each affected block kUnavailable "peer lost: ..." at once; an operation past its deadline
// gives kTimeout and drops that peer's endpoint, so no call ever hangs. A call returns only when UCX
// will no longer touch the local bytes it named.
//
// All UCX calls happen on the progress thread; the public functions are thread-safe and block the
// calling thread until their work is done (or its deadline passed). Built with KVFERRY_WITH_UCX.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/layouts/status.h"

namespace kvferry::store {

/// One byte run to move between this daemon's registered pool and a peer's.
struct RemoteCopy {
  uint64_t local_offset = 0;   ///< into this transport's pool
  uint64_t remote_offset = 0;  ///< into the peer's pool
  uint64_t bytes = 0;
};

/// A connection to a peer daemon, as the transport numbers it (never reused).
using PeerId = uint64_t;

struct PeerInfo {
  PeerId id = 0;
  std::string name;          ///< the peer's member id (from its authenticated hello)
  uint64_t incarnation = 0;  ///< the peer's, from the hello
  uint64_t pool_bytes = 0;   ///< size of the peer's registered pool
  bool alive = false;        ///< false once its endpoint failed or was closed
  std::string reason;        ///< why it is no longer alive
  bool inbound = false;      ///< it connected to us
};

struct UcxCounters {
  uint64_t handshakes_refused = 0;  ///< peers that failed to prove the secret (or refused ours)
  uint64_t handshakes_timed_out = 0;
  uint64_t bad_messages = 0;  ///< malformed or unexpected control messages (dropped)
  uint64_t peers_lost = 0;
  uint64_t bytes_got = 0;
  uint64_t bytes_put = 0;
  uint64_t requests_served = 0;
};

class UcxTransport {
 public:
  /// Serves a control request from an authenticated peer: (peer, op, body) → reply body or an error
  /// that travels back to the caller. Runs on the progress thread: keep it short, never block.
  using RequestHandler =
      std::function<Result<std::vector<uint8_t>>(const PeerInfo& peer, uint16_t op, std::span<const uint8_t> body)>;

  struct Options {
    std::string name;          ///< this daemon's member id (told to peers)
    uint64_t incarnation = 0;  ///< told to peers
    bool listen = true;
    std::string listen_host = "127.0.0.1";  ///< without a secret only a loopback address is allowed
    uint16_t listen_port = 0;               ///< 0: any free port (see listen_port())
    std::string tls = "tcp";                ///< UCX_TLS for this context: "tcp", "posix,cma,self", ...
    std::string secret;                     ///< the shared key's bytes (tiers.remote.secret_file); "" = none
    void* pool = nullptr;                   ///< the pinned host pool, registered once; owned by the caller
    uint64_t pool_bytes = 0;
    std::chrono::milliseconds connect_timeout{1000};    ///< connect + handshake, client side
    std::chrono::milliseconds handshake_timeout{2000};  ///< an inbound connection not authenticated by then is dropped
    std::chrono::milliseconds op_timeout{5000};         ///< default deadline of get/put/call
    std::chrono::milliseconds keepalive{1000};          ///< UCX keepalive (below the membership TTL)
    /// After the last sign of activity the progress thread keeps polling this long before it arms
    /// the worker and sleeps: waking a sleeping vCPU costs ≈ 50 µs on the VMs measured, more than a
    /// 64 KiB block takes on the wire, so a serving peer that slept between requests would halve
    /// its throughput. 0: sleep as soon as idle.
    std::chrono::microseconds spin{200};
    RequestHandler on_request;                    ///< "" ops are refused with kUnsupported when empty
    std::function<void(const std::string&)> log;  ///< warnings (refused peers, lost peers); stderr when empty
  };

  /// Creates the context, worker, listener and pool registration and starts the progress thread.
  static Result<std::unique_ptr<UcxTransport>> create(Options opts);
  /// Closes every endpoint (outstanding operations complete with kCancelled) and stops the thread.
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;
  UcxTransport(UcxTransport&&) = delete;
  UcxTransport& operator=(UcxTransport&&) = delete;

  /// The listener's port (0 when not listening).
  uint16_t listen_port() const;
  /// This worker's address, for peers on the same host that connect with connect_worker() (shared
  /// memory transports are only used by endpoints made from a worker address).
  const std::vector<uint8_t>& worker_address() const;

  /// Connects to a peer's listener and runs the authenticated handshake. kUnavailable when nothing
  /// answers (a refused connection fails within connect_timeout), kPermissionDenied when either side
  /// cannot prove the secret, kTimeout past connect_timeout.
  Result<PeerId> connect(const std::string& host, uint16_t port);
  /// The same from a peer's worker address (same host: shared memory where UCX_TLS allows it).
  Result<PeerId> connect_worker(std::span<const uint8_t> worker_address);
  /// Closes the endpoint (idempotent); operations still outstanding on it end with kCancelled.
  void disconnect(PeerId peer);

  /// One-sided reads of peer pool → local pool, one status per copy (in order), one flush for the
  /// batch. `timeout` 0 means op_timeout. Returns when every copy is done or failed.
  std::vector<Status> get(PeerId peer, std::span<const RemoteCopy> copies, std::chrono::milliseconds timeout = {});
  /// One-sided writes of local pool → peer pool, the same way.
  std::vector<Status> put(PeerId peer, std::span<const RemoteCopy> copies, std::chrono::milliseconds timeout = {});
  /// A control request (wire::RemoteOp) answered by the peer's RequestHandler.
  Result<std::vector<uint8_t>> call(PeerId peer, uint16_t op, std::span<const uint8_t> body,
                                    std::chrono::milliseconds timeout = {});

  std::optional<PeerInfo> peer(PeerId id) const;
  std::vector<PeerInfo> peers() const;
  UcxCounters counters() const;

  struct Impl;

 private:
  explicit UcxTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// HMAC-SHA256 of `data` under `key` (OpenSSL's libcrypto): the handshake's MAC, exposed for tests.
std::vector<uint8_t> hmac_sha256(std::string_view key, std::span<const uint8_t> data);

}  // namespace kvferry::store
