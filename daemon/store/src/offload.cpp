#include "kvferry/store/offload.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry::store {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs fn(i) for i in [0, n) on up to `threads` threads; small batches stay on the caller.
template <class Fn>
void parallel_for(size_t n, int threads, uint64_t bytes_per_item, Fn&& fn) {
  const size_t want = std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), n);
  if (want <= 1 || n * bytes_per_item < (size_t{4} << 20)) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> ts;
  ts.reserve(want - 1);
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  for (size_t t = 1; t < want; ++t) ts.emplace_back(work);
  work();
  for (auto& t : ts) t.join();
}

bool convertible(FormatKind from, FormatKind to) {
  using K = FormatKind;
  return (from == K::kMlaFp8 && to == K::kMlaFp8Ds) || (from == K::kMlaBf16 && to == K::kMlaFp8Ds) ||
         (from == K::kMlaFp8Ds && to == K::kMlaBf16) || (from == K::kMlaFp8Ds && to == K::kMlaFp8);
}

// Appends the runs that move one block of `spec` (all layers) to/from a contiguous slot at
// `slot_offset` (slot side block-major). `to_slot` picks the direction.
void push_block_runs(std::vector<CopyRun>* runs, const KvCacheSpec& spec, int64_t block, int64_t slot_offset,
                     bool to_slot) {
  auto merge_push = [runs](int64_t s, int64_t d, int64_t n) {
    if (!runs->empty() && runs->back().src + runs->back().bytes == s && runs->back().dst + runs->back().bytes == d)
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

// Every block of a request whose key and block-id lists differ in length gets the same error.
std::vector<Status> mismatched_lists(const char* op, size_t keys, size_t ids) {
  return std::vector<Status>(
      keys, Status(ErrorCode::kInvalidArgument,
                   std::string(op) + ": " + std::to_string(keys) + " keys but " + std::to_string(ids) + " block ids"));
}

}  // namespace

std::string format_family(const EntryFormat& f) { return f.is_mla() ? std::string("mla") : f.name(); }

Status check_loadable(const BlockShape& from, const BlockShape& to) {
  if (from.layers != to.layers || from.block_size != to.block_size)
    return {ErrorCode::kInvalidArgument, "stored block is " + std::to_string(from.layers) + " layers x " +
                                             std::to_string(from.block_size) + " tokens but the region's blocks are " +
                                             std::to_string(to.layers) + " x " + std::to_string(to.block_size)};
  if (from.format == to.format || convertible(from.format.kind, to.format.kind)) return Status::Ok();
  return {ErrorCode::kUnsupported, "no conversion from the stored format " + from.format.name() + " to the region's " +
                                       to.format.name() +
                                       " (supported: mla_fp8->mla_fp8_ds, mla_bf16->mla_fp8_ds, "
                                       "mla_fp8_ds->mla_bf16, mla_fp8_ds->mla_fp8 when lossless)"};
}

struct OffloadService::Impl {
  Impl(BlockIndex& idx, Registry& m, Options o)
      : index(idx),
        opts(o),
        saved_blocks(m.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"host\"")),
        saved_bytes(m.counter("kvferry_bytes_saved_total", "Bytes saved", "tier=\"host\"")),
        loaded_blocks(m.counter("kvferry_blocks_loaded_total", "Blocks loaded", "tier=\"host\"")),
        loaded_bytes(m.counter("kvferry_bytes_loaded_total", "Bytes loaded", "tier=\"host\"")),
        load_misses(m.counter("kvferry_load_misses_total", "Loads of blocks that were not stored")),
        converted(m.counter("kvferry_blocks_converted_total", "Blocks converted to another format on load")),
        checksum_failures(m.counter("kvferry_checksum_failures_total", "Stored blocks whose checksum did not match")),
        save_failures(m.counter("kvferry_save_failures_total", "Blocks that could not be saved")),
        save_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"save\"")),
        load_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"load\"")) {
    if (opts.cpu_threads <= 0)
      opts.cpu_threads = static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency())));
  }
  ~Impl() {
#if defined(KVFERRY_WITH_CUDA)
    if (staging) cudaFreeHost(staging);
    if (stream) cudaStreamDestroy(stream);
#endif
  }

  BlockIndex& index;
  Options opts;
  Counter &saved_blocks, &saved_bytes, &loaded_blocks, &loaded_bytes, &load_misses, &converted, &checksum_failures,
      &save_failures;
  Histogram &save_seconds, &load_seconds;

  // Copies `runs` from src to dst (whole-region extents for validation). Device copies go through
  // the copier's DMA on the service's stream and are complete when this returns.
  Status copy(const RegionAccess& region, bool to_pool, std::span<const CopyRun> runs) {
    uint8_t* pool = pool_base;
    const int64_t pool_bytes = static_cast<int64_t>(pool_capacity);
    const int64_t region_bytes = region.spec.region_bytes();
    if (!region.device) {
      return to_pool ? kernels::copy_blocks_cpu(region.base, region_bytes, pool, pool_bytes, runs, {opts.cpu_threads})
                     : kernels::copy_blocks_cpu(pool, pool_bytes, region.base, region_bytes, runs, {opts.cpu_threads});
    }
#if defined(KVFERRY_WITH_CUDA)
    if (!copier) return {ErrorCode::kUnavailable, "device region but the service was started without CUDA"};
    KVFERRY_TRY(
        kernels::validate_copy_runs(runs, to_pool ? region_bytes : pool_bytes, to_pool ? pool_bytes : region_bytes));
    std::lock_guard lk(dev_mu);
    KVFERRY_TRY(copy_device_locked(to_pool ? static_cast<const void*>(region.base) : pool,
                                   to_pool ? static_cast<void*>(pool) : region.base, runs));
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(stream));
    return Status::Ok();
