// kvferry-bench ipc: ping round trips through kvferryd's rings (client -> submission ring ->
// daemon's ring thread -> op table -> completion ring -> client), with 1 and 8 clients, next to
// a bare memfd-ring ping-pong with the same spin-then-sleep doorbells measured in the same run.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "bench.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/ring.h"
#include "kvferry/daemon/daemon.h"

namespace kvferry::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(50);

struct Stats {
  double p50_us = 0, p99_us = 0, ops_per_s = 0;
};

Stats summarize(std::vector<std::vector<double>>& per_client, double wall_s) {
  std::vector<double> all;
  for (auto& v : per_client) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  Stats s;
  if (all.empty()) return s;
  s.p50_us = all[all.size() / 2];
  s.p99_us = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  s.ops_per_s = static_cast<double>(all.size()) / wall_s;
  return s;
}

/// Waits for one completion: spin, then flag sleeping and wait on the eventfd.
template <class PollFn>
void wait_one(ring::Ring<ring::CompletionEntry>& cq, int efd, PollFn&& poll) {
  const auto start = Clock::now();
  for (;;) {
    if (poll()) return;
    if (Clock::now() - start < kSpin) continue;
    if (!cq.prepare_sleep()) continue;
    ring::wait_doorbell(efd, 100000);
    cq.end_sleep();
  }
}

// ---- the bare ring: memfd rings, one server thread, no daemon ----
struct BareChannel {
  void* base = nullptr;
  uint64_t bytes = 0;
  ring::Channel ch;
  int sq_efd = -1, cq_efd = -1;
};

Stats bare_pingpong(int clients, int iters) {
  auto g = *ring::Geometry::make(1024, 0);
  std::vector<BareChannel> chans(static_cast<size_t>(clients));
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  for (auto& c : chans) {
    int fd = ::memfd_create("bench-ring", MFD_CLOEXEC);
    if (::ftruncate(fd, static_cast<off_t>(g.total_bytes)) != 0) std::abort();
    c.base = ::mmap(nullptr, g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    c.bytes = g.total_bytes;
    ring::init(c.base, g);
    c.ch = ring::channel(c.base, g);
    c.sq_efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c.cq_efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = c.sq_efd;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, c.sq_efd, &ev);
  }
  std::atomic<bool> stop{false};
  std::thread server([&] {
    auto last = Clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      size_t work = 0;
      for (auto& c : chans) {
        while (const ring::SubmitEntry* r = c.ch.sq.peek()) {
          ring::CompletionEntry out{};
          out.id = r->id;
          out.result[0] = r->args[0];
          c.ch.sq.pop();
          c.ch.cq.try_push(out);
          ++work;
        }
        if (work && c.ch.cq.consumer_needs_doorbell()) ring::ring_doorbell(c.cq_efd);
      }
      if (work) {
        last = Clock::now();
        continue;
      }
      if (Clock::now() - last < kSpin) continue;
      bool sleep = true;
      for (auto& c : chans) sleep = sleep && c.ch.sq.prepare_sleep();
      if (sleep) {
        epoll_event evs[16];
        int n = ::epoll_wait(ep, evs, 16, 10);
        for (int i = 0; i < n; ++i) ring::drain_doorbell(evs[i].data.fd);
      }
      for (auto& c : chans) c.ch.sq.end_sleep();
      last = Clock::now() - kSpin / 2;
    }
  });
  std::vector<std::vector<double>> lat(static_cast<size_t>(clients));
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int k = 0; k < clients; ++k) {
    ts.emplace_back([&, k] {
      auto& c = chans[static_cast<size_t>(k)];
      auto& v = lat[static_cast<size_t>(k)];
      v.reserve(static_cast<size_t>(iters));
      for (int i = 0; i < iters + iters / 10; ++i) {
        ring::SubmitEntry e{};
        e.id = static_cast<uint64_t>(i);
        const auto a = Clock::now();
        while (!c.ch.sq.try_push(e)) {
        }
        if (c.ch.sq.consumer_needs_doorbell()) ring::ring_doorbell(c.sq_efd);
        wait_one(c.ch.cq, c.cq_efd, [&] {
          if (!c.ch.cq.peek()) return false;
          c.ch.cq.pop();
          return true;
        });
        if (i >= iters / 10) v.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
      }
    });
  }
  for (auto& t : ts) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count() * iters / (iters + iters / 10);
  stop = true;
  server.join();
  for (auto& c : chans) {
    ::munmap(c.base, c.bytes);
    ::close(c.sq_efd);
    ::close(c.cq_efd);
  }
  ::close(ep);
  return summarize(lat, wall);
}

