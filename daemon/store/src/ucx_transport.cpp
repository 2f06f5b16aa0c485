#include "kvferry/store/ucx_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <future>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "kvferry/store/remote_wire.h"

namespace kvferry::store {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using wire::MsgType;

constexpr unsigned kAmId = 0x4b;  // the one active-message id of the control channel
constexpr size_t kNonceBytes = 16;
constexpr size_t kMaxPendingHandshakes = 64;

// ---- the one place where ucs_status_t becomes a Status ----

bool is_peer_failure(ucs_status_t s) {
  return s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_UNREACHABLE ||
         s == UCS_ERR_REJECTED || s == UCS_ERR_NOT_CONNECTED || s == UCS_ERR_IO_ERROR ||
         s == UCS_ERR_SOME_CONNECTS_FAILED;
}

Status ucx_status(ucs_status_t s, const char* call, const char* file, int line) {
  if (s == UCS_OK || s == UCS_INPROGRESS) return Status::Ok();
  const char* base = std::strrchr(file, '/');
  std::string m = std::string(call) + ": " + ucs_status_string(s) + " (" + (base ? base + 1 : file) + ":" +
                  std::to_string(line) + ")";
  if (is_peer_failure(s)) return Status(ErrorCode::kUnavailable, "peer lost: " + m);
  switch (s) {
    case UCS_ERR_TIMED_OUT: return Status(ErrorCode::kTimeout, m);
    case UCS_ERR_CANCELED: return Status(ErrorCode::kCancelled, m);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE: return Status(ErrorCode::kResourceExhausted, m);
    case UCS_ERR_INVALID_PARAM: return Status(ErrorCode::kInvalidArgument, m);
    case UCS_ERR_UNSUPPORTED: return Status(ErrorCode::kUnsupported, m);
    default: return Status(ErrorCode::kUcx, m);
  }
}

#define KVFERRY_UCX_STATUS(s, call) ::kvferry::store::ucx_status((s), call, __FILE__, __LINE__)
#define KVFERRY_UCX_TRY(expr) KVFERRY_TRY(KVFERRY_UCX_STATUS((expr), #expr))

// ---- one owner type per UCX handle ----

class UcpContext {
 public:
  UcpContext() = default;
  explicit UcpContext(ucp_context_h h) : h_(h) {}
  ~UcpContext() { reset(); }
  void reset(ucp_context_h h = nullptr) {
    if (h_) ucp_cleanup(h_);
    h_ = h;
  }
  UcpContext(const UcpContext&) = delete;
  UcpContext& operator=(const UcpContext&) = delete;
  ucp_context_h get() const { return h_; }

 private:
  ucp_context_h h_ = nullptr;
};

class UcpWorker {
 public:
  UcpWorker() = default;
  explicit UcpWorker(ucp_worker_h h) : h_(h) {}
  ~UcpWorker() { reset(); }
  void reset(ucp_worker_h h = nullptr) {
    if (h_) ucp_worker_destroy(h_);
    h_ = h;
  }
  UcpWorker(const UcpWorker&) = delete;
  UcpWorker& operator=(const UcpWorker&) = delete;
  ucp_worker_h get() const { return h_; }

 private:
  ucp_worker_h h_ = nullptr;
};

class UcpMem {
 public:
  UcpMem() = default;
  UcpMem(ucp_context_h ctx, ucp_mem_h h) : ctx_(ctx), h_(h) {}
  ~UcpMem() { reset(); }
  void reset(ucp_context_h ctx = nullptr, ucp_mem_h h = nullptr) {
    if (h_) ucp_mem_unmap(ctx_, h_);
    ctx_ = ctx;
    h_ = h;
  }
  UcpMem(const UcpMem&) = delete;
  UcpMem& operator=(const UcpMem&) = delete;
  ucp_mem_h get() const { return h_; }

 private:
  ucp_context_h ctx_ = nullptr;
  ucp_mem_h h_ = nullptr;
};

class UcpRkey {
 public:
  UcpRkey() = default;
  ~UcpRkey() { reset(); }
  UcpRkey(const UcpRkey&) = delete;
  UcpRkey& operator=(const UcpRkey&) = delete;
  /// Must run after the operations using it completed and before its endpoint is destroyed.
  void reset(ucp_rkey_h h = nullptr) {
    if (h_) ucp_rkey_destroy(h_);
    h_ = h;
  }
  ucp_rkey_h get() const { return h_; }

 private:
  ucp_rkey_h h_ = nullptr;
};

class UcpListener {
 public:
  UcpListener() = default;
  ~UcpListener() { reset(); }
  UcpListener(const UcpListener&) = delete;
  UcpListener& operator=(const UcpListener&) = delete;
  void reset(ucp_listener_h h = nullptr) {
    if (h_) ucp_listener_destroy(h_);
    h_ = h;
  }
  ucp_listener_h get() const { return h_; }

 private:
  ucp_listener_h h_ = nullptr;
};

/// An endpoint; closing needs the worker's progress, so close() takes the worker and waits
/// (bounded) for the forced close to finish. The rkey unpacked on it is destroyed in between.
class UcpEndpoint {
 public:
  UcpEndpoint() = default;
  ~UcpEndpoint() = default;  // closed explicitly by the progress thread (close()) before it goes
  UcpEndpoint(const UcpEndpoint&) = delete;
  UcpEndpoint& operator=(const UcpEndpoint&) = delete;
  void adopt(ucp_ep_h h) { h_ = h; }
  ucp_ep_h get() const { return h_; }

  void close(ucp_worker_h worker, UcpRkey& rkey) {
    if (!h_) {
      rkey.reset();
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;  // completes outstanding operations with an error at once
    void* req = ucp_ep_close_nbx(h_, &p);
    rkey.reset();
    if (UCS_PTR_IS_PTR(req)) {
      const auto end = Clock::now() + milliseconds(2000);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < end) ucp_worker_progress(worker);
      ucp_request_free(req);
    }
    h_ = nullptr;
  }

