// Client (client.h).
#include "kvferry/connector/client.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "kvferry/connector/cuda_vmm.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry {

namespace {
/// Restores the calling thread's current CUDA device on every path (the engine's choice is
/// not ours to change). A no-op without CUDA or without a device.
class DeviceGuard {
 public:
  DeviceGuard() {
#if defined(KVFERRY_WITH_CUDA)
    if (cudaGetDevice(&device_) != cudaSuccess) {
      device_ = -1;
      (void)cudaGetLastError();
    }
#endif
  }
  ~DeviceGuard() {
#if defined(KVFERRY_WITH_CUDA)
    int now = -1;
    if (device_ >= 0 && (cudaGetDevice(&now) != cudaSuccess || now != device_)) (void)cudaSetDevice(device_);
#endif
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = -1;
};

std::string socket_path(const std::string& s) {
  if (!s.empty()) return s;
  const char* env = std::getenv("KVFERRY_SOCKET");
  return env && *env ? env : "/run/kvferry/kvferry.sock";
}

Status error_from(const proto::RecvFrame& f) {
  auto e = proto::decode_error(f.payload, f.header.field_mask);
  if (!e.ok()) return e.status();
  return {e->code, "kvferryd: " + e->message};
}
}  // namespace

Result<std::unique_ptr<Client>> Client::connect(const Options& opts) {
  std::unique_ptr<Client> c(new Client());
  c->opts_ = opts;
  const std::string path = socket_path(opts.socket);
  sockaddr_un a{};
  if (path.size() >= sizeof a.sun_path) return Status(ErrorCode::kInvalidArgument, "socket path too long: " + path);
  c->sock_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!c->sock_) return errno_status("socket", errno);
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  if (::connect(c->sock_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    return Status(ErrorCode::kUnavailable, "cannot connect to kvferryd at '" + path + "': " + std::strerror(errno));
  proto::Hello hello;
  hello.client_name = opts.name;
  hello.pid = static_cast<uint32_t>(::getpid());
  if (!opts.model.empty() || !opts.tenant.empty()) {
    hello.has_namespace = true;
    hello.model = opts.model;
    hello.tenant = opts.tenant;
  }
  hello.peer_token = opts.peer_token;
  auto f = c->request(proto::encode(hello), proto::MsgType::kWelcome);
  if (!f.ok()) {
    if (f.status().code() == ErrorCode::kVersionMismatch)
      return f.status().with_context("kvferryd at '" + path +
                                     "' speaks another protocol version (this library speaks " +
                                     std::to_string(proto::kVersion) + ")");
    return f.status();
  }
  if (f->header.version != proto::kVersion)
    return Status(ErrorCode::kVersionMismatch, "kvferryd at '" + path + "' answered with protocol version " +
                                                   std::to_string(f->header.version) + ", this library speaks " +
                                                   std::to_string(proto::kVersion));
  auto w = proto::decode_welcome(f->payload, f->header.field_mask);
  if (!w.ok()) return w.status();
  if (f->fds.size() != 3)
    return Status(ErrorCode::kProtocol, "Welcome carried " + std::to_string(f->fds.size()) + " fds, expected 3");
  c->welcome_ = std::move(*w);
  c->ring_fd_ = std::move(f->fds[0]);
  c->sq_efd_ = std::move(f->fds[1]);
  c->cq_efd_ = std::move(f->fds[2]);
  struct stat st {};
  if (::fstat(c->ring_fd_.get(), &st) != 0) return errno_status("fstat(ring)", errno);
  if (static_cast<uint64_t>(st.st_size) != c->welcome_.ring_bytes)
    return Status(ErrorCode::kProtocol, "ring memfd is " + std::to_string(st.st_size) + " bytes, the Welcome said " +
                                            std::to_string(c->welcome_.ring_bytes));
  void* p = ::mmap(nullptr, c->welcome_.ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->ring_fd_.get(), 0);
  if (p == MAP_FAILED) return errno_status("mmap(ring)", errno);
  c->ring_base_ = p;
  c->ring_bytes_ = c->welcome_.ring_bytes;
  auto g = ring::check(p, c->ring_bytes_);
  if (!g.ok()) return g.status();
  c->ch_ = ring::channel(p, *g);
  for (const auto& r : c->welcome_.regions) c->known_[r.id] = r;
  return c;
}

Client::~Client() {
  DeviceGuard dg;
  for (auto& [_, m] : mapped_) unmap(m);
  if (sock_) (void)proto::send_frame(sock_.get(), proto::encode_goodbye(), {}, 100);
  if (ring_base_) ::munmap(ring_base_, ring_bytes_);
}

void Client::unmap(Mapped& m) {
  if (!m.base || !m.owned) return;
  m.base = static_cast<uint8_t*>(m.base) - m.offset;  // the mapping starts at the buffer
  switch (m.desc.backend) {
    case proto::Backend::kMemfd: ::munmap(m.base, m.desc.alloc_bytes); break;
    case proto::Backend::kCudaVmm: {
      cuda_vmm::Mapping vm;
      vm.device = m.desc.device;
      vm.handle = m.handle;
      vm.ptr = m.base;
      vm.size = m.desc.alloc_bytes;
      cuda_vmm::release(vm);
      break;
    }
    case proto::Backend::kCudaIpc: cuda_vmm::ipc_close(m.base, m.desc.device); break;
  }
  m.base = nullptr;
}

Result<proto::RecvFrame> Client::request(const proto::Frame& f, proto::MsgType want) {
  if (Status sent = proto::send_frame(sock_.get(), f, {}, opts_.timeout_ms); !sent.ok()) {
    // The daemon may have refused us (and closed) before reading: its Error frame says why.
    auto why = proto::recv_frame(sock_.get(), 200);
    if (why.ok() && why->header.type == static_cast<uint16_t>(proto::MsgType::kError)) return error_from(*why);
    return sent.with_context("sending to kvferryd");
  }
  auto r = proto::recv_frame(sock_.get(), opts_.timeout_ms);
  if (!r.ok()) return r.status().with_context("waiting for kvferryd");
  if (r->header.type == static_cast<uint16_t>(proto::MsgType::kError)) return error_from(*r);
  if (r->header.type != static_cast<uint16_t>(want))
    return Status(ErrorCode::kProtocol, "kvferryd answered message type " + std::to_string(r->header.type) +
                                            ", expected " + std::to_string(static_cast<int>(want)));
  return r;
}

std::vector<proto::RegionDesc> Client::regions() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<proto::RegionDesc> v;
  for (auto& [_, d] : known_) v.push_back(d);
  return v;
}

Result<uint32_t> Client::find_region(const std::string& name) const {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [id, d] : known_)
    if (d.name == name) return id;
  // Not offered at the handshake: another client may have made it since. The daemon's status
  // lists the regions this client may see. (request() only touches the control socket, which mu_
  // guards; known_ is the cache it refreshes.)
  auto f = const_cast<Client*>(this)->request(proto::encode_status_request(), proto::MsgType::kStatusReply);
  if (f.ok())
    if (auto s = proto::decode_status_reply(f->payload, f->header.field_mask); s.ok())
      for (const auto& r : s->regions) known_.try_emplace(r.desc.id, r.desc);
  for (auto& [id, d] : known_)
    if (d.name == name) return id;
  return Status(ErrorCode::kNotFound, "no region named '" + name + "'");
}

