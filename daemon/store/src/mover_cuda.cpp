// The CUDA mover: DMA between a device region and the pinned pool, a sub-batch per enqueue on a
// lane of the op's own. Built only with CUDA (mover_nocuda.cpp otherwise).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"
#include "mover.h"

namespace kvferry::store {
namespace {

/// Most runs one BlockCopier::copy takes; a sub-batch with more goes in several.
constexpr int64_t kMaxRuns = 8192;

/// One op's device resources: its own stream (so one data worker's DMA overlaps another's
/// hashing), a copier and an event per sub-batch in flight (a copier reuses its run array only
/// after its previous copy is done), and pinned staging for converted loads.
struct Lane {
  static constexpr int kDepth = 4;
  cudaStream_t stream = nullptr;
  std::unique_ptr<kernels::BlockCopier> copiers[kDepth];
  cudaEvent_t events[kDepth] = {};
  uint8_t* staging = nullptr;
  int64_t staging_bytes = 0;
  uint8_t* stage[2] = {nullptr, nullptr};  // assembled sub-batches of mapped loads (MoveOp::staging)
  int64_t stage_bytes[2] = {0, 0};
  std::vector<CopyRun> merged;  // a sub-batch's runs, neighbours merged (kept for its capacity)

  Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() {
    if (stream) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
    for (auto& c : copiers) c.reset();
    if (staging) cudaFreeHost(staging);
    for (uint8_t* p : stage)
      if (p) cudaFreeHost(p);
    if (stream) cudaStreamDestroy(stream);
  }
};

class CudaMover final : public Mover {
 public:
  explicit CudaMover(PoolAccess pool) : pool_(pool) {}

  Status prepare() override {
    KVFERRY_ASSIGN_OR_RETURN(auto lane, take_lane());
    give_lane(std::move(lane));
    return Status::Ok();
  }
  Result<std::unique_ptr<MoveOp>> begin(const RegionAccess& region, bool to_pool) override;

  const PoolAccess& pool() const { return pool_; }

  Result<std::unique_ptr<Lane>> take_lane() {
    {
      std::lock_guard lk(mu_);
      if (!free_.empty()) {
        auto l = std::move(free_.back());
        free_.pop_back();
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
    std::lock_guard lk(mu_);
    free_.push_back(std::move(l));
  }

 private:
  PoolAccess pool_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Lane>> free_;
};

class CudaOp final : public MoveOp {
 public:
  CudaOp(CudaMover& mover, std::unique_ptr<Lane> lane, const RegionAccess& region, bool to_pool)
      : mover_(mover), lane_(std::move(lane)), region_(region), to_pool_(to_pool) {}
  ~CudaOp() override {
    (void)cudaStreamSynchronize(lane_->stream);  // the next op on this lane starts on an idle stream
    mover_.give_lane(std::move(lane_));
  }
  CudaOp(const CudaOp&) = delete;
  CudaOp& operator=(const CudaOp&) = delete;

  int depth() const override { return Lane::kDepth; }

  /// On copier and event k % depth. The runs come block by block; neighbours that follow each
  /// other on both sides become one copy.
  Status enqueue(size_t k, std::span<const CopyRun> runs) override {
    auto& m = lane_->merged;
    m.clear();
    for (const CopyRun& r : runs) {
      if (!m.empty() && m.back().src + m.back().bytes == r.src && m.back().dst + m.back().bytes == r.dst)
        m.back().bytes += r.bytes;
      else
        m.push_back(r);
    }
    const int64_t rb = region_.spec.region_bytes(), pb = mover_.pool().bytes;
    KVFERRY_TRY(kernels::validate_copy_runs(m, to_pool_ ? rb : pb, to_pool_ ? pb : rb));
    const void* src = to_pool_ ? static_cast<const void*>(region_.base) : mover_.pool().base;
    void* dst = to_pool_ ? static_cast<void*>(mover_.pool().base) : region_.base;
    kernels::BlockCopier& cp = *lane_->copiers[k % Lane::kDepth];
    const std::span<const CopyRun> all(m);
    for (size_t i = 0; i < all.size(); i += static_cast<size_t>(kMaxRuns)) {
      const size_t n = std::min(all.size() - i, static_cast<size_t>(kMaxRuns));
      KVFERRY_TRY(cp.copy(src, dst, all.subspan(i, n), kernels::CopyEngine::kDma, lane_->stream));
    }
    KVFERRY_CUDA_TRY(cudaEventRecord(lane_->events[k % Lane::kDepth], lane_->stream));
    return Status::Ok();
  }

  Status wait(size_t k) override { return KVFERRY_CUDA_STATUS(cudaEventSynchronize(lane_->events[k % Lane::kDepth])); }

  Status move_block(std::span<const CopyRun>) override { return Status::Ok(); }  // moves with its sub-batch

  Result<uint8_t*> staging(size_t k, int64_t bytes) override {
    Lane& lane = *lane_;
    const size_t s = k % 2;
    if (k >= 2) KVFERRY_TRY(wait(k - 2));  // its copy out of this buffer is done
    KVFERRY_TRY(grow_pinned(&lane.stage[s], &lane.stage_bytes[s], bytes));
    return lane.stage[s];
  }

  Status enqueue_2d(size_t k, std::span<const CopyRun2D> runs) override {
    if (to_pool_) return {ErrorCode::kInternal, "enqueue_2d on a save"};
    Lane& lane = *lane_;
    const int64_t pb = mover_.pool().bytes, rb = region_.spec.region_bytes();
    for (const CopyRun2D& r : runs) {
      const int64_t send = r.src + (r.rows - 1) * r.spitch + r.width, dend = r.dst + (r.rows - 1) * r.dpitch + r.width;
      if (r.rows < 1 || r.width < 1 || r.spitch < r.width || r.dpitch < r.width || r.src < 0 || r.dst < 0 ||
          send > pb || dend > rb)
        return {ErrorCode::kOutOfRange, "2-D copy of " + std::to_string(r.rows) + " x " + std::to_string(r.width) +
                                            " bytes lies outside the pool or the region"};
      KVFERRY_CUDA_TRY(cudaMemcpy2DAsync(region_.base + r.dst, static_cast<size_t>(r.dpitch),
                                         mover_.pool().base + r.src, static_cast<size_t>(r.spitch),
                                         static_cast<size_t>(r.width), static_cast<size_t>(r.rows),
                                         cudaMemcpyHostToDevice, lane.stream));
    }
    KVFERRY_CUDA_TRY(cudaEventRecord(lane.events[k % Lane::kDepth], lane.stream));
    return Status::Ok();
  }

  Status enqueue_staged(size_t k, std::span<const CopyRun> runs) override {
    if (to_pool_) return {ErrorCode::kInternal, "enqueue_staged on a save"};
    Lane& lane = *lane_;
    const size_t s = k % 2;
    KVFERRY_TRY(kernels::validate_copy_runs(runs, lane.stage_bytes[s], region_.spec.region_bytes()));
    kernels::BlockCopier& cp = *lane.copiers[k % Lane::kDepth];
    for (size_t i = 0; i < runs.size(); i += static_cast<size_t>(kMaxRuns)) {
      const size_t n = std::min(runs.size() - i, static_cast<size_t>(kMaxRuns));
      KVFERRY_TRY(cp.copy(lane.stage[s], region_.base, runs.subspan(i, n), kernels::CopyEngine::kDma, lane.stream));
    }
    KVFERRY_CUDA_TRY(cudaEventRecord(lane.events[k % Lane::kDepth], lane.stream));
    return Status::Ok();
  }

  /// Through the lane's pinned staging: converted on the host, then one DMA into the region.
  Status convert_block(const uint8_t* stored, const BlockShape& shape, std::span<const CopyRun> runs,
                       std::vector<int64_t>* lossy) override {
    if (to_pool_) return {ErrorCode::kInternal, "convert_block on a save"};
    const KvCacheSpec one = BlockShape{region_.spec.layers, region_.spec.block_size, region_.spec.format}.slot_spec();
    KVFERRY_TRY(grow_staging(one.region_bytes()));
    Lane& lane = *lane_;
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));  // the staging's previous block is out
    const int64_t zero = 0;
    KVFERRY_TRY(kernels::convert_blocks_cpu(stored, shape.slot_spec(), {&zero, 1}, lane.staging, one, {&zero, 1},
                                            {mover_.pool().cpu_threads}, lossy));
    if (!lossy->empty()) return Status::Ok();  // the caller reports data loss; the target stays untouched
    KVFERRY_TRY(kernels::validate_copy_runs(runs, lane.staging_bytes, region_.spec.region_bytes()));
    KVFERRY_TRY(lane.copiers[0]->copy(lane.staging, region_.base, runs, kernels::CopyEngine::kDma, lane.stream));
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));
    return Status::Ok();
  }

