// CUDA engines of copy_blocks: an SM copy kernel (16-byte loads, many in flight per warp, so
// enough bytes are outstanding over PCIe when one side is mapped pinned memory) and
// cudaMemcpyBatchAsync split over a few streams.
//
// The kernel's run list lives in device memory (one small async copy from the pinned staging slot
// ahead of the kernel): an earlier version read it, and binary-searched a chunk prefix per
// 64 KiB chunk, straight from mapped host memory, a dozen dependent PCIe round trips per chunk
// that cost 10-40 % of the rate (most for host-to-device, where those reads queue behind the data).
// Now each warp takes a contiguous range of chunks, searches once (in device memory) and walks on.
// (Read straight from mapped memory with that search, the list cost the kernel engine 0.005-0.015
// at 16 KiB; the staged engine's kernels to host do read theirs there, see staged().)
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>

#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"

namespace kvferry::kernels {
namespace {

constexpr int kCopyThreads = 512;
constexpr int64_t kChunk = 64 << 10;  // bytes of one work item (a piece of one run)

/// One warp copies `len` bytes: kUnroll 16-byte loads per lane in flight, then their stores.
/// Streaming cache hints: the bytes are touched once, keep them out of the engine's L2 working set.
template <int kUnroll>
__device__ __forceinline__ void warp_copy(const uint8_t* __restrict__ s, uint8_t* __restrict__ d, int64_t len,
                                          int lane) {
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15u) == 0) {
    const int64_t nv = len >> 4;
    const uint4* sp = reinterpret_cast<const uint4*>(s) + lane;
    uint4* dp = reinterpret_cast<uint4*>(d) + lane;
    const uint4* const send = reinterpret_cast<const uint4*>(s) + (nv - (nv % (32 * kUnroll)));
#pragma unroll 1
    for (; sp < send; sp += 32 * kUnroll, dp += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(sp + u * 32);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) __stcs(dp + u * 32, v[u]);
    }
    // Tail: fewer than 32 * kUnroll vectors, four loads per lane in flight.
    int rem = static_cast<int>(reinterpret_cast<const uint4*>(s) + nv - sp);  // vectors left, from this lane's
#pragma unroll 1
    for (; rem > 0; rem -= 128, sp += 128, dp += 128) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (u * 32 < rem) v[u] = __ldcs(sp + u * 32);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (u * 32 < rem) __stcs(dp + u * 32, v[u]);
    }
    done = nv << 4;
  }
#pragma unroll 1
  for (int64_t k = done + lane; k < len; k += 32) d[k] = s[k];
}

/// Chunk c of the copy is piece (c - prefix[r]) of run r, where prefix[r] <= c < prefix[r + 1]
/// (prefix[r] = chunks of runs before r; empty runs add none). Warp w copies chunks
/// [total * w / warps, total * (w + 1) / warps).
template <int kUnroll>
__global__ void __launch_bounds__(kCopyThreads)
    copy_chunks_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, const CopyRun* __restrict__ runs,
                       const int64_t* __restrict__ prefix, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t total = prefix[n];
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t c0 = total * w / nwarps, c1 = total * (w + 1) / nwarps;
  if (c0 >= c1) return;
  // The run holding c0, searched by the whole warp: each round the lanes probe 32 points of
  // (lo, hi) at once, so 4096 runs take 3 dependent loads instead of a binary search's 12. The
  // staged engine's kernels to host read their run lists from mapped pinned memory, where each
  // dependent load is a PCIe round trip.
  int64_t lo = 0, hi = n;  // prefix[lo] <= c0 < prefix[hi]
  while (hi - lo > 1) {
    const int64_t p = lo + 1 + (hi - lo - 1) * lane / 32;  // in (lo, hi), non-decreasing in lane
    const unsigned le = __ballot_sync(0xffffffffu, prefix[p] <= c0);
    const int last = le ? 31 - __clz(le) : -1;  // the last lane whose probe is <= c0
    const int64_t new_lo = last >= 0 ? __shfl_sync(0xffffffffu, p, last) : lo;
    const int64_t new_hi = last < 31 ? __shfl_sync(0xffffffffu, p, last + 1) : hi;
    lo = new_lo;
    hi = new_hi;
  }
  int64_t r = lo, rbegin = prefix[lo], rend = prefix[lo + 1];
  CopyRun run = runs[r];