 private:
  ucp_ep_h h_ = nullptr;
};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

std::span<const uint8_t> as_bytes(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

bool is_loopback(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  return ::inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

Result<sockaddr_storage> resolve(const std::string& host, uint16_t port, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string p = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), p.c_str(), &hints, &res);
  if (rc != 0 || !res) return Status(ErrorCode::kInvalidArgument, "cannot resolve '" + host + "': " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

std::vector<uint8_t> hmac_sha256(std::string_view key, std::span<const uint8_t> data) {
  static const unsigned char kEmpty = 0;
  std::vector<uint8_t> out(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.empty() ? static_cast<const void*>(&kEmpty) : key.data(), int(key.size()),
       data.empty() ? &kEmpty : data.data(), data.size(), out.data(), &len);
  out.resize(len);
  return out;
}

// ---- the transport ----

struct UcxTransport::Impl {
  enum class State : uint8_t { kConnecting, kChallenged, kAuthSent, kReady, kClosing, kClosed };

  /// One connection. Its address goes to UCX as the endpoint's error-handler argument, so it never
  /// moves; it is destroyed only after its endpoint is closed.
  struct Peer {
    PeerId id = 0;
    Impl* impl = nullptr;
    UcpEndpoint ep;
    UcpRkey rkey;
    State state = State::kConnecting;
    bool inbound = false;
    std::string where;  ///< address for logs
    std::array<uint8_t, kNonceBytes> nonce_c{};
    std::array<uint8_t, kNonceBytes> nonce_s{};
    wire::PeerHello remote;
    Clock::time_point deadline{};  ///< of the handshake (or of a delayed close)
    std::optional<std::promise<Result<PeerId>>> connected;
    std::string reason;
    bool in_handshake = true;  ///< counted in pending_handshakes
    /// False for an endpoint UCX made for a peer that connected to our worker address (the
    /// reply endpoint of its hello): UCX destroys it when the peer goes, and may hand the same
    /// handle to the next such peer, so we never close it and a new hello on it starts afresh.
    bool owned = true;
    Peer() = default;
    Peer(const Peer&) = delete;
    Peer& operator=(const Peer&) = delete;
  };

  struct Batch;
  struct Op {
    Batch* batch = nullptr;
    size_t index = 0;
  };
  /// One get/put batch. Its ops' addresses go to UCX as request user data: never moves.
  struct Batch {
    Impl* impl = nullptr;
    PeerId peer = 0;
    bool put = false;
    std::vector<RemoteCopy> copies;
    std::vector<Status> statuses;
    std::vector<Op> ops;
    size_t outstanding = 0;
    Clock::time_point deadline{};
    milliseconds timeout{};
    bool timed_out = false;
    std::string lost;  ///< set when the peer was lost while the batch ran
    bool finished = false;
    std::promise<std::vector<Status>> done;
    Batch() = default;
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
  };

  struct Call {
    PeerId peer = 0;
    Clock::time_point deadline{};
    std::promise<Result<std::vector<uint8_t>>> done;
  };

  struct Deferred {
    enum Kind : uint8_t { kMessage, kConnRequest, kEpError } kind = kMessage;
    ucp_ep_h ep = nullptr;
    std::vector<uint8_t> data;
    ucp_conn_request_h conn = nullptr;
    PeerId peer = 0;
    ucs_status_t status = UCS_OK;
  };

  Options opts;
  // Declared in the order they are built; destroyed in reverse (peers first, context last).
  UcpContext context;
  UcpWorker worker;
  UcpMem mem;
  UcpListener listener;
  Fd epoll_fd;
  Fd wake_fd;
  int worker_fd = -1;
  std::vector<uint8_t> worker_addr;
  std::vector<uint8_t> packed_rkey;
  uint16_t port = 0;

  // Progress thread only.
  std::map<PeerId, std::unique_ptr<Peer>> peers;
  std::unordered_map<ucp_ep_h, Peer*> by_ep;
  std::list<std::shared_ptr<Batch>> batches;
  std::map<uint64_t, Call> calls;
  std::deque<Deferred> deferred;
  uint64_t next_request = 1;
  size_t pending_handshakes = 0;

  // Shared with the API threads.
  std::mutex cmd_mu;
  std::vector<std::function<void()>> cmds;
  std::atomic<bool> stopping{false};
  std::atomic<PeerId> next_peer{1};
  mutable std::mutex info_mu;
  std::map<PeerId, PeerInfo> info;
  UcxCounters stats;  // under info_mu
  std::thread thread;

  void log(const std::string& line) const {
    if (opts.log)
      opts.log(line);
    else
      std::fprintf(stderr, "kvferry remote: %s\n", line.c_str());
  }

  template <class F>
  void count(F&& f) {
    std::lock_guard lk(info_mu);
    f(stats);
  }

  void publish(const Peer& p) {
    std::lock_guard lk(info_mu);
    PeerInfo& i = info[p.id];
    i.id = p.id;
    i.name = p.remote.name;
    i.incarnation = p.remote.incarnation;
    i.pool_bytes = p.remote.pool_bytes;
    i.alive = p.state == State::kReady;
    i.reason = p.reason;
    i.inbound = p.inbound;
  }

  // ---- set-up ----

  Status init() {
    // A daemon restarted on its port (after a crash, say) must be able to listen at once: the
    // accepted connections of the one before sit in TIME_WAIT on that port for a minute. UCX
    // reads its transports' options from the environment only; an operator's setting wins.
    ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
    // The TCP transport's own keepalive (read from the environment only) below the membership
    // TTL too: idle for the keepalive interval, then probes a quarter of that apart (UCX's
    // defaults, 10 s and 2 s, would notice a silent peer only after the lease had long expired).
    const int64_t ka_ms = std::max<int64_t>(1, opts.keepalive.count());
    ::setenv("UCX_TCP_KEEPIDLE", (std::to_string(ka_ms) + "ms").c_str(), 0);
    ::setenv("UCX_TCP_KEEPINTVL", (std::to_string(std::max<int64_t>(1, ka_ms / 4)) + "ms").c_str(), 0);
    ucp_config_t* cfg = nullptr;
    KVFERRY_UCX_TRY(ucp_config_read(nullptr, nullptr, &cfg));
    Status s = KVFERRY_UCX_STATUS(ucp_config_modify(cfg, "TLS", opts.tls.c_str()), "setting UCX_TLS");
    const std::string ka = std::to_string(std::max<int64_t>(1, opts.keepalive.count())) + "ms";
    // UCX's keepalive below the membership TTL, so a silent peer is noticed by UCX as well. (The
    // TCP transport's own TCP_KEEPIDLE/KEEPINTVL are read from the environment only, set above:
    // UCX 1.13 does not apply them through ucp_config_modify.)
    if (ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", ka.c_str()) != UCS_OK) log("UCX does not take KEEPALIVE_INTERVAL");
    if (s.ok()) {
      ucp_params_t p{};
      p.field_mask = UCP_PARAM_FIELD_FEATURES;
      p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
      ucp_context_h ctx = nullptr;
      s = KVFERRY_UCX_STATUS(ucp_init(&p, cfg, &ctx), "ucp_init");
      if (s.ok()) context.reset(ctx);
    }
    ucp_config_release(cfg);
    KVFERRY_TRY(s);

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    ucp_worker_h w = nullptr;
    KVFERRY_UCX_TRY(ucp_worker_create(context.get(), &wp, &w));
    worker.reset(w);
    KVFERRY_UCX_TRY(ucp_worker_get_efd(w, &worker_fd));
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    KVFERRY_UCX_TRY(ucp_worker_get_address(w, &addr, &addr_len));
    worker_addr.assign(reinterpret_cast<uint8_t*>(addr), reinterpret_cast<uint8_t*>(addr) + addr_len);
    ucp_worker_release_address(w, addr);

    if (opts.pool && opts.pool_bytes) {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = opts.pool;
      mp.length = opts.pool_bytes;
      ucp_mem_h mh = nullptr;
      KVFERRY_UCX_TRY(ucp_mem_map(context.get(), &mp, &mh));
      mem.reset(context.get(), mh);
      void* rb = nullptr;
      size_t rb_len = 0;
      KVFERRY_UCX_TRY(ucp_rkey_pack(context.get(), mh, &rb, &rb_len));
      packed_rkey.assign(static_cast<uint8_t*>(rb), static_cast<uint8_t*>(rb) + rb_len);
      ucp_rkey_buffer_release(rb);
    }

    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kAmId;
    hp.cb = &Impl::on_am;
    hp.arg = this;
    KVFERRY_UCX_TRY(ucp_worker_set_am_recv_handler(w, &hp));

    if (opts.listen) {
      socklen_t len = 0;
      KVFERRY_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(opts.listen_host, opts.listen_port, len));
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
      lp.sockaddr.addrlen = len;
      lp.conn_handler.cb = &Impl::on_conn_request;
      lp.conn_handler.arg = this;
      ucp_listener_h lh = nullptr;
      Status ls = KVFERRY_UCX_STATUS(ucp_listener_create(w, &lp, &lh), "ucp_listener_create");
      if (!ls.ok()) return ls.with_context("listening on " + opts.listen_host + ":" + std::to_string(opts.listen_port));
      listener.reset(lh);
      ucp_listener_attr_t la{};
      la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      KVFERRY_UCX_TRY(ucp_listener_query(lh, &la));
      port = ntohs(la.sockaddr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&la.sockaddr)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&la.sockaddr)->sin_port);
    }

    wake_fd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    epoll_fd.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (wake_fd.get() < 0 || epoll_fd.get() < 0) return Status(ErrorCode::kIo, "eventfd/epoll_create1 failed");
    for (int fd : {worker_fd, wake_fd.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
        return Status(ErrorCode::kIo, std::string("epoll_ctl: ") + std::strerror(errno));
    }
    thread = std::thread([this] { loop(); });
    return Status::Ok();
  }

  // ---- UCX callbacks: they only record what happened; the loop acts on it ----

  static ucs_status_t on_am(void* arg, const void*, size_t, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    const bool has_ep = param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || !has_ep || length > wire::kHeaderBytes + wire::kMaxBody) {
      self->count([](UcxCounters& c) { ++c.bad_messages; });
      return UCS_OK;  // dropped: control messages are small and eager, with a reply endpoint
    }
    Deferred d;
    d.kind = Deferred::kMessage;
    d.ep = param->reply_ep;
    d.data.assign(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + length);
    self->deferred.push_back(std::move(d));
    return UCS_OK;
  }

  static void on_conn_request(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    Deferred d;
    d.kind = Deferred::kConnRequest;
    d.conn = req;
    self->deferred.push_back(std::move(d));
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    Deferred d;
    d.kind = Deferred::kEpError;
    d.peer = p->id;
    d.status = status;
    p->impl->deferred.push_back(std::move(d));
  }

  static void on_rma_done(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->batch->impl->op_done(*op->batch, op->index, status);
    ucp_request_free(request);
  }

  static void on_flush_done(void* request, ucs_status_t, void* user_data) {
    auto* b = static_cast<Batch*>(user_data);
    ucp_request_free(request);
    b->impl->release(*b);
  }

  static void on_send_done(void* request, ucs_status_t, void* user_data) {
    delete static_cast<std::vector<uint8_t>*>(user_data);
    ucp_request_free(request);
  }

  // ---- batches ----

  Status op_failure(const Batch& b, ucs_status_t s) const {
    if (b.timed_out)
      return Status(ErrorCode::kTimeout, "no completion within " + std::to_string(b.timeout.count()) +
                                             " ms; the peer's endpoint was dropped");
    if (!b.lost.empty()) return Status(ErrorCode::kUnavailable, "peer lost: " + b.lost);
    return KVFERRY_UCX_STATUS(s, b.put ? "ucp_put_nbx" : "ucp_get_nbx");
  }

  void op_done(Batch& b, size_t i, ucs_status_t s) {
    b.statuses[i] = s == UCS_OK ? Status::Ok() : op_failure(b, s);
    release(b);
  }

  void release(Batch& b) {
    if (--b.outstanding == 0) finish(b);
  }

  void finish(Batch& b) {
    if (b.finished) return;
    b.finished = true;
    uint64_t bytes = 0;
    for (size_t i = 0; i < b.copies.size(); ++i)
      if (b.statuses[i].ok()) bytes += b.copies[i].bytes;
    count([&](UcxCounters& c) { (b.put ? c.bytes_put : c.bytes_got) += bytes; });
    b.done.set_value(b.statuses);
  }

  void start_batch(const std::shared_ptr<Batch>& bp) {
    Batch& b = *bp;
    auto it = peers.find(b.peer);
    Peer* p = it == peers.end() ? nullptr : it->second.get();
    if (!p || p->state != State::kReady) {
      Status s = unavailable(b.peer, p);
      for (auto& st : b.statuses)
        if (st.ok()) st = s;
      b.finished = true;
      b.done.set_value(b.statuses);
      return;
    }
    b.ops.resize(b.copies.size());
    b.outstanding = 1;  // held until every op is issued
    auto* base = static_cast<uint8_t*>(opts.pool);
    for (size_t i = 0; i < b.copies.size(); ++i) {
      const RemoteCopy& c = b.copies[i];
      if (!b.statuses[i].ok()) continue;  // rejected before it got here
      if (c.remote_offset > p->remote.pool_bytes || c.bytes > p->remote.pool_bytes - c.remote_offset) {
        b.statuses[i] = Status(ErrorCode::kOutOfRange, "remote run [" + std::to_string(c.remote_offset) + ", +" +
                                                           std::to_string(c.bytes) + ") is past the peer's pool");
        continue;
      }
      b.ops[i] = {&b, i};
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = &Impl::on_rma_done;
      rp.user_data = &b.ops[i];
      const uint64_t raddr = p->remote.pool_base + c.remote_offset;
      ucs_status_ptr_t r = b.put ? ucp_put_nbx(p->ep.get(), base + c.local_offset, c.bytes, raddr, p->rkey.get(), &rp)
                                 : ucp_get_nbx(p->ep.get(), base + c.local_offset, c.bytes, raddr, p->rkey.get(), &rp);
      if (UCS_PTR_IS_PTR(r))
        ++b.outstanding;
      else if (UCS_PTR_IS_ERR(r))
        b.statuses[i] = op_failure(b, UCS_PTR_STATUS(r));
    }
    batches.push_back(bp);
    // One flush for the batch: its completion says every op before it is complete at the target.
    ucp_request_param_t fp{};
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = &Impl::on_flush_done;
    fp.user_data = &b;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep.get(), &fp);
    if (UCS_PTR_IS_PTR(r)) ++b.outstanding;
    release(b);  // the hold taken above
  }

