#pragma once
// copy_blocks: moves byte runs (layouts' copy_plan: one run per block block-major, L runs
// layer-major, neighbours merged) between a region and a pinned host pool, in either direction,
// or region <-> region on the device. Engines:
//   kKernel  an SM copy kernel (few CTAs, 16-byte loads) that reads or writes mapped pinned
//            memory directly: for engine-driven copies of small blocks;
//   kDma     cudaMemcpyBatchAsync (copy engines, no SMs): what the daemon uses;
//   kAuto    kKernel when the mean run is below `auto_threshold`, else kDma.
// The CPU backend copies with memcpy.
#include <cstdint>
#include <memory>
#include <span>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels {

enum class CopyEngine : uint8_t { kAuto = 0, kKernel = 1, kDma = 2 };

const char* copy_engine_name(CopyEngine e);

/// Mean run size from which kAuto picks DMA. The `copy` benchmark on an H200 (see the note in
/// kernels/src/cpu/copy_blocks_cpu.cpp) shows the batched DMA matching the mapped-memory kernel
/// from about 256 KiB.
constexpr int64_t kCopyAutoThreshold = 256 << 10;

/// Picks the engine for `runs` under `e` (resolves kAuto).
CopyEngine choose_copy_engine(std::span<const CopyRun> runs, CopyEngine e, int64_t auto_threshold = kCopyAutoThreshold);

/// Checks every run lies inside [0, src_bytes) and [0, dst_bytes) without overflow.
Status validate_copy_runs(std::span<const CopyRun> runs, int64_t src_bytes, int64_t dst_bytes);

/// CPU backend: memcpy of every run (runs may be split over threads).
Status copy_blocks_cpu(const void* src_base, int64_t src_bytes, void* dst_base, int64_t dst_bytes,
                       std::span<const CopyRun> runs, const CpuOptions& opt = {});

#if defined(KVFERRY_WITH_CUDA)
/// CUDA copier. Owns a pinned, mapped staging array for the run list (the kernel reads it; DMA
/// reads the pointer arrays from it), so one copier serves one stream at a time: copy() waits
/// for the copier's previous copy before reusing that array. Pointers must be device memory or
/// mapped pinned host memory (cudaMallocHost / cudaHostRegister under UVA).
class BlockCopier {
 public:
  /// `max_runs`: most runs one copy() takes; `kernel_ctas`: CTAs of the copy kernel.
  static Result<std::unique_ptr<BlockCopier>> create(int64_t max_runs, int kernel_ctas = 8);
  ~BlockCopier();
  BlockCopier(const BlockCopier&) = delete;
  BlockCopier& operator=(const BlockCopier&) = delete;

  /// Enqueues the copies on `stream` (not the legacy default stream). Asynchronous.
  Status copy(const void* src_base, void* dst_base, std::span<const CopyRun> runs, CopyEngine engine,
              cudaStream_t stream, int64_t auto_threshold = kCopyAutoThreshold);

  int kernel_ctas() const { return ctas_; }
  void set_kernel_ctas(int c) { ctas_ = c > 0 ? c : 1; }

 private:
  BlockCopier() = default;
  int64_t max_runs_ = 0;
  int ctas_ = 8;
  void* staging_ = nullptr;  // pinned: CopyRun[max], chunk prefix[max+1], dsts[max], srcs[max], sizes[max]
  cudaEvent_t done_ = nullptr;
  bool pending_ = false;
};

#endif

}  // namespace kvferry::kernels