#pragma unroll 1
  for (int64_t c = c0; c < c1; ++c) {
    while (c >= rend) {  // next non-empty run
      ++r;
      rbegin = rend;
      rend = prefix[r + 1];
      run = runs[r];
    }
    const int64_t off = (c - rbegin) * kChunk;
    const int64_t len = run.bytes - off < kChunk ? run.bytes - off : kChunk;
    warp_copy<kUnroll>(src + run.src + off, dst + run.dst + off, len, lane);
  }
}

cudaError_t launch_copy_chunks(const void* src_base, void* dst_base, const CopyRun* runs, const int64_t* prefix,
                               int64_t num_runs, int64_t chunks, int ctas, bool from_host, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  const int64_t warps_per_cta = kCopyThreads / 32;
  int64_t grid = (chunks + warps_per_cta - 1) / warps_per_cta;
  if (grid > ctas) grid = ctas;
  const auto* s = static_cast<const uint8_t*>(src_base);
  auto* d = static_cast<uint8_t*>(dst_base);
  // Reads of host memory take a PCIe round trip: twice the loads in flight per warp.
  if (from_host)
    copy_chunks_kernel<16><<<static_cast<unsigned>(grid), kCopyThreads, 0, stream>>>(s, d, runs, prefix, num_runs);
  else
    copy_chunks_kernel<8><<<static_cast<unsigned>(grid), kCopyThreads, 0, stream>>>(s, d, runs, prefix, num_runs);
  return cudaGetLastError();
}

// Kernel metadata of one copy: prefix[k + 1] then runs[k] per launch; kStaged launches once per
// round, each round at least one run, so 40 bytes per run (plus one) cover every case.
size_t device_bytes(int64_t max_runs) {
  return static_cast<size_t>(max_runs) * (sizeof(CopyRun) + 2 * sizeof(int64_t)) + sizeof(int64_t);
}

size_t staging_bytes(int64_t max_runs) {
  return device_bytes(max_runs) + static_cast<size_t>(max_runs) * (2 * sizeof(void*) + sizeof(size_t));
}

}  // namespace

Result<std::unique_ptr<BlockCopier>> BlockCopier::create(int64_t max_runs, int kernel_ctas) {
  if (max_runs < 1) return Result<std::unique_ptr<BlockCopier>>(ErrorCode::kInvalidArgument, "max_runs must be >= 1");
  std::unique_ptr<BlockCopier> c(new BlockCopier());
  c->max_runs_ = max_runs;
  c->set_kernel_ctas(kernel_ctas);
  int dev = 0;
  KVFERRY_CUDA_TRY(cudaGetDevice(&dev));
  KVFERRY_CUDA_TRY(cudaDeviceGetAttribute(&c->sms_, cudaDevAttrMultiProcessorCount, dev));
  for (Slot& s : c->slots_) {
    KVFERRY_CUDA_TRY(cudaHostAlloc(&s.staging, staging_bytes(max_runs), cudaHostAllocMapped | cudaHostAllocPortable));
    KVFERRY_CUDA_TRY(cudaHostGetDevicePointer(&s.staging_dev, s.staging, 0));
    KVFERRY_CUDA_TRY(cudaMalloc(&s.dev, device_bytes(max_runs)));
    KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
  }
  for (int i = 0; i < kCopyMaxDmaStreams - 1; ++i) {
    KVFERRY_CUDA_TRY(cudaStreamCreateWithFlags(&c->aux_[i], cudaStreamNonBlocking));
    KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->join_[i], cudaEventDisableTiming));
  }
  KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->fork_, cudaEventDisableTiming));
  KVFERRY_CUDA_TRY(cudaStreamCreateWithFlags(&c->kstream_, cudaStreamNonBlocking));
  KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->kfork_, cudaEventDisableTiming));
  KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->kjoin_, cudaEventDisableTiming));
  for (int i = 0; i < kCopyStageParts; ++i) {
    KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->piece_k_[i], cudaEventDisableTiming));
    KVFERRY_CUDA_TRY(cudaEventCreateWithFlags(&c->piece_d_[i], cudaEventDisableTiming));
  }
  return Result<std::unique_ptr<BlockCopier>>(std::move(c));
}

