// The data ops of kvferryd (data_ops.h).
#include "data_ops.h"
#include "local_send.h"

#include "ring_request.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <sstream>
#include <deque>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvferry/connector/ops.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/disk_tier.h"
#include "kvferry/store/fault_tier.h"
#include "kvferry/store/host_pool.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/offload.h"
#include "kvferry/store/remote_store.h"
#include "kvferry/store/tiered_store.h"

namespace kvferry::daemon {

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kDefaultModel = "default";

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void set_status(ring::CompletionEntry& out, ErrorCode c) { out.status = static_cast<int16_t>(c); }

/// A fixed set of threads draining one queue of jobs per tenant, the tenants in turn: one
/// tenant's queue of large saves delays another tenant's request by at most one job step.
class WorkerPool {
 public:
  explicit WorkerPool(int n) {
    for (int i = 0; i < std::max(1, n); ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() { stop(); }
  void post(const std::string& tenant, std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto [it, fresh] = queues_.try_emplace(tenant);
      if (fresh) turn_.push_back(tenant);
      it->second.push_back(std::move(job));
      ++queued_;
    }
    cv_.notify_one();
  }
  /// Whether a tenant other than `tenant` has a job waiting (a long job then yields its worker).
  bool others_waiting(const std::string& tenant) const {
    std::lock_guard<std::mutex> g(mu_);
    return queues_.size() > (queues_.count(tenant) ? 1u : 0u);
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
    return queued_;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || queued_ > 0; });
        if (queued_ == 0) return;
        // The tenant at the front of the turn order runs one job and goes to the back.
        const std::string tenant = std::move(turn_.front());
        turn_.pop_front();
        auto q = queues_.find(tenant);
        job = std::move(q->second.front());
        q->second.pop_front();
        --queued_;
        if (q->second.empty())
          queues_.erase(q);  // the table holds waiting tenants only
        else
          turn_.push_back(tenant);
      }
      job();
    }
  }
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, std::deque<std::function<void()>>> queues_;  // non-empty queues only
  std::deque<std::string> turn_;  // tenants with a waiting job, in serving order
  size_t queued_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// The namespaces one client leased (model|family|tenant per format family it used), released
/// when its channel goes, i.e. after the last worker holding the channel is done.
struct ClientNamespaces {
  std::shared_ptr<store::BlockIndex> index;
  uint32_t client_id = 0;
  std::mutex mu;
  std::vector<std::pair<std::string, store::NamespaceId>> ids;  // family -> id; a handful at most
  ~ClientNamespaces() {
    // The channel is gone from every thread now. The session dropped the client's pins when it
    // disconnected, but the ring thread may have served a pin of it after that (it finishes
    // the pass it is in): drop any such pin here, or it would hold its block forever.
    index->release_client(client_id);
    for (auto& [_, id] : ids) index->release_namespace(id);
  }
};

/// One save or load moving through the workers in steps of at most kFairStepBytes.
struct Transfer {
  std::shared_ptr<ClientChannel> client;
  ring::SubmitEntry req;
  ring::CompletionEntry out;
  std::shared_ptr<Region> region;
  std::vector<store::BlockKey> keys;
  std::vector<int64_t> ids;
  uint64_t status_offset = 0;
  store::NamespaceId ns = 0;
  bool load = false;
  bool send = false;  // a save whose blocks then go to `peer` (prefill → decode)
  std::string peer;
  uint32_t peer_region = 0;       // send: land the blocks in this region of the peer (0 = its pool only)
  std::vector<int64_t> peer_ids;  // ... at these blocks, one per key
  bool mapped = false;            // load_mapped: `parts` say which part of each stored block goes where
  std::vector<int32_t> parts;
  uint64_t bytes = 0;  // counted against the tenant's in-flight quota until the completion
  Clock::time_point t0, deadline;
  size_t next = 0;  // blocks done
  std::vector<ErrorCode> codes;
  std::string why;  // the first failure's message, for the debug log
};

/// Opens the disk tier of tiers.disk (wrapped in a FaultTier when a test asks), registers the
/// host pool with it and rebuilds its index from the slot headers, logging the count and time.
Result<std::unique_ptr<store::Tier>> open_disk_tier(const config::Config& cfg, const DataOps::Options& opts,
                                                    store::HostPool& pool) {
  store::DiskTier::Options o;
  o.path = cfg.disk.path;
  o.capacity = cfg.disk.capacity;
  o.queue_depth = cfg.disk.queue_depth;
  // Extents of an eighth of the tier (at most 256 MiB, at least one 4 MiB block and its header),
  // so a small tier still holds a few size classes.
  o.extent_bytes =
      std::clamp<uint64_t>(cfg.disk.capacity / 8 / 4096 * 4096, (uint64_t{4} << 20) + 4096, uint64_t{256} << 20);
  o.direct_io = cfg.disk.direct_io;
  o.force_fallback = cfg.disk.io_engine == config::DiskIoEngine::kPosix;
  o.durability = cfg.disk.durability == config::DiskDurability::kNone   ? store::Durability::kNone
                 : cfg.disk.durability == config::DiskDurability::kEach ? store::Durability::kEach
                                                                        : store::Durability::kBatch;
  o.log = [](std::string_view line) { spdlog::warn("disk tier: {}", line); };
  auto opened = store::DiskTier::open(o);
  if (!opened.ok()) return opened.status().with_context("tiers.disk.path " + cfg.disk.path);
  auto* dt = opened->get();
  spdlog::info("disk tier: {} ({} MiB, {}, durability {}, {})", dt->file_path(), cfg.disk.capacity >> 20, dt->engine(),
               cfg.disk.durability == config::DiskDurability::kNone   ? "none"
               : cfg.disk.durability == config::DiskDurability::kEach ? "each"
                                                                      : "batch",
               cfg.disk.write_through ? "write-through" : "write-back");
  std::unique_ptr<store::Tier> tier = std::move(*opened);
  if (!opts.test_disk_faults.empty()) {
    auto knobs = store::parse_fault_spec(opts.test_disk_faults);
    if (!knobs.ok()) return knobs.status().with_context("--test-disk-faults");
    spdlog::warn("test faults on the disk tier ({}): never in production", opts.test_disk_faults);
    tier = std::make_unique<store::FaultTier>(std::move(tier), *knobs);
  }
  const iovec whole{pool.base(), static_cast<size_t>(pool.capacity())};
  if (Status st = tier->register_buffers({&whole, 1}); !st.ok())
    spdlog::warn("disk tier: the host pool could not be registered for I/O ({}); I/O pins pages per request",
                 st.to_string());
  const auto t0 = Clock::now();
  auto n = tier->recover();
  if (!n.ok()) return n.status().with_context("recovering the disk tier at " + cfg.disk.path);
  spdlog::info("disk tier: recovered {} blocks in {:.3f} s", *n, seconds_since(t0));
  return tier;
}

