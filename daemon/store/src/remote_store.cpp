#include "kvferry/store/remote_store.h"

#if defined(KVFERRY_WITH_UCX)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "kvferry/config/host_port.h"
#include "kvferry/store/membership.h"
#include "kvferry/store/placement.h"
#include "kvferry/store/remote_wire.h"
#include "kvferry/store/tiered_store.h"
#include "kvferry/store/ucx_transport.h"
#include "task_pool.h"
#endif

namespace kvferry::store {

#if defined(KVFERRY_WITH_UCX)
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// Blocks per control call: a reserve reply of 4096 entries is 72 KiB, well under wire::kMaxBody.
constexpr size_t kBatch = 4096;
/// Bytes per one-sided get whose blocks are then checked while the next is on the wire.
constexpr uint64_t kPieceBytes = uint64_t{32} << 20;

/// Threads that help hash the blocks of a large commit (the progress thread is the eighth).
constexpr int kCommitHelpers = 7;

Status split_host_port(const std::string& hp, std::string* host, uint16_t* port) {
  config::HostPort p;
  switch (config::parse_host_port(hp, &p)) {
    case config::HostPortFault::kOk: break;
    case config::HostPortFault::kNotHostPort: return {ErrorCode::kInvalidArgument, "'" + hp + "' is not host:port"};
    case config::HostPortFault::kBadPort: return {ErrorCode::kInvalidArgument, "'" + hp + "' has a bad port"};
  }
  *host = std::move(p.host);
  *port = p.port;
  return Status::Ok();
}

/// Milliseconds left until `deadline` (at least 1 while it is ahead; 0 once passed).
milliseconds left_until(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (now >= deadline) return milliseconds(0);
  return std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline - now));
}

bool peer_failure(ErrorCode c) { return c == ErrorCode::kUnavailable || c == ErrorCode::kTimeout; }

/// This host's boot id (differs between machines and between boots; the same in every network
/// namespace of one kernel), or the host name when the kernel does not say.
std::string host_boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  char hn[256] = {};
  ::gethostname(hn, sizeof hn - 1);
  return std::string("host:") + hn;
}

}  // namespace

struct RemoteStore::Impl {
  struct PeerState {
    MemberRecord rec;
    bool live = false;  ///< in the current view
    PeerId ep = 0;      ///< our endpoint to it (0: none)
    Clock::time_point retry_after{};
    std::string last_error;
    Counter *blocks_out = nullptr, *bytes_out = nullptr, *blocks_in = nullptr, *bytes_in = nullptr, *errors = nullptr;
  };
  struct Pending {
    SaveReservation r;
    NamespaceId ns = 0;  ///< the namespace lease this reservation holds
    Clock::time_point expiry;
    std::string peer;  ///< who reserved it (member id)
    bool send = false;
    uint32_t land_region = 0;  ///< a send into a region: load the block there on commit
    int64_t land_id = -1;
    bool held = false;  ///< the block was stored already: nothing was reserved, only the landing
    BlockKey key;
  };

  RemoteStoreOptions opts;
  BlockIndex& index;
  Registry& metrics;
  std::string self_id;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<Membership> membership;

  mutable std::mutex mu;  // peers, placement, serving; never held across a transport call
  std::map<std::string, PeerState> peers;
  std::shared_ptr<const RendezvousPlacement> placement;
  bool serving = true;
  std::string lost_reason;

  std::mutex res_mu;  // reservations made by peers (owner side)
  std::unordered_map<uint64_t, Pending> pending;
  uint64_t next_reservation = 1;

  std::mutex commit_mu;  // wakes wait_for() on every commit from a peer
  std::condition_variable commit_cv;
  uint64_t commits = 0;

  std::mutex sweep_mu;
  std::condition_variable sweep_cv;
  bool stopping = false;
  std::thread sweeper;

  Counter *served_lookups = nullptr, *served_blocks_in = nullptr, *torn_reads = nullptr, *refused = nullptr,
          *commit_mismatch = nullptr, *landing_failures = nullptr, *local_landed = nullptr;

  TaskPool hashers{kCommitHelpers};  // a large commit's blocks are hashed on these and the progress thread
  std::string boot_id;               // this host's (/proc/sys/kernel/random/boot_id): peers with the same one share it

  // Keys peers on this host copied into this daemon's regions (region to region: not stored here),
  // by namespace name, for wait_for; guarded by commit_mu, the oldest dropped past kMaxLanded.
  static constexpr size_t kMaxLanded = size_t{1} << 16;
  std::map<std::string, std::unordered_set<BlockKey, BlockKeyHash>> landed;
  std::deque<std::pair<std::string, BlockKey>> landed_order;

  Impl(RemoteStoreOptions o, BlockIndex& i, Registry& m) : opts(std::move(o)), index(i), metrics(m) {}

  void warn(const std::string& s) const {
    if (opts.log)
      opts.log(s);
    else
      std::fprintf(stderr, "remote tier: %s\n", s.c_str());
  }
  void note(const std::string& s) const {
    if (opts.info) opts.info(s);
  }

  PeerState& peer_locked(const std::string& id) {
    auto [it, fresh] = peers.try_emplace(id);
    if (fresh) {
      const std::string l = "tier=\"remote\",peer=\"" + id + "\"";
      auto c = [&](const char* name, const char* help, const char* dir) {
        return &metrics.counter(name, help, l + ",dir=\"" + dir + "\"");
      };
      it->second.blocks_out = c("kvferry_remote_blocks_total", "Blocks moved to (out) or from (in) a peer", "out");
      it->second.blocks_in = c("kvferry_remote_blocks_total", "Blocks moved to (out) or from (in) a peer", "in");
      it->second.bytes_out = c("kvferry_remote_bytes_total", "Bytes moved to (out) or from (in) a peer", "out");
      it->second.bytes_in = c("kvferry_remote_bytes_total", "Bytes moved to (out) or from (in) a peer", "in");
      it->second.errors = &metrics.counter(
          "kvferry_remote_errors_total", "Blocks whose move to or from a peer failed (peer lost, timeout, refused)", l);
    }
    return it->second;
  }

  // ---- view ----

  void apply_view() {
    auto view = membership->members();
    std::vector<std::string> ids;
    std::vector<PeerId> drop;
    {
      std::lock_guard g(mu);
      for (auto& [id, p] : peers) p.live = false;
      for (auto& m : view) {
        ids.push_back(m.id);
        if (m.id == self_id) continue;
        PeerState& p = peer_locked(m.id);
        if (p.ep && (p.rec.incarnation != m.incarnation || p.rec.address != m.address)) {
          drop.push_back(p.ep);  // restarted or moved: its endpoint and rkey are stale
          p.ep = 0;
        }
        p.rec = m;
        p.live = true;
      }
      for (auto& [id, p] : peers)
        if (!p.live && p.ep) {
          drop.push_back(p.ep);
          p.ep = 0;
        }
      placement = std::make_shared<const RendezvousPlacement>(std::move(ids));
    }
    for (PeerId e : drop) transport->disconnect(e);
  }

  void on_event(const MembershipEvent& ev) {
    switch (ev.type) {
      case MembershipEventType::kLost: {
        std::lock_guard g(mu);
        serving = false;
        lost_reason = ev.reason;
        warn("this daemon lost its cluster membership (" + ev.reason + "): it stops serving remote reads");
        return;
      }
      case MembershipEventType::kRestored: {
        std::lock_guard g(mu);
        serving = true;
        lost_reason.clear();
        note("cluster membership restored");
        break;
      }
      case MembershipEventType::kJoined: note("peer " + ev.member.id + " joined at " + ev.member.address); break;
      case MembershipEventType::kUpdated:
        note("peer " + ev.member.id + " restarted (incarnation " + std::to_string(ev.member.incarnation) + ")");
        break;
      case MembershipEventType::kLeft: note("peer " + ev.member.id + " left"); break;
    }
    apply_view();
  }

