#include "kvferry/store/offload.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>

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
uint64_t micros(double s) { return static_cast<uint64_t>(s * 1e6); }

/// A fixed set of threads, created once, that help callers run parallel_for. Concurrent callers
/// share them; each caller works on its own items too, so a busy pool only slows, never stalls.
class TaskPool {
 public:
  explicit TaskPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { serve(); });
  }
  ~TaskPool() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int helpers() const { return static_cast<int>(threads_.size()); }

  /// Runs fn(i) for i in [0, n); returns when every item is done. Small jobs stay on the caller.
  void parallel_for(size_t n, uint64_t bytes_per_item, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    const size_t want = std::min<size_t>(threads_.size(), n - 1);
    if (want == 0 || n * bytes_per_item < (size_t{2} << 20)) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->fn = &fn;
    {
      std::lock_guard lk(mu_);
      for (size_t t = 0; t < want; ++t) queue_.push_back(job);
    }
    if (want == threads_.size())
      cv_.notify_all();
    else
      for (size_t t = 0; t < want; ++t) cv_.notify_one();
    work(*job);
    std::unique_lock lk(job->mu);
    job->cv.wait(lk, [&] { return job->done.load() == n; });
  }

 private:
  struct Job {
    size_t n = 0;
    const std::function<void(size_t)>* fn = nullptr;  // valid until done == n
    std::atomic<size_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  static void work(Job& j) {
    for (size_t i = j.next.fetch_add(1); i < j.n; i = j.next.fetch_add(1)) {
      (*j.fn)(i);
      if (j.done.fetch_add(1) + 1 == j.n) {
        std::lock_guard lk(j.mu);
        j.cv.notify_all();
      }
    }
  }
  void serve() {
    for (;;) {
      std::shared_ptr<Job> j;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        j = std::move(queue_.front());
        queue_.pop_front();
      }
      work(*j);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// Contiguous ranges [begin, end) of a batch's items of about `target` bytes each (>= 1 item).
std::vector<std::pair<size_t, size_t>> split(size_t n, uint64_t item_bytes, int64_t target) {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t per =
      target <= 0
          ? std::max<size_t>(n, 1)
          : std::max<size_t>(1, static_cast<size_t>(static_cast<uint64_t>(target) / std::max<uint64_t>(item_bytes, 1)));
  for (size_t b = 0; b < n; b += per) out.emplace_back(b, std::min(n, b + per));
  return out;
}

bool convertible(FormatKind from, FormatKind to) {
  using K = FormatKind;
  return (from == K::kMlaFp8 && to == K::kMlaFp8Ds) || (from == K::kMlaBf16 && to == K::kMlaFp8Ds) ||
         (from == K::kMlaFp8Ds && to == K::kMlaBf16) || (from == K::kMlaFp8Ds && to == K::kMlaFp8);
}

// Appends the runs that move one block of `spec` (all layers) to/from a contiguous slot at
// `slot_offset` (slot side block-major). `to_slot` picks the direction. Runs from index `floor` on
// may merge with a neighbour (a sub-batch's runs merge; separate sub-batches' never do).
void push_block_runs(std::vector<CopyRun>* runs, const KvCacheSpec& spec, int64_t block, int64_t slot_offset,
                     bool to_slot, size_t floor = 0) {
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

// Every block of a request whose key and block-id lists differ in length gets the same error.
std::vector<Status> mismatched_lists(const char* op, size_t keys, size_t ids) {
  return std::vector<Status>(
      keys, Status(ErrorCode::kInvalidArgument,
                   std::string(op) + ": " + std::to_string(keys) + " keys but " + std::to_string(ids) + " block ids"));
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

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return std::hash<uint64_t>()(k.hi * 0x9E3779B97F4A7C15ull ^ k.lo); }
};

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

#if defined(KVFERRY_WITH_CUDA)
/// One caller's device resources: its own stream (so one data worker's DMA overlaps another's
/// hashing), a copier and an event per sub-batch in flight (a copier reuses its run array only
/// after its previous copy is done), and pinned staging for converted loads.
struct Lane {
  static constexpr int kDepth = 4;
  cudaStream_t stream = nullptr;
  std::unique_ptr<kernels::BlockCopier> copiers[kDepth];
  cudaEvent_t events[kDepth] = {};
  uint8_t* staging = nullptr;
  int64_t staging_bytes = 0;
  ~Lane() {
    if (stream) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
    for (auto& c : copiers) c.reset();
    if (staging) cudaFreeHost(staging);
    if (stream) cudaStreamDestroy(stream);
  }
};
#endif

struct OffloadService::Impl {
  /// Per-op phase totals (microseconds), for the timing breakdown of the bench and /metrics.
  struct Phases {
    Counter *prepare, *enqueue, *dma_wait, *hash, *total;
    Phases(Registry& m, const char* op) {
      auto c = [&](const char* phase) {
        return &m.counter("kvferry_transfer_phase_microseconds_total",
                          "Time data workers spent per phase of saves and loads (dma_wait: blocked on the copy "
                          "engine; hash: checksums on the worker's critical path)",
                          std::string("op=\"") + op + "\",phase=\"" + phase + "\"");
      };
      prepare = c("prepare");
      enqueue = c("enqueue");
      dma_wait = c("dma_wait");
      hash = c("hash");
      total = c("total");
    }
  };

  Impl(BlockIndex& idx, Registry& m, Options o)
      : index(idx),
        opts(o),
        verify_on_load(o.verify_on_load),
        saved_blocks(m.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"host\"")),
        saved_bytes(m.counter("kvferry_bytes_saved_total", "Bytes saved", "tier=\"host\"")),
        loaded_blocks(m.counter("kvferry_blocks_loaded_total", "Blocks loaded", "tier=\"host\"")),
        loaded_bytes(m.counter("kvferry_bytes_loaded_total", "Bytes loaded", "tier=\"host\"")),
        load_misses(m.counter("kvferry_load_misses_total", "Loads of blocks that were not stored")),
        converted(m.counter("kvferry_blocks_converted_total", "Blocks converted to another format on load")),
        checksum_failures(m.counter("kvferry_checksum_failures_total", "Stored blocks whose checksum did not match")),
        save_failures(m.counter("kvferry_save_failures_total", "Blocks that could not be saved")),
        timeouts(m.counter("kvferry_transfer_timeouts_total", "Blocks failed because limits.request_timeout passed")),
        save_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"save\"")),
        load_seconds(m.histogram("kvferry_op_seconds", "Op latency in the daemon", "op=\"load\"")),
        save_phase(m, "save"),
        load_phase(m, "load") {
    if (opts.cpu_threads <= 0)
      opts.cpu_threads = static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency())));
    if (opts.hash_threads < 0) opts.hash_threads = opts.cpu_threads - 1;
    hashers = std::make_unique<TaskPool>(opts.hash_threads);
  }

  BlockIndex& index;
  Options opts;
  std::atomic<bool> verify_on_load;
  std::unique_ptr<TaskPool> hashers;
  Counter &saved_blocks, &saved_bytes, &loaded_blocks, &loaded_bytes, &load_misses, &converted, &checksum_failures,
      &save_failures, &timeouts;
  Histogram &save_seconds, &load_seconds;
  Phases save_phase, load_phase;

  uint8_t* pool_base = nullptr;
  uint64_t pool_capacity = 0;

  void test_delay() const {
    if (opts.test_delay.count() > 0) std::this_thread::sleep_for(opts.test_delay);
  }
  int64_t pool_bytes() const { return static_cast<int64_t>(pool_capacity); }
  /// Bytes per sub-batch for blocks of `bb`: pipeline_bytes, but at least one block per hashing
  /// thread (hashing is per block; fewer blocks would leave threads idle while the DMA waits).
  int64_t sub_batch_bytes(uint64_t bb) const {
    if (opts.pipeline_bytes <= 0) return 0;
    return std::max<int64_t>(opts.pipeline_bytes, static_cast<int64_t>(bb) * (opts.hash_threads + 1));
  }

  static Status timed_out(const char* op) {
    return op[0] == 's' ? Status(ErrorCode::kTimeout,
                                 "limits.request_timeout passed before this block's save finished; it was not stored")
                        : Status(ErrorCode::kTimeout,
                                 "limits.request_timeout passed before this block's load started; its target block "
                                 "was not written");
  }

  /// Host regions: copies one block's runs (one thread; blocks run in parallel on the pool).
  Status copy_host(const RegionAccess& region, bool to_pool, std::span<const CopyRun> runs) {
    const int64_t rb = region.spec.region_bytes();
    return to_pool ? kernels::copy_blocks_cpu(region.base, rb, pool_base, pool_bytes(), runs, {1})
                   : kernels::copy_blocks_cpu(pool_base, pool_bytes(), region.base, rb, runs, {1});
  }