#else
    return {ErrorCode::kUnavailable, "device region but kvferry was built without CUDA"};
#endif
  }

#if defined(KVFERRY_WITH_CUDA)
  // The copier takes at most max_runs per call.
  Status copy_device_locked(const void* src, void* dst, std::span<const CopyRun> runs) {
    for (size_t i = 0; i < runs.size(); i += static_cast<size_t>(kMaxRuns)) {
      const size_t n = std::min(runs.size() - i, static_cast<size_t>(kMaxRuns));
      KVFERRY_TRY(copier->copy(src, dst, runs.subspan(i, n), kernels::CopyEngine::kDma, stream));
    }
    return Status::Ok();
  }
  static constexpr int64_t kMaxRuns = 8192;
  std::mutex dev_mu;
  cudaStream_t stream = nullptr;
  std::unique_ptr<kernels::BlockCopier> copier;
  uint8_t* staging = nullptr;  // pinned host staging for converted loads into device regions
  int64_t staging_bytes = 0;
#endif

  uint8_t* pool_base = nullptr;
  uint64_t pool_capacity = 0;
};

OffloadService::OffloadService(BlockIndex& index, std::unique_ptr<Impl> impl) : index_(index), impl_(std::move(impl)) {}
OffloadService::~OffloadService() = default;

Result<std::unique_ptr<OffloadService>> OffloadService::create(BlockIndex& index, Registry& metrics, Options opts) {
  auto impl = std::make_unique<Impl>(index, metrics, opts);
  impl->pool_base = index.pool().base();
  impl->pool_capacity = index.pool().capacity();
  if (opts.use_cuda) {
#if defined(KVFERRY_WITH_CUDA)
    KVFERRY_CUDA_TRY(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
    KVFERRY_ASSIGN_OR_RETURN(impl->copier, kernels::BlockCopier::create(Impl::kMaxRuns));
#else
    return Result<std::unique_ptr<OffloadService>>(ErrorCode::kUnavailable, "kvferry was built without CUDA");
#endif
  }
  return std::unique_ptr<OffloadService>(new OffloadService(index, std::move(impl)));
}

std::vector<Status> OffloadService::save(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                         std::span<const int64_t> block_ids) {
  const auto t0 = Clock::now();
  std::vector<Status> res(keys.size());
  if (keys.size() != block_ids.size()) return mismatched_lists("save", keys.size(), block_ids.size());
  const BlockShape shape{region.spec.layers, region.spec.block_size, region.spec.format};
  std::vector<size_t> which;  // indices with a reservation
  std::vector<SaveReservation> resv;
  std::vector<CopyRun> runs;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (Status st = region.spec.check_block(block_ids[i]); !st.ok()) {
      res[i] = st;
      continue;
    }
    auto r = impl_->index.reserve(NsKey{ns, keys[i]}, shape);
    if (!r.ok()) {
      if (r.status().code() != ErrorCode::kAlreadyExists) res[i] = r.status();  // stored already: done
      continue;
    }
    push_block_runs(&runs, region.spec, block_ids[i], static_cast<int64_t>(r->slot.offset), true);
    which.push_back(i);
    resv.push_back(*r);
  }
  Status copied = runs.empty() ? Status::Ok() : impl_->copy(region, true, runs);
  if (!copied.ok()) {
    for (size_t j = 0; j < resv.size(); ++j) {
      impl_->index.abort(resv[j]);
      res[which[j]] = copied;
    }
  } else {
    std::vector<uint64_t> sums(resv.size(), 0);
    if (impl_->opts.checksum)
      parallel_for(resv.size(), impl_->opts.cpu_threads, static_cast<uint64_t>(shape.bytes()),
                   [&](size_t j) { sums[j] = block_checksum(resv[j].data, resv[j].bytes); });
    for (size_t j = 0; j < resv.size(); ++j) impl_->index.commit(resv[j], sums[j]);
    impl_->saved_blocks.add(resv.size());
    impl_->saved_bytes.add(resv.size() * static_cast<uint64_t>(shape.bytes()));
  }
  for (const Status& s : res)
    if (!s.ok()) impl_->save_failures.add();
  impl_->save_seconds.observe(seconds_since(t0));
  return res;
}

