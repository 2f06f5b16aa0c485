// RingService (ring_service.h).
#include "kvferry/daemon/ring_service.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>

#include "kvferry/connector/protocol.h"

namespace kvferry::daemon {

ClientChannel::~ClientChannel() {
  if (base) ::munmap(base, bytes);
}

Result<std::shared_ptr<ClientChannel>> ClientChannel::create(uint32_t client_id, uint32_t entries,
                                                             uint32_t arena_bytes) {
  auto g = ring::Geometry::make(entries, arena_bytes);
  if (!g.ok()) return g.status();
  auto c = std::make_shared<ClientChannel>();
  c->client_id = client_id;
  c->geometry = *g;
  c->bytes = g->total_bytes;
  c->ring_fd.reset(::memfd_create("kvferry-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!c->ring_fd) return errno_status("memfd_create(ring)", errno);
  if (::ftruncate(c->ring_fd.get(), static_cast<off_t>(c->bytes)) != 0) return errno_status("ftruncate(ring)", errno);
  if (::fcntl(c->ring_fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return errno_status("fcntl(ring seals)", errno);
  void* p = ::mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->ring_fd.get(), 0);
  if (p == MAP_FAILED) return errno_status("mmap(ring)", errno);
  c->base = p;
  ring::init(p, *g);
  c->ch = ring::channel(p, *g);
  c->sq_efd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  c->cq_efd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!c->sq_efd || !c->cq_efd) return errno_status("eventfd", errno);
  return c;
}

namespace {
void unsupported_op(ClientChannel&, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
  out.status =
      static_cast<int16_t>(req.op >= 16 && req.op <= 23 ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument);
}
/// One read of a submission slot the client may be rewriting: word by word through volatile
/// loads, so the compiler cannot fold a later use of the copy back into a read of the slot.
ring::SubmitEntry copy_untrusted(const ring::SubmitEntry* slot) {
  static_assert(sizeof(ring::SubmitEntry) % sizeof(uint64_t) == 0);
  uint64_t words[sizeof(ring::SubmitEntry) / sizeof(uint64_t)];
  const volatile uint64_t* src = reinterpret_cast<const volatile uint64_t*>(slot);
  for (size_t i = 0; i < std::size(words); ++i) words[i] = src[i];
  ring::SubmitEntry e;
  std::memcpy(&e, words, sizeof e);
  return e;
}
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

RingService::RingService(std::chrono::microseconds spin) : spin_ns_(spin.count() * 1000) {
  table_.fill(&unsupported_op);
}

RingService::~RingService() { stop(); }

void RingService::set_handler(uint16_t op, OpHandler h) {
  if (op < table_.size()) table_[op] = h;
}

void RingService::set_handler(uint16_t op, DeferrableHandler h) {
  if (op < deferrable_.size()) deferrable_[op] = std::move(h);
}

void RingService::post(const std::shared_ptr<ClientChannel>& c, const ring::CompletionEntry& e) {
  {
    std::lock_guard<std::mutex> g(post_mu_);
    posted_.emplace_back(c, e);
    posted_count_.fetch_add(1, std::memory_order_release);
  }
  ring::ring_doorbell(wake_efd_.get());
}

size_t RingService::drain_posted() {
  if (posted_count_.load(std::memory_order_acquire) == 0) return 0;
  std::vector<std::pair<std::weak_ptr<ClientChannel>, ring::CompletionEntry>> batch;
  {
    std::lock_guard<std::mutex> g(post_mu_);
    batch.swap(posted_);
    posted_count_.store(0, std::memory_order_release);
  }
  std::vector<ClientChannel*> rung;
  for (auto& [w, e] : batch) {
    auto c = w.lock();
    if (!c) continue;
    c->ch.cq.try_push(e);  // cannot fail: serve() kept a slot free for every deferred request
    c->deferred.fetch_sub(1, std::memory_order_acq_rel);
    c->ops.fetch_add(1, std::memory_order_relaxed);
    if (c->ch.cq.consumer_needs_doorbell()) ring::ring_doorbell(c->cq_efd.get());
  }
  return batch.size();
}

Status RingService::start() {
  epfd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  wake_efd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epfd_ || !wake_efd_) return errno_status("epoll_create1/eventfd", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_efd_.get();
  if (::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, wake_efd_.get(), &ev) != 0) return errno_status("epoll_ctl", errno);
  thread_ = std::thread([this] { loop(); });
  return Status::Ok();
}

void RingService::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  ring::ring_doorbell(wake_efd_.get());
  thread_.join();
}

void RingService::add(std::shared_ptr<ClientChannel> c) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = c->sq_efd.get();
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, c->sq_efd.get(), &ev);
  {
    std::lock_guard<std::mutex> g(mu_);
    clients_.push_back(std::move(c));
    generation_.fetch_add(1, std::memory_order_release);
  }
  ring::ring_doorbell(wake_efd_.get());
}