  std::shared_ptr<const RendezvousPlacement> view() const {
    std::lock_guard g(mu);
    return placement;
  }

  // ---- endpoints ----

  /// Our endpoint to member `id`, connecting when there is none. kUnavailable ("peer lost: ...")
  /// when it is not a live member or cannot be reached (a failed attempt is not repeated for 1 s).
  Result<PeerId> endpoint(const std::string& id) {
    std::string address;
    {
      std::lock_guard g(mu);
      auto it = peers.find(id);
      if (it == peers.end() || !it->second.live)
        return Status(ErrorCode::kUnavailable, "peer lost: " + id + " is not a live member of the cluster");
      if (it->second.ep) return it->second.ep;
      if (Clock::now() < it->second.retry_after)
        return Status(ErrorCode::kUnavailable, "peer lost: " + id + " is unreachable (" + it->second.last_error + ")");
      address = it->second.rec.address;
    }
    std::string host;
    uint16_t port = 0;
    Status st = split_host_port(address, &host, &port);
    Result<PeerId> ep = st.ok() ? transport->connect(host, port) : Result<PeerId>(st);
    if (ep.ok()) {
      auto info = transport->peer(*ep);
      if (!info || info->name != id) {
        transport->disconnect(*ep);
        ep = Status(ErrorCode::kPermissionDenied,
                    "the daemon at " + address + " says it is '" + (info ? info->name : "?") + "', not '" + id + "'");
      }
    }
    std::lock_guard g(mu);
    auto it = peers.find(id);
    if (!ep.ok()) {
      if (it != peers.end()) {
        it->second.retry_after = Clock::now() + milliseconds(1000);
        it->second.last_error = ep.status().to_string();
      }
      return Status(ErrorCode::kUnavailable,
                    "peer lost: cannot reach " + id + " at " + address + ": " + ep.status().to_string());
    }
    if (it == peers.end() || !it->second.live || it->second.ep) {
      const PeerId keep = it != peers.end() && it->second.live ? it->second.ep : 0;
      transport->disconnect(*ep);  // another thread connected meanwhile, or the peer left
      if (keep) return keep;
      return Status(ErrorCode::kUnavailable, "peer lost: " + id + " left the cluster");
    }
    it->second.ep = *ep;
    it->second.last_error.clear();
    return *ep;
  }

  /// A transfer to `id` over `ep` failed with `st`: forget the endpoint when the failure was the peer's.
  void failed(const std::string& id, PeerId ep, const Status& st) {
    if (!peer_failure(st.code())) return;
    {
      std::lock_guard g(mu);
      auto it = peers.find(id);
      if (it != peers.end() && it->second.ep == ep) {
        it->second.ep = 0;
        it->second.last_error = st.to_string();
      }
    }
    transport->disconnect(ep);
  }

  void count(const std::string& id, bool out, uint64_t blocks, uint64_t bytes, uint64_t errors) {
    std::lock_guard g(mu);
    PeerState& p = peer_locked(id);
    (out ? p.blocks_out : p.blocks_in)->add(blocks);
    (out ? p.bytes_out : p.bytes_in)->add(bytes);
    p.errors->add(errors);
  }

  // ---- owner side (the transport's progress thread) ----

  Result<std::vector<uint8_t>> serve(const PeerInfo& peer, uint16_t op, std::span<const uint8_t> body) {
    {
      std::lock_guard g(mu);
      if (!serving)
        return Status(ErrorCode::kUnavailable,
                      "peer lost: " + self_id + " lost its cluster membership (" + lost_reason + ")");
    }
    switch (static_cast<wire::RemoteOp>(op)) {
      case wire::RemoteOp::kLookup: return serve_lookup(body);
      case wire::RemoteOp::kReserve: return serve_reserve(peer, body);
      case wire::RemoteOp::kCommit: return serve_commit(peer, body);
      case wire::RemoteOp::kPing: return std::vector<uint8_t>(body.begin(), body.end());
      case wire::RemoteOp::kLocalExport: return serve_local_export(peer, body);
      case wire::RemoteOp::kLocalLanded: return serve_local_landed(peer, body);
      default: break;
    }
    refused->add();
    return Status(ErrorCode::kUnsupported, "remote op " + std::to_string(op) + " is not served");
  }

  /// A peer on this host asks to import one of this daemon's regions: the daemon grants a token.
  Result<std::vector<uint8_t>> serve_local_export(const PeerInfo& peer, std::span<const uint8_t> body) {
    KVFERRY_ASSIGN_OR_RETURN(auto q, wire::LocalExportRequest::decode(body));
    if (!opts.grant_import || opts.socket.empty())
      return Status(ErrorCode::kUnsupported, self_id + " does not export regions to peers (local_transfer is off)");
    KVFERRY_ASSIGN_OR_RETURN(auto token, opts.grant_import(TieredStore::tenant_of(q.ns), q.region));
    note("peer " + peer.name + " imports region " + std::to_string(q.region) + " for region-to-region sends");
    return wire::LocalExportReply{boot_id, opts.socket, std::move(token)}.encode();
  }

  /// A peer on this host copied blocks into one of this daemon's regions: check them, remember the
  /// keys as landed and wake the waiters.
  Result<std::vector<uint8_t>> serve_local_landed(const PeerInfo&, std::span<const uint8_t> body) {
    KVFERRY_ASSIGN_OR_RETURN(auto q, wire::LocalLanded::decode(body));
    if (!opts.on_local_landed)
      return Status(ErrorCode::kUnsupported, self_id + " does not take region-to-region sends");
    const auto st = opts.on_local_landed(q.token, TieredStore::tenant_of(q.ns), q.region, q.ids);
    wire::CommitReply rep;
    rep.codes.resize(q.keys.size(), ErrorCode::kInternal);
    std::lock_guard g(commit_mu);
    uint64_t n = 0;
    for (size_t i = 0; i < q.keys.size() && i < st.size(); ++i) {
      rep.codes[i] = st[i].code();
      if (!st[i].ok() || !landed[q.ns].insert(q.keys[i]).second) continue;  // the entry only once one lands
      landed_order.emplace_back(q.ns, q.keys[i]);
      ++n;
    }
    while (landed_order.size() > kMaxLanded) {
      auto& [ns, key] = landed_order.front();
      if (auto it = landed.find(ns); it != landed.end()) {
        it->second.erase(key);
        if (it->second.empty()) landed.erase(it);
      }
      landed_order.pop_front();
    }
    local_landed->add(n);
    ++commits;
    commit_cv.notify_all();
    return rep.encode();
  }

  Result<std::vector<uint8_t>> serve_lookup(std::span<const uint8_t> body) {
    KVFERRY_ASSIGN_OR_RETURN(auto q, wire::LookupRequest::decode(body));
    wire::LookupReply rep;
    rep.entries.resize(q.keys.size());
    const auto ns = index.namespace_id(q.ns);
    for (size_t i = 0; ns && i < q.keys.size(); ++i) {
      auto h = index.acquire(NsKey{*ns, q.keys[i]});
      if (!h.ok()) continue;
      rep.entries[i] = {true, h->slot.offset, h->meta.bytes, h->meta.checksum,
                        TieredStore::record_format(h->meta.shape)};
      index.release(*h);
    }
    served_lookups->add(q.keys.size());
    return rep.encode();
  }

