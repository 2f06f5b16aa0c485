// kvferry-bench roundtrip: save and load of N blocks through kvferryd (client -> ring -> daemon ->
// copy -> completion) for block sizes 64 KiB .. 4 MiB, each next to a bare copy of the same runs
// measured in the same run (CPU backend: memcpy of the same runs; CUDA: cudaMemcpyAsync of the
// same runs between the region and a pinned buffer, plus a pinned 1 GiB copy), and lookup
// latency p50/p99 with 8 clients next to a ping through the same rings.
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>
#include <thread>
#include <vector>

#include "bench.h"
#include "kvferry/connector/client.h"
#include "kvferry/daemon/daemon.h"
#include "kvferry/kernels/device.h"
#include "kvferry/store/block_key.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry::bench {
namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

struct Pct {
  double p50 = 0, p99 = 0;
};
Pct percentiles(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[std::min(v.size() - 1, v.size() * 99 / 100)]};
}

/// Runs requests over items [0, n) with up to 8 in flight: submit(first, count) queues one of
/// the `count` items from `first` (`batch`, or more where `extend(first, count)` says a request
/// must not end there) and returns its id. Seconds for all, or the first failure.
Result<double> pipelined(Client& c, size_t n, size_t batch, const char* what,
                         const std::function<Result<uint64_t>(size_t, size_t)>& submit,
                         const std::function<bool(size_t, size_t)>& extend = {}) {
  const auto t0 = Clock::now();
  std::vector<uint64_t> inflight;
  size_t next = 0;
  constexpr size_t kDepth = 8;
  while (next < n || !inflight.empty()) {
    while (next < n && inflight.size() < kDepth) {
      size_t count = std::min(batch, n - next);
      while (extend && next + count < n && extend(next, count)) ++count;
      auto id = submit(next, count);
      if (!id.ok()) return id.status();
      inflight.push_back(*id);
      next += count;
    }
    auto r = c.wait_op(inflight.front(), 60'000'000);
    if (!r.ok()) return r.status();
    if (r->status != ErrorCode::kOk)
      return Status(r->status,
                    std::string(what) + ": " + std::to_string(r->blocks.size() - r->done) + " entries failed");
    inflight.erase(inflight.begin());
  }
  return secs(t0);
}

/// Pipelined save or load of every block: batches of `batch` keys.
Result<double> transfer(Client& c, bool load, uint32_t region, const std::vector<ops::Key>& keys,
                        const std::vector<int64_t>& ids, size_t batch) {
  return pipelined(c, keys.size(), batch, load ? "load" : "save", [&](size_t first, size_t n) {
    const std::span<const ops::Key> k(keys.data() + first, n);
    const std::span<const int64_t> b(ids.data() + first, n);
    return load ? c.submit_load(region, k, b) : c.submit_save(region, k, b);
  });
}

struct Bare {
  double save_s = 0, load_s = 0;
};

/// The same runs copied without the daemon: host memcpy (CPU) or cudaMemcpyAsync (CUDA), region
/// <-> a buffer of N blocks.
Bare bare_copy(uint8_t* region, bool device, int64_t block_bytes, int64_t n, std::vector<uint8_t>* host_buf,
               void* pinned) {
  Bare b;
  if (!device) {
    uint8_t* dst = host_buf->data();
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * block_bytes, region + i * block_bytes, block_bytes);
    b.save_s = secs(t0);
    t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) std::memcpy(region + (n + i) * block_bytes, dst + i * block_bytes, block_bytes);
    b.load_s = secs(t0);
    return b;
  }
#if defined(KVFERRY_WITH_CUDA)
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto* p = static_cast<uint8_t*>(pinned);
  auto t0 = Clock::now();
  for (int64_t i = 0; i < n; ++i)
    cudaMemcpyAsync(p + i * block_bytes, region + i * block_bytes, block_bytes, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  b.save_s = secs(t0);
  t0 = Clock::now();
  for (int64_t i = 0; i < n; ++i)
    cudaMemcpyAsync(region + (n + i) * block_bytes, p + i * block_bytes, block_bytes, cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s);
  b.load_s = secs(t0);
  cudaStreamDestroy(s);
#else
  (void)pinned;
#endif
  return b;
}