  Status unavailable(PeerId id, const Peer* p) {
    if (p && p->state != State::kReady && p->state != State::kClosed && p->state != State::kClosing)
      return Status(ErrorCode::kUnavailable, "peer " + std::to_string(id) + " is still connecting");
    std::lock_guard lk(info_mu);
    auto it = info.find(id);
    if (it == info.end()) return Status(ErrorCode::kNotFound, "no peer " + std::to_string(id));
    return Status(ErrorCode::kUnavailable, "peer lost: " + it->second.name + ": " + it->second.reason);
  }

  // ---- control messages ----

  void send(Peer& p, MsgType type, uint64_t request_id, const std::vector<uint8_t>& body) {
    if (!p.ep.get()) return;
    auto* buf = new std::vector<uint8_t>(wire::frame(type, request_id, body));
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    rp.cb.send = &Impl::on_send_done;
    rp.user_data = buf;
    ucs_status_ptr_t r = ucp_am_send_nbx(p.ep.get(), kAmId, nullptr, 0, buf->data(), buf->size(), &rp);
    if (!UCS_PTR_IS_PTR(r)) delete buf;  // sent (or failed) at once; a failure shows up on the endpoint
  }

  std::vector<uint8_t> mac(const char* label, const Peer& p, std::span<const uint8_t> extra) const {
    wire::Writer w;
    w.raw(as_bytes(label));
    w.raw(p.nonce_c);
    w.raw(p.nonce_s);
    w.raw(extra);
    return hmac_sha256(opts.secret, w.buffer());
  }

