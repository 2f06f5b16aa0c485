#include "kvferry/store/tiered_store.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace kvferry::store {
namespace {

uint64_t slot_bytes_of(uint64_t bytes) {
  return (bytes + HostPool::kSlotAlign - 1) / HostPool::kSlotAlign * HostPool::kSlotAlign;
}

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return std::hash<uint64_t>()(k.hi * 0x9E3779B97F4A7C15ull ^ k.lo); }
};

bool has_duplicates(std::span<const BlockKey> keys) {
  std::unordered_set<BlockKey, BlockKeyHash> seen;
  seen.reserve(keys.size());
  for (const BlockKey& k : keys)
    if (!seen.insert(k).second) return true;
  return false;
}

}  // namespace

std::string TieredStore::tenant_of(const std::string& ns_name) {
  const size_t bar = ns_name.rfind('|');
  return bar == std::string::npos ? std::string() : ns_name.substr(bar + 1);
}

std::string TieredStore::record_format(const BlockShape& shape) {
  return shape.format.name() + "@" + std::to_string(shape.layers) + "x" + std::to_string(shape.block_size);
}

std::optional<BlockShape> TieredStore::shape_of(std::string_view f) {
  const size_t at = f.rfind('@');
  if (at == std::string_view::npos) return std::nullopt;
  auto fmt = EntryFormat::parse(f.substr(0, at));
  if (!fmt.ok()) return std::nullopt;
  const std::string geo(f.substr(at + 1));
  long long layers = 0, block = 0;
  char tail = 0;
  if (std::sscanf(geo.c_str(), "%lldx%lld%c", &layers, &block, &tail) != 2 || layers <= 0 || block <= 0)
    return std::nullopt;
  return BlockShape{layers, block, *fmt};
}

