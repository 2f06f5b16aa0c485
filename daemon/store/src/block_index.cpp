#include "kvferry/store/block_index.h"

#include <algorithm>
#include <utility>

namespace kvferry::store {

BlockIndex::BlockIndex(HostPool& pool, Options opts) : pool_(pool), opts_(std::move(opts)) {}

Result<uint64_t> BlockIndex::set_watermarks(double high, double low) {
  if (!(low >= 0.0 && low < high && high <= 1.0))
    return Result<uint64_t>(ErrorCode::kInvalidArgument, "watermarks need 0 <= low < high <= 1, got low " +
                                                             std::to_string(low) + " and high " + std::to_string(high));
  std::lock_guard lk(mu_);
  opts_.high_watermark = high;
  opts_.low_watermark = low;
  const double cap = static_cast<double>(pool_.capacity());
  uint64_t n = 0;
  if (static_cast<double>(pool_.used_bytes()) <= high * cap) return n;
  for (auto it = lru_.end(); it != lru_.begin() && static_cast<double>(pool_.used_bytes()) > low * cap;) {
    --it;
    auto e = map_.find(*it);
    if (e == map_.end() || !room_evictable(e->second)) continue;
    auto after = std::next(it);  // erase invalidates it
    evicted_bytes_ += e->second.slot.bytes;
    erase_locked(e);
    ++evictions_;
    ++n;
    it = after;
  }
  return n;
}

BlockIndex::Options BlockIndex::watermarks() const {
  std::lock_guard lk(mu_);
  return opts_;
}

Result<NamespaceId> BlockIndex::acquire_namespace_locked(const std::string& name, const std::string& tenant) {
  if (auto it = ns_ids_.find(name); it != ns_ids_.end()) {
    ++ns_[it->second].leases;
    return it->second;
  }
  if (live_ns_ >= opts_.max_namespaces)
    return Result<NamespaceId>(ErrorCode::kResourceExhausted,
                               "the index holds its limit of " + std::to_string(opts_.max_namespaces) +
                                   " namespaces; namespace '" + name + "' was not created");
  NamespaceId id;
  if (!free_ns_.empty()) {
    id = free_ns_.back();
    free_ns_.pop_back();
  } else {
    id = static_cast<NamespaceId>(ns_.size());
    ns_.emplace_back();
  }
  ns_[id] = NsRecord{name, tenant, 1, 0, true};
  ns_ids_.emplace(name, id);
  ++live_ns_;
  return id;
}

void BlockIndex::maybe_forget_namespace_locked(NamespaceId id) {
  if (id >= ns_.size()) return;
  NsRecord& r = ns_[id];
  if (!r.live || r.leases || r.entries) return;
  ns_ids_.erase(r.name);
  r = NsRecord{};
  free_ns_.push_back(id);
  --live_ns_;
}

NamespaceId BlockIndex::intern_namespace(const std::string& name) {
  std::lock_guard lk(mu_);
  if (auto it = ns_ids_.find(name); it != ns_ids_.end()) return it->second;
  auto id = acquire_namespace_locked(name, "");
  return id.ok() ? *id : NamespaceId(~0u);  // past the limit: an id no block can have
}

Result<NamespaceId> BlockIndex::acquire_namespace(const std::string& name, const std::string& tenant) {
  std::lock_guard lk(mu_);
  return acquire_namespace_locked(name, tenant);
}

void BlockIndex::release_namespace(NamespaceId id) {
  std::lock_guard lk(mu_);
  if (id >= ns_.size() || !ns_[id].live || ns_[id].leases == 0) return;
  --ns_[id].leases;
  maybe_forget_namespace_locked(id);
}

size_t BlockIndex::namespaces() const {
  std::lock_guard lk(mu_);
  return live_ns_;
}

void BlockIndex::add_pins_locked(Entry& e, int64_t delta) {
  const bool was = e.pins > 0;
  e.pins = static_cast<uint32_t>(static_cast<int64_t>(e.pins) + delta);
  if (was != (e.pins > 0)) was ? --pinned_ : ++pinned_;
}

void BlockIndex::account_dirty_locked(const Entry& e, int64_t sign) {
  if (e.state != State::kReady) return;
  if (e.on_lower) on_lower_ = static_cast<uint64_t>(static_cast<int64_t>(on_lower_) + sign);
  if (!e.on_lower && !e.droppable)
    dirty_bytes_ =
        static_cast<uint64_t>(static_cast<int64_t>(dirty_bytes_) + sign * static_cast<int64_t>(e.slot.bytes));
}

void BlockIndex::erase_locked(std::unordered_map<NsKey, Entry, NsKeyHash>::iterator it) {
  account_dirty_locked(it->second, -1);
  if (it->second.state == State::kReady) {
    lru_.erase(it->second.lru);
    --ready_;
  } else {
    --writing_;
    writing_bytes_ -= std::min(writing_bytes_, it->second.slot.bytes);
  }
  if (it->second.pins) --pinned_;
  pool_.release(it->second.slot);
  const NamespaceId ns = it->first.ns;
  map_.erase(it);
  if (ns < ns_.size() && ns_[ns].entries) {
    --ns_[ns].entries;
    maybe_forget_namespace_locked(ns);
  }
}

bool BlockIndex::make_room_locked(uint64_t bytes) {
  const double cap = static_cast<double>(pool_.capacity());
  auto over_high = [&] { return static_cast<double>(pool_.used_bytes() + bytes) > opts_.high_watermark * cap; };
  auto over_low = [&] { return static_cast<double>(pool_.used_bytes() + bytes) > opts_.low_watermark * cap; };
  const bool evict_to_low = over_high();
  // Walk from the least recently used end; pinned and held blocks are skipped, never evicted.
  auto it = lru_.end();
  while ((evict_to_low ? over_low() : false) || !pool_.can_allocate(bytes)) {
    if (it == lru_.begin()) return pool_.can_allocate(bytes);
    --it;
    auto e = map_.find(*it);
    if (e == map_.end() || !room_evictable(e->second)) continue;
    const uint64_t b = e->second.slot.bytes;
    auto prev = it;
    ++prev;  // erase invalidates it; continue from the element after (already visited side)
    erase_locked(e);
    ++evictions_;
    evicted_bytes_ += b;
    it = prev;
  }
  return true;
}

Result<SaveReservation> BlockIndex::reserve(const NsKey& key, const BlockShape& shape) {
  const uint64_t bytes = static_cast<uint64_t>(shape.bytes());
  std::lock_guard lk(mu_);
  if (auto it = map_.find(key); it != map_.end()) {
    if (it->second.state == State::kReady) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return Result<SaveReservation>(ErrorCode::kAlreadyExists, "block " + key.key.hex() + " is already stored");
    }
    return Result<SaveReservation>(ErrorCode::kAlreadyExists, "block " + key.key.hex() + " is being saved");
  }
  if (!make_room_locked(bytes))
    return Result<SaveReservation>(ErrorCode::kResourceExhausted, "host pool is full of pinned or in-use blocks (" +
                                                                      std::to_string(pool_.used_bytes()) + " of " +
                                                                      std::to_string(pool_.capacity()) + " bytes)");
  auto slot = pool_.allocate(bytes);
  if (!slot.ok()) return slot.status();
  Entry e;
  e.state = State::kWriting;
  e.meta.shape = shape;
  e.meta.bytes = bytes;
  e.slot = *slot;
  map_.emplace(key, e);
  ++writing_;
  writing_bytes_ += slot->bytes;
  if (key.ns < ns_.size()) ++ns_[key.ns].entries;
  return SaveReservation{key, *slot, pool_.data(*slot), bytes};
}

