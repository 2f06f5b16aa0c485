#include "kvferry/store/block_index.h"

#include <algorithm>

namespace kvferry::store {

BlockIndex::BlockIndex(HostPool& pool, Options opts) : pool_(pool), opts_(opts) {}

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
    if (e == map_.end() || !evictable(e->second)) continue;
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

NamespaceId BlockIndex::intern_namespace(const std::string& name) {
  std::lock_guard lk(mu_);
  auto [it, fresh] = ns_ids_.try_emplace(name, static_cast<NamespaceId>(ns_names_.size()));
  if (fresh) ns_names_.push_back(name);
  return it->second;
}

void BlockIndex::erase_locked(std::unordered_map<NsKey, Entry, NsKeyHash>::iterator it) {
  if (it->second.state == State::kReady) lru_.erase(it->second.lru);
  pool_.release(it->second.slot);
  map_.erase(it);
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
    if (e == map_.end() || !evictable(e->second)) continue;
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
  return SaveReservation{key, *slot, pool_.data(*slot), bytes};
}

void BlockIndex::commit(const SaveReservation& r, uint64_t checksum) {
  std::lock_guard lk(mu_);
  auto it = map_.find(r.key);
  if (it == map_.end() || it->second.state != State::kWriting || it->second.slot.offset != r.slot.offset) return;
  it->second.meta.checksum = checksum;
  it->second.state = State::kReady;
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

Status BlockIndex::pin(const NsKey& key, ClientId client) {
  std::lock_guard lk(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.state != State::kReady)
    return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not stored"};
  ++it->second.pins;
  ++client_pins_[client][key];
  return Status::Ok();
}

Status BlockIndex::unpin(const NsKey& key, ClientId client) {
  std::lock_guard lk(mu_);
  auto c = client_pins_.find(client);
  if (c == client_pins_.end())
    return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not pinned by this client"};
  auto p = c->second.find(key);
  if (p == c->second.end()) return {ErrorCode::kNotFound, "block " + key.key.hex() + " is not pinned by this client"};
  if (--p->second == 0) c->second.erase(p);
  auto it = map_.find(key);
  if (it != map_.end() && it->second.pins > 0) --it->second.pins;
  return Status::Ok();
}

void BlockIndex::release_client(ClientId client) {
  std::lock_guard lk(mu_);
  auto c = client_pins_.find(client);
  if (c == client_pins_.end()) return;
  for (const auto& [key, n] : c->second) {
    auto it = map_.find(key);
    if (it != map_.end()) it->second.pins -= std::min(it->second.pins, n);
  }
  client_pins_.erase(c);
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
  uint64_t n = 0;
  for (auto it = map_.begin(); it != map_.end();) {
    auto next = std::next(it);
    if (evictable(it->second) && (!ns || it->first.ns == *ns)) {
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
  for (const auto& [k, e] : map_) {
    if (e.state == State::kReady)
      ++s.entries;
    else
      ++s.writing;
    if (e.pins) ++s.pinned;
  }
  s.used_bytes = pool_.used_bytes();
  s.capacity_bytes = pool_.capacity();
  s.evictions = evictions_;
  s.evicted_bytes = evicted_bytes_;
  return s;
}

std::vector<ListEntry> BlockIndex::list(std::optional<NamespaceId> ns, size_t limit) const {
  std::lock_guard lk(mu_);
  std::vector<ListEntry> out;
  for (const NsKey& k : lru_) {
    if (out.size() >= limit) break;
    if (ns && k.ns != *ns) continue;
    const Entry& e = map_.at(k);
    out.push_back({k.ns < ns_names_.size() ? ns_names_[k.ns] : "?", k.key, e.meta.shape.format.name(), e.meta.bytes,
                   e.pins, "host"});
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