  Result<std::vector<uint8_t>> serve_reserve(const PeerInfo& peer, std::span<const uint8_t> body) {
    KVFERRY_ASSIGN_OR_RETURN(auto q, wire::ReserveRequest::decode(body));
    auto shape = TieredStore::shape_of(q.format);
    if (!shape || static_cast<uint64_t>(shape->bytes()) != q.bytes)
      return Status(ErrorCode::kInvalidArgument, "reserve: format '" + q.format + "' does not describe blocks of " +
                                                     std::to_string(q.bytes) + " bytes");
    const std::string tenant = TieredStore::tenant_of(q.ns);
    wire::ReserveReply rep;
    rep.entries.resize(q.keys.size());
    const auto expiry = Clock::now() + 2 * opts.timeout;
    for (size_t i = 0; i < q.keys.size(); ++i) {
      auto ns = index.acquire_namespace(q.ns, tenant);
      if (!ns.ok()) {
        rep.entries[i].code = ns.status().code();
        continue;
      }
      const uint32_t land = q.land_region;
      const int64_t land_id = land && i < q.land_ids.size() ? q.land_ids[i] : -1;
      auto r = index.reserve(NsKey{*ns, q.keys[i]}, *shape);
      if (!r.ok()) {
        if (r.status().code() == ErrorCode::kAlreadyExists && land) {
          // Held already: nothing to put, but the commit still lands it in the region.
          std::lock_guard g(res_mu);
          const uint64_t id = next_reservation++;
          pending.emplace(id, Pending{{}, *ns, expiry, peer.name, q.send, land, land_id, true, q.keys[i]});
          rep.entries[i] = {ErrorCode::kAlreadyExists, 0, id};
          continue;
        }
        index.release_namespace(*ns);
        rep.entries[i].code = r.status().code();
        continue;
      }
      std::lock_guard g(res_mu);
      const uint64_t id = next_reservation++;
      pending.emplace(id, Pending{*r, *ns, expiry, peer.name, q.send, land, land_id, false, q.keys[i]});
      rep.entries[i] = {ErrorCode::kOk, r->slot.offset, id};
    }
    return rep.encode();
  }

  Result<std::vector<uint8_t>> serve_commit(const PeerInfo& peer, std::span<const uint8_t> body) {
    KVFERRY_ASSIGN_OR_RETURN(auto q, wire::CommitRequest::decode(body));
    wire::CommitReply rep;
    rep.codes.resize(q.items.size(), ErrorCode::kOk);
    std::vector<std::optional<Pending>> ps(q.items.size());
    uint64_t bytes = 0;
    {
      std::lock_guard g(res_mu);
      for (size_t i = 0; i < q.items.size(); ++i) {
        auto it = pending.find(q.items[i].reservation);
        if (it == pending.end() || it->second.peer != peer.name) {
          rep.codes[i] = ErrorCode::kNotFound;  // expired (and dropped) or never this peer's
          continue;
        }
        ps[i] = it->second;
        bytes += it->second.r.bytes;
        pending.erase(it);
      }
    }
    // Each landed block is hashed before it is indexed: on a few threads for a large batch, so
    // the progress thread (which the peer's next puts need) is held as briefly as possible.
    std::atomic<uint64_t> committed{0};
    hashers.parallel_for(q.items.size(), q.items.empty() ? 0 : bytes / q.items.size(), [&](size_t i) {
      if (!ps[i]) return;
      const Pending& p = *ps[i];
      if (p.held) {
        if (!q.items[i].done) rep.codes[i] = ErrorCode::kCancelled;
        return;  // stored already: only its landing is left
      }
      if (!q.items[i].done) {
        index.abort(p.r);
        rep.codes[i] = ErrorCode::kCancelled;
      } else if (block_checksum(p.r.data, p.r.bytes) != q.items[i].checksum) {
        // The bytes that landed are not the block the peer hashed: never index them.
        index.abort(p.r);
        commit_mismatch->add();
        rep.codes[i] = ErrorCode::kChecksumMismatch;
      } else {
        index.commit(p.r, q.items[i].checksum);
        served_blocks_in->add();
        committed.fetch_add(1);
      }
    });
    land(ps, rep);
    for (auto& p : ps)
      if (p) index.release_namespace(p->ns);
    if (committed.load()) {
      std::lock_guard g(commit_mu);
      commits += committed.load();
      commit_cv.notify_all();
    }
    return rep.encode();
  }

  /// Loads the committed (or already held) blocks of a send into the regions it named, one call
  /// per namespace and region; a block that does not land gets the landing's error.
  void land(const std::vector<std::optional<Pending>>& ps, wire::CommitReply& rep) {
    std::map<std::pair<NamespaceId, uint32_t>, std::vector<size_t>> groups;
    for (size_t i = 0; i < ps.size(); ++i)
      if (ps[i] && ps[i]->land_region && rep.codes[i] == ErrorCode::kOk)
        groups[{ps[i]->ns, ps[i]->land_region}].push_back(i);
    for (auto& [where, items] : groups) {
      std::vector<BlockKey> keys;
      std::vector<int64_t> ids;
      for (size_t i : items) {
        keys.push_back(ps[i]->key);
        ids.push_back(ps[i]->land_id);
      }
      const auto name = index.namespace_name(where.first);
      std::vector<Status> st = opts.on_land && name
                                   ? opts.on_land(where.first, TieredStore::tenant_of(*name), where.second, keys, ids)
                                   : std::vector<Status>(items.size(), Status(ErrorCode::kUnsupported, "no landing"));
      for (size_t k = 0; k < items.size(); ++k) {
        const Status s = k < st.size() ? st[k] : Status(ErrorCode::kInternal, "landing returned too few statuses");
        if (!s.ok()) {
          rep.codes[items[k]] = s.code();
          if (landing_failures) landing_failures->add();
        }
      }
    }
  }

  /// Drops reservations whose commit never came (the peer died or gave up).
  void sweep() {
    std::unique_lock lk(sweep_mu);
    while (!stopping) {
      sweep_cv.wait_for(lk, milliseconds(250));
      std::vector<Pending> expired;
      {
        std::lock_guard g(res_mu);
        const auto now = Clock::now();
        for (auto it = pending.begin(); it != pending.end();)
          if (stopping || it->second.expiry < now) {
            expired.push_back(it->second);
            it = pending.erase(it);
          } else {
            ++it;
          }
      }
      for (auto& p : expired) {
        if (!p.held) index.abort(p.r);
        index.release_namespace(p.ns);
      }
      if (!expired.empty() && !stopping)
        warn(std::to_string(expired.size()) + " reserved block(s) of peer " + expired.front().peer +
             " were never committed; dropped");
    }
  }

  // ---- requester side ----

  /// The remote owners of `key` in rank order (self excluded).
  static std::vector<std::string> owners(const RendezvousPlacement& pl, const BlockKey& key, size_t replicas,
                                         const std::string& self) {
    std::vector<std::string> out;
    for (size_t i : pl.owners(key, replicas))
      if (pl.ids()[i] != self) out.push_back(pl.ids()[i]);
    return out;
  }

