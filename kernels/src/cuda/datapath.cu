// CUDA kernels of the data path: cache writers, gathers, format conversions, indexer writer.
// Three engines, all bit-identical to the CPU twins: "direct" kernels keep a warp's next item in
// registers (data loads one item ahead, index loads two, pipeline()); "staged" kernels stream
// items through a per-warp ring of shared-memory stages filled by cp.async (staged()); "bulk"
// kernels (sm_90, the conversions) stream units of a block's entries through a per-CTA ring
// filled by bulk copies (bulk_units()). Each launcher picks the engine that measured faster for
// its kernel (use_staged, use_bulk). Grids are one resident wave looping grid-stride (the bulk
// kernels: grid-stride over units, or one range of units per CTA on a whole layer view); 16-byte
// vector accesses; every entry addressed through the view's strides in 64-bit (CacheRef::entry).
// The math gives the CPU twins' bits
// (common/datapath_math.h): quantisation divides through the reciprocal with two Markstein
// corrections (no per-value range checks: the scale's range is checked once, overflow and NaN
// show up as the cvt's NaN code) and converts pairs with the packed e4m3 cvt; power-of-two scales
// multiply once; dequantisation converts e4m3 pairs to f16 in hardware (exact), multiplies once
// and packs pairs to bf16; every warp-wide store covers whole sectors; loop-invariant divisors
// (block size, row chunks) divide by multiply-high. Inputs outside the fast paths' exact range
// (NaN, extreme scales) take the scalar path, kept out of line. The direct write_mha fp8 and
// indexer writers write their rows with an L2 evict-first policy (st_v8_once); the indexer also
// reads with it where an item's slots are scattered (ld_v16_once).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/datapath_math.h"
#include "common/mbarrier.cuh"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/gather.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint4 ld_v16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void st_v16(uint8_t* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ uint2 ld_v8(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ void st_v8(uint8_t* p, uint2 v) { *reinterpret_cast<uint2*>(p) = v; }

// Global memory only: the same accesses with an L2 evict-first policy, for bytes a kernel touches
// once. write_mha fp8 and the indexer write their fp8 rows this way, and the indexer reads its
// 16-bit input this way where its slots are scattered: the input and output streams then leave the
// L2 first, so the lines that random slots fill piecemeal (the indexer's 4-byte scales, entries
// that share a line with a neighbour written later) stay long enough to be completed there instead
// of being written back part-filled. Where it cost more than it gained on an H200 (write_mla fp8,
// write_mla fp8_ds, bf16 -> 656, the loads of slots that run in order) the kernels access memory
// plainly; kernels/DESIGN.md §2.2 has the figures. The policy is a hint: the bytes written are the same.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 ld_v16_once(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.b32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(evict_first_policy()));
  return v;
}
__device__ __forceinline__ void st_v8_once(uint8_t* p, uint2 v) {
  asm volatile("st.global.L2::cache_hint.v2.b32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(v.x), "r"(v.y),
               "l"(evict_first_policy())
               : "memory");
}

struct H8 {
  uint16_t h[8];
};
__device__ __forceinline__ H8 unpack(uint4 v) {
  H8 r;
  memcpy(r.h, &v, 16);
  return r;
}

/// A loop-invariant divisor d in [1, 2^31) with its Granlund-Montgomery multiplier: a / d for
/// a < 2^32 costs a multiply-high, two adds and two shifts instead of a division sequence (these
/// kernels divide token, slot and group indices by block and row sizes in their inner loops).
/// Larger dividends (or divisors) take the plain 64-bit division.
struct Div {
  int64_t d = 1;
  uint32_t m = 1, sh1 = 0, sh2 = 0;
  bool fast = false;
};
__device__ __forceinline__ Div make_div(int64_t d) {
  Div v;
  v.d = d;
  v.fast = d >= 1 && d < (int64_t{1} << 31);
  if (v.fast) {
    const uint32_t d32 = static_cast<uint32_t>(d);
    const uint32_t l = d32 <= 1 ? 0u : 32u - static_cast<uint32_t>(__clz(d32 - 1));  // ceil(log2 d)
    v.m = static_cast<uint32_t>((((uint64_t{1} << l) - d32) << 32) / d32) + 1u;
    v.sh1 = l < 1 ? l : 1u;
    v.sh2 = l < 1 ? 0u : l - 1u;
  }
  return v;
}
/// q = a / d, r = a % d for a >= 0.
__device__ __forceinline__ void divmod(int64_t a, const Div& v, int64_t& q, int64_t& r) {
  if (v.fast && (a >> 32) == 0) {
    const uint32_t n = static_cast<uint32_t>(a);
    const uint32_t t = __umulhi(n, v.m);
    const uint32_t q32 = (t + ((n - t) >> v.sh1)) >> v.sh2;
    q = q32;
    r = a - static_cast<int64_t>(q32) * v.d;
  } else {
    q = a / v.d;
    r = a - q * v.d;
  }
}

__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ int64_t total_warps() { return (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5; }

/// min(want, the device's SMs x per_sm), at least 1: the blocks of one resident wave.
inline unsigned one_wave(int64_t want, int per_sm) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t cap = static_cast<int64_t>(sms) * per_sm;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

/// Blocks for `items` work items handled `per_warp` at a time: at most one full wave of the
/// kernel's resident blocks (occupancy query, cached per kernel; at most `max_per_sm` per SM where
/// that is set), which then loop grid-stride, so no partial last wave leaves SMs idle while the
/// others drain.
template <auto kKernel>
unsigned grid_for(int64_t items, int64_t per_warp, int max_per_sm = 0) {
  static const int per_sm = [] {
    // Kernels that stage through shared memory want all of it (the L1 share shrinks).
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kKernel) == cudaSuccess && fa.sharedSizeBytes > 0)
      (void)cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0) != cudaSuccess || b < 1) b = 1;
    return b;
  }();
  const int64_t warps = (items + per_warp - 1) / per_warp;
  return one_wave((warps + kWarps - 1) / kWarps, max_per_sm > 0 && max_per_sm < per_sm ? max_per_sm : per_sm);
}

// ---- vector conversions: fast paths bit-identical to the scalar math, scalar fallback ----

/// Two floats -> two bf16 (lo in the low half), RNE; equals float_to_bf16 for non-NaN input.
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

/// The scalar path of quant4 (NaN, extreme exponents), out of line so it costs the fast path no
/// registers.
__device__ __noinline__ uint32_t quant4_slow(float a, float b, float c, float d, float s) {
  return static_cast<uint32_t>(quant_e4m3(a, s)) | (static_cast<uint32_t>(quant_e4m3(b, s)) << 8) |
         (static_cast<uint32_t>(quant_e4m3(c, s)) << 16) | (static_cast<uint32_t>(quant_e4m3(d, s)) << 24);
}

/// Values x(0..3) of an mla_fp8_ds tile -> 4 e4m3 bytes, byte j = quant_e4m3(x(j), d.s) for the
/// tile's scale (quot_ds's conditions): quot_ds and the packed cvt for all four, then one test for
/// the cvt's NaN code (a NaN input), and the exact division where that, the divisor's range
/// (d.fast) or its sign rules the fast path out. x(j) unpacks the value again where the slow path
/// needs it, so no floats stay alive across the fast path.
template <class X>
__device__ __forceinline__ uint32_t quant4_ds(X x, const QDiv& d) {
  const uint32_t lo = cvt_e4m3x2(quot_ds(x(0), d), quot_ds(x(1), d));
  const uint32_t hi = cvt_e4m3x2(quot_ds(x(2), d), quot_ds(x(3), d));
  const uint32_t w = __byte_perm(lo, hi, 0x5410);
  const bool nan = (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0;  // a byte is 0x7f / 0xff
  if (d.fast && d.s > 0.0f && !nan) return w;
  return quant4_slow(x(0), x(1), x(2), x(3), d.s);
}

/// 4 floats -> 4 bytes, byte k = quant_e4m3(x[k], d.s): the quotient kQ allows (quot<kQ>) and the
/// packed cvt, the exact division where quant2_fast declines. (The writers measured as fast or faster with these
/// per-pair tests than with one test per four values as quant4_ds has, see quant16_bf16.)
template <Quot kQ = Quot::kAny>
__device__ __forceinline__ uint32_t quant4(const float* x, const QDiv& d) {
  uint32_t lo, hi;
  const bool a = quant2_fast<kQ>(x[0], x[1], d, &lo);
  const bool b = quant2_fast<kQ>(x[2], x[3], d, &hi);
  if (d.fast & a & b) return lo | (hi << 16);
  return quant4_slow(x[0], x[1], x[2], x[3], d.s);
}

template <Quot kQ = Quot::kAny>
__device__ __forceinline__ uint2 quant8(const float* x, const QDiv& d) {
  return make_uint2(quant4<kQ>(x, d), quant4<kQ>(x + 4, d));
}

/// 16 bf16 values of an mla_fp8_ds tile (two uint4, value j in half j % 2 of word j / 2) -> 16 e4m3
/// bytes by quant4_ds: on an H200 the bf16 -> 656 conversion ran 0.757 -> 0.80 of the D2D copy
/// with this loop (then over the two-correction quotient, select-free) and the
/// EntryWalk (its per-pair tests, branches and zero selects had been a fifth of its instructions).
/// The writers keep quant8: they measured no faster, or slower, with it (write_mla fp8 0.87 -> 0.80,
/// write_mha fp8 0.856 -> 0.828 in one build or the other).
__device__ __forceinline__ uint4 quant16_bf16(uint4 a, uint4 b, const QDiv& d) {
  const uint32_t v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = quant4_ds(
        [&v, k](int j) {
          const uint32_t u = v[2 * k + (j >> 1)];
          return __uint_as_float((j & 1) ? (u & 0xffff0000u) : (u << 16));
        },
        d);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Whether any of 16 fp16 values (two uint4) is a NaN, from the bits: a half is NaN when its
/// magnitude bits exceed the infinity's, i.e. when adding the infinity's mantissa mask carries into
/// bit 15 (no carry crosses into the other half). (bf16 gets its NaN test from bf16_mag16_bits.)
__device__ __forceinline__ bool f16_has_nan16(uint4 a, uint4 b) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint32_t acc = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) acc |= (w[k] & 0x7fff7fffu) + 0x03ff03ffu;
  return (acc & 0x80008000u) != 0;
}

/// The largest magnitude bits (x & 0x7fff) of 16 bf16 values (two uint4) by integer maxima of the
/// packed pairs: for non-NaN values the bits of max |x|; above 0x7f80 where a value is NaN.
__device__ __forceinline__ uint32_t bf16_mag16_bits(uint4 a, uint4 b) {
  uint32_t m[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) m[k] &= 0x7fff7fffu;
#pragma unroll
  for (int s = 4; s >= 1; s >>= 1)
#pragma unroll
    for (int k = 0; k < s; ++k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm("max.u16x2 %0, %0, %1;\n" : "+r"(m[k]) : "r"(m[k + s]));  // one instruction on sm_90
#else
      m[k] = __vmaxu2(m[k], m[k + s]);
#endif
    }
  return max(m[0] & 0xffffu, m[0] >> 16);
}

/// 8 floats -> 8 e4m3 bytes for a power-of-two scale whose reciprocal is y, where no value is NaN
/// and none can overflow (|x| <= 448 s, as the ue8m0 indexer scale guarantees): quant8<Quot::kPow2>'s
/// bits without its per-pair test for the cvt's NaN code, which only a NaN input or an overflow gives.
__device__ __forceinline__ uint2 quant8_pow2(const float* x, float y) {
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = cvt_e4m3x2(mul_rn(x[2 * i], y), mul_rn(x[2 * i + 1], y));
  return make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
}