void RingService::remove(const std::shared_ptr<ClientChannel>& c) {
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_DEL, c->sq_efd.get(), nullptr);
  {
    std::lock_guard<std::mutex> g(mu_);
    std::erase(clients_, c);
    generation_.fetch_add(1, std::memory_order_release);
  }
  ring::ring_doorbell(wake_efd_.get());
}

size_t RingService::serve(const std::shared_ptr<ClientChannel>& cp, bool* blocked) {
  constexpr size_t kBatch = 64;
  ClientChannel& c = *cp;
  size_t n = 0, now = 0;
  while (n < kBatch) {
    if (c.ch.cq.size() + c.deferred.load(std::memory_order_acquire) >= c.ch.cq.capacity()) {
      *blocked = true;  // backpressure: leave the request in the submission ring
      break;
    }
    const ring::SubmitEntry* slot = c.ch.sq.peek();
    if (!slot) break;
    // The slot is client-writable memory: copy it once, and let the handlers see only the copy
    // (a client that rewrites count or arena_offset after a check would otherwise win the race).
    const ring::SubmitEntry req = copy_untrusted(slot);
    ring::CompletionEntry out{};
    out.id = req.id;
    out.op = req.op;
    out.status = static_cast<int16_t>(ErrorCode::kOk);
    const size_t op = req.op < table_.size() ? req.op : 0;
    bool complete = true;
    if (deferrable_[op]) {
      c.deferred.fetch_add(1, std::memory_order_acq_rel);  // holds a completion slot until posted
      complete = deferrable_[op](cp, req, out);
      if (complete) c.deferred.fetch_sub(1, std::memory_order_acq_rel);
    } else {
      table_[op](c, req, out);
    }
    c.ch.sq.pop();
    if (complete) {
      c.ch.cq.try_push(out);
      ++now;
    }
    ++n;
  }
  if (now) {
    c.ops.fetch_add(now, std::memory_order_relaxed);
    if (c.ch.cq.consumer_needs_doorbell()) ring::ring_doorbell(c.cq_efd.get());
  }
  return n;
}

void RingService::loop() {
  std::vector<std::shared_ptr<ClientChannel>> local;
  uint64_t seen = ~uint64_t{0};
  auto last_work = std::chrono::steady_clock::now();
  for (;;) {
    if (generation_.load(std::memory_order_acquire) != seen) {  // the hot path takes no lock
      std::lock_guard<std::mutex> g(mu_);
      local = clients_;
      seen = generation_.load(std::memory_order_relaxed);
    }
    const bool stopping = stop_.load(std::memory_order_acquire);
    size_t work = 0;
    bool blocked = false;
    work += drain_posted();
    for (auto& c : local) work += serve(c, &blocked);
    if (stopping && work == 0) break;  // drained (a client held back by backpressure cannot progress)
    if (work) {
      last_work = std::chrono::steady_clock::now();
      continue;
    }
    const auto idle = std::chrono::steady_clock::now() - last_work;
    if (idle < std::chrono::nanoseconds(spin_ns_.load(std::memory_order_relaxed))) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      continue;
    }
    // Sleep: flag every ring, re-check (Dekker), then wait on the doorbells.
    bool can_sleep = true;
    std::vector<ClientChannel*>& flagged = flagged_;
    flagged.clear();
    for (auto& c : local) {
      if (c->ch.cq.size() >= c->ch.cq.capacity()) continue;  // held back: polled below
      if (!c->ch.sq.prepare_sleep()) {
        can_sleep = false;
        break;
      }
      flagged.push_back(c.get());
    }
    if (can_sleep && posted_count_.load(std::memory_order_acquire) == 0) {
      epoll_event evs[16];
      // A client held back by a full completion ring rings no doorbell when it drains: poll.
      int n = ::epoll_wait(epfd_.get(), evs, 16, blocked ? 1 : 200);
      for (int i = 0; i < n; ++i) ring::drain_doorbell(evs[i].data.fd);
    }
    for (ClientChannel* c : flagged) c->ch.sq.end_sleep();
    last_work = std::chrono::steady_clock::now() - std::chrono::nanoseconds(spin_ns_.load()) / 2;
  }
  for (auto& c : local)
    if (c->ch.cq.consumer_needs_doorbell()) ring::ring_doorbell(c->cq_efd.get());
}

}  // namespace kvferry::daemon