  /// `land_region` != 0: a send whose blocks land in that region of the peer, at `land_ids[i]`.
  /// `preheld` (one per key, when given): the caller holds the blocks already (a write-back
  /// demotion); they are neither acquired nor released here, and their LRU places stay.
  void push_to(const std::string& peer, NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
               const std::vector<size_t>& idx, Clock::time_point deadline, bool send, std::vector<Status>& out,
               uint32_t land_region = 0, std::span<const int64_t> land_ids = {}, std::span<const Hold> preheld = {}) {
    auto fail = [&](size_t i, const Status& s) {
      if (out[i].ok()) out[i] = s;
    };
    // Hold the local copies for the whole move: eviction must not reuse a slot a put reads.
    std::vector<Hold> holds;
    std::vector<size_t> which;
    for (size_t i : idx) {
      if (!preheld.empty()) {
        holds.push_back(preheld[i]);
        which.push_back(i);
        continue;
      }
      auto h = index.acquire(NsKey{ns, keys[i]});
      if (!h.ok()) {
        fail(i, Status(ErrorCode::kNotFound, "block " + keys[i].hex() + " is not stored on " + self_id));
        continue;
      }
      holds.push_back(*h);
      which.push_back(i);
    }
    auto release = [&] {
      if (preheld.empty())
        for (auto& h : holds) index.release(h);
    };
    if (holds.empty()) return;
    auto ep = endpoint(peer);
    if (!ep.ok()) {
      for (size_t i : which) fail(i, ep.status());
      count(peer, true, 0, 0, which.size());
      release();
      return;
    }
    uint64_t moved = 0, moved_bytes = 0, errors = 0;
    for (size_t a = 0; a < holds.size();) {
      // One call per run of holds of one format (a region's blocks are all one), at most kBatch.
      const std::string fmt = TieredStore::record_format(holds[a].meta.shape);
      size_t b = a + 1;
      while (b < holds.size() && b - a < kBatch && holds[b].meta.shape == holds[a].meta.shape) ++b;
      wire::ReserveRequest q{ns_name, fmt, holds[a].meta.bytes, {}, send, land_region, {}};
      for (size_t k = a; k < b; ++k) {
        q.keys.push_back(holds[k].key.key);
        if (land_region) q.land_ids.push_back(which[k] < land_ids.size() ? land_ids[which[k]] : -1);
      }
      auto failed_run = [&](const Status& s) {
        for (size_t k = a; k < b; ++k) fail(which[k], s);
        errors += b - a;
      };
      const milliseconds budget = left_until(deadline);
      if (budget.count() == 0) {
        failed_run(Status(ErrorCode::kTimeout, "the deadline passed before the blocks went to " + peer));
        a = b;
        continue;
      }
      auto rep = transport->call(*ep, static_cast<uint16_t>(wire::RemoteOp::kReserve), q.encode(), budget);
      Result<wire::ReserveReply> rr =
          rep.ok() ? wire::ReserveReply::decode(*rep) : Result<wire::ReserveReply>(rep.status());
      if (rr.ok() && rr->entries.size() != b - a)
        rr = Status(ErrorCode::kProtocol, peer + " answered a reserve of " + std::to_string(b - a) + " blocks with " +
                                              std::to_string(rr->entries.size()));
      if (!rr.ok()) {
        failed_run(rr.status().with_context("reserving room on " + peer));
        failed(peer, *ep, rr.status());
        if (peer_failure(rr.status().code())) break;
        a = b;
        continue;
      }
      std::vector<RemoteCopy> copies;
      std::vector<size_t> put_of;   // hold index per copy
      std::vector<size_t> land_of;  // held there already, to land only
      for (size_t k = a; k < b; ++k) {
        const auto& e = rr->entries[k - a];
        if (e.code == ErrorCode::kAlreadyExists) {  // the target holds it already
          if (e.reservation) land_of.push_back(k);
          continue;
        }
        if (e.code != ErrorCode::kOk) {
          fail(which[k], Status(e.code, peer + " refused block " + holds[k].key.key.hex()));
          ++errors;
          continue;
        }
        copies.push_back({holds[k].slot.offset, e.offset, holds[k].meta.bytes});
        put_of.push_back(k);
      }
      if (!copies.empty() || !land_of.empty()) {
        auto sts = copies.empty() ? std::vector<Status>{} : transport->put(*ep, copies, left_until(deadline));
        wire::CommitRequest c;
        for (size_t j = 0; j < copies.size(); ++j)
          c.items.push_back(
              {rr->entries[put_of[j] - a].reservation, holds[put_of[j]].meta.checksum, j < sts.size() && sts[j].ok()});
        for (size_t k : land_of) c.items.push_back({rr->entries[k - a].reservation, 0, true});
        put_of.insert(put_of.end(), land_of.begin(), land_of.end());
        Status lost;
        for (size_t j = 0; j < copies.size(); ++j)
          if (j >= sts.size() || !sts[j].ok()) {
            lost = j < sts.size() ? sts[j] : Status(ErrorCode::kInternal, "put returned too few statuses");
            fail(which[put_of[j]], lost.with_context("writing to " + peer));
            ++errors;
          }
        // The commit tells the owner which puts landed (the others' slots are freed at once).
        auto cr = transport->call(*ep, static_cast<uint16_t>(wire::RemoteOp::kCommit), c.encode(),
                                  std::max(left_until(deadline), milliseconds(100)));
        Result<wire::CommitReply> crr =
            cr.ok() ? wire::CommitReply::decode(*cr) : Result<wire::CommitReply>(cr.status());
        if (crr.ok() && crr->codes.size() != c.items.size())
          crr = Status(ErrorCode::kProtocol, peer + " answered a commit with the wrong count");
        for (size_t j = 0; j < c.items.size(); ++j) {
          if (!c.items[j].done) continue;
          const size_t k = put_of[j];
          if (!crr.ok()) {
            fail(which[k], crr.status().with_context("committing on " + peer));
            ++errors;
          } else if (crr->codes[j] != ErrorCode::kOk) {
            fail(which[k], Status(crr->codes[j], peer + " did not " + (land_region ? "land" : "store") + " block " +
                                                     holds[k].key.key.hex() +
                                                     (crr->codes[j] == ErrorCode::kChecksumMismatch
                                                          ? ": the bytes that landed did not match their checksum"
                                                          : "")));
            ++errors;
          } else if (j < copies.size()) {
            ++moved;
            moved_bytes += holds[k].meta.bytes;
          }
        }
        if (!lost.ok()) failed(peer, *ep, lost);
        if (!crr.ok()) failed(peer, *ep, crr.status());
        if ((!lost.ok() && peer_failure(lost.code())) || (!crr.ok() && peer_failure(crr.status().code()))) {
          for (size_t k = b; k < holds.size(); ++k) fail(which[k], lost.ok() ? crr.status() : lost);
          errors += holds.size() - b;
          break;
        }
      }
      a = b;
    }
    count(peer, true, moved, moved_bytes, errors);
    release();
  }

