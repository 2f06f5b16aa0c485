#pragma once
// copy_blocks: moves byte runs (layouts' copy_plan: one run per block block-major, L runs
// layer-major, neighbours merged) between a region and a pinned host pool, in either direction,
// or region <-> region on the device. Engines:
//   kKernel  an SM copy kernel (a few CTAs, 16-byte loads, many in flight) that reads or writes
//            mapped pinned memory directly: for engine-driven copies of small blocks;
//   kDma     cudaMemcpyBatchAsync (copy engines, no SMs), the batch split over a few streams so
//            several copy engines overlap their per-copy overheads: what the daemon uses;
//   kStaged  between device and host only: the runs' device side is gathered into (or scattered
//            from) a device staging buffer by a short device-to-device kernel, and the host side
//            moves by DMA in as few copies as its adjacency allows (runs whose host ranges follow
//            each other become one copy), piece by piece, the kernel of one piece overlapping the
//            DMA of another (see kCopyStagePiece). For small blocks scattered in the region but
//            consecutive in the pool: copy engines at large-copy speed, SMs busy for ~2 % of it;
//   kAuto    kDma when the mean run is at least `auto_threshold`; below it, kStaged when the host
//            side merges into copies of that mean size, else kKernel.
// The CPU backend copies with memcpy.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels {

enum class CopyEngine : uint8_t { kAuto = 0, kKernel = 1, kDma = 2, kStaged = 3 };

const char* copy_engine_name(CopyEngine e);

/// Which sides of a copy are host memory (as the CUDA copier finds the two base pointers).
enum class CopyDirection : uint8_t { kDeviceToDevice = 0, kDeviceToHost = 1, kHostToDevice = 2, kHostToHost = 3 };

const char* copy_direction_name(CopyDirection d);

/// Mean run size from which kAuto picks DMA (and the mean merged host copy from which it stages
/// below that). The `copy` benchmark on an H200 (see the note in kernels/src/cpu/copy_blocks_cpu.cpp)
/// shows batched DMA over 4 streams ahead of the kernel and the staged engine from 256 KiB.
constexpr int64_t kCopyAutoThreshold = 256 << 10;

/// CTAs of the copy kernel when the copier's count is automatic (0), by direction. Since the run
/// list moved to device memory, 8 to 64 CTAs give the same rate one way on an H200; reads of
/// mapped host memory get more in case a slower link needs more loads in flight. Device to device
/// uses two CTAs per multiprocessor.
constexpr int kCopyKernelCtasToHost = 16;
constexpr int kCopyKernelCtasFromHost = 32;

/// Streams (copy engines) one kDma copy is split over by default.
constexpr int kCopyDmaStreams = 4;
constexpr int kCopyMaxDmaStreams = 4;

/// Device staging buffer of kStaged (allocated on first use): a ring of kCopyStageParts parts of
/// kCopyStagePiece bytes. The runs go in pieces of at most a part; while the copy engines move one
/// piece's host side, the kernel gathers the next one (to host) or scatters the one before (from
/// host), so only one piece's kernel adds to the copy's time, and that piece (the first to host,
/// the last from host) is kept to kCopyStageLead bytes. Runs bigger than a part go by DMA as they
/// are. On an H200 (kvferry-bench copy, 16 KiB blocks) this took the staged engine from 0.92 to
/// 0.95 of the pinned copy each way; more and smaller pieces cost each DMA's start (8 pieces of
/// 8 MiB: both ways 0.85-0.90 against 0.90-0.94 in one piece; 2 MiB pieces: 0.90 one way).
constexpr int64_t kCopyStageBytes = int64_t{64} << 20;
constexpr int64_t kCopyStagePiece = int64_t{16} << 20;
constexpr int64_t kCopyStageLead = int64_t{2} << 20;
constexpr int kCopyStageParts = static_cast<int>(kCopyStageBytes / kCopyStagePiece);

/// Picks the engine for `runs` under `e` by the mean run alone (kKernel or kDma for kAuto; the
/// copier refines kKernel to kStaged when the host side merges, see count_host_copies).
CopyEngine choose_copy_engine(std::span<const CopyRun> runs, CopyEngine e, int64_t auto_threshold = kCopyAutoThreshold);

/// Checks every run lies inside [0, src_bytes) and [0, dst_bytes) without overflow.
Status validate_copy_runs(std::span<const CopyRun> runs, int64_t src_bytes, int64_t dst_bytes);

/// Splits `runs` into at most `parts` consecutive ranges of about equal bytes; returns the
/// number of ranges and writes their ends (exclusive run indices) to `ends` (size >= parts).
/// Empty when `runs` is. The DMA engine issues one batch per range, each on its own stream.
int split_copy_runs(std::span<const CopyRun> runs, int parts, std::span<size_t> ends);

/// The same split over plain sizes.
int split_copy_sizes(std::span<const size_t> sizes, int parts, std::span<size_t> ends);

