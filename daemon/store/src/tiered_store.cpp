#include "kvferry/store/tiered_store.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace kvferry::store {
namespace {

uint64_t slot_bytes_of(uint64_t bytes) {
  return (bytes + HostPool::kSlotAlign - 1) / HostPool::kSlotAlign * HostPool::kSlotAlign;
}

/// Runs `fn(begin, count)` over [0, n) in turns of about `turn.bytes`, stopping after a turn once
/// `turn.yield()` says so. Returns the statuses of the blocks done (a prefix).
template <class Fn>
std::vector<Status> run_turns(size_t n, uint64_t block_bytes, const TieredStore::Turn& turn, Fn&& fn) {
  const size_t per = static_cast<size_t>(std::max<uint64_t>(1, turn.bytes / block_bytes));
  std::vector<Status> res;
  res.reserve(n);
  for (size_t b = 0; b < n;) {
    const size_t m = std::min(per, n - b);
    for (Status& s : fn(b, m)) res.push_back(std::move(s));
    b += m;
    if (b < n && turn.yield && turn.yield()) break;
  }
  return res;
}

/// Steps whose lower-tier I/O runs while the worker copies the next (save) or the previous
/// (load) one: at least two (the device's queue stays full across one step's fdatasync and the
/// worker's hiccups on a busy host), and up to 32 blocks (a device queue's worth: 4 MiB blocks
/// come 8 to a 32 MiB step) as long as they and the step being copied take at most half of the
/// pool, so the other worker's pipeline fits beside them.
/// A read of block `key` of namespace `ns` from the lower tier into the reserved slot `r`.
TierRequest read_into(const std::string& ns, const BlockKey& key, const SaveReservation& r) {
  TierRequest q;
  q.op = TierOp::kRead;
  q.record.ns = ns;
  q.record.key = key;
  q.buf = r.data;
  q.buf_bytes = r.slot.bytes;
  return q;
}

size_t steps_in_flight(size_t per_step, uint64_t slot_bytes, uint64_t pool_bytes) {
  const size_t for_queue = (32 + per_step - 1) / per_step;
  const size_t fit = static_cast<size_t>(pool_bytes / 2 / std::max<uint64_t>(1, per_step * slot_bytes));
  return std::max<size_t>(2, std::min(for_queue, fit > 0 ? fit - 1 : 0));
}

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
                                "tier=\"disk\"")),
        trusted_reads(m.counter("kvferry_tier_verified_promotions_total",
                                "Promoted blocks whose bytes the lower tier checked (XXH3) as they landed, so the "
                                "load did not hash them again",
                                "tier=\"disk\"")),
        save_phase(m, "save"),
        load_phase(m, "load") {
    if (opts.step_bytes == 0)
      opts.step_bytes = std::clamp<uint64_t>(index.pool().capacity() / 8, 1, uint64_t{32} << 20);
  }

  /// Where a data worker's time goes in saves and loads through the tiers (microseconds): `host`
  /// in the offload service (copies and hashes), `lower_wait` blocked on the lower tier's I/O,
  /// `demote` writing host blocks down before a step could start, `total` the whole call.
  struct Phases {
    Counter *host, *lower_wait, *demote, *total;
    Phases(Registry& m, const char* op) {
      auto c = [&](const char* phase) {
        return &m.counter("kvferry_tier_phase_microseconds_total",
                          "Time data workers spent per phase of saves and loads through the tiers (host: copies "
                          "and hashes; lower_wait: blocked on the lower tier; demote: writing blocks down before "
                          "a step could start)",
                          std::string("tier=\"disk\",op=\"") + op + "\",phase=\"" + phase + "\"");
      };
      host = c("host");
      lower_wait = c("lower_wait");
      demote = c("demote");
      total = c("total");
    }
  };
  /// Adds the microseconds since `t0` to `c` when destroyed.
  struct Timed {
    Counter& c;
    Clock::time_point t0 = Clock::now();
    ~Timed() { c.add(static_cast<uint64_t>(std::chrono::duration<double, std::micro>(Clock::now() - t0).count())); }
  };

  BlockIndex& index;
  OffloadService& svc;
  Tier* lower;
  Options opts;
  Counter &saved_blocks, &saved_bytes, &loaded_blocks, &loaded_bytes, &write_failures, &read_failures, &space_retries,
      &trusted_reads;
  Phases save_phase, load_phase;

  // Completions of the shared tier are routed by cookie: whichever caller polls files them for
  // every waiter (two workers poll one tier).
  std::mutex pmu;
  std::condition_variable pcv;
  bool polling = false;
  std::unordered_map<uint64_t, TierCompletion> done;
  std::atomic<uint64_t> next_cookie{1};

  /// A batch submitted to the lower tier whose completions have not been collected yet.
  struct Flight {
    std::vector<TierRequest> reqs;  ///< cookies first .. first + size - 1
    uint64_t first = 0;
    Status refused;  ///< submit() itself failed: every request completes with it
  };

  /// Submits `reqs` (cookies assigned here) without waiting.
  Flight start(std::vector<TierRequest> reqs) {
    Flight f;
    f.reqs = std::move(reqs);
    if (f.reqs.empty()) return f;
    f.first = next_cookie.fetch_add(f.reqs.size());
    for (size_t i = 0; i < f.reqs.size(); ++i) f.reqs[i].cookie = f.first + i;
    f.refused = lower->submit(f.reqs);
    return f;
  }

  /// Waits for every completion of `f`, in request order.
  std::vector<TierCompletion> collect(const Flight& f, Counter& waited) {
    const auto& reqs = f.reqs;
    std::vector<TierCompletion> out(reqs.size());
    if (reqs.empty()) return out;
    if (!f.refused.ok()) {
      for (size_t i = 0; i < reqs.size(); ++i)
        out[i] = TierCompletion{reqs[i].cookie, reqs[i].op, f.refused, reqs[i].record};
      return out;
    }
    Timed t{waited};
    const uint64_t first = f.first;
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

  /// Submits `reqs` and waits for all of their completions, in order.
  std::vector<TierCompletion> run(std::vector<TierRequest> reqs, Counter& waited) {
    return collect(start(std::move(reqs)), waited);
  }

  /// The lower tier dropped these on its own (to make room): their host copies, if any, are the
  /// only ones now.
  void note_victims() {
    for (const BlockRecord& v : lower->take_victims())
      if (auto id = index.namespace_id(v.ns)) index.set_on_lower(NsKey{*id, v.key}, false);
  }

  /// Writes blocks down (write_finish() collects them); a full tier evicts its oldest blocks and
  /// the writes are retried once.
  Flight write_start(std::vector<TierRequest> reqs) { return start(std::move(reqs)); }
  std::vector<TierCompletion> write_finish(const Flight& f, Counter& waited) {
    const auto& reqs = f.reqs;
    auto out = collect(f, waited);
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
      auto out2 = run(std::move(retry), waited);
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

  /// A demotion under way: host blocks held while their writes run.
  struct Demotion {
    std::vector<Hold> holds;
    std::vector<uint8_t> named;  ///< per hold: its namespace is live (it has a request in `f`)
    Flight f;
  };

  /// Starts writing about `bytes` of the least recently used dirty host blocks down, so their
  /// slots may be reused once demote_finish() has run.
  Demotion demote_start(uint64_t bytes) {
    Demotion d;
    d.holds = index.take_dirty(bytes);
    if (d.holds.empty()) return d;
    std::vector<TierRequest> reqs;
    d.named.assign(d.holds.size(), 0);
    reqs.reserve(d.holds.size());
    for (size_t i = 0; i < d.holds.size(); ++i) {
      auto name = index.namespace_name(d.holds[i].key.ns);
      if (!name) continue;
      d.named[i] = 1;
      reqs.push_back(write_request(d.holds[i], *name));
    }
    d.f = write_start(std::move(reqs));
    return d;
  }
  /// Waits for a demotion and lets its blocks be evicted. Returns the slot bytes it made evictable.
  uint64_t demote_finish(Demotion& d, Counter& waited) {
    if (d.holds.empty()) return 0;
    auto out = write_finish(d.f, waited);
    uint64_t freed = 0;
    for (size_t i = 0, j = 0; i < d.holds.size(); ++i) {
      const bool ok = d.named[i] && out[j].status.ok();
      if (d.named[i]) ++j;
      index.end_demote(d.holds[i], ok);
      freed += d.holds[i].slot.bytes;
    }
    d.holds.clear();
    return freed;
  }
  uint64_t demote(uint64_t bytes, Counter& waited) {
    Demotion d = demote_start(bytes);
    return demote_finish(d, waited);
  }

  void make_room(uint64_t bytes, Counter& waited) {
    if (uint64_t need = index.demotion_needed(bytes)) demote(need, waited);
  }
};

TieredStore::TieredStore(BlockIndex& index, OffloadService& svc, Registry& metrics, std::unique_ptr<Tier> lower,
                         Options opts)
    : lower_(std::move(lower)), impl_(std::make_unique<Impl>(index, svc, metrics, lower_.get(), opts)) {}

TieredStore::~TieredStore() = default;

std::vector<Status> TieredStore::save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                      std::span<const int64_t> block_ids, Clock::time_point deadline,
                                      const Turn& turn) {
  Impl& d = *impl_;
  if (keys.size() != block_ids.size()) return d.svc.save(region, ns, keys, block_ids, deadline);
  const uint64_t bb = std::max<uint64_t>(1, static_cast<uint64_t>(region.spec.block_bytes()));
  const uint64_t slot = slot_bytes_of(bb);
  // The service refuses a key named twice only within one call: such a request runs whole.
  const bool whole = keys.size() > 1 && has_duplicates(keys);
  if (!lower_) {
    if (whole || turn.bytes == 0) return d.svc.save(region, ns, keys, block_ids, deadline);
    return run_turns(keys.size(), bb, turn, [&](size_t b, size_t n) {
      return d.svc.save(region, ns, keys.subspan(b, n), block_ids.subspan(b, n), deadline);
    });
  }
  Impl::Timed total{*d.save_phase.total};
  const auto name = d.index.namespace_name(ns);
  const size_t per = whole ? keys.size() : static_cast<size_t>(std::max<uint64_t>(1, d.opts.step_bytes / slot));
  const size_t in_flight = steps_in_flight(per, slot, d.index.pool().capacity());
  std::vector<Status> res(keys.size());
  // Write-through: the writes of step k run while step k+1 copies and hashes. Write-back: the
  // room step k+1 needs is written down while step k copies.
  struct Writes {
    Impl::Flight f;
    std::vector<Hold> holds;
    std::vector<size_t> at;  // index into keys per hold
  };
  std::deque<Writes> writes;
  Impl::Demotion ahead;
  auto finish_writes = [&](Writes& w) {
    auto out = d.write_finish(w.f, *d.save_phase.lower_wait);
    for (size_t j = 0; j < w.holds.size(); ++j) {
      if (out[j].status.ok())
        d.index.set_on_lower(w.holds[j].key, true);
      else
        res[w.at[j]] = out[j].status.with_context("write-through to the " + std::string(lower_->name()) + " tier");
      d.index.release(w.holds[j]);
    }
  };
  auto drain = [&] {  // returns whether anything was in flight
    const bool any = !writes.empty() || !ahead.holds.empty();
    for (; !writes.empty(); writes.pop_front()) finish_writes(writes.front());
    d.demote_finish(ahead, *d.save_phase.lower_wait);
    return any;
  };
  size_t b = 0;
  uint64_t done_bytes = 0;
  while (b < keys.size()) {
    const size_t n = std::min(per, keys.size() - b);
    const size_t n_next = std::min(per, keys.size() - b - n);
    d.demote_finish(ahead, *d.save_phase.lower_wait);
    d.make_room(n * slot, *d.save_phase.demote);
    if (!d.opts.write_through && n_next > 0)
      if (uint64_t need = d.index.demotion_needed((n + n_next) * slot)) ahead = d.demote_start(need);
    std::vector<Status> r;
    {
      Impl::Timed t{*d.save_phase.host};
      r = d.svc.save(region, ns, keys.subspan(b, n), block_ids.subspan(b, n), deadline);
    }
    // The pool was full of blocks still being written down: let this call's I/O finish, demote
    // more, and retry once.
    std::vector<size_t> again;
    for (size_t i = 0; i < n; ++i)
      if (r[i].code() == ErrorCode::kResourceExhausted) again.push_back(i);
    if (!again.empty()) {
      const bool drained = drain();
      if (d.demote(again.size() * slot, *d.save_phase.demote) > 0 || drained) {
        std::vector<BlockKey> k2;
        std::vector<int64_t> i2;
        for (size_t i : again) {
          k2.push_back(keys[b + i]);
          i2.push_back(block_ids[b + i]);
        }
        std::vector<Status> r2;
        {
          Impl::Timed t{*d.save_phase.host};
          r2 = d.svc.save(region, ns, k2, i2, deadline);
        }
        for (size_t j = 0; j < again.size(); ++j) r[again[j]] = r2[j];
      }
    }
    for (size_t i = 0; i < n; ++i) res[b + i] = std::move(r[i]);
    if (d.opts.write_through && name) {
      Writes w;
      std::vector<TierRequest> reqs;
      for (size_t i = 0; i < n; ++i) {
        if (!res[b + i].ok()) continue;
        auto h = d.index.acquire(NsKey{ns, keys[b + i]});
        if (!h.ok()) continue;  // evicted already (a tiny pool): it was demoted on the way out
        w.holds.push_back(*h);
        w.at.push_back(b + i);
        reqs.push_back(d.write_request(*h, *name));
      }
      w.f = d.write_start(std::move(reqs));
      writes.push_back(std::move(w));
      for (; writes.size() > in_flight; writes.pop_front()) finish_writes(writes.front());
    }
    b += n;
    done_bytes += n * bb;
    if (b < keys.size() && turn.bytes > 0 && done_bytes >= turn.bytes && turn.yield && turn.yield()) break;
  }
  drain();
  res.resize(b);
  return res;
}

