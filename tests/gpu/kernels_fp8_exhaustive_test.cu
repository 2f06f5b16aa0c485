// The device's float -> e4m3 conversion used by the data-path kernels (hardware cvt on sm_89+)
// against layouts' float_to_e4m3 (what the CPU twins use) for all 2^32 float bit patterns; the
// kernels' fast paths likewise: the packed bf16 cvt against float_to_bf16, the one-multiply
// quantisation (quant2_fast) against e4m3 of __fdiv_rn for every float dividend and a set of
// divisors, the mla_fp8_ds tile quotient (quot_ds) for every bf16 tile maximum and value, and the hardware e4m3x2 ->
// f16x2 conversion against e4m3_to_float for every byte pair; and the MLA decode's e4m3 -> bf16 and e4m3 -> fp16 tile
// conversions (convert16_words and convert16_f16, decode_mla/wgmma.cuh) against the host's rounding of e4m3_to_float
// for every byte pair.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "common/datapath_math.h"
#include "decode_mla/wgmma.cuh"
#include "kvferry/kernels/device.h"

namespace kvferry {
namespace {

namespace dd = kernels::detail;

// How many indices i < n a check found wrong (check(i) true), and the lowest of them.
struct Mismatches {
  unsigned long long count = 0;
  uint64_t first = ~uint64_t{0};
};

template <class Check>
__global__ void count_mismatches(uint64_t n, Check check, unsigned long long* count, unsigned long long* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long local = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (check(i)) {
      ++local;
      atomicMin(first, static_cast<unsigned long long>(i));
    }
  }
  if (local) atomicAdd(count, local);
}

/// Runs check over every index below n on the device (a grid-stride kernel of 1024 x 256 threads).
template <class Check>
Mismatches run_exhaustive(uint64_t n, Check check) {
  unsigned long long* m = nullptr;
  Mismatches r;
  if (cudaMallocManaged(&m, 2 * sizeof *m) != cudaSuccess) {
    ADD_FAILURE() << "cudaMallocManaged failed";
    r.count = 1;
    return r;
  }
  m[0] = 0;
  m[1] = ~0ull;
  count_mismatches<<<1024, 256>>>(n, check, m, m + 1);
  const cudaError_t e = cudaDeviceSynchronize();
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  r.count = e == cudaSuccess ? m[0] : 1;
  r.first = m[1];
  cudaFree(m);
  return r;
}

// The device's float -> e4m3 against the host's, for one float bit pattern.
struct DeviceE4m3 {
  __device__ bool operator()(uint64_t i) const {
    const float x = bits_float(static_cast<uint32_t>(i));
    return dd::to_e4m3(x) != float_to_e4m3(x);
  }
};

TEST(KernelsGpuFp8, DeviceConversionMatchesHostForAllFloats) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Mismatches m = run_exhaustive(uint64_t{1} << 32, DeviceE4m3{});
  const float x = bits_float(static_cast<uint32_t>(m.first));
  EXPECT_EQ(m.count, 0ull) << "first mismatch at float bits 0x" << std::hex << m.first << ": device "
                           << int(dd::to_e4m3(x)) << " host " << int(float_to_e4m3(x));
}

// For float bit pattern i and divisor s: the packed bf16 cvt, the one-multiply quantisation where it
// claims the input, and (i < 65536) the hardware e4m3x2 -> f16x2 conversion of byte pair i.
struct FastPaths {
  float s;
  dd::QDiv d;
  __device__ bool operator()(uint64_t i) const {
    const float x = bits_float(static_cast<uint32_t>(i));
    bool bad = false;
    if (x == x) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(x, -x);
      uint32_t u;
      memcpy(&u, &h, 4);
      bad |= u != (float_to_bf16(x) | (static_cast<uint32_t>(float_to_bf16(-x)) << 16));
    }
    uint32_t q = 0;
    if (d.fast && dd::quant2_fast(x, -x, d, &q))
      bad |= q != (dd::to_e4m3(__fdiv_rn(x, s)) | (static_cast<uint32_t>(dd::to_e4m3(__fdiv_rn(-x, s))) << 8));
    if (i < 65536u) {
      const uint8_t b0 = static_cast<uint8_t>(i), b1 = static_cast<uint8_t>(i >> 8);
      if ((b0 & 0x7fu) != 0x7fu && (b1 & 0x7fu) != 0x7fu) {
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(i), __NV_E4M3);
        const float2 f = __half22float2(__half2(r));
        bad |= float_bits(f.x) != float_bits(e4m3_to_float(b0)) || float_bits(f.y) != float_bits(e4m3_to_float(b1));
      }
    }
    return bad;
  }
};

TEST(KernelsGpuFp8, FastPathsMatchScalarMathForAllFloats) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (float s :
       {0.037f, 0.1f, 3.0f, 0.5f, 1.0f / 448.0f, 0.01171875f / 448.0f, 2.3e-9f, 7.7e13f, 0x1p-80f, 0x1.fffffep79f}) {
    const Mismatches m = run_exhaustive(uint64_t{1} << 32, FastPaths{s, dd::make_qdiv(s)});
    EXPECT_EQ(m.count, 0ull) << "divisor " << s << ": first mismatch at float bits 0x" << std::hex << m.first;
  }
}