template <bool kBf16>
__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
  if constexpr (kBf16) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

/// 8 bf16 (kBf16) or fp16 values -> floats (exact; the hardware conversion for fp16).
template <bool kBf16>
__device__ __forceinline__ void to_floats(uint4 v, float* x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kBf16) {
      x[2 * k] = __uint_as_float(w[k] << 16);
      x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      x[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k])));
      x[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
    }
  }
}

/// The scalar path of dequant4 (NaN bytes, large scales), out of line.
__device__ __noinline__ uint2 dequant4_slow(uint32_t w, float s, bool unscaled) {
  uint16_t h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint8_t b = static_cast<uint8_t>(w >> (8 * k));
    h[k] = unscaled ? e4m3_to_bf16(b) : dequant_bf16(b, s);
  }
  uint2 v;
  memcpy(&v, h, 8);
  return v;
}

/// 4 e4m3 bytes -> 4 bf16 (uint2): dequant_bf16(b, d.s), or e4m3_to_bf16(b) when kUnscaled (d.s = 1).
/// The hardware e4m3x2 -> f16x2 conversion is exact (every e4m3 value is an fp16 value), so the
/// fp32 product and its bf16 rounding are the scalar math's; NaN bytes and a non-finite scale take
/// the scalar path (NaN payloads).
template <bool kUnscaled = false>
__device__ __forceinline__ uint2 dequant4(uint32_t w, const DqScale& d) {
  if (d.fast && !has_e4m3_nan(w)) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
    if constexpr (!kUnscaled) {
      a.x = mul_rn(a.x, d.s);
      a.y = mul_rn(a.y, d.s);
      b.x = mul_rn(b.x, d.s);
      b.y = mul_rn(b.y, d.s);
    }
    return make_uint2(cvt_bf16x2(a.x, a.y), cvt_bf16x2(b.x, b.y));
  }
  return dequant4_slow(w, d.s, kUnscaled);
}

/// 2 e4m3 bytes (the low half of w) -> 2 bf16, as dequant4.
template <bool kUnscaled = false>
__device__ __forceinline__ uint32_t dequant2(uint32_t w, const DqScale& d) {
  w &= 0xffffu;
  if (d.fast && !has_e4m3_nan(w)) {
    float2 a = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3)));
    if constexpr (!kUnscaled) {
      a.x = mul_rn(a.x, d.s);
      a.y = mul_rn(a.y, d.s);
    }
    return cvt_bf16x2(a.x, a.y);
  }
  return dequant4_slow(w, d.s, kUnscaled).x;
}

template <bool kUnscaled = false>
__device__ __forceinline__ uint4 dequant8(uint2 q, const DqScale& d) {
  const uint2 a = dequant4<kUnscaled>(q.x, d), b = dequant4<kUnscaled>(q.y, d);
  return make_uint4(a.x, a.y, b.x, b.y);
}

// ---- warp-cooperative entry operations (lane in [0, 32)), split into a load and a store half so
// a warp can issue the loads of several entries before it converts and stores any of them ----

/// max(0, |x_0|, ..., |x_15|) of 16 bf16 values (two uint4) with NaN ignored: the fmax_f chain over
/// their floats, compared in bf16 pairs (exact, since a maximum is one of its inputs; __hmax2
/// returns the non-NaN input as fmaxf does, and canonical NaN, which the last fmax_f drops, where
/// both are NaN): 8 masks and 7 paired maxima instead of 16 of each.
__device__ __forceinline__ float bf16_amax16(uint4 a, uint4 b) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  __nv_bfloat162 m[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t u = w[k] & 0x7fff7fffu;
    memcpy(&m[k], &u, 4);
  }
#pragma unroll
  for (int s = 4; s >= 1; s >>= 1)
#pragma unroll
    for (int k = 0; k < s; ++k) m[k] = __hmax2(m[k], m[k + s]);
  uint32_t u;
  memcpy(&u, &m[0], 4);
  return fmax_f(fmax_f(0.0f, __uint_as_float(u << 16)), __uint_as_float(u & 0xffff0000u));
}

/// 576 bf16 (512 nope + 64 rope) as loaded for the bf16 -> 656 B conversion: lane l takes values
/// [16l, 16l + 16) (tile l / 8), lanes 0-7 also 8 rope values. (Lanes taking two 8-value runs
/// 256 values apart, for 512-byte contiguous loads, measured slower on an H200: two tile maxima
/// and scales per lane cost more than the L1 saves.)
struct Bf16In {
  uint4 a = {}, b = {}, rope = {};
};
/// nope, rope: global or shared.
__device__ __forceinline__ Bf16In load_bf16(const uint8_t* nope, const uint8_t* rope, int lane) {
  Bf16In in;
  in.a = ld_v16(nope + 32 * lane);
  in.b = ld_v16(nope + 32 * lane + 16);
  if (lane < 8) in.rope = ld_v16(rope + 16 * lane);
  return in;
}
/// -> one 656 B entry. kPairMax: the lane's maximum by bf16_amax16 (the conversion bf16 -> 656 ran
/// 0.717 -> 0.757 of the D2D copy with it on an H200), else by the float chain (write_mla fp8_ds
/// measured 0.78 with the float chain, 0.77 with bf16_amax16).
template <bool kPairMax>
__device__ __forceinline__ void store_bf16_as_ds(const Bf16In& in, uint8_t* dst, int lane) {
  float x[16];
  float amax = 0.0f;
  if constexpr (kPairMax) {
    amax = bf16_amax16(in.a, in.b);
  } else {
    to_floats<true>(in.a, x);
    to_floats<true>(in.b, x + 8);
#pragma unroll
    for (int k = 0; k < 16; ++k) amax = fmax_f(amax, abs_f(x[k]));
  }
#pragma unroll
  for (int m = 4; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
  const float sc = ds_tile_scale_fast(amax);
  const QDiv r = make_qdiv(sc);
  if constexpr (kPairMax) {
    st_v16(dst + 16 * lane, quant16_bf16(in.a, in.b, r));
  } else {
    const uint2 lo = quant8<Quot::kDsTile>(x, r), hi = quant8<Quot::kDsTile>(x + 8, r);
    st_v16(dst + 16 * lane, make_uint4(lo.x, lo.y, hi.x, hi.y));
  }
  if ((lane & 7) == 0) *reinterpret_cast<float*>(dst + kMlaDsScaleOffset + 4 * (lane >> 3)) = sc;
  if (lane < 8) st_v16(dst + kMlaDsRopeOffset + 16 * lane, in.rope);
}

/// One 656 B entry as loaded for the conversion to bf16, so that every warp-wide store is 512
/// contiguous bytes (stores that leave half of each sector to another instruction cost the L2
/// twice): lane l takes values [8l, 8l + 8) and [256 + 8l, 256 + 8l + 8), whose tiles are l / 16
/// and 2 + l / 16; lanes 0-7 also 8 rope values.
struct DsIn {
  uint2 q0 = {}, q1 = {};
  uint4 rope = {};
  float s0 = 0.0f, s1 = 0.0f;
};
/// src: a global or shared entry.
__device__ __forceinline__ DsIn load_ds(const uint8_t* src, int lane) {
  DsIn in;
  in.q0 = ld_v8(src + 8 * lane);
  in.q1 = ld_v8(src + 256 + 8 * lane);
  in.s0 = *reinterpret_cast<const float*>(src + kMlaDsScaleOffset + 4 * (lane >> 4));
  in.s1 = *reinterpret_cast<const float*>(src + kMlaDsScaleOffset + 8 + 4 * (lane >> 4));
  if (lane < 8) in.rope = ld_v16(src + kMlaDsRopeOffset + 16 * lane);
  return in;
}
/// -> 576 bf16 (1152 B).
__device__ __forceinline__ void store_ds_as_bf16(const DsIn& in, uint8_t* dst, int lane) {
  st_v16(dst + 16 * lane, dequant8(in.q0, make_dq_scale(in.s0)));
  st_v16(dst + 512 + 16 * lane, dequant8(in.q1, make_dq_scale(in.s1)));
  if (lane < 8) st_v16(dst + kMlaRank * 2 + 16 * lane, in.rope);
}

/// One 656 B entry as loaded for the conversion to 576 B: every lane 16 nope bytes and 2 rope
/// values, lanes 0-3 one tile scale each.
struct Ds8In {
  uint4 q = {};
  uint32_t scale = kOneF32Bits, rope = 0;
};
__device__ __forceinline__ Ds8In load_ds8(const uint8_t* src, int lane) {
  Ds8In in;
  in.q = ld_v16(src + 16 * lane);
  in.rope = *reinterpret_cast<const uint32_t*>(src + kMlaDsRopeOffset + 4 * lane);
  if (lane < 4) in.scale = *reinterpret_cast<const uint32_t*>(src + kMlaDsScaleOffset + 4 * lane);
  return in;
}
/// Both bf16 of `w` as e4m3 (low byte from the low half) and whether both are exact: the scalar
/// bf16_to_e4m3_exact for NaN/inf halves; otherwise the packed cvt, and exactness as "the e4m3
/// value read back (exactly, through f16) has the bits of the input float", which is what the
/// scalar round trip e4m3 -> bf16 == h means for finite input (e4m3 values are bf16-exact).
__device__ __forceinline__ uint32_t bf16x2_to_e4m3x2_exact(uint32_t w, bool& ok) {
  if ((w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u) {
    uint8_t a, b;
    ok &= bf16_to_e4m3_exact(static_cast<uint16_t>(w), &a);
    ok &= bf16_to_e4m3_exact(static_cast<uint16_t>(w >> 16), &b);
    return a | (static_cast<uint32_t>(b) << 8);
  }
  const float lo = bits_float(w << 16), hi = bits_float(w & 0xffff0000u);
  const uint32_t q = cvt_e4m3x2(lo, hi);
  const __half2_raw back = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(q), __NV_E4M3);
  ok &= float_bits(__half2float(__ushort_as_half(back.x))) == float_bits(lo) &&
        float_bits(__half2float(__ushort_as_half(back.y))) == float_bits(hi);
  return q;
}
/// -> 576 B; returns (to every lane) whether the entry was lossless.
__device__ __forceinline__ bool store_ds_as_fp8(const Ds8In& in, uint8_t* dst, int lane) {
  st_v16(dst + 16 * lane, in.q);
  bool ok = in.scale == kOneF32Bits;
  const uint32_t q = bf16x2_to_e4m3x2_exact(in.rope, ok);
  *reinterpret_cast<uint16_t*>(dst + kMlaRank + 2 * lane) = static_cast<uint16_t>(q);
  return __all_sync(kFull, ok);
}

/// One 576 B mla_fp8 entry as loaded for the conversion to 656 B: every lane 16 nope bytes and 2
/// rope bytes (the rope converted by all 32 lanes, one packed conversion each, rather than by 8
/// lanes x 8 values in a third round at a quarter of the warp: on an H200, 576 -> 656 on a layer
/// view 0.806 -> 0.825, and the fp8 -> bf16 gather's rope likewise 0.815 -> 0.865).
struct Fp8In {
  uint4 nope = {};
  uint32_t rope = 0;
};
/// src: a global or shared entry.
__device__ __forceinline__ Fp8In load_fp8(const uint8_t* src, int lane) {
  Fp8In in;
  in.nope = ld_v16(src + 16 * lane);
  in.rope = *reinterpret_cast<const uint16_t*>(src + kMlaRank + 2 * lane);
  return in;
}
/// -> 656 B: nope kept, scales 1.0, rope e4m3 -> bf16.
__device__ __forceinline__ void store_fp8_as_ds(const Fp8In& in, uint8_t* dst, int lane, const DqScale& one) {
  st_v16(dst + 16 * lane, in.nope);
  if (lane == 0) st_v16(dst + kMlaDsScaleOffset, make_uint4(kOneF32Bits, kOneF32Bits, kOneF32Bits, kOneF32Bits));
  *reinterpret_cast<uint32_t*>(dst + kMlaDsRopeOffset + 4 * lane) = dequant2<true>(in.rope, one);
}

// ---- the loop shape every kernel below shares (pipeline): a warp takes one work item (a few
// entries) per trip, grid-stride over one resident wave. Index loads (slots, block tables, block
// lists) run two trips ahead and data loads one trip ahead, so while a warp converts and stores
// one item, the next item's bytes are already in flight: a warp that spends most of its time on
// arithmetic still keeps memory busy. Source rows indexed by token never wait for the slot. ----

__device__ __forceinline__ bool slot_ok(int64_t s, int64_t limit) { return s >= 0 && s < limit; }

/// index(i) issues item i's index loads (an empty result past the end), load(i, idx) its data
/// loads, store(i, idx, data) converts and writes it. index is called exactly once per item of the
/// warp's, in order, and then for the two items after its last (past the end), so it may keep state
/// that advances by one grid stride per call (EntryWalk).
template <class Index, class Load, class Store>
__device__ __forceinline__ void pipeline(int64_t items, Index index, Load load, Store store) {
  const int64_t step = total_warps();
  int64_t i = global_warp();
  if (i >= items) return;
  auto ic = index(i);
  auto in1 = index(i + step);
  auto dc = load(i, ic);
  for (; i < items; i += step) {
    auto dn = load(i + step, in1);
    auto in2 = index(i + 2 * step);
    store(i, ic, dc);
    ic = in1;
    in1 = in2;
    dc = dn;
  }
}

/// s[u] = slots[n0 + u], -1 past `count`.
template <int kN, class T>
struct Slots {
  int64_t s[kN];
};
template <int kN, class T>
__device__ __forceinline__ Slots<kN, T> load_slots(const T* slots, int64_t n0, int64_t count) {
  Slots<kN, T> r;
#pragma unroll
  for (int u = 0; u < kN; ++u) r.s[u] = n0 + u < count ? static_cast<int64_t>(slots[n0 + u]) : -1;
  return r;
}

// ---- write_mla ----

template <int kMode, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, kMode == 0 ? 2 : 3) write_mla_kernel(const WriteMlaParams p) {
  constexpr int kU = kMode == 0 ? 2 : 1;  // tokens per item
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const QDiv rc = make_qdiv(p.scale);
  const int64_t items = (p.tokens + kU - 1) / kU;
  struct In {
    uint4 v[kU][3];
  };
  pipeline(
      items, [&](int64_t i) { return load_slots<kU>(p.slots, i * kU, p.tokens); },
      [&](int64_t i, const Slots<kU, int64_t>&) {
        In in;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          in.v[u][0] = in.v[u][1] = in.v[u][2] = uint4{};
          const int64_t n = i * kU + u;
          if (n >= p.tokens) continue;
          const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
          const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
          if constexpr (kMode == 2) {
            const Bf16In b = load_bf16(nope, rope, lane);
            in.v[u][0] = b.a;
            in.v[u][1] = b.b;
            in.v[u][2] = b.rope;
          } else {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
              const int g = lane + 32 * k;
              if (g < 72) in.v[u][k] = g < 64 ? ld_v16(nope + 16 * g) : ld_v16(rope + 16 * (g - 64));
            }
          }
        }
        return in;
      },
      [&](int64_t, const Slots<kU, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!slot_ok(sl.s[u], limit)) continue;  // uniform over the warp
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          uint8_t* dst = p.cache.entry(blk, off);
          if constexpr (kMode == 2) {
            Bf16In b;
            b.a = in.v[u][0];
            b.b = in.v[u][1];
            b.rope = in.v[u][2];
            store_bf16_as_ds<false>(b, dst, lane);
          } else {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
              const int g = lane + 32 * k;
              if (g >= 72) continue;
              if constexpr (kMode == 0) {
                st_v16(dst + 16 * g, in.v[u][k]);
              } else {
                float x[8];
                to_floats<kBf16>(in.v[u][k], x);
                st_v8(dst + 8 * g, quant8(x, rc));
              }
            }
          }
        }
      });
}