  static bool mac_equal(std::span<const uint8_t> a, const std::vector<uint8_t>& b) {
    return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
  }

  std::vector<uint8_t> my_hello() const {
    wire::PeerHello h;
    h.name = opts.name;
    h.incarnation = opts.incarnation;
    h.pool_base = reinterpret_cast<uint64_t>(opts.pool);
    h.pool_bytes = opts.pool ? opts.pool_bytes : 0;
    h.rkey = packed_rkey;
    wire::Writer w;
    h.encode(w);
    return std::move(w.buffer());
  }

  /// Refuses a peer: tells it why, logs, and closes its endpoint shortly after (so the refusal
  /// can leave first).
  void refuse(Peer& p, const std::string& why, bool tell) {
    log("refused peer " + p.where + (p.remote.name.empty() ? "" : " (" + p.remote.name + ")") + ": " + why);
    count([](UcxCounters& c) { ++c.handshakes_refused; });
    if (tell) {
      wire::Writer w;
      w.str(why);
      send(p, MsgType::kRefused, 0, w.buffer());
    }
    if (p.connected) {
      p.connected->set_value(Status(ErrorCode::kPermissionDenied, "peer " + p.where + ": " + why));
      p.connected.reset();
    }
    p.reason = why;
    leave_handshake(p);
    p.state = State::kClosing;
    p.deadline = Clock::now() + milliseconds(200);
    publish(p);
  }

