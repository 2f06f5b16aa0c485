// The data ops of kvferryd (data_ops.h).
#include "data_ops.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "kvferry/connector/ops.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/host_pool.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/offload.h"

namespace kvferry::daemon {

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kDefaultModel = "default";

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void set_status(ring::CompletionEntry& out, ErrorCode c) { out.status = static_cast<int16_t>(c); }

/// A fixed set of threads draining one queue of jobs.
class WorkerPool {
 public:
  explicit WorkerPool(int n) {
    for (int i = 0; i < std::max(1, n); ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() { stop(); }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }
  /// Runs what is queued, then joins. Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  bool running() const {
    std::lock_guard<std::mutex> g(mu_);
    return !stop_;
  }
  size_t queued() const {
    std::lock_guard<std::mutex> g(mu_);
    return jobs_.size();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

struct DataOps::Impl {
  Options opts;
  std::unique_ptr<store::HostPool> pool;
  std::unique_ptr<store::BlockIndex> index;
  store::Registry metrics;
  std::unique_ptr<store::OffloadService> svc;
  std::unique_ptr<WorkerPool> workers;
  RingService* rings = nullptr;
  std::atomic<int64_t> request_timeout_ms{30000};

  store::Counter* lookups_hit = nullptr;
  store::Counter* lookups_miss = nullptr;
  store::Histogram* op_seconds[proto::kOpTableSize] = {};

  /// The block namespace of `client` for blocks of `format`: model|family|tenant.
  store::NamespaceId ns_for(const ClientChannel& c, const EntryFormat& format) {
    const std::string model = c.model.empty() ? kDefaultModel : c.model;
    return index->intern_namespace(model + "|" + store::format_family(format) + "|" + c.tenant);
  }

  /// Checks that `count` entries of `op` (input + statuses) fit in the client's arena.
  Status check_arena(const ClientChannel& c, const ring::SubmitEntry& req) const {
    if (req.arena_offset % 8 != 0)
      return {ErrorCode::kMisaligned, "arena_offset " + std::to_string(req.arena_offset) + " is not 8-byte aligned"};
    const uint64_t need = ops::request_bytes(req.op, req.count);
    if (uint64_t{req.arena_offset} + need > c.ch.arena_bytes)
      return {ErrorCode::kOutOfRange, std::to_string(req.count) + " entries at arena offset " +
                                          std::to_string(req.arena_offset) + " need " + std::to_string(need) +
                                          " bytes, past the arena of " + std::to_string(c.ch.arena_bytes)};
    return Status::Ok();
  }

  std::vector<store::BlockKey> read_keys(const ClientChannel& c, const ring::SubmitEntry& req) const {
    std::vector<store::BlockKey> keys(req.count);
    const uint8_t* p = c.ch.arena + req.arena_offset;
    for (uint32_t i = 0; i < req.count; ++i) {
      ops::Key k;
      std::memcpy(&k, p + i * sizeof(ops::Key), sizeof k);
      keys[i] = {k.hi, k.lo};
    }
    return keys;
  }

  /// Writes per-key statuses after the input and points the completion at them.
  static void write_statuses(ClientChannel& c, const ring::SubmitEntry& req, const std::vector<ErrorCode>& st,
                             ring::CompletionEntry& out) {
    const uint64_t off = ops::status_offset(req.op, req.arena_offset, req.count);
    uint32_t done = 0;
    for (size_t i = 0; i < st.size(); ++i) {
      const int16_t v = static_cast<int16_t>(st[i]);
      std::memcpy(c.ch.arena + off + i * sizeof(int16_t), &v, sizeof v);
      done += st[i] == ErrorCode::kOk ? 1 : 0;
    }
    out.arena_offset = static_cast<uint32_t>(off);
    out.count = static_cast<uint32_t>(st.size());
    out.done = done;
  }

  /// The region a keyed op names, or an error in `out`.
  std::shared_ptr<Region> region_of(const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    auto r = opts.find_region(req.region);
    if (!r) set_status(out, ErrorCode::kNotFound);
    return r;
  }

  void observe(uint16_t op, Clock::time_point t0) {
    if (op < proto::kOpTableSize && op_seconds[op]) op_seconds[op]->observe(seconds_since(t0));
  }

  // ---- handlers ----

  bool transfer(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (Status st = check_arena(c, req); !st.ok()) {
      set_status(out, st.code());
      return true;
    }
    auto region = region_of(req, out);
    if (!region) return true;
    auto keys = read_keys(c, req);
    std::vector<int64_t> ids(req.count);
    std::memcpy(ids.data(), c.ch.arena + req.arena_offset + req.count * sizeof(ops::Key), req.count * sizeof(int64_t));
    const store::NamespaceId ns = ns_for(c, region->desc().spec.format);
    const bool load = req.op == static_cast<uint16_t>(proto::Op::kLoad);
    const auto deadline = t0 + std::chrono::milliseconds(request_timeout_ms.load());
    workers->post(
        [this, cp, req, out, region, keys = std::move(keys), ids = std::move(ids), ns, load, t0, deadline]() mutable {
          store::RegionAccess acc{region->base(), region->desc().spec, region->on_device()};
          std::vector<Status> res =
              load ? svc->load(acc, ns, keys, ids, deadline) : svc->save(acc, ns, keys, ids, deadline);
          std::vector<ErrorCode> codes(res.size());
          ErrorCode first = ErrorCode::kOk;
          for (size_t i = 0; i < res.size(); ++i) {
            codes[i] = res[i].code();
            if (first == ErrorCode::kOk && codes[i] != ErrorCode::kOk) {
              first = codes[i];
              spdlog::debug("client {}: {} of block {} ({}): {}", cp->client_id, load ? "load" : "save", ids[i],
                            keys[i].hex(), res[i].to_string());
            }
          }
          write_statuses(*cp, req, codes, out);
          set_status(out, first);
          observe(req.op, t0);
          rings->post(cp, out);
        });
    return false;
  }

  bool lookup(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (Status st = check_arena(c, req); !st.ok()) return set_status(out, st.code()), true;
    auto region = region_of(req, out);
    if (!region) return true;
    auto keys = read_keys(c, req);
    auto r = index->lookup(ns_for(c, region->desc().spec.format), keys);
    std::vector<ErrorCode> codes(keys.size());
    uint64_t hits = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      codes[i] = r.present[i] ? ErrorCode::kOk : ErrorCode::kNotFound;
      hits += r.present[i];
    }
    lookups_hit->add(hits);
    lookups_miss->add(keys.size() - hits);
    write_statuses(c, req, codes, out);
    out.result[0] = r.prefix;
    observe(req.op, t0);
    return true;
  }

  bool pin(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (Status st = check_arena(c, req); !st.ok()) return set_status(out, st.code()), true;
    auto region = region_of(req, out);
    if (!region) return true;
    auto keys = read_keys(c, req);
    const auto ns = ns_for(c, region->desc().spec.format);
    const bool unpin = req.op == static_cast<uint16_t>(proto::Op::kUnpin);
    std::vector<ErrorCode> codes(keys.size());
    for (size_t i = 0; i < keys.size(); ++i)
      codes[i] = (unpin ? index->unpin({ns, keys[i]}, c.client_id) : index->pin({ns, keys[i]}, c.client_id)).code();
    write_statuses(c, req, codes, out);
    observe(req.op, t0);
    return true;
  }

  bool evict(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (req.args[0] & ops::kEvictAllNs) {
      out.result[0] = index->evict_all(std::nullopt);
      observe(req.op, t0);
      return true;
    }
    if (Status st = check_arena(c, req); !st.ok()) return set_status(out, st.code()), true;
    auto region = region_of(req, out);
    if (!region) return true;
    const auto ns = ns_for(c, region->desc().spec.format);
    if (req.args[0] & ops::kEvictAll) {
      out.result[0] = index->evict_all(ns);
      observe(req.op, t0);
      return true;
    }
    auto keys = read_keys(c, req);
    std::vector<ErrorCode> codes(keys.size());
    uint64_t evicted = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (index->evict(ns, std::span<const store::BlockKey>(&keys[i], 1)) == 1) {
        codes[i] = ErrorCode::kOk;
        ++evicted;
      } else {
        codes[i] = index->lookup(ns, std::span<const store::BlockKey>(&keys[i], 1)).present[0] ? ErrorCode::kBusy
                                                                                               : ErrorCode::kNotFound;
      }
    }
    write_statuses(c, req, codes, out);
    out.result[0] = evicted;
    observe(req.op, t0);
    return true;
  }