struct TieredStore::Impl {
  Impl(BlockIndex& i, OffloadService& s, Registry& m, Tier* t, Options o)
      : index(i),
        svc(s),
        lower(t),
        opts(o),
        saved_blocks(m.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"disk\"")),
        saved_bytes(m.counter("kvferry_bytes_saved_total", "Bytes saved", "tier=\"disk\"")),
        loaded_blocks(m.counter("kvferry_blocks_loaded_total", "Blocks loaded", "tier=\"disk\"")),
        loaded_bytes(m.counter("kvferry_bytes_loaded_total", "Bytes loaded", "tier=\"disk\"")),
        write_failures(m.counter("kvferry_tier_write_failures_total",
                                 "Blocks a lower tier could not store (a demotion's block then leaves the host "
                                 "unsaved; a write-through save fails)",
                                 "tier=\"disk\"")),
        read_failures(m.counter("kvferry_tier_read_failures_total",
                                "Blocks a lower tier held but could not hand back (I/O error or damaged bytes)",
                                "tier=\"disk\"")),
        space_retries(m.counter("kvferry_tier_space_retries_total",
                                "Writes retried after evicting the lower tier's oldest blocks (full device)",
                                "tier=\"disk\"")) {
    if (opts.step_bytes == 0) opts.step_bytes = std::max<uint64_t>(index.pool().capacity() / 4, 1);
  }

  BlockIndex& index;
  OffloadService& svc;
  Tier* lower;
  Options opts;
  Counter &saved_blocks, &saved_bytes, &loaded_blocks, &loaded_bytes, &write_failures, &read_failures, &space_retries;

  // Completions of the shared tier are routed by cookie: whichever caller polls files them for
  // every waiter (two workers poll one tier).
  std::mutex pmu;
  std::condition_variable pcv;
  bool polling = false;
  std::unordered_map<uint64_t, TierCompletion> done;
  std::atomic<uint64_t> next_cookie{1};

  /// Submits `reqs` (cookies assigned here) and waits for all of their completions, in order.
  std::vector<TierCompletion> run(std::vector<TierRequest>& reqs) {
    std::vector<TierCompletion> out(reqs.size());
    if (reqs.empty()) return out;
    const uint64_t first = next_cookie.fetch_add(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].cookie = first + i;
    if (Status st = lower->submit(reqs); !st.ok()) {
      for (size_t i = 0; i < reqs.size(); ++i) out[i] = TierCompletion{reqs[i].cookie, reqs[i].op, st, reqs[i].record};
      return out;
    }
    size_t have = 0;
    std::vector<uint8_t> got(reqs.size(), 0);
    std::unique_lock lk(pmu);
    for (;;) {
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (got[i]) continue;
        auto it = done.find(first + i);
        if (it == done.end()) continue;
        out[i] = std::move(it->second);
        done.erase(it);
        got[i] = 1;
        ++have;
      }
      if (have == reqs.size()) break;
      if (polling) {
        pcv.wait(lk);
        continue;
      }
      polling = true;
      lk.unlock();
      std::vector<TierCompletion> batch;
      lower->poll(batch, 1024, std::chrono::milliseconds(20));
      lk.lock();
      polling = false;
      for (auto& c : batch) done.emplace(c.cookie, std::move(c));
      pcv.notify_all();
    }
    return out;
  }

  /// The lower tier dropped these on its own (to make room): their host copies, if any, are the
  /// only ones now.
  void note_victims() {
    for (const BlockRecord& v : lower->take_victims())
      if (auto id = index.namespace_id(v.ns)) index.set_on_lower(NsKey{*id, v.key}, false);
  }

  /// Writes blocks down; a full tier evicts its oldest blocks and the writes are retried once.
  std::vector<TierCompletion> write(std::vector<TierRequest>& reqs) {
    auto out = run(reqs);
    std::vector<size_t> again;
    uint64_t need = 0;
    for (size_t i = 0; i < out.size(); ++i)
      if (out[i].status.code() == ErrorCode::kResourceExhausted) {
        again.push_back(i);
        need += slot_bytes_of(reqs[i].record.bytes) + 4096;
      }
    if (!again.empty()) {
      space_retries.add(again.size());
      for (const BlockRecord& v : lower->evict(need))
        if (auto id = index.namespace_id(v.ns)) index.set_on_lower(NsKey{*id, v.key}, false);
      std::vector<TierRequest> retry;
      for (size_t i : again) retry.push_back(reqs[i]);
      auto out2 = run(retry);
      for (size_t j = 0; j < again.size(); ++j) out[again[j]] = std::move(out2[j]);
    }
    note_victims();
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].status.ok()) {
        saved_blocks.add();
        saved_bytes.add(reqs[i].record.bytes);
      } else {
        write_failures.add();
      }
    }
    return out;
  }

  TierRequest write_request(const Hold& h, const std::string& ns_name) {
    TierRequest r;
    r.op = TierOp::kWrite;
    r.record.ns = ns_name;
    r.record.key = h.key.key;
    r.record.format = record_format(h.meta.shape);
    r.record.bytes = h.meta.bytes;
    r.record.checksum = opts.checksums ? h.meta.checksum : block_checksum(h.data, h.meta.bytes);
    r.buf = h.data;
    r.buf_bytes = h.slot.bytes;
    return r;
  }

  /// Writes about `bytes` of the least recently used dirty host blocks down, so their slots may
  /// be reused. Returns the slot bytes it made evictable.
  uint64_t demote(uint64_t bytes) {
    auto holds = index.take_dirty(bytes);
    if (holds.empty()) return 0;
    std::vector<TierRequest> reqs;
    std::vector<uint8_t> named(holds.size(), 0);
    reqs.reserve(holds.size());
    for (size_t i = 0; i < holds.size(); ++i) {
      auto name = index.namespace_name(holds[i].key.ns);
      if (!name) continue;
      named[i] = 1;
      reqs.push_back(write_request(holds[i], *name));
    }
    auto out = write(reqs);
    uint64_t freed = 0;
    for (size_t i = 0, j = 0; i < holds.size(); ++i) {
      const bool ok = named[i] && out[j].status.ok();
      if (named[i]) ++j;
      index.end_demote(holds[i], ok);
      freed += holds[i].slot.bytes;
    }
    return freed;
  }

  void make_room(uint64_t bytes) {
    if (uint64_t need = index.demotion_needed(bytes)) demote(need);
  }
};

TieredStore::TieredStore(BlockIndex& index, OffloadService& svc, Registry& metrics, std::unique_ptr<Tier> lower,
                         Options opts)
    : lower_(std::move(lower)), impl_(std::make_unique<Impl>(index, svc, metrics, lower_.get(), opts)) {}

TieredStore::~TieredStore() = default;