BlockCopier::~BlockCopier() {
  for (Slot& s : slots_) {
    if (s.done) {
      if (s.pending) (void)cudaEventSynchronize(s.done);
      (void)cudaEventDestroy(s.done);
    }
    if (s.staging) (void)cudaFreeHost(s.staging);
    if (s.dev) (void)cudaFree(s.dev);
  }
  if (stage_) (void)cudaFree(stage_);
  for (int i = 0; i < kCopyMaxDmaStreams - 1; ++i) {
    if (aux_[i]) (void)cudaStreamDestroy(aux_[i]);
    if (join_[i]) (void)cudaEventDestroy(join_[i]);
  }
  if (fork_) (void)cudaEventDestroy(fork_);
  if (kstream_) (void)cudaStreamDestroy(kstream_);
  for (cudaEvent_t e : {kfork_, kjoin_})
    if (e) (void)cudaEventDestroy(e);
  for (int i = 0; i < kCopyStageParts; ++i) {
    if (piece_k_[i]) (void)cudaEventDestroy(piece_k_[i]);
    if (piece_d_[i]) (void)cudaEventDestroy(piece_d_[i]);
  }
}

int BlockCopier::kernel_ctas_for(CopyDirection d) const {
  if (ctas_ > 0) return ctas_;
  switch (d) {
    case CopyDirection::kDeviceToHost: return kCopyKernelCtasToHost;
    case CopyDirection::kHostToDevice:
    case CopyDirection::kHostToHost: return kCopyKernelCtasFromHost;
    case CopyDirection::kDeviceToDevice: return 2 * sms_;
  }
  return kCopyKernelCtasToHost;
}

Result<CopyDirection> BlockCopier::direction(const void* src, const void* dst) const {
  bool host[2] = {false, false};
  const void* p[2] = {src, dst};
  for (int i = 0; i < 2; ++i) {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p[i]);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Result<CopyDirection>(ErrorCode::kInvalidArgument,
                                   std::string("copy_blocks: cannot tell what memory the ") +
                                       (i ? "destination" : "source") + " is: " + cudaGetErrorString(e));
    }
    if (a.type == cudaMemoryTypeUnregistered)
      return Result<CopyDirection>(ErrorCode::kInvalidArgument,
                                   std::string("copy_blocks: the ") + (i ? "destination" : "source") +
                                       " is pageable host memory; the copy kernel needs device or pinned memory");
    host[i] = a.type == cudaMemoryTypeHost;
  }
  return Result<CopyDirection>(static_cast<CopyDirection>((host[0] ? 2 : 0) | (host[1] ? 1 : 0)));
}

Status BlockCopier::dma(void** dsts, void** srcs, size_t* sizes, size_t count, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  size_t ends[kCopyMaxDmaStreams];
  const int parts = split_copy_sizes(std::span<const size_t>(sizes, count), dma_streams_, ends);
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  if (parts > 1) {
    KVFERRY_CUDA_TRY(cudaEventRecord(fork_, stream));
    for (int p = 1; p < parts; ++p) KVFERRY_CUDA_TRY(cudaStreamWaitEvent(aux_[p - 1], fork_, 0));
  }
  size_t begin = 0;
  for (int p = 0; p < parts; ++p) {
    const size_t end = ends[p];
    cudaStream_t st = p == 0 ? stream : aux_[p - 1];
    KVFERRY_CUDA_TRY(
        cudaMemcpyBatchAsync(dsts + begin, srcs + begin, sizes + begin, end - begin, &attr, &attr_idx, 1, st));
    if (p > 0) {
      KVFERRY_CUDA_TRY(cudaEventRecord(join_[p - 1], st));
      KVFERRY_CUDA_TRY(cudaStreamWaitEvent(stream, join_[p - 1], 0));
    }
    begin = end;
  }
  return Status::Ok();
}