Result<uint32_t> Client::map_handle(proto::RecvFrame& f) {
  auto h = proto::decode_region_handle(f.payload, f.header.field_mask);
  if (!h.ok()) return h.status();
  const proto::RegionDesc& d = h->region;
  if (auto it = mapped_.find(d.id); it != mapped_.end()) return d.id;
  Mapped m;
  m.desc = d;
  switch (d.backend) {
    case proto::Backend::kMemfd: {
      if (f.fds.size() != 1) return Status(ErrorCode::kProtocol, "memfd region handle without its fd");
      struct stat st {};
      if (::fstat(f.fds[0].get(), &st) != 0) return errno_status("fstat(region)", errno);
      if (static_cast<uint64_t>(st.st_size) != d.alloc_bytes)
        return Status(ErrorCode::kProtocol, "region memfd is " + std::to_string(st.st_size) + " bytes, expected " +
                                                std::to_string(d.alloc_bytes));
      void* p = ::mmap(nullptr, d.alloc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f.fds[0].get(), 0);
      if (p == MAP_FAILED) return errno_status("mmap(region)", errno);
      m.base = p;
      break;
    }
    case proto::Backend::kCudaVmm: {
      if (f.fds.size() != 1) return Status(ErrorCode::kProtocol, "cuda region handle without its fd");
      auto vm = cuda_vmm::import_fd(d.device, f.fds[0].get(), d.alloc_bytes);
      if (!vm.ok()) return vm.status().with_context("mapping region '" + d.name + "'");
      m.base = vm->ptr;
      m.handle = vm->handle;
      m.device = true;
      break;
    }
    case proto::Backend::kCudaIpc: {
      if (!h->has_ipc_handle) return Status(ErrorCode::kProtocol, "cuda_ipc region handle without its IPC handle");
      auto p = cuda_vmm::ipc_open(d.device, h->ipc_handle);
      if (!p.ok()) return p.status().with_context("mapping region '" + d.name + "'");
      m.base = *p;
      m.device = true;
      break;
    }
  }
  // A region inside a larger buffer (registered at an offset; mapped by a peer daemon only).
  if (h->offset > d.alloc_bytes || d.bytes > d.alloc_bytes - h->offset) {
    unmap(m);
    return Status(ErrorCode::kProtocol, "region '" + d.name + "' of " + std::to_string(d.bytes) + " bytes at offset " +
                                            std::to_string(h->offset) + " does not fit its buffer of " +
                                            std::to_string(d.alloc_bytes) + " bytes");
  }
  m.offset = h->offset;
  m.base = static_cast<uint8_t*>(m.base) + m.offset;
  known_[d.id] = d;
  mapped_[d.id] = m;
  return d.id;
}