  uint64_t counter_value(const char* name, const char* labels) { return metrics.counter(name, "", labels).value(); }

  ops::StatsWire stats_wire() {
    const auto s = index->stats();
    ops::StatsWire w{};
    w.entries = s.entries;
    w.writing = s.writing;
    w.pinned = s.pinned;
    w.used_bytes = s.used_bytes;
    w.capacity_bytes = s.capacity_bytes;
    w.evictions = s.evictions;
    w.evicted_bytes = s.evicted_bytes;
    w.hits = lookups_hit->value();
    w.misses = lookups_miss->value();
    w.lookups = w.hits + w.misses;
    w.blocks_saved = counter_value("kvferry_blocks_saved_total", "tier=\"host\"");
    w.bytes_saved = counter_value("kvferry_bytes_saved_total", "tier=\"host\"");
    w.blocks_loaded = counter_value("kvferry_blocks_loaded_total", "tier=\"host\"");
    w.bytes_loaded = counter_value("kvferry_bytes_loaded_total", "tier=\"host\"");
    w.checksum_failures = counter_value("kvferry_checksum_failures_total", "");
    w.clients = opts.clients ? opts.clients() : 0;
    w.pool_pinned = pool->pinned() ? 1 : 0;
    return w;
  }

  bool stats(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (req.arena_offset % 8 != 0 || uint64_t{req.arena_offset} + sizeof(ops::StatsWire) > c.ch.arena_bytes)
      return set_status(out, ErrorCode::kOutOfRange), true;
    const ops::StatsWire w = stats_wire();
    std::memcpy(c.ch.arena + req.arena_offset, &w, sizeof w);
    out.arena_offset = req.arena_offset;
    out.count = 1;
    out.done = 1;
    out.result[0] = w.entries;
    out.result[1] = w.used_bytes;
    out.result[2] = w.capacity_bytes;
    out.result[3] = w.pinned;
    out.result[4] = w.evictions;
    observe(req.op, t0);
    return true;
  }

