#pragma once
// BlockIndex: key -> stored block (format, bytes, checksum, where it is, pins, last use) over the
// host pool, with LRU eviction between watermarks. A block being written is invisible until it
// is committed; a block being read (held) or pinned is never evicted. One mutex guards the
// metadata only: copies run outside it, so lookups never wait behind transfers. Thread-safe.
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#include "kvferry/store/block_key.h"
#include "kvferry/store/host_pool.h"

namespace kvferry::store {

using ClientId = uint64_t;

/// The shape of a stored block: every layer of one block of `block_size` tokens of `format`,
/// block-major (layer pages back to back), `layers * block_size * bytes_per_token` bytes.
struct BlockShape {
  int64_t layers = 0;
  int64_t block_size = 0;
  EntryFormat format;
  int64_t bytes() const { return layers * block_size * format.bytes_per_token(); }
  /// A one-block block-major spec of this shape (what copy_plan needs for a slot).
  KvCacheSpec slot_spec() const { return {layers, 1, block_size, format, Layout::kBlockMajor}; }
  bool operator==(const BlockShape& o) const {
    return layers == o.layers && block_size == o.block_size && format == o.format;
  }
};

/// What the index knows of one stored block.
struct EntryMeta {
  BlockShape shape;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

/// A slot reserved for a block being saved; commit() or abort() it exactly once.
struct SaveReservation {
  NsKey key;
  Slot slot;
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

/// A stored block held for reading (not evictable until release()).
struct Hold {
  NsKey key;
  Slot slot;
  uint8_t* data = nullptr;
  EntryMeta meta;
};

struct LookupResult {
  std::vector<uint8_t> present;  ///< 1 per key found (ready)
  uint32_t prefix = 0;           ///< number of leading keys all present
};

struct IndexStats {
  uint64_t entries = 0;
  uint64_t writing = 0;
  uint64_t pinned = 0;
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t evictions = 0;
  uint64_t evicted_bytes = 0;
  uint64_t on_lower = 0;     ///< ready blocks that also have a copy on the lower tier
  uint64_t dirty_bytes = 0;  ///< slot bytes of ready blocks eviction would lose (no lower copy)
};

/// Blocks pinned by the clients of one account (a tenant) count against its limit.
struct PinAccount {
  uint64_t id = 0;           ///< 0 = no account: no limit
  uint64_t limit_bytes = 0;  ///< 0 = no limit
};

/// What a filter over namespaces sees: the id, the full name and the tenant it belongs to.
using NamespaceFilter = std::function<bool(NamespaceId, const std::string& name, const std::string& tenant)>;

struct ListEntry {
  std::string ns;
  BlockKey key;
  std::string format;
  uint64_t bytes = 0;
  uint32_t pins = 0;
  std::string tier;  ///< "host", or "host+disk" when the lower tier holds a copy too
};

class BlockIndex {
 public:
  struct Options {
    double high_watermark = 0.95;   ///< evict when the pool is fuller than this fraction
    double low_watermark = 0.85;    ///< ... down to this fraction
    size_t max_namespaces = 65536;  ///< live namespaces at most (leased or holding blocks)
    /// A lower tier sits below the pool (write-back): making room evicts only blocks that have a
    /// copy there (or whose demotion failed); the caller demotes the others first (take_dirty).
    bool write_back = false;
    std::string lower_name = "disk";  ///< the lower tier's name, for ListEntry::tier
  };

  BlockIndex(HostPool& pool, Options opts);

  /// Replaces the watermarks (a reload); when the pool is now above the high one, evicts LRU
  /// blocks down to the low one at once. Returns how many blocks went. kInvalidArgument (and no
  /// change) unless 0 <= low < high <= 1.
  Result<uint64_t> set_watermarks(double high, double low);
  Options watermarks() const;