#if defined(KVFERRY_WITH_CUDA)
  static constexpr int64_t kMaxRuns = 8192;
  std::mutex lanes_mu;
  std::vector<std::unique_ptr<Lane>> free_lanes;

  Result<std::unique_ptr<Lane>> take_lane() {
    {
      std::lock_guard lk(lanes_mu);
      if (!free_lanes.empty()) {
        auto l = std::move(free_lanes.back());
        free_lanes.pop_back();
        return l;
      }
    }
    auto l = std::make_unique<Lane>();
    KVFERRY_CUDA_TRY(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
    for (int i = 0; i < Lane::kDepth; ++i) {
      KVFERRY_ASSIGN_OR_RETURN(l->copiers[i], kernels::BlockCopier::create(kMaxRuns));
      KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&l->events[i], cudaEventDisableTiming));
    }
    return l;
  }
  void give_lane(std::unique_ptr<Lane> l) {
    std::lock_guard lk(lanes_mu);
    free_lanes.push_back(std::move(l));
  }
  /// Takes a lane for one op and gives it back.
  struct LaneRef {
    explicit LaneRef(Impl* i) : impl(i) {}
    ~LaneRef() {
      if (lane) impl->give_lane(std::move(lane));
    }
    Impl* impl;
    std::unique_ptr<Lane> lane;
  };

  /// Enqueues sub-batch `k`'s runs on the lane (copier and event k % depth). Asynchronous.
  Status enqueue(Lane& lane, size_t k, const RegionAccess& region, bool to_pool, std::span<const CopyRun> runs) {
    const int64_t rb = region.spec.region_bytes();
    KVFERRY_TRY(kernels::validate_copy_runs(runs, to_pool ? rb : pool_bytes(), to_pool ? pool_bytes() : rb));
    const void* src = to_pool ? static_cast<const void*>(region.base) : pool_base;
    void* dst = to_pool ? static_cast<void*>(pool_base) : region.base;
    kernels::BlockCopier& cp = *lane.copiers[k % Lane::kDepth];
    for (size_t i = 0; i < runs.size(); i += static_cast<size_t>(kMaxRuns)) {
      const size_t n = std::min(runs.size() - i, static_cast<size_t>(kMaxRuns));
      KVFERRY_TRY(cp.copy(src, dst, runs.subspan(i, n), kernels::CopyEngine::kDma, lane.stream));
    }
    KVFERRY_CUDA_TRY(cudaEventRecord(lane.events[k % Lane::kDepth], lane.stream));
    return Status::Ok();
  }

  /// Converts one stored block into block `b` of a device region through the lane's staging.
  Status convert_to_device(Lane& lane, const Hold& h, const RegionAccess& region, int64_t b,
                           std::vector<int64_t>* lossy) {
    const KvCacheSpec one = BlockShape{region.spec.layers, region.spec.block_size, region.spec.format}.slot_spec();
    if (lane.staging_bytes < one.region_bytes()) {
      if (lane.staging) {
        KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));
        cudaFreeHost(lane.staging);
      }
      lane.staging = nullptr;
      lane.staging_bytes = 0;
      void* p = nullptr;
      KVFERRY_CUDA_TRY(cudaMallocHost(&p, static_cast<size_t>(one.region_bytes())));
      lane.staging = static_cast<uint8_t*>(p);
      lane.staging_bytes = one.region_bytes();
    }
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));  // the staging's previous block is out
    const int64_t zero = 0;
    KVFERRY_TRY(kernels::convert_blocks_cpu(h.data, h.meta.shape.slot_spec(), {&zero, 1}, lane.staging, one, {&zero, 1},
                                            {opts.cpu_threads}, lossy));
    if (!lossy->empty()) return Status::Ok();  // the caller reports data loss; the target stays untouched
    std::vector<CopyRun> cr;
    push_block_runs(&cr, region.spec, b, 0, false);
    KVFERRY_TRY(kernels::validate_copy_runs(cr, lane.staging_bytes, region.spec.region_bytes()));
    KVFERRY_TRY(lane.copiers[0]->copy(lane.staging, region.base, cr, kernels::CopyEngine::kDma, lane.stream));
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));
    return Status::Ok();
  }