/// Starts the remote tier of tiers.remote: reads the secret, starts the transport and joins the
/// cluster (etcd or the static peers).
Result<std::unique_ptr<store::RemoteStore>> open_remote_tier(
    const config::Config& cfg, store::BlockIndex& index, store::Registry& metrics,
    std::function<std::vector<Status>(store::NamespaceId, const std::string&, uint32_t,
                                      std::span<const store::BlockKey>, std::span<const int64_t>)>
        on_land,
    const DataOps::Options& dopts) {
  const config::RemoteTierConfig& rc = cfg.remote;
  if (!rc.peers.empty() && !rc.etcd.empty())
    return Status(ErrorCode::kConfig,
                  "tiers.remote.peers and tiers.remote.etcd are both set: membership comes from one of them");
  if (!rc.peers.empty() && !rc.id.empty())
    return Status(ErrorCode::kConfig,
                  "tiers.remote.id is for etcd membership; with static tiers.remote.peers every "
                  "daemon is named by its listen address");
  if (cfg.integrity.checksum != config::Checksum::kXxh3)
    return Status(ErrorCode::kConfig,
                  "integrity.checksum must be xxh3 with the remote tier (every block that "
                  "crosses the network is verified against it)");
  store::RemoteStoreOptions o;
  o.id = rc.id;
  o.listen = rc.listen;
  o.tls = rc.transport;
  o.etcd = rc.etcd;
  o.prefix = rc.prefix;
  o.ttl = std::chrono::duration_cast<std::chrono::seconds>(rc.ttl);
  o.peers = rc.peers;
  o.replicas = rc.replicas;
  o.timeout = rc.timeout;
  o.lookup_timeout = rc.lookup_timeout;
  o.on_land = std::move(on_land);
  if (rc.local_transfer && dopts.grant_import && dopts.check_landed && !dopts.socket.empty()) {
    o.grant_import = dopts.grant_import;
    o.on_local_landed = dopts.check_landed;
    o.socket = dopts.socket;
  }
  o.log = [](const std::string& line) { spdlog::warn("remote tier: {}", line); };
  o.info = [](const std::string& line) { spdlog::info("remote tier: {}", line); };
  if (!rc.secret_file.empty()) {
    std::ifstream f(rc.secret_file, std::ios::binary);
    if (!f)
      return Status(ErrorCode::kConfig,
                    "tiers.remote.secret_file " + rc.secret_file + " cannot be read: " + std::strerror(errno));
    std::stringstream ss;
    ss << f.rdbuf();
    o.secret = ss.str();
    while (!o.secret.empty() && (o.secret.back() == '\n' || o.secret.back() == '\r')) o.secret.pop_back();
    if (o.secret.size() < 16)
      return Status(ErrorCode::kConfig, "tiers.remote.secret_file " + rc.secret_file + " holds " +
                                            std::to_string(o.secret.size()) +
                                            " bytes; a shared key needs at least 16 (e.g. openssl rand -hex 32)");
  }
  if (rc.transport.find("tcp") == std::string::npos)
    spdlog::warn(
        "remote tier: tiers.remote.transport '{}' has no tcp: peers are reached by address, and UCX 1.13 "
        "refuses its shared-memory transports on endpoints with peer error handling, so connections may "
        "fail (\"Destination is unreachable\"); add tcp",
        rc.transport);
  auto r = store::RemoteStore::create(o, index, metrics);
  if (!r.ok()) return r.status().with_context("tiers.remote");
  spdlog::info("remote tier: member '{}' on port {} ({} membership{}, UCX_TLS={}, {})", (*r)->id(), (*r)->port(),
               rc.etcd.empty() ? "static" : "etcd", rc.etcd.empty() ? "" : " at " + rc.etcd, rc.transport,
               o.secret.empty() ? "no secret: loopback only" : "peers prove the shared secret");
  return r;
}

}  // namespace

struct DataOps::Impl {
  /// A long transfer yields its worker to another tenant after this many bytes (one step keeps
  /// the copy/hash pipeline busy: two of its 128 MiB sub-batches).
  static constexpr uint64_t kFairStepBytes = uint64_t{256} << 20;

  Options opts;
  std::unique_ptr<store::HostPool> pool;
  std::shared_ptr<store::BlockIndex> index;
  store::Registry metrics;
  std::unique_ptr<store::OffloadService> svc;
  std::unique_ptr<store::TieredStore> tiers;   // the host pool over the disk tier (when configured)
  std::unique_ptr<store::RemoteStore> remote;  // the remote tier (tiers.remote.listen set); before its users
  std::chrono::milliseconds remote_timeout{5000}, remote_lookup_timeout{500};
  bool remote_on_evict = false;        // tiers.remote.write: on_evict (the remote tier is the write-back tier)
  std::unique_ptr<LocalSender> local;  // sends into regions of peers on this host (tiers.remote.local_transfer)
  std::unique_ptr<WorkerPool> workers;
  std::unique_ptr<WorkerPool> remote_workers;  // remote lookups and waits: never queued behind transfers
  RingService* rings = nullptr;
  std::atomic<int64_t> request_timeout_ms{30000};

  store::Counter* lookups_hit = nullptr;
  store::Counter* lookups_miss = nullptr;
  store::Counter* quota_refusals = nullptr;
  store::Counter* push_failures = nullptr;
  store::Histogram* op_seconds[proto::kOpTableSize] = {};

  std::mutex inflight_mu;
  std::unordered_map<std::string, uint64_t> inflight;  // bytes per tenant; tenants with none are erased

  /// The block namespace of `client` for blocks of `format`: model|family|tenant, leased once
  /// per client and family. kResourceExhausted when the index holds its limit of namespaces.
  Result<store::NamespaceId> ns_for(ClientChannel& c, const EntryFormat& format) {
    if (!c.data_state) {
      auto st = std::make_shared<ClientNamespaces>();
      st->index = index;
      st->client_id = c.client_id;
      c.data_state = st;
    }
    auto& cache = *static_cast<ClientNamespaces*>(c.data_state.get());
    const std::string family = store::format_family(format);
    std::lock_guard<std::mutex> g(cache.mu);
    for (auto& [f, id] : cache.ids)
      if (f == family) return id;
    const std::string model = c.model.empty() ? kDefaultModel : c.model;
    auto id = index->acquire_namespace(model + "|" + family + "|" + c.tenant, c.tenant);
    if (id.ok()) cache.ids.emplace_back(family, *id);
    return id;
  }