std::vector<Status> TieredStore::load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                      std::span<const int64_t> block_ids, Clock::time_point deadline,
                                      const Turn& turn) {
  Impl& d = *impl_;
  if (keys.size() != block_ids.size()) return d.svc.load(region, ns, keys, block_ids, deadline);
  const uint64_t bb = std::max<uint64_t>(1, static_cast<uint64_t>(region.spec.block_bytes()));
  const uint64_t slot = slot_bytes_of(bb);
  // The service refuses a target block named twice only within one call: such a request runs whole.
  bool whole = false;
  {
    std::unordered_set<int64_t> seen;
    seen.reserve(block_ids.size());
    for (int64_t id : block_ids)
      if (!seen.insert(id).second) {
        whole = true;
        break;
      }
  }
  const auto name = lower_ ? d.index.namespace_name(ns) : std::nullopt;
  if (!lower_ || !name) {
    if (whole || turn.bytes == 0) return d.svc.load(region, ns, keys, block_ids, deadline);
    return run_turns(keys.size(), bb, turn, [&](size_t b, size_t n) {
      return d.svc.load(region, ns, keys.subspan(b, n), block_ids.subspan(b, n), deadline);
    });
  }
  Impl::Timed total{*d.load_phase.total};
  const size_t per = whole ? keys.size() : static_cast<size_t>(std::max<uint64_t>(1, d.opts.step_bytes / slot));
  const size_t in_flight = steps_in_flight(per, slot, d.index.pool().capacity());
  // One step of a load: its host blocks held (so promotions of later steps cannot evict them), its
  // lower-tier blocks read into reserved host slots (promoted), then all of it loaded into the
  // region. The reads of step k+1 run while step k is copied.
  struct Reads {
    Impl::Flight f;
    std::vector<size_t> at;  // index in the step per request
    std::vector<SaveReservation> resv;
  };
  struct Step {
    size_t b = 0, n = 0;
    std::vector<Hold> holds;
    std::vector<Status> promo;
    std::vector<uint8_t> verified;                         // promoted, and the tier checked the bytes
    std::vector<std::pair<size_t, BlockRecord>> deferred;  // on the lower tier, no slot reserved yet
    std::vector<Reads> reads;
  };
  // Reserves slots for the step's lower-tier blocks and submits their reads. A step read ahead
  // stops at the first block the pool has no room for (the current step gets the room first);
  // the rest are read when it becomes current.
  auto read_lower = [&](Step& p, bool early) {
    if (p.deferred.empty()) return;
    uint64_t want = 0;
    for (const auto& [i, rec] : p.deferred) want += slot_bytes_of(rec.bytes);
    d.make_room(want, *d.load_phase.demote);
    Reads rd;
    std::vector<TierRequest> reqs;
    size_t k = 0;
    for (; k < p.deferred.size(); ++k) {
      const size_t i = p.deferred[k].first;
      const BlockRecord& rec = p.deferred[k].second;
      const BlockKey& key = keys[p.b + i];
      auto shape = shape_of(rec.format);
      if (!shape || static_cast<uint64_t>(shape->bytes()) != rec.bytes) {
        p.promo[i] = Status(ErrorCode::kDataLoss, "the " + std::string(lower_->name()) + " tier's record of block " +
                                                      key.hex() + " names an unknown format '" + rec.format + "'");
        continue;
      }
      auto r = d.index.reserve(NsKey{ns, key}, *shape);
      if (!r.ok() && r.status().code() == ErrorCode::kResourceExhausted) {
        if (early) break;
        if (d.demote(slot_bytes_of(rec.bytes), *d.load_phase.demote) > 0) r = d.index.reserve(NsKey{ns, key}, *shape);
      }
      if (!r.ok()) {
        if (r.status().code() != ErrorCode::kAlreadyExists) p.promo[i] = r.status();  // saved meanwhile: fine
        continue;
      }
      reqs.push_back(read_into(*name, key, *r));
      rd.resv.push_back(*r);
      rd.at.push_back(i);
    }
    p.deferred.erase(p.deferred.begin(), p.deferred.begin() + static_cast<std::ptrdiff_t>(k));
    if (reqs.empty()) return;
    rd.f = d.start(std::move(reqs));
    p.reads.push_back(std::move(rd));
  };
  size_t next = 0;  // first key of the next step to start
  auto start_step = [&](bool early) {
    Step p;
    p.b = next;
    p.n = std::min(per, keys.size() - next);
    next += p.n;
    p.promo.resize(p.n);
    p.verified.assign(p.n, 0);
    if (Clock::now() < deadline) {  // past it, the service reports every block as timed out
      for (size_t i = 0; i < p.n; ++i) {
        const BlockKey& key = keys[p.b + i];
        if (auto h = d.index.acquire(NsKey{ns, key}); h.ok()) {
          p.holds.push_back(*h);
          continue;
        }
        if (auto rec = lower_->lookup(*name, key)) p.deferred.emplace_back(i, std::move(*rec));
      }
      read_lower(p, early);
    }
    return p;
  };
  // Waits for the step's reads and makes the promoted blocks visible (held).
  auto finish_reads = [&](Step& p) {
    read_lower(p, false);
    for (Reads& rd : p.reads) {
      auto out = d.collect(rd.f, *d.load_phase.lower_wait);
      for (size_t j = 0; j < out.size(); ++j) {
        const size_t i = rd.at[j];
        if (out[j].status.ok() && out[j].record.bytes == rd.resv[j].bytes) {
          d.index.commit(rd.resv[j], out[j].record.checksum, true);
          if (auto h = d.index.acquire(rd.resv[j].key); h.ok()) {
            p.holds.push_back(*h);
            p.verified[i] = d.opts.trust_lower_reads ? 1 : 0;
          }
          d.loaded_blocks.add();
          d.loaded_bytes.add(out[j].record.bytes);
          continue;
        }
        d.index.abort(rd.resv[j]);
        if (out[j].status.code() == ErrorCode::kNotFound) continue;  // dropped meanwhile: a miss
        d.read_failures.add();
        p.promo[i] = out[j].status.ok() ? Status(ErrorCode::kDataLoss, "size changed on the lower tier")
                                        : out[j].status.with_context("block " + keys[p.b + i].hex() + " from the " +
                                                                     std::string(lower_->name()) + " tier");
      }
    }
    p.reads.clear();
  };
  auto release = [&](Step& p) {
    for (const Hold& h : p.holds) d.index.release(h);
    p.holds.clear();
  };
  std::vector<Status> res(keys.size());
  std::deque<Step> steps;
  size_t b = 0;
  uint64_t done_bytes = 0;
  while (b < keys.size()) {
    if (steps.empty()) steps.push_back(start_step(false));
    while (next < keys.size() && steps.size() < 1 + in_flight) steps.push_back(start_step(true));
    Step& p = steps.front();
    finish_reads(p);
    // The front step's reads have landed: while it is copied into the region, a further step's
    // reads keep the lower tier's queue as deep as before (deque references stay valid).
    while (next < keys.size() && steps.size() < 2 + in_flight) steps.push_back(start_step(true));
    uint64_t trusted = 0;
    for (uint8_t v : p.verified) trusted += v;
    d.trusted_reads.add(trusted);
    std::vector<Status> r;
    {
      Impl::Timed t{*d.load_phase.host};
      r = d.svc.load(region, ns, keys.subspan(p.b, p.n), block_ids.subspan(p.b, p.n), deadline, p.verified);
    }
    release(p);
    for (size_t i = 0; i < p.n; ++i) res[p.b + i] = p.promo[i].ok() ? std::move(r[i]) : std::move(p.promo[i]);
    b += p.n;
    done_bytes += p.n * bb;
    steps.pop_front();
    if (b < keys.size() && turn.bytes > 0 && done_bytes >= turn.bytes && turn.yield && turn.yield()) break;
  }
  // A step read ahead of a yield: its blocks stay promoted on the host for the next call.
  for (Step& p : steps) {
    finish_reads(p);
    release(p);
  }
  res.resize(b);
  return res;
}