// ---- write_mha: an item is one token's K and V over 32 * kG 16-byte groups per plane ----

template <bool kFp8, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, 2) write_mha_kernel(const WriteMhaParams p) {
  // 16-byte groups per lane and plane in flight: 4, one item per token at 8 x 128 (fp8 with 2,
  // two items per token: 0.819 of the D2D copy against 0.866 with 4 on an H200, contiguous cache).
  constexpr int kG = 4;
  const int lane = threadIdx.x & 31;
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.sizes[1], h = kv.sizes[2], d = kv.sizes[3];
  const Div dbs = make_div(bs);
  const int64_t limit = kv.sizes[0] * bs;
  const int64_t gpd = d / 8, groups = h * gpd;
  const int64_t chunks = (groups + 32 * kG - 1) / (32 * kG);
  const Div dchunks = make_div(chunks), dgpd = make_div(gpd);
  const int64_t eb = kFp8 ? 1 : 2;
  const QDiv rk = make_qdiv(p.k_scale), rv = make_qdiv(p.v_scale);
  const int64_t hsk = p.k_cache.view.strides[2] * eb, hsv = p.v_cache.view.strides[2] * eb;
  const int64_t items = p.tokens * chunks;
  struct In {
    uint4 a[kG], b[kG];
  };
  pipeline(
      items,
      [&](int64_t i) {
        int64_t n = 0, c = 0;
        if (i < items) divmod(i, dchunks, n, c);
        return i < items ? p.slots[n] : int64_t{-1};
      },
      [&](int64_t i, int64_t) {
        In in = {};
        if (i >= items) return in;
        int64_t n, c;
        divmod(i, dchunks, n, c);
        const uint8_t* sk = static_cast<const uint8_t*>(p.key) + n * p.key_stride * 2;
        const uint8_t* sv = static_cast<const uint8_t*>(p.value) + n * p.value_stride * 2;
#pragma unroll
        for (int k = 0; k < kG; ++k) {
          const int64_t g = c * 32 * kG + lane + 32 * k;
          if (g < groups) {
            in.a[k] = ld_v16(sk + 16 * g);
            in.b[k] = ld_v16(sv + 16 * g);
          }
        }
        return in;
      },
      [&](int64_t i, int64_t s, const In& in) {
        if (!slot_ok(s, limit)) return;
        int64_t n, c, blk, off;
        divmod(i, dchunks, n, c);
        divmod(s, dbs, blk, off);
        uint8_t* ek = p.k_cache.entry(blk, off);
        uint8_t* ev = p.v_cache.entry(blk, off);
#pragma unroll
        for (int k = 0; k < kG; ++k) {
          const int64_t g = c * 32 * kG + lane + 32 * k;
          if (g >= groups) continue;
          int64_t hh, kg;
          divmod(g, dgpd, hh, kg);
          uint8_t* dk = ek + hh * hsk + kg * 8 * eb;
          uint8_t* dv = ev + hh * hsv + kg * 8 * eb;
          if constexpr (!kFp8) {
            st_v16(dk, in.a[k]);
            st_v16(dv, in.b[k]);
          } else {
            float x[8];
            to_floats<kBf16>(in.a[k], x);
            st_v8_once(dk, quant8(x, rk));
            to_floats<kBf16>(in.b[k], x);
            st_v8_once(dv, quant8(x, rv));
          }
        }
      });
}

// ---- indexer ----

/// The slots of an indexer item's rows: row u * kPer + sub of item i (item of kOps * kPer rows),
/// -1 past the end.
template <int kOps, int kPer>
__device__ __forceinline__ Slots<kOps, int64_t> indexer_slots(const IndexerWriteParams& p, int64_t i, int sub) {
  Slots<kOps, int64_t> o;
#pragma unroll
  for (int u = 0; u < kOps; ++u) {
    const int64_t n = i * (kOps * kPer) + u * kPer + sub;
    o.s[u] = n < p.tokens ? p.slots[n] : -1;
  }
  return o;
}

/// The indexer for rows that are not 16-byte aligned: 8-byte loads, 32 lanes per 128-value row,
/// kRows rows per item.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, 3) indexer_write_narrow_kernel(const IndexerWriteParams p) {
  constexpr int kVec = 8;                             // bytes per load
  constexpr int kLanes = 2 * kIndexerHeadDim / kVec;  // lanes per row
  constexpr int kPer = 32 / kLanes;                   // rows per warp-wide access
  constexpr int kE = kVec / 2;                        // values per lane
  constexpr int kOps = 2;                             // accesses per lane and item
  constexpr int kRows = kOps * kPer;                  // rows per item
  const int lane = threadIdx.x & 31, hl = lane % kLanes, sub = lane / kLanes;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const uint8_t* const k = static_cast<const uint8_t*>(p.k);
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  struct In {
    uint2 raw[kOps];
  };
  pipeline(
      items, [&](int64_t i) { return indexer_slots<kOps, kPer>(p, i, sub); },
      [&](int64_t i, const Slots<kOps, int64_t>&) {
        In in;
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          const int64_t n = i * kRows + u * kPer + sub;
          in.raw[u] = uint2{};
          if (n < p.tokens) in.raw[u] = ld_v8(k + n * row_bytes + kVec * hl);
        }
        return in;
      },
      [&](int64_t, const Slots<kOps, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          uint16_t hv[kE];
          memcpy(hv, &in.raw[u], kVec);
          float x[kE];
          float amax = 0.0f;
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            x[e] = half_bits_to_float<kBf16>(hv[e]);
            amax = fmax_f(amax, abs_f(x[e]));
          }
#pragma unroll
          for (int m = kLanes / 2; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (slot_ok(sl.s[u], limit)) {
            const float sc = indexer_scale_fast(amax, p.ue8m0);
            const QDiv r = make_qdiv(sc);
            const bool pow2 = p.ue8m0 && is_pow2_scale(sc);
            int64_t blk, off;
            divmod(sl.s[u], dbs, blk, off);
            uint8_t* block = p.cache.entry(blk, 0);
            uint8_t* vals = block + off * kIndexerHeadDim + kE * hl;
            *reinterpret_cast<uint32_t*>(vals) = pow2 ? quant4<Quot::kPow2>(x, r) : quant4(x, r);
            if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
          }
        }
      });
}