  /// Through the lane's pinned staging, as convert_block: a copy on the host, then one DMA.
  Status place_block(const uint8_t* buf, int64_t bytes, std::span<const CopyRun> runs) override {
    if (to_pool_) return {ErrorCode::kInternal, "place_block on a save"};
    KVFERRY_TRY(grow_staging(bytes));
    Lane& lane = *lane_;
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));  // the staging's previous block is out
    std::memcpy(lane.staging, buf, static_cast<size_t>(bytes));
    KVFERRY_TRY(kernels::validate_copy_runs(runs, bytes, region_.spec.region_bytes()));
    KVFERRY_TRY(lane.copiers[0]->copy(lane.staging, region_.base, runs, kernels::CopyEngine::kDma, lane.stream));
    KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane.stream));
    return Status::Ok();
  }

  Status finish() override { return KVFERRY_CUDA_STATUS(cudaStreamSynchronize(lane_->stream)); }

 private:
  /// The lane's pinned staging, at least `bytes` (regrown after the stream is idle).
  Status grow_staging(int64_t bytes) { return grow_pinned(&lane_->staging, &lane_->staging_bytes, bytes); }

  /// Makes `*buf` pinned host memory of at least `bytes` (regrown once the lane's stream is idle).
  Status grow_pinned(uint8_t** buf, int64_t* have, int64_t bytes) {
    if (*have >= bytes) return Status::Ok();
    if (*buf) {
      KVFERRY_CUDA_TRY(cudaStreamSynchronize(lane_->stream));
      cudaFreeHost(*buf);
    }
    *buf = nullptr;
    *have = 0;
    void* p = nullptr;
    KVFERRY_CUDA_TRY(cudaMallocHost(&p, static_cast<size_t>(bytes)));
    *buf = static_cast<uint8_t*>(p);
    *have = bytes;
    return Status::Ok();
  }

  CudaMover& mover_;
  std::unique_ptr<Lane> lane_;
  RegionAccess region_;
  bool to_pool_;
};

Result<std::unique_ptr<MoveOp>> CudaMover::begin(const RegionAccess& region, bool to_pool) {
  KVFERRY_ASSIGN_OR_RETURN(auto lane, take_lane());
  return std::unique_ptr<MoveOp>(std::make_unique<CudaOp>(*this, std::move(lane), region, to_pool));
}

}  // namespace

Result<std::unique_ptr<Mover>> make_cuda_mover(PoolAccess pool) {
  return std::unique_ptr<Mover>(std::make_unique<CudaMover>(pool));
}

}  // namespace kvferry::store