  Status unpack_rkey(Peer& p) {
    if (p.remote.rkey.empty()) return Status::Ok();  // a peer without a pool (it only reads)
    ucp_rkey_h rk = nullptr;
    KVFERRY_UCX_TRY(ucp_ep_rkey_unpack(p.ep.get(), p.remote.rkey.data(), &rk));
    p.rkey.reset(rk);
    return Status::Ok();
  }

  void on_message(ucp_ep_h ep, std::span<const uint8_t> msg) {
    wire::Header h;
    std::span<const uint8_t> body;
    auto it = by_ep.find(ep);
    Peer* p = it == by_ep.end() ? nullptr : it->second;
    if (Status s = wire::parse_frame(msg, h, body); !s.ok()) {
      count([](UcxCounters& c) { ++c.bad_messages; });
      if (p && p->state != State::kReady) fail_peer(*p, "malformed handshake message: " + s.message());
      return;
    }
    if (p && !p->owned && h.type == MsgType::kHello) {
      fail_peer(*p, "its endpoint was reused by a new connection");
      p = nullptr;
    }
    if (!p) {
      if (h.type != MsgType::kHello) {
        count([](UcxCounters& c) { ++c.bad_messages; });
        return;
      }
      // A peer that connected to our worker address: UCX made this endpoint for it.
      p = add_peer(ep, true, "worker-address peer");
      if (!p) return;
      p->owned = false;
    }
    wire::Reader r(body);
    switch (h.type) {
      case MsgType::kHello: {
        auto nonce = r.bytes(kNonceBytes);
        if (!p->inbound || p->state != State::kConnecting || nonce.size() != kNonceBytes || !r.ok())
          return protocol_violation(*p, "unexpected hello");
        std::copy(nonce.begin(), nonce.end(), p->nonce_c.begin());
        RAND_bytes(p->nonce_s.data(), int(kNonceBytes));
        wire::Writer w;
        w.bytes(p->nonce_s);
        w.bytes(mac("kvferry-challenge", *p, {}));
        p->state = State::kChallenged;
        send(*p, MsgType::kChallenge, 0, w.buffer());
        return;
      }
      case MsgType::kChallenge: {
        auto nonce = r.bytes(kNonceBytes);
        auto m = r.bytes(64);
        if (p->inbound || p->state != State::kConnecting || nonce.size() != kNonceBytes || !r.ok())
          return protocol_violation(*p, "unexpected challenge");
        std::copy(nonce.begin(), nonce.end(), p->nonce_s.begin());
        if (!mac_equal(m, mac("kvferry-challenge", *p, {})))
          return refuse(*p, "the peer could not prove the shared secret", true);
        auto hello = my_hello();
        wire::Writer w;
        w.bytes(mac("kvferry-auth", *p, hello));
        w.bytes(hello);
        p->state = State::kAuthSent;
        send(*p, MsgType::kAuth, 0, w.buffer());
        return;
      }
      case MsgType::kAuth:
      case MsgType::kWelcome: {
        const bool auth = h.type == MsgType::kAuth;
        auto m = r.bytes(64);
        auto hello = r.bytes(64 * 1024);
        if (!r.ok() || p->inbound != auth || p->state != (auth ? State::kChallenged : State::kAuthSent))
          return protocol_violation(*p, auth ? "unexpected auth" : "unexpected welcome");
        if (!mac_equal(m, mac(auth ? "kvferry-auth" : "kvferry-welcome", *p, hello)))
          return refuse(*p, auth ? "wrong secret (handshake MAC mismatch)" : "welcome MAC mismatch", true);
        wire::Reader hr(hello);
        auto ph = wire::PeerHello::decode(hr);
        if (!ph.ok()) return protocol_violation(*p, ph.status().message());
        p->remote = std::move(*ph);
        if (Status s = unpack_rkey(*p); !s.ok()) return fail_peer(*p, s.to_string());
        p->state = State::kReady;
        leave_handshake(*p);
        publish(*p);
        if (auth) {
          auto mine = my_hello();
          wire::Writer w;
          w.bytes(mac("kvferry-welcome", *p, mine));
          w.bytes(mine);
          send(*p, MsgType::kWelcome, 0, w.buffer());
        } else if (p->connected) {
          p->connected->set_value(p->id);
          p->connected.reset();
        }
        return;
      }
      case MsgType::kRefused: {
        std::string why = r.str();
        return refuse(*p, "refused by the peer: " + why, false);
      }
      case MsgType::kRequest: {
        if (p->state != State::kReady) return protocol_violation(*p, "request before the handshake");
        uint16_t op = r.u16();
        if (!r.ok()) return protocol_violation(*p, "request without an op");
        auto payload = body.subspan(2);
        Result<std::vector<uint8_t>> res = Status(ErrorCode::kUnsupported, "this daemon serves no requests");
        if (opts.on_request) {
          PeerInfo pi;
          {
            std::lock_guard lk(info_mu);
            pi = info[p->id];
          }
          res = opts.on_request(pi, op, payload);
        }
        wire::Writer w;
        Status st = res.status();
        w.u16(uint16_t(st.code()));
        w.str(st.message());
        if (res.ok())
          w.bytes(*res);
        else
          w.bytes({});
        count([](UcxCounters& c) { ++c.requests_served; });
        send(*p, MsgType::kResponse, h.request_id, w.buffer());
        return;
      }
      case MsgType::kResponse: {
        auto c = calls.find(h.request_id);
        if (p->state != State::kReady || c == calls.end() || c->second.peer != p->id) {
          count([](UcxCounters& k) { ++k.bad_messages; });
          return;
        }
        auto code = ErrorCode(int16_t(r.u16()));
        std::string m = r.str(64 * 1024);
        auto out = r.bytes();
        if (Status s = r.finish("response"); !s.ok())
          c->second.done.set_value(s);
        else if (code != ErrorCode::kOk)
          c->second.done.set_value(Status(code, "peer " + p->remote.name + ": " + m));
        else
          c->second.done.set_value(std::vector<uint8_t>(out.begin(), out.end()));
        calls.erase(c);
        return;
      }
    }
    count([](UcxCounters& c) { ++c.bad_messages; });
  }