void BlockIndex::commit(const SaveReservation& r, uint64_t checksum, bool on_lower) {
  std::lock_guard lk(mu_);
  auto it = map_.find(r.key);
  if (it == map_.end() || it->second.state != State::kWriting || it->second.slot.offset != r.slot.offset) return;
  it->second.meta.checksum = checksum;
  it->second.state = State::kReady;
  it->second.on_lower = on_lower;
  --writing_;
  writing_bytes_ -= std::min(writing_bytes_, it->second.slot.bytes);
  ++ready_;
  account_dirty_locked(it->second, 1);
  lru_.push_front(r.key);
  it->second.lru = lru_.begin();
}

void BlockIndex::abort(const SaveReservation& r) {
  std::lock_guard lk(mu_);
  auto it = map_.find(r.key);
  if (it == map_.end() || it->second.state != State::kWriting || it->second.slot.offset != r.slot.offset) return;
  erase_locked(it);
}

Result<Hold> BlockIndex::acquire(const NsKey& key) {
  std::lock_guard lk(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.state != State::kReady)
    return Result<Hold>(ErrorCode::kNotFound, "block " + key.key.hex() + " is not stored");
  ++it->second.readers;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return Hold{key, it->second.slot, pool_.data(it->second.slot), it->second.meta};
}

void BlockIndex::release(const Hold& h) {
  std::lock_guard lk(mu_);
  auto it = map_.find(h.key);
  if (it != map_.end() && it->second.readers > 0) --it->second.readers;
}