  bool ls(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (req.arena_offset % 8 != 0 || req.arena_offset >= c.ch.arena_bytes)
      return set_status(out, ErrorCode::kOutOfRange), true;
    std::optional<store::NamespaceId> ns;
    if (req.region != 0) {
      auto region = region_of(req, out);
      if (!region) return true;
      ns = ns_for(c, region->desc().spec.format);
    }
    const uint64_t room = (c.ch.arena_bytes - req.arena_offset) / sizeof(ops::LsEntry);
    const uint64_t limit = std::min<uint64_t>(room, req.args[0] ? req.args[0] : room);
    const auto list = index->list(ns, limit);
    for (size_t i = 0; i < list.size(); ++i) {
      ops::LsEntry e{};
      e.key = {list[i].key.hi, list[i].key.lo};
      e.bytes = list[i].bytes;
      e.pins = list[i].pins;
      std::strncpy(e.ns, list[i].ns.c_str(), sizeof e.ns - 1);
      std::strncpy(e.format, list[i].format.c_str(), sizeof e.format - 1);
      std::strncpy(e.tier, list[i].tier.c_str(), sizeof e.tier - 1);
      std::memcpy(c.ch.arena + req.arena_offset + i * sizeof e, &e, sizeof e);
    }
    out.arena_offset = req.arena_offset;
    out.count = static_cast<uint32_t>(list.size());
    out.done = out.count;
    observe(req.op, t0);
    return true;
  }

