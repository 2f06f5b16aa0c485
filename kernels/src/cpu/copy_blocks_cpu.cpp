// CPU backend of copy_blocks (memcpy of byte runs) and the engine choice shared with CUDA.
//
// Threshold of kAuto (kCopyAutoThreshold = 256 KiB): on an H200, cudaMemcpyBatchAsync of 4096
// scattered blocks reaches 0.45 / 0.75 / 0.92 / 0.97 / 0.995 of a 1 GiB pinned copy at
// 16 KiB / 64 KiB / 256 KiB / 1 MiB / 4 MiB, a copy kernel on mapped pinned memory 0.92-0.95 at
// every size (DESIGN.md section 8, ENVIRONMENT.md); they meet at about 256 KiB, and from there
// DMA leaves the SMs to the engine. `kvferry-bench copy` re-measures both on the machine at hand.
#include <cstring>
#include <string>

#include "cpu/cpu_common.h"
#include "kvferry/kernels/copy_blocks.h"

namespace kvferry::kernels {

const char* copy_engine_name(CopyEngine e) {
  switch (e) {
    case CopyEngine::kAuto: return "auto";
    case CopyEngine::kKernel: return "kernel";
    case CopyEngine::kDma: return "dma";
  }
  return "?";
}

CopyEngine choose_copy_engine(std::span<const CopyRun> runs, CopyEngine e, int64_t auto_threshold) {
  if (e != CopyEngine::kAuto) return e;
  if (runs.empty()) return CopyEngine::kDma;
  int64_t total = 0;
  for (const CopyRun& r : runs) total += r.bytes;
  return total / static_cast<int64_t>(runs.size()) < auto_threshold ? CopyEngine::kKernel : CopyEngine::kDma;
}

Status validate_copy_runs(std::span<const CopyRun> runs, int64_t src_bytes, int64_t dst_bytes) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const CopyRun& r = runs[i];
    int64_t se = 0, de = 0;
    if (r.src < 0 || r.dst < 0 || r.bytes < 0)
      return {ErrorCode::kInvalidArgument, "copy run " + std::to_string(i) + " has a negative offset or size"};
    if (__builtin_add_overflow(r.src, r.bytes, &se) || __builtin_add_overflow(r.dst, r.bytes, &de))
      return {ErrorCode::kOverflow, "copy run " + std::to_string(i) + " overflows int64"};
    if (se > src_bytes)
      return {ErrorCode::kOutOfRange, "copy run " + std::to_string(i) + " reads up to byte " + std::to_string(se) +
                                          ", past the source's " + std::to_string(src_bytes)};
    if (de > dst_bytes)
      return {ErrorCode::kOutOfRange, "copy run " + std::to_string(i) + " writes up to byte " + std::to_string(de) +
                                          ", past the destination's " + std::to_string(dst_bytes)};
  }
  return Status::Ok();
}

Status copy_blocks_cpu(const void* src_base, int64_t src_bytes, void* dst_base, int64_t dst_bytes,
                       std::span<const CopyRun> runs, const CpuOptions& opt) {
  KVFERRY_TRY(validate_copy_runs(runs, src_bytes, dst_bytes));
  if (!runs.empty() && (src_base == nullptr || dst_base == nullptr))
    return {ErrorCode::kInvalidArgument, "copy_blocks: null base pointer"};
  const auto* s = static_cast<const uint8_t*>(src_base);
  auto* d = static_cast<uint8_t*>(dst_base);
  detail::parallel_for(static_cast<int64_t>(runs.size()), opt.threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(d + runs[i].dst, s + runs[i].src, static_cast<size_t>(runs[i].bytes));
  });
  return Status::Ok();
}

}  // namespace kvferry::kernels