std::vector<Hold> BlockIndex::take_dirty(uint64_t bytes) {
  std::lock_guard lk(mu_);
  std::vector<Hold> out;
  uint64_t got = 0;
  for (auto it = lru_.rbegin(); it != lru_.rend() && (got < bytes || out.empty()); ++it) {
    auto e = map_.find(*it);
    if (e == map_.end()) continue;
    Entry& en = e->second;
    if (!evictable(en) || en.on_lower || en.droppable || en.demoting) continue;
    en.demoting = true;
    ++en.readers;
    got += en.slot.bytes;
    out.push_back(Hold{e->first, en.slot, pool_.data(en.slot), en.meta});
  }
  return out;
}

void BlockIndex::end_demote(const Hold& h, bool stored) {
  std::lock_guard lk(mu_);
  auto it = map_.find(h.key);
  if (it == map_.end() || !it->second.demoting) return;
  Entry& e = it->second;
  account_dirty_locked(e, -1);
  e.demoting = false;
  if (e.readers > 0) --e.readers;
  (stored ? e.on_lower : e.droppable) = true;
  account_dirty_locked(e, 1);
}

bool BlockIndex::set_on_lower(const NsKey& key, bool on_lower) {
  std::lock_guard lk(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.state != State::kReady) return false;
  account_dirty_locked(it->second, -1);
  it->second.on_lower = on_lower;
  if (on_lower) it->second.droppable = false;
  account_dirty_locked(it->second, 1);
  return true;
}

uint64_t BlockIndex::demotion_needed(uint64_t bytes) const {
  std::lock_guard lk(mu_);
  if (!opts_.write_back) return 0;
  const double low = opts_.low_watermark * static_cast<double>(pool_.capacity());
  const double want = static_cast<double>(dirty_bytes_ + writing_bytes_ + bytes);
  return want > low ? static_cast<uint64_t>(want - low) : 0;
}

std::optional<std::string> BlockIndex::namespace_name(NamespaceId id) const {
  std::lock_guard lk(mu_);
  if (id >= ns_.size() || !ns_[id].live) return std::nullopt;
  return ns_[id].name;
}

std::optional<NamespaceId> BlockIndex::namespace_id(const std::string& name) const {
  std::lock_guard lk(mu_);
  auto it = ns_ids_.find(name);
  if (it == ns_ids_.end()) return std::nullopt;
  return it->second;
}

LookupResult BlockIndex::lookup(NamespaceId ns, std::span<const BlockKey> keys) {
  LookupResult r;
  r.present.resize(keys.size());
  bool prefix = true;
  std::lock_guard lk(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = map_.find(NsKey{ns, keys[i]});
    const bool hit = it != map_.end() && it->second.state == State::kReady;
    r.present[i] = hit ? 1 : 0;
    if (hit) lru_.splice(lru_.begin(), lru_, it->second.lru);
    if (prefix && hit)
      ++r.prefix;
    else
      prefix = false;
  }
  return r;
}

Status BlockIndex::pin(const NsKey& key, ClientId client, const PinAccount& account) {
  std::lock_guard lk(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.state != State::kReady)
    return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not stored"};
  ClientPins& c = client_pins_[client];
  if (c.keys.empty()) c.account = account;  // a client's account is the one of its first pin
  auto [p, first] = c.keys.try_emplace(key, 0);
  if (first && c.account.id) {
    uint64_t& used = account_bytes_[c.account.id];
    const uint64_t b = it->second.slot.bytes;
    if (c.account.limit_bytes && used + b > c.account.limit_bytes) {
      // The message first: the erases below may free `c` and `used`.
      Status refused(ErrorCode::kResourceExhausted, "pinning block " + key.key.hex() + " (" + std::to_string(b) +
                                                        " bytes) would pass the pinned-bytes quota of " +
                                                        std::to_string(c.account.limit_bytes) + " (" +
                                                        std::to_string(used) + " pinned)");
      c.keys.erase(p);
      if (used == 0) account_bytes_.erase(c.account.id);
      if (c.keys.empty()) client_pins_.erase(client);
      return refused;
    }
    used += b;
  }
  ++p->second;
  add_pins_locked(it->second, 1);
  return Status::Ok();
}

void BlockIndex::unpin_locked(ClientPins& c, std::unordered_map<NsKey, uint32_t, NsKeyHash>::iterator p, bool all) {
  const uint32_t n = all ? p->second : 1;
  auto it = map_.find(p->first);
  if (it != map_.end()) add_pins_locked(it->second, -static_cast<int64_t>(std::min(it->second.pins, n)));
  p->second -= n;
  if (p->second) return;
  if (c.account.id && it != map_.end()) {
    auto a = account_bytes_.find(c.account.id);
    if (a != account_bytes_.end()) {
      a->second -= std::min(a->second, it->second.slot.bytes);
      if (a->second == 0) account_bytes_.erase(a);
    }
  }
  c.keys.erase(p);
}