void* Client::mapped_base(uint32_t region_id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = mapped_.find(region_id);
  return it == mapped_.end() ? nullptr : it->second.base;
}

Result<void*> Client::map_region(uint32_t region_id) {
  DeviceGuard dg;
  std::lock_guard<std::mutex> g(mu_);
  if (auto it = mapped_.find(region_id); it != mapped_.end()) return it->second.base;
  auto f = request(proto::encode(proto::MapRegion{region_id}), proto::MsgType::kRegionHandle);
  if (!f.ok()) return f.status();
  auto id = map_handle(*f);
  if (!id.ok()) return id.status();
  return mapped_[*id].base;
}

Result<uint32_t> Client::create_region(const std::string& name, const KvCacheSpec& spec) {
  KVFERRY_TRY(spec.validate());
  DeviceGuard dg;
  std::lock_guard<std::mutex> g(mu_);
  auto f = request(proto::encode(proto::CreateRegion{name, spec}), proto::MsgType::kRegionHandle);
  if (!f.ok()) return f.status();
  return map_handle(*f);
}

Result<uint32_t> Client::register_region(const std::string& name, const KvCacheSpec& spec, const OwnBuffer& buf) {
  KVFERRY_TRY(spec.validate());
  if (!buf.base) return Status(ErrorCode::kInvalidArgument, "register_region: base is null");
  const auto rb = static_cast<uint64_t>(spec.region_bytes());
  if (buf.alloc_bytes < rb || buf.offset > buf.alloc_bytes - rb)
    return Status(ErrorCode::kInvalidArgument, "register_region: a buffer of " + std::to_string(buf.alloc_bytes) +
                                                   " bytes cannot hold the region's " + std::to_string(rb) +
                                                   " bytes at offset " + std::to_string(buf.offset));
  if (buf.offset % static_cast<uint64_t>(spec.format.alignment()) != 0)
    return Status(ErrorCode::kInvalidArgument, "register_region: offset " + std::to_string(buf.offset) +
                                                   " is not a multiple of " + spec.format.name() + "'s alignment (" +
                                                   std::to_string(spec.format.alignment()) + " bytes)");
  proto::RegisterRegion m;
  m.name = name;
  m.spec = spec;
  m.backend = buf.backend;
  m.device = buf.device;
  m.alloc_bytes = buf.alloc_bytes;
  m.offset = buf.offset;
  std::vector<int> fds;
  if (buf.backend == proto::Backend::kCudaIpc) {
    if (!buf.ipc_handle) return Status(ErrorCode::kInvalidArgument, "register_region: cuda_ipc needs an IPC handle");
    m.has_ipc_handle = true;
    std::memcpy(m.ipc_handle, buf.ipc_handle, 64);
  } else {
    if (buf.fd < 0) return Status(ErrorCode::kInvalidArgument, "register_region: memfd and cuda_vmm need an fd");
    fds.push_back(buf.fd);
  }
  std::lock_guard<std::mutex> g(mu_);
  KVFERRY_TRY(proto::send_frame(sock_.get(), proto::encode(m), fds, opts_.timeout_ms));
  auto f = proto::recv_frame(sock_.get(), opts_.timeout_ms);
  if (!f.ok()) return f.status().with_context("waiting for kvferryd");
  if (f->header.type == static_cast<uint16_t>(proto::MsgType::kError)) return error_from(*f);
  if (f->header.type != static_cast<uint16_t>(proto::MsgType::kRegionHandle))
    return Status(ErrorCode::kProtocol, "kvferryd answered message type " + std::to_string(f->header.type));
  auto h = proto::decode_region_handle(f->payload, f->header.field_mask);
  if (!h.ok()) return h.status();
  Mapped mp;
  mp.desc = h->region;
  mp.base = static_cast<uint8_t*>(buf.base) + buf.offset;
  mp.device = buf.backend != proto::Backend::kMemfd;
  mp.owned = false;
  known_[mp.desc.id] = mp.desc;
  mapped_[mp.desc.id] = mp;
  return mp.desc.id;
}

Result<LayerView> Client::kv_view(uint32_t region_id, int64_t layer, bool v_plane) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = mapped_.find(region_id);
  if (it == mapped_.end())
    return Status(ErrorCode::kNotFound, "region " + std::to_string(region_id) + " is not mapped (call map_region)");
  const KvCacheSpec& s = it->second.desc.spec;
  KVFERRY_TRY(s.check_layer(layer));
  LayerView v;
  v.view = s.format.kind == FormatKind::kMha ? s.kv_view(layer, v_plane) : s.layer_view(layer);
  if (v_plane && s.format.kind != FormatKind::kMha)
    return Status(ErrorCode::kInvalidArgument,
                  "region '" + it->second.desc.name + "' has format " + s.format.name() + ", which has no V plane");
  v.data = static_cast<uint8_t*>(it->second.base) + v.view.offset;
  v.on_device = it->second.device;
  return v;
}

Result<LayerView> Client::layer_view(uint32_t region_id, int64_t layer) const {
  return kv_view(region_id, layer, false);
}