// quot_ds on the device, for every pair the unit test KernelsFastMath.DsTileQuotientIsExact checks on
// the host: a positive finite bf16 tile maximum with a fast scale, a bf16 value of either sign up to
// it; e4m3 of the quotient against e4m3 of __fdiv_rn (the CPU twins' quant_e4m3). Index i is amax
// bits i / 32768 and x bits i % 32768.
struct DsQuotients {
  __device__ bool operator()(uint64_t i) const {
    const uint32_t ha = static_cast<uint32_t>(i >> 15), hx = static_cast<uint32_t>(i & 0x7fffu);
    if (hx > ha) return false;
    const float s = dd::ds_tile_scale(bf16_to_float(static_cast<uint16_t>(ha)));
    const dd::QDiv d = dd::make_qdiv(s);
    if (!d.fast) return false;
    const float x = bf16_to_float(static_cast<uint16_t>(hx));
    bool bad = false;
    for (float v : {x, -x}) bad |= dd::to_e4m3(dd::quot_ds(v, d)) != dd::to_e4m3(__fdiv_rn(v, s));
    return bad;
  }
};

TEST(KernelsGpuFp8, DsTileQuotientMatchesDivisionForAllBf16Pairs) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Mismatches m = run_exhaustive(uint64_t{0x7f80} << 15, DsQuotients{});
  EXPECT_EQ(m.count, 0ull) << "first mismatch: amax bf16 0x" << std::hex << (m.first >> 15) << ", x bf16 0x"
                           << (m.first & 0x7fffu);
}

// Every byte pair i: the tile conversion of the wgmma decode kernels (convert16_words, unscaled as
// for mla_fp8 and times 1 as for mla_fp8_ds with unit scales) against the host's
// float_to_bf16(e4m3_to_float) (exact: every e4m3 value is a bf16 value); the NaN codes 0x7f / 0xff
// give a NaN.
struct DecodeE4m3ToBf16 {
  __device__ bool operator()(uint64_t p) const {
    const uint32_t i = static_cast<uint32_t>(p);
    const uint32_t w = i | (i << 16);
    uint32_t a[8], b[8];
    mla_detail::convert16_words<false>(make_uint4(w, w, w, w), 1.0f, a);
    mla_detail::convert16_words<true>(make_uint4(w, w, w, w), 1.0f, b);
    bool ok = true;
    for (int k = 0; k < 2; ++k) {  // every output word holds bf16(byte 0) low, bf16(byte 1) high
      const uint8_t byte = static_cast<uint8_t>(i >> (8 * k));
      const bool nan = (byte & 0x7f) == 0x7f;
      const uint16_t want = nan ? 0 : float_to_bf16(e4m3_to_float(byte));
      for (int j = 0; j < 8; ++j) {
        const uint16_t ga = static_cast<uint16_t>(a[j] >> (16 * k)), gb = static_cast<uint16_t>(b[j] >> (16 * k));
        ok = ok && (nan ? (ga & 0x7fff) > 0x7f80 && (gb & 0x7fff) > 0x7f80 : ga == want && gb == want);
      }
    }
    return !ok;
  }
};

TEST(KernelsGpuFp8, DecodeE4m3ToBf16MatchesForAllBytePairs) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Mismatches m = run_exhaustive(65536, DecodeE4m3ToBf16{});
  EXPECT_EQ(m.count, 0ull) << "first mismatch at byte pair 0x" << std::hex << m.first;
}

// Every byte pair i: the fp16 tile conversion of the seesaw decode kernel (convert16_f16, unscaled
// as for mla_fp8 and times ds_scale_f16x2(1) as for mla_fp8_ds with unit scales) against the host's
// float_to_f16(e4m3_to_float) (exact: every e4m3 value is an fp16 value); the NaN codes give a NaN.
// Also times 2 and times 0.5 (exact for every byte), and a scale above 146 clamps to 146.
struct DecodeE4m3ToF16 {
  __device__ bool operator()(uint64_t p) const {
    const uint32_t i = static_cast<uint32_t>(p);
    const uint32_t w = i | (i << 16);
    const uint4 raw = make_uint4(w, w, w, w);
    constexpr float kScales[4] = {1.0f, 2.0f, 0.5f, 1000.0f};
    uint32_t a[8];
    mla_detail::convert16_f16<false>(raw, 0u, a);
    bool ok = true;
    for (int si = -1; si < 4; ++si) {
      uint32_t b[8];
      if (si >= 0) mla_detail::convert16_f16<true>(raw, mla_detail::ds_scale_f16x2(kScales[si]), b);
      const float scale = si < 0 ? 1.0f : si == 3 ? 146.0f : kScales[si];
      for (int k = 0; k < 2; ++k) {
        const uint8_t byte = static_cast<uint8_t>(i >> (8 * k));
        const bool nan = (byte & 0x7f) == 0x7f;
        const uint16_t want = nan ? 0 : __half_as_ushort(__float2half_rn(e4m3_to_float(byte) * scale));
        for (int j = 0; j < 8; ++j) {
          const uint16_t got = static_cast<uint16_t>((si < 0 ? a[j] : b[j]) >> (16 * k));
          ok = ok && (nan ? (got & 0x7fff) > 0x7c00 : got == want);
        }
      }
    }
    return !ok;
  }
};

TEST(KernelsGpuFp8, DecodeE4m3ToF16MatchesForAllBytePairs) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Mismatches m = run_exhaustive(65536, DecodeE4m3ToF16{});
  EXPECT_EQ(m.count, 0ull) << "first mismatch at byte pair 0x" << std::hex << m.first;
}

}  // namespace
}  // namespace kvferry