Status BlockIndex::unpin(const NsKey& key, ClientId client) {
  std::lock_guard lk(mu_);
  auto c = client_pins_.find(client);
  auto p = c == client_pins_.end() ? decltype(c->second.keys.begin()){} : c->second.keys.find(key);
  if (c == client_pins_.end() || p == c->second.keys.end())
    return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not pinned by this client"};
  unpin_locked(c->second, p, false);
  if (c->second.keys.empty()) client_pins_.erase(c);
  return Status::Ok();
}

void BlockIndex::release_client(ClientId client) {
  std::lock_guard lk(mu_);
  auto c = client_pins_.find(client);
  if (c == client_pins_.end()) return;
  while (!c->second.keys.empty()) unpin_locked(c->second, c->second.keys.begin(), true);
  client_pins_.erase(c);
}

uint64_t BlockIndex::pinned_bytes(uint64_t account) const {
  std::lock_guard lk(mu_);
  auto a = account_bytes_.find(account);
  return a == account_bytes_.end() ? 0 : a->second;
}

uint64_t BlockIndex::evict(NamespaceId ns, std::span<const BlockKey> keys) {
  std::lock_guard lk(mu_);
  uint64_t n = 0;
  for (const BlockKey& k : keys) {
    auto it = map_.find(NsKey{ns, k});
    if (it == map_.end() || !evictable(it->second)) continue;
    evicted_bytes_ += it->second.slot.bytes;
    erase_locked(it);
    ++evictions_;
    ++n;
  }
  return n;
}

uint64_t BlockIndex::evict_all(std::optional<NamespaceId> ns) {
  std::lock_guard lk(mu_);
  return evict_if_locked([&](const NsKey& k) { return !ns || k.ns == *ns; });
}

uint64_t BlockIndex::evict_all(const NamespaceFilter& filter) {
  std::lock_guard lk(mu_);
  return evict_if_locked([&](const NsKey& k) {
    return k.ns < ns_.size() && ns_[k.ns].live && filter(k.ns, ns_[k.ns].name, ns_[k.ns].tenant);
  });
}

uint64_t BlockIndex::evict_if_locked(const std::function<bool(const NsKey&)>& pred) {
  uint64_t n = 0;
  for (auto it = map_.begin(); it != map_.end();) {
    auto next = std::next(it);
    if (evictable(it->second) && pred(it->first)) {
      evicted_bytes_ += it->second.slot.bytes;
      erase_locked(it);
      ++evictions_;
      ++n;
    }
    it = next;
  }
  return n;
}

IndexStats BlockIndex::stats() const {
  std::lock_guard lk(mu_);
  IndexStats s;
  s.entries = ready_;
  s.writing = writing_;
  s.pinned = pinned_;
  s.used_bytes = pool_.used_bytes();
  s.capacity_bytes = pool_.capacity();
  s.evictions = evictions_;
  s.evicted_bytes = evicted_bytes_;
  s.on_lower = on_lower_;
  s.dirty_bytes = dirty_bytes_;
  return s;
}

std::vector<ListEntry> BlockIndex::list(std::optional<NamespaceId> ns, size_t limit) const {
  return list([&](NamespaceId id, const std::string&, const std::string&) { return !ns || id == *ns; }, limit);
}

std::vector<ListEntry> BlockIndex::list(const NamespaceFilter& filter, size_t limit) const {
  std::lock_guard lk(mu_);
  std::vector<ListEntry> out;
  for (const NsKey& k : lru_) {
    if (out.size() >= limit) break;
    const bool known = k.ns < ns_.size() && ns_[k.ns].live;
    if (!known || !filter(k.ns, ns_[k.ns].name, ns_[k.ns].tenant)) continue;
    const Entry& e = map_.at(k);
    out.push_back({ns_[k.ns].name, k.key, e.meta.shape.format.name(), e.meta.bytes, e.pins,
                   e.on_lower ? "host+" + opts_.lower_name : std::string("host")});
  }
  return out;
}

Status BlockIndex::corrupt_for_test(const NsKey& key, uint64_t byte) {
  std::lock_guard lk(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.state != State::kReady)
    return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not stored"};
  if (byte >= it->second.meta.bytes)
    return {ErrorCode::kOutOfRange, "byte " + std::to_string(byte) + " is past the block's " +
                                        std::to_string(it->second.meta.bytes) + " bytes"};
  pool_.data(it->second.slot)[byte] ^= 0xFF;
  return Status::Ok();
}

}  // namespace kvferry::store