#endif
};

OffloadService::OffloadService(BlockIndex& index, std::unique_ptr<Impl> impl) : index_(index), impl_(std::move(impl)) {}
OffloadService::~OffloadService() = default;

Result<std::unique_ptr<OffloadService>> OffloadService::create(BlockIndex& index, Registry& metrics, Options opts) {
  if (opts.use_cuda) {
#if !defined(KVFERRY_WITH_CUDA)
    return Result<std::unique_ptr<OffloadService>>(ErrorCode::kUnavailable, "kvferry was built without CUDA");
#endif
  }
  auto impl = std::make_unique<Impl>(index, metrics, opts);
  impl->pool_base = index.pool().base();
  impl->pool_capacity = index.pool().capacity();
#if defined(KVFERRY_WITH_CUDA)
  if (opts.use_cuda) {  // one lane now, so a CUDA problem shows at start rather than on the first save
    auto lane = impl->take_lane();
    if (!lane.ok()) return lane.status().with_context("the offload service's stream and copiers");
    impl->give_lane(std::move(*lane));
  }
#endif
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
  // Sub-batches; on the device a sub-batch's runs merge across its blocks, on the host each block
  // keeps its own runs (it is copied and hashed by one thread while it is in cache).
  const auto subs = split(resv.size(), bb, d.sub_batch_bytes(bb));
  std::vector<CopyRun> runs;
  std::vector<size_t> run_at(resv.size() + 1, 0), sub_run_at(subs.size() + 1, 0);
  for (size_t k = 0; k < subs.size(); ++k) {
    sub_run_at[k] = runs.size();
    for (size_t j = subs[k].first; j < subs[k].second; ++j) {
      run_at[j] = runs.size();
      push_block_runs(&runs, region.spec, block_ids[which[j]], static_cast<int64_t>(resv[j].slot.offset), true,
                      region.device ? sub_run_at[k] : run_at[j]);
    }
  }
  run_at[resv.size()] = sub_run_at[subs.size()] = runs.size();
  std::vector<uint64_t> sums(resv.size(), 0);
  std::vector<Status> bst(resv.size());  // per reserved block; ok ones are committed
  double t_enqueue = 0, t_wait = 0, t_hash = 0;
  const double t_prepare = seconds_since(t0);
  const bool hash = d.opts.checksum;
  [[maybe_unused]] auto hash_sub = [&](size_t k) {
    const auto th = Clock::now();
    if (hash)
      d.hashers->parallel_for(subs[k].second - subs[k].first, bb, [&](size_t i) {
        const size_t j = subs[k].first + i;
        sums[j] = block_checksum(resv[j].data, resv[j].bytes);
      });
    t_hash += seconds_since(th);
  };
  auto fail_from = [&](size_t k, const Status& st) {
    for (; k < subs.size(); ++k)
      for (size_t j = subs[k].first; j < subs[k].second; ++j) bst[j] = st;
  };
  if (!region.device) {
    for (size_t k = 0; k < subs.size(); ++k) {
      d.test_delay();
      if (Clock::now() >= deadline) {
        fail_from(k, Impl::timed_out("save"));
        break;
      }
      const auto th = Clock::now();
      d.hashers->parallel_for(subs[k].second - subs[k].first, bb, [&](size_t i) {
        const size_t j = subs[k].first + i;
        bst[j] =
            d.copy_host(region, true, std::span<const CopyRun>(runs).subspan(run_at[j], run_at[j + 1] - run_at[j]));
        if (bst[j].ok() && hash) sums[j] = block_checksum(resv[j].data, resv[j].bytes);
      });
      t_hash += seconds_since(th);
    }
  } else {
#if defined(KVFERRY_WITH_CUDA)
    Impl::LaneRef lane(&d);
    if (!subs.empty()) {
      auto l = d.take_lane();
      if (l.ok())
        lane.lane = std::move(*l);
      else
        fail_from(0, l.status());
    }
    size_t enq = 0;  // sub-batches enqueued
    Status fail;     // why the rest could not be enqueued
    auto try_enqueue = [&] {
      if (!lane.lane || enq >= subs.size() || !fail.ok()) return false;
      d.test_delay();
      if (Clock::now() >= deadline) {
        fail = Impl::timed_out("save");
        return false;
      }
      const auto te = Clock::now();
      Status st =
          d.enqueue(*lane.lane, enq, region, true,
                    std::span<const CopyRun>(runs).subspan(sub_run_at[enq], sub_run_at[enq + 1] - sub_run_at[enq]));
      t_enqueue += seconds_since(te);
      if (!st.ok()) {
        fail = st;
        return false;
      }
      ++enq;
      return true;
    };
    while (enq < static_cast<size_t>(Lane::kDepth) && try_enqueue()) {
    }
    bool broken = false;  // a copy failed: the stream is unusable, every later block fails
    for (size_t k = 0; k < enq; ++k) {
      const auto tw = Clock::now();
      Status w = cuda_status(cudaEventSynchronize(lane.lane->events[k % Lane::kDepth]), "cudaEventSynchronize",
                             __FILE__, __LINE__);
      t_wait += seconds_since(tw);
      if (!w.ok() || broken) {
        if (!broken) (void)cudaStreamSynchronize(lane.lane->stream);  // no slot is freed under a running copy
        broken = true;
        fail_from(k, w.ok() ? Status(ErrorCode::kCuda, "an earlier copy of this save failed") : w);
        if (fail.ok()) fail = w;
        break;
      }
      try_enqueue();  // sub-batch k+depth takes k's copier and event; the engine stays busy
      if (Clock::now() >= deadline) {
        fail_from(k, Impl::timed_out("save"));
        (void)cudaStreamSynchronize(lane.lane->stream);
        enq = subs.size();  // nothing below is enqueued any more
        break;
      }
      hash_sub(k);
    }
    if (enq < subs.size()) fail_from(enq, fail.ok() ? Impl::timed_out("save") : fail);
#else
    fail_from(0, Status(ErrorCode::kUnavailable, "device region but kvferry was built without CUDA"));
#endif
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
  std::vector<size_t> which;
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
  auto runs_of = [&](size_t j, std::vector<CopyRun>* runs, size_t floor) {
    push_block_runs(runs, region.spec, block_ids[which[j]], static_cast<int64_t>(holds[j].slot.offset), false, floor);
  };
#if defined(KVFERRY_WITH_CUDA)
  Impl::LaneRef lane(&d);
  if (region.device && !holds.empty()) {
    auto l = d.take_lane();
    if (l.ok()) {
      lane.lane = std::move(*l);
    } else {
      for (auto& s : bst) s = l.status();
    }
  }
#endif
  if (!region.device) {
    for (size_t k = 0; k < subs.size(); ++k) {
      d.test_delay();
      if (Clock::now() >= deadline) {
        fail_from(k, Impl::timed_out("load"));
        break;
      }
      const auto th = Clock::now();
      d.hashers->parallel_for(subs[k].second - subs[k].first, bb, [&](size_t i) {
        const size_t j = direct[subs[k].first + i];
        check(j);
        if (bad[j]) return;
        std::vector<CopyRun> runs;
        runs_of(j, &runs, 0);
        bst[j] = d.copy_host(region, false, runs);
      });
      t_hash += seconds_since(th);
    }
  } else {
#if defined(KVFERRY_WITH_CUDA)
    size_t k = 0;
    for (; lane.lane && k < subs.size(); ++k) {
      d.test_delay();
      if (Clock::now() >= deadline) {
        fail_from(k, Impl::timed_out("load"));
        break;
      }
      // Verify sub-batch k while k-1 (enqueued last round) is being copied.
      const auto th = Clock::now();
      if (verify)
        d.hashers->parallel_for(subs[k].second - subs[k].first, bb,
                                [&](size_t i) { check(direct[subs[k].first + i]); });
      t_hash += seconds_since(th);
      std::vector<CopyRun> runs;
      for (size_t i = subs[k].first; i < subs[k].second; ++i)
        if (!bad[direct[i]]) runs_of(direct[i], &runs, 0);
      if (runs.empty()) continue;
      const auto te = Clock::now();
      Status st = d.enqueue(*lane.lane, k, region, false, runs);
      t_enqueue += seconds_since(te);
      if (!st.ok()) {
        fail_from(k, st);
        break;
      }
    }
    if (lane.lane) {
      const auto tw = Clock::now();
      Status st = cuda_status(cudaStreamSynchronize(lane.lane->stream), "cudaStreamSynchronize", __FILE__, __LINE__);
      t_wait += seconds_since(tw);
      if (!st.ok())
        for (size_t i = 0; i < direct.size(); ++i)
          if (bst[direct[i]].ok()) bst[direct[i]] = st;
    }
#else
    fail_from(0, Status(ErrorCode::kUnavailable, "device region but kvferry was built without CUDA"));
#endif
  }
  for (size_t j : convert) {
    if (!bst[j].ok()) continue;
    if (Clock::now() >= deadline) {
      bst[j] = Impl::timed_out("load");
      continue;
    }
    check(j);
    if (bad[j]) continue;
    const Hold& h = holds[j];
    const int64_t b = block_ids[which[j]];
    std::vector<int64_t> lossy;
    const int64_t zero = 0;
    Status st;
    if (!region.device) {
      // Through a one-block staging copy: a conversion that turns out lossy must leave the
      // target block as it was.
      const KvCacheSpec one = target.slot_spec();
      std::vector<uint8_t> staged(static_cast<size_t>(one.region_bytes()));
      st = kernels::convert_blocks_cpu(h.data, h.meta.shape.slot_spec(), {&zero, 1}, staged.data(), one, {&zero, 1},
                                       {d.opts.cpu_threads}, &lossy);
      if (st.ok() && lossy.empty()) {
        std::vector<CopyRun> runs;
        push_block_runs(&runs, region.spec, b, 0, false);
        st = kernels::copy_blocks_cpu(staged.data(), one.region_bytes(), region.base, region.spec.region_bytes(), runs,
                                      {1});
      }
    } else {
#if defined(KVFERRY_WITH_CUDA)
      st = lane.lane ? d.convert_to_device(*lane.lane, h, region, b, &lossy) : bst[j];
#else
      st = {ErrorCode::kUnavailable, "device region but kvferry was built without CUDA"};
#endif
    }
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