Status Client::submit(const ring::SubmitEntry& e) {
  if (dead_.load(std::memory_order_acquire)) return dead_status();
  std::lock_guard<std::mutex> g(sq_mu_);
  if (!ch_.sq.try_push(e))
    return {ErrorCode::kBusy, "the submission ring is full (" + std::to_string(ch_.sq.capacity()) +
                                  " requests in flight): reap completions and retry"};
  if (ch_.sq.consumer_needs_doorbell()) ring::ring_doorbell(sq_efd_.get());
  return Status::Ok();
}

Status Client::ping(uint64_t id, uint64_t payload) {
  ring::SubmitEntry e{};
  e.id = id;
  e.op = static_cast<uint16_t>(proto::Op::kPing);
  e.args[0] = payload;
  return submit(e);
}

size_t Client::drain_cq(ring::CompletionEntry* out, size_t max) {
  size_t n = 0;
  while (n < max) {
    const ring::CompletionEntry* c = ch_.cq.peek();
    if (!c) break;
    out[n++] = *c;
    ch_.cq.pop();
  }
  return n;
}

bool Client::socket_closed(int timeout_ms) const {
  // POLLRDHUP only: a control reply waiting to be read (POLLIN) is not a death.
  pollfd p{sock_.get(), POLLRDHUP, 0};
  int r;
  do r = ::poll(&p, 1, timeout_ms);
  while (r < 0 && errno == EINTR);
  return r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

Status Client::dead_status() const {
  return {ErrorCode::kUnavailable, "kvferryd closed the connection (it died or stopped); " + std::to_string(lost_ops_) +
                                       " data op(s) in flight then were lost, and pins this client held were released: "
                                       "connect again"};
}

void Client::mark_dead() {
  if (dead_.load(std::memory_order_relaxed)) return;
  lost_ops_ = pending_.size();
  dead_.store(true, std::memory_order_release);
}

Status Client::connection_status() {
  std::unique_lock<std::mutex> lk(ops_mu_);
  if (!dead_.load(std::memory_order_relaxed) && socket_closed(0)) mark_dead();
  return dead_.load(std::memory_order_relaxed) ? dead_status() : Status::Ok();
}

Status Client::reap_until(std::unique_lock<std::mutex>& lk, Clock::time_point end, const std::function<bool()>& done) {
  const auto start = Clock::now();
  const auto spin = std::chrono::microseconds(opts_.spin_us);
  bool tried = false;  // a zero timeout still looks at the ring once
  for (;;) {
    if (done()) return Status::Ok();
    if (dead_.load(std::memory_order_relaxed)) return dead_status();
    if (tried && Clock::now() >= end) return Status(ErrorCode::kTimeout, "no completion in time");
    if (reaping_) {  // another thread reaps for everyone and wakes us for each batch it files
      if (ops_cv_.wait_until(lk, end) == std::cv_status::timeout) tried = true;
      continue;
    }
    reaping_ = true;
    tried = true;
    lk.unlock();
    ring::CompletionEntry buf[64];
    size_t n = drain_cq(buf, 64);
    bool gone = false;
    if (n == 0 && Clock::now() < end) {
      if (Clock::now() - start < spin) {
        while (ch_.cq.empty() && Clock::now() - start < spin && Clock::now() < end) {
#if defined(__x86_64__)
          __builtin_ia32_pause();
#endif
        }
      } else if (ch_.cq.prepare_sleep()) {
        // Sleep on the completion doorbell and the control socket together: a dead daemon rings
        // no doorbell, but its socket hangs up. Bounded so that a waiter re-checks its deadline.
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count() + 1;
        pollfd p[2] = {{cq_efd_.get(), POLLIN, 0}, {sock_.get(), POLLRDHUP, 0}};
        int r;
        do r = ::poll(p, 2, static_cast<int>(std::min<int64_t>(left, 100)));
        while (r < 0 && errno == EINTR);
        if (r > 0 && (p[0].revents & POLLIN)) ring::drain_doorbell(cq_efd_.get());
        if (r > 0 && (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) gone = true;
        ch_.cq.end_sleep();
      }
      n = drain_cq(buf, 64);
    }
    // Whatever the daemon completed before it went is still handed out.
    if (gone)
      while (size_t more = drain_cq(buf + n, 64 - n)) n += more;
    lk.lock();
    for (size_t i = 0; i < n; ++i) absorb(buf[i]);
    if (gone && n < 64) mark_dead();
    reaping_ = false;
    ops_cv_.notify_all();
  }
}

size_t Client::poll(std::span<ring::CompletionEntry> out) {
  std::lock_guard<std::mutex> g(ops_mu_);
  if (!reaping_) {  // file what the ring holds; a reaper at work files it itself
    ring::CompletionEntry buf[64];
    size_t n;
    do {
      n = drain_cq(buf, 64);
      for (size_t i = 0; i < n; ++i) absorb(buf[i]);
    } while (n == 64 && raw_.size() < out.size());
    if (n) ops_cv_.notify_all();
  }
  size_t k = 0;
  while (k < out.size() && !raw_.empty()) {
    out[k++] = raw_.front();
    raw_.pop_front();
  }
  return k;
}

Result<size_t> Client::wait(std::span<ring::CompletionEntry> out, int64_t timeout_us) {
  if (out.empty()) return Status(ErrorCode::kInvalidArgument, "wait: no room for a completion");
  std::unique_lock<std::mutex> lk(ops_mu_);
  Status st = reap_until(lk, Clock::now() + std::chrono::microseconds(std::max<int64_t>(timeout_us, 0)),
                         [&] { return !raw_.empty(); });
  if (!st.ok()) {
    if (st.code() == ErrorCode::kTimeout)
      return Status(ErrorCode::kTimeout, "no completion within " + std::to_string(timeout_us) + " us");
    return st;
  }
  size_t k = 0;
  while (k < out.size() && !raw_.empty()) {
    out[k++] = raw_.front();
    raw_.pop_front();
  }
  return k;
}

Result<std::vector<uint8_t>> Client::debug_read(uint32_t region_id, uint64_t offset, uint32_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  auto f = request(proto::encode(proto::DebugRead{region_id, offset, bytes}), proto::MsgType::kDebugReadReply);
  if (!f.ok()) return f.status();
  if (f->payload.size() != bytes)
    return Status(ErrorCode::kProtocol, "debug read returned " + std::to_string(f->payload.size()) + " of " +
                                            std::to_string(bytes) + " bytes");
  return std::move(f->payload);
}

Result<proto::StatusReply> Client::status() {
  std::lock_guard<std::mutex> g(mu_);
  auto f = request(proto::encode_status_request(), proto::MsgType::kStatusReply);
  if (!f.ok()) return f.status();
  return proto::decode_status_reply(f->payload, f->header.field_mask);
}

// ---- data ops ----

Result<uint32_t> Client::arena_alloc(uint64_t bytes) {
  bytes = std::max<uint64_t>(8, (bytes + 7) / 8 * 8);
  if (bytes > ch_.arena_bytes)
    return Status(ErrorCode::kInvalidArgument, "a request of " + std::to_string(bytes) +
                                                   " arena bytes is larger than the arena (" +
                                                   std::to_string(ch_.arena_bytes) + "): split it");
  uint64_t at = 0;
  for (const auto& [off, len] : arena_used_) {  // first fit between used ranges
    if (off >= at + bytes) break;
    at = off + len;
  }
  if (at + bytes > ch_.arena_bytes)
    return Status(ErrorCode::kBusy, "the arena is full of requests in flight: reap completions and retry");
  arena_used_[static_cast<uint32_t>(at)] = static_cast<uint32_t>(bytes);
  return static_cast<uint32_t>(at);
}

Result<uint64_t> Client::submit_keys(uint16_t op, uint32_t region_id, std::span<const ops::Key> keys,
                                     std::span<const int64_t> block_ids, uint64_t arg0, uint64_t extra_bytes,
                                     uint64_t arg1, std::span<const uint8_t> tail, uint64_t arg2) {
  if (ops::has_block_ids(op) && block_ids.size() != keys.size())
    return Status(ErrorCode::kInvalidArgument,
                  std::to_string(keys.size()) + " keys but " + std::to_string(block_ids.size()) + " block ids");
  if (keys.size() > UINT32_MAX) return Status(ErrorCode::kInvalidArgument, "too many keys in one request");
  const uint64_t bytes = ops::request_bytes(op, keys.size()) + std::max<uint64_t>(extra_bytes, tail.size());
  std::lock_guard<std::mutex> g(ops_mu_);
  if (dead_.load(std::memory_order_relaxed)) return dead_status();
  auto off = arena_alloc(bytes);
  if (!off.ok()) return off.status();
  uint8_t* p = ch_.arena + *off;
  if (!keys.empty()) std::memcpy(p, keys.data(), keys.size() * sizeof(ops::Key));
  if (ops::has_block_ids(op) && !block_ids.empty())
    std::memcpy(p + keys.size() * sizeof(ops::Key), block_ids.data(), block_ids.size() * sizeof(int64_t));
  if (!tail.empty()) std::memcpy(p + ops::request_bytes(op, keys.size()), tail.data(), tail.size());
  ring::SubmitEntry e{};
  e.id = next_op_id_++;
  e.op = op;
  e.region = region_id;
  e.count = static_cast<uint32_t>(keys.size());
  e.arena_offset = *off;
  e.args[0] = arg0;
  e.args[1] = arg1;
  e.args[2] = arg2;
  // Filed before the push (ops_mu_ held), so the completion always finds its op.
  pending_[e.id] = Pending{*off, static_cast<uint32_t>(bytes)};
  if (Status st = submit(e); !st.ok()) {
    pending_.erase(e.id);
    arena_used_.erase(*off);
    return st;
  }
  return e.id;
}

void Client::absorb(const ring::CompletionEntry& c) {
  auto it = pending_.find(c.id);
  if (it == pending_.end()) {
    raw_.push_back(c);
    return;
  }
  OpResult r;
  r.status = static_cast<ErrorCode>(c.status);
  r.done = c.done;
  std::memcpy(r.result, c.result, sizeof r.result);
  const Pending& p = it->second;
  const uint64_t lo = p.arena_offset, hi = uint64_t{p.arena_offset} + p.arena_bytes;
  const auto op = static_cast<proto::Op>(c.op);
  auto inside = [&](uint64_t off, uint64_t n) { return off >= lo && off + n <= hi; };
  if (op == proto::Op::kStats) {
    // count = 1 + the TierStatsWire entries that follow the StatsWire (ops.h).
    const uint64_t n = sizeof(ops::StatsWire) + uint64_t{c.count > 1 ? c.count - 1 : 0} * sizeof(ops::TierStatsWire);
    if (inside(c.arena_offset, n)) r.payload.assign(ch_.arena + c.arena_offset, ch_.arena + c.arena_offset + n);
  } else if (op == proto::Op::kPeers) {
    if (inside(c.arena_offset, c.count))
      r.payload.assign(ch_.arena + c.arena_offset, ch_.arena + c.arena_offset + c.count);
  } else if (op == proto::Op::kLs) {
    const uint64_t n = uint64_t{c.count} * sizeof(ops::LsEntry);
    if (inside(c.arena_offset, n)) r.payload.assign(ch_.arena + c.arena_offset, ch_.arena + c.arena_offset + n);
  } else if (c.count && inside(c.arena_offset, uint64_t{c.count} * sizeof(int16_t))) {
    r.blocks.resize(c.count);
    for (uint32_t i = 0; i < c.count; ++i) {
      int16_t v;
      std::memcpy(&v, ch_.arena + c.arena_offset + i * sizeof v, sizeof v);
      r.blocks[i] = static_cast<ErrorCode>(v);
    }
  }
  arena_used_.erase(p.arena_offset);
  pending_.erase(it);
  finished_[c.id] = std::move(r);
}

Result<Client::OpResult> Client::wait_op(uint64_t id, int64_t timeout_us) {
  std::unique_lock<std::mutex> lk(ops_mu_);
  Status st = reap_until(lk, Clock::now() + std::chrono::microseconds(std::max<int64_t>(timeout_us, 0)),
                         [&] { return finished_.count(id) || !pending_.count(id); });
  if (auto it = finished_.find(id); it != finished_.end()) {
    OpResult r = std::move(it->second);
    finished_.erase(it);
    return r;
  }
  if (!pending_.count(id)) return Status(ErrorCode::kNotFound, "no data op " + std::to_string(id) + " in flight");
  if (st.code() == ErrorCode::kUnavailable) {  // lost with the daemon: its arena part is ours again
    arena_used_.erase(pending_[id].arena_offset);
    pending_.erase(id);
    return st.with_context("data op " + std::to_string(id));
  }
  if (st.code() == ErrorCode::kTimeout)
    return Status(ErrorCode::kTimeout, "data op " + std::to_string(id) + " did not complete in time");
  return st;
}

Result<uint64_t> Client::submit_lookup(uint32_t region_id, std::span<const ops::Key> keys) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kLookup), region_id, keys, {}, 0, 0);
}
Result<uint64_t> Client::submit_save(uint32_t region_id, std::span<const ops::Key> keys,
                                     std::span<const int64_t> block_ids) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kSave), region_id, keys, block_ids, 0, 0);
}
Result<uint64_t> Client::submit_load(uint32_t region_id, std::span<const ops::Key> keys,
                                     std::span<const int64_t> block_ids) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kLoad), region_id, keys, block_ids, 0, 0);
}
Result<uint64_t> Client::submit_pin(uint32_t region_id, std::span<const ops::Key> keys) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kPin), region_id, keys, {}, 0, 0);
}
Result<uint64_t> Client::submit_unpin(uint32_t region_id, std::span<const ops::Key> keys) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kUnpin), region_id, keys, {}, 0, 0);
}
Result<uint64_t> Client::submit_evict(uint32_t region_id, std::span<const ops::Key> keys, uint64_t flags) {
  return submit_keys(static_cast<uint16_t>(proto::Op::kEvict), region_id,
                     (flags & (ops::kEvictAll | ops::kEvictAllNs)) ? std::span<const ops::Key>() : keys, {}, flags, 0);
}