/// The indexer for 16-byte aligned rows: 8 lanes per 128-value row (each two 16-byte runs 64
/// values apart, so 8 lanes read and write one contiguous run of the row), 4 rows per warp-wide
/// access, 8 rows per item. Twice the values per lane of a 16-lane layout halve the per-row
/// work (maximum, scale, reciprocal, slot division) per value, which bound that kernel's issue rate.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads, kBf16 ? 3 : 2) indexer_write_wide_kernel(const IndexerWriteParams p) {
  constexpr int kOps = 2, kRows = 4 * kOps;
  const int lane = threadIdx.x & 31, hl = lane & 7, sub = lane >> 3;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const uint8_t* const k = static_cast<const uint8_t*>(p.k);
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  struct In {
    uint4 a[kOps], b[kOps];
  };
  pipeline(
      items, [&](int64_t i) { return indexer_slots<kOps, 4>(p, i, sub); },
      [&](int64_t i, const Slots<kOps, int64_t>& sl) {
        In in;
        // A run: the item's rows go to consecutive slots (a prefill's); those read plainly, the
        // others evict-first (see ld_v16_once).
        const int64_t s0 = __shfl_sync(kFull, sl.s[0], 0);
        bool run = s0 >= 0;
#pragma unroll
        for (int u = 0; u < kOps; ++u) run &= sl.s[u] == s0 + 4 * u + sub;
        run = __all_sync(kFull, run);
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          const int64_t n = i * kRows + 4 * u + sub;
          in.a[u] = in.b[u] = uint4{};
          if (n >= p.tokens) continue;
          const uint8_t* const row = k + n * row_bytes + 16 * hl;
          if (run) {
            in.a[u] = ld_v16(row);
            in.b[u] = ld_v16(row + 128);
          } else {
            in.a[u] = ld_v16_once(row);
            in.b[u] = ld_v16_once(row + 128);
          }
        }
        return in;
      },
      [&](int64_t, const Slots<kOps, int64_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kOps; ++u) {
          float x[16];
          to_floats<kBf16>(in.a[u], x);
          to_floats<kBf16>(in.b[u], x + 8);
          float amax = 0.0f;
          bool nan = false;  // a NaN among this lane's 16 values
          if constexpr (kBf16) {
            // The magnitudes' largest bits by integer maxima of the bf16 pairs: a NaN sorts above
            // the infinity, so one comparison finds it (and only then the NaN-ignoring maximum).
            const uint32_t mb = bf16_mag16_bits(in.a[u], in.b[u]);
            nan = mb > 0x7f80u;
            amax = nan ? bf16_amax16(in.a[u], in.b[u]) : __uint_as_float(mb << 16);
          } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) amax = fmax_f(amax, abs_f(x[e]));
            nan = f16_has_nan16(in.a[u], in.b[u]);
          }
#pragma unroll
          for (int m = 4; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (!slot_ok(sl.s[u], limit)) continue;
          const float sc = indexer_scale_fast(amax, p.ue8m0);
          const bool pow2 = p.ue8m0 && is_pow2_scale(sc);
          QDiv r;
          if (pow2) {  // the exact reciprocal of a power of two, without the division
            r.s = sc;
            r.y = bits_float(((254u - ((float_bits(sc) >> 23) & 0xffu)) << 23));
            r.fast = true;
          } else {
            r = make_qdiv(sc);
          }
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          uint8_t* block = p.cache.entry(blk, 0);
          uint8_t* vals = block + off * kIndexerHeadDim + 8 * hl;
          if (pow2 && !nan) {
            st_v8_once(vals, quant8_pow2(x, r.y));
            st_v8_once(vals + 64, quant8_pow2(x + 8, r.y));
          } else {
            st_v8_once(vals, pow2 ? quant8<Quot::kPow2>(x, r) : quant8(x, r));
            st_v8_once(vals + 64, pow2 ? quant8<Quot::kPow2>(x + 8, r) : quant8(x + 8, r));
          }
          // The scale keeps the normal policy: its line is shared by the block's other rows.
          if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
        }
      });
}

// ---- gathers ----

__device__ __forceinline__ int64_t find_request(const int32_t* cu, int64_t batch, int64_t j) {
  int64_t lo = 0, hi = batch;  // cu[lo] <= j < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (cu[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/// Entry addresses of the kR rows from j0 (null past the end): one binary search, then the
/// block-table loads.
template <int kR>
struct Rows {
  const uint8_t* src[kR];
};
template <int kR>
__device__ __forceinline__ Rows<kR> locate_rows(const GatherParams& p, const Div& dbs, int64_t j0) {
  Rows<kR> out;
#pragma unroll
  for (int u = 0; u < kR; ++u) out.src[u] = nullptr;
  if (j0 >= p.total_rows) return out;
  int64_t r = find_request(p.cu_seq_lens, p.batch, j0);
  int64_t tok[kR], col[kR], req[kR];
#pragma unroll
  for (int u = 0; u < kR; ++u) {
    tok[u] = col[u] = 0;
    req[u] = r;
    const int64_t j = j0 + u;
    if (j >= p.total_rows) continue;
    while (p.cu_seq_lens[r + 1] <= j) ++r;
    req[u] = r;
    const int64_t pos = j - p.cu_seq_lens[r] + (p.seq_starts ? p.seq_starts[r] : 0);
    divmod(pos, dbs, col[u], tok[u]);
  }
#pragma unroll
  for (int u = 0; u < kR; ++u)
    if (j0 + u < p.total_rows)
      out.src[u] = p.cache.entry(p.block_table[req[u] * p.block_table_stride + col[u]], tok[u]);
  return out;
}

/// Raw copy (16-byte vectors) and fp8 -> bf16: an item is kR consecutive rows x up to 96 vectors
/// of each (rows longer than that take several items).
template <int kMode>
__global__ void __launch_bounds__(kThreads, 2) gather_kernel(const GatherParams p) {
  constexpr int kR = kMode == 0 ? 2 : 4;  // rows per item
  using Vec = std::conditional_t<kMode == 0, uint4, uint2>;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = kMode == 0 ? v.sizes[2] * eb / 16 : v.sizes[2] / 8;  // vectors per row
  const int64_t chunks = (n + 95) / 96;
  const int64_t dst_row = p.dst_stride * (kMode == 0 ? eb : 2);
  const int64_t items = (p.total_rows + kR - 1) / kR * chunks;
  const DqScale dq = make_dq_scale(p.scale);
  struct In {
    Vec x[kR][3];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i / chunks * kR : p.total_rows); },
      [&](int64_t i, const Rows<kR>& r) {
        In in;
        const int64_t k0 = i % chunks * 96;
#pragma unroll
        for (int u = 0; u < kR; ++u)
#pragma unroll
          for (int c = 0; c < 3; ++c) {
            const int64_t k = k0 + lane + 32 * c;
            in.x[u][c] = Vec{};
            if (r.src[u] && k < n) in.x[u][c] = *reinterpret_cast<const Vec*>(r.src[u] + sizeof(Vec) * k);
          }
        return in;
      },
      [&](int64_t i, const Rows<kR>& r, const In& in) {
        const int64_t j0 = i / chunks * kR, k0 = i % chunks * 96;
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + j0 * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u)
#pragma unroll
          for (int c = 0; c < 3; ++c) {
            const int64_t k = k0 + lane + 32 * c;
            if (!r.src[u] || k >= n) continue;
            if constexpr (kMode == 0)
              st_v16(out + u * dst_row + 16 * k, in.x[u][c]);
            else
              st_v16(out + u * dst_row + 16 * k, dequant8(in.x[u][c], dq));
          }
      });
}

/// fp8 -> bf16 rows of 576 entries (mla_fp8), 2 rows per item, laid out like the 656 B gather so
/// every warp-wide store is 512 contiguous bytes: lane l takes values [8l, 8l + 8) and
/// [256 + 8l, 256 + 8l + 8), and rope values 2l, 2l + 1. (The generic row loop spends a quarter
/// of its third access idle on 72-vector rows and holds 118 registers.)
__global__ void __launch_bounds__(kThreads, 3) gather_fp8_576_kernel(const GatherParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  const DqScale dq = make_dq_scale(p.scale);
  struct In {
    uint2 a[kR], b[kR];
    uint32_t r[kR];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, const Rows<kR>& rows) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          in.a[u] = in.b[u] = uint2{};
          in.r[u] = 0;
          if (!rows.src[u]) continue;
          in.a[u] = ld_v8(rows.src[u] + 8 * lane);
          in.b[u] = ld_v8(rows.src[u] + 256 + 8 * lane);
          in.r[u] = *reinterpret_cast<const uint16_t*>(rows.src[u] + kMlaRank + 2 * lane);
        }
        return in;
      },
      [&](int64_t i, const Rows<kR>& rows, const In& in) {
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + i * kR * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!rows.src[u]) continue;
          uint8_t* const o = out + u * dst_row;
          st_v16(o + 16 * lane, dequant8(in.a[u], dq));
          st_v16(o + 512 + 16 * lane, dequant8(in.b[u], dq));
          *reinterpret_cast<uint32_t*>(o + kMlaRank * 2 + 4 * lane) = dequant2(in.r[u], dq);
        }
      });
}

/// 656 B -> bf16 rows, kR rows per item.
__global__ void __launch_bounds__(kThreads, 3) gather_ds_kernel(const GatherParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  struct In {
    DsIn e[kR];
  };
  pipeline(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, const Rows<kR>& r) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) in.e[u] = load_ds(r.src[u], lane);
        return in;
      },
      [&](int64_t i, const Rows<kR>& r, const In& in) {
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + i * kR * dst_row;
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) store_ds_as_bf16(in.e[u], out + u * dst_row, lane);
      });
}

/// Raw copy of rows not 16-byte aligned (kVec-byte accesses), kR rows per warp and trip.
template <int kVec>
__global__ void __launch_bounds__(kThreads) gather_copy_narrow_kernel(const GatherParams p) {
  constexpr int kR = 4;
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = v.sizes[2] * eb / kVec;
  const int64_t dst_row = p.dst_stride * eb;
  for (int64_t j0 = global_warp() * kR; j0 < p.total_rows; j0 += total_warps() * kR) {
    const Rows<kR> r = locate_rows<kR>(p, dbs, j0);
    uint8_t* const out = static_cast<uint8_t*>(p.dst) + j0 * dst_row;
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      const uint8_t* s = r.src[u];
      if (!s) continue;
      uint8_t* dst = out + u * dst_row;
      for (int64_t k = lane; k < n; k += 32) {
        if constexpr (kVec == 4)
          reinterpret_cast<uint32_t*>(dst)[k] = reinterpret_cast<const uint32_t*>(s)[k];
        else if constexpr (kVec == 2)
          reinterpret_cast<uint16_t*>(dst)[k] = reinterpret_cast<const uint16_t*>(s)[k];
        else
          dst[k] = s[k];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 3) dequant_paged_kernel(const DequantPagedParams p) {
  constexpr int kR = 2;
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1], limit = p.cache.view.sizes[0] * bs;
  const Div dbs = make_div(bs);
  const int64_t items = (p.count + kR - 1) / kR;
  struct In {
    DsIn e[kR];
  };
  pipeline(
      items, [&](int64_t i) { return load_slots<kR>(p.slots, i * kR, p.count); },
      [&](int64_t, const Slots<kR, int32_t>& sl) {
        In in;
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!slot_ok(sl.s[u], limit)) continue;
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          in.e[u] = load_ds(p.cache.entry(blk, off), lane);
        }
        return in;
      },
      [&](int64_t i, const Slots<kR, int32_t>& sl, const In& in) {
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (slot_ok(sl.s[u], limit))
            store_ds_as_bf16(in.e[u], static_cast<uint8_t*>(p.dst) + (i * kR + u) * p.dst_stride * 2, lane);
      });
}

// ---- conversions ----

/// The stride S of an EntryWalk in its radix (computed by the launcher: kernel parameters cost no
/// registers).
struct WalkStep {
  uint32_t sl = 0, sb = 0, st = 0;
};

