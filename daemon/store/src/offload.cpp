// Saves and plain loads (offload.h): reservation, sub-batched moves through the region's mover,
// checksums, commit or abort; verification and format conversion on load. Mapped loads: offload_mapped.cpp.
#include "offload_impl.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <unordered_map>

#include "kvferry/layouts/geometry.h"

namespace kvferry::store {
namespace {

uint64_t micros(double s) { return static_cast<uint64_t>(s * 1e6); }

bool convertible(FormatKind from, FormatKind to) {
  using K = FormatKind;
  return (from == K::kMlaFp8 && to == K::kMlaFp8Ds) || (from == K::kMlaBf16 && to == K::kMlaFp8Ds) ||
         (from == K::kMlaFp8Ds && to == K::kMlaBf16) || (from == K::kMlaFp8Ds && to == K::kMlaFp8) ||
         // mla_fp4 (SGLang's FP4 layout) from and to every other MLA format, on the host.
         (from == K::kMlaFp4 && to != K::kMlaFp4 && (to == K::kMlaBf16 || to == K::kMlaFp8 || to == K::kMlaFp8Ds)) ||
         (to == K::kMlaFp4 && (from == K::kMlaBf16 || from == K::kMlaFp8 || from == K::kMlaFp8Ds));
}

/// Marks every entry whose destination (a save's key, a load's target block) occurs more than
/// once in the request: which copy should win is the caller's bug, so none of them runs.
template <class T, class Hash = std::hash<T>>
void refuse_duplicates(std::span<const T> dests, std::vector<Status>* res, const char* what,
                       const std::function<std::string(const T&)>& name) {
  std::unordered_map<T, uint32_t, Hash> seen;
  seen.reserve(dests.size());
  for (const T& d : dests) ++seen[d];
  for (size_t i = 0; i < dests.size(); ++i) {
    const uint32_t n = seen[dests[i]];
    if (n > 1 && (*res)[i].ok())
      (*res)[i] =
          Status(ErrorCode::kInvalidArgument, std::string(what) + " " + name(dests[i]) + " is named " +
                                                  std::to_string(n) + " times in one request; none of them ran");
  }
}

}  // namespace

std::vector<std::pair<size_t, size_t>> split(size_t n, uint64_t item_bytes, int64_t target) {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t per =
      target <= 0
          ? std::max<size_t>(n, 1)
          : std::max<size_t>(1, static_cast<size_t>(static_cast<uint64_t>(target) / std::max<uint64_t>(item_bytes, 1)));
  for (size_t b = 0; b < n; b += per) out.emplace_back(b, std::min(n, b + per));
  return out;
}

void push_block_runs(std::vector<CopyRun>* runs, const KvCacheSpec& spec, int64_t block, int64_t slot_offset,
                     bool to_slot) {
  const size_t floor = runs->size();
  auto merge_push = [runs, floor](int64_t s, int64_t d, int64_t n) {
    if (runs->size() > floor && runs->back().src + runs->back().bytes == s &&
        runs->back().dst + runs->back().bytes == d)
      runs->back().bytes += n;
    else
      runs->push_back({s, d, n});
  };
  if (spec.layout == Layout::kBlockMajor) {
    const int64_t off = spec.page_offset(0, block);
    to_slot ? merge_push(off, slot_offset, spec.block_bytes()) : merge_push(slot_offset, off, spec.block_bytes());
    return;
  }
  for (int64_t l = 0; l < spec.layers; ++l) {
    const int64_t off = spec.page_offset(l, block), in_slot = slot_offset + l * spec.page_bytes();
    to_slot ? merge_push(off, in_slot, spec.page_bytes()) : merge_push(in_slot, off, spec.page_bytes());
  }
}

std::vector<Status> mismatched_lists(const char* op, size_t keys, size_t ids) {
  return std::vector<Status>(
      keys, Status(ErrorCode::kInvalidArgument,
                   std::string(op) + ": " + std::to_string(keys) + " keys but " + std::to_string(ids) + " block ids"));
}

std::string format_family(const EntryFormat& f) {
  if (f.is_mla()) return "mla";
  // MHA caches of one model share blocks whatever their order and whichever heads a rank holds:
  // loads map both.
  if (f.kind == FormatKind::kMha)
    return "mha:" + std::string(dtype_name(f.dtype)) + ":" + std::to_string(f.total_heads()) + "x" +
           std::to_string(f.head_dim);
  return f.name();
}

Status check_loadable(const BlockShape& from, const BlockShape& to) {
  if (from.layers != to.layers || from.block_size != to.block_size)
    return {ErrorCode::kInvalidArgument,
            "stored block is " + std::to_string(from.layers) + " layers x " + std::to_string(from.block_size) +
                " tokens but the region's blocks are " + std::to_string(to.layers) + " x " +
                std::to_string(to.block_size) +
                (from.layers == to.layers ? " (a mapped load says which part of it goes into which block)" : "")};
  if (from.format == to.format || convertible(from.format.kind, to.format.kind)) return Status::Ok();
  return {ErrorCode::kUnsupported, "no conversion from the stored format " + from.format.name() + " to the region's " +
                                       to.format.name() +
                                       " (supported: mla_fp8->mla_fp8_ds, mla_bf16->mla_fp8_ds, "
                                       "mla_fp8_ds->mla_bf16, mla_fp8_ds->mla_fp8 when lossless, mla_fp4<->mla_bf16, "
                                       "mla_fp4<->mla_fp8_ds, mla_fp8->mla_fp4, mla_fp4->mla_fp8 when lossless)"};
}

Status check_mappable(const BlockShape& from, const BlockShape& to) {
  auto both = [&] {
    return " (stored: " + geometry_name(from.format, from.layers, from.block_size) +
           "; region: " + geometry_name(to.format, to.layers, to.block_size) + ")";
  };
  if (from.layers != to.layers) return {ErrorCode::kInvalidArgument, "different layer counts" + both()};
  if (!same_entries(from.format, to.format) && !convertible(from.format.kind, to.format.kind)) {
    if (from.format.kind == FormatKind::kMha && to.format.kind == FormatKind::kMha)
      return {ErrorCode::kUnsupported, "MHA caches of another dtype, head size or head count" + both()};
    return {ErrorCode::kUnsupported, "no conversion between these entry formats" + both()};
  }
  if (from.format.kind == FormatKind::kMha && common_heads(from.format, to.format).count() == 0)
    return {ErrorCode::kInvalidArgument, "the stored block holds none of the region's heads" + both()};
  const int64_t a = from.block_size, b = to.block_size;
  if (a < 1 || b < 1 || (a >= b ? a % b : b % a) != 0)
    return {ErrorCode::kUnsupported, "page sizes that do not divide each other" + both()};
  return Status::Ok();
}

OffloadService::OffloadService(BlockIndex& index, std::unique_ptr<Impl> impl) : index_(index), impl_(std::move(impl)) {}
OffloadService::~OffloadService() = default;

Result<std::unique_ptr<OffloadService>> OffloadService::create(BlockIndex& index, Registry& metrics, Options opts) {
  auto impl = std::make_unique<Impl>(index, metrics, opts);
  const PoolAccess pool{index.pool().base(), static_cast<int64_t>(index.pool().capacity()), impl->opts.cpu_threads};
  impl->host = make_host_mover(pool);
  auto device = make_cuda_mover(pool);
  if (device.ok())
    impl->device = std::move(*device);
  else
    impl->no_device = device.status();
  if (opts.use_cuda) {
    if (!impl->device) return impl->no_device;
    // One lane now, so a CUDA problem shows at start rather than on the first save.
    if (Status st = impl->device->prepare(); !st.ok())
      return st.with_context("the offload service's stream and copiers");
  }
  return std::unique_ptr<OffloadService>(new OffloadService(index, std::move(impl)));
}

void OffloadService::set_verify_on_load(bool on) { impl_->verify_on_load.store(on); }

std::vector<Status> OffloadService::save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                         std::span<const int64_t> block_ids, Clock::time_point deadline) {
  const auto t0 = Clock::now();
  Impl& d = *impl_;
  std::vector<Status> res(keys.size());
  if (keys.size() != block_ids.size()) return mismatched_lists("save", keys.size(), block_ids.size());
  const BlockShape shape{region.spec.layers, region.spec.block_size, region.spec.format};
  const uint64_t bb = static_cast<uint64_t>(shape.bytes());
  std::vector<size_t> which;  // indices with a reservation
  std::vector<SaveReservation> resv;
  if (Clock::now() >= deadline) {  // queued past its deadline: nothing is reserved
    for (auto& r : res) r = Impl::timed_out("save");
    d.timeouts.add(res.size());
    d.save_failures.add(res.size());
    return res;
  }
  refuse_duplicates<BlockKey, BlockKeyHash>(keys, &res, "key", [](const BlockKey& k) { return k.hex(); });
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!res[i].ok()) continue;
    if (Status st = region.spec.check_block(block_ids[i]); !st.ok()) {
      res[i] = st;
      continue;
    }
    auto r = d.index.reserve(NsKey{ns, keys[i]}, shape);
    if (!r.ok()) {
      if (r.status().code() != ErrorCode::kAlreadyExists) res[i] = r.status();  // stored already: done
      continue;
    }
    which.push_back(i);
    resv.push_back(*r);
  }
  // Sub-batches of whole blocks. Each block keeps its own runs, so a mover that copies block by
  // block (host) moves it on the thread that then hashes it, while it is in cache; one that moves
  // a sub-batch at once (DMA) merges neighbours across blocks.
  const auto subs = split(resv.size(), bb, d.sub_batch_bytes(bb));
  std::vector<CopyRun> runs;
  std::vector<size_t> run_at(resv.size() + 1, 0);
  for (size_t j = 0; j < resv.size(); ++j) {
    run_at[j] = runs.size();
    push_block_runs(&runs, region.spec, block_ids[which[j]], static_cast<int64_t>(resv[j].slot.offset), true);
  }
  run_at[resv.size()] = runs.size();
  auto runs_of = [&](size_t from, size_t to) {  // the runs of blocks [from, to)
    return std::span<const CopyRun>(runs).subspan(run_at[from], run_at[to] - run_at[from]);
  };
  std::vector<uint64_t> sums(resv.size(), 0);
  std::vector<Status> bst(resv.size());  // per reserved block; ok ones are committed
  double t_enqueue = 0, t_wait = 0, t_hash = 0;
  const double t_prepare = seconds_since(t0);
  const bool hash = d.opts.checksum;
  auto fail_from = [&](size_t k, const Status& st) {
    for (; k < subs.size(); ++k)
      for (size_t j = subs[k].first; j < subs[k].second; ++j) bst[j] = st;
  };
  std::unique_ptr<MoveOp> op;
  if (!subs.empty()) {
    auto o = d.begin(region, true);
    if (o.ok())
      op = std::move(*o);
    else
      fail_from(0, o.status());
  }
  size_t enq = 0;  // sub-batches enqueued
  Status fail;     // why the rest could not be enqueued
  auto try_enqueue = [&] {
    if (!op || enq >= subs.size() || !fail.ok()) return false;
    d.test_delay();
    if (Clock::now() >= deadline) {
      fail = Impl::timed_out("save");
      return false;
    }
    const auto te = Clock::now();
    Status st = op->enqueue(enq, runs_of(subs[enq].first, subs[enq].second));
    t_enqueue += seconds_since(te);
    if (!st.ok()) {
      fail = st;
      return false;
    }
    ++enq;
    return true;
  };
  auto enqueue_to = [&](size_t end) {  // enqueues sub-batches until `end` are
    while (enq < end && try_enqueue()) {
    }
  };
  const size_t depth = op ? static_cast<size_t>(op->depth()) : 0;
  enqueue_to(depth);
  for (size_t k = 0; op && k < subs.size(); ++k) {
    enqueue_to(k + 1);  // a mover of depth 0 starts each sub-batch only now
    if (enq <= k) break;
    const auto tw = Clock::now();
    Status w = op->wait(k);
    t_wait += seconds_since(tw);
    if (!w.ok()) {
      fail_from(k, w);
      if (fail.ok()) fail = w;
      break;
    }
    enqueue_to(k + 1 + depth);  // sub-batch k+depth takes k's place; the copy engine stays busy
    if (Clock::now() >= deadline) {
      fail_from(k, Impl::timed_out("save"));
      enq = subs.size();  // nothing below is enqueued any more
      break;
    }
    if (hash || op->by_block()) {
      const auto th = Clock::now();
      d.hashers->parallel_for(subs[k].second - subs[k].first, bb, [&](size_t i) {
        const size_t j = subs[k].first + i;
        bst[j] = op->move_block(runs_of(j, j + 1));
        if (bst[j].ok() && hash) sums[j] = block_checksum(resv[j].data, resv[j].bytes);
      });
      t_hash += seconds_since(th);
    }
  }
  if (op) {
    if (enq < subs.size()) fail_from(enq, fail.ok() ? Impl::timed_out("save") : fail);
    const auto tw = Clock::now();
    (void)op->finish();  // after a failure or a timeout: no slot is freed under a running copy
    t_wait += seconds_since(tw);
  }
  uint64_t committed = 0;
  for (size_t j = 0; j < resv.size(); ++j) {
    if (bst[j].ok()) {
      d.index.commit(resv[j], sums[j]);
      ++committed;
    } else {
      d.index.abort(resv[j]);
      res[which[j]] = bst[j];
      if (bst[j].code() == ErrorCode::kTimeout) d.timeouts.add();
    }
  }
  d.saved_blocks.add(committed);
  d.saved_bytes.add(committed * bb);
  for (const Status& s : res)
    if (!s.ok()) d.save_failures.add();
  const double total = seconds_since(t0);
  d.save_phase.prepare->add(micros(t_prepare));
  d.save_phase.enqueue->add(micros(t_enqueue));
  d.save_phase.dma_wait->add(micros(t_wait));
  d.save_phase.hash->add(micros(t_hash));
  d.save_phase.total->add(micros(total));
  d.save_seconds.observe(total);
  return res;
}