/// Lookup (16 keys) and ping round trips from `clients` threads, each with its own connection.
std::pair<Pct, Pct> lookup_latency(const std::string& socket, uint32_t region, const std::vector<ops::Key>& keys,
                                   int clients, int iters) {
  std::vector<std::unique_ptr<Client>> cs;
  for (int k = 0; k < clients; ++k) {
    Client::Options o;
    o.socket = socket;
    o.name = "bench-lookup";
    o.model = "bench";
    auto c = Client::connect(o);
    if (!c.ok()) return {};
    if (!(*c)->map_region(region).ok()) return {};
    cs.push_back(std::move(*c));
  }
  std::vector<std::vector<double>> lk(clients), pg(clients);
  std::vector<std::thread> ts;
  ts.reserve(clients);
  for (int k = 0; k < clients; ++k)
    ts.emplace_back([&, k] {
      Client& c = *cs[k];
      std::span<const ops::Key> probe(keys.data(), std::min<size_t>(16, keys.size()));
      ring::CompletionEntry ce[1];
      for (int i = 0; i < iters; ++i) {
        auto a = Clock::now();
        auto r = c.lookup(region, probe, 1'000'000);
        if (!r.ok()) return;
        lk[k].push_back(secs(a) * 1e6);
        a = Clock::now();
        if (!c.ping(static_cast<uint64_t>(i), 0).ok() || !c.wait(ce, 1'000'000).ok()) return;
        pg[k].push_back(secs(a) * 1e6);
      }
    });
  for (auto& t : ts) t.join();
  std::vector<double> all_lk, all_pg;
  for (int k = 0; k < clients; ++k) {
    all_lk.insert(all_lk.end(), lk[k].begin() + std::min<size_t>(lk[k].size(), iters / 10), lk[k].end());
    all_pg.insert(all_pg.end(), pg[k].begin() + std::min<size_t>(pg[k].size(), iters / 10), pg[k].end());
  }
  return {percentiles(all_lk), percentiles(all_pg)};
}

/// A hostile neighbour for the lookup rows: a client that floods the control socket with status
/// requests and never reads the replies (reconnecting when the daemon drops it), and a client of
/// another tenant that pins every block it stored, then unpins and pins them again, and keeps
/// saves of its own queued. Runs until stop is set.
class HostileNeighbour {
 public:
  HostileNeighbour(const std::string& socket, uint32_t region, int64_t blocks) {
    threads_.emplace_back([this, socket] { non_reader(socket); });
    threads_.emplace_back([this, socket, region, blocks] { pin_hog(socket, region, blocks); });
  }
  ~HostileNeighbour() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  uint64_t reconnects() const { return reconnects_; }
  uint64_t pins() const { return pins_; }

 private:
  void non_reader(const std::string& socket) {
    const auto frame = proto::encode_status_request();
    while (!stop_) {
      const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      int small = 4096;
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::strncpy(a.sun_path, socket.c_str(), sizeof a.sun_path - 1);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
        ++reconnects_;
        // Requests until the daemon stops taking them (or drops us); never a read.
        for (int i = 0; i < 100000 && !stop_; ++i)
          if (::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            if (errno != EAGAIN) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
      }
      ::close(fd);
    }
  }
  void pin_hog(const std::string& socket, uint32_t region, int64_t blocks) {
    Client::Options o;
    o.socket = socket;
    o.name = "bench-pin-hog";
    o.model = "bench";
    o.tenant = "hog";
    auto c = Client::connect(o);
    if (!c.ok()) return;
    std::vector<ops::Key> keys(static_cast<size_t>(blocks));
    std::vector<int64_t> ids(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      keys[i] = {0xB0C0, i};
      ids[i] = static_cast<int64_t>(i);
    }
    (void)(*c)->save(region, keys, ids);
    uint64_t round = 0;
    while (!stop_) {
      auto p = (*c)->pin(region, keys, 1'000'000);
      if (p.ok()) pins_ += p->done;
      // A save of fresh keys queued behind the pins keeps the workers busy for this tenant.
      std::vector<ops::Key> fresh(keys.size());
      for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = {0xF00D + round, i};
      auto s = (*c)->submit_save(region, fresh, ids);
      (void)(*c)->unpin(region, keys, 1'000'000);
      if (s.ok()) (void)(*c)->wait_op(*s, 5'000'000);
      (void)(*c)->evict(region, fresh, 0, 1'000'000);
      ++round;
    }
  }
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> reconnects_{0}, pins_{0};
  std::vector<std::thread> threads_;
};

/// One daemon configuration of the data path (the sweep compares several in one run).
struct Variant {
  std::string name;
  int workers = 0;              ///< 0 = the daemon's default
  int hash_threads = -1;        ///< -1 = default
  int64_t pipeline_bytes = -1;  ///< -1 = default, 0 = whole batches
};