/// A warp's entries w0, w0 + S, w0 + 2 S, ... of a conversion, each as (layer l, block b, token t)
/// with w = (l * count + b) * bs + t: one mixed-radix addition of S per item instead of two
/// divisions per entry (on an H200 the divisions and their 64-bit checks were a third of the
/// bf16 -> 656 conversion's instructions, which bound its issue rate).
struct EntryWalk {
  // 32-bit (validate_convert keeps layers, count and the block size below 2^31); the block size,
  // count and S come from the parameters rather than registers: the walk's state lives across
  // the whole loop next to two pipelined items, and held fields spilled.
  uint32_t l = 0, b = 0, t = 0;  // the current entry
  __device__ __forceinline__ void init(int64_t w0, const Div& dbs, const Div& dcount) {
    int64_t q, r0, r1;
    divmod(w0, dbs, q, r0);
    t = static_cast<uint32_t>(r0);
    divmod(q, dcount, q, r1);
    b = static_cast<uint32_t>(r1);
    l = q < int64_t{1} << 31 ? static_cast<uint32_t>(q) : 0x80000000u;  // past every layer
  }
  /// Brings tt back below bs (with the carries) after at most bs was added to it.
  __device__ __forceinline__ static void carry(uint32_t& ll, uint32_t& bb, uint32_t& tt, uint32_t bs, uint32_t count) {
    if (tt >= bs) {
      tt -= bs;
      if (++bb == count) {
        bb = 0;
        ++ll;
      }
    }
  }
  __device__ __forceinline__ void next(const WalkStep& s, uint32_t bs, uint32_t count) {
    t += s.st;
    b += s.sb;
    if (t >= bs) {
      t -= bs;
      ++b;
    }
    if (b >= count) {
      b -= count;
      ++l;
    }
    l = l + s.sl < 0x80000000u ? l + s.sl : 0x80000000u;
  }
};

template <int kKind>
__global__ void __launch_bounds__(kThreads, kKind == 1 || kKind == 3 ? 2
                                            : kKind == 2             ? 4
                                                         : 3) convert_kernel(const ConvertParams p, const WalkStep ws) {
  constexpr int kU = kKind == 2 ? 1 : 2;  // entries per item
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.src.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t entries = p.layers * p.count * bs;
  const Div dcount = make_div(p.count);
  const int64_t items = (entries + kU - 1) / kU;
  const DqScale one = make_dq_scale(1.0f);
  struct Where {
    const uint8_t* src[kU];
    uint8_t* dst[kU];
    int64_t blk[kU];
  };
  using E = std::conditional_t<kKind == 0, Fp8In,
                               std::conditional_t<kKind == 1, Ds8In, std::conditional_t<kKind == 2, Bf16In, DsIn>>>;
  struct In {
    E e[kU];
  };
  EntryWalk walk;
  walk.init(global_warp() * kU, dbs, dcount);
  pipeline(
      items,
      [&](int64_t) {  // pipeline calls it once per item of the warp's, in order, then past the end
        Where a;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          a.src[u] = nullptr;
          a.dst[u] = nullptr;
          a.blk[u] = 0;
          uint32_t l = walk.l, b = walk.b, t = walk.t + u;
          if (u > 0) EntryWalk::carry(l, b, t, static_cast<uint32_t>(bs), static_cast<uint32_t>(p.count));
          if (l >= p.layers) continue;
          const int64_t sb = p.src_blocks ? p.src_blocks[b] : b;
          const int64_t db = p.dst_blocks ? p.dst_blocks[b] : b;
          a.src[u] = p.src.entry(sb, t) + l * p.src_layer_stride;
          a.dst[u] = p.dst.entry(db, t) + l * p.dst_layer_stride;
          a.blk[u] = b;
        }
        walk.next(ws, static_cast<uint32_t>(p.src.view.sizes[1]), static_cast<uint32_t>(p.count));
        return a;
      },
      [&](int64_t, const Where& a) {
        In in;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!a.src[u]) continue;
          if constexpr (kKind == 0)
            in.e[u] = load_fp8(a.src[u], lane);
          else if constexpr (kKind == 1)
            in.e[u] = load_ds8(a.src[u], lane);
          else if constexpr (kKind == 2)
            in.e[u] = load_bf16(a.src[u], a.src[u] + kMlaRank * 2, lane);
          else
            in.e[u] = load_ds(a.src[u], lane);
        }
        return in;
      },
      [&](int64_t, const Where& a, const In& in) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!a.src[u]) continue;
          if constexpr (kKind == 0) {
            store_fp8_as_ds(in.e[u], a.dst[u], lane, one);
          } else if constexpr (kKind == 1) {
            const bool ok = store_ds_as_fp8(in.e[u], a.dst[u], lane);
            if (!ok && lane == 0 && p.not_lossless) p.not_lossless[a.blk[u]] = 1;
          } else if constexpr (kKind == 2) {
            store_bf16_as_ds<true>(in.e[u], a.dst[u], lane);
          } else {
            store_ds_as_bf16(in.e[u], a.dst[u], lane);
          }
        }
      });
}

// ---- staged engine: each warp streams its items through a ring of kStages shared-memory stages
// with cp.async, kStages - 1 items ahead, so bytes in flight no longer cost registers; it then
// converts from shared memory and stores. Index loads (where a source address needs one) run one
// trip further ahead in registers. Stage buffers are 16-byte aligned; a stage may start with a
// header (slots, destination pointers) that process() reads back. ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(void* smem, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp8(void* smem, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(smem)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kN>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kN) : "memory");
}
/// The warp copies `chunks` 16-byte chunks from g to smem.
__device__ __forceinline__ void warp_cp16(uint8_t* smem, const uint8_t* g, int chunks, int lane) {
  for (int k = lane; k < chunks; k += 32) cp16(smem + 16 * k, g + 16 * k);
}

constexpr int kStages = 4;

/// index(i) -> the item's index data (loads issued a trip before fetch needs them; past the end
/// it must describe an empty item), fetch(i, stage, idx) issues its cp.async (none past the end),
/// process(i, stage) converts and stores it.
/// kSt: the ring's stages (kSt - 1 items in flight ahead of the one processed).
template <int kSt = kStages, class Index, class Fetch, class Process>
__device__ __forceinline__ void staged(int64_t items, Index index, Fetch fetch, Process process) {
  const int64_t step = total_warps();
  const int64_t i0 = global_warp();
  if (i0 >= items) return;
#pragma unroll
  for (int k = 0; k < kSt - 1; ++k) {
    fetch(i0 + k * step, k, index(i0 + k * step));
    cp_commit();
  }
  auto pend = index(i0 + (kSt - 1) * step);
  int stage = 0;
  for (int64_t i = i0; i < items; i += step) {
    const int ahead = stage == 0 ? kSt - 1 : stage - 1;
    fetch(i + (kSt - 1) * step, ahead, pend);
    cp_commit();
    pend = index(i + kSt * step);
    cp_wait<kSt - 1>();
    __syncwarp();
    process(i, stage);
    __syncwarp();
    stage = stage + 1 == kSt ? 0 : stage + 1;
  }
  cp_wait<0>();
}

struct NoIndex {};

__device__ __forceinline__ uint4 lds16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint2 lds8(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

/// The warp's ring: kSt stages of kBytes.
template <int kSt, int kBytes>
__device__ __forceinline__ uint8_t* ring_stage(uint8_t (*ring)[kSt][kBytes], int stage) {
  return ring[threadIdx.x >> 5][stage];
}

// write_mla: one token per item; stage = slot (16 B header), then 1024 B nope + 128 B rope.
template <int kMode, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) write_mla_staged_kernel(const WriteMlaParams p) {
  constexpr int kBytes = 16 + 1152;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const QDiv rc = make_qdiv(p.scale);
  staged(
      p.tokens, [](int64_t) { return NoIndex{}; },
      [&](int64_t n, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (n >= p.tokens) return;
        const uint8_t* nope = static_cast<const uint8_t*>(p.kv_c) + n * p.kv_c_stride * 2;
        const uint8_t* rope = static_cast<const uint8_t*>(p.k_pe) + n * p.k_pe_stride * 2;
        warp_cp16(st + 16, nope, 64, lane);
        if (lane < 8) cp16(st + 16 + 1024 + 16 * lane, rope + 16 * lane);
        if (lane == 8) cp8(st, p.slots + n);
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t s = *reinterpret_cast<const int64_t*>(st);
        if (!slot_ok(s, limit)) return;
        int64_t blk, off;
        divmod(s, dbs, blk, off);
        uint8_t* dst = p.cache.entry(blk, off);
        const uint8_t* d = st + 16;
        if constexpr (kMode == 2) {
          store_bf16_as_ds<false>(load_bf16(d, d + 1024, lane), dst, lane);
        } else {
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const int g = lane + 32 * k;
            if (g >= 72) continue;
            if constexpr (kMode == 0) {
              st_v16(dst + 16 * g, lds16(d + 16 * g));
            } else {
              float x[8];
              to_floats<kBf16>(lds16(d + 16 * g), x);
              st_v8(dst + 8 * g, quant8(x, rc));
            }
          }
        }
      });
}

// ---- bulk engine (sm_90): each CTA streams units (a run of one block's entries, contiguous in
// memory) through a ring of shared-memory stages, each filled by one bulk copy (the TMA engine:
// one instruction a unit, completion counted in bytes on the stage's full barrier, nothing in the
// warps' instruction stream); the warps then convert from shared memory. Warp 0 also refills: at
// unit k it refills the stage of unit k - 1 once every warp has released it (the stage's empty
// barrier), before its own share of unit k with two stages, after it with more. Not used for
// write_mla (its input is contiguous too): that kernel is issue-bound, and the barriers' waits add
// instructions (kernels/DESIGN.md §2.2). ----

using ptx::mbar_arrive;
using ptx::mbar_expect_tx;
using ptx::mbar_fence_init;
using ptx::mbar_init;
using ptx::mbar_wait;

/// CTA c takes units c, c + grid, c + 2 grid, ..., or with `ranges` the units
/// [units * c / grid, units * (c + 1) / grid) in order. issue(unit, stage, full_bar, lane): called by
/// all of warp 0; it arms full_bar with the unit's bytes (mbar_expect_tx) before its copies can
/// land. process(unit, k, stage, warp, lane) converts and stores the warp's share of the unit (k:
/// the CTA's unit count so far). bars: 2 kSt mbarriers.
template <int kStageBytes, int kSt, class Issue, class Process>
__device__ __forceinline__ void bulk_units(int64_t units, uint8_t (*ring)[kStageBytes], uint64_t* bars, Issue issue,
                                           Process process, bool ranges = false) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * kSt;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kSt; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, blockDim.x >> 5);
    }
    mbar_fence_init();
  }
  __syncthreads();
  // The CTA's units: every gridDim-th from its own index (the grid sweeps the units in order, so
  // at any moment the CTAs work on neighbouring ones), or with `ranges` one range of consecutive
  // units per CTA (kernels/DESIGN.md §2.3: what each costs on which views).
  const int64_t step = ranges ? 1 : gridDim.x;
  int64_t u = ranges ? units * blockIdx.x / gridDim.x : blockIdx.x;
  if (ranges) units = units * (blockIdx.x + 1) / gridDim.x;
  // Where warp 0 refills: with two stages, before its share of unit k (the refill is unit k + 1,
  // needed as soon as unit k is done); with three or more, after it, so that warp 0 does not wait
  // on the empty barrier (the slowest warp of unit k - 1) before its own work at every unit: faster
  // for the issue-bound bf16 -> 656 (three stages), slower for two-stage rings (kernels/DESIGN.md
  // §2.3).
  constexpr bool kLateRefill = kSt >= 3;
  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < kSt; ++s)
      if (u + s * step < units) issue(u + s * step, smem_addr(ring[s]), full0 + 8 * s, lane);
  }
  for (int64_t k = 0; u < units; u += step, ++k) {
    const int s = static_cast<int>(k % kSt);
    auto refill = [&] {
      if (warp == 0 && k > 0) {
        const int ps = s == 0 ? kSt - 1 : s - 1;  // the stage of unit k - 1
        const int64_t v = u + (kSt - 1) * step;
        if (v < units) {
          mbar_wait(empty0 + 8 * ps, static_cast<uint32_t>(((k - 1) / kSt) & 1));
          issue(v, smem_addr(ring[ps]), full0 + 8 * ps, lane);
        }
      }
    };
    if constexpr (!kLateRefill) refill();
    mbar_wait(full0 + 8 * s, static_cast<uint32_t>((k / kSt) & 1));
    process(u, k, ring[s], warp, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
    if constexpr (kLateRefill) refill();
  }
}