Status BlockCopier::staged(const void* src_base, void* dst_base, std::span<const CopyRun> runs, bool to_host,
                           Slot& slot, cudaStream_t stream) {
  if (stage_ == nullptr) KVFERRY_CUDA_TRY(cudaMalloc(&stage_, static_cast<size_t>(kCopyStageBytes)));
  auto* meta = static_cast<int64_t*>(slot.staging);  // packed per piece: prefix[k + 1], runs[k]
  auto* dev_meta = static_cast<int64_t*>(slot.dev);
  auto** dsts = reinterpret_cast<void**>(static_cast<uint8_t*>(slot.staging) + device_bytes(max_runs_));
  auto** srcs = dsts + max_runs_;
  auto* sizes = reinterpret_cast<size_t*>(srcs + max_runs_);
  auto* src = static_cast<const uint8_t*>(src_base);
  auto* dst = static_cast<uint8_t*>(dst_base);
  auto part_at = [this](int part) { return static_cast<uint8_t*>(stage_) + part * kCopyStagePiece; };
  // The plan: pieces of runs laid out back to back in their ring part (the kernel moves their
  // device side, DMA their host side, merged where host ranges follow each other), and runs too
  // big for a piece, which go by DMA as they are. plan_next() appends the next piece (false when
  // none is left).
  pieces_.clear();
  size_t meta_at = 0, dma_at = 0;  // used entries of the slot's arrays
  const size_t n = runs.size();
  int64_t total = 0;  // bytes that go through the stage
  for (const CopyRun& r : runs)
    if (r.bytes <= kCopyStagePiece) total += r.bytes;
  // The kernel of the first piece (to host) or of the last (from host) is not overlapped: that
  // piece is kCopyStageLead bytes (about: runs are not split), the others up to a part. From host,
  // the first piece takes what is left over so that the last one comes out at the lead's size.
  int64_t cap =
      to_host || total <= kCopyStageLead ? kCopyStageLead : (total - kCopyStageLead - 1) % kCopyStagePiece + 1;
  int staged_pieces = 0;
  size_t i = 0;
  auto plan_next = [&]() -> bool {
    while (i < n && runs[i].bytes == 0) ++i;
    if (i >= n) return false;
    Piece pc;
    pc.dma_begin = dma_at;
    if (runs[i].bytes > kCopyStagePiece) {
      dsts[dma_at] = dst + runs[i].dst;
      srcs[dma_at] = const_cast<uint8_t*>(src) + runs[i].src;
      sizes[dma_at] = static_cast<size_t>(runs[i].bytes);
      pc.dma_end = ++dma_at;
      pieces_.push_back(pc);
      ++i;
      return true;
    }
    pc.part = staged_pieces % kCopyStageParts;
    pc.reuses = staged_pieces >= kCopyStageParts;
    ++staged_pieces;
    uint8_t* const stage = part_at(pc.part);
    size_t j = i;
    int64_t bytes = 0;
    while (j < n && runs[j].bytes <= kCopyStagePiece && (j == i || bytes + runs[j].bytes <= cap))
      bytes += runs[j++].bytes;
    cap = kCopyStagePiece;
    const size_t k = j - i;
    int64_t* prefix = meta + meta_at;
    auto* kruns = reinterpret_cast<CopyRun*>(prefix + k + 1);
    prefix[0] = 0;
    int64_t soff = 0, host_next = -1;
    for (size_t q = 0; q < k; ++q) {
      const CopyRun& r = runs[i + q];
      kruns[q] = to_host ? CopyRun{r.src, soff, r.bytes} : CopyRun{soff, r.dst, r.bytes};
      prefix[q + 1] = prefix[q] + (r.bytes + kChunk - 1) / kChunk;
      if (r.bytes > 0) {
        const int64_t host_at = to_host ? r.dst : r.src;
        if (host_at == host_next && dma_at > pc.dma_begin) {
          sizes[dma_at - 1] += static_cast<size_t>(r.bytes);
        } else {
          dsts[dma_at] = to_host ? dst + r.dst : stage + soff;
          srcs[dma_at] = to_host ? stage + soff : const_cast<uint8_t*>(src) + r.src;
          sizes[dma_at] = static_cast<size_t>(r.bytes);
          ++dma_at;
        }
        host_next = host_at + r.bytes;
      }
      soff += r.bytes;
    }
    pc.dma_end = dma_at;
    pc.runs = k;
    pc.chunks = prefix[k];
    pc.meta_at = meta_at;
    meta_at += (k + 1) + k * (sizeof(CopyRun) / sizeof(int64_t));
    pieces_.push_back(pc);
    i = j;
    return true;
  };
  // A piece's host side (DMA on `stream`) and device side (the kernel on kstream_, which starts
  // behind what `stream` held before, from host also behind the run lists' copy, and joins
  // `stream` at the end). A ring part's previous user (the DMA or the kernel that read it) must be
  // done before the part is written again.
  auto host_side = [&](const Piece& pc) -> Status {
    KVFERRY_TRY(dma(dsts + pc.dma_begin, srcs + pc.dma_begin, sizes + pc.dma_begin, pc.dma_end - pc.dma_begin, stream));
    if (pc.runs > 0) KVFERRY_CUDA_TRY(cudaEventRecord(piece_d_[pc.part], stream));
    return Status::Ok();
  };
  // To host the kernels read their run lists straight from the slot's mapped pinned memory: no
  // copy of them waits behind the host-to-device DMAs of a load running at the same time (one
  // did, on kstream_: both ways at 64 KiB, 0.98 -> 0.53 of the both-ways copy, the save waiting
  // for the whole load). From host one copy of them follows the first piece's DMA on `stream`.
  const int64_t* const kmeta = to_host ? static_cast<const int64_t*>(slot.staging_dev) : dev_meta;
  auto device_side = [&](const Piece& pc) -> Status {
    uint8_t* const stage = part_at(pc.part);
    KVFERRY_CUDA_TRY(
        launch_copy_chunks(to_host ? static_cast<const void*>(src) : stage, to_host ? static_cast<void*>(stage) : dst,
                           reinterpret_cast<const CopyRun*>(kmeta + pc.meta_at + pc.runs + 1), kmeta + pc.meta_at,
                           static_cast<int64_t>(pc.runs), pc.chunks, 2 * sms_, false, kstream_));
    KVFERRY_CUDA_TRY(cudaEventRecord(piece_k_[pc.part], kstream_));
    return Status::Ok();
  };
  auto fork = [&]() -> Status {
    KVFERRY_CUDA_TRY(cudaEventRecord(kfork_, stream));
    KVFERRY_CUDA_TRY(cudaStreamWaitEvent(kstream_, kfork_, 0));
    return Status::Ok();
  };
  auto enqueue = [&](const Piece& pc) -> Status {
    if (pc.runs == 0) return host_side(pc);
    if (to_host) {
      if (pc.reuses) KVFERRY_CUDA_TRY(cudaStreamWaitEvent(kstream_, piece_d_[pc.part], 0));
      KVFERRY_TRY(device_side(pc));
      KVFERRY_CUDA_TRY(cudaStreamWaitEvent(stream, piece_k_[pc.part], 0));
      return host_side(pc);
    }
    if (pc.reuses) KVFERRY_CUDA_TRY(cudaStreamWaitEvent(stream, piece_k_[pc.part], 0));
    KVFERRY_TRY(host_side(pc));
    KVFERRY_CUDA_TRY(cudaStreamWaitEvent(kstream_, piece_d_[pc.part], 0));
    return device_side(pc);
  };
  // The GPU starts on the first piece while the host plans the others (planning every piece first
  // left the GPU idle for the whole plan: kernels/DESIGN.md §5). From host the first piece's DMA
  // needs no run list and goes first; the run lists follow it in one copy on `stream` (a copy per
  // piece, or one from another stream between host-to-device DMAs, delayed those DMAs).
  if (!plan_next()) return Status::Ok();
  if (to_host) {
    KVFERRY_TRY(fork());
    KVFERRY_TRY(enqueue(pieces_[0]));
    while (plan_next()) {
    }
  } else {
    KVFERRY_TRY(host_side(pieces_[0]));  // the first piece reuses no ring part
    while (plan_next()) {
    }
    if (meta_at > 0)
      KVFERRY_CUDA_TRY(cudaMemcpyAsync(dev_meta, meta, meta_at * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
    KVFERRY_TRY(fork());
    if (pieces_[0].runs > 0) {
      KVFERRY_CUDA_TRY(cudaStreamWaitEvent(kstream_, piece_d_[pieces_[0].part], 0));
      KVFERRY_TRY(device_side(pieces_[0]));
    }
  }
  for (size_t p = 1; p < pieces_.size(); ++p) KVFERRY_TRY(enqueue(pieces_[p]));
  KVFERRY_CUDA_TRY(cudaEventRecord(kjoin_, kstream_));
  KVFERRY_CUDA_TRY(cudaStreamWaitEvent(stream, kjoin_, 0));
  return Status::Ok();
}

Status BlockCopier::copy(const void* src_base, void* dst_base, std::span<const CopyRun> runs, CopyEngine engine,
                         cudaStream_t stream, int64_t auto_threshold) {
  if (runs.empty()) return Status::Ok();
  if (static_cast<int64_t>(runs.size()) > max_runs_)
    return {ErrorCode::kInvalidArgument,
            "copy_blocks: " + std::to_string(runs.size()) + " runs but the copier holds " + std::to_string(max_runs_)};
  if (stream == nullptr || stream == cudaStreamLegacy)
    return {ErrorCode::kInvalidArgument, "copy_blocks: needs an explicit stream (not the legacy default stream)"};
  if (src_base == nullptr || dst_base == nullptr)
    return {ErrorCode::kInvalidArgument, "copy_blocks: null base pointer"};
  CopyEngine e = choose_copy_engine(runs, engine, auto_threshold);
  CopyDirection dir = CopyDirection::kDeviceToDevice;
  if (e == CopyEngine::kKernel || e == CopyEngine::kStaged) {
    KVFERRY_ASSIGN_OR_RETURN(dir, direction(src_base, dst_base));
  }
  const bool one_host_side = dir == CopyDirection::kDeviceToHost || dir == CopyDirection::kHostToDevice;
  if (engine == CopyEngine::kAuto && e == CopyEngine::kKernel && one_host_side) {
    int64_t total = 0;
    for (const CopyRun& r : runs) total += r.bytes;
    const int64_t copies = count_host_copies(runs, dir == CopyDirection::kHostToDevice);
    if (copies > 0 && total / copies >= auto_threshold) e = CopyEngine::kStaged;
  }
  if (e == CopyEngine::kStaged && !one_host_side)
    e = dir == CopyDirection::kDeviceToDevice ? CopyEngine::kKernel : CopyEngine::kDma;
  Slot& slot = slots_[next_];
  if (slot.pending) {
    KVFERRY_CUDA_TRY(cudaEventSynchronize(slot.done));
    slot.pending = false;
  }
  const size_t n = runs.size();
  // Staging slot: the kernel's metadata packed for this copy (prefix[n + 1], then runs[n], one
  // async copy to the device slot), then the DMA pointer arrays at fixed places.
  auto* prefix = static_cast<int64_t*>(slot.staging);
  auto* staged_runs = reinterpret_cast<CopyRun*>(prefix + n + 1);
  auto** dsts = reinterpret_cast<void**>(static_cast<uint8_t*>(slot.staging) + device_bytes(max_runs_));
  auto** srcs = dsts + max_runs_;
  auto* sizes = reinterpret_cast<size_t*>(srcs + max_runs_);
  if (e == CopyEngine::kStaged) {
    KVFERRY_TRY(staged(src_base, dst_base, runs, dir == CopyDirection::kDeviceToHost, slot, stream));
  } else if (e == CopyEngine::kKernel) {
    std::memcpy(staged_runs, runs.data(), n * sizeof(CopyRun));
    prefix[0] = 0;
    for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + (runs[i].bytes + kChunk - 1) / kChunk;
    auto* dev_prefix = static_cast<int64_t*>(slot.dev);
    auto* dev_runs = reinterpret_cast<const CopyRun*>(dev_prefix + n + 1);
    if (prefix[n] > 0) {
      KVFERRY_CUDA_TRY(cudaMemcpyAsync(slot.dev, slot.staging, (n + 1) * sizeof(int64_t) + n * sizeof(CopyRun),
                                       cudaMemcpyHostToDevice, stream));
      const bool from_host = dir == CopyDirection::kHostToDevice || dir == CopyDirection::kHostToHost;
      KVFERRY_CUDA_TRY(launch_copy_chunks(src_base, dst_base, dev_runs, dev_prefix, static_cast<int64_t>(n), prefix[n],
                                          kernel_ctas_for(dir), from_host, stream));
    }
  } else {
    // Empty runs are left out (a batch entry of 0 bytes is not a copy).
    size_t m = 0;
    for (size_t i = 0; i < n; ++i) {
      if (runs[i].bytes == 0) continue;
      dsts[m] = static_cast<uint8_t*>(dst_base) + runs[i].dst;
      srcs[m] = const_cast<uint8_t*>(static_cast<const uint8_t*>(src_base)) + runs[i].src;
      sizes[m] = static_cast<size_t>(runs[i].bytes);
      ++m;
    }
    KVFERRY_TRY(dma(dsts, srcs, sizes, m, stream));
  }
  KVFERRY_CUDA_TRY(cudaEventRecord(slot.done, stream));
  slot.pending = true;
  next_ ^= 1;
  last_engine_ = e;
  last_dir_ = dir;
  return Status::Ok();
}

}  // namespace kvferry::kernels