  bool corrupt(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    ClientChannel& c = *cp;
    if (!opts.test_faults) return set_status(out, ErrorCode::kUnsupported), true;
    if (req.count != 1) return set_status(out, ErrorCode::kInvalidArgument), true;
    if (Status st = check_arena(c, req); !st.ok()) return set_status(out, st.code()), true;
    auto region = region_of(req, out);
    if (!region) return true;
    auto keys = read_keys(c, req);
    Status st = index->corrupt_for_test({ns_for(c, region->desc().spec.format), keys[0]}, req.args[0]);
    if (st.ok()) spdlog::warn("test fault: flipped byte {} of block {}", req.args[0], keys[0].hex());
    set_status(out, st.code());
    return true;
  }
};

DataOps::DataOps(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DataOps::~DataOps() { stop(); }

Result<std::unique_ptr<DataOps>> DataOps::create(const config::Config& cfg, Options opts) {
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(opts);
  store::HostPool::Options po;
  po.capacity = cfg.host.capacity;
  po.numa_node = cfg.host.numa_node;
  po.pin = impl->opts.cuda;
  // Chunks of 64 MiB (one slot size each); a small pool gets smaller chunks so that it still
  // holds a few size classes (at least 4 MiB: the largest block a chunk can take).
  po.chunk_bytes = std::clamp<uint64_t>(cfg.host.capacity / 4, uint64_t{4} << 20, uint64_t{64} << 20) /
                   store::HostPool::kSlotAlign * store::HostPool::kSlotAlign;
  if (cfg.host.capacity < po.chunk_bytes)
    return Status(ErrorCode::kConfig, "tiers.host.capacity " + std::to_string(cfg.host.capacity) +
                                          " bytes is smaller than one pool chunk (" + std::to_string(po.chunk_bytes) +
                                          " bytes)");
  uint64_t next_log = 0;
  const auto t0 = Clock::now();
  po.progress = [&next_log](uint64_t done, uint64_t total) {
    if (done < next_log && done != total) return;
    spdlog::info("host pool: {} of {} MiB populated{}", done >> 20, total >> 20, done == total ? "" : " ...");
    next_log = done + std::max<uint64_t>(total / 4, 1);
  };
  auto pool = store::HostPool::create(po);
  if (!pool.ok()) return pool.status().with_context("tiers.host");
  impl->pool = std::move(*pool);
  spdlog::info("host pool: {} MiB ready in {:.2f} s ({}, NUMA node {})", impl->pool->capacity() >> 20,
               seconds_since(t0), impl->pool->pinned() ? "page-locked" : "pageable", cfg.host.numa_node);
  store::BlockIndex::Options io;
  io.high_watermark = cfg.host.high_watermark;
  io.low_watermark = cfg.host.low_watermark;
  impl->index = std::make_unique<store::BlockIndex>(*impl->pool, io);
  store::OffloadService::Options so;
  so.checksum = cfg.integrity.checksum == config::Checksum::kXxh3;
  so.verify_on_load = cfg.integrity.verify_on_load;
  so.use_cuda = impl->opts.cuda;
  if (impl->opts.hash_threads >= 0) so.hash_threads = impl->opts.hash_threads;
  if (impl->opts.pipeline_bytes >= 0) so.pipeline_bytes = impl->opts.pipeline_bytes;
  so.test_delay = impl->opts.test_copy_delay;
  impl->request_timeout_ms = cfg.limits.request_timeout.count();
  auto svc = store::OffloadService::create(*impl->index, impl->metrics, so);
  if (!svc.ok()) return svc.status().with_context("the offload service");
  impl->svc = std::move(*svc);

  Impl& d = *impl;
  auto& m = d.metrics;
  d.lookups_hit = &m.counter("kvferry_lookups_total", "Keys looked up", "result=\"hit\"");
  d.lookups_miss = &m.counter("kvferry_lookups_total", "Keys looked up", "result=\"miss\"");
  static const std::pair<proto::Op, const char*> names[] = {
      {proto::Op::kLookup, "lookup"}, {proto::Op::kSave, "save"},   {proto::Op::kLoad, "load"},
      {proto::Op::kPin, "pin"},       {proto::Op::kUnpin, "unpin"}, {proto::Op::kEvict, "evict"},
      {proto::Op::kStats, "stats"},   {proto::Op::kLs, "ls"}};
  for (auto& [op, name] : names)
    d.op_seconds[static_cast<uint16_t>(op)] =
        &m.histogram("kvferry_ring_op_seconds", "Data op latency from the ring to the completion",
                     std::string("op=\"") + name + "\"");
  store::BlockIndex* idx = d.index.get();
  m.gauge_fn("kvferry_pool_used_bytes", "Host pool bytes in use", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().used_bytes); });
  m.gauge_fn("kvferry_pool_capacity_bytes", "Host pool capacity", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().capacity_bytes); });
  m.gauge_fn("kvferry_pool_occupancy_ratio", "Host pool bytes in use / capacity", "tier=\"host\"", [idx] {
    auto s = idx->stats();
    return s.capacity_bytes ? static_cast<double>(s.used_bytes) / static_cast<double>(s.capacity_bytes) : 0.0;
  });
  m.gauge_fn("kvferry_blocks_stored", "Blocks stored", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().entries); });
  m.gauge_fn("kvferry_blocks_pinned", "Blocks pinned by clients", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().pinned); });
  m.gauge_fn("kvferry_evictions", "Blocks evicted since start (monotonic)", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().evictions); });
  auto clients = d.opts.clients;
  m.gauge_fn("kvferry_clients", "Connected clients", "",
             [clients] { return clients ? static_cast<double>(clients()) : 0.0; });
  d.workers = std::make_unique<WorkerPool>(d.opts.workers);
  return std::unique_ptr<DataOps>(new DataOps(std::move(impl)));
}