std::vector<Status> OffloadService::load(const RegionAccess& region, NamespaceId ns, std::span<const BlockKey> keys,
                                         std::span<const int64_t> block_ids) {
  const auto t0 = Clock::now();
  std::vector<Status> res(keys.size());
  if (keys.size() != block_ids.size()) return mismatched_lists("load", keys.size(), block_ids.size());
  const BlockShape target{region.spec.layers, region.spec.block_size, region.spec.format};
  std::vector<size_t> which;
  std::vector<Hold> holds;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (Status st = region.spec.check_block(block_ids[i]); !st.ok()) {
      res[i] = st;
      continue;
    }
    auto h = impl_->index.acquire(NsKey{ns, keys[i]});
    if (!h.ok()) {
      res[i] = h.status();
      impl_->load_misses.add();
      continue;
    }
    if (Status st = check_loadable(h->meta.shape, target); !st.ok()) {
      res[i] = st;
      impl_->index.release(*h);
      continue;
    }
    which.push_back(i);
    holds.push_back(*h);
  }
  // Verify before anything reaches the region: a damaged copy is reported and dropped.
  std::vector<uint8_t> bad(holds.size(), 0);
  if (impl_->opts.checksum && impl_->opts.verify_on_load)
    parallel_for(holds.size(), impl_->opts.cpu_threads, holds.empty() ? 0 : holds[0].meta.bytes, [&](size_t j) {
      bad[j] = block_checksum(holds[j].data, holds[j].meta.bytes) != holds[j].meta.checksum ? 1 : 0;
    });
  std::vector<CopyRun> runs;
  std::vector<size_t> direct, convert;
  for (size_t j = 0; j < holds.size(); ++j) {
    if (bad[j]) {
      res[which[j]] = {ErrorCode::kChecksumMismatch,
                       "stored block " + keys[which[j]].hex() + " failed its checksum; it was dropped"};
      continue;
    }
    if (holds[j].meta.shape.format == target.format) {
      push_block_runs(&runs, region.spec, block_ids[which[j]], static_cast<int64_t>(holds[j].slot.offset), false);
      direct.push_back(j);
    } else {
      convert.push_back(j);
    }
  }
  if (!runs.empty()) {
    Status st = impl_->copy(region, false, runs);
    if (!st.ok())
      for (size_t j : direct) res[which[j]] = st;
  }
  for (size_t j : convert) {
    const Hold& h = holds[j];
    const int64_t b = block_ids[which[j]];
    std::vector<int64_t> lossy;
    const int64_t zero = 0;
    Status st;
    if (!region.device) {
      st = kernels::convert_blocks_cpu(h.data, h.meta.shape.slot_spec(), {&zero, 1}, region.base, region.spec, {&b, 1},
                                       {impl_->opts.cpu_threads}, &lossy);
    } else {
#if defined(KVFERRY_WITH_CUDA)
      std::lock_guard lk(impl_->dev_mu);
      const KvCacheSpec one = target.slot_spec();
      if (impl_->staging_bytes < one.region_bytes()) {
        if (impl_->staging) cudaFreeHost(impl_->staging);
        impl_->staging = nullptr;
        impl_->staging_bytes = 0;
        void* p = nullptr;
        st = cuda_status(cudaMallocHost(&p, static_cast<size_t>(one.region_bytes())), "cudaMallocHost(staging)",
                         __FILE__, __LINE__);
        if (st.ok()) {
          impl_->staging = static_cast<uint8_t*>(p);
          impl_->staging_bytes = one.region_bytes();
        }
      }
      if (st.ok())
        st = kernels::convert_blocks_cpu(h.data, h.meta.shape.slot_spec(), {&zero, 1}, impl_->staging, one, {&zero, 1},
                                         {impl_->opts.cpu_threads}, &lossy);
      if (st.ok()) {
        std::vector<CopyRun> cr;
        push_block_runs(&cr, region.spec, b, 0, false);
        st = impl_->copy_device_locked(impl_->staging, region.base, cr);
        if (st.ok())
          st = cuda_status(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize", __FILE__, __LINE__);
      }
#else
      st = {ErrorCode::kUnavailable, "device region but kvferry was built without CUDA"};
#endif
    }
    if (st.ok() && !lossy.empty())
      st = {ErrorCode::kDataLoss, "stored block " + keys[which[j]].hex() + " is not losslessly representable as " +
                                      target.format.name() + "; recompute it"};
    res[which[j]] = st;
    if (st.ok()) impl_->converted.add();
  }
  for (size_t j = 0; j < holds.size(); ++j) {
    impl_->index.release(holds[j]);
    if (bad[j]) {
      impl_->checksum_failures.add();
      (void)impl_->index.evict(ns, std::span<const BlockKey>(&keys[which[j]], 1));
    } else if (res[which[j]].ok()) {
      impl_->loaded_blocks.add();
      impl_->loaded_bytes.add(holds[j].meta.bytes);
    }
  }
  impl_->load_seconds.observe(seconds_since(t0));
  return res;
}

}  // namespace kvferry::store