namespace {
template <class F>
Result<Client::OpResult> submit_and_wait(Client& c, int64_t timeout_us, F&& submit) {
  auto id = submit();
  if (!id.ok()) return id.status();
  return c.wait_op(*id, timeout_us);
}
}  // namespace

Result<Client::OpResult> Client::lookup(uint32_t r, std::span<const ops::Key> k, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_lookup(r, k); });
}
Result<Client::OpResult> Client::save(uint32_t r, std::span<const ops::Key> k, std::span<const int64_t> b, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_save(r, k, b); });
}
Result<Client::OpResult> Client::load(uint32_t r, std::span<const ops::Key> k, std::span<const int64_t> b, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_load(r, k, b); });
}
Result<Client::OpResult> Client::pin(uint32_t r, std::span<const ops::Key> k, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_pin(r, k); });
}
Result<Client::OpResult> Client::unpin(uint32_t r, std::span<const ops::Key> k, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_unpin(r, k); });
}
Result<Client::OpResult> Client::evict(uint32_t r, std::span<const ops::Key> k, uint64_t flags, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_evict(r, k, flags); });
}

Result<ops::StatsWire> Client::stats(int64_t timeout_us) {
  auto r = submit_and_wait(*this, timeout_us, [&] {
    return submit_keys(static_cast<uint16_t>(proto::Op::kStats), 0, {}, {}, 0, sizeof(ops::StatsWire));
  });
  if (!r.ok()) return r.status();
  if (r->status != ErrorCode::kOk) return Status(r->status, "stats failed");
  if (r->payload.size() < sizeof(ops::StatsWire))
    return Status(ErrorCode::kProtocol, "stats answer outside its arena part");
  ops::StatsWire w;
  std::memcpy(&w, r->payload.data(), sizeof w);
  return w;
}