/// Host-side copies of `runs` once runs whose host ranges follow each other (in list order) are
/// merged: the host side is the source when `host_is_src`, else the destination. Empty runs count
/// none.
int64_t count_host_copies(std::span<const CopyRun> runs, bool host_is_src);

/// CPU backend: memcpy of every run (runs may be split over threads).
Status copy_blocks_cpu(const void* src_base, int64_t src_bytes, void* dst_base, int64_t dst_bytes,
                       std::span<const CopyRun> runs, const CpuOptions& opt = {});

#if defined(KVFERRY_WITH_CUDA)
/// CUDA copier. Owns two pinned staging slots for the run list (DMA reads its pointer arrays
/// from one; the kernel's runs go through one to a device copy that the kernel reads), used in
/// turn, so one copier serves one stream at a time: copy() waits only for the copy before the
/// previous one before reusing its slot. Pointers must be device memory or mapped pinned host
/// memory (cudaMallocHost / cudaHostRegister under UVA); the kernel engine refuses pageable ones.
class BlockCopier {
 public:
  /// `max_runs`: most runs one copy() takes; `kernel_ctas`: CTAs of the copy kernel, 0 = by
  /// direction (kCopyKernelCtasToHost / kCopyKernelCtasFromHost, 2 per SM device to device).
  static Result<std::unique_ptr<BlockCopier>> create(int64_t max_runs, int kernel_ctas = 0);
  ~BlockCopier();
  BlockCopier(const BlockCopier&) = delete;
  BlockCopier& operator=(const BlockCopier&) = delete;

  /// Enqueues the copies on `stream` (not the legacy default stream). Asynchronous; with DMA
  /// over several streams, the others join `stream` before it goes on.
  Status copy(const void* src_base, void* dst_base, std::span<const CopyRun> runs, CopyEngine engine,
              cudaStream_t stream, int64_t auto_threshold = kCopyAutoThreshold);

  /// 0 = automatic (by direction).
  int kernel_ctas() const { return ctas_; }
  void set_kernel_ctas(int c) { ctas_ = c > 0 ? c : 0; }
  /// CTAs the kernel engine uses for `d` under the current setting.
  int kernel_ctas_for(CopyDirection d) const;
  /// Streams one DMA copy is split over (1..kCopyMaxDmaStreams).
  int dma_streams() const { return dma_streams_; }
  void set_dma_streams(int n) { dma_streams_ = n < 1 ? 1 : n > kCopyMaxDmaStreams ? kCopyMaxDmaStreams : n; }
  /// Engine and direction of the last copy() that enqueued work.
  CopyEngine last_engine() const { return last_engine_; }
  CopyDirection last_direction() const { return last_dir_; }

 private:
  struct Slot {
    void* staging = nullptr;      // pinned: prefix[n+1] + runs[n] (room for max), dsts, srcs, sizes [max]
    void* dev = nullptr;          // device: prefix[n+1] + runs[n], what the kernel reads
    void* staging_dev = nullptr;  // `staging` as the device addresses it (mapped pinned memory)
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  BlockCopier() = default;
  Result<CopyDirection> direction(const void* src, const void* dst) const;
  Status dma(void** dsts, void** srcs, size_t* sizes, size_t count, cudaStream_t stream);
  Status staged(const void* src_base, void* dst_base, std::span<const CopyRun> runs, bool to_host, Slot& slot,
                cudaStream_t stream);
  int64_t max_runs_ = 0;
  int ctas_ = 0;
  int sms_ = 1;
  int dma_streams_ = kCopyDmaStreams;
  Slot slots_[2];
  int next_ = 0;
  cudaStream_t aux_[kCopyMaxDmaStreams - 1] = {};
  cudaEvent_t fork_ = nullptr;
  void* stage_ = nullptr;           // device, kCopyStageBytes, allocated on first kStaged copy
  cudaStream_t kstream_ = nullptr;  // kStaged's kernels, beside the stream of its DMAs
  cudaEvent_t kfork_ = nullptr, kjoin_ = nullptr;
  cudaEvent_t piece_k_[kCopyStageParts] = {};  // a ring part's last kernel done
  cudaEvent_t piece_d_[kCopyStageParts] = {};  // a ring part's last DMA done
  struct Piece {                               // one step of a kStaged copy
    size_t dma_begin = 0, dma_end = 0;         // its host-side copies in the slot's arrays
    size_t runs = 0;                           // 0: one run too big for a piece, DMA only
    size_t meta_at = 0;                        // its run list (prefix, runs) in the slot
    int64_t chunks = 0;
    int part = 0;
    bool reuses = false;  // its ring part held an earlier piece of this copy
  };
  std::vector<Piece> pieces_;
  cudaEvent_t join_[kCopyMaxDmaStreams - 1] = {};
  CopyEngine last_engine_ = CopyEngine::kAuto;
  CopyDirection last_dir_ = CopyDirection::kDeviceToDevice;
};

#endif

}  // namespace kvferry::kernels