  /// Fetches keys `idx` from `peer`. Per key: out = kOk, or left kNotFound (a miss there), or the
  /// error. `asked`: set for keys the peer answered for.
  void fetch_from(const std::string& peer, NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                  const std::vector<size_t>& idx, Clock::time_point deadline, std::vector<Status>& out) {
    auto ep = endpoint(peer);
    if (!ep.ok()) {
      for (size_t i : idx) out[i] = ep.status();
      count(peer, false, 0, 0, idx.size());
      return;
    }
    uint64_t moved = 0, moved_bytes = 0, errors = 0;
    for (size_t a = 0; a < idx.size(); a += kBatch) {
      const size_t b = std::min(idx.size(), a + kBatch);
      const milliseconds budget = left_until(deadline);
      if (budget.count() == 0) {
        for (size_t k = a; k < b; ++k)
          out[idx[k]] = Status(ErrorCode::kTimeout, "the deadline passed before the block was asked of " + peer);
        continue;
      }
      wire::LookupRequest q{ns_name, {}};
      for (size_t k = a; k < b; ++k) q.keys.push_back(keys[idx[k]]);
      auto rep = transport->call(*ep, static_cast<uint16_t>(wire::RemoteOp::kLookup), q.encode(), budget);
      Result<wire::LookupReply> lr =
          rep.ok() ? wire::LookupReply::decode(*rep) : Result<wire::LookupReply>(rep.status());
      if (lr.ok() && lr->entries.size() != b - a)
        lr = Status(ErrorCode::kProtocol, peer + " answered a lookup with the wrong count");
      if (!lr.ok()) {
        for (size_t k = a; k < b; ++k) out[idx[k]] = lr.status().with_context("asking " + peer);
        errors += b - a;
        failed(peer, *ep, lr.status());
        if (peer_failure(lr.status().code())) {
          for (size_t k = b; k < idx.size(); ++k) out[idx[k]] = lr.status().with_context("asking " + peer);
          errors += idx.size() - b;
          break;
        }
        continue;
      }
      std::vector<SaveReservation> res;
      std::vector<RemoteCopy> copies;
      std::vector<size_t> of;  // position in idx per copy
      for (size_t k = a; k < b; ++k) {
        const auto& e = lr->entries[k - a];
        const size_t i = idx[k];
        if (!e.found) continue;  // stays kNotFound
        auto shape = TieredStore::shape_of(e.format);
        if (!shape || static_cast<uint64_t>(shape->bytes()) != e.bytes) {
          out[i] = Status(ErrorCode::kProtocol, peer + " described block " + keys[i].hex() + " as '" + e.format +
                                                    "' of " + std::to_string(e.bytes) + " bytes");
          ++errors;
          continue;
        }
        auto r = index.reserve(NsKey{ns, keys[i]}, *shape);
        if (!r.ok()) {
          // Stored here meanwhile (another fetch or a save): done. Else no room.
          out[i] = r.status().code() == ErrorCode::kAlreadyExists ? Status::Ok() : r.status();
          continue;
        }
        res.push_back(*r);
        copies.push_back({r->slot.offset, e.offset, e.bytes});
        of.push_back(k);
      }
      if (copies.empty()) continue;
      // Got in pieces of about kPieceBytes: each piece is checked (XXH3 against the owner's) and
      // committed on a thread of its own while the next piece is on the wire.
      const uint64_t per_piece = std::max<uint64_t>(1, kPieceBytes / std::max<uint64_t>(copies.front().bytes, 1));
      std::vector<std::future<void>> checks;
      std::atomic<uint64_t> ok_blocks{0}, ok_bytes{0}, bad{0};
      Status lost;
      size_t c0 = 0;
      for (; c0 < copies.size() && lost.ok(); c0 += per_piece) {
        const size_t c1 = std::min<size_t>(copies.size(), c0 + per_piece);
        auto sts = transport->get(*ep, std::span<const RemoteCopy>(copies).subspan(c0, c1 - c0), left_until(deadline));
        for (size_t j = c0; j < c1; ++j)
          if (j - c0 >= sts.size() || !sts[j - c0].ok()) {
            lost = j - c0 < sts.size() ? sts[j - c0] : Status(ErrorCode::kInternal, "get returned too few statuses");
            break;
          }
        checks.push_back(std::async(std::launch::async, [&, c0, c1, sts = std::move(sts)] {
          for (size_t j = c0; j < c1; ++j) {
            const size_t i = idx[of[j]];
            const auto& e = lr->entries[of[j] - a];
            if (j - c0 >= sts.size() || !sts[j - c0].ok()) {
              index.abort(res[j]);
              out[i] = (j - c0 < sts.size() ? sts[j - c0] : Status(ErrorCode::kInternal, "get returned too few"))
                           .with_context("reading from " + peer);
              bad.fetch_add(1);
            } else if (block_checksum(res[j].data, e.bytes) != e.checksum) {
              // The owner dropped or reused the slot while it was read: a miss, never these bytes.
              index.abort(res[j]);
              torn_reads->add();
              out[i] =
                  Status(ErrorCode::kNotFound, "block " + keys[i].hex() + " changed on " + peer + " while it was read");
            } else {
              index.commit(res[j], e.checksum);
              out[i] = Status::Ok();
              ok_blocks.fetch_add(1);
              ok_bytes.fetch_add(e.bytes);
            }
          }
        }));
      }
      for (size_t j = c0; j < copies.size(); ++j) {  // not asked for: the peer was lost before
        index.abort(res[j]);
        out[idx[of[j]]] = lost.with_context("reading from " + peer);
        bad.fetch_add(1);
      }
      for (auto& f : checks) f.get();
      moved += ok_blocks.load();
      moved_bytes += ok_bytes.load();
      errors += bad.load();
      if (!lost.ok()) {
        failed(peer, *ep, lost);
        if (peer_failure(lost.code())) {
          for (size_t k = b; k < idx.size(); ++k) out[idx[k]] = lost.with_context("reading from " + peer);
          errors += idx.size() - b;
          break;
        }
      }
    }
    count(peer, false, moved, moved_bytes, errors);
  }
};

namespace {

/// The remote tier as the host pool's write-back tier (tiers.remote.write: on_evict): the store's
/// demotions of least recently used blocks become pushes to their owners, done on a thread of its
/// own. It holds nothing itself (lookups, lists and reads go through the RemoteStore's own paths).
class RemoteWriteBackTier final : public Tier {
 public:
  RemoteWriteBackTier(RemoteStore::Impl& r, BlockIndex& index, std::chrono::milliseconds timeout)
      : r_(r), index_(index), timeout_(timeout), thread_([this] { run(); }) {}
  ~RemoteWriteBackTier() override {
    {
      std::lock_guard g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::string_view name() const override { return "remote"; }
  Result<uint64_t> recover() override { return uint64_t{0}; }
  Status register_buffers(std::span<const iovec>) override { return Status::Ok(); }
  Status submit(std::span<const TierRequest> batch) override {
    std::lock_guard g(mu_);
    if (stop_) return {ErrorCode::kCancelled, "the remote tier is stopping"};
    queue_.emplace_back(batch.begin(), batch.end());
    cv_.notify_all();
    return Status::Ok();
  }
  size_t poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) override {
    std::unique_lock lk(mu_);
    done_cv_.wait_for(lk, wait, [&] { return !done_.empty(); });
    size_t n = 0;
    while (!done_.empty() && n < max) {
      out.push_back(std::move(done_.front()));
      done_.pop_front();
      ++n;
    }
    return n;
  }
  std::optional<BlockRecord> lookup(std::string_view, const BlockKey&) override { return std::nullopt; }
  Status erase(std::string_view, const BlockKey&) override { return {ErrorCode::kNotFound, "not held here"}; }
  std::vector<BlockRecord> list(std::optional<std::string_view>, size_t) const override { return {}; }
  Status pin(std::string_view, const BlockKey&) override { return {ErrorCode::kNotFound, "not held here"}; }
  Status unpin(std::string_view, const BlockKey&) override { return {ErrorCode::kNotFound, "not held here"}; }
  std::vector<BlockRecord> evict(uint64_t) override { return {}; }
  std::vector<BlockRecord> take_victims() override { return {}; }
  TierUsage usage() const override { return {}; }
  TierHealth health() const override {
    TierHealth h;
    std::lock_guard g(r_.mu);
    h.ok = r_.serving;
    h.reason = r_.serving ? "" : "cluster membership lost: " + r_.lost_reason;
    h.bytes_written = written_.load();
    h.io_errors = failed_.load();
    return h;
  }

 private:
  void run() {
    for (;;) {
      std::vector<TierRequest> batch;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        batch = std::move(queue_.front());
        queue_.pop_front();
      }
      std::vector<TierCompletion> out(batch.size());
      std::map<std::string, std::vector<size_t>> by_ns;
      for (size_t i = 0; i < batch.size(); ++i) {
        out[i] = {batch[i].cookie, batch[i].op, Status::Ok(), batch[i].record};
        if (batch[i].op == TierOp::kWrite)
          by_ns[batch[i].record.ns].push_back(i);
        else
          out[i].status = {ErrorCode::kNotFound, "the remote write-back tier serves no reads"};
      }
      for (auto& [name, items] : by_ns) push(name, items, batch, out);
      std::lock_guard g(mu_);
      for (auto& c : out) done_.push_back(std::move(c));
      done_cv_.notify_all();
    }
  }