Result<Client::StoreStats> Client::stats_all(int64_t timeout_us) {
  auto r = submit_and_wait(*this, timeout_us, [&] {
    return submit_keys(static_cast<uint16_t>(proto::Op::kStats), 0, {}, {}, ops::kStatsTiers,
                       sizeof(ops::StatsWire) + ops::kMaxTierStats * sizeof(ops::TierStatsWire), ops::kMaxTierStats);
  });
  if (!r.ok()) return r.status();
  if (r->status != ErrorCode::kOk) return Status(r->status, "stats failed");
  const size_t tier_bytes = r->payload.size() - std::min(r->payload.size(), sizeof(ops::StatsWire));
  if (r->payload.size() < sizeof(ops::StatsWire) || tier_bytes % sizeof(ops::TierStatsWire) != 0 ||
      tier_bytes / sizeof(ops::TierStatsWire) > ops::kMaxTierStats)
    return Status(ErrorCode::kProtocol, "stats answer outside its arena part");
  StoreStats out;
  std::memcpy(&out.host, r->payload.data(), sizeof out.host);
  for (size_t off = sizeof(ops::StatsWire); off < r->payload.size(); off += sizeof(ops::TierStatsWire)) {
    ops::TierStatsWire t;
    std::memcpy(&t, r->payload.data() + off, sizeof t);
    if (!(t.flags & ops::kTierPresent)) continue;
    // The names are read as C strings: terminated here whatever the daemon wrote.
    t.tier[sizeof t.tier - 1] = '\0';
    t.member[sizeof t.member - 1] = '\0';
    t.reason[sizeof t.reason - 1] = '\0';
    out.tiers.push_back(t);
  }
  return out;
}