/// "w4:h7:p8" -> 4 workers, 7 hashing threads, 8 MiB sub-batches (each part optional).
Variant parse_variant(const std::string& s) {
  Variant v;
  v.name = s;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = std::min(s.find(':', i), s.size());
    const std::string part = s.substr(i, j - i);
    if (part.size() > 1) {
      const long long x = std::atoll(part.c_str() + 1);
      if (part[0] == 'w') v.workers = static_cast<int>(x);
      if (part[0] == 'h') v.hash_threads = static_cast<int>(x);
      if (part[0] == 'p') v.pipeline_bytes = static_cast<int64_t>(x) << 20;
    }
    i = j + 1;
  }
  return v;
}

/// Sum of the samples of one metric line prefix (`name{labels}`) in Prometheus text.
double metric(const std::string& text, const std::string& series) {
  const size_t at = text.find(series + " ");
  if (at == std::string::npos) return 0;
  return std::atof(text.c_str() + at + series.size() + 1);
}

struct Phases {
  double prepare = 0, enqueue = 0, dma_wait = 0, hash = 0, total = 0;  // microseconds
};
Phases phases(const std::string& text, const char* op) {
  auto m = [&](const char* ph) {
    return metric(text,
                  std::string("kvferry_transfer_phase_microseconds_total{op=\"") + op + "\",phase=\"" + ph + "\"}");
  };
  return {m("prepare"), m("enqueue"), m("dma_wait"), m("hash"), m("total")};
}
Phases operator-(const Phases& a, const Phases& b) {
  return {a.prepare - b.prepare, a.enqueue - b.enqueue, a.dma_wait - b.dma_wait, a.hash - b.hash, a.total - b.total};
}
std::string describe(const Phases& p, double wall_s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "worker time %.1f ms over %.1f ms wall: dma_wait %.1f, hash %.1f, enqueue %.1f, prepare %.1f ms",
                p.total / 1e3, wall_s * 1e3, p.dma_wait / 1e3, p.hash / 1e3, p.enqueue / 1e3, p.prepare / 1e3);
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct SizeResult {
  int64_t block = 0, n = 0;
  double save_gbs = 0, load_gbs = 0, bare_save_gbs = 0, bare_load_gbs = 0;
  Phases save_ph, load_ph;
  double save_wall = 0, load_wall = 0;
};