std::vector<Status> OffloadService::load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                         std::span<const int64_t> block_ids, Clock::time_point deadline,
                                         std::span<const uint8_t> verified) {
  const auto t0 = Clock::now();
  Impl& d = *impl_;
  std::vector<Status> res(keys.size());
  if (keys.size() != block_ids.size()) return mismatched_lists("load", keys.size(), block_ids.size());
  const BlockShape target{region.spec.layers, region.spec.block_size, region.spec.format};
  std::vector<size_t> which, remap;
  std::vector<Hold> holds;
  refuse_duplicates<int64_t>(block_ids, &res, "target block", [](const int64_t& b) { return std::to_string(b); });
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!res[i].ok()) continue;
    if (Status st = region.spec.check_block(block_ids[i]); !st.ok()) {
      res[i] = st;
      continue;
    }
    auto h = d.index.acquire(NsKey{ns, keys[i]});
    if (!h.ok()) {
      res[i] = h.status();
      d.load_misses.add();
      continue;
    }
    if (Status st = check_loadable(h->meta.shape, target); !st.ok()) {
      // Another head slice or order of the same pages: a one-to-one mapped load.
      if (h->meta.shape.block_size == target.block_size && check_mappable(h->meta.shape, target).ok())
        remap.push_back(i);
      else
        res[i] = st;
      d.index.release(*h);
      continue;
    }
    which.push_back(i);
    holds.push_back(*h);
  }
  const bool verify = d.opts.checksum && d.verify_on_load.load();
  std::vector<uint8_t> bad(holds.size(), 0);
  std::vector<size_t> direct, convert;
  for (size_t j = 0; j < holds.size(); ++j)
    (holds[j].meta.shape.format == target.format ? direct : convert).push_back(j);
  const uint64_t bb = static_cast<uint64_t>(target.bytes());
  const auto subs = split(direct.size(), bb, d.sub_batch_bytes(bb));
  // Each direct block's own runs (block i of `direct`), as in a save.
  std::vector<CopyRun> runs;
  std::vector<size_t> run_at(direct.size() + 1, 0);
  for (size_t i = 0; i < direct.size(); ++i) {
    const size_t j = direct[i];
    run_at[i] = runs.size();
    push_block_runs(&runs, region.spec, block_ids[which[j]], static_cast<int64_t>(holds[j].slot.offset), false);
  }
  run_at[direct.size()] = runs.size();
  auto runs_of = [&](size_t i) { return std::span<const CopyRun>(runs).subspan(run_at[i], run_at[i + 1] - run_at[i]); };
  std::vector<Status> bst(holds.size());
  double t_enqueue = 0, t_wait = 0, t_hash = 0;
  const double t_prepare = seconds_since(t0);
  auto fail_from = [&](size_t k, const Status& st) {
    for (; k < subs.size(); ++k)
      for (size_t i = subs[k].first; i < subs[k].second; ++i) bst[direct[i]] = st;
  };
  auto check = [&](size_t j) {  // a damaged copy is reported and dropped, never copied
    if (!verify || (which[j] < verified.size() && verified[which[j]])) return;
    if (block_checksum(holds[j].data, holds[j].meta.bytes) != holds[j].meta.checksum) bad[j] = 1;
  };
  std::unique_ptr<MoveOp> op;
  if (!holds.empty()) {
    auto o = d.begin(region, false);
    if (o.ok())
      op = std::move(*o);
    else
      for (auto& s : bst) s = o.status();
  }
  std::vector<CopyRun> kept;  // a sub-batch's runs without its damaged blocks
  for (size_t k = 0; op && k < subs.size(); ++k) {
    d.test_delay();
    if (Clock::now() >= deadline) {
      fail_from(k, Impl::timed_out("load"));
      break;
    }
    // Verify sub-batch k while k-1 (enqueued last round) is being copied; a mover that copies
    // block by block copies each block right after its check, while it is in cache.
    const auto th = Clock::now();
    if (verify || op->by_block())
      d.hashers->parallel_for(subs[k].second - subs[k].first, bb, [&](size_t i) {
        const size_t j = direct[subs[k].first + i];
        check(j);
        if (!bad[j]) bst[j] = op->move_block(runs_of(subs[k].first + i));
      });
    t_hash += seconds_since(th);
    kept.clear();
    for (size_t i = subs[k].first; i < subs[k].second; ++i) {
      if (bad[direct[i]]) continue;
      const auto r = runs_of(i);
      kept.insert(kept.end(), r.begin(), r.end());
    }
    if (kept.empty()) continue;
    const auto te = Clock::now();
    Status st = op->enqueue(k, kept);
    t_enqueue += seconds_since(te);
    if (!st.ok()) {
      fail_from(k, st);
      break;
    }
  }
  if (op) {
    const auto tw = Clock::now();
    Status st = op->finish();
    t_wait += seconds_since(tw);
    if (!st.ok())
      for (size_t j : direct)
        if (bst[j].ok()) bst[j] = st;
  }
  for (size_t j : convert) {
    if (!bst[j].ok()) continue;  // also when no op could start: every block has its status
    if (Clock::now() >= deadline) {
      bst[j] = Impl::timed_out("load");
      continue;
    }
    check(j);
    if (bad[j]) continue;
    const Hold& h = holds[j];
    std::vector<CopyRun> cr;  // from a one-block buffer in the slot layout
    push_block_runs(&cr, region.spec, block_ids[which[j]], 0, false);
    std::vector<int64_t> lossy;
    Status st = op->convert_block(h.data, h.meta.shape, cr, &lossy);
    if (st.ok() && !lossy.empty())
      st = {ErrorCode::kDataLoss, "stored block " + keys[which[j]].hex() + " is not losslessly representable as " +
                                      target.format.name() + "; recompute it"};
    bst[j] = st;
    if (st.ok()) d.converted.add();
  }
  for (size_t j = 0; j < holds.size(); ++j) {
    d.index.release(holds[j]);
    if (bad[j]) {
      res[which[j]] = {ErrorCode::kChecksumMismatch,
                       "stored block " + keys[which[j]].hex() + " failed its checksum; it was dropped"};
      d.checksum_failures.add();
      (void)d.index.evict(ns, std::span<const BlockKey>(&keys[which[j]], 1));
    } else {
      res[which[j]] = bst[j];
      if (bst[j].ok()) {
        d.loaded_blocks.add();
        d.loaded_bytes.add(holds[j].meta.bytes);
      } else if (bst[j].code() == ErrorCode::kTimeout) {
        d.timeouts.add();
      }
    }
  }
  if (!remap.empty()) {
    std::vector<BlockKey> rk;
    std::vector<int64_t> rb;
    std::vector<uint8_t> rv;
    for (size_t i : remap) {
      rk.push_back(keys[i]);
      rb.push_back(block_ids[i]);
      rv.push_back(i < verified.size() ? verified[i] : 0);
    }
    const std::vector<int32_t> parts(remap.size(), 0);
    auto r = load_mapped(region, ns, rk, rb, parts, deadline, rv);
    for (size_t j = 0; j < remap.size(); ++j) res[remap[j]] = std::move(r[j]);
  }
  const double total = seconds_since(t0);
  d.load_phase.prepare->add(micros(t_prepare));
  d.load_phase.enqueue->add(micros(t_enqueue));
  d.load_phase.dma_wait->add(micros(t_wait));
  d.load_phase.hash->add(micros(t_hash));
  d.load_phase.total->add(micros(total));
  d.load_seconds.observe(total);
  return res;
}

}  // namespace kvferry::store
