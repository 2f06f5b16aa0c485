#pragma once
// TensorView: Shape + Stride over bytes of a region. Sizes and strides are int64, strides in
// elements of `dtype`, `offset` in bytes from the region's base. Usable from device code.
#include <cstdint>
#include <initializer_list>

#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <string>
#include "kvferry/layouts/status.h"
#endif

namespace kvferry {

constexpr int kMaxRank = 5;

/// A strided view `(sizes):(strides)` of `dtype` elements starting `offset` bytes into a region.
struct TensorView {
  DType dtype = DType::kU8;
  int rank = 0;
  int64_t sizes[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};  ///< in elements
  int64_t offset = 0;              ///< bytes from the region base

  KVFERRY_HOST_DEVICE int64_t size(int d) const { return sizes[d < 0 ? rank + d : d]; }
  KVFERRY_HOST_DEVICE int64_t stride(int d) const { return strides[d < 0 ? rank + d : d]; }
  KVFERRY_HOST_DEVICE int64_t elem_bytes() const { return dtype_size(dtype); }
  KVFERRY_HOST_DEVICE int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= sizes[i];
    return n;
  }

  /// Byte offset (from the region base) of the element at `coord` (rank entries). 64-bit math.
  KVFERRY_HOST_DEVICE int64_t offset_of(const int64_t* coord) const {
    int64_t e = 0;
    for (int i = 0; i < rank; ++i) e += coord[i] * strides[i];
    return offset + e * dtype_size(dtype);
  }
  /// Byte offset of element (i0, i1, ...) for rank up to 4.
  KVFERRY_HOST_DEVICE int64_t offset_at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    const int64_t c[4] = {i0, i1, i2, i3};
    int64_t e = 0;
    for (int i = 0; i < rank && i < 4; ++i) e += c[i] * strides[i];
    return offset + e * dtype_size(dtype);
  }

  /// A view of the first `n` elements of the last dim (e.g. V = K[..., :512]).
  KVFERRY_HOST_DEVICE TensorView narrow_last(int64_t n) const {
    TensorView v = *this;
    v.sizes[rank - 1] = n;
    return v;
  }

#if !defined(__CUDA_ARCH__)
  /// "(4,64,576):(147456,576,1)" plus "+offset" when the offset is not zero.
  std::string to_string() const {
    std::string s = "(";
    for (int i = 0; i < rank; ++i) s += (i ? "," : "") + std::to_string(sizes[i]);
    s += "):(";
    for (int i = 0; i < rank; ++i) s += (i ? "," : "") + std::to_string(strides[i]);
    s += ")";
    if (offset != 0) s += "+" + std::to_string(offset) + "B";
    return s;
  }

  /// Checks the view is usable inside a region of `region_bytes` bytes: rank in range, sizes and
  /// strides non-negative, innermost stride 1, offset and every stride aligned to `align` bytes
  /// (the element size at least), every byte it addresses inside [0, region_bytes), and no
  /// int64 overflow on the way. The message names the culprit.
  Status validate(int64_t region_bytes, int64_t align = 0) const {
    const int64_t eb = dtype_size(dtype);
    if (rank < 1 || rank > kMaxRank)
      return {ErrorCode::kInvalidArgument,
              "view rank " + std::to_string(rank) + " is outside [1, " + std::to_string(kMaxRank) + "]"};
    if (eb == 0) return {ErrorCode::kInvalidArgument, "view has an unknown dtype"};
    if (align < eb) align = eb;
    for (int i = 0; i < rank; ++i) {
      if (sizes[i] < 0)
        return {ErrorCode::kInvalidArgument,
                "size(" + std::to_string(i) + ") = " + std::to_string(sizes[i]) + " is negative"};
      if (strides[i] < 0)
        return {ErrorCode::kInvalidArgument,
                "stride(" + std::to_string(i) + ") = " + std::to_string(strides[i]) + " is negative"};
    }
    if (strides[rank - 1] != 1 && sizes[rank - 1] > 1)
      return {ErrorCode::kInvalidArgument, "stride(-1) = " + std::to_string(strides[rank - 1]) +
                                               " but the innermost dimension must be contiguous (1) in " + to_string()};
    if (offset < 0) return {ErrorCode::kOutOfRange, "view offset " + std::to_string(offset) + " is negative"};
    if (offset % align != 0)
      return {ErrorCode::kMisaligned,
              "view offset " + std::to_string(offset) + " is not a multiple of " + std::to_string(align) + " bytes"};
    for (int i = 0; i < rank - 1; ++i) {
      int64_t sb = 0;
      if (__builtin_mul_overflow(strides[i], eb, &sb))
        return {ErrorCode::kOverflow, "stride(" + std::to_string(i) + ") in bytes overflows int64"};
      if (sizes[i] > 1 && sb % align != 0)
        return {ErrorCode::kMisaligned, "stride(" + std::to_string(i) + ") = " + std::to_string(sb) +
                                            " bytes is not a multiple of " + std::to_string(align)};
    }
    for (int i = 0; i < rank; ++i)
      if (sizes[i] == 0) return Status::Ok();  // empty view addresses nothing
    int64_t last = 0;                          // element offset of the last element
    for (int i = 0; i < rank; ++i) {
      int64_t t = 0;
      if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &t) || __builtin_add_overflow(last, t, &last))
        return {ErrorCode::kOverflow,
                "view " + to_string() + " spans more than int64 elements (dim " + std::to_string(i) + ")"};
    }
    int64_t end = 0;
    if (__builtin_add_overflow(last, int64_t{1}, &end) || __builtin_mul_overflow(end, eb, &end) ||
        __builtin_add_overflow(end, offset, &end))
      return {ErrorCode::kOverflow, "view " + to_string() + " ends past int64 bytes"};
    if (end > region_bytes)
      return {ErrorCode::kOutOfRange, "view " + to_string() + " ends at byte " + std::to_string(end) +
                                          ", past the region's " + std::to_string(region_bytes) + " bytes"};
    return Status::Ok();
  }
#endif
};

/// Builds a view from sizes and strides (elements) and a byte offset.
KVFERRY_HOST_DEVICE TensorView make_view(DType dtype, int rank, const int64_t* sizes, const int64_t* strides,
                                         int64_t offset) {
  TensorView v;
  v.dtype = dtype;
  v.rank = rank;
  for (int i = 0; i < rank; ++i) {
    v.sizes[i] = sizes[i];
    v.strides[i] = strides[i];
  }
  v.offset = offset;
  return v;
}

/// A contiguous row-major view of `sizes` (strides derived), starting `offset` bytes in.
inline TensorView contiguous_view(DType dtype, std::initializer_list<int64_t> sizes, int64_t offset = 0) {
  TensorView v;
  v.dtype = dtype;
  v.rank = static_cast<int>(sizes.size());
  int i = 0;
  for (int64_t s : sizes) v.sizes[i++] = s;
  int64_t st = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.strides[d] = st;
    st *= v.sizes[d];
  }
  v.offset = offset;
  return v;
}

}  // namespace kvferry
