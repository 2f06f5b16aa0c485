#pragma once
// Movers (private to the store): how the offload service moves the blocks of a save or a load
// between a region and the host pool. The service runs one pipeline for every region (sub-batches,
// deadlines, checksums, commits); the mover it picks by where the region lives moves the bytes:
//   host  memcpy (kernels::copy_blocks_cpu), one block at a time on the thread that asks, which
//         the service does on its hashing pool, right beside that block's checksum, so the block
//         is hashed while it is in cache (mover_host.cpp);
//   CUDA  DMA of whole sub-batches on a lane of the op's own: a stream, a BlockCopier and an event
//         per sub-batch in flight, pinned staging for converted loads (mover_cuda.cpp; without
//         CUDA, mover_nocuda.cpp says so and device regions fail with that reason).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#include "kvferry/store/block_index.h"
#include "kvferry/store/offload.h"

namespace kvferry::store {

/// `rows` copies of `width` bytes, row r from src + r * spitch to dst + r * dpitch (pitches >=
/// width): what the copy engines move in one pitched (2-D) transfer.
struct CopyRun2D {
  int64_t src = 0, dst = 0, width = 0, rows = 1, spitch = 0, dpitch = 0;
};

/// Folds runs that step by constant source and destination strides with one size into 2-D runs
/// (a mapped load's layers of one page, tokens of one head slice), in list order.
inline std::vector<CopyRun2D> fold_2d(std::span<const CopyRun> runs) {
  std::vector<CopyRun2D> out;
  for (size_t i = 0; i < runs.size();) {
    CopyRun2D r{runs[i].src, runs[i].dst, runs[i].bytes, 1, runs[i].bytes, runs[i].bytes};
    size_t j = i + 1;
    if (j < runs.size() && runs[j].bytes == r.width) {
      const int64_t ds = runs[j].src - runs[i].src, dd = runs[j].dst - runs[i].dst;
      if (ds >= r.width && dd >= r.width) {
        r.spitch = ds;
        r.dpitch = dd;
        while (j < runs.size() && runs[j].bytes == r.width && runs[j].src - runs[j - 1].src == ds &&
               runs[j].dst - runs[j - 1].dst == dd)
          ++j;
        r.rows = static_cast<int64_t>(j - i);
      }
    }
    if (r.rows == 1) j = i + 1;
    out.push_back(r);
    i = j;
  }
  return out;
}

/// One save's or load's use of a mover. Runs are byte runs {src, dst, bytes} with offsets into
/// the region and the pool (src is the region's side when the op moves toward the pool). The op's
/// thread calls everything but move_block, which the pool's threads call concurrently. Destroying
/// the op waits for the copies it started (no slot is freed under a running copy) and gives its
/// resources back to the mover.
class MoveOp {
 public:
  virtual ~MoveOp() = default;

  /// Sub-batches that may be in flight: wait(k) is only for one of the last depth() enqueued (an
  /// older one's completion is not kept), so a caller that waits enqueues k + depth() after
  /// wait(k). 0: the mover moves nothing in enqueue; each block moves in move_block (by_block).
  virtual int depth() const = 0;
  /// The blocks move one by one in move_block, on the caller's threads, not in enqueue.
  bool by_block() const { return depth() == 0; }

  /// Starts moving sub-batch `k` (k = 0, 1, ... in order): `runs` are all its blocks' runs, and
  /// need only live until this returns. Asynchronous; it may block while earlier sub-batches hold
  /// what it needs. After a failure the caller enqueues nothing more; finish() still waits for
  /// what did start.
  virtual Status enqueue(size_t k, std::span<const CopyRun> runs) = 0;
  /// Returns once sub-batch `k` has landed, or with why it did not.
  virtual Status wait(size_t k) = 0;
  /// Moves one block's runs now, on the calling thread, when by_block(); otherwise Ok at once
  /// (the block moves with its sub-batch in enqueue). Thread-safe.
  virtual Status move_block(std::span<const CopyRun> runs) = 0;
  /// Loads only: converts the stored block at `stored` (of `shape`, in the pool) into the region's
  /// format in a one-block buffer laid out as a slot of the region's shape, then moves it into the
  /// region by `runs` (source offsets into that buffer). A conversion that is not lossless is
  /// appended to `*lossy` and leaves the region untouched (Ok). Synchronous.
  virtual Status convert_block(const uint8_t* stored, const BlockShape& shape, std::span<const CopyRun> runs,
                               std::vector<int64_t>* lossy) = 0;
  /// Loads only: moves a block laid out in host memory [buf, buf + bytes) (a mapped load's block,
  /// assembled there) into the region by `runs` (source offsets into buf). Synchronous.
  virtual Status place_block(const uint8_t* buf, int64_t bytes, std::span<const CopyRun> runs) = 0;
  /// Loads whose blocks arrive as many small runs (a mapped load: another page size, a head
  /// slice) move better assembled on the host first: pinned host memory for sub-batch `k`, at
  /// least `bytes`, which the caller fills and then hands to enqueue_staged(k, runs) (sources are
  /// offsets into it). The buffer of k is used again for k + 2, after k's copy is waited for here.
  /// Movers that copy block by block do not stage (kUnsupported).
  virtual Result<uint8_t*> staging(size_t k, int64_t bytes) {
    (void)k;
    (void)bytes;
    return Status(ErrorCode::kUnsupported, "this mover does not stage");
  }
  virtual Status enqueue_staged(size_t k, std::span<const CopyRun> runs) {
    (void)k;
    (void)runs;
    return Status(ErrorCode::kUnsupported, "this mover does not stage");
  }
  /// Loads only: sub-batch `k` as pitched copies from the pool into the region (sources are pool
  /// offsets), on the same depth of events as enqueue(). Movers without 2-D copies: kUnsupported.
  virtual Status enqueue_2d(size_t k, std::span<const CopyRun2D> runs) {
    (void)k;
    (void)runs;
    return Status(ErrorCode::kUnsupported, "this mover has no 2-D copies");
  }
  /// Waits for everything enqueued; the first copy failure, if any.
  virtual Status finish() = 0;
};

/// Makes the ops of one offload service. Thread-safe: each concurrent caller gets its own op.
class Mover {
 public:
  virtual ~Mover() = default;
  /// Makes what one op needs now (a CUDA lane), so a problem shows at start rather than on the
  /// first save.
  virtual Status prepare() = 0;
  /// An op that moves blocks between `region` and the pool, toward the pool when `to_pool`. The
  /// region's memory must be what this mover serves (host memory, or device memory for CUDA).
  virtual Result<std::unique_ptr<MoveOp>> begin(const RegionAccess& region, bool to_pool) = 0;
};

/// The pool both kinds of mover move to and from: [base, base + bytes), page-locked where a CUDA
/// device is present. Conversions use `cpu_threads` host threads.
struct PoolAccess {
  uint8_t* base = nullptr;
  int64_t bytes = 0;
  int cpu_threads = 1;
};

/// Host regions: memcpy.
std::unique_ptr<Mover> make_host_mover(PoolAccess pool);
/// Device regions: CUDA DMA. Creates no CUDA resource (ops take lanes, made on first need);
/// kUnavailable "kvferry was built without CUDA" in a build without CUDA.
Result<std::unique_ptr<Mover>> make_cuda_mover(PoolAccess pool);

}  // namespace kvferry::store