/// A daemon run in this process (CUDA backend when a device is there) for the suite's rows, on
/// its own socket; stopped when destroyed.
struct InProcDaemon {
  config::Config cfg;
  std::unique_ptr<daemon::Daemon> d;
  std::thread runner;
  bool start(const Options& opts, uint64_t pool_bytes, const daemon::Daemon::Options& dopts, const char* tag) {
    cfg.daemon.socket = std::string("/tmp/kvferry-bench-") + tag + "-" + std::to_string(::getpid()) + ".sock";
    cfg.daemon.metrics_listen = "";
    cfg.device.backend = cuda_device_count() > 0 ? config::Backend::kCuda : config::Backend::kCpu;
    cfg.device.gpu = opts.device;
    cfg.host.capacity = pool_bytes;
    cfg.host.high_watermark = 0.99;
    cfg.host.low_watermark = 0.9;
    auto r = daemon::Daemon::create(cfg, dopts);
    if (!r.ok()) {
      std::fprintf(stderr, "roundtrip: %s\n", r.status().to_string().c_str());
      return false;
    }
    d = std::move(*r);
    runner = std::thread([this] { (void)d->run(); });
    return true;
  }
  /// A client of model "bench"; null (said on stderr) when it cannot connect.
  std::unique_ptr<Client> connect(const std::string& name) const {
    Client::Options o;
    o.socket = cfg.daemon.socket;
    o.name = name;
    o.model = "bench";
    for (int i = 0; i < 200; ++i) {  // the daemon starts on the other thread
      auto r = Client::connect(o);
      if (r.ok()) return std::move(*r);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::fprintf(stderr, "roundtrip: cannot connect to the in-process daemon\n");
    return nullptr;
  }
  ~InProcDaemon() {
    if (!d) return;
    d->stop();
    runner.join();
  }
};

/// Runs a daemon of `v` in this process and measures save/load of every size in `sizes` (median
/// of `reps` rounds, the bare copy likewise). With `lookups`, also the lookup latency rows.
int measure(const Options& opts, const Variant& v, const std::vector<int64_t>& sizes, int64_t max_total,
            int64_t max_blocks, int reps, bool lookups, Report& rep, std::vector<SizeResult>* out) {
  config::Config cfg;
  daemon::Daemon::Options dopts;
  dopts.data_workers = v.workers;
  dopts.hash_threads = v.hash_threads;
  dopts.pipeline_bytes = v.pipeline_bytes;
  InProcDaemon ipd;
  if (!ipd.start(opts, static_cast<uint64_t>(max_total) + (uint64_t{256} << 20), dopts, "rt")) return 1;
  cfg = ipd.cfg;
  auto& d = ipd.d;
  int rc = 0;
  {
    std::unique_ptr<Client> c = ipd.connect("bench-roundtrip");
    if (!c) rc = 1;
    uint32_t last_region = 0;
    std::vector<ops::Key> last_keys;
    for (int64_t bb : sizes) {
      if (!c) break;
      // mha:bf16:1x128 is 512 B per token; 64-token pages of 32 KiB; layers make up the block.
      const int64_t layers = bb / (32 << 10);
      const int64_t n = std::min(max_blocks, max_total / bb);
      const KvCacheSpec spec{layers, 2 * n, 64, EntryFormat::mha(1, 128, DType::kBF16), Layout::kBlockMajor};
      if (spec.block_bytes() != bb) {
        std::fprintf(stderr, "roundtrip: block of %lld bytes, wanted %lld\n", (long long)spec.block_bytes(),
                     (long long)bb);
        rc = 1;
        break;
      }
      auto rid = c->create_region("bench-" + v.name + "-" + human_bytes(bb), spec);
      if (!rid.ok()) {
        std::fprintf(stderr, "roundtrip: %s\n", rid.status().to_string().c_str());
        rc = 1;
        break;
      }
      auto base = c->map_region(*rid);
      auto lv = c->layer_view(*rid, 0);
      if (!base.ok() || !lv.ok()) {
        rc = 1;
        break;
      }
      auto* region = static_cast<uint8_t*>(*base);
      const bool device = lv->on_device;
      std::vector<uint8_t> pattern(static_cast<size_t>(bb));
      for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + 7);
      for (int64_t b = 0; b < n; ++b) {
#if defined(KVFERRY_WITH_CUDA)
        if (device) {
          cudaMemcpy(region + b * bb, pattern.data(), bb, cudaMemcpyHostToDevice);
          continue;
        }
#endif
        std::memcpy(region + b * bb, pattern.data(), static_cast<size_t>(bb));
      }
      std::vector<ops::Key> keys(static_cast<size_t>(n));
      std::vector<int64_t> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        keys[i] = {static_cast<uint64_t>(bb), static_cast<uint64_t>(i)};
        src[i] = i;
        dst[i] = n + i;
      }
      const size_t batch = static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(256, (256 << 20) / bb)));
      std::vector<double> sv, ld;
      std::vector<Phases> sph, lph;  // the breakdown of each round
      SizeResult sr;
      sr.block = bb;
      sr.n = n;
      for (int r = 0; r < reps && rc == 0; ++r) {
        const std::string m0 = d->metrics_text();
        auto s = transfer(*c, false, *rid, keys, src, batch);
        const std::string m1 = d->metrics_text();
        auto l = s.ok() ? transfer(*c, true, *rid, keys, dst, batch) : Result<double>(s.status());
        const std::string m2 = d->metrics_text();
        if (!s.ok() || !l.ok()) {
          std::fprintf(stderr, "roundtrip %s: %s\n", human_bytes(bb).c_str(),
                       (!s.ok() ? s.status() : l.status()).to_string().c_str());
          rc = 1;
          break;
        }
        sv.push_back(*s);
        ld.push_back(*l);
        sph.push_back(phases(m1, "save") - phases(m0, "save"));
        lph.push_back(phases(m2, "load") - phases(m1, "load"));
        if (r + 1 < reps) (void)c->evict(*rid, {}, ops::kEvictAll);
      }
      if (rc) break;
      std::vector<uint8_t> host_buf;
      void* pinned = nullptr;
      if (!device) host_buf.resize(static_cast<size_t>(n * bb));
#if defined(KVFERRY_WITH_CUDA)
      if (device && cudaMallocHost(&pinned, static_cast<size_t>(n * bb)) != cudaSuccess) pinned = nullptr;