  void protocol_violation(Peer& p, const std::string& what) {
    count([](UcxCounters& c) { ++c.bad_messages; });
    fail_peer(p, "protocol violation: " + what);
  }

  // ---- peers ----

  void leave_handshake(Peer& p) {
    if (!p.in_handshake) return;
    p.in_handshake = false;
    --pending_handshakes;
  }

  Peer* add_peer(ucp_ep_h ep, bool inbound, std::string where) {
    if (inbound && pending_handshakes >= kMaxPendingHandshakes) {
      log("too many handshakes in progress; dropping a connection from " + where);
      return nullptr;
    }
    auto p = std::make_unique<Peer>();
    p->id = next_peer++;
    p->impl = this;
    p->inbound = inbound;
    p->where = std::move(where);
    p->deadline = Clock::now() + (inbound ? opts.handshake_timeout : opts.connect_timeout);
    if (ep) p->ep.adopt(ep);
    Peer* raw = p.get();
    if (ep) by_ep[ep] = raw;
    peers[raw->id] = std::move(p);
    ++pending_handshakes;
    publish(*raw);
    return raw;
  }

  ucp_ep_params_t ep_params(Peer* p) const {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::on_ep_error;
    ep.err_handler.arg = p;
    return ep;
  }

  void accept(ucp_conn_request_h req) {
    ucp_conn_request_attr_t ca{};
    ca.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    std::string where = "?";
    if (ucp_conn_request_query(req, &ca) == UCS_OK) where = sockaddr_text(ca.client_address);
    if (pending_handshakes >= kMaxPendingHandshakes) {
      log("too many handshakes in progress; rejecting " + where);
      ucp_listener_reject(listener.get(), req);
      return;
    }
    Peer* p = add_peer(nullptr, true, where);
    ucp_ep_params_t ep = ep_params(p);
    ep.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = req;
    ucp_ep_h h = nullptr;
    if (Status s = KVFERRY_UCX_STATUS(ucp_ep_create(worker.get(), &ep, &h), "ucp_ep_create"); !s.ok()) {
      log("accepting " + where + ": " + s.to_string());
      p->state = State::kClosed;
      p->reason = s.to_string();
      leave_handshake(*p);
      publish(*p);
      peers.erase(p->id);
      return;
    }
    p->ep.adopt(h);
    by_ep[h] = p;
  }

  void start_connect(Peer* p, const ucp_ep_params_t& base, std::promise<Result<PeerId>> done) {
    p->connected = std::move(done);
    ucp_ep_params_t ep = base;
    ucp_ep_params_t eh = ep_params(p);
    ep.field_mask |= eh.field_mask;
    ep.err_mode = eh.err_mode;
    ep.err_handler = eh.err_handler;
    ucp_ep_h h = nullptr;
    if (Status s = KVFERRY_UCX_STATUS(ucp_ep_create(worker.get(), &ep, &h), "ucp_ep_create"); !s.ok()) {
      return fail_peer(*p, s.to_string());
    }
    p->ep.adopt(h);
    by_ep[h] = p;
    RAND_bytes(p->nonce_c.data(), int(kNonceBytes));
    wire::Writer w;
    w.bytes(p->nonce_c);
    send(*p, MsgType::kHello, 0, w.buffer());
  }