// write_mha: an item is one token's 32 16-byte groups of K and of V; stage = slot, K, V.
template <bool kFp8, bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) write_mha_staged_kernel(const WriteMhaParams p) {
  constexpr int kBytes = 16 + 1024;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const TensorView& kv = p.k_cache.view;
  const int64_t bs = kv.sizes[1], h = kv.sizes[2], d = kv.sizes[3];
  const Div dbs = make_div(bs);
  const int64_t limit = kv.sizes[0] * bs;
  const int64_t gpd = d / 8, groups = h * gpd;
  const int64_t chunks = (groups + 31) / 32;
  const Div dchunks = make_div(chunks), dgpd = make_div(gpd);
  const int64_t eb = kFp8 ? 1 : 2;
  const QDiv rk = make_qdiv(p.k_scale), rv = make_qdiv(p.v_scale);
  const int64_t hsk = p.k_cache.view.strides[2] * eb, hsv = p.v_cache.view.strides[2] * eb;
  const int64_t items = p.tokens * chunks;
  staged(
      items, [](int64_t) { return NoIndex{}; },
      [&](int64_t i, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (i >= items) return;
        int64_t n, c;
        divmod(i, dchunks, n, c);
        const int64_t g = c * 32 + lane;
        if (g < groups) {
          cp16(st + 16 + 16 * lane, static_cast<const uint8_t*>(p.key) + n * p.key_stride * 2 + 16 * g);
          cp16(st + 16 + 512 + 16 * lane, static_cast<const uint8_t*>(p.value) + n * p.value_stride * 2 + 16 * g);
        }
        if (lane == 0) cp8(st, p.slots + n);
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t s = *reinterpret_cast<const int64_t*>(st);
        if (!slot_ok(s, limit)) return;
        int64_t n, c, blk, off, hh, kg;
        divmod(i, dchunks, n, c);
        const int64_t g = c * 32 + lane;
        if (g >= groups) return;
        divmod(s, dbs, blk, off);
        divmod(g, dgpd, hh, kg);
        uint8_t* dk = p.k_cache.entry(blk, off) + hh * hsk + kg * 8 * eb;
        uint8_t* dv = p.v_cache.entry(blk, off) + hh * hsv + kg * 8 * eb;
        const uint4 a = lds16(st + 16 + 16 * lane), b = lds16(st + 16 + 512 + 16 * lane);
        if constexpr (!kFp8) {
          st_v16(dk, a);
          st_v16(dv, b);
        } else {
          float x[8];
          to_floats<kBf16>(a, x);
          st_v8(dk, quant8(x, rk));
          to_floats<kBf16>(b, x);
          st_v8(dv, quant8(x, rv));
        }
      });
}

// indexer (16-byte aligned rows): 4 rows per item; stage = 4 slots, then 4 x 256 B.
template <bool kBf16 = true>
__global__ void __launch_bounds__(kThreads) indexer_write_staged_kernel(const IndexerWriteParams p) {
  constexpr int kRows = 4;
  constexpr int kBytes = 32 + kRows * 256;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31, hl = lane & 15, sub = lane >> 4;
  const int64_t bs = p.cache.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t limit = p.cache.view.sizes[0] * bs;
  const int64_t row_bytes = p.k_stride * 2;
  const int64_t items = (p.tokens + kRows - 1) / kRows;
  staged(
      items, [](int64_t) { return NoIndex{}; },
      [&](int64_t i, int stage, NoIndex) {
        uint8_t* st = ring_stage(ring, stage);
        if (i >= items) return;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int r = 2 * k + sub;
          const int64_t n = i * kRows + r;
          if (n < p.tokens)
            cp16(st + 32 + 256 * r + 16 * hl, static_cast<const uint8_t*>(p.k) + n * row_bytes + 16 * hl);
        }
        if (lane < kRows) {
          const int64_t n = i * kRows + lane;
          if (n < p.tokens)
            cp8(st + 8 * lane, p.slots + n);
          else
            *reinterpret_cast<int64_t*>(st + 8 * lane) = -1;
        }
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int r = 2 * k + sub;
          const int64_t s = reinterpret_cast<const int64_t*>(st)[r];
          const H8 hv = unpack(lds16(st + 32 + 256 * r + 16 * hl));
          float x[8];
          float amax = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            x[e] = half_bits_to_float<kBf16>(hv.h[e]);
            amax = fmax_f(amax, abs_f(x[e]));
          }
#pragma unroll
          for (int m = 8; m >= 1; m >>= 1) amax = fmax_f(amax, __shfl_xor_sync(kFull, amax, m));
          if (slot_ok(s, limit)) {
            const float sc = indexer_scale_fast(amax, p.ue8m0);
            const QDiv r = make_qdiv(sc);
            int64_t blk, off;
            divmod(s, dbs, blk, off);
            uint8_t* block = p.cache.entry(blk, 0);
            st_v8(block + off * kIndexerHeadDim + 8 * hl,
                  p.ue8m0 && is_pow2_scale(sc) ? quant8<Quot::kPow2>(x, r) : quant8(x, r));
            if (hl == 0) *reinterpret_cast<float*>(block + bs * kIndexerHeadDim + off * 4) = sc;
          }
        }
      });
}

/// Raw copy (16-byte vectors) and fp8 -> bf16 (8-byte vectors) gathers: an item is one row's run of
/// up to 72 vectors.
template <int kMode>
__global__ void __launch_bounds__(kThreads) gather_staged_kernel(const GatherParams p) {
  constexpr int kVec = kMode == 0 ? 16 : 8;
  constexpr int kBytes = 72 * kVec;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const TensorView& v = p.cache.view;
  const int64_t eb = dtype_size(v.dtype);
  const int64_t n = kMode == 0 ? v.sizes[2] * eb / 16 : v.sizes[2] / 8;  // vectors per row
  const int64_t chunks = (n + 71) / 72;
  const int64_t dst_row = p.dst_stride * (kMode == 0 ? eb : 2);
  const int64_t items = p.total_rows * chunks;
  const DqScale dq = make_dq_scale(p.scale);
  staged(
      items, [&](int64_t i) { return locate_rows<1>(p, dbs, i < items ? i / chunks : p.total_rows); },
      [&](int64_t i, int stage, const Rows<1>& r) {
        uint8_t* st = ring_stage(ring, stage);
        if (!r.src[0]) return;
        const int64_t k0 = i % chunks * 72;
        const int64_t m = n - k0 < 72 ? n - k0 : 72;
        for (int k = lane; k < m; k += 32) {
          if constexpr (kMode == 0)
            cp16(st + 16 * k, r.src[0] + 16 * (k0 + k));
          else
            cp8(st + 8 * k, r.src[0] + 8 * (k0 + k));
        }
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        const int64_t j = i / chunks, k0 = i % chunks * 72;
        const int64_t m = n - k0 < 72 ? n - k0 : 72;
        uint8_t* const out = static_cast<uint8_t*>(p.dst) + j * dst_row + 16 * k0;
        for (int k = lane; k < m; k += 32) {
          if constexpr (kMode == 0)
            st_v16(out + 16 * k, lds16(st + 16 * k));
          else
            st_v16(out + 16 * k, dequant8(lds8(st + 8 * k), dq));
        }
      });
}

/// 656 B -> bf16 rows, 2 rows per item.
__global__ void __launch_bounds__(kThreads) gather_ds_staged_kernel(const GatherParams p) {
  constexpr int kR = 2;
  constexpr int kBytes = kR * kMlaDsBytes;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const Div dbs = make_div(p.cache.view.sizes[1]);
  const int64_t dst_row = p.dst_stride * 2;
  const int64_t items = (p.total_rows + kR - 1) / kR;
  staged(
      items, [&](int64_t i) { return locate_rows<kR>(p, dbs, i < items ? i * kR : p.total_rows); },
      [&](int64_t, int stage, const Rows<kR>& r) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u)
          if (r.src[u]) warp_cp16(st + u * kMlaDsBytes, r.src[u], kMlaDsBytes / 16, lane);
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (i * kR + u >= p.total_rows) continue;
          store_ds_as_bf16(load_ds(st + u * kMlaDsBytes, lane), static_cast<uint8_t*>(p.dst) + (i * kR + u) * dst_row,
                           lane);
        }
      });
}

__global__ void __launch_bounds__(kThreads) dequant_paged_staged_kernel(const DequantPagedParams p) {
  constexpr int kR = 2;
  constexpr int kBytes = 16 + kR * kMlaDsBytes;
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.cache.view.sizes[1], limit = p.cache.view.sizes[0] * bs;
  const Div dbs = make_div(bs);
  const int64_t items = (p.count + kR - 1) / kR;
  staged(
      items, [&](int64_t i) { return load_slots<kR>(p.slots, i * kR, p.count); },
      [&](int64_t, int stage, const Slots<kR, int32_t>& sl) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (lane == 0) reinterpret_cast<int64_t*>(st)[u] = sl.s[u];
          if (!slot_ok(sl.s[u], limit)) continue;
          int64_t blk, off;
          divmod(sl.s[u], dbs, blk, off);
          warp_cp16(st + 16 + u * kMlaDsBytes, p.cache.entry(blk, off), kMlaDsBytes / 16, lane);
        }
      },
      [&](int64_t i, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (!slot_ok(reinterpret_cast<const int64_t*>(st)[u], limit)) continue;
          store_ds_as_bf16(load_ds(st + 16 + u * kMlaDsBytes, lane),
                           static_cast<uint8_t*>(p.dst) + (i * kR + u) * p.dst_stride * 2, lane);
        }
      });
}

/// convert_entries(kind) entries per item, convert_ring(kind) stages. For 576 <-> 656 and
/// 656 -> bf16, 4 entries per item (2.3-2.6 KB of one block's entries) in a ring of 4-5 stages
/// (2 CTAs per SM, bounded by shared memory) against 2 entries and 4 stages (5 CTAs per SM): on an
/// H200, contiguous cache, 576 -> 656 0.818 -> 0.873 (5 stages; 0.836 with 4), 656 -> 576
/// 0.764 -> 0.876 (with one not_lossless store per item and block), 656 -> bf16 0.843 -> 0.868
/// (layer views 0.79 -> 0.81, 0.77 -> 0.83, 0.80 -> 0.82); 8 entries and 2 stages, or 4 and 3,
/// measured between the two, and 2 or 4 entries for bf16 -> 656 lower than 1 (0.725, 0.685).
constexpr int convert_entries(int kind) { return kind == 2 ? 1 : 4; }
constexpr int convert_ring(int kind) { return kind == 0 ? 5 : kStages; }