#endif
      std::vector<double> bs, bl;
      for (int r = 0; r < reps; ++r) {
        Bare bare = bare_copy(region, device, bb, n, &host_buf, pinned);
        bs.push_back(bare.save_s);
        bl.push_back(bare.load_s);
      }
#if defined(KVFERRY_WITH_CUDA)
      if (pinned) cudaFreeHost(pinned);
#endif
      auto median_round = [](const std::vector<double>& t) {  // index of the median time
        std::vector<size_t> ix(t.size());
        std::iota(ix.begin(), ix.end(), size_t{0});
        std::sort(ix.begin(), ix.end(), [&](size_t a, size_t b) { return t[a] < t[b]; });
        return ix[ix.size() / 2];
      };
      sr.save_ph = sph[median_round(sv)];
      sr.save_wall = sv[median_round(sv)];
      sr.load_ph = lph[median_round(ld)];
      sr.load_wall = ld[median_round(ld)];
      const double bytes = static_cast<double>(n * bb);
      sr.save_gbs = bytes / median(sv) / 1e9;
      sr.load_gbs = bytes / median(ld) / 1e9;
      sr.bare_save_gbs = bytes / median(bs) / 1e9;
      sr.bare_load_gbs = bytes / median(bl) / 1e9;
      const std::string tag = human_bytes(bb) + " x " + std::to_string(n);
      const std::string lim = device ? "cudaMemcpyAsync of the same runs, pinned" : "memcpy of the same runs";
      const std::string pre = v.name.empty() ? "" : "[" + v.name + "] ";
      const double target = v.name.empty() && bb >= (1 << 20) ? 0.9 : 0;
      rep.add({pre + "save " + tag, sr.save_gbs, "GB/s", sr.bare_save_gbs, lim, true, target, ""});
      rep.add({pre + "load " + tag, sr.load_gbs, "GB/s", sr.bare_load_gbs, lim, true, target, ""});
      rep.note(pre + "save " + tag + ": " + describe(sr.save_ph, sr.save_wall));
      rep.note(pre + "load " + tag + ": " + describe(sr.load_ph, sr.load_wall));
      if (out) out->push_back(sr);
      (void)c->evict(*rid, {}, ops::kEvictAll);
      last_region = *rid;
      last_keys = keys;
    }
    // Lookup latency with 8 clients (blocks of the last size stay stored for hits).
    if (lookups && c && rc == 0 && last_region) {
      std::vector<int64_t> src16(std::min<size_t>(last_keys.size(), 16));
      std::iota(src16.begin(), src16.end(), 0);
      std::vector<ops::Key> k16(last_keys.begin(), last_keys.begin() + static_cast<long>(src16.size()));
      (void)c->save(last_region, k16, src16);
      const int iters = opts.quick ? 500 : 5000;
      auto [lk, pg] = lookup_latency(cfg.daemon.socket, last_region, k16, 8, iters);
      rep.add({"lookup 16 keys p50, 8 clients", lk.p50, "us", pg.p50, "ping p50 through the same rings", false, 0, ""});
      rep.add({"lookup 16 keys p99, 8 clients", lk.p99, "us", pg.p99, "ping p99 through the same rings", false, 0, ""});
      // The same with a hostile neighbour (a non-reader and a pin hog of another tenant) next to
      // a clean run taken right before it: the others' p99 stays within 1.5x (ratio >= 0.67).
      auto [clean, clean_pg] = lookup_latency(cfg.daemon.socket, last_region, k16, 8, iters);
      Pct hostile;
      uint64_t reconnects = 0, pins = 0;
      {
        HostileNeighbour h(cfg.daemon.socket, last_region, std::min<int64_t>(64, max_blocks));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        hostile = lookup_latency(cfg.daemon.socket, last_region, k16, 8, iters).first;
        reconnects = h.reconnects();
        pins = h.pins();
      }
      rep.add({"lookup 16 keys p99, 8 clients, hostile neighbour", hostile.p99, "us", clean.p99,
               "the same without it, this run", false, 1.0 / 1.5, ""});
      rep.add({"lookup 16 keys p50, 8 clients, hostile neighbour", hostile.p50, "us", clean.p50,
               "the same without it, this run", false, 0, ""});
      rep.note("hostile neighbour: a control-socket non-reader (" + std::to_string(reconnects) +
               " connections, each dropped by the daemon when its replies stalled) and a pin hog of another tenant (" +
               std::to_string(pins) + " pins, a save of its own queued each round)");
    }
  }
  return rc;
}