std::vector<Status> TieredStore::save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                      std::span<const int64_t> block_ids, Clock::time_point deadline) {
  Impl& d = *impl_;
  if (!lower_ || keys.size() != block_ids.size()) return d.svc.save(region, ns, keys, block_ids, deadline);
  const auto name = d.index.namespace_name(ns);
  const uint64_t slot = slot_bytes_of(static_cast<uint64_t>(region.spec.block_bytes()));
  size_t per = static_cast<size_t>(std::max<uint64_t>(1, d.opts.step_bytes / slot));
  // The service refuses a key named twice only within one call: such a request runs whole.
  if (keys.size() > per && has_duplicates(keys)) per = keys.size();
  std::vector<Status> res(keys.size());
  for (size_t b = 0; b < keys.size(); b += per) {
    const size_t n = std::min(per, keys.size() - b);
    d.make_room(n * slot);
    auto r = d.svc.save(region, ns, keys.subspan(b, n), block_ids.subspan(b, n), deadline);
    // The pool was full of blocks still being written down elsewhere: demote more, retry once.
    std::vector<size_t> again;
    for (size_t i = 0; i < n; ++i)
      if (r[i].code() == ErrorCode::kResourceExhausted) again.push_back(i);
    if (!again.empty() && d.demote(again.size() * slot) > 0) {
      std::vector<BlockKey> k2;
      std::vector<int64_t> i2;
      for (size_t i : again) {
        k2.push_back(keys[b + i]);
        i2.push_back(block_ids[b + i]);
      }
      auto r2 = d.svc.save(region, ns, k2, i2, deadline);
      for (size_t j = 0; j < again.size(); ++j) r[again[j]] = r2[j];
    }
    if (d.opts.write_through && name) {
      std::vector<Hold> holds;
      std::vector<size_t> at;
      std::vector<TierRequest> reqs;
      for (size_t i = 0; i < n; ++i) {
        if (!r[i].ok()) continue;
        auto h = d.index.acquire(NsKey{ns, keys[b + i]});
        if (!h.ok()) continue;  // evicted already (a tiny pool): it was demoted on the way out
        holds.push_back(*h);
        at.push_back(i);
        reqs.push_back(d.write_request(*h, *name));
      }
      auto out = d.write(reqs);
      for (size_t j = 0; j < holds.size(); ++j) {
        if (out[j].status.ok())
          d.index.set_on_lower(holds[j].key, true);
        else
          r[at[j]] = out[j].status.with_context("write-through to the " + std::string(lower_->name()) + " tier");
        d.index.release(holds[j]);
      }
    }
    for (size_t i = 0; i < n; ++i) res[b + i] = std::move(r[i]);
  }
  return res;
}

std::vector<Status> TieredStore::load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                      std::span<const int64_t> block_ids, Clock::time_point deadline) {
  Impl& d = *impl_;
  if (!lower_ || keys.size() != block_ids.size()) return d.svc.load(region, ns, keys, block_ids, deadline);
  const auto name = d.index.namespace_name(ns);
  if (!name) return d.svc.load(region, ns, keys, block_ids, deadline);
  const uint64_t slot = slot_bytes_of(static_cast<uint64_t>(region.spec.block_bytes()));
  size_t per = static_cast<size_t>(std::max<uint64_t>(1, d.opts.step_bytes / slot));
  // The service refuses a target block named twice only within one call: such a request runs whole.
  {
    std::unordered_set<int64_t> seen;
    for (int64_t b : block_ids)
      if (!seen.insert(b).second) {
        per = keys.size();
        break;
      }
  }
  std::vector<Status> res(keys.size());
  for (size_t b = 0; b < keys.size(); b += per) {
    const size_t n = std::min(per, keys.size() - b);
    const auto ks = keys.subspan(b, n);
    const auto present = d.index.lookup(ns, ks).present;
    // Promote the host misses the lower tier holds: read into reserved host slots, commit (as
    // blocks with a lower copy), and hold them until the service has loaded them.
    std::vector<size_t> at;
    std::vector<SaveReservation> resv;
    std::vector<TierRequest> reqs;
    std::vector<Status> promo(n);
    uint64_t want = 0;
    std::vector<std::pair<size_t, BlockRecord>> found;
    for (size_t i = 0; i < n; ++i) {
      if (present[i]) continue;
      auto rec = lower_->lookup(*name, ks[i]);
      if (!rec) continue;
      want += slot_bytes_of(rec->bytes);
      found.emplace_back(i, std::move(*rec));
    }
    if (!found.empty()) d.make_room(want);
    for (auto& [i, rec] : found) {
      auto shape = shape_of(rec.format);
      if (!shape || static_cast<uint64_t>(shape->bytes()) != rec.bytes) {
        promo[i] = Status(ErrorCode::kDataLoss, "the " + std::string(lower_->name()) + " tier's record of block " +
                                                    ks[i].hex() + " names an unknown format '" + rec.format + "'");
        continue;
      }
      auto r = d.index.reserve(NsKey{ns, ks[i]}, *shape);
      if (!r.ok() && r.status().code() == ErrorCode::kResourceExhausted && d.demote(slot_bytes_of(rec.bytes)) > 0)
        r = d.index.reserve(NsKey{ns, ks[i]}, *shape);
      if (!r.ok()) {
        if (r.status().code() != ErrorCode::kAlreadyExists) promo[i] = r.status();  // saved meanwhile: fine
        continue;
      }
      TierRequest q;
      q.op = TierOp::kRead;
      q.record.ns = *name;
      q.record.key = ks[i];
      q.buf = r->data;
      q.buf_bytes = r->slot.bytes;
      reqs.push_back(std::move(q));
      resv.push_back(*r);
      at.push_back(i);
    }
    std::vector<Hold> holds;
    if (!reqs.empty()) {
      auto out = d.run(reqs);
      for (size_t j = 0; j < out.size(); ++j) {
        const size_t i = at[j];
        if (out[j].status.ok() && out[j].record.bytes == resv[j].bytes) {
          d.index.commit(resv[j], out[j].record.checksum, true);
          auto h = d.index.acquire(resv[j].key);
          if (h.ok()) holds.push_back(*h);
          d.loaded_blocks.add();
          d.loaded_bytes.add(out[j].record.bytes);
          continue;
        }
        d.index.abort(resv[j]);
        if (out[j].status.code() == ErrorCode::kNotFound) continue;  // dropped meanwhile: a miss
        d.read_failures.add();
        promo[i] = out[j].status.ok() ? Status(ErrorCode::kDataLoss, "size changed on the lower tier")
                                      : out[j].status.with_context("block " + ks[i].hex() + " from the " +
                                                                   std::string(lower_->name()) + " tier");
      }
    }
    auto r = d.svc.load(region, ns, ks, block_ids.subspan(b, n), deadline);
    for (const Hold& h : holds) d.index.release(h);
    for (size_t i = 0; i < n; ++i) res[b + i] = promo[i].ok() ? std::move(r[i]) : std::move(promo[i]);
  }
  return res;
}