void DataOps::install(RingService& rings) {
  Impl* d = impl_.get();
  d->rings = &rings;
  auto bind = [d](bool (Impl::*fn)(const std::shared_ptr<ClientChannel>&, const ring::SubmitEntry&,
                                   ring::CompletionEntry&)) -> DeferrableHandler {
    return [d, fn](const std::shared_ptr<ClientChannel>& c, const ring::SubmitEntry& r, ring::CompletionEntry& o) {
      return (d->*fn)(c, r, o);
    };
  };
  rings.set_handler(static_cast<uint16_t>(proto::Op::kLookup), bind(&Impl::lookup));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kSave), bind(&Impl::transfer));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kLoad), bind(&Impl::transfer));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kPin), bind(&Impl::pin));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kUnpin), bind(&Impl::pin));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kEvict), bind(&Impl::evict));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kStats), bind(&Impl::stats));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kLs), bind(&Impl::ls));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kCorruptForTest), bind(&Impl::corrupt));
}

Status DataOps::reload(const config::Config& cfg) {
  Impl& d = *impl_;
  const auto before = d.index->watermarks();
  if (before.high_watermark != cfg.host.high_watermark || before.low_watermark != cfg.host.low_watermark) {
    auto n = d.index->set_watermarks(cfg.host.high_watermark, cfg.host.low_watermark);
    if (!n.ok()) return n.status().with_context("tiers.host watermarks");
    spdlog::info("reload: host pool watermarks now {} / {} (high / low){}", cfg.host.high_watermark,
                 cfg.host.low_watermark, *n ? "; evicted " + std::to_string(*n) + " blocks" : std::string());
  }
  d.svc->set_verify_on_load(cfg.integrity.verify_on_load);
  d.request_timeout_ms = cfg.limits.request_timeout.count();
  return Status::Ok();
}

void DataOps::client_gone(uint32_t client_id) { impl_->index->release_client(client_id); }

void DataOps::stop() {
  if (impl_ && impl_->workers) impl_->workers->stop();
}

std::string DataOps::render_metrics() const { return impl_->metrics.render(); }

bool DataOps::healthy(std::string* body) const {
  const auto s = impl_->index->stats();
  const bool ok = impl_->workers->running();
  if (body)
    *body = std::string(ok ? "ok" : "stopping") + ": " + std::to_string(s.entries) + " blocks, " +
            std::to_string(s.used_bytes >> 20) + " of " + std::to_string(s.capacity_bytes >> 20) + " MiB\n";
  return ok;
}

}  // namespace kvferry::daemon