  /// The blocks of one namespace to their owners, as the holds the demotion took.
  void push(const std::string& name, const std::vector<size_t>& items, const std::vector<TierRequest>& batch,
            std::vector<TierCompletion>& out) {
    const auto ns = index_.namespace_id(name);
    std::vector<BlockKey> keys;
    std::vector<Hold> holds;
    for (size_t i : items) {
      const TierRequest& q = batch[i];
      auto shape = TieredStore::shape_of(q.record.format);
      Hold h;
      h.key = NsKey{ns.value_or(0), q.record.key};
      h.slot = Slot{static_cast<uint64_t>(q.buf - index_.pool().base()), q.buf_bytes};
      h.data = q.buf;
      h.meta = EntryMeta{shape.value_or(BlockShape{}), q.record.bytes, q.record.checksum};
      keys.push_back(q.record.key);
      holds.push_back(h);
    }
    std::vector<Status> st(keys.size(), Status::Ok());
    if (!ns) {
      st.assign(keys.size(), Status(ErrorCode::kNotFound, "namespace '" + name + "' is gone"));
    } else if (auto pl = r_.view()) {
      // Rank by rank over the owners other than this daemon (a block this daemon alone owns goes).
      std::map<std::string, std::vector<size_t>> by_owner;
      for (size_t i = 0; i < keys.size(); ++i)
        for (auto& o : RemoteStore::Impl::owners(*pl, keys[i], r_.opts.replicas, r_.self_id)) by_owner[o].push_back(i);
      for (auto& [peer, idx] : by_owner)
        r_.push_to(peer, *ns, name, keys, idx, Clock::now() + timeout_, false, st, 0, {}, holds);
    }
    for (size_t k = 0; k < items.size(); ++k) {
      out[items[k]].status = st[k];
      if (st[k].ok())
        written_.fetch_add(batch[items[k]].record.bytes);
      else
        failed_.fetch_add(1);
    }
  }

  RemoteStore::Impl& r_;
  BlockIndex& index_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::vector<TierRequest>> queue_;
  std::deque<TierCompletion> done_;
  bool stop_ = false;
  std::atomic<uint64_t> written_{0}, failed_{0};
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Tier> RemoteStore::write_back_tier() {
  return std::make_unique<RemoteWriteBackTier>(*impl_, impl_->index, impl_->opts.timeout);
}

RemoteStore::RemoteStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RemoteStore::~RemoteStore() {
  Impl& d = *impl_;
  if (d.membership) d.membership->stop();  // peers see this member go at once (etcd: lease revoked)
  {
    std::lock_guard g(d.sweep_mu);
    d.stopping = true;
  }
  d.sweep_cv.notify_all();
  if (d.sweeper.joinable()) d.sweeper.join();
  d.transport.reset();  // closes every endpoint; the handler is not called after this
  std::vector<Impl::Pending> left;
  {
    std::lock_guard g(d.res_mu);
    for (auto& [id, p] : d.pending) left.push_back(p);
    d.pending.clear();
  }
  for (auto& p : left) {
    if (!p.held) d.index.abort(p.r);
    d.index.release_namespace(p.ns);
  }
}

Result<std::unique_ptr<RemoteStore>> RemoteStore::create(RemoteStoreOptions opts, BlockIndex& index,
                                                         Registry& metrics) {
  auto impl = std::make_unique<Impl>(std::move(opts), index, metrics);
  Impl& d = *impl;
  if (d.opts.replicas < 1 || d.opts.replicas > 2) return Status(ErrorCode::kInvalidArgument, "replicas must be 1 or 2");
  std::string host;
  uint16_t port = 0;
  KVFERRY_TRY(split_host_port(d.opts.listen, &host, &port));
  const bool is_static = d.opts.etcd.empty();
  if (is_static && port == 0)
    return Status(ErrorCode::kInvalidArgument,
                  "with static peers the listen port must be fixed (peers name this daemon by its address)");
  d.self_id = is_static ? d.opts.listen : d.opts.id;
  const uint64_t incarnation = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  auto& m = metrics;
  d.served_lookups =
      &m.counter("kvferry_remote_served_lookups_total", "Keys peers asked this daemon for", "tier=\"remote\"");
  d.served_blocks_in = &m.counter("kvferry_remote_served_commits_total", "Blocks peers wrote into this daemon's pool",
                                  "tier=\"remote\"");
  d.torn_reads =
      &m.counter("kvferry_remote_torn_reads_total",
                 "Remote blocks that changed on their owner while read (dropped: a miss)", "tier=\"remote\"");
  d.refused =
      &m.counter("kvferry_remote_refused_requests_total", "Peer requests refused (unknown op)", "tier=\"remote\"");
  d.commit_mismatch =
      &m.counter("kvferry_remote_commit_mismatches_total",
                 "Blocks peers wrote whose bytes did not match their checksum (dropped)", "tier=\"remote\"");
  d.local_landed =
      &m.counter("kvferry_remote_local_landed_total",
                 "Blocks peers on this host copied into this daemon's regions (region to region)", "tier=\"remote\"");
  d.boot_id = host_boot_id();

  UcxTransport::Options to;
  to.incarnation = incarnation;
  to.listen = true;
  to.listen_host = host;
  to.listen_port = port;
  to.tls = d.opts.tls;
  to.secret = d.opts.secret;
  to.pool = index.pool().base();
  to.pool_bytes = index.pool().capacity();
  to.op_timeout = d.opts.timeout;
  // UCX's keepalive a quarter of the lease TTL: below it (a dead peer is noticed by UCX as well),
  // and long enough that a busy peer whose progress thread waits for a core is not declared dead.
  to.keepalive = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1000), d.opts.ttl / 4);
  to.log = d.opts.log;
  Impl* ip = impl.get();
  to.on_request = [ip](const PeerInfo& p, uint16_t op, std::span<const uint8_t> body) {
    return ip->serve(p, op, body);
  };
  // The member id must be known before the transport tells it to peers; under etcd, an empty id
  // is the advertised address, which needs the chosen port: pick it first.
  if (!is_static && d.self_id.empty() && port == 0)
    return Status(ErrorCode::kInvalidArgument, "with etcd membership set an id or a fixed listen port");
  if (d.self_id.empty()) d.self_id = d.opts.listen;
  to.name = d.self_id;
  auto t = UcxTransport::create(to);
  if (!t.ok()) return t.status().with_context("the remote tier's transport on " + d.opts.listen);
  d.transport = std::move(*t);

