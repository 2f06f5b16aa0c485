// Mapped loads (OffloadService::load_mapped): region blocks assembled from parts of stored blocks
// of another page size, head slice or format, moved directly, as pitched copies or staged on the host.
#include "offload_impl.h"

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <unordered_map>

#include "kvferry/layouts/geometry.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"

namespace kvferry::store {

/// Copies into pinned staging that the copy engines read next: streaming stores where the
/// destination is 16-byte aligned (no read of the destination's cache lines, nothing left in
/// cache that the CPU does not read again), memcpy otherwise.
void stream_copy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && n >= 256) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

/// Mapped loads into device regions: runs averaging less than this go through host staging in
/// sub-batches of kStageSubBatch (CopyEngine's own crossover is 256 KiB; a 16-token page of a
/// layer is 9-18 KiB, a token's head slice 1 KiB).
constexpr int64_t kStageBelowRun = int64_t{64} << 10;
constexpr int64_t kStageSubBatch = int64_t{32} << 20;

std::vector<Status> OffloadService::load_mapped(const RegionAccess& region, NamespaceId ns,
                                                std::span<const BlockKey> keys, std::span<const int64_t> block_ids,
                                                std::span<const int32_t> parts, Clock::time_point deadline,
                                                std::span<const uint8_t> verified) {
  const auto t0 = Clock::now();
  Impl& d = *impl_;
  const size_t n = keys.size();
  if (block_ids.size() != n) return mismatched_lists("mapped load", n, block_ids.size());
  if (parts.size() != n)
    return std::vector<Status>(
        n, Status(ErrorCode::kInvalidArgument,
                  "mapped load: " + std::to_string(n) + " keys but " + std::to_string(parts.size()) + " parts"));
  std::vector<Status> res(n);
  const BlockShape target{region.spec.layers, region.spec.block_size, region.spec.format};
  const KvCacheSpec one = target.slot_spec();  // a region block alone, as it is assembled on the host
  const bool verify = d.opts.checksum && d.verify_on_load.load();

  // Each stored block once, held for the whole call; a key may feed several region blocks.
  struct Source {
    Hold hold;
    Status st;  // why it cannot be used (a miss, ...)
    bool held = false, checked = false, bad = false, trusted = false;
  };
  std::vector<Source> srcs;
  std::vector<size_t> src_of(n, 0);
  {
    std::unordered_map<BlockKey, size_t, BlockKeyHash> at;
    for (size_t i = 0; i < n; ++i) {
      auto [it, fresh] = at.emplace(keys[i], srcs.size());
      src_of[i] = it->second;
      if (!fresh) {
        srcs[it->second].trusted = srcs[it->second].trusted && i < verified.size() && verified[i];
        continue;
      }
      Source src;
      src.trusted = i < verified.size() && verified[i];
      auto h = d.index.acquire(NsKey{ns, keys[i]});
      if (h.ok()) {
        src.hold = *h;
        src.held = true;
      } else {
        src.st = h.status();
        d.load_misses.add();
      }
      srcs.push_back(std::move(src));
    }
  }
  // Where each entry's tokens go, and whether its stored block needs a format conversion first.
  std::vector<TokenSpan> span(n);
  std::vector<uint8_t> conv(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (Status st = region.spec.check_block(block_ids[i]); !st.ok()) {
      res[i] = st;
      continue;
    }
    const Source& src = srcs[src_of[i]];
    if (!src.held) {
      res[i] = src.st;
      continue;
    }
    const BlockShape& from = src.hold.meta.shape;
    if (Status st = check_mappable(from, target); !st.ok()) {
      res[i] = st.with_context("stored block " + keys[i].hex());
      continue;
    }
    auto sp = token_span(from.block_size, target.block_size, parts[i]);
    if (!sp.ok()) {
      res[i] = sp.status().with_context("stored block " + keys[i].hex());
      continue;
    }
    span[i] = *sp;
    conv[i] = from.format == target.format || same_entries(from.format, target.format) ? 0 : 1;
  }
  // Region blocks, in order of first mention, with their entries.
  struct Group {
    int64_t block = 0;
    std::vector<size_t> entries;
    Status st;
    bool convert = false;
  };
  std::vector<Group> groups;
  {
    std::unordered_map<int64_t, size_t> at;
    for (size_t i = 0; i < n; ++i) {
      if (region.spec.check_block(block_ids[i]).ok()) {
        auto [it, fresh] = at.emplace(block_ids[i], groups.size());
        if (fresh) groups.push_back(Group{block_ids[i], {}, Status::Ok(), false});
        groups[it->second].entries.push_back(i);
      }
    }
  }
  const bool mha = target.format.kind == FormatKind::kMha;
  const int64_t need = target.block_size * (mha ? target.format.heads : 1);
  auto fail_group = [&](Group& g, size_t cause, const Status& why) {
    if (!g.st.ok()) return;
    g.st = Status(why.code(), "region block " + std::to_string(g.block) + " was not loaded: entry " +
                                  std::to_string(cause) + " (stored block " + keys[cause].hex() + ", part " +
                                  std::to_string(parts[cause]) + "): " + why.message());
  };
  for (Group& g : groups) {
    for (size_t i : g.entries)
      if (!res[i].ok()) fail_group(g, i, res[i]);
    if (!g.st.ok()) continue;
    // Coverage: each token (and head) of the region block exactly once.
    int64_t covered = 0;
    for (size_t a = 0; a < g.entries.size() && g.st.ok(); ++a) {
      const size_t i = g.entries[a];
      const HeadRange hi = mha ? common_heads(srcs[src_of[i]].hold.meta.shape.format, target.format) : HeadRange{0, 1};
      covered += span[i].tokens * hi.count();
      g.convert = g.convert || conv[i];
      for (size_t b = 0; b < a; ++b) {
        const size_t j = g.entries[b];
        const HeadRange hj =
            mha ? common_heads(srcs[src_of[j]].hold.meta.shape.format, target.format) : HeadRange{0, 1};
        const bool tokens = span[i].dst_token < span[j].dst_token + span[j].tokens &&
                            span[j].dst_token < span[i].dst_token + span[i].tokens;
        const bool heads = std::max(hi.first, hj.first) < std::min(hi.end, hj.end);
        if (tokens && heads)
          fail_group(
              g, i,
              Status(ErrorCode::kInvalidArgument,
                     "it overlaps entry " + std::to_string(j) + " (tokens [" + std::to_string(span[i].dst_token) +
                         ", " + std::to_string(span[i].dst_token + span[i].tokens) + ") of the region block twice)"));
      }
    }
    if (g.st.ok() && covered != need)
      fail_group(g, g.entries.front(),
                 Status(ErrorCode::kInvalidArgument, "the request fills " + std::to_string(covered) + " of its " +
                                                         std::to_string(need) + (mha ? " token-heads" : " tokens") +
                                                         "; name the stored blocks of every part"));
  }
  std::vector<size_t> direct, staged;  // indices into groups: moved as they are, or converted first
  // Checks a stored block's bytes once (not when the caller vouched for them).
  auto verify_source = [&](Source& src) {
    if (src.checked) return;
    src.checked = true;
    if (verify && !src.trusted && block_checksum(src.hold.data, src.hold.meta.bytes) != src.hold.meta.checksum)
      src.bad = true;
  };
  // Verifies the stored blocks `which` (marked checked already) on the hashing pool.
  auto check_sources = [&](std::vector<size_t>& which) {
    if (!verify || which.empty()) return;
    d.hashers->parallel_for(which.size(), target.bytes(), [&](size_t k) {
      Source& src = srcs[which[k]];
      if (block_checksum(src.hold.data, src.hold.meta.bytes) != src.hold.meta.checksum) src.bad = true;
    });
  };
  // When each of the region blocks direct[from, to) comes from one stored block (pages split, a
  // head slice taken): the stored blocks in order of first use, each with its region blocks (their
  // index q into `direct`), so that a thread verifies a stored block and then moves its region
  // blocks while the block is in cache. Empty when some region block has several stored blocks.
  struct BySource {
    std::vector<size_t> order;
    std::unordered_map<size_t, std::vector<size_t>> blocks;
  };
  auto by_source = [&](size_t from, size_t to, BySource* out) {
    for (size_t q = from; q < to; ++q)
      for (size_t i : groups[direct[q]].entries)
        if (src_of[i] != src_of[groups[direct[q]].entries[0]]) return false;
    for (size_t q = from; q < to; ++q) {
      if (!groups[direct[q]].st.ok()) continue;
      auto [it, fresh] = out->blocks.try_emplace(src_of[groups[direct[q]].entries[0]]);
      if (fresh) out->order.push_back(it->first);
      it->second.push_back(q);
    }
    return true;
  };
  // Fails region blocks direct[from, end) that have not failed yet with `st`.
  auto fail_direct_from = [&](size_t from, const Status& st) {
    for (size_t q = from; q < direct.size(); ++q) fail_group(groups[direct[q]], groups[direct[q]].entries.front(), st);
  };
  auto group_bad = [&](Group& g) {
    for (size_t i : g.entries)
      if (srcs[src_of[i]].bad) {
        fail_group(g, i, Status(ErrorCode::kChecksumMismatch, "it failed its checksum; it was dropped"));
        return true;
      }
    return false;
  };
  auto sources_of = [&](size_t from, size_t to, const std::vector<size_t>& gi) {  // unchecked sources of groups
    std::vector<size_t> which;
    for (size_t k = from; k < to; ++k)
      for (size_t i : groups[gi[k]].entries) {
        Source& src = srcs[src_of[i]];
        if (src.checked) continue;
        src.checked = true;
        if (!src.trusted) which.push_back(src_of[i]);
      }
    return which;
  };
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].st.ok()) (groups[g].convert ? staged : direct).push_back(g);

  std::unique_ptr<MoveOp> op;
  if (!direct.empty() || !staged.empty()) {
    auto o = d.begin(region, false);
    if (o.ok())
      op = std::move(*o);
    else
      for (Group& g : groups) fail_group(g, g.entries.front(), o.status());
  }
  // Direct groups: runs from the stored blocks' slots straight into the region, in sub-batches;
  // sub-batch k's stored blocks are verified while k-1 is being copied.
  const uint64_t bb = static_cast<uint64_t>(target.bytes());
  const auto subs = split(direct.size(), bb, d.sub_batch_bytes(bb));
  std::vector<CopyRun> runs, kept;
  std::vector<size_t> run_at(direct.size() + 1, 0);
  for (size_t k = 0; op && k < direct.size(); ++k) {
    Group& g = groups[direct[k]];
    run_at[k] = runs.size();
    for (size_t i : g.entries) {
      const Source& src = srcs[src_of[i]];
      const BlockShape& from = src.hold.meta.shape;
      const KvCacheSpec sspec = from.slot_spec();
      const size_t floor = runs.size();
      Status st = push_token_runs(&runs, sspec, 0, span[i].src_token, region.spec, g.block, span[i].dst_token,
                                  span[i].tokens, static_cast<int64_t>(src.hold.slot.offset), 0);
      if (!st.ok()) {
        runs.resize(floor);
        fail_group(g, i, st);
      }
    }
  }
  run_at[direct.size()] = runs.size();
  // Copy engines lose most of their rate on runs of a few KiB (a 16-token page of a layer, one
  // token's heads): the CUDA mover then gets each sub-batch assembled on the host, region block
  // by region block in the slot layout, by the hashing threads right after they verify the
  // stored block, and moves it with one run per block.
  int64_t run_bytes = 0;
  for (const CopyRun& r : runs) run_bytes += r.bytes;
  const int64_t mean_run = runs.empty() ? 0 : run_bytes / static_cast<int64_t>(runs.size());
  // Small runs that repeat at a constant stride into pitched copies of at least the copy
  // engines' crossover each (an HND head slice's layers and planes) go as 2-D copies instead.
  bool pitched = false;
  if (op && !op->by_block() && !runs.empty() && mean_run < kStageBelowRun) {
    const auto folded = fold_2d(runs);
    pitched = run_bytes / static_cast<int64_t>(folded.size()) >= kernels::kCopyAutoThreshold;
  }
  const bool staged_dma = op && !op->by_block() && !runs.empty() && mean_run < kStageBelowRun && !pitched;
  if (staged_dma) {
    const size_t per = static_cast<size_t>(std::max<int64_t>(1, kStageSubBatch / std::max<int64_t>(1, target.bytes())));
    uint8_t* const pool = d.index.pool().base();
    for (size_t k = 0, a = 0; a < direct.size(); ++k, a += per) {
      const size_t b = std::min(direct.size(), a + per);
      d.test_delay();
      if (Clock::now() >= deadline) {
        fail_direct_from(a, Impl::timed_out("load"));
        break;
      }
      auto buf = op->staging(k, static_cast<int64_t>(b - a) * target.bytes());
      if (!buf.ok()) {
        fail_direct_from(a, buf.status());
        break;
      }
      std::vector<uint8_t> go(b - a, 0);
      BySource bs;
      const bool fused = by_source(a, b, &bs);
      if (!fused) {
        auto which = sources_of(a, b, direct);
        check_sources(which);
      }
      auto assemble = [&](size_t x) {
        Group& g = groups[direct[a + x]];
        if (!g.st.ok() || group_bad(g)) return;
        std::vector<CopyRun> cr;
        const int64_t at = static_cast<int64_t>(x) * target.bytes();
        for (size_t i : g.entries) {
          const Source& src = srcs[src_of[i]];
          Status st =
              push_token_runs(&cr, src.hold.meta.shape.slot_spec(), 0, span[i].src_token, one, 0, span[i].dst_token,
                              span[i].tokens, static_cast<int64_t>(src.hold.slot.offset), at);
          if (!st.ok()) {
            fail_group(g, i, st);
            return;
          }
        }
        for (const CopyRun& r : cr) stream_copy(*buf + r.dst, pool + r.src, static_cast<size_t>(r.bytes));
#if defined(__SSE2__)
        _mm_sfence();  // this thread's streamed bytes are in memory before the copy engines read them
#endif
        go[x] = 1;
      };
      if (fused) {
        d.hashers->parallel_for(bs.order.size(), bb, [&](size_t y) {
          verify_source(srcs[bs.order[y]]);
          for (size_t q : bs.blocks.at(bs.order[y])) assemble(q - a);
        });
      } else {
        d.hashers->parallel_for(b - a, bb, assemble);
      }
      std::vector<CopyRun> dma;
      for (size_t x = 0; x < b - a; ++x)
        if (go[x] && groups[direct[a + x]].st.ok())
          push_block_runs(&dma, region.spec, groups[direct[a + x]].block, static_cast<int64_t>(x) * target.bytes(),
                          false);
      if (dma.empty()) continue;
      if (Status st = op->enqueue_staged(k, dma); !st.ok()) {
        fail_direct_from(a, st);
        break;
      }
    }
  }
  for (size_t k = 0; op && !staged_dma && k < subs.size(); ++k) {
    d.test_delay();
    if (Clock::now() >= deadline) {
      fail_direct_from(subs[k].first, Impl::timed_out("load"));
      break;
    }
    // A host mover copies each stored block into its region blocks right after verifying it.
    BySource bs;
    if (op->by_block() && by_source(subs[k].first, subs[k].second, &bs)) {
      d.hashers->parallel_for(bs.order.size(), bb, [&](size_t x) {
        verify_source(srcs[bs.order[x]]);
        for (size_t q : bs.blocks.at(bs.order[x])) {
          Group& g = groups[direct[q]];
          if (group_bad(g)) continue;
          Status st = op->move_block(std::span<const CopyRun>(runs).subspan(run_at[q], run_at[q + 1] - run_at[q]));
          if (!st.ok()) fail_group(g, g.entries.front(), st);
        }
      });
      continue;
    }
    auto which = sources_of(subs[k].first, subs[k].second, direct);
    check_sources(which);
    kept.clear();
    std::vector<size_t> go;
    for (size_t q = subs[k].first; q < subs[k].second; ++q) {
      Group& g = groups[direct[q]];
      if (!g.st.ok() || group_bad(g)) continue;
      go.push_back(q);
      kept.insert(kept.end(), runs.begin() + static_cast<std::ptrdiff_t>(run_at[q]),
                  runs.begin() + static_cast<std::ptrdiff_t>(run_at[q + 1]));
    }
    if (op->by_block()) {
      d.hashers->parallel_for(go.size(), bb, [&](size_t x) {
        const size_t q = go[x];
        Status st = op->move_block(std::span<const CopyRun>(runs).subspan(run_at[q], run_at[q + 1] - run_at[q]));
        if (!st.ok()) fail_group(groups[direct[q]], groups[direct[q]].entries.front(), st);
      });
    } else if (!kept.empty()) {
      if (Status st = pitched ? op->enqueue_2d(k, fold_2d(kept)) : op->enqueue(k, kept); !st.ok()) {
        fail_direct_from(subs[k].first, st);
        break;
      }
    }
  }
  if (op && !direct.empty()) {
    if (Status st = op->finish(); !st.ok())
      for (size_t q : direct) fail_group(groups[q], groups[q].entries.front(), st);
  }
  // Groups with a conversion: assembled on the host (each stored block converted into the
  // region's format at its own geometry, then mapped), then placed whole.
  std::vector<uint8_t> block_buf, conv_buf;
  for (size_t q : staged) {
    Group& g = groups[q];
    if (!op || !g.st.ok()) continue;
    if (Clock::now() >= deadline) {
      fail_group(g, g.entries.front(), Impl::timed_out("load"));
      continue;
    }
    auto which = sources_of(0, 1, std::vector<size_t>{q});
    check_sources(which);
    if (group_bad(g)) continue;
    block_buf.assign(static_cast<size_t>(one.region_bytes()), 0);
    for (size_t i : g.entries) {
      if (!g.st.ok()) break;
      const Source& src = srcs[src_of[i]];
      const BlockShape& from = src.hold.meta.shape;
      const uint8_t* sbase = src.hold.data;
      KvCacheSpec sspec = from.slot_spec();
      if (conv[i]) {
        const KvCacheSpec cspec{from.layers, 1, from.block_size, target.format, Layout::kBlockMajor};
        conv_buf.assign(static_cast<size_t>(cspec.region_bytes()), 0);
        std::vector<int64_t> lossy;
        const int64_t zero = 0;
        Status st = kernels::convert_blocks_cpu(sbase, sspec, {&zero, 1}, conv_buf.data(), cspec, {&zero, 1},
                                                {d.opts.cpu_threads}, &lossy);
        if (st.ok() && !lossy.empty())
          st = {ErrorCode::kDataLoss,
                "it is not losslessly representable as " + target.format.name() + "; recompute it"};
        if (!st.ok()) {
          fail_group(g, i, st);
          break;
        }
        sbase = conv_buf.data();
        sspec = cspec;
      }
      std::vector<CopyRun> cr;
      Status st = push_token_runs(&cr, sspec, 0, span[i].src_token, one, 0, span[i].dst_token, span[i].tokens);
      if (st.ok())
        st = kernels::copy_blocks_cpu(sbase, sspec.region_bytes(), block_buf.data(), one.region_bytes(), cr, {1});
      if (!st.ok()) fail_group(g, i, st);
    }
    if (!g.st.ok()) continue;
    std::vector<CopyRun> place;
    push_block_runs(&place, region.spec, g.block, 0, false);
    if (Status st = op->place_block(block_buf.data(), one.region_bytes(), place); !st.ok())
      fail_group(g, g.entries.front(), st);
    else
      d.converted.add();
  }
  op.reset();  // waits for its copies before the holds go
  // Damaged stored blocks are dropped; holds released; every entry gets its region block's status.
  for (size_t k = 0; k < srcs.size(); ++k) {
    Source& src = srcs[k];
    if (!src.held) continue;
    d.index.release(src.hold);
    if (src.bad) {
      d.checksum_failures.add();
      (void)d.index.evict(ns, std::span<const BlockKey>(&src.hold.key.key, 1));
    }
  }
  for (const Group& g : groups) {
    for (size_t i : g.entries) res[i] = g.st;
    if (g.st.ok()) {
      d.loaded_blocks.add();
      d.loaded_bytes.add(bb);
      d.remapped.add();
    } else if (g.st.code() == ErrorCode::kTimeout) {
      d.timeouts.add();
    }
  }
  d.load_seconds.observe(seconds_since(t0));
  return res;
}

}  // namespace kvferry::store