  /// The peer is gone (its endpoint failed, a deadline passed, or it broke the protocol): every
  /// waiter on it gets an error now and its endpoint is closed (forced), which completes whatever
  /// UCX still had outstanding on it.
  void fail_peer(Peer& p, const std::string& why, ErrorCode code = ErrorCode::kUnavailable) {
    if (p.state == State::kClosed) return;
    const bool was_ready = p.state == State::kReady;
    leave_handshake(p);
    p.state = State::kClosed;
    p.reason = why;
    const std::string name = p.remote.name.empty() ? p.where : p.remote.name;
    if (was_ready) {
      count([](UcxCounters& c) { ++c.peers_lost; });
      log("peer " + name + " lost: " + why);
    }
    if (p.connected) {
      p.connected->set_value(Status(code == ErrorCode::kUnavailable ? ErrorCode::kUnavailable : code,
                                    "connecting to " + p.where + ": " + why));
      p.connected.reset();
    }
    publish(p);
    for (auto it = calls.begin(); it != calls.end();) {
      if (it->second.peer == p.id) {
        it->second.done.set_value(Status(ErrorCode::kUnavailable, "peer lost: " + name + ": " + why));
        it = calls.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& b : batches)
      if (b->peer == p.id && !b->finished && b->lost.empty()) b->lost = name + ": " + why;
    if (ucp_ep_h ep = p.ep.get()) {
      by_ep.erase(ep);
      if (p.owned)
        p.ep.close(worker.get(), p.rkey);
      else
        p.rkey.reset();
      // Messages that arrived on it but were not handled yet name a handle that is gone now.
      std::erase_if(deferred, [ep](const Deferred& d) { return d.kind == Deferred::kMessage && d.ep == ep; });
    }
    peers.erase(p.id);  // no callback refers to it once its endpoint is closed
  }

  // ---- the progress loop ----

  void run_deferred() {
    while (!deferred.empty()) {
      Deferred d = std::move(deferred.front());
      deferred.pop_front();
      switch (d.kind) {
        case Deferred::kMessage: on_message(d.ep, d.data); break;
        case Deferred::kConnRequest: accept(d.conn); break;
        case Deferred::kEpError: {
          auto it = peers.find(d.peer);
          if (it != peers.end()) fail_peer(*it->second, std::string("endpoint failed: ") + ucs_status_string(d.status));
          break;
        }
      }
    }
  }

  void run_commands() {
    std::vector<std::function<void()>> now;
    {
      std::lock_guard lk(cmd_mu);
      now.swap(cmds);
    }
    for (auto& f : now) f();
  }

  /// Handles passed deadlines; returns the time until the next one.
  milliseconds check_deadlines() {
    const auto now = Clock::now();
    auto next = now + milliseconds(100);
    for (auto it = batches.begin(); it != batches.end();) {
      Batch& b = **it;
      if (b.finished) {
        it = batches.erase(it);
        continue;
      }
      if (now >= b.deadline && !b.timed_out) {
        b.timed_out = true;
        auto p = peers.find(b.peer);
        if (p != peers.end())
          fail_peer(*p->second, "no completion within " + std::to_string(b.timeout.count()) + " ms",
                    ErrorCode::kTimeout);
      }
      next = std::min(next, b.deadline);
      ++it;
    }
    for (auto it = calls.begin(); it != calls.end();) {
      if (now >= it->second.deadline) {
        it->second.done.set_value(Status(ErrorCode::kTimeout, "no reply in time"));
        it = calls.erase(it);
      } else {
        next = std::min(next, it->second.deadline);
        ++it;
      }
    }
    std::vector<Peer*> late;
    for (auto& [id, p] : peers) {
      if (p->state == State::kReady) continue;
      if (now >= p->deadline)
        late.push_back(p.get());
      else
        next = std::min(next, p->deadline);
    }
    for (Peer* p : late) {
      if (p->state == State::kClosing) {
        fail_peer(*p, p->reason);
        continue;
      }
      count([](UcxCounters& c) { ++c.handshakes_timed_out; });
      if (p->inbound) log("connection from " + p->where + " did not finish its handshake in time; dropped");
      fail_peer(*p, "handshake not finished in time", ErrorCode::kTimeout);
    }
    return std::chrono::duration_cast<milliseconds>(std::max(next - now, Clock::duration::zero()));
  }

  bool busy() const {
    for (auto& b : batches)
      if (!b->finished) return true;
    return !deferred.empty();
  }

  void loop() {
    ucp_worker_h w = worker.get();
    auto active = Clock::now();
    while (!stopping.load(std::memory_order_acquire)) {
      bool progressed = false;
      while (ucp_worker_progress(w) != 0) progressed = true;
      progressed |= !deferred.empty();
      run_deferred();
      {
        std::lock_guard lk(cmd_mu);
        progressed |= !cmds.empty();
      }
      run_commands();
      milliseconds wait = check_deadlines();
      run_deferred();
      const auto now = Clock::now();
      if (progressed) active = now;
      if (busy()) continue;                    // completions are due: keep progressing rather than sleep
      if (now - active < opts.spin) continue;  // more work is likely to follow soon
      ucs_status_t s = ucp_worker_arm(w);
      if (s == UCS_ERR_BUSY) continue;
      epoll_event evs[2];
      // Bounded: with a peer connected, at most 10 ms (a wakeup UCX's tcp transport fails to signal
      // then costs a target-side get at most that, not the 100 ms an idle transport sleeps).
      const int64_t cap = peers.empty() ? 100 : 10;
      int n = ::epoll_wait(epoll_fd.get(), evs, 2, int(std::min<int64_t>(wait.count() + 1, cap)));
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.fd == wake_fd.get()) {
          uint64_t v;
          while (::read(wake_fd.get(), &v, sizeof v) > 0) {
          }
        }
      }
    }
    // Shutdown: everything still open ends now.
    run_commands();
    std::vector<Peer*> all;
    for (auto& [id, p] : peers) all.push_back(p.get());
    for (Peer* p : all) fail_peer(*p, "transport shut down", ErrorCode::kCancelled);
    const auto end = Clock::now() + milliseconds(2000);
    while (busy() && Clock::now() < end) {
      ucp_worker_progress(w);
      deferred.clear();
    }
    for (auto& [id, c] : calls) c.done.set_value(Status(ErrorCode::kCancelled, "transport shut down"));
    calls.clear();
    listener.reset();
  }

  void post(std::function<void()> f) {
    {
      std::lock_guard lk(cmd_mu);
      cmds.push_back(std::move(f));
    }
    uint64_t one = 1;
    if (::write(wake_fd.get(), &one, sizeof one) < 0) {
      // the counter is saturated: the loop is awake anyway
    }
  }

  milliseconds deadline_of(milliseconds t) const { return t.count() > 0 ? t : opts.op_timeout; }

  std::vector<Status> rma(PeerId id, std::span<const RemoteCopy> copies, milliseconds timeout, bool put) {
    if (copies.empty()) return {};
    auto b = std::make_shared<Batch>();
    b->impl = this;
    b->peer = id;
    b->put = put;
    b->copies.assign(copies.begin(), copies.end());
    b->statuses.resize(copies.size());
    b->timeout = deadline_of(timeout);
    b->deadline = Clock::now() + b->timeout;
    for (size_t i = 0; i < copies.size(); ++i) {
      const RemoteCopy& c = copies[i];
      if (!opts.pool || c.local_offset > opts.pool_bytes || c.bytes > opts.pool_bytes - c.local_offset)
        b->statuses[i] = Status(ErrorCode::kOutOfRange, "local run [" + std::to_string(c.local_offset) + ", +" +
                                                            std::to_string(c.bytes) + ") is past the registered pool");
    }
    auto fut = b->done.get_future();
    post([this, b] { start_batch(b); });
    // The loop answers by the deadline (it drops the endpoint then); the grace covers a slow close.
    if (fut.wait_for(b->timeout + milliseconds(3000)) != std::future_status::ready)
      return std::vector<Status>(copies.size(), Status(ErrorCode::kTimeout, "the transport did not answer in time"));
    return fut.get();
  }
};

