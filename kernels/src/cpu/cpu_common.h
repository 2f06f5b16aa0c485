#pragma once
// Helpers of the CPU twins: checks shared by validators, and a small parallel-for.
#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/kernels/datapath_types.h"
#include "kvferry/layouts/status.h"

namespace kvferry::kernels::detail {

/// Runs fn(begin, end) over [0, n) split into `threads` contiguous chunks.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t t = std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, n / 64));
  if (t <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t - 1));
  const int64_t chunk = (n + t - 1) / t;
  for (int64_t i = 1; i < t; ++i) {
    const int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

/// Checks a cache view: rank, entry size, dtype size, alignment, bounds inside its region.
inline Status check_cache(const CacheRef& c, const char* what, int rank, int64_t entry_elems, int64_t elem_bytes,
                          int64_t align) {
  const std::string w(what);
  if (c.base == nullptr && c.view.numel() > 0) return {ErrorCode::kInvalidArgument, w + ": base pointer is null"};
  if (c.view.rank != rank)
    return {ErrorCode::kInvalidArgument, w + ": view " + c.view.to_string() + " has rank " +
                                             std::to_string(c.view.rank) + ", expected " + std::to_string(rank)};
  if (c.view.size(-1) != entry_elems)
    return {ErrorCode::kInvalidArgument, w + ": view " + c.view.to_string() + " has last dim " +
                                             std::to_string(c.view.size(-1)) + ", expected " +
                                             std::to_string(entry_elems)};
  if (dtype_size(c.view.dtype) != elem_bytes)
    return {ErrorCode::kInvalidArgument, w + ": view dtype " + std::string(dtype_name(c.view.dtype)) + " is not " +
                                             std::to_string(elem_bytes) + "-byte"};
  Status st = c.view.validate(c.bytes, align);
  if (!st.ok()) return st.with_context(w);
  if (reinterpret_cast<uintptr_t>(c.base) % static_cast<uintptr_t>(align) != 0)
    return {ErrorCode::kMisaligned, w + ": base pointer is not " + std::to_string(align) + "-byte aligned"};
  return Status::Ok();
}

/// check_cache for layer 0 of `layers` layers `stride` bytes apart (a per-layer view of a
/// block-major or layer-major region), and for the last layer, whose offset must not overflow.
inline Status check_cache_layers(const CacheRef& c, const char* what, int64_t entry_elems, int64_t elem_bytes,
                                 int64_t align, int64_t layers, int64_t stride) {
  KVFERRY_TRY(check_cache(c, what, 3, entry_elems, elem_bytes, align));
  if (layers <= 1 || c.view.numel() == 0) return Status::Ok();  // no blocks (a layer-major region of none: stride 0)
  if (stride <= 0 || stride % align != 0)
    return {ErrorCode::kInvalidArgument, std::string(what) + ": layer stride " + std::to_string(stride) +
                                             " B must be a positive multiple of " + std::to_string(align)};
  CacheRef last = c;
  int64_t shift = 0;
  if (__builtin_mul_overflow(layers - 1, stride, &shift) ||
      __builtin_add_overflow(last.view.offset, shift, &last.view.offset))
    return {ErrorCode::kOverflow, std::string(what) + ": layer offsets overflow int64"};
  return check_cache(last, what, 3, entry_elems, elem_bytes, align).with_context("last layer");
}

/// Checks a row-major input: pointer non-null and aligned, row stride (elements) >= width and
/// a multiple of the alignment.
inline Status check_rows(const void* p, int64_t rows, int64_t stride, int64_t width, int64_t elem_bytes, int64_t align,
                         const char* what) {
  const std::string w(what);
  if (rows == 0) return Status::Ok();
  if (p == nullptr) return {ErrorCode::kInvalidArgument, w + " is null"};
  if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(align) != 0)
    return {ErrorCode::kMisaligned, w + " is not " + std::to_string(align) + "-byte aligned"};
  if (rows > 1 && stride < width)
    return {ErrorCode::kInvalidArgument,
            w + " row stride " + std::to_string(stride) + " is below the row width " + std::to_string(width)};
  if ((stride * elem_bytes) % align != 0)
    return {ErrorCode::kMisaligned, w + " row stride " + std::to_string(stride * elem_bytes) +
                                        " B is not a multiple of " + std::to_string(align)};
  return Status::Ok();
}

/// A launcher's engine choice is one of the DatapathEngine values.
inline Status check_engine(DatapathEngine e, const char* what) {
  if (static_cast<int>(e) <= static_cast<int>(DatapathEngine::kBulk)) return {};
  return {ErrorCode::kInvalidArgument,
          std::string(what) + ": engine " + std::to_string(static_cast<int>(e)) + " is not a DatapathEngine"};
}

inline Status check_slots(const int64_t* slots, int64_t n, int64_t limit) {
  if (n > 0 && slots == nullptr) return {ErrorCode::kInvalidArgument, "slot mapping is null"};
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] >= limit)
      return {ErrorCode::kOutOfRange, "slot " + std::to_string(slots[i]) + " of token " + std::to_string(i) +
                                          " is past the cache's " + std::to_string(limit) + " slots"};
  return Status::Ok();
}

}  // namespace kvferry::kernels::detail