Result<std::vector<ops::LsEntry>> Client::ls(uint32_t region_id, uint32_t limit, int64_t timeout_us) {
  const uint64_t room = ch_.arena_bytes / 2 / sizeof(ops::LsEntry);
  const uint64_t n = limit ? std::min<uint64_t>(limit, room) : room;
  auto r = submit_and_wait(*this, timeout_us, [&] {
    return submit_keys(static_cast<uint16_t>(proto::Op::kLs), region_id, {}, {}, n, n * sizeof(ops::LsEntry));
  });
  if (!r.ok()) return r.status();
  if (r->status != ErrorCode::kOk) return Status(r->status, "ls failed");
  std::vector<ops::LsEntry> out(r->payload.size() / sizeof(ops::LsEntry));
  if (!out.empty()) std::memcpy(out.data(), r->payload.data(), out.size() * sizeof(ops::LsEntry));
  return out;
}

Result<uint64_t> Client::submit_send(uint32_t region_id, std::span<const ops::Key> keys,
                                     std::span<const int64_t> block_ids, const std::string& peer, uint32_t peer_region,
                                     std::span<const int64_t> peer_block_ids) {
  if (peer.empty() || peer.size() > ops::kMaxPeerName)
    return Status(ErrorCode::kInvalidArgument, "a peer's member id has 1 to " + std::to_string(ops::kMaxPeerName) +
                                                   " characters, not " + std::to_string(peer.size()));
  if (peer_region != 0 && peer_block_ids.size() != keys.size())
    return Status(ErrorCode::kInvalidArgument, std::to_string(keys.size()) + " keys but " +
                                                   std::to_string(peer_block_ids.size()) + " of the peer's block ids");
  // The tail: the peer's member id, then (8-aligned) the peer's block ids.
  std::vector<uint8_t> tail((peer.size() + 7) / 8 * 8 + (peer_region ? peer_block_ids.size() * sizeof(int64_t) : 0));
  std::memcpy(tail.data(), peer.data(), peer.size());
  if (peer_region && !peer_block_ids.empty())
    std::memcpy(tail.data() + (peer.size() + 7) / 8 * 8, peer_block_ids.data(),
                peer_block_ids.size() * sizeof(int64_t));
  return submit_keys(static_cast<uint16_t>(proto::Op::kSend), region_id, keys, block_ids, 0, 0, peer.size(), tail,
                     peer_region);
}