/// Mapped loads in batches of about `batch` entries that end on a region block.
Result<double> transfer_mapped(Client& c, uint32_t region, const std::vector<ops::Key>& keys,
                               const std::vector<int64_t>& ids, const std::vector<int32_t>& parts, size_t batch) {
  return pipelined(
      c, keys.size(), batch, "load_mapped",
      [&](size_t first, size_t n) {
        return c.submit_load_mapped(region, std::span(keys).subspan(first, n), std::span(ids).subspan(first, n),
                                    std::span(parts).subspan(first, n));
      },
      [&](size_t first, size_t n) { return ids[first + n] == ids[first + n - 1]; });  // a region block stays whole
}

/// Loads across geometries (1 MiB stored blocks): 64-token pages into 16-token ones (mla_bf16,
/// 14 layers) and a TP 1 -> 2 rank's heads out of full-head blocks (mha:bf16:8x128, 16 layers of
/// 16 tokens; NHD and HND), each next to a load of the same stored blocks into their own geometry
/// in the same daemon and run. GB/s count the stored bytes a load consumes (a TP 2 rank writes
/// half of them).
int geometry_rows(const Options& opts, Report& rep) {
  const int64_t n = opts.quick ? 128 : 4096;
  const int reps = opts.quick ? 1 : 3;
  InProcDaemon ipd;
  if (!ipd.start(opts, static_cast<uint64_t>(n) * (1 << 20) + (uint64_t{512} << 20), {}, "geo")) return 1;
  auto c = ipd.connect("bench-geometry");
  if (!c) return 1;
  struct Case {
    std::string name;
    KvCacheSpec saved, loaded;
  };
  const auto mha = [](int32_t heads, MhaOrder o, int32_t first) {
    return EntryFormat::mha_slice(heads, 128, DType::kBF16, o, first, 8);
  };
  const std::vector<Case> cases = {
      {"load 64->16 token pages (mla_bf16)",
       {14, 2 * n, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor},
       {14, 4 * n, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor}},
      {"load TP 1->2 heads (mha:bf16:8x128 nhd)",
       {16, 2 * n, 16, mha(8, MhaOrder::kNHD, 0), Layout::kBlockMajor},
       {16, n, 16, mha(4, MhaOrder::kNHD, 4), Layout::kBlockMajor}},
      {"load TP 1->2 heads (mha:bf16:8x128 hnd)",
       {16, 2 * n, 16, mha(8, MhaOrder::kHND, 0), Layout::kBlockMajor},
       {16, n, 16, mha(4, MhaOrder::kHND, 4), Layout::kBlockMajor}},
  };
  const bool device = cuda_device_count() > 0;
  int k = 0;
  for (const Case& cs : cases) {
    ++k;
    auto a = c->create_region("geo-saved-" + std::to_string(k), cs.saved);
    auto b = a.ok() ? c->create_region("geo-loaded-" + std::to_string(k), cs.loaded) : a;
    if (!a.ok() || !b.ok()) {
      std::fprintf(stderr, "roundtrip geometry: %s\n", (a.ok() ? b : a).status().to_string().c_str());
      return 1;
    }
    const int64_t bb = cs.saved.block_bytes();
    std::vector<ops::Key> keys(static_cast<size_t>(n));
    std::vector<int64_t> src(static_cast<size_t>(n)), same(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      keys[static_cast<size_t>(i)] = {0x6E0ull << 48 | static_cast<uint64_t>(k), static_cast<uint64_t>(i)};
      src[static_cast<size_t>(i)] = i;
      same[static_cast<size_t>(i)] = n + i;
    }
    const size_t batch = static_cast<size_t>(std::max<int64_t>(1, (256 << 20) / bb));
    if (auto sv = transfer(*c, false, *a, keys, src, batch); !sv.ok()) {
      std::fprintf(stderr, "roundtrip geometry save: %s\n", sv.status().to_string().c_str());
      return 1;
    }
    std::vector<ops::Key> mk;
    std::vector<int64_t> mb;
    std::vector<int32_t> mp;
    if (cs.saved.block_size != cs.loaded.block_size) {
      std::vector<int64_t> ids(static_cast<size_t>(n * cs.saved.block_size / cs.loaded.block_size));
      std::iota(ids.begin(), ids.end(), int64_t{0});
      if (!Client::page_map(keys, cs.saved.block_size, ids, cs.loaded.block_size, &mk, &mb, &mp).ok()) return 1;
    } else {  // one stored block per rank block: part 0
      mk = keys;
      mb = src;
      mp.assign(keys.size(), 0);
    }
    std::vector<double> t_same, t_map;
    for (int r = 0; r < reps; ++r) {
      auto ts = transfer(*c, true, *a, keys, same, batch);
      auto tm = transfer_mapped(
          *c, *b, mk, mb, mp,
          batch * static_cast<size_t>(std::max<int64_t>(1, cs.saved.block_size / cs.loaded.block_size)));
      if (!ts.ok() || !tm.ok()) {
        std::fprintf(stderr, "roundtrip geometry: %s\n", (ts.ok() ? tm : ts).status().to_string().c_str());
        return 1;
      }
      t_same.push_back(*ts);
      t_map.push_back(*tm);
    }
    const double bytes = static_cast<double>(n * bb);
    rep.add({cs.name + " " + human_bytes(bb) + " x " + std::to_string(n), bytes / median(t_map) / 1e9, "GB/s",
             bytes / median(t_same) / 1e9, "load of the same blocks, same geometry, this run", true, 0.9,
             device ? "CUDA region" : "cpu region"});
    (void)c->evict(*a, {}, ops::kEvictAll);
  }
  return 0;
}