template <int kKind>
__global__ void __launch_bounds__(kThreads) convert_staged_kernel(const ConvertParams p) {
  constexpr int kU = convert_entries(kKind);
  constexpr int kSt = convert_ring(kKind);
  constexpr int kSrc = kKind == 0 ? kMlaFp8Bytes : kKind == 2 ? kMlaDim * 2 : kMlaDsBytes;
  constexpr int kHdr = 16 * kU;  // destination pointer and block index per entry
  constexpr int kBytes = kHdr + kU * kSrc;
  __shared__ __align__(16) uint8_t ring[kWarps][kSt][kBytes];
  const int lane = threadIdx.x & 31;
  const int64_t bs = p.src.view.sizes[1];
  const Div dbs = make_div(bs);
  const int64_t entries = p.layers * p.count * bs;
  const Div dcount = make_div(p.count);
  const int64_t items = (entries + kU - 1) / kU;
  const DqScale one = make_dq_scale(1.0f);
  struct Where {
    const uint8_t* src[kU];
    uint8_t* dst[kU];
    int64_t blk[kU];
  };
  staged<kSt>(
      items,
      [&](int64_t i) {
        Where a;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          a.src[u] = nullptr;
          a.dst[u] = nullptr;
          a.blk[u] = 0;
          const int64_t w = i * kU + u;
          if (w >= entries) continue;
          int64_t q, t, l, b;
          divmod(w, dbs, q, t);
          divmod(q, dcount, l, b);
          const int64_t sb = p.src_blocks ? p.src_blocks[b] : b;
          const int64_t db = p.dst_blocks ? p.dst_blocks[b] : b;
          a.src[u] = p.src.entry(sb, t) + l * p.src_layer_stride;
          a.dst[u] = p.dst.entry(db, t) + l * p.dst_layer_stride;
          a.blk[u] = b;
        }
        return a;
      },
      [&](int64_t, int stage, const Where& a) {
        uint8_t* st = ring_stage(ring, stage);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (lane == 0) {
            reinterpret_cast<uint8_t**>(st)[2 * u] = a.dst[u];
            reinterpret_cast<int64_t*>(st)[2 * u + 1] = a.blk[u];
          }
          if (a.src[u]) warp_cp16(st + kHdr + u * kSrc, a.src[u], kSrc / 16, lane);
        }
      },
      [&](int64_t, int stage) {
        const uint8_t* st = ring_stage(ring, stage);
        int64_t flagged = -1;  // the block this item last reported not lossless
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          uint8_t* dst = reinterpret_cast<uint8_t* const*>(st)[2 * u];
          if (!dst) continue;
          const uint8_t* e = st + kHdr + u * kSrc;
          if constexpr (kKind == 0) {
            store_fp8_as_ds(load_fp8(e, lane), dst, lane, one);
          } else if constexpr (kKind == 1) {
            const Ds8In in = load_ds8(e, lane);
            // One not_lossless store per item and block, not per entry: the flags of the blocks in
            // flight share a few L2 lines, which every warp's stores met (0.756 -> 0.814 of the
            // D2D copy with 2 entries per item, before the 4-entry items).
            const bool ok = store_ds_as_fp8(in, dst, lane);
            const int64_t b = reinterpret_cast<const int64_t*>(st)[2 * u + 1];
            if (!ok && b != flagged) {
              if (lane == 0 && p.not_lossless) p.not_lossless[b] = 1;
              flagged = b;
            }
          } else if constexpr (kKind == 2) {
            store_bf16_as_ds<true>(load_bf16(e, e + kMlaRank * 2, lane), dst, lane);
          } else {
            store_ds_as_bf16(load_ds(e, lane), dst, lane);
          }
        }
      });
}

// Conversions on the bulk engine: a unit is kConvUnit consecutive entries of one (layer, block),
// whose source bytes are one contiguous range and come in one bulk copy. The warps convert its
// entries (kStrided: warp w entries w, w + kW, ...; else a run of consecutive ones each) and store
// them: kStore: into the warp's shared-memory buffer (two, alternating) and then with one bulk
// copy (the destination's entries are contiguous too), else directly.
constexpr int conv_src_bytes(int kind) { return kind == 0 ? kMlaFp8Bytes : kind == 2 ? kMlaDim * 2 : kMlaDsBytes; }
constexpr int conv_dst_bytes(int kind) { return kind == 1 ? kMlaFp8Bytes : kind == 3 ? kMlaDim * 2 : kMlaDsBytes; }
/// Dynamic shared memory of convert_bulk_kernel: the input ring, the output stages, the barriers.
constexpr int conv_bulk_smem(int kind, bool store, int unit, int stages, int warps) {
  return stages * unit * conv_src_bytes(kind) +
         (store ? 2 * warps * ((unit + warps - 1) / warps) * conv_dst_bytes(kind) : 0) + 8 * 2 * stages;
}

__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#else
  __trap();
#endif
}

template <int kKind, bool kStore, int kConvUnit, int kSt, bool kStrided = false, int kW = kWarps>
__global__ void __launch_bounds__(kW * 32, 2) convert_bulk_kernel(const ConvertParams p, bool ranges) {
  static_assert(!(kStore && kStrided), "a warp's bulk store needs its entries consecutive");
  constexpr int kSrc = conv_src_bytes(kKind), kDst = conv_dst_bytes(kKind);
  constexpr int kStage = kConvUnit * kSrc;
  constexpr int kPer = (kConvUnit + kW - 1) / kW;  // entries per warp and unit
  constexpr int kOut = kPer * kDst;                // a warp's output buffer
  extern __shared__ __align__(128) uint8_t smem[];
  auto* ring = reinterpret_cast<uint8_t(*)[kStage]>(smem);
  uint8_t* const out = smem + kSt * kStage;  // kStore: 2 buffers of kOut per warp
  auto* bars = reinterpret_cast<uint64_t*>(out + (kStore ? 2 * kW * kOut : 0));
  const int64_t bs = p.src.view.sizes[1];
  const int64_t chunks = (bs + kConvUnit - 1) / kConvUnit;  // units per (layer, block)
  const Div dchunks = make_div(chunks), dcount = make_div(p.count);
  const int64_t units = p.layers * p.count * chunks;
  const DqScale one = make_dq_scale(1.0f);
  const int64_t dstep = p.dst.view.strides[1] * dtype_size(p.dst.view.dtype);
  struct Unit {
    int64_t l, b, t0;
    int count;
  };
  auto locate = [&](int64_t u) {
    Unit w;
    int64_t q, c;
    divmod(u, dchunks, q, c);
    divmod(q, dcount, w.l, w.b);
    w.t0 = c * kConvUnit;
    w.count = static_cast<int>(bs - w.t0 < kConvUnit ? bs - w.t0 : kConvUnit);
    return w;
  };
  bulk_units<kStage, kSt>(
      units, ring, bars,
      [&](int64_t u, uint32_t st, uint32_t bar, int lane) {
        if (lane != 0) return;
        const Unit w = locate(u);
        const int64_t sb = p.src_blocks ? p.src_blocks[w.b] : w.b;
        const uint32_t bytes = static_cast<uint32_t>(w.count * kSrc);
        mbar_expect_tx(bar, bytes);
        ptx::bulk_g2s(st, p.src.entry(sb, w.t0) + w.l * p.src_layer_stride, bytes, bar);
      },
      [&](int64_t u, int64_t k, const uint8_t* st, int warp, int lane) {
        const Unit w = locate(u);
        // The warp's entries: [e0, e1) of the unit, consecutive in the destination too; kStrided:
        // e0, e0 + 8, ... instead.
        const int e0 = kStrided ? warp : warp * kPer;
        const int e1 = kStrided ? w.count : (e0 + kPer < w.count ? e0 + kPer : w.count);
        // kStore: every unit is whole (the launcher takes the bulk engine only for block sizes
        // that are multiples of the unit), so each warp stores at every unit and its buffers
        // alternate with its bulk groups; a warp skipping a unit would break wait_group.read 1.
        if (e0 >= e1) return;
        const int64_t db = p.dst_blocks ? p.dst_blocks[w.b] : w.b;
        uint8_t* const dst0 = p.dst.entry(db, w.t0 + e0) + w.l * p.dst_layer_stride;
        uint8_t* const ob = out + (2 * warp + static_cast<int>(k & 1)) * kOut;
        if constexpr (kStore) {
          // This buffer's previous store (two of the warp's stores ago) must have read it.
          if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
          __syncwarp();
        }
        bool lossless = true;
        for (int e = e0; e < e1; e += kStrided ? kW : 1) {
          const uint8_t* src = st + e * kSrc;
          uint8_t* dst = kStore ? ob + (e - e0) * kDst : dst0 + (e - e0) * dstep;  // dst0: entry e0
          if constexpr (kKind == 0) {
            store_fp8_as_ds(load_fp8(src, lane), dst, lane, one);
          } else if constexpr (kKind == 1) {
            lossless &= store_ds_as_fp8(load_ds8(src, lane), dst, lane);
          } else if constexpr (kKind == 2) {
            store_bf16_as_ds<true>(load_bf16(src, src + kMlaRank * 2, lane), dst, lane);
          } else {
            store_ds_as_bf16(load_ds(src, lane), dst, lane);
          }
        }
        if constexpr (kKind == 1) {
          if (!lossless && lane == 0 && p.not_lossless) p.not_lossless[w.b] = 1;
        }
        if constexpr (kStore) {
          // The bulk copy reads the buffer through the async proxy: fence the warp's writes first.
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          __syncwarp();
          if (lane == 0) bulk_store(dst0, smem_addr(ob), static_cast<uint32_t>((e1 - e0) * kDst));
        }
      },
      ranges);
  if (kStore && (threadIdx.x & 31) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/// The engine a launcher's params force, or -1 for its default (DatapathEngine::kAuto): the engine
/// that measured faster on an H200 (kvferry-bench kernels, the engines in one run): bulk for the
/// conversions (where their entries allow it, else staged, and direct for bf16 -> 656), direct for
/// the writers, the indexer, the gathers and dequant_paged (kernels/DESIGN.md §2.1).
int forced_engine(DatapathEngine e) {
  switch (e) {
    case DatapathEngine::kDirect: return 0;
    case DatapathEngine::kStaged: return 1;
    case DatapathEngine::kBulk: return 2;
    default: return -1;
  }
}
bool use_staged(DatapathEngine e, bool by_default) {
  const int forced = forced_engine(e);
  return forced < 0 || forced == 2 ? by_default : forced == 1;
}
/// The bulk engine where the kernel has one and the device runs it: bulk copies need sm_90, a CTA
/// needs `smem` bytes of shared memory, and the build must have compiled the kernels for sm_90
/// (code built for an older architecture and JIT-compiled would trap).
bool use_bulk(DatapathEngine e, bool by_default, int smem) {
  const int forced = forced_engine(e);
  if (forced >= 0 && forced != 2) return false;
  if (forced < 0 && !by_default) return false;
  int dev = 0, major = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major < 9 ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || smem > optin)
    return false;
  static const bool built = [] {
    cudaFuncAttributes fa{};
    return cudaFuncGetAttributes(&fa, convert_bulk_kernel<0, true, 64, 2>) == cudaSuccess && fa.binaryVersion >= 90 &&
           fa.ptxVersion >= 90;
  }();
  return built;
}

bool aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0; }