Result<Client::OpResult> Client::send(uint32_t r, std::span<const ops::Key> k, std::span<const int64_t> b,
                                      const std::string& peer, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_send(r, k, b, peer); });
}

Result<Client::OpResult> Client::send_into(uint32_t r, std::span<const ops::Key> k, std::span<const int64_t> b,
                                           const std::string& peer, uint32_t peer_region,
                                           std::span<const int64_t> peer_block_ids, int64_t t) {
  if (peer_region == 0) return Status(ErrorCode::kInvalidArgument, "send_into needs the peer's region id");
  return submit_and_wait(*this, t, [&] { return submit_send(r, k, b, peer, peer_region, peer_block_ids); });
}

Result<uint64_t> Client::submit_load_mapped(uint32_t region_id, std::span<const ops::Key> keys,
                                            std::span<const int64_t> block_ids, std::span<const int32_t> parts) {
  if (parts.size() != keys.size())
    return Status(ErrorCode::kInvalidArgument,
                  std::to_string(keys.size()) + " keys but " + std::to_string(parts.size()) + " parts");
  std::vector<uint8_t> tail(ops::parts_bytes(parts.size()));
  if (!parts.empty()) std::memcpy(tail.data(), parts.data(), parts.size() * sizeof(int32_t));
  return submit_keys(static_cast<uint16_t>(proto::Op::kLoadMapped), region_id, keys, block_ids, 0, 0, 0, tail);
}

Result<Client::OpResult> Client::load_mapped(uint32_t r, std::span<const ops::Key> k, std::span<const int64_t> b,
                                             std::span<const int32_t> p, int64_t t) {
  return submit_and_wait(*this, t, [&] { return submit_load_mapped(r, k, b, p); });
}

Status Client::page_map(std::span<const ops::Key> keys, int64_t stored_tokens, std::span<const int64_t> block_ids,
                        int64_t region_tokens, std::vector<ops::Key>* out_keys, std::vector<int64_t>* out_blocks,
                        std::vector<int32_t>* out_parts) {
  const int64_t s = stored_tokens, r = region_tokens;
  if (s < 1 || r < 1 || (s >= r ? s % r : r % s) != 0)
    return {ErrorCode::kInvalidArgument, "pages of " + std::to_string(s) + " and " + std::to_string(r) +
                                             " tokens: one page size must divide the other"};
  if (static_cast<int64_t>(keys.size()) * s != static_cast<int64_t>(block_ids.size()) * r)
    return {ErrorCode::kInvalidArgument, std::to_string(keys.size()) + " stored blocks of " + std::to_string(s) +
                                             " tokens do not fill " + std::to_string(block_ids.size()) +
                                             " region blocks of " + std::to_string(r)};
  out_keys->clear();
  out_blocks->clear();
  out_parts->clear();
  if (s >= r) {  // each stored block feeds s / r region blocks
    for (size_t j = 0; j < block_ids.size(); ++j) {
      out_keys->push_back(keys[j / static_cast<size_t>(s / r)]);
      out_blocks->push_back(block_ids[j]);
      out_parts->push_back(static_cast<int32_t>(j % static_cast<size_t>(s / r)));
    }
  } else {  // each region block takes r / s stored blocks
    for (size_t i = 0; i < keys.size(); ++i) {
      out_keys->push_back(keys[i]);
      out_blocks->push_back(block_ids[i / static_cast<size_t>(r / s)]);
      out_parts->push_back(static_cast<int32_t>(i % static_cast<size_t>(r / s)));
    }
  }
  return Status::Ok();
}

Result<Client::OpResult> Client::lookup_wait(uint32_t r, std::span<const ops::Key> k, uint32_t wait_ms, int64_t t) {
  return submit_and_wait(*this, t, [&] {
    return submit_keys(static_cast<uint16_t>(proto::Op::kLookup), r, k, {}, ops::kLookupWait, 0,
                       std::min<uint64_t>(wait_ms, ops::kMaxLookupWaitMs));
  });
}

Result<std::string> Client::peers(int64_t timeout_us) {
  const uint64_t n = std::min<uint64_t>(ch_.arena_bytes / 2, uint64_t{1} << 20);
  auto r = submit_and_wait(*this, timeout_us,
                           [&] { return submit_keys(static_cast<uint16_t>(proto::Op::kPeers), 0, {}, {}, n, n); });
  if (!r.ok()) return r.status();
  if (r->status == ErrorCode::kUnavailable)
    return Status(r->status, "the daemon has no remote tier (tiers.remote.listen is not set)");
  if (r->status != ErrorCode::kOk) return Status(r->status, "peers failed");
  return std::string(r->payload.begin(), r->payload.end());
}

Result<Client::OpResult> Client::corrupt_for_test(uint32_t region_id, const ops::Key& key, uint64_t byte,
                                                  int64_t timeout_us) {
  return submit_and_wait(*this, timeout_us, [&] {
    return submit_keys(static_cast<uint16_t>(proto::Op::kCorruptForTest), region_id, std::span<const ops::Key>(&key, 1),
                       {}, byte, 0);
  });
}

}  // namespace kvferry