LookupResult TieredStore::lookup(NamespaceId ns, std::span<const BlockKey> keys) {
  Impl& d = *impl_;
  LookupResult r = d.index.lookup(ns, keys);
  if (!lower_) return r;
  std::optional<std::string> name;
  bool prefix = true;
  r.prefix = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!r.present[i]) {
      if (!name) name = d.index.namespace_name(ns);
      if (name && lower_->lookup(*name, keys[i])) r.present[i] = 1;
    }
    if (prefix && r.present[i])
      ++r.prefix;
    else
      prefix = false;
  }
  return r;
}

Status TieredStore::evict(NamespaceId ns, const BlockKey& key) {
  Impl& d = *impl_;
  const bool host = d.index.evict(ns, std::span<const BlockKey>(&key, 1)) == 1;
  bool host_busy = !host && d.index.lookup(ns, std::span<const BlockKey>(&key, 1)).present[0];
  bool low = false, low_busy = false;
  if (lower_ && !host_busy) {
    if (auto name = d.index.namespace_name(ns)) {
      Status st = lower_->erase(*name, key);
      low = st.ok();
      low_busy = st.code() == ErrorCode::kBusy;
    }
  }
  if (host_busy || low_busy) return {ErrorCode::kBusy, "block " + key.hex() + " is in use"};
  if (host || low) return Status::Ok();
  return {ErrorCode::kNotFound, "block " + key.hex() + " is not stored"};
}

uint64_t TieredStore::evict_all(const std::function<bool(const std::string&, const std::string&)>& filter) {
  Impl& d = *impl_;
  uint64_t n =
      d.index.evict_all([&](NamespaceId, const std::string& name, const std::string& t) { return filter(name, t); });
  if (!lower_) return n;
  for (const BlockRecord& r : lower_->list(std::nullopt, SIZE_MAX))
    if (filter(r.ns, tenant_of(r.ns)) && lower_->erase(r.ns, r.key).ok()) ++n;
  return n;
}

std::vector<ListEntry> TieredStore::list(const std::function<bool(const std::string&, const std::string&)>& filter,
                                         size_t limit) const {
  Impl& d = *impl_;
  auto out =
      d.index.list([&](NamespaceId, const std::string& name, const std::string& t) { return filter(name, t); }, limit);
  if (!lower_ || out.size() >= limit) return out;
  std::unordered_set<std::string> on_host;
  on_host.reserve(out.size());
  for (const ListEntry& e : out) on_host.insert(e.ns + "/" + e.key.hex());
  for (const BlockRecord& r : lower_->list(std::nullopt, SIZE_MAX)) {
    if (out.size() >= limit) break;
    if (!filter(r.ns, tenant_of(r.ns)) || on_host.count(r.ns + "/" + r.key.hex())) continue;
    auto shape = shape_of(r.format);
    out.push_back({r.ns, r.key, shape ? shape->format.name() : r.format, r.bytes, 0, std::string(lower_->name())});
  }
  return out;
}

}  // namespace kvferry::store
