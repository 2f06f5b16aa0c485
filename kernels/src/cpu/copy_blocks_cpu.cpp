// CPU backend of copy_blocks (memcpy of byte runs) and the engine choice shared with CUDA.
//
// kAuto's engine choice (kCopyAutoThreshold, staged below it where the pool side merges) and the
// measurements that chose it: kernels/DESIGN.md §5.
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
    case CopyEngine::kStaged: return "staged";
  }
  return "?";
}

const char* copy_direction_name(CopyDirection d) {
  switch (d) {
    case CopyDirection::kDeviceToDevice: return "d2d";
    case CopyDirection::kDeviceToHost: return "d2h";
    case CopyDirection::kHostToDevice: return "h2d";
    case CopyDirection::kHostToHost: return "h2h";
  }
  return "?";
}

namespace {

/// Splits items of sizes size(i), i < count, into at most `parts` consecutive ranges of about
/// equal bytes (see split_copy_runs).
template <class Size>
int split_by_bytes(size_t count, Size&& size, int parts, std::span<size_t> ends) {
  if (count == 0 || parts < 1 || ends.empty()) return 0;
  if (static_cast<size_t>(parts) > ends.size()) parts = static_cast<int>(ends.size());
  if (static_cast<size_t>(parts) > count) parts = static_cast<int>(count);
  int64_t total = 0;
  for (size_t i = 0; i < count; ++i) total += size(i);
  int n = 0;
  int64_t acc = 0;
  for (size_t i = 0; i < count && n < parts - 1; ++i) {
    acc += size(i);
    // Close range n once it holds its share (n + 1) / parts of the bytes, leaving at least one
    // item for each range still to come.
    const bool share = total > 0 ? acc * parts >= total * (n + 1) : (i + 1) * parts >= count * (n + 1);
    if (share && count - (i + 1) >= static_cast<size_t>(parts - 1 - n)) ends[static_cast<size_t>(n++)] = i + 1;
  }
  ends[static_cast<size_t>(n++)] = count;
  return n;
}

}  // namespace

int split_copy_runs(std::span<const CopyRun> runs, int parts, std::span<size_t> ends) {
  return split_by_bytes(
      runs.size(), [&](size_t i) { return runs[i].bytes; }, parts, ends);
}

int split_copy_sizes(std::span<const size_t> sizes, int parts, std::span<size_t> ends) {
  return split_by_bytes(
      sizes.size(), [&](size_t i) { return static_cast<int64_t>(sizes[i]); }, parts, ends);
}

int64_t count_host_copies(std::span<const CopyRun> runs, bool host_is_src) {
  int64_t copies = 0;
  int64_t next = -1;  // where the host side of the previous non-empty run ended
  for (const CopyRun& r : runs) {
    if (r.bytes == 0) continue;
    const int64_t at = host_is_src ? r.src : r.dst;
    if (at != next) ++copies;
    next = at + r.bytes;
  }
  return copies;
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
