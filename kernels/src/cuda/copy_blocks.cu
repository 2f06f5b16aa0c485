// CUDA engines of copy_blocks: an SM copy kernel (few CTAs, 16-byte loads unrolled so many bytes
// are in flight over PCIe when one side is mapped pinned memory) and cudaMemcpyBatchAsync.
#include <cuda_runtime.h>

#include <cstring>
#include <utility>
#include <string>

#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"

namespace kvferry::kernels {
namespace {

constexpr int kCopyThreads = 512;
constexpr int kUnroll = 8;
constexpr int64_t kChunk = 64 << 10;  // bytes of one work item (a piece of one run)

// One warp per 64 KiB chunk of a run; every lane keeps kUnroll 16-byte loads in flight
// (predicated at the tail), so a warp has 4 KiB outstanding and 8 CTAs of 16 warps 512 KiB:
// enough to cover PCIe latency when one side is mapped pinned memory, even for 16 KiB blocks.
__global__ void __launch_bounds__(kCopyThreads)
    copy_chunks_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, const CopyRun* runs,
                       const int64_t* chunk_prefix, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t total = chunk_prefix[n];
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; c < total; c += nwarps) {
    int64_t lo = 0, hi = n;  // chunk_prefix[lo] <= c < chunk_prefix[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) >> 1;
      if (chunk_prefix[mid] <= c)
        lo = mid;
      else
        hi = mid;
    }
    const CopyRun r = runs[lo];
    const int64_t off = (c - chunk_prefix[lo]) * kChunk;
    const int64_t len = r.bytes - off < kChunk ? r.bytes - off : kChunk;
    const uint8_t* s = src + r.src + off;
    uint8_t* d = dst + r.dst + off;
    int64_t done = 0;
    if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15u) == 0) {
      const int64_t nv = len >> 4;
      const uint4* sv = reinterpret_cast<const uint4*>(s);
      uint4* dv = reinterpret_cast<uint4*>(d);
      for (int64_t base = 0; base < nv; base += 32 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = base + u * 32 + lane;
          if (k < nv) v[u] = sv[k];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = base + u * 32 + lane;
          if (k < nv) dv[k] = v[u];
        }
      }
      done = nv << 4;
    }
    for (int64_t k = done + lane; k < len; k += 32) d[k] = s[k];
  }
}

cudaError_t launch_copy_chunks(const void* src_base, void* dst_base, const CopyRun* runs, const int64_t* prefix,
                               int64_t num_runs, int64_t chunks, int ctas, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  const int64_t warps_per_cta = kCopyThreads / 32;
  int64_t grid = (chunks + warps_per_cta - 1) / warps_per_cta;
  if (grid > ctas) grid = ctas;
  copy_chunks_kernel<<<static_cast<unsigned>(grid), kCopyThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src_base), static_cast<uint8_t*>(dst_base), runs, prefix, num_runs);
  return cudaGetLastError();
}

}  // namespace

Result<std::unique_ptr<BlockCopier>> BlockCopier::create(int64_t max_runs, int kernel_ctas) {
  if (max_runs < 1) return Result<std::unique_ptr<BlockCopier>>(ErrorCode::kInvalidArgument, "max_runs must be >= 1");
  std::unique_ptr<BlockCopier> c(new BlockCopier());
  c->max_runs_ = max_runs;
  c->set_kernel_ctas(kernel_ctas);
  const size_t bytes =
      static_cast<size_t>(max_runs) * (sizeof(CopyRun) + sizeof(int64_t) + 2 * sizeof(void*) + sizeof(size_t)) +
      sizeof(int64_t);
  KVFERRY_CUDA_TRY(cudaHostAlloc(&c->staging_, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->done_, cudaEventDisableTiming));
  return Result<std::unique_ptr<BlockCopier>>(std::move(c));
}

BlockCopier::~BlockCopier() {
  if (done_) {
    if (pending_) (void)cudaEventSynchronize(done_);
    (void)cudaEventDestroy(done_);
  }
  if (staging_) (void)cudaFreeHost(staging_);
}

Status BlockCopier::copy(const void* src_base, void* dst_base, std::span<const CopyRun> runs, CopyEngine engine,
                         cudaStream_t stream, int64_t auto_threshold) {
  if (runs.empty()) return Status::Ok();
  if (static_cast<int64_t>(runs.size()) > max_runs_)
    return {ErrorCode::kInvalidArgument,
            "copy_blocks: " + std::to_string(runs.size()) + " runs but the copier holds " + std::to_string(max_runs_)};
  if (stream == nullptr || stream == cudaStreamLegacy)
    return {ErrorCode::kInvalidArgument, "copy_blocks: needs an explicit stream (not the legacy default stream)"};
  if (pending_) {
    KVFERRY_CUDA_TRY(cudaEventSynchronize(done_));
    pending_ = false;
  }
  const size_t n = runs.size();
  auto* staged = static_cast<CopyRun*>(staging_);
  auto* prefix = reinterpret_cast<int64_t*>(staged + max_runs_);
  auto** dsts = reinterpret_cast<void**>(prefix + max_runs_ + 1);
  auto** srcs = reinterpret_cast<const void**>(reinterpret_cast<uintptr_t>(dsts + max_runs_));
  auto* sizes = reinterpret_cast<size_t*>(reinterpret_cast<uintptr_t>(srcs + max_runs_));
  const CopyEngine e = choose_copy_engine(runs, engine, auto_threshold);
  if (e == CopyEngine::kKernel) {
    std::memcpy(staged, runs.data(), n * sizeof(CopyRun));
    prefix[0] = 0;
    for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + (runs[i].bytes + kChunk - 1) / kChunk;
    KVFERRY_CUDA_TRY(
        launch_copy_chunks(src_base, dst_base, staged, prefix, static_cast<int64_t>(n), prefix[n], ctas_, stream));
  } else {
    for (size_t i = 0; i < n; ++i) {
      dsts[i] = static_cast<uint8_t*>(dst_base) + runs[i].dst;
      srcs[i] = static_cast<const uint8_t*>(src_base) + runs[i].src;
      sizes[i] = static_cast<size_t>(runs[i].bytes);
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    KVFERRY_CUDA_TRY(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attr_idx, 1, stream));
  }
  KVFERRY_CUDA_TRY(cudaEventRecord(done_, stream));
  pending_ = true;
  return Status::Ok();
}

}  // namespace kvferry::kernels