std::vector<Status> TieredStore::load_mapped(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                             std::span<const int64_t> block_ids, std::span<const int32_t> parts,
                                             Clock::time_point deadline) {
  Impl& d = *impl_;
  const auto name = lower_ ? d.index.namespace_name(ns) : std::nullopt;
  if (!lower_ || !name || keys.size() != block_ids.size() || keys.size() != parts.size())
    return d.svc.load_mapped(region, ns, keys, block_ids, parts, deadline);
  // Entries by region block (in order of first mention), so a step never splits a region block.
  std::vector<std::vector<size_t>> groups;
  {
    std::unordered_map<int64_t, size_t> at;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto [it, fresh] = at.emplace(block_ids[i], groups.size());
      if (fresh) groups.emplace_back();
      groups[it->second].push_back(i);
    }
  }
  std::vector<Status> res(keys.size());
  size_t g = 0;
  while (g < groups.size()) {
    // One step: region blocks while their distinct stored blocks fit step_bytes (at least one).
    std::vector<size_t> entries;
    std::unordered_set<BlockKey, BlockKeyHash> distinct;
    uint64_t step = 0;
    for (; g < groups.size(); ++g) {
      uint64_t more = 0;
      for (size_t i : groups[g])
        if (!distinct.count(keys[i])) more += static_cast<uint64_t>(region.spec.block_bytes());
      if (!entries.empty() && step + more > d.opts.step_bytes) break;
      step += more;
      for (size_t i : groups[g]) {
        distinct.insert(keys[i]);
        entries.push_back(i);
      }
    }
    // Promote the step's stored blocks that only the lower tier holds, and hold every one.
    std::vector<Hold> holds;
    std::vector<BlockKey> reads_of;
    std::vector<SaveReservation> resv;
    std::vector<TierRequest> reqs;
    std::unordered_map<BlockKey, Status, BlockKeyHash> promo;
    std::unordered_set<BlockKey, BlockKeyHash> trusted;
    d.make_room(step, *d.load_phase.demote);
    for (const BlockKey& key : distinct) {
      if (auto h = d.index.acquire(NsKey{ns, key}); h.ok()) {
        holds.push_back(*h);
        continue;
      }
      auto rec = lower_->lookup(*name, key);
      if (!rec) continue;  // a miss; the service reports it
      auto shape = shape_of(rec->format);
      if (!shape || static_cast<uint64_t>(shape->bytes()) != rec->bytes) {
        promo[key] = Status(ErrorCode::kDataLoss, "the " + std::string(lower_->name()) + " tier's record of block " +
                                                      key.hex() + " names an unknown format '" + rec->format + "'");
        continue;
      }
      auto r = d.index.reserve(NsKey{ns, key}, *shape);
      if (!r.ok() && r.status().code() == ErrorCode::kResourceExhausted &&
          d.demote(slot_bytes_of(rec->bytes), *d.load_phase.demote) > 0)
        r = d.index.reserve(NsKey{ns, key}, *shape);
      if (!r.ok()) {
        if (r.status().code() != ErrorCode::kAlreadyExists) promo[key] = r.status();
        continue;
      }
      reqs.push_back(read_into(*name, key, *r));
      resv.push_back(*r);
      reads_of.push_back(key);
    }
    auto out = d.collect(d.start(std::move(reqs)), *d.load_phase.lower_wait);
    for (size_t j = 0; j < out.size(); ++j) {
      if (out[j].status.ok() && out[j].record.bytes == resv[j].bytes) {
        d.index.commit(resv[j], out[j].record.checksum, true);
        if (auto h = d.index.acquire(resv[j].key); h.ok()) {
          holds.push_back(*h);
          if (d.opts.trust_lower_reads) trusted.insert(reads_of[j]);
        }
        d.loaded_blocks.add();
        d.loaded_bytes.add(out[j].record.bytes);
        continue;
      }
      d.index.abort(resv[j]);
      if (out[j].status.code() == ErrorCode::kNotFound) continue;
      d.read_failures.add();
      promo[reads_of[j]] = out[j].status.ok() ? Status(ErrorCode::kDataLoss, "size changed on the lower tier")
                                              : out[j].status.with_context("block " + reads_of[j].hex() + " from the " +
                                                                           std::string(lower_->name()) + " tier");
    }
    std::vector<BlockKey> k;
    std::vector<int64_t> b;
    std::vector<int32_t> p;
    std::vector<uint8_t> v;
    for (size_t i : entries) {
      k.push_back(keys[i]);
      b.push_back(block_ids[i]);
      p.push_back(parts[i]);
      v.push_back(trusted.count(keys[i]) ? 1 : 0);
    }
    std::vector<Status> r;
    {
      Impl::Timed t{*d.load_phase.host};
      r = d.svc.load_mapped(region, ns, k, b, p, deadline, v);
    }
    for (const Hold& h : holds) d.index.release(h);
    for (size_t j = 0; j < entries.size(); ++j) {
      auto it = promo.find(keys[entries[j]]);
      // A stored block that could not be promoted is that entry's reason (the service saw a miss).
      res[entries[j]] = it != promo.end() && !r[j].ok() ? it->second : std::move(r[j]);
    }
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