/// The Python package's save/load of 1 MiB blocks next to the C ABI called directly (ctypes, keys
/// and ids prepared once: the C++ client's path), both from python/bench/roundtrip.py in one run
/// against its own daemon. The Python is $KVFERRY_PYTHON, else the venv scripts/test-python.sh
/// makes (build/py-venv); without one that imports kvferry and numpy the rows are skipped, said in a
/// note.
void python_rows(const Options& opts, Report& rep) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return;
  exe[n] = 0;
  std::string bin(exe);
  bin = bin.substr(0, bin.rfind('/'));                      // build/bin
  const std::string build = bin.substr(0, bin.rfind('/'));  // build
  std::string py;
  if (const char* e = std::getenv("KVFERRY_PYTHON"); e && *e)
    py = e;
  else if (::access((build + "/py-venv/bin/python").c_str(), X_OK) == 0)
    py = build + "/py-venv/bin/python";
  const std::string env = "KVFERRYD='" + bin + "/kvferryd' KVFERRY_LIBRARY='" + build + "/lib/libkvferry.so' ";
  if (py.empty() || std::system((env + "'" + py + "' -c 'import kvferry, numpy' >/dev/null 2>&1").c_str()) != 0) {
    rep.note(
        "python rows skipped: no Python that imports kvferry and numpy (set KVFERRY_PYTHON, or run "
        "scripts/test-python.sh, which makes build/py-venv)");
    return;
  }
  const std::string json = "/tmp/kvferry-bench-py-" + std::to_string(::getpid()) + ".json";
  const int blocks = opts.quick ? 256 : 4096;
  const std::string cmd = env + "'" + py + "' " + KVFERRY_SOURCE_DIR + "/python/bench/roundtrip.py --blocks " +
                          std::to_string(blocks) + " --block-mib 1 --rounds " + (opts.quick ? "1" : "3") + " --json " +
                          json + " >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    rep.note("python rows: python/bench/roundtrip.py failed (run it by hand to see why)");
    ::unlink(json.c_str());
    return;
  }
  std::ifstream f(json);
  std::stringstream ss;
  ss << f.rdbuf();
  ::unlink(json.c_str());
  const auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.contains("rows")) return;
  for (const auto& r : j["rows"]) {
    const std::string op = r.value("op", "?");
    rep.add({"python package " + op + " 1MiB x" + std::to_string(blocks), r.value("package_gbps", 0.0), "GB/s",
             r.value("c_abi_gbps", 0.0), "C ABI via ctypes, same run", true, 0.95,
             "python/bench/roundtrip.py, its own daemon (cpu backend)"});
  }
}