  MemberRecord self;
  self.id = d.self_id;
  self.incarnation = incarnation;
  std::string adv_host = host;
  if (adv_host == "0.0.0.0" || adv_host == "::") {
    char hn[256] = {};
    if (::gethostname(hn, sizeof hn - 1) == 0) adv_host = hn;
  }
  self.address = adv_host + ":" + std::to_string(d.transport->listen_port());
  self.pool_bytes = index.pool().capacity();
  self.slot_align = HostPool::kSlotAlign;
  self.formats = d.opts.formats;
  Result<std::unique_ptr<Membership>> mem = Status(ErrorCode::kInternal, "no membership");
  if (is_static) {
    std::vector<MemberRecord> others;
    for (auto& p : d.opts.peers) {
      if (p == d.self_id) continue;
      MemberRecord r;
      r.id = p;
      r.address = p;
      others.push_back(r);
    }
    mem = make_static_membership(self, std::move(others));
  } else {
    EtcdMembershipOptions eo;
    eo.endpoint = d.opts.etcd;
    eo.prefix = d.opts.prefix;
    eo.ttl = d.opts.ttl;
    eo.log = d.opts.log;
    mem = make_etcd_membership(eo, self);
  }
  if (!mem.ok()) return mem.status().with_context("cluster membership");
  d.membership = std::move(*mem);
  d.membership->set_listener([ip](const MembershipEvent& ev) { ip->on_event(ev); });
  Status st = d.membership->start();
  if (!st.ok())
    return st.with_context(is_static ? "cluster membership" : "joining the cluster in etcd at " + d.opts.etcd);
  d.apply_view();
  d.sweeper = std::thread([ip] { ip->sweep(); });
  return std::unique_ptr<RemoteStore>(new RemoteStore(std::move(impl)));
}

const std::string& RemoteStore::id() const { return impl_->self_id; }
uint16_t RemoteStore::port() const { return impl_->transport->listen_port(); }

std::vector<uint8_t> RemoteStore::lookup(const std::string& ns_name, std::span<const BlockKey> keys,
                                         Clock::time_point deadline) {
  Impl& d = *impl_;
  std::vector<uint8_t> found(keys.size(), 0);
  auto pl = d.view();
  if (!pl) return found;
  std::vector<std::vector<std::string>> own(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) own[i] = Impl::owners(*pl, keys[i], d.opts.replicas, d.self_id);
  // Rank by rank: a key its first owner does not hold (or that owner cannot answer) is asked of the next.
  for (size_t rank = 0; rank < d.opts.replicas; ++rank) {
    std::map<std::string, std::vector<size_t>> by_owner;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!found[i] && rank < own[i].size()) by_owner[own[i][rank]].push_back(i);
    for (auto& [peer, idx] : by_owner) {
      const milliseconds budget = left_until(deadline);
      if (budget.count() == 0) return found;
      auto ep = d.endpoint(peer);
      if (!ep.ok()) continue;
      wire::LookupRequest q{ns_name, {}};
      for (size_t i : idx) q.keys.push_back(keys[i]);
      auto rep = d.transport->call(*ep, static_cast<uint16_t>(wire::RemoteOp::kLookup), q.encode(), budget);
      Result<wire::LookupReply> lr =
          rep.ok() ? wire::LookupReply::decode(*rep) : Result<wire::LookupReply>(rep.status());
      if (!lr.ok() || lr->entries.size() != idx.size()) {
        if (!lr.ok()) d.failed(peer, *ep, lr.status());
        continue;
      }
      for (size_t k = 0; k < idx.size(); ++k) found[idx[k]] = lr->entries[k].found ? 1 : 0;
    }
  }
  return found;
}

std::vector<Status> RemoteStore::fetch(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                                       Clock::time_point deadline) {
  Impl& d = *impl_;
  std::vector<Status> out(keys.size(), Status(ErrorCode::kNotFound, "no daemon of the cluster holds the block"));
  auto pl = d.view();
  if (!pl) return out;
  std::vector<std::vector<std::string>> own(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) own[i] = Impl::owners(*pl, keys[i], d.opts.replicas, d.self_id);
  // Rank by rank: a key missing (or unreachable) at its first owner is asked of the next.
  for (size_t rank = 0; rank < d.opts.replicas; ++rank) {
    std::map<std::string, std::vector<size_t>> by_owner;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!out[i].ok() && out[i].code() != ErrorCode::kResourceExhausted && rank < own[i].size())
        by_owner[own[i][rank]].push_back(i);
    for (auto& [peer, idx] : by_owner) {
      std::vector<Status> got(keys.size(), Status(ErrorCode::kNotFound, "no daemon of the cluster holds the block"));
      d.fetch_from(peer, ns, ns_name, keys, idx, deadline, got);
      for (size_t i : idx)
        // A miss at a later owner does not hide an earlier owner's error (peer lost).
        if (got[i].ok() || got[i].code() != ErrorCode::kNotFound || rank == 0) out[i] = got[i];
    }
  }
  return out;
}

std::vector<Status> RemoteStore::push(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                                      Clock::time_point deadline, const std::string& to) {
  Impl& d = *impl_;
  std::vector<Status> out(keys.size(), Status::Ok());
  std::map<std::string, std::vector<size_t>> by_owner;
  if (!to.empty()) {
    if (to == d.self_id) return out;  // sent to itself: the blocks are here already
    {
      std::lock_guard g(d.mu);
      auto it = d.peers.find(to);
      if (it == d.peers.end() || !it->second.live) {
        std::string known;
        for (auto& [id, p] : d.peers)
          if (p.live) known += (known.empty() ? "" : ", ") + id;
        return std::vector<Status>(
            keys.size(), Status(ErrorCode::kNotFound,
                                "no live peer is named '" + to + "' (live: " + (known.empty() ? "none" : known) + ")"));
      }
    }
    for (size_t i = 0; i < keys.size(); ++i) by_owner[to].push_back(i);
  } else if (auto pl = d.view()) {
    for (size_t i = 0; i < keys.size(); ++i)
      for (auto& o : Impl::owners(*pl, keys[i], d.opts.replicas, d.self_id)) by_owner[o].push_back(i);
  }
  for (auto& [peer, idx] : by_owner) d.push_to(peer, ns, ns_name, keys, idx, deadline, !to.empty(), out);
  return out;
}

