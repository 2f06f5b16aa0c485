#pragma once
// Device primitives of the data-path CUDA kernels (write.cu, gather.cu, convert.cu): 16- and
// 8-byte accesses (plain, and with an L2 evict-first policy), loop-invariant division by
// multiply-high, the vector conversions whose fast paths give the CPU twins' bits, the
// warp-cooperative entry loads and stores more than one kernel family shares, and the cp.async
// wrappers of the staged engine. Private to kernels/src.
//
// The math gives the CPU twins' bits (common/datapath_math.h): quantisation divides through the
// reciprocal with two Markstein corrections (no per-value range checks: the scale's range is
// checked once, overflow and NaN show up as the cvt's NaN code) and converts pairs with the packed
// e4m3 cvt; power-of-two scales multiply once; dequantisation converts e4m3 pairs to f16 in
// hardware (exact), multiplies once and packs pairs to bf16; every warp-wide store covers whole
// sectors; loop-invariant divisors (block size, row chunks) divide by multiply-high. Inputs outside
// the fast paths' exact range (NaN, extreme scales) take the scalar path, kept out of line. The
// direct write_mha fp8 and indexer writers write their rows with an L2 evict-first policy
// (st_v8_once); the indexer also reads with it where an item's slots are scattered (ld_v16_once).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/datapath_math.h"
#include "kvferry/layouts/entry_format.h"

namespace kvferry::kernels::detail {

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
static __device__ __noinline__ uint32_t quant4_slow(float a, float b, float c, float d, float s) {
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

/// The scalar path of dequant4 (NaN bytes, large scales), out of line. `used` keeps it one function
/// for both values of `unscaled`: gather.cu passes only false, and the copy the compiler specialised
/// for that changed the register allocation of the gathers' fast paths.
static __device__ __noinline__ __attribute__((used)) uint2 dequant4_slow(uint32_t w, float s, bool unscaled) {
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

// ---- destination slots ----

__device__ __forceinline__ bool slot_ok(int64_t s, int64_t limit) { return s >= 0 && s < limit; }

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

// ---- cp.async (the staged engine's copies) ----

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

__device__ __forceinline__ uint4 lds16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint2 lds8(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

}  // namespace kvferry::kernels::detail