  /// The pin account of an owner (ClientChannel::owner): a hash of its name (0 is "no account").
  static uint64_t owner_account(const std::string& owner) { return std::hash<std::string>()(owner) | 1; }

  /// Whether `c` may see blocks of a namespace of `tenant` (its own; an admin every one).
  static bool sees(const ClientChannel& c, const std::string& tenant) { return c.admin || tenant == c.tenant; }

  /// Counts `bytes` against the owner's in-flight quota; false (nothing counted) past it.
  bool take_inflight(const ClientChannel& c, uint64_t bytes, uint64_t* now) {
    std::lock_guard<std::mutex> g(inflight_mu);
    uint64_t& used = inflight[c.owner];
    *now = used;
    // A request larger than the whole quota still runs when it is the tenant's only one.
    if (c.quota.inflight_bytes && used > 0 && used + bytes > c.quota.inflight_bytes) return false;
    used += bytes;
    return true;
  }
  void give_inflight(const std::string& tenant, uint64_t bytes) {
    std::lock_guard<std::mutex> g(inflight_mu);
    auto it = inflight.find(tenant);
    if (it == inflight.end()) return;
    it->second -= std::min(it->second, bytes);
    if (it->second == 0) inflight.erase(it);
  }

  /// The request's keys and block ids, copied out of the client's arena once (ring_request.h);
  /// on an error its code is in `out`.
  static std::optional<KeyedRequest> take(const ClientChannel& c, const ring::SubmitEntry& req,
                                          ring::CompletionEntry& out) {
    auto r = take_keyed_request(req, c.ch.arena, c.ch.arena_bytes);
    if (!r.ok()) {
      set_status(out, r.status().code());
      return std::nullopt;
    }
    return std::move(*r);
  }

  static std::vector<store::BlockKey> block_keys(const KeyedRequest& r) {
    std::vector<store::BlockKey> keys(r.keys.size());
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = {r.keys[i].hi, r.keys[i].lo};
    return keys;
  }