std::vector<Status> RemoteStore::push_into(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                                           Clock::time_point deadline, const std::string& to, uint32_t region,
                                           std::span<const int64_t> ids) {
  Impl& d = *impl_;
  if (region == 0 || ids.size() != keys.size())
    return std::vector<Status>(keys.size(), Status(ErrorCode::kInvalidArgument,
                                                   "a send into a region needs a region "
                                                   "id and one block id per key"));
  if (to == d.self_id)
    return std::vector<Status>(keys.size(), Status(ErrorCode::kInvalidArgument,
                                                   "a send into a region names this daemon itself (load instead)"));
  {
    std::lock_guard g(d.mu);
    auto it = d.peers.find(to);
    if (it == d.peers.end() || !it->second.live)
      return std::vector<Status>(keys.size(), Status(ErrorCode::kNotFound, "no live peer is named '" + to + "'"));
  }
  std::vector<Status> out(keys.size(), Status::Ok());
  std::vector<size_t> idx(keys.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  d.push_to(to, ns, ns_name, keys, idx, deadline, true, out, region, ids);
  return out;
}

Result<RemoteStore::LocalGrant> RemoteStore::local_import(const std::string& to, const std::string& ns_name,
                                                          uint32_t region, Clock::time_point deadline) {
  Impl& d = *impl_;
  if (to == d.self_id) return Status(ErrorCode::kInvalidArgument, "a send into a region names this daemon itself");
  KVFERRY_ASSIGN_OR_RETURN(PeerId ep, d.endpoint(to));
  auto rep = d.transport->call(ep, static_cast<uint16_t>(wire::RemoteOp::kLocalExport),
                               wire::LocalExportRequest{ns_name, region}.encode(),
                               std::max(left_until(deadline), milliseconds(100)));
  Result<wire::LocalExportReply> r =
      rep.ok() ? wire::LocalExportReply::decode(*rep) : Result<wire::LocalExportReply>(rep.status());
  if (!r.ok()) {
    d.failed(to, ep, r.status());
    return r.status().with_context("importing region " + std::to_string(region) + " of " + to);
  }
  if (r->boot_id != d.boot_id) return Status(ErrorCode::kUnsupported, to + " runs on another host");
  return LocalGrant{std::move(r->socket), std::move(r->token)};
}

std::vector<Status> RemoteStore::local_landed(const std::string& to, const std::string& ns_name,
                                              const std::string& token, uint32_t region, std::span<const BlockKey> keys,
                                              std::span<const int64_t> ids, Clock::time_point deadline) {
  Impl& d = *impl_;
  auto ep = d.endpoint(to);
  if (!ep.ok()) return std::vector<Status>(keys.size(), ep.status());
  wire::LocalLanded q{ns_name, token, region, {keys.begin(), keys.end()}, {ids.begin(), ids.end()}};
  auto rep = d.transport->call(*ep, static_cast<uint16_t>(wire::RemoteOp::kLocalLanded), q.encode(),
                               std::max(left_until(deadline), milliseconds(100)));
  Result<wire::CommitReply> r = rep.ok() ? wire::CommitReply::decode(*rep) : Result<wire::CommitReply>(rep.status());
  if (r.ok() && r->codes.size() != keys.size())
    r = Status(ErrorCode::kProtocol, to + " answered a landing of " + std::to_string(keys.size()) + " blocks with " +
                                         std::to_string(r->codes.size()) + " codes");
  std::vector<Status> out(keys.size(), Status::Ok());
  uint64_t errors = 0;
  if (!r.ok()) {
    d.failed(to, *ep, r.status());
    for (auto& o : out) o = r.status().with_context("telling " + to + " the blocks landed");
    errors = keys.size();
  } else {
    for (size_t i = 0; i < keys.size(); ++i)
      if (r->codes[i] != ErrorCode::kOk) {
        out[i] = Status(r->codes[i],
                        to + " refused block " + std::to_string(ids[i]) + " of its region " + std::to_string(region));
        ++errors;
      }
  }
  d.count(to, true, keys.size() - errors, 0, errors);
  return out;
}

std::vector<uint8_t> RemoteStore::wait_for(NamespaceId ns, std::span<const BlockKey> keys, Clock::time_point deadline) {
  Impl& d = *impl_;
  for (;;) {
    uint64_t seen;
    {
      std::lock_guard g(d.commit_mu);
      seen = d.commits;
    }
    auto r = d.index.lookup(ns, keys);
    if (r.prefix < keys.size()) {  // or copied into a region here by a peer on this host
      const auto name = d.index.namespace_name(ns);
      std::lock_guard g(d.commit_mu);
      auto it = name ? d.landed.find(*name) : d.landed.end();
      for (size_t i = 0; it != d.landed.end() && i < keys.size(); ++i)
        if (!r.present[i] && it->second.count(keys[i])) r.present[i] = 1;
      r.prefix = 0;
      while (r.prefix < keys.size() && r.present[r.prefix]) ++r.prefix;
    }
    if (r.prefix == keys.size() || Clock::now() >= deadline) return r.present;
    std::unique_lock lk(d.commit_mu);
    d.commit_cv.wait_until(lk, deadline, [&] { return d.commits != seen; });
  }
}

std::vector<RemotePeerView> RemoteStore::peers() const {
  Impl& d = *impl_;
  std::vector<RemotePeerView> out;
  const auto& self = d.membership->self();
  out.push_back({self.id, self.address, self.incarnation, "self", 0, 0, 0, 0, 0});
  std::lock_guard g(d.mu);
  for (auto& [id, p] : d.peers) {
    RemotePeerView v{id,
                     p.rec.address,
                     p.rec.incarnation,
                     "",
                     uint64_t(p.blocks_out->value()),
                     uint64_t(p.bytes_out->value()),
                     uint64_t(p.blocks_in->value()),
                     uint64_t(p.bytes_in->value()),
                     uint64_t(p.errors->value())};
    if (!p.live)
      v.state = "left";
    else if (p.ep)
      v.state = "connected";
    else if (!p.last_error.empty())
      v.state = "unreachable: " + p.last_error;
    else
      v.state = "live";
    out.push_back(std::move(v));
  }
  return out;
}

Status RemoteStore::health() const {
  std::lock_guard g(impl_->mu);
  if (!impl_->serving) return {ErrorCode::kUnavailable, "cluster membership lost: " + impl_->lost_reason};
  return Status::Ok();
}

#else  // built without UCX: the remote tier refuses to start

struct RemoteStore::Impl {
  std::string id;
};
RemoteStore::RemoteStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteStore::~RemoteStore() = default;
Result<std::unique_ptr<RemoteStore>> RemoteStore::create(RemoteStoreOptions, BlockIndex&, Registry&) {
  return Status(ErrorCode::kUnavailable,
                "kvferry was built without UCX (libucx-dev), so the remote tier is not available; rebuild with "
                "KVFERRY_WITH_UCX=ON or remove tiers.remote.listen");
}
const std::string& RemoteStore::id() const { return impl_->id; }
uint16_t RemoteStore::port() const { return 0; }
std::vector<uint8_t> RemoteStore::lookup(const std::string&, std::span<const BlockKey> keys, Clock::time_point) {
  return std::vector<uint8_t>(keys.size(), 0);
}
std::vector<Status> RemoteStore::fetch(NamespaceId, const std::string&, std::span<const BlockKey> keys,
                                       Clock::time_point) {
  return std::vector<Status>(keys.size(), Status(ErrorCode::kUnavailable, "built without UCX"));
}
std::vector<Status> RemoteStore::push(NamespaceId, const std::string&, std::span<const BlockKey> keys,
                                      Clock::time_point, const std::string&) {
  return std::vector<Status>(keys.size(), Status(ErrorCode::kUnavailable, "built without UCX"));
}
std::vector<Status> RemoteStore::push_into(NamespaceId, const std::string&, std::span<const BlockKey> keys,
                                           Clock::time_point, const std::string&, uint32_t, std::span<const int64_t>) {
  return std::vector<Status>(keys.size(), Status(ErrorCode::kUnavailable, "built without UCX"));
}
std::vector<uint8_t> RemoteStore::wait_for(NamespaceId, std::span<const BlockKey> keys, Clock::time_point) {
  return std::vector<uint8_t>(keys.size(), 0);
}
Result<RemoteStore::LocalGrant> RemoteStore::local_import(const std::string&, const std::string&, uint32_t,
                                                          Clock::time_point) {
  return Status(ErrorCode::kUnavailable, "built without UCX");
}
std::vector<Status> RemoteStore::local_landed(const std::string&, const std::string&, const std::string&, uint32_t,
                                              std::span<const BlockKey> keys, std::span<const int64_t>,
                                              Clock::time_point) {
  return std::vector<Status>(keys.size(), Status(ErrorCode::kUnavailable, "built without UCX"));
}
std::vector<RemotePeerView> RemoteStore::peers() const { return {}; }
Status RemoteStore::health() const { return {ErrorCode::kUnavailable, "built without UCX"}; }
std::unique_ptr<Tier> RemoteStore::write_back_tier() { return nullptr; }

#endif

}  // namespace kvferry::store