  /// Id of namespace `name` (model + format fingerprint + tenant), created on first use and
  /// never released (tools and tests; the daemon leases instead).
  NamespaceId intern_namespace(const std::string& name);
  /// Leases namespace `name` of `tenant`: its id stays valid until release_namespace(). A
  /// namespace that no lease holds and that stores no block is forgotten and its id reused, so the
  /// table stays bounded however many names clients make up. kResourceExhausted past
  /// Options::max_namespaces.
  Result<NamespaceId> acquire_namespace(const std::string& name, const std::string& tenant);
  void release_namespace(NamespaceId id);
  /// Live namespaces (leased or holding blocks).
  size_t namespaces() const;

  /// Reserves a slot for a new block. kAlreadyExists when the key is stored or being written
  /// (the caller treats that as done); kResourceExhausted when nothing can be evicted.
  Result<SaveReservation> reserve(const NsKey& key, const BlockShape& shape);
  /// Makes a written block visible with its checksum; `on_lower`: the lower tier holds it too
  /// (a promoted block), so eviction may drop it.
  void commit(const SaveReservation& r, uint64_t checksum, bool on_lower = false);
  /// Drops a reservation (failed copy, client gone): the slot is freed, nothing becomes visible.
  void abort(const SaveReservation& r);

  /// Holds a stored block for reading; kNotFound on a miss.
  Result<Hold> acquire(const NsKey& key);
  void release(const Hold& h);

  /// Write-back: holds the least recently used ready, unpinned, idle blocks that have no copy on
  /// the lower tier, about `bytes` of slots of them (at least one when any), so the caller can
  /// write them down; end_demote() each exactly once.
  std::vector<Hold> take_dirty(uint64_t bytes);
  /// Ends a demotion: `stored` = the lower tier holds the block now. Either way the block may be
  /// evicted from now on (a failed demotion must not wedge the pool; the loss is the caller's to count).
  void end_demote(const Hold& h, bool stored);
  /// Records whether the lower tier holds a copy of a stored block (write-through, or the lower
  /// tier dropped it). Returns false when the block is not stored.
  bool set_on_lower(const NsKey& key, bool on_lower);
  /// Slot bytes of dirty blocks to demote so that `bytes` more fit below the low watermark
  /// without evicting a dirty block (0 when they fit already).
  uint64_t demotion_needed(uint64_t bytes) const;
  /// The name of a live namespace (nullopt when the id is not live).
  std::optional<std::string> namespace_name(NamespaceId id) const;
  /// The id of a live namespace by name (nullopt when none is live).
  std::optional<NamespaceId> namespace_id(const std::string& name) const;

  /// Per-key presence and the longest prefix of hits, in key order.
  LookupResult lookup(NamespaceId ns, std::span<const BlockKey> keys);

  /// Pins a stored block for `client` (never evicted while pinned); pins count per client. A
  /// block's bytes count against `account` from the client's first pin of it to its last unpin;
  /// kResourceExhausted (nothing pinned) when that would pass the account's limit.
  Status pin(const NsKey& key, ClientId client, const PinAccount& account = {});
  Status unpin(const NsKey& key, ClientId client);
  /// Drops every pin `client` holds (it disconnected).
  void release_client(ClientId client);

  /// Evicts the given keys (pinned or held ones stay: reported in the result count as kept).
  /// Returns how many were evicted.
  uint64_t evict(NamespaceId ns, std::span<const BlockKey> keys);
  /// Evicts every unpinned, unheld block (of `ns` when given). Returns how many.
  uint64_t evict_all(std::optional<NamespaceId> ns);
  /// Evicts every unpinned, unheld block of the namespaces `filter` accepts. Returns how many.
  uint64_t evict_all(const NamespaceFilter& filter);