  /// Writes per-key statuses at the request's status area (checked inside the arena) and points
  /// the completion at them.
  static void write_statuses(ClientChannel& c, uint64_t off, const std::vector<ErrorCode>& st,
                             ring::CompletionEntry& out) {
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
  std::shared_ptr<Region> region_of(const ClientChannel& c, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    auto r = opts.find_region(c, req.region);
    if (!r) set_status(out, ErrorCode::kNotFound);
    return r;
  }

  void observe(uint16_t op, Clock::time_point t0) {
    if (op < proto::kOpTableSize && op_seconds[op]) op_seconds[op]->observe(seconds_since(t0));
  }

  // ---- handlers ----

  /// The namespace of `region` for `c`, or kResourceExhausted in `out`.
  bool namespace_of(ClientChannel& c, const Region& region, ring::CompletionEntry& out, store::NamespaceId* ns) {
    auto id = ns_for(c, region.desc().spec.format);
    if (!id.ok()) {
      set_status(out, id.status().code());
      return false;
    }
    *ns = *id;
    return true;
  }

  bool transfer(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    ClientChannel& c = *cp;
    auto in = take(c, req, out);
    if (!in) return true;
    auto region = region_of(c, req, out);
    if (!region) return true;
    auto t = std::make_shared<Transfer>();
    if (req.op == static_cast<uint16_t>(proto::Op::kSend)) {
      if (!remote) return set_status(out, ErrorCode::kUnavailable), true;  // tiers.remote is off
      auto peer = peer_name(c, req);
      if (!peer) return set_status(out, ErrorCode::kInvalidArgument), true;
      t->send = true;
      t->peer = std::move(*peer);
      if (req.args[2] != 0) {
        auto ids = peer_block_ids(c, req);
        if (!ids) return set_status(out, ErrorCode::kInvalidArgument), true;
        t->peer_region = static_cast<uint32_t>(req.args[2]);
        t->peer_ids = std::move(*ids);
      }
    }
    if (req.op == static_cast<uint16_t>(proto::Op::kLoadMapped)) {
      auto parts = map_parts(c, req);
      if (!parts) return set_status(out, ErrorCode::kOutOfRange), true;
      t->mapped = true;
      t->parts = std::move(*parts);
    }
    if (!namespace_of(c, *region, out, &t->ns)) return true;
    t->bytes = uint64_t{req.count} * static_cast<uint64_t>(region->desc().spec.block_bytes());
    uint64_t used = 0;
    if (!take_inflight(c, t->bytes, &used)) {
      // A tenant's requests already queued or running hold its whole quota: refuse this one at
      // once (the engine retries or recomputes) rather than let it queue behind them.
      quota_refusals->add();
      std::vector<ErrorCode> codes(req.count, ErrorCode::kResourceExhausted);
      write_statuses(c, in->status_offset, codes, out);
      set_status(out, ErrorCode::kResourceExhausted);
      spdlog::debug("client {}: {} of {} bytes refused: tenant '{}' has {} bytes in flight (quota {})", c.client_id,
                    req.op == static_cast<uint16_t>(proto::Op::kLoad) ? "load" : "save", t->bytes, c.tenant, used,
                    c.quota.inflight_bytes);
      return true;
    }
    t->client = cp;
    t->req = req;
    t->out = out;
    t->region = std::move(region);
    t->keys = block_keys(*in);
    t->ids = std::move(in->block_ids);
    t->status_offset = in->status_offset;
    t->load = req.op == static_cast<uint16_t>(proto::Op::kLoad) || t->mapped;
    t->t0 = Clock::now();
    t->deadline = t->t0 + std::chrono::milliseconds(request_timeout_ms.load());
    t->codes.reserve(req.count);
    workers->post(c.owner, [this, t] { step(t); });
    return false;
  }

  /// Runs one turn of a transfer on a worker: all of it, or, once kFairStepBytes are done and
  /// another tenant waits, the blocks up to the next step boundary; the rest goes to the back of
  /// this tenant's queue. The store keeps its lower tier's I/O in flight across its own steps
  /// within a turn, so a transfer nobody waits behind runs as one pipeline.
  void step(const std::shared_ptr<Transfer>& t) {
    const store::RegionAccess acc{t->region->base(), t->region->desc().spec, t->region->on_device()};
    const size_t n = t->keys.size();
    std::vector<Status> res;
    std::optional<std::vector<Status>> direct;
    if (t->send && t->peer_region && local && t->next == 0) {  // a peer on this host: region to region
      if (const auto name = index->namespace_name(t->ns))
        direct = local->send(*t->region, *name, t->peer, t->peer_region, t->keys, t->ids, t->peer_ids,
                             std::min(t->deadline, Clock::now() + remote_timeout));
    }
    if (direct) {
      res = std::move(*direct);
    } else if (t->mapped) {  // runs whole: a region block's entries must be loaded together
      res = tiers->load_mapped(acc, t->ns, t->keys, t->ids, t->parts, t->deadline);
      if (remote && !res.empty()) fetch_missing_mapped(*t, acc, res);
    } else {
      store::TieredStore::Turn turn;
      // The service refuses a destination named twice only within one call: such a request runs whole.
      if (!(t->next == 0 && has_duplicate_destinations(*t))) {
        turn.bytes = kFairStepBytes;
        turn.yield = [this, &t] { return workers->others_waiting(t->client->owner); };
      }
      const auto keys = std::span<const store::BlockKey>(t->keys).subspan(t->next);
      const auto ids = std::span<const int64_t>(t->ids).subspan(t->next);
      res = t->load ? tiers->load(acc, t->ns, keys, ids, t->deadline, turn)
                    : tiers->save(acc, t->ns, keys, ids, t->deadline, turn);
      if (remote && !res.empty()) {
        if (t->load)
          fetch_missing(*t, acc, keys, ids, res);
        else
          push_saved(*t, keys, res);
      }
    }
    for (const Status& r : res) {
      t->codes.push_back(r.code());
      if (t->why.empty() && !r.ok()) t->why = r.to_string();
    }
    t->next += res.size();
    if (t->next < n && !res.empty()) {
      workers->post(t->client->owner, [this, t] { step(t); });
      return;
    }
    finish(*t);
  }

  static bool has_duplicate_destinations(const Transfer& t) {
    std::vector<std::pair<uint64_t, uint64_t>> v;
    v.reserve(t.keys.size());
    for (size_t i = 0; i < t.keys.size(); ++i)
      v.emplace_back(t.load ? static_cast<uint64_t>(t.ids[i]) : t.keys[i].hi, t.load ? 0 : t.keys[i].lo);
    std::sort(v.begin(), v.end());
    return std::adjacent_find(v.begin(), v.end()) != v.end();
  }

  /// Send's peer: the member id after the request's keys, ids and statuses (args[1] bytes),
  /// copied out of the arena once. nullopt when its length or place is out of bounds.
  static std::optional<std::string> peer_name(const ClientChannel& c, const ring::SubmitEntry& req) {
    const uint64_t off = uint64_t{req.arena_offset} + ops::request_bytes(req.op, req.count);
    const uint64_t len = req.args[1];
    if (len == 0 || len > ops::kMaxPeerName || off + len > c.ch.arena_bytes) return std::nullopt;
    std::string name(len, '\0');
    std::memcpy(name.data(), c.ch.arena + off, len);
    return name;
  }

  /// load_mapped's parts: int32[count] after the request's keys, ids and statuses, copied out of
  /// the arena once. nullopt when they lie past the arena.
  static std::optional<std::vector<int32_t>> map_parts(const ClientChannel& c, const ring::SubmitEntry& req) {
    const uint64_t off = uint64_t{req.arena_offset} + ops::request_bytes(req.op, req.count);
    const uint64_t bytes = uint64_t{req.count} * sizeof(int32_t);
    if (off + bytes > c.ch.arena_bytes) return std::nullopt;
    std::vector<int32_t> parts(req.count);
    if (bytes) std::memcpy(parts.data(), c.ch.arena + off, bytes);
    return parts;
  }

  /// A mapped load's stored blocks that no local tier holds are asked of their owners; the region
  /// blocks that missed one are loaded again once they are fetched.
  void fetch_missing_mapped(const Transfer& t, const store::RegionAccess& acc, std::vector<Status>& res) {
    std::vector<store::BlockKey> want;
    {
      std::unordered_set<store::BlockKey, store::BlockKeyHash> seen;
      std::vector<store::BlockKey> cand;
      for (size_t i = 0; i < res.size(); ++i)
        if (res[i].code() == ErrorCode::kNotFound && seen.insert(t.keys[i]).second) cand.push_back(t.keys[i]);
      if (cand.empty()) return;
      const auto have = tiers->lookup(t.ns, cand);
      for (size_t j = 0; j < cand.size(); ++j)
        if (!have.present[j]) want.push_back(cand[j]);
    }
    const auto name = index->namespace_name(t.ns);
    if (want.empty() || !name) return;
    const auto got = remote->fetch(t.ns, *name, want, std::min(t.deadline, Clock::now() + remote_timeout));
    bool any = false;
    for (const Status& g : got) any = any || g.ok();
    if (!any) return;
    // Again, for every region block that had a miss: all of its entries.
    std::unordered_set<int64_t> blocks;
    for (size_t i = 0; i < res.size(); ++i)
      if (res[i].code() == ErrorCode::kNotFound) blocks.insert(t.ids[i]);
    std::vector<size_t> at;
    std::vector<store::BlockKey> k;
    std::vector<int64_t> b;
    std::vector<int32_t> p;
    for (size_t i = 0; i < res.size(); ++i)
      if (blocks.count(t.ids[i])) {
        at.push_back(i);
        k.push_back(t.keys[i]);
        b.push_back(t.ids[i]);
        p.push_back(t.parts[i]);
      }
    const auto again = tiers->load_mapped(acc, t.ns, k, b, p, t.deadline);
    for (size_t j = 0; j < again.size() && j < at.size(); ++j) res[at[j]] = again[j];
  }

  /// Send into a peer's region: its block ids, int64[count] after the peer's name (8-aligned).
  static std::optional<std::vector<int64_t>> peer_block_ids(const ClientChannel& c, const ring::SubmitEntry& req) {
    if (req.args[2] > UINT32_MAX) return std::nullopt;
    const uint64_t off = uint64_t{req.arena_offset} + ops::request_bytes(req.op, req.count) + (req.args[1] + 7) / 8 * 8;
    const uint64_t bytes = uint64_t{req.count} * sizeof(int64_t);
    if (off + bytes > c.ch.arena_bytes) return std::nullopt;
    std::vector<int64_t> ids(req.count);
    if (bytes) std::memcpy(ids.data(), c.ch.arena + off, bytes);
    return ids;
  }

  /// A peer's send landing in one of this daemon's regions (RemoteStoreOptions::on_land).
  std::vector<Status> land(store::NamespaceId ns, const std::string& tenant, uint32_t region_id,
                           std::span<const store::BlockKey> keys, std::span<const int64_t> ids) {
    if (!tiers)
      return std::vector<Status>(keys.size(), Status(ErrorCode::kUnavailable, "this daemon is still starting"));
    auto region = opts.find_region_for_tenant ? opts.find_region_for_tenant(tenant, region_id) : nullptr;
    if (!region)
      return std::vector<Status>(
          keys.size(), Status(ErrorCode::kNotFound,
                              "no region " + std::to_string(region_id) + " of tenant '" + tenant + "' on this daemon"));
    const store::RegionAccess acc{region->base(), region->desc().spec, region->on_device()};
    return tiers->load(acc, ns, keys, ids, Clock::now() + remote_timeout);
  }

  /// A load's host and disk misses are asked of their owners; the ones fetched (now on the
  /// host) are loaded. A remote miss stays a miss; a peer's failure is that block's error.
  void fetch_missing(const Transfer& t, const store::RegionAccess& acc, std::span<const store::BlockKey> keys,
                     std::span<const int64_t> ids, std::vector<Status>& res) {
    std::vector<size_t> miss;
    for (size_t i = 0; i < res.size(); ++i)
      if (res[i].code() == ErrorCode::kNotFound) miss.push_back(i);
    const auto name = index->namespace_name(t.ns);
    if (miss.empty() || !name) return;
    std::vector<store::BlockKey> mk;
    mk.reserve(miss.size());
    for (size_t i : miss) mk.push_back(keys[i]);
    const auto got = remote->fetch(t.ns, *name, mk, std::min(t.deadline, Clock::now() + remote_timeout));
    std::vector<store::BlockKey> lk;
    std::vector<int64_t> li;
    std::vector<size_t> where;
    for (size_t j = 0; j < miss.size(); ++j) {
      if (got[j].ok()) {
        lk.push_back(keys[miss[j]]);
        li.push_back(ids[miss[j]]);
        where.push_back(miss[j]);
      } else if (got[j].code() != ErrorCode::kNotFound) {
        res[miss[j]] = got[j];
      }
    }
    if (lk.empty()) return;
    const auto again = tiers->load(acc, t.ns, lk, li, t.deadline);
    for (size_t j = 0; j < again.size() && j < where.size(); ++j) res[where[j]] = again[j];
  }

  /// A save's stored blocks go to their owners (write-through), or a send's to its peer. A
  /// save's blocks stay saved here when an owner cannot take them (counted, logged); a send
  /// reports the peer's outcome per block.
  void push_saved(const Transfer& t, std::span<const store::BlockKey> keys, std::vector<Status>& res) {
    if (!t.send && remote_on_evict) return;  // written to the owners when the host evicts them
    std::vector<size_t> saved;
    for (size_t i = 0; i < res.size(); ++i)
      if (res[i].ok()) saved.push_back(i);
    const auto name = index->namespace_name(t.ns);
    if (saved.empty() || !name) return;
    std::vector<store::BlockKey> sk;
    std::vector<int64_t> land_ids;
    sk.reserve(saved.size());
    for (size_t i : saved) {
      sk.push_back(keys[i]);
      if (t.peer_region) land_ids.push_back(t.peer_ids[t.next + i]);
    }
    const auto deadline = std::min(t.deadline, Clock::now() + remote_timeout);
    const auto st = t.peer_region ? remote->push_into(t.ns, *name, sk, deadline, t.peer, t.peer_region, land_ids)
                                  : remote->push(t.ns, *name, sk, deadline, t.peer);
    uint64_t failed = 0;
    const Status* first = nullptr;
    for (size_t j = 0; j < saved.size(); ++j) {
      if (st[j].ok()) continue;
      ++failed;
      if (!first) first = &st[j];
      if (t.send) res[saved[j]] = st[j];
    }
    if (failed && !t.send) {
      push_failures->add(failed);
      spdlog::warn("remote tier: {} of {} saved blocks did not reach their owner (kept here): {}", failed, saved.size(),
                   first->to_string());
    }
  }

  void finish(Transfer& t) {
    ErrorCode first = ErrorCode::kOk;
    for (ErrorCode c : t.codes)
      if (c != ErrorCode::kOk) {
        first = c;
        break;
      }
    if (first != ErrorCode::kOk)
      spdlog::debug("client {}: {} failed for some blocks, the first: {}", t.client->client_id,
                    t.load   ? "load"
                    : t.send ? "send"
                             : "save",
                    t.why);
    write_statuses(*t.client, t.status_offset, t.codes, t.out);
    set_status(t.out, first);
    observe(t.req.op, t.t0);
    give_inflight(t.client->owner, t.bytes);
    rings->post(t.client, t.out);
  }

  bool lookup(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    auto in = take(c, req, out);
    if (!in) return true;
    auto region = region_of(c, req, out);
    if (!region) return true;
    store::NamespaceId ns;
    if (!namespace_of(c, *region, out, &ns)) return true;
    auto keys = block_keys(*in);
    auto r = tiers->lookup(ns, keys);
    if (remote && r.prefix < keys.size()) {
      // Misses are asked of their owners (or, with kLookupWait, awaited) off the ring thread.
      const bool wait = (req.args[0] & ops::kLookupWait) != 0;
      const auto wait_for = std::chrono::milliseconds(std::min<uint64_t>(req.args[1], ops::kMaxLookupWaitMs));
      auto name = index->namespace_name(ns);
      remote_workers->post(c.owner,
                           [this, cp, out, t0, ns, wait, wait_for, name = name.value_or(""), keys = std::move(keys),
                            present = std::move(r.present), status_offset = in->status_offset]() mutable {
                             if (wait) {
                               present = remote->wait_for(ns, keys, Clock::now() + wait_for);
                             } else {
                               std::vector<size_t> miss;
                               std::vector<store::BlockKey> mk;
                               for (size_t i = 0; i < keys.size(); ++i)
                                 if (!present[i]) {
                                   miss.push_back(i);
                                   mk.push_back(keys[i]);
                                 }
                               const auto found = remote->lookup(name, mk, Clock::now() + remote_lookup_timeout);
                               for (size_t j = 0; j < miss.size(); ++j) present[miss[j]] = found[j];
                             }
                             uint32_t prefix = 0;
                             while (prefix < present.size() && present[prefix]) ++prefix;
                             complete_lookup(*cp, present, prefix, status_offset, out);
                             observe(static_cast<uint16_t>(proto::Op::kLookup), t0);
                             rings->post(cp, out);
                           });
      return false;
    }
    complete_lookup(c, r.present, r.prefix, in->status_offset, out);
    observe(req.op, t0);
    return true;
  }

  void complete_lookup(ClientChannel& c, const std::vector<uint8_t>& present, uint32_t prefix, uint64_t status_offset,
                       ring::CompletionEntry& out) {
    std::vector<ErrorCode> codes(present.size());
    uint64_t hits = 0;
    for (size_t i = 0; i < present.size(); ++i) {
      codes[i] = present[i] ? ErrorCode::kOk : ErrorCode::kNotFound;
      hits += present[i];
    }
    lookups_hit->add(hits);
    lookups_miss->add(present.size() - hits);
    write_statuses(c, status_offset, codes, out);
    out.result[0] = prefix;
  }

  /// The remote tier's members as JSON text (kvferry peers).
  bool peers(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    ClientChannel& c = *cp;
    if (!remote) return set_status(out, ErrorCode::kUnavailable), true;
    if (Status st = check_result_area(req, c.ch.arena_bytes, 1); !st.ok()) return set_status(out, st.code()), true;
    const std::string text = peers_json();
    const uint64_t room = c.ch.arena_bytes - req.arena_offset;
    const uint64_t n = std::min<uint64_t>({text.size(), room, req.args[0] ? req.args[0] : room});
    std::memcpy(c.ch.arena + req.arena_offset, text.data(), n);
    out.arena_offset = req.arena_offset;
    out.count = static_cast<uint32_t>(n);
    out.result[0] = n;
    out.result[1] = text.size();
    return true;
  }

  std::string peers_json() const {
    const Status h = remote->health();
    nlohmann::ordered_json members = nlohmann::ordered_json::array();
    for (const auto& p : remote->peers())
      members.push_back({{"id", p.id},
                         {"address", p.address},
                         {"incarnation", p.incarnation},
                         {"state", p.state},
                         {"blocks_out", p.blocks_out},
                         {"bytes_out", p.bytes_out},
                         {"blocks_in", p.blocks_in},
                         {"bytes_in", p.bytes_in},
                         {"errors", p.errors}});
    const nlohmann::ordered_json j = {{"self", remote->id()},
                                      {"healthy", h.ok()},
                                      {"reason", h.ok() ? std::string() : h.message()},
                                      {"members", std::move(members)}};
    return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  }

  bool pin(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    auto in = take(c, req, out);
    if (!in) return true;
    auto region = region_of(c, req, out);
    if (!region) return true;
    store::NamespaceId ns;
    if (!namespace_of(c, *region, out, &ns)) return true;
    const auto keys = block_keys(*in);
    const bool unpin = req.op == static_cast<uint16_t>(proto::Op::kUnpin);
    // The pinned-bytes quota is the tenant's: every client of a tenant pins against one account.
    const store::PinAccount account{owner_account(c.owner), c.quota.pinned_bytes};
    std::vector<ErrorCode> codes(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      codes[i] =
          (unpin ? index->unpin({ns, keys[i]}, c.client_id) : index->pin({ns, keys[i]}, c.client_id, account)).code();
      if (codes[i] == ErrorCode::kResourceExhausted) quota_refusals->add();
    }
    write_statuses(c, in->status_offset, codes, out);
    observe(req.op, t0);
    return true;
  }

  bool evict(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (req.args[0] & ops::kEvictAllNs) {
      // Every namespace the client may see: an admin's every one, anyone else's their tenant's.
      out.result[0] = tiers->evict_all([&c](const std::string&, const std::string& t) { return sees(c, t); });
      observe(req.op, t0);
      return true;
    }
    auto in = take(c, req, out);
    if (!in) return true;
    auto region = region_of(c, req, out);
    if (!region) return true;
    store::NamespaceId ns;
    if (!namespace_of(c, *region, out, &ns)) return true;
    if (req.args[0] & ops::kEvictAll) {
      const auto name = index->namespace_name(ns);
      out.result[0] =
          tiers->evict_all([&name](const std::string& n, const std::string&) { return name && n == *name; });
      observe(req.op, t0);
      return true;
    }
    const auto keys = block_keys(*in);
    std::vector<ErrorCode> codes(keys.size());
    uint64_t evicted = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      codes[i] = tiers->evict(ns, keys[i]).code();
      evicted += codes[i] == ErrorCode::kOk;
    }
    write_statuses(c, in->status_offset, codes, out);
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

  /// Copies `v` into the fixed field `dst` (NUL-terminated, truncated).
  template <size_t N>
  static void put_str(char (&dst)[N], std::string_view v) {
    const size_t n = std::min(v.size(), N - 1);
    if (n) std::memcpy(dst, v.data(), n);  // an empty view's data() may be null
    dst[n] = '\0';
  }

  /// One TierStatsWire per lower tier this daemon runs: the disk, then the remote tier.
  std::vector<ops::TierStatsWire> tier_stats_wire() const {
    std::vector<ops::TierStatsWire> out;
    // The remote write-back tier (on_evict) holds nothing of its own: the remote entry below says it all.
    if (const store::Tier* t = remote_on_evict ? nullptr : tiers->lower()) {
      const auto u = t->usage();
      const auto h = t->health();
      ops::TierStatsWire w{};
      put_str(w.tier, t->name());
      w.flags = ops::kTierPresent | ops::kTierStorage | (h.ok ? ops::kTierHealthy : 0);
      w.capacity_bytes = u.capacity_bytes;
      w.used_bytes = u.used_bytes;
      w.blocks = u.blocks;
      w.pinned = u.pinned;
      w.evictions = h.evictions;
      w.io_errors = h.io_errors;
      w.checksum_failures = h.checksum_failures;
      w.bytes_written = h.bytes_written;
      w.bytes_read = h.bytes_read;
      put_str(w.reason, h.ok ? std::string_view() : std::string_view(h.reason));
      out.push_back(w);
    }
    if (const store::RemoteStore* r = remote.get()) {
      const Status h = r->health();
      ops::TierStatsWire w{};
      put_str(w.tier, "remote");
      w.flags = ops::kTierPresent | ops::kTierPeers | (h.ok() ? ops::kTierHealthy : 0);
      // Lost as /healthz counts them: unreachable or left; every other member but self is live.
      for (const auto& p : r->peers()) {
        w.blocks_out += p.blocks_out;
        w.bytes_out += p.bytes_out;
        w.blocks_in += p.blocks_in;
        w.bytes_in += p.bytes_in;
        w.errors += p.errors;
        if (p.is_self()) continue;
        ++(p.lost() ? w.peers_lost : w.peers_live);
      }
      put_str(w.member, r->id());
      put_str(w.reason, h.ok() ? std::string_view() : std::string_view(h.message()));
      out.push_back(w);
    }
    return out;
  }

  bool stats(const std::shared_ptr<ClientChannel>& cp, const ring::SubmitEntry& req, ring::CompletionEntry& out) {
    const auto t0 = Clock::now();
    ClientChannel& c = *cp;
    if (Status st = check_result_area(req, c.ch.arena_bytes, sizeof(ops::StatsWire)); !st.ok())
      return set_status(out, st.code()), true;
    const ops::StatsWire w = stats_wire();
    std::memcpy(c.ch.arena + req.arena_offset, &w, sizeof w);
    uint64_t n = 0;
    if (req.args[0] & ops::kStatsTiers) {
      // As many as the client's part holds (args[1]) and the arena has room for after the StatsWire.
      const auto t = tier_stats_wire();
      const uint64_t at = uint64_t{req.arena_offset} + sizeof w;
      const uint64_t room = (c.ch.arena_bytes - at) / sizeof(ops::TierStatsWire);
      n = std::min<uint64_t>({t.size(), room, req.args[1] ? req.args[1] : room});
      if (n) std::memcpy(c.ch.arena + at, t.data(), n * sizeof(ops::TierStatsWire));
    }
    out.arena_offset = req.arena_offset;
    out.count = static_cast<uint32_t>(1 + n);
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
    if (Status st = check_result_area(req, c.ch.arena_bytes, sizeof(ops::LsEntry)); !st.ok())
      return set_status(out, st.code()), true;
    std::optional<store::NamespaceId> ns;
    if (req.region != 0) {
      auto region = region_of(c, req, out);
      if (!region) return true;
      store::NamespaceId id;
      if (!namespace_of(c, *region, out, &id)) return true;
      ns = id;
    }
    const uint64_t room = (c.ch.arena_bytes - req.arena_offset) / sizeof(ops::LsEntry);
    const uint64_t limit = std::min<uint64_t>(room, req.args[0] ? req.args[0] : room);
    const auto ns_name = ns ? index->namespace_name(*ns) : std::nullopt;
    const auto list = tiers->list(
        [&](const std::string& name, const std::string& t) { return ns ? ns_name && name == *ns_name : sees(c, t); },
        limit);
    for (size_t i = 0; i < list.size(); ++i) {
      ops::LsEntry e{};
      e.key = {list[i].key.hi, list[i].key.lo};
      e.bytes = list[i].bytes;
      e.pins = list[i].pins;
      std::strncpy(e.ns, list[i].ns.c_str(), sizeof e.ns - 1);
      std::strncpy(e.format, list[i].format.c_str(), sizeof e.format - 1);
      // LsEntry::tier holds 7 characters: a block on the host and the disk reads "both".
      const std::string tier = list[i].tier.size() < sizeof e.tier ? list[i].tier : std::string("both");
      std::strncpy(e.tier, tier.c_str(), sizeof e.tier - 1);
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
    auto in = take(c, req, out);
    if (!in) return true;
    auto region = region_of(c, req, out);
    if (!region) return true;
    store::NamespaceId ns;
    if (!namespace_of(c, *region, out, &ns)) return true;
    const auto keys = block_keys(*in);
    Status st = index->corrupt_for_test({ns, keys[0]}, req.args[0]);
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
  std::unique_ptr<store::Tier> disk;
  if (!cfg.disk.path.empty()) {
    auto t = open_disk_tier(cfg, impl->opts, *impl->pool);
    if (!t.ok()) return t.status();
    disk = std::move(*t);
  }
  store::BlockIndex::Options io;
  io.high_watermark = cfg.host.high_watermark;
  io.low_watermark = cfg.host.low_watermark;
  // tiers.remote.write: on_evict makes the remote tier the host pool's write-back tier (the one
  // lower tier: the disk tier is off then).
  const bool on_evict = !cfg.remote.listen.empty() && cfg.remote.write == config::RemoteWrite::kOnEvict;
  if (on_evict && disk)
    return Status(ErrorCode::kConfig,
                  "tiers.remote.write: on_evict needs tiers.disk.path off: the host pool "
                  "writes back to one lower tier (use write: through with a disk tier)");
  io.write_back = disk != nullptr || on_evict;
  io.lower_name = on_evict ? "remote" : "disk";
  impl->index = std::make_shared<store::BlockIndex>(*impl->pool, io);
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
  store::TieredStore::Options to;
  to.write_through = cfg.disk.write_through;
  to.checksums = so.checksum;
  // The disk tier checks every read's XXH3 itself; a test wrapper may corrupt bytes after it.
  to.trust_lower_reads = impl->opts.test_disk_faults.empty();
  if (!cfg.remote.listen.empty()) {
    Impl* ip = impl.get();
    auto r = open_remote_tier(
        cfg, *impl->index, impl->metrics,
        [ip](store::NamespaceId ns, const std::string& tenant, uint32_t region, std::span<const store::BlockKey> keys,
             std::span<const int64_t> ids) { return ip->land(ns, tenant, region, keys, ids); },
        impl->opts);
    if (!r.ok()) return r.status();
    impl->remote = std::move(*r);
    if (cfg.remote.local_transfer) {
      impl->local = std::make_unique<LocalSender>(*impl->remote, impl->remote->id());
      LocalSender* ls = impl->local.get();
      impl->metrics.gauge_fn("kvferry_remote_local_sent_blocks",
                             "Blocks this daemon sent region to region into peers on its host (since start)",
                             "tier=\"remote\"", [ls] { return static_cast<double>(ls->blocks_sent()); });
    }
    impl->remote_timeout = cfg.remote.timeout;
    impl->remote_lookup_timeout = cfg.remote.lookup_timeout;
    impl->remote_on_evict = on_evict;
    impl->remote_workers = std::make_unique<WorkerPool>(2);
    store::RemoteStore* rs = impl->remote.get();
    if (!on_evict)  // as the write-back tier it gets the lower tier's gauges below
      impl->metrics.gauge_fn("kvferry_tier_healthy", "1 while a lower tier works, 0 once degraded (an I/O error)",
                             "tier=\"remote\"", [rs] { return rs->health().ok() ? 1.0 : 0.0; });
    for (const char* state : {"live", "lost"}) {
      const bool lost = state[1] == 'o';
      impl->metrics.gauge_fn("kvferry_remote_peers",
                             "Members of the remote tier's cluster other than this daemon: live, or lost (left the "
                             "cluster or unreachable)",
                             std::string("tier=\"remote\",state=\"") + state + "\"", [rs, lost] {
                               uint64_t n = 0;
                               for (const auto& p : rs->peers()) {
                                 if (!p.is_self()) n += p.lost() == lost;
                               }
                               return static_cast<double>(n);
                             });
    }
    if (on_evict) disk = impl->remote->write_back_tier();
  }
  impl->tiers = std::make_unique<store::TieredStore>(*impl->index, *impl->svc, impl->metrics, std::move(disk), to);

  Impl& d = *impl;
  auto& m = d.metrics;
  d.lookups_hit = &m.counter("kvferry_lookups_total", "Keys looked up", "result=\"hit\"");
  d.lookups_miss = &m.counter("kvferry_lookups_total", "Keys looked up", "result=\"miss\"");
  d.push_failures =
      &m.counter("kvferry_remote_push_failures_total",
                 "Saved blocks that did not reach their remote owner (kept on this daemon)", "tier=\"remote\"");
  d.quota_refusals = &m.counter("kvferry_quota_refusals_total",
                                "Pins and transfers refused by a tenant quota (limits.tenant, tenants[].quota)");
  static const std::pair<proto::Op, const char*> names[] = {{proto::Op::kLookup, "lookup"},
                                                            {proto::Op::kSave, "save"},
                                                            {proto::Op::kLoad, "load"},
                                                            {proto::Op::kPin, "pin"},
                                                            {proto::Op::kUnpin, "unpin"},
                                                            {proto::Op::kEvict, "evict"},
                                                            {proto::Op::kStats, "stats"},
                                                            {proto::Op::kLs, "ls"},
                                                            {proto::Op::kSend, "send"},
                                                            {proto::Op::kPeers, "peers"},
                                                            {proto::Op::kLoadMapped, "load_mapped"}};
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
  m.gauge_fn("kvferry_namespaces", "Live block namespaces (leased by a client or holding blocks)", "",
             [idx] { return static_cast<double>(idx->namespaces()); });
  if (store::Tier* t = d.tiers->lower()) {
    const std::string l = "tier=\"" + std::string(t->name()) + "\"";
    m.gauge_fn("kvferry_pool_used_bytes", "Host pool bytes in use", l,
               [t] { return static_cast<double>(t->usage().used_bytes); });
    m.gauge_fn("kvferry_pool_capacity_bytes", "Host pool capacity", l,
               [t] { return static_cast<double>(t->usage().capacity_bytes); });
    m.gauge_fn("kvferry_pool_occupancy_ratio", "Host pool bytes in use / capacity", l, [t] {
      auto u = t->usage();
      return u.capacity_bytes ? static_cast<double>(u.used_bytes) / static_cast<double>(u.capacity_bytes) : 0.0;
    });
    m.gauge_fn("kvferry_blocks_stored", "Blocks stored", l, [t] { return static_cast<double>(t->usage().blocks); });
    m.gauge_fn("kvferry_blocks_pinned", "Blocks pinned by clients", l,
               [t] { return static_cast<double>(t->usage().pinned); });
    m.gauge_fn("kvferry_evictions", "Blocks evicted since start (monotonic)", l,
               [t] { return static_cast<double>(t->health().evictions); });
    m.gauge_fn("kvferry_tier_healthy", "1 while a lower tier works, 0 once degraded (an I/O error)", l,
               [t] { return t->health().ok ? 1.0 : 0.0; });
    m.gauge_fn("kvferry_tier_io_errors", "I/O errors of a lower tier since start (monotonic)", l,
               [t] { return static_cast<double>(t->health().io_errors); });
    m.gauge_fn("kvferry_tier_checksum_failures", "Blocks a lower tier dropped because their bytes no longer matched", l,
               [t] { return static_cast<double>(t->health().checksum_failures); });
    m.gauge_fn("kvferry_tier_bytes_written", "Bytes a lower tier wrote since start (monotonic)", l,
               [t] { return static_cast<double>(t->health().bytes_written); });
    m.gauge_fn("kvferry_tier_bytes_read", "Bytes a lower tier read since start (monotonic)", l,
               [t] { return static_cast<double>(t->health().bytes_read); });
  }
  m.gauge_fn("kvferry_blocks_on_lower", "Host blocks that also have a copy on the lower tier", "tier=\"host\"",
             [idx] { return static_cast<double>(idx->stats().on_lower); });
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
  rings.set_handler(static_cast<uint16_t>(proto::Op::kSend), bind(&Impl::transfer));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kPeers), bind(&Impl::peers));
  rings.set_handler(static_cast<uint16_t>(proto::Op::kLoadMapped), bind(&Impl::transfer));
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
  if (impl_ && impl_->remote_workers) impl_->remote_workers->stop();
  if (impl_ && impl_->workers) impl_->workers->stop();
}

std::string DataOps::render_metrics() const { return impl_->metrics.render(); }

bool DataOps::healthy(std::string* body) const {
  const auto s = impl_->index->stats();
  const bool ok = impl_->workers->running();
  if (body) {
    *body = std::string(ok ? "ok" : "stopping") + ": host " + std::to_string(s.entries) + " blocks, " +
            std::to_string(s.used_bytes >> 20) + " of " + std::to_string(s.capacity_bytes >> 20) + " MiB\n";
    // A degraded lower tier is reported, not fatal: the daemon serves on from the host.
    if (const store::Tier* t = impl_->remote_on_evict ? nullptr : impl_->tiers->lower()) {
      const auto u = t->usage();
      const auto h = t->health();
      *body += std::string(t->name()) + " " + (h.ok ? "ok" : "degraded") + ": " + std::to_string(u.blocks) +
               " blocks, " + std::to_string(u.used_bytes >> 20) + " of " + std::to_string(u.capacity_bytes >> 20) +
               " MiB, " + std::to_string(h.io_errors) + " I/O errors, " + std::to_string(h.checksum_failures) +
               " checksum failures" + (h.ok ? std::string() : " (" + h.reason + ")") + "\n";
    }
    if (const store::RemoteStore* r = impl_->remote.get()) {
      const Status h = r->health();
      uint64_t live = 0, lost = 0;
      std::string lost_ids;
      for (const auto& p : r->peers()) {
        if (p.is_self()) continue;
        if (p.lost()) {
          ++lost;
          lost_ids += (lost_ids.empty() ? "" : ", ") + p.id;
        } else {
          ++live;
        }
      }
      *body += "remote " + std::string(h.ok() ? "ok" : "degraded") + ": member " + r->id() + ", " +
               std::to_string(live) + " peers live" +
               (lost ? ", " + std::to_string(lost) + " lost (" + lost_ids + ")" : std::string()) +
               (h.ok() ? std::string() : " (" + h.message() + ")") + "\n";
    }
  }
  return ok;
}

}  // namespace kvferry::daemon