int run_roundtrip(const Options& opts) {
  spdlog::set_level(spdlog::level::warn);
  const bool cuda = cuda_device_count() > 0;
  const int64_t max_total = opts.quick ? (int64_t{256} << 20) : (int64_t{4} << 30);  // bytes per size
  const int64_t max_blocks = opts.quick ? 256 : 4096;
  const int reps = opts.quick ? 1 : 3;
  const std::vector<int64_t> sizes = opts.quick ? std::vector<int64_t>{64 << 10, 1 << 20}
                                                : std::vector<int64_t>{64 << 10, 256 << 10, 1 << 20, 4 << 20};
  Report rep("roundtrip");
  rep.note(std::string("backend ") + (cuda ? "cuda (GPU region, page-locked host pool)" : "cpu (memfd region)") + "; " +
           std::to_string(std::thread::hardware_concurrency()) +
           " cores; checksums on (XXH3 on save, verified on load); each figure and its limit are the median of " +
           std::to_string(reps) + " rounds");
  {  // the checksum's own speed: one thread, 4 MiB blocks of a 256 MiB buffer (out of cache)
    const size_t total = size_t{256} << 20, blk = size_t{4} << 20;
    std::vector<uint8_t> buf(total);
    for (size_t i = 0; i < total; i += 4096) buf[i] = static_cast<uint8_t>(i >> 12);
    uint64_t acc = 0;
    const auto t0 = Clock::now();
    for (size_t o = 0; o < total; o += blk) acc ^= store::block_checksum(buf.data() + o, blk);
    const double fast = static_cast<double>(total) / secs(t0) / 1e9;
    const auto t1 = Clock::now();
    for (size_t o = 0; o < total; o += blk) acc ^= store::block_checksum_baseline(buf.data() + o, blk);
    const double base = static_cast<double>(total) / secs(t1) / 1e9;
    char line[160];
    std::snprintf(line, sizeof line,
                  "block checksum (XXH3-64, %s build): %.1f GB/s on one thread; baseline build %.1f GB/s%s",
                  store::block_checksum_impl(), fast, base, acc == 42 ? " " : "");
    rep.note(line);
  }
  int rc = measure(opts, Variant{}, sizes, max_total, max_blocks, reps, true, rep, nullptr);
#if defined(KVFERRY_WITH_CUDA)
  if (cuda && rc == 0) {  // a pinned 1 GiB copy each way: the ceiling of the link
    const size_t g = opts.quick ? (size_t{256} << 20) : (size_t{1} << 30);
    void *h = nullptr, *dv = nullptr;
    if (cudaMallocHost(&h, g) == cudaSuccess && cudaMalloc(&dv, g) == cudaSuccess) {
      cudaMemcpy(dv, h, g, cudaMemcpyHostToDevice);
      auto t0 = Clock::now();
      cudaMemcpy(h, dv, g, cudaMemcpyDeviceToHost);
      const double d2h = g / secs(t0) / 1e9;
      t0 = Clock::now();
      cudaMemcpy(dv, h, g, cudaMemcpyHostToDevice);
      const double h2d = g / secs(t0) / 1e9;
      rep.note("pinned " + human_bytes(static_cast<int64_t>(g)) + " cudaMemcpy: D2H " + std::to_string(d2h) +
               " GB/s, H2D " + std::to_string(h2d) + " GB/s");
      for (const auto& r : std::vector<Row>(rep.rows()))
        if (r.unit == "GB/s")
          rep.add({r.name + " vs pinned 1GiB", r.value, "GB/s", r.name.rfind("save", 0) == 0 ? d2h : h2d,
                   "pinned " + human_bytes(static_cast<int64_t>(g)) + " cudaMemcpy", true, 0, ""});
    }
    if (dv) cudaFree(dv);
    if (h) cudaFreeHost(h);
  }
#endif
  // Optional sweep of data-path variants (KVFERRY_RT_SWEEP="w2:p32,w4:p8,..." or the suite's
  // extra arguments): 1 MiB and 4 MiB blocks, 2 GiB each, rows named by the variant.
  std::vector<std::string> sweep = opts.args;
  if (const char* env = std::getenv("KVFERRY_RT_SWEEP"); env && *env) {
    std::string e = env;
    for (size_t i = 0; i <= e.size();) {
      const size_t j = std::min(e.find(',', i), e.size());
      if (j > i) sweep.push_back(e.substr(i, j - i));
      i = j + 1;
    }
  }
  for (const std::string& s : sweep) {
    if (rc) break;
    rc = measure(opts, parse_variant(s), {1 << 20, 4 << 20}, opts.quick ? max_total : (int64_t{2} << 30), 4096, reps,
                 false, rep, nullptr);
  }
  if (rc == 0) rc = geometry_rows(opts, rep);
  if (rc == 0) python_rows(opts, rep);
  const int f = rep.finish(opts);
  return rc ? rc : f;
}

}  // namespace

KVFERRY_BENCH_SUITE("roundtrip",
                    "save and load of blocks through kvferryd (64 KiB .. 4 MiB) vs a bare copy of the same runs, "
                    "and lookup latency with 8 clients",
                    run_roundtrip);

}  // namespace kvferry::bench