/// Launches kernel kK over `items` work items, `per_warp` per warp and trip.
template <auto kK, class P>
cudaError_t go(const P& p, int64_t items, int64_t per_warp, cudaStream_t stream, int max_per_sm = 0) {
  kK<<<grid_for<kK>(items, per_warp, max_per_sm), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_write_mla(const WriteMlaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, false);
  const bool bf16 = p.input_dtype == DType::kBF16;
  switch (p.mode) {
    case MlaWriteMode::kCopy:
      return sg ? go<write_mla_staged_kernel<0>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<0>>(p, p.tokens, 2, stream);
    case MlaWriteMode::kFp8:
      if (!bf16)
        return sg ? go<write_mla_staged_kernel<1, false>>(p, p.tokens, 1, stream)
                  : go<write_mla_kernel<1, false>>(p, p.tokens, 1, stream);
      return sg ? go<write_mla_staged_kernel<1>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<1>>(p, p.tokens, 1, stream);
    case MlaWriteMode::kFp8Ds:
      // Three CTAs per SM where four fit. With random slots each 656 B entry shares a sector with a
      // neighbour written at another time; since the quotient takes one correction (quot_ds), a
      // fourth CTA's stores in flight cost more than its warps gain (kernels/DESIGN.md §2.2).
      return sg ? go<write_mla_staged_kernel<2>>(p, p.tokens, 1, stream)
                : go<write_mla_kernel<2>>(p, p.tokens, 1, stream, 3);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_write_mha(const WriteMhaParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, false);
  if (p.k_cache.view.dtype == DType::kFP8E4M3) {
    if (p.input_dtype != DType::kBF16)
      return sg ? go<write_mha_staged_kernel<true, false>>(p, p.tokens, 1, stream)
                : go<write_mha_kernel<true, false>>(p, p.tokens, 1, stream);
    return sg ? go<write_mha_staged_kernel<true>>(p, p.tokens, 1, stream)
              : go<write_mha_kernel<true>>(p, p.tokens, 1, stream);
  }
  return sg ? go<write_mha_staged_kernel<false>>(p, p.tokens, 1, stream)
            : go<write_mha_kernel<false>>(p, p.tokens, 1, stream);
}

cudaError_t launch_indexer_write(const IndexerWriteParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool bf16 = p.input_dtype == DType::kBF16;
  if (!aligned(p.k, 16) || (p.k_stride * 2) % 16 != 0)
    return bf16 ? go<indexer_write_narrow_kernel<true>>(p, p.tokens, 2, stream)
                : go<indexer_write_narrow_kernel<false>>(p, p.tokens, 2, stream);
  if (!bf16)
    return use_staged(p.engine, false) ? go<indexer_write_staged_kernel<false>>(p, p.tokens, 4, stream)
                                       : go<indexer_write_wide_kernel<false>>(p, p.tokens, 8, stream);
  return use_staged(p.engine, false) ? go<indexer_write_staged_kernel<true>>(p, p.tokens, 4, stream)
                                     : go<indexer_write_wide_kernel<true>>(p, p.tokens, 8, stream);
}

cudaError_t launch_gather(const GatherParams& p, cudaStream_t stream) {
  if (p.total_rows == 0) return cudaSuccess;
  const int64_t n = p.total_rows;
  const bool sg = use_staged(p.engine, false);
  switch (p.mode) {
    case GatherMode::kCopy: {
      const TensorView& v = p.cache.view;
      const int64_t eb = dtype_size(v.dtype);
      const int64_t row = v.sizes[2] * eb;
      const uint8_t* first = static_cast<const uint8_t*>(p.cache.base) + v.offset;
      auto fits = [&](int64_t a) {
        return row % a == 0 && (v.strides[0] * eb) % a == 0 && (v.strides[1] * eb) % a == 0 && aligned(first, a) &&
               aligned(p.dst, a) && (p.dst_stride * eb) % a == 0;
      };
      if (fits(16)) return sg ? go<gather_staged_kernel<0>>(p, n, 1, stream) : go<gather_kernel<0>>(p, n, 2, stream);
      if (fits(4)) return go<gather_copy_narrow_kernel<4>>(p, n, 4, stream);
      if (fits(2)) return go<gather_copy_narrow_kernel<2>>(p, n, 4, stream);
      return go<gather_copy_narrow_kernel<1>>(p, n, 4, stream);
    }
    case GatherMode::kDequantFp8:
      if (!sg && p.cache.view.sizes[2] == kMlaDim) return go<gather_fp8_576_kernel>(p, n, 2, stream);
      return sg ? go<gather_staged_kernel<1>>(p, n, 1, stream) : go<gather_kernel<1>>(p, n, 4, stream);
    case GatherMode::kDequantDs:
      return sg ? go<gather_ds_staged_kernel>(p, n, 2, stream) : go<gather_ds_kernel>(p, n, 2, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_dequant_paged(const DequantPagedParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  return use_staged(p.engine, false) ? go<dequant_paged_staged_kernel>(p, p.count, 2, stream)
                                     : go<dequant_paged_kernel>(p, p.count, 2, stream);
}

/// Launches bulk-engine kernel kK over `units` units (one per CTA and trip) with `smem` bytes of
/// dynamic shared memory: at most one wave of the CTAs that fit. The shared-memory opt-in and the
/// occupancy belong to a device, so they are kept per device (0: not yet known; devices past 15
/// ask every time). use_bulk has checked that `smem` fits the device.
template <auto kK, class P, class... A>
cudaError_t go_bulk(const P& p, int64_t units, int smem, cudaStream_t stream, int threads, A... args) {
  static std::atomic<int> per_sm_of[16];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  int per_sm = dev >= 0 && dev < 16 ? per_sm_of[dev].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    e = cudaFuncSetAttribute(kK, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kK, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kK, threads, smem);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return e;
    }
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    if (dev >= 0 && dev < 16) per_sm_of[dev].store(per_sm, std::memory_order_relaxed);
  }
  kK<<<one_wave(units, per_sm), threads, smem, stream>>>(p, args...);
  return cudaGetLastError();
}

/// go() for the direct conversion kernels, which also take their EntryWalk stride: the grid's
/// warps times `per_warp` entries, in the radix (block size, count).
template <auto kK>
cudaError_t go_walk(const ConvertParams& p, int64_t items, int64_t per_warp, cudaStream_t stream) {
  const unsigned grid = grid_for<kK>(items, per_warp);
  const int64_t s = static_cast<int64_t>(grid) * kWarps * per_warp, bs = p.src.view.sizes[1];
  WalkStep ws;
  ws.st = static_cast<uint32_t>(s % bs);
  ws.sb = static_cast<uint32_t>(s / bs % p.count);
  const int64_t sl = s / bs / p.count;
  ws.sl = sl < (int64_t{1} << 31) ? static_cast<uint32_t>(sl) : 0x80000000u;
  kK<<<grid, kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

cudaError_t launch_convert(const ConvertParams& p, cudaStream_t stream) {
  const int64_t n = p.layers * p.count * p.src.view.sizes[1];
  if (n == 0) return cudaSuccess;
  const bool sg = use_staged(p.engine, p.kind != ConvertKind::kBf16ToDs);
  // The bulk engine where both sides' entries are contiguous within a block (16-byte aligned
  // ranges) and the block size is a multiple of the unit; unit and ring per kind as measured
  // fastest on an H200 (kernels/DESIGN.md §2.3): whole blocks of 64 entries in two
  // stages, stored by bulk copies for 576 <-> 656 and by the warps for 656 -> bf16; for bf16 ->
  // 656 (issue-bound) 32 entries in three stages (16 in six for smaller blocks) and 16 warps per
  // CTA, each taking every sixteenth entry. For blocks of 16 or 32 entries the others stay
  // staged: with units of 16 entries the bulk engine measured as fast or slower there.
  auto contiguous = [](const CacheRef& c, int64_t entry_bytes, int64_t layer_stride) {
    const int64_t eb = dtype_size(c.view.dtype);
    return c.view.strides[1] * eb == entry_bytes && aligned(c.entry(0, 0), 16) && (c.view.strides[0] * eb) % 16 == 0 &&
           layer_stride % 16 == 0;
  };
  const int kind = static_cast<int>(p.kind);
  const int64_t bs = p.src.view.sizes[1];
  // (use_bulk's shared memory: the largest ring of the four, 576 -> 656's with its store buffers.)
  if (kind >= 0 && kind <= 3 && bs % (kind == 2 ? 16 : 64) == 0 &&
      use_bulk(p.engine, true, conv_bulk_smem(0, true, 64, 2, kWarps)) &&
      contiguous(p.src, conv_src_bytes(kind), p.src_layer_stride) &&
      contiguous(p.dst, conv_dst_bytes(kind), p.dst_layer_stride)) {
    auto units = [&](int unit) { return p.layers * p.count * (bs / unit); };
    // Unit order: for a whole view whose blocks lie apart (a layer view of a block-major buffer,
    // no block list), one range of consecutive units per CTA; otherwise grid-stride, so the grid
    // sweeps a contiguous cache in order: ranges gain a little on layer views read in order and
    // lose on contiguous caches and on shuffled lists (kernels/DESIGN.md §2.3).
    // ConvertParams::unit_order forces one.
    auto apart = [bs](const CacheRef& c, int64_t entry_bytes) {
      return c.view.strides[0] * dtype_size(c.view.dtype) != bs * entry_bytes;
    };
    const bool ranges = p.unit_order != ConvertUnitOrder::kAuto
                            ? p.unit_order == ConvertUnitOrder::kRanges
                            : !p.src_blocks && !p.dst_blocks &&
                                  (apart(p.src, conv_src_bytes(kind)) || apart(p.dst, conv_dst_bytes(kind)));
#define KVF_CONV(K, S, U, ST, SD)                                                                                   \
  go_bulk<convert_bulk_kernel<K, S, U, ST, SD>>(p, units(U), conv_bulk_smem(K, S, U, ST, kWarps), stream, kThreads, \
                                                ranges)
#define KVF_CONV16(K, S, U, ST, SD) \
  go_bulk<convert_bulk_kernel<K, S, U, ST, SD, 16>>(p, units(U), conv_bulk_smem(K, S, U, ST, 16), stream, 512, ranges)
    switch (kind) {
      case 0: return KVF_CONV(0, true, 64, 2, false);
      case 1: return KVF_CONV(1, true, 64, 2, false);
      case 2: return bs % 32 == 0 ? KVF_CONV16(2, false, 32, 3, true) : KVF_CONV16(2, false, 16, 6, true);
      default: return KVF_CONV(3, false, 64, 2, false);
    }
#undef KVF_CONV
#undef KVF_CONV16
  }
  switch (p.kind) {
    case ConvertKind::kFp8ToDs:
      return sg ? go<convert_staged_kernel<0>>(p, n, convert_entries(0), stream)
                : go_walk<convert_kernel<0>>(p, n, 2, stream);
    case ConvertKind::kDsToFp8:
      return sg ? go<convert_staged_kernel<1>>(p, n, convert_entries(1), stream)
                : go_walk<convert_kernel<1>>(p, n, 2, stream);
    case ConvertKind::kBf16ToDs:
      return sg ? go<convert_staged_kernel<2>>(p, n, convert_entries(2), stream)
                : go_walk<convert_kernel<2>>(p, n, 1, stream);
    case ConvertKind::kDsToBf16:
      return sg ? go<convert_staged_kernel<3>>(p, n, convert_entries(3), stream)
                : go_walk<convert_kernel<3>>(p, n, 2, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvferry::kernels
