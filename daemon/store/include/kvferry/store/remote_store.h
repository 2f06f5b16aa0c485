#pragma once
// RemoteStore: the remote tier (G4, DESIGN.md §4): the daemons of a cluster as one cache. It joins
// the cluster (etcd membership, or a static peer list), places every block on its owner(s) by
// rendezvous hashing over the live members, and moves whole blocks between this daemon's host pool
// and the owners' pools over UcxTransport (one-sided gets and puts of pool byte runs; lookup,
// reserve and commit as control calls, batched per peer).
//
// - push: stored host blocks are written to their owners (or to one named peer: a prefill node's
//   send to its decode node): the owner reserves slots, the bytes are put into them, and the
//   owner checks each block's XXH3 before it indexes it. A block is visible on the owner only once
//   its bytes are complete and verified.
// - fetch: host misses are looked up at their owners, got into local host slots, checked against
//   the owner's XXH3, and only then committed to the local index; a block the owner dropped or
//   reused while it was read fails its check and is a miss, never wrong bytes.
// - lookup: which keys the owners hold (for a client's lookup).
// The owner side is served on the transport's progress thread: lookups and reservations touch the
// index's metadata only; a commit hashes its blocks there.
//
// Namespaces hold across the network exactly as locally: a block is named by its namespace *name*
// (model|format family|tenant), so a tenant's client on any daemon finds its tenant's blocks only.
// Every call has a deadline. A peer that dies or cannot be reached gives its blocks kUnavailable
// ("peer lost: ..."); a membership change, a new incarnation or a failed transfer drops the cached
// endpoint. Without a secret the tier listens on loopback only. Thread-safe.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/layouts/status.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/block_key.h"
#include "kvferry/store/metrics.h"
#include "kvferry/store/tier.h"

namespace kvferry::store {

struct RemoteStoreOptions {
  std::string id;                      ///< member id ("" = the listen address); unique in the cluster
  std::string listen = "127.0.0.1:0";  ///< host:port of the transport's listener
  std::string tls = "tcp";             ///< UCX_TLS
  std::string secret;                  ///< shared key ("" = none: loopback only)
  std::string etcd;                    ///< etcd endpoint http://host:port ("" = static membership)
  std::string prefix = "/kvferry/members/";
  std::chrono::seconds ttl{10};                   ///< etcd lease TTL
  std::vector<std::string> peers;                 ///< static membership: host:port of the others (ids = addresses)
  size_t replicas = 1;                            ///< owners per block (1 or 2)
  std::chrono::milliseconds timeout{5000};        ///< deadline of one push or fetch batch
  std::chrono::milliseconds lookup_timeout{500};  ///< deadline of a remote lookup
  std::vector<std::string> formats;               ///< told to peers (member record)
  /// A peer's send into one of this daemon's regions: loads the committed blocks of namespace
  /// `ns` into blocks `ids` of region `region` (the namespace's tenant must reach it) and returns
  /// one status per block. Called on the transport's progress thread; it blocks until done.
  /// Empty: such sends fail with kUnsupported.
  std::function<std::vector<Status>(NamespaceId ns, const std::string& tenant, uint32_t region,
                                    std::span<const BlockKey> keys, std::span<const int64_t> ids)>
      on_land;
  /// Region-to-region sends from peers on this host (tiers.remote.local_transfer), this daemon's
  /// side. grant_import: a one-time token with which a peer's import session on `socket` maps
  /// region `region` of `tenant` (kNotFound when that tenant has no such region). Empty: such
  /// imports are refused (kUnsupported), and senders go through the host pools.
  std::function<Result<std::string>(const std::string& tenant, uint32_t region)> grant_import;
  std::string socket;  ///< this daemon's control socket (where an importing peer connects)
  /// A peer copied blocks into blocks `ids` of region `region` of `tenant` through the import
  /// that `token` granted: one status per id (the import is still that region's, each id exists).
  /// Called on the transport's progress thread; must not block.
  std::function<std::vector<Status>(const std::string& token, const std::string& tenant, uint32_t region,
                                    std::span<const int64_t> ids)>
      on_local_landed;
  std::function<void(const std::string&)> log;   ///< warnings; stderr when empty
  std::function<void(const std::string&)> info;  ///< notable events (joins, leaves); dropped when empty
};

/// One member as `kvferry peers` shows it.
struct RemotePeerView {
  std::string id;
  std::string address;
  uint64_t incarnation = 0;
  std::string state;                       ///< "self", "live", "connected", "unreachable: ...", "left"
  uint64_t blocks_out = 0, bytes_out = 0;  ///< pushed to it
  uint64_t blocks_in = 0, bytes_in = 0;    ///< fetched from it
  uint64_t errors = 0;                     ///< blocks that failed on its account
  bool is_self() const { return state == "self"; }
  /// Lost as /healthz, the metrics and `kvferry stats` count it: it left the cluster or cannot be reached.
  bool lost() const { return state == "left" || state.rfind("unreachable", 0) == 0; }
};

class RemoteStore {
 public:
  using Clock = std::chrono::steady_clock;