// ---- through kvferryd (in-process daemon core, clients over its socket and rings) ----
Stats daemon_pingpong(const std::string& socket, int clients, int iters) {
  std::vector<std::unique_ptr<Client>> cs;
  for (int k = 0; k < clients; ++k) {
    Client::Options o;
    o.socket = socket;
    o.name = "bench-" + std::to_string(k);
    o.spin_us = kSpin.count();
    auto c = Client::connect(o);
    if (!c.ok()) {
      std::fprintf(stderr, "ipc: %s\n", c.status().to_string().c_str());
      return {};
    }
    cs.push_back(std::move(*c));
  }
  std::vector<std::vector<double>> lat(static_cast<size_t>(clients));
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int k = 0; k < clients; ++k) {
    ts.emplace_back([&, k] {
      Client& c = *cs[static_cast<size_t>(k)];
      auto& v = lat[static_cast<size_t>(k)];
      v.reserve(static_cast<size_t>(iters));
      ring::CompletionEntry ce[1];
      for (int i = 0; i < iters + iters / 10; ++i) {
        const auto a = Clock::now();
        while (!c.ping(static_cast<uint64_t>(i), 1).ok()) {
        }
        auto r = c.wait(ce, 1'000'000);
        if (!r.ok()) {
          std::fprintf(stderr, "ipc: %s\n", r.status().to_string().c_str());
          return;
        }
        if (i >= iters / 10) v.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
      }
    });
  }
  for (auto& t : ts) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count() * iters / (iters + iters / 10);
  return summarize(lat, wall);
}

int run_ipc(const Options& opts) {
  spdlog::set_level(spdlog::level::warn);
  config::Config cfg;
  cfg.daemon.socket = "/tmp/kvferry-bench-" + std::to_string(::getpid()) + ".sock";
  cfg.device.backend = config::Backend::kCpu;
  cfg.limits.ring_entries = 1024;
  cfg.daemon.metrics_listen = "";          // no HTTP port to clash with a running daemon
  cfg.host.capacity = uint64_t{64} << 20;  // pings need no host pool
  auto d = daemon::Daemon::create(cfg);
  if (!d.ok()) {
    std::fprintf(stderr, "ipc: %s\n", d.status().to_string().c_str());
    return 1;
  }
  std::thread runner([&] { (void)(*d)->run(); });
  Report rep("ipc");
  const int iters1 = opts.quick ? 5000 : 50000;
  const int iters8 = opts.quick ? 1000 : 10000;
  rep.note("cores: " + std::to_string(std::thread::hardware_concurrency()) + "; spin " + std::to_string(kSpin.count()) +
           " us then eventfd with a sleeping flag, both sides");
  for (int clients : {1, 8}) {
    const int iters = clients == 1 ? iters1 : iters8;
    Stats bare = bare_pingpong(clients, iters);
    Stats dmn = daemon_pingpong(cfg.daemon.socket, clients, iters);
    const std::string tag = std::to_string(clients) + (clients == 1 ? " client" : " clients");
    const std::string limit = "bare memfd ring, " + tag;
    rep.add({"ping rtt p50, " + tag, dmn.p50_us, "us", bare.p50_us, limit, false, 0,
             clients == 1 ? "target <= 1.5 us" : "target <= 30 us"});
    rep.add({"ping rtt p99, " + tag, dmn.p99_us, "us", bare.p99_us, limit, false, 0,
             clients == 1 ? "target <= 5 us" : "target <= 200 us"});
    rep.add({"ping ops/s, " + tag, dmn.ops_per_s, "ops/s", bare.ops_per_s, limit, true, clients == 8 ? 0.8 : 0, ""});
  }
  (*d)->stop();
  runner.join();
  return rep.finish(opts);
}

}  // namespace

KVFERRY_BENCH_SUITE("ipc", "ping round trip through kvferryd's rings (1 and 8 clients) vs a bare memfd ring", run_ipc);

}  // namespace kvferry::bench
