// The mla_fp4 CUDA kernels against their CPU twins, bit for bit: random bf16 entries over extreme
// scales (bf16 subnormals to the top binade, inf and NaN groups), random fp4 bytes (every code and
// scale byte, 0xFF included), block-major and layer-major regions, first / middle / last layers of
// cross-layer views, block sizes whose pages are only 4-byte aligned, shuffled block lists, and
// SGLang-style separate per-layer value and scale tensors. Whole regions are compared, so bytes
// outside the written views must stay as they were on both sides.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../unit/kernels_test_util.h"
#include "kvferry/kernels/fp4.h"

namespace kvferry {
namespace {

using kernels::MlaFp4Params;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;  // no driver: error 35, not 0 devices
}

/// Host and device copies of one byte buffer.
struct Mirror {
  std::vector<uint8_t> h;
  uint8_t* d = nullptr;
  explicit Mirror(size_t n, uint32_t seed) : h(n ? n : 1) {
    test::fill_random(h.data(), h.size(), seed);
    if (cudaMalloc(&d, h.size()) == cudaSuccess) (void)cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice);
  }
  ~Mirror() {
    if (d) (void)cudaFree(d);
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  int64_t bytes() const { return static_cast<int64_t>(h.size()); }
  void upload() { (void)cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice); }
  /// Index of the first byte where the device copy differs from the host copy, or -1.
  int64_t first_diff() const {
    std::vector<uint8_t> back(h.size());
    if (cudaMemcpy(back.data(), d, back.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return -2;
    for (size_t i = 0; i < back.size(); ++i)
      if (back[i] != h[i]) return static_cast<int64_t>(i);
    return -1;
  }
};

template <class T>
struct DevArray {
  T* p = nullptr;
  explicit DevArray(const std::vector<T>& v) {
    if (!v.empty() && cudaMalloc(&p, v.size() * sizeof(T)) == cudaSuccess)
      (void)cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DevArray() {
    if (p) (void)cudaFree(p);
  }
};

/// bf16 entries whose groups span the whole bf16 range: per group a random binade in
/// [-140, 124], some groups mixed, a few with inf or NaN, some all zero.
void fill_extreme_bf16(uint8_t* p, const KvCacheSpec& s, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(-140, 124);
  for (int64_t l = 0; l < s.layers; ++l)
    for (int64_t b = 0; b < s.blocks; ++b)
      for (int64_t t = 0; t < s.block_size; ++t) {
        uint8_t* e = p + s.page_offset(l, b) + t * kMlaBf16Bytes;
        for (int grp = 0; grp < kernels::kMlaFp4Groups; ++grp) {
          const int kind = static_cast<int>(g() % 16), e0 = ed(g);
          for (int i = 0; i < kMlaFp4Group; ++i) {
            uint16_t h = float_to_bf16(std::ldexp(nd(g), kind == 1 ? ed(g) : e0));
            if (kind == 2) h = 0;
            if (kind == 3 && i == 5) h = g() % 2 ? 0x7f80 : 0xff80;
            if (kind == 4 && i == 9) h = 0x7fc0;
            if (kind == 5) h = static_cast<uint16_t>(g() & 0x807f);  // subnormals and zeros
            if (kind == 6 && i == 0) h = 0x7f7f;                     // bf16 max: top-binade overflow
            std::memcpy(e + 2 * (grp * kMlaFp4Group + i), &h, 2);
          }
        }
      }
}

struct Case {
  int64_t layers, blocks, bs, layer;
  Layout layout;
  bool listed;
};

std::string name(const Case& c) {
  return "L" + std::to_string(c.layers) + " NB" + std::to_string(c.blocks) + " BS" + std::to_string(c.bs) + " layer " +
         std::to_string(c.layer) + (c.layout == Layout::kBlockMajor ? " block_major" : " layer_major") +
         (c.listed ? " listed" : "");
}

class Fp4Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// One layer's view (layer >= 0) or all layers (layer < 0), with or without block lists.
TEST_F(Fp4Gpu, QuantizeAndDequantizeMatchTheCpuTwins) {
  const Case cases[] = {{1, 4, 64, 0, Layout::kBlockMajor, false},  {3, 5, 64, 1, Layout::kBlockMajor, false},
                        {61, 3, 64, 60, Layout::kBlockMajor, true}, {5, 4, 16, 0, Layout::kLayerMajor, true},
                        {3, 6, 3, 2, Layout::kBlockMajor, true},    {4, 7, 1, -1, Layout::kBlockMajor, false},
                        {3, 9, 5, -1, Layout::kLayerMajor, true},   {2, 0, 64, -1, Layout::kBlockMajor, false},
                        {2, 300, 64, -1, Layout::kBlockMajor, true}};
  uint32_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    const auto hs = test::mk_spec(c.layers, c.blocks, c.bs, EntryFormat::mla_bf16(), c.layout);
    // The fp4 region has the other layout and one block more, so the lists map blocks around.
    const auto fs = test::mk_spec(c.layers, c.blocks + 1, c.bs, EntryFormat::mla_fp4(),
                                  c.layout == Layout::kBlockMajor ? Layout::kLayerMajor : Layout::kBlockMajor);
    Mirror h(static_cast<size_t>(hs.region_bytes()), seed++), f(static_cast<size_t>(fs.region_bytes()), seed++);
    fill_extreme_bf16(h.h.data(), hs, seed++);
    h.upload();
    std::vector<int64_t> hb(static_cast<size_t>(c.blocks)), fb(hb.size());
    std::iota(hb.begin(), hb.end(), 0);
    std::iota(fb.begin(), fb.end(), 1);
    std::mt19937 g(seed++);
    std::shuffle(hb.begin(), hb.end(), g);
    DevArray<int64_t> dhb(hb), dfb(fb);

    auto params = [&](uint8_t* hbase, uint8_t* fbase, bool dev) {
      auto p = kernels::make_mla_fp4_params(hbase, hs, fbase, fs);
      EXPECT_TRUE(p.ok()) << p.status().to_string();
      MlaFp4Params q = *p;
      if (c.layer >= 0) {  // one layer's views
        q.bf16.view = hs.layer_view(c.layer);
        q.values.view = fs.mla_fp4_values_view(c.layer);
        q.scales.view = fs.mla_fp4_scales_view(c.layer);
        q.layers = 1;
        q.bf16_layer_stride = q.fp4_layer_stride = 0;
      }
      q.count = c.blocks;
      if (c.listed) {
        q.bf16_blocks = dev ? dhb.p : hb.data();
        q.fp4_blocks = dev ? dfb.p : fb.data();
      } else {  // block i <-> block i: shift the fp4 views by one block to keep the two sides apart
        q.values.view.offset += fs.block_stride_bytes();
        q.scales.view.offset += fs.block_stride_bytes();
        q.values.view.sizes[0] = q.scales.view.sizes[0] = c.blocks;
      }
      return q;
    };
    const MlaFp4Params hq = params(h.h.data(), f.h.data(), false);
    const MlaFp4Params dq = params(h.d, f.d, true);
    ASSERT_TRUE(kernels::validate_mla_fp4(dq).ok()) << kernels::validate_mla_fp4(dq).to_string();
    ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(hq).ok());
    CUDA_OK(kernels::launch_quantize_mla_fp4(dq, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(f.first_diff(), -1) << "quantize";

    // Dequantize into a bf16 region of fresh garbage (the same on both sides), from the host's
    // fp4 bytes on both sides (so a quantize mismatch does not show up here again).
    f.upload();
    Mirror back(static_cast<size_t>(hs.region_bytes()), seed++);
    MlaFp4Params hd = params(back.h.data(), f.h.data(), false);
    MlaFp4Params dd = params(back.d, f.d, true);
    ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(hd).ok());
    CUDA_OK(kernels::launch_dequantize_mla_fp4(dd, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(back.first_diff(), -1) << "dequantize";
  }
}

// Random fp4 bytes (every code, every scale byte, 0xFF included) decode alike.
TEST_F(Fp4Gpu, DequantizeOfRandomBytes) {
  for (Layout lay : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    const auto hs = test::mk_spec(3, 64, 64, EntryFormat::mla_bf16(), lay);
    const auto fs = test::mk_spec(3, 64, 64, EntryFormat::mla_fp4(), lay);
    Mirror f(static_cast<size_t>(fs.region_bytes()), 7), back(static_cast<size_t>(hs.region_bytes()), 8);
    auto hp = kernels::make_mla_fp4_params(back.h.data(), hs, f.h.data(), fs);
    auto dp = kernels::make_mla_fp4_params(back.d, hs, f.d, fs);
    ASSERT_TRUE(hp.ok() && dp.ok());
    hp->count = dp->count = 64;
    ASSERT_TRUE(kernels::dequantize_mla_fp4_cpu(*hp).ok());
    CUDA_OK(kernels::launch_dequantize_mla_fp4(*dp, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(back.first_diff(), -1);
  }
}

// SGLang's layout: per layer a value tensor (m, 288) and a scale tensor (m, 36), token slots of
// page size 1, viewed as (m, 1, 288) and (m, 1, 36) in two allocations.
TEST_F(Fp4Gpu, SeparateValueAndScaleTensors) {
  const int64_t m = 1000;
  const auto hs = test::mk_spec(1, m, 1, EntryFormat::mla_bf16());
  Mirror h(static_cast<size_t>(hs.region_bytes()), 11), v(static_cast<size_t>(m * 288), 12),
      s(static_cast<size_t>(m * 36), 13);
  fill_extreme_bf16(h.h.data(), hs, 14);
  h.upload();
  auto view = [m](int64_t row) {
    TensorView t;
    t.dtype = DType::kU8;
    t.rank = 3;
    t.sizes[0] = m;
    t.sizes[1] = 1;
    t.sizes[2] = row;
    t.strides[0] = row;
    t.strides[1] = row;
    t.strides[2] = 1;
    return t;
  };
  auto params = [&](bool dev) {
    MlaFp4Params p;
    p.bf16 = {dev ? h.d : h.h.data(), h.bytes(), hs.layer_view(0)};
    p.values = {dev ? v.d : v.h.data(), v.bytes(), view(288)};
    p.scales = {dev ? s.d : s.h.data(), s.bytes(), view(36)};
    p.count = m;
    return p;
  };
  ASSERT_TRUE(kernels::validate_mla_fp4(params(true)).ok());
  ASSERT_TRUE(kernels::quantize_mla_fp4_cpu(params(false)).ok());
  CUDA_OK(kernels::launch_quantize_mla_fp4(params(true), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(v.first_diff(), -1);
  EXPECT_EQ(s.first_diff(), -1);
}

}  // namespace
}  // namespace kvferry