// ---- public face ----

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UcxTransport::~UcxTransport() {
  if (!impl_) return;
  impl_->stopping.store(true, std::memory_order_release);
  impl_->post([] {});
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<std::unique_ptr<UcxTransport>> UcxTransport::create(Options opts) {
  if (opts.listen && opts.secret.empty() && !is_loopback(opts.listen_host))
    return Status(ErrorCode::kPermissionDenied,
                  "the remote tier listens on " + opts.listen_host + " only with a shared secret (secret_file)");
  if (opts.pool && opts.pool_bytes == 0) return Status(ErrorCode::kInvalidArgument, "pool of 0 bytes");
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(opts);
  Status s = impl->init();
  if (!s.ok()) {
    if (impl->thread.joinable()) {
      impl->stopping = true;
      impl->post([] {});
      impl->thread.join();
    }
    return s.with_context("starting the UCX transport");
  }
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(impl)));
}

uint16_t UcxTransport::listen_port() const { return impl_->port; }
const std::vector<uint8_t>& UcxTransport::worker_address() const { return impl_->worker_addr; }

Result<PeerId> UcxTransport::connect(const std::string& host, uint16_t port) {
  socklen_t len = 0;
  KVFERRY_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(host, port, len));
  auto done = std::make_shared<std::promise<Result<PeerId>>>();
  auto fut = done->get_future();
  impl_->post([this, ss, len, where = host + ":" + std::to_string(port), done] {
    Impl::Peer* p = impl_->add_peer(nullptr, false, where);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    impl_->start_connect(p, ep, std::move(*done));
  });
  if (fut.wait_for(impl_->opts.connect_timeout + milliseconds(3000)) != std::future_status::ready)
    return Status(ErrorCode::kTimeout, "connecting to " + host + ":" + std::to_string(port) + ": no answer");
  return fut.get();
}

Result<PeerId> UcxTransport::connect_worker(std::span<const uint8_t> address) {
  if (address.empty()) return Status(ErrorCode::kInvalidArgument, "empty worker address");
  auto done = std::make_shared<std::promise<Result<PeerId>>>();
  auto fut = done->get_future();
  impl_->post([this, addr = std::vector<uint8_t>(address.begin(), address.end()), done] {
    Impl::Peer* p = impl_->add_peer(nullptr, false, "worker address");
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    impl_->start_connect(p, ep, std::move(*done));
  });
  if (fut.wait_for(impl_->opts.connect_timeout + milliseconds(3000)) != std::future_status::ready)
    return Status(ErrorCode::kTimeout, "connecting to a worker address: no answer");
  return fut.get();
}

void UcxTransport::disconnect(PeerId id) {
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  impl_->post([this, id, done] {
    auto it = impl_->peers.find(id);
    if (it != impl_->peers.end()) impl_->fail_peer(*it->second, "disconnected", ErrorCode::kCancelled);
    done->set_value();
  });
  fut.wait_for(milliseconds(5000));
}

std::vector<Status> UcxTransport::get(PeerId peer, std::span<const RemoteCopy> copies, milliseconds timeout) {
  return impl_->rma(peer, copies, timeout, false);
}

std::vector<Status> UcxTransport::put(PeerId peer, std::span<const RemoteCopy> copies, milliseconds timeout) {
  return impl_->rma(peer, copies, timeout, true);
}

Result<std::vector<uint8_t>> UcxTransport::call(PeerId peer, uint16_t op, std::span<const uint8_t> body,
                                                milliseconds timeout) {
  if (body.size() + 2 > wire::kMaxBody) return Status(ErrorCode::kInvalidArgument, "control message too large");
  const milliseconds t = impl_->deadline_of(timeout);
  auto done = std::make_shared<std::promise<Result<std::vector<uint8_t>>>>();
  auto fut = done->get_future();
  wire::Writer w;
  w.u16(op);
  w.raw(body);
  impl_->post([this, peer, t, done, msg = std::move(w.buffer())] {
    auto it = impl_->peers.find(peer);
    Impl::Peer* p = it == impl_->peers.end() ? nullptr : it->second.get();
    if (!p || p->state != Impl::State::kReady) return done->set_value(impl_->unavailable(peer, p));
    const uint64_t id = impl_->next_request++;
    Impl::Call c;
    c.peer = peer;
    c.deadline = Clock::now() + t;
    c.done = std::move(*done);
    impl_->calls.emplace(id, std::move(c));
    impl_->send(*p, MsgType::kRequest, id, msg);
  });
  if (fut.wait_for(t + milliseconds(3000)) != std::future_status::ready)
    return Status(ErrorCode::kTimeout, "the transport did not answer in time");
  return fut.get();
}

std::optional<PeerInfo> UcxTransport::peer(PeerId id) const {
  std::lock_guard lk(impl_->info_mu);
  auto it = impl_->info.find(id);
  if (it == impl_->info.end()) return std::nullopt;
  return it->second;
}

std::vector<PeerInfo> UcxTransport::peers() const {
  std::lock_guard lk(impl_->info_mu);
  std::vector<PeerInfo> out;
  for (auto& [id, i] : impl_->info) out.push_back(i);
  return out;
}

UcxCounters UcxTransport::counters() const {
  std::lock_guard lk(impl_->info_mu);
  return impl_->stats;
}

}  // namespace kvferry::store