  /// Starts the transport (the pool registered once), joins the cluster and starts serving.
  /// Errors name what failed (the listen address, etcd, the secret).
  static Result<std::unique_ptr<RemoteStore>> create(RemoteStoreOptions opts, BlockIndex& index, Registry& metrics);
  /// Leaves the cluster (etcd: revokes the lease), closes every endpoint, drops open reservations.
  ~RemoteStore();
  RemoteStore(const RemoteStore&) = delete;
  RemoteStore& operator=(const RemoteStore&) = delete;

  const std::string& id() const;
  /// The transport's listen port (the chosen one when the config said 0).
  uint16_t port() const;

  /// Per key: 1 when a remote owner holds it. Keys this daemon owns are not asked (0); a peer that
  /// does not answer by the deadline counts as a miss.
  std::vector<uint8_t> lookup(const std::string& ns_name, std::span<const BlockKey> keys, Clock::time_point deadline);

  /// Fetches blocks of namespace `ns` (this index's id of `ns_name`) from their owners into the
  /// host pool. Per key: kOk (now stored here, verified), kNotFound (no owner holds it, or its copy
  /// changed while read), kUnavailable (peer lost or unreachable), kTimeout, kResourceExhausted (no
  /// host slot).
  std::vector<Status> fetch(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                            Clock::time_point deadline);

  /// Writes stored host blocks of `ns` to their owners (to member `to` only when given, owner or
  /// not). Per key: kOk (the target holds it, verified, or already held it; or this daemon is its
  /// only owner), kNotFound (not stored here), kUnavailable / kTimeout (the peer), kResourceExhausted
  /// (no room there), kNotFound for `to` unknown is reported for every key.
  std::vector<Status> push(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                           Clock::time_point deadline, const std::string& to = "");
  /// A send to member `to` whose blocks land in its region `region` at blocks `ids` (one per key):
  /// per key kOk once stored there and loaded into the region, else the error.
  std::vector<Status> push_into(NamespaceId ns, const std::string& ns_name, std::span<const BlockKey> keys,
                                Clock::time_point deadline, const std::string& to, uint32_t region,
                                std::span<const int64_t> ids);

  /// How to import member `to`'s region `region` for region-to-region sends (the namespace's tenant
  /// must reach it): its control socket and a one-time token. kUnsupported when `to` runs on
  /// another host (its boot id differs) or does not export regions; kUnavailable when it is lost.
  struct LocalGrant {
    std::string socket;
    std::string token;
  };
  Result<LocalGrant> local_import(const std::string& to, const std::string& ns_name, uint32_t region,
                                  Clock::time_point deadline);
  /// Tells member `to` that blocks `keys` of `ns_name` were copied into blocks `ids` of its region
  /// `region`: per key kOk once it has checked the blocks and woken its waiters, else the error.
  std::vector<Status> local_landed(const std::string& to, const std::string& ns_name, const std::string& token,
                                   uint32_t region, std::span<const BlockKey> keys, std::span<const int64_t> ids,
                                   Clock::time_point deadline);

  /// Waits until every key of `ns_name` in `keys` is stored here (a send from a peer landed) or the
  /// deadline passes; per key 1 when present. Wakes on every commit from a peer (no polling).
  /// A key a peer on this host copied into one of this daemon's regions (local_landed) counts as
  /// present too, though it is not stored: it is in the region it was sent to.
  std::vector<uint8_t> wait_for(NamespaceId ns, std::span<const BlockKey> keys, Clock::time_point deadline);

  /// The host pool's write-back tier for `tiers.remote.write: on_evict`: the store's demotions of
  /// least recently used blocks (before their slots are reused) become pushes to their owners; a
  /// block only this daemon owns is simply evicted. It holds nothing itself: reads and lookups go
  /// through fetch() and lookup(). Outlives no RemoteStore.
  std::unique_ptr<Tier> write_back_tier();

  /// Every member of the current view (self first) and peers seen before that left.
  std::vector<RemotePeerView> peers() const;
  /// Ok while the tier serves; kUnavailable with the reason (membership lost) otherwise.
  Status health() const;

  struct Impl;

 private:
  explicit RemoteStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::store