  /// Kept up to date by every change: O(1), so /metrics never walks the index.
  IndexStats stats() const;
  HostPool& pool() const { return pool_; }
  /// Up to `limit` entries (of `ns` when given), most recently used first.
  std::vector<ListEntry> list(std::optional<NamespaceId> ns, size_t limit) const;
  /// Up to `limit` entries of the namespaces `filter` accepts.
  std::vector<ListEntry> list(const NamespaceFilter& filter, size_t limit) const;
  /// Bytes pinned against `account` now.
  uint64_t pinned_bytes(uint64_t account) const;

  /// Fault knob for tests: flips the bits of byte `byte` of a stored block.
  Status corrupt_for_test(const NsKey& key, uint64_t byte);

 private:
  enum class State : uint8_t { kWriting, kReady };
  struct Entry {
    State state = State::kWriting;
    EntryMeta meta;
    Slot slot;
    uint32_t readers = 0;
    uint32_t pins = 0;
    bool on_lower = false;           ///< the lower tier holds a copy
    bool droppable = false;          ///< its demotion failed: evict it anyway
    bool demoting = false;           ///< take_dirty() holds it
    std::list<NsKey>::iterator lru;  ///< valid while ready
  };

  struct NsRecord {
    std::string name, tenant;
    uint64_t leases = 0;   ///< acquire_namespace() not yet released (intern: one forever)
    uint64_t entries = 0;  ///< blocks of this namespace in the map (writing or ready)
    bool live = false;
  };
  struct ClientPins {
    std::unordered_map<NsKey, uint32_t, NsKeyHash> keys;
    PinAccount account;
  };

  bool evictable(const Entry& e) const { return e.state == State::kReady && e.readers == 0 && e.pins == 0; }
  bool clean(const Entry& e) const { return !opts_.write_back || e.on_lower || e.droppable; }
  /// make_room's test: evictable, and (write-back) nothing is lost by dropping it.
  bool room_evictable(const Entry& e) const { return evictable(e) && clean(e); }
  /// Keeps dirty_bytes_ in step around a change of `e`'s flags or state.
  void account_dirty_locked(const Entry& e, int64_t sign);
  Result<NamespaceId> acquire_namespace_locked(const std::string& name, const std::string& tenant);
  void maybe_forget_namespace_locked(NamespaceId id);
  void add_pins_locked(Entry& e, int64_t delta);
  /// Drops one client's pin count of a key (all of them with `all`), with its account's bytes.
  void unpin_locked(ClientPins& c, std::unordered_map<NsKey, uint32_t, NsKeyHash>::iterator p, bool all);
  uint64_t evict_if_locked(const std::function<bool(const NsKey&)>& pred);
  /// Evicts LRU blocks until a slot of `bytes` fits and usage is at most the low watermark (when
  /// above the high one). Caller holds mu_. Returns false when nothing more can go.
  bool make_room_locked(uint64_t bytes);
  void erase_locked(std::unordered_map<NsKey, Entry, NsKeyHash>::iterator it);

  HostPool& pool_;
  Options opts_;
  mutable std::mutex mu_;
  std::unordered_map<NsKey, Entry, NsKeyHash> map_;
  std::list<NsKey> lru_;                                 ///< front = most recently used (ready entries only)
  std::unordered_map<std::string, NamespaceId> ns_ids_;  ///< live namespaces only
  std::vector<NsRecord> ns_;                             ///< by id
  std::vector<NamespaceId> free_ns_;                     ///< ids of forgotten namespaces
  size_t live_ns_ = 0;
  std::unordered_map<ClientId, ClientPins> client_pins_;
  std::unordered_map<uint64_t, uint64_t> account_bytes_;  ///< pinned bytes per account (non-zero only)
  uint64_t evictions_ = 0;
  uint64_t evicted_bytes_ = 0;
  uint64_t ready_ = 0, writing_ = 0, pinned_ = 0;  ///< IndexStats, kept up to date
  uint64_t on_lower_ = 0, dirty_bytes_ = 0;        ///< over ready entries
  uint64_t writing_bytes_ = 0;                     ///< slot bytes reserved, not yet committed
};

}  // namespace kvferry::store
