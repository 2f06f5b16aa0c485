// CUDA paged MHA/GQA decode: against the CPU twin within the bf16 bound, bit-identical across
// placements of the same K/V (layer views of block-major buffers, NHD and HND, V as a slice of
// a combined buffer, int64 page offsets), poisoned outputs fully written.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "kvferry/kernels/decode_paged.h"
#include "kvferry/kernels/device.h"
#include "unit/decode_paged_problem.h"

namespace kvferry::test {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

/// Owns one device allocation.
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : n(bytes) {
    if (bytes > 0 && cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (p != nullptr) cudaFree(p);
  }
  template <class T>
  bool upload(const std::vector<T>& v) {
    return cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
  }
};

bool have_gpu() { return cuda_device_count() > 0; }

/// Runs the CUDA decode on a placement; o and lse start poisoned (NaN bytes).
void run_gpu(const Problem& p, const Placed& pl, int splits, Output& out) {
  DecodePagedParams d = base_params(p, pl);
  DevBuf q(p.q.size()), k(pl.kbuf.size()), v(pl.vbuf.size()), bt(p.block_table.size() * 4), lens(p.lens.size() * 4),
      o(static_cast<size_t>(d.o_region_bytes)), lse(static_cast<size_t>(p.s.B * p.s.Hq) * 4);
  ASSERT_TRUE(q.upload(p.q) && k.upload(pl.kbuf) && (pl.shared || v.upload(pl.vbuf)) && bt.upload(p.block_table) &&
              lens.upload(p.lens));
  CUDA_OK(cudaMemset(o.p, 0xFF, o.n));
  CUDA_OK(cudaMemset(lse.p, 0xFF, lse.n));
  d.q_base = q.p;
  d.k_base = k.p;
  d.v_base = pl.shared ? k.p : v.p;
  d.o_base = o.p;
  d.lse = static_cast<float*>(lse.p);
  d.block_table = static_cast<const int32_t*>(bt.p);
  d.seq_lens = static_cast<const int32_t*>(lens.p);
  d.num_splits = splits == 0 ? decode_paged_choose_splits(d) : splits;
  DevBuf ws(static_cast<size_t>(decode_paged_workspace_bytes(d)));
  d.workspace = ws.p;
  d.workspace_bytes = static_cast<int64_t>(ws.n);
  ASSERT_TRUE(validate_decode_paged(d).ok()) << validate_decode_paged(d).to_string();
  CUDA_OK(launch_decode_paged(d, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  out.o.resize(o.n);
  out.lse.resize(static_cast<size_t>(p.s.B * p.s.Hq));
  CUDA_OK(cudaMemcpy(out.o.data(), o.p, o.n, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(out.lse.data(), lse.p, lse.n, cudaMemcpyDeviceToHost));
}

ProblemShape shape(int B, int Hq, int Hkv, int Dk, int Dv, std::vector<int32_t> lens, DType ct = DType::kBF16,
                   DType qt = DType::kBF16) {
  ProblemShape s;
  s.B = B;
  s.Hq = Hq;
  s.Hkv = Hkv;
  s.Dk = Dk;
  s.Dv = Dv;
  s.lens = std::move(lens);
  s.ct = ct;
  s.qt = qt;
  return s;
}

ProblemShape with_page(ProblemShape s, int page) {
  s.P = page;
  return s;
}

struct Case {
  const char* name;
  ProblemShape s;
  int splits = 1;  ///< 0 = the launcher's choice; kDecodePagedBalanced
  float cap = 0;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class DecodePagedGpu : public ::testing::TestWithParam<Case> {};

constexpr int kBal = kDecodePagedBalanced;

/// Lengths 1..~600 of a batch, a few of them whole pages.
std::vector<int32_t> batch_lens(int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i % 7 == 0 ? 16 * (i + 1) : 1 + (37 * i) % 600;
  return v;
}

TEST_P(DecodePagedGpu, MatchesCpuTwinAndFillsPoisonedOutputs) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  Problem p = make_problem(c.s);
  p.logit_cap = c.cap;
  Placed pl = place(p, KvLayout::kLayerNhd, 3, 1);
  Output gpu, cpu;
  ASSERT_NO_FATAL_FAILURE(run_gpu(p, pl, c.splits, gpu));
  ASSERT_TRUE(run_cpu(p, pl, c.splits == 0 ? 1 : c.splits, cpu).ok());  // balanced: unsplit
  std::vector<double> ro, rl;
  reference(p, ro, rl);
  // Both outputs are rounded to bf16 (fp16): within 2 ulps at |o| <= 1 of each other, and of
  // the float64 reference.
  const double tol = p.s.qt == DType::kBF16 ? 1.6e-2 : 4e-3;
  double max_cpu = 0, max_ref = 0;
  for (size_t i = 0; i < ro.size(); ++i) {
    const float g = gpu.o_at(p, i);
    ASSERT_TRUE(std::isfinite(g)) << "o[" << i << "] not written or not finite";
    max_cpu = std::max(max_cpu, double(std::abs(g - cpu.o_at(p, i))));
    max_ref = std::max(max_ref, std::abs(g - ro[i]));
  }
  EXPECT_LE(max_cpu, tol);
  EXPECT_LE(max_ref, tol);
  for (size_t i = 0; i < rl.size(); ++i) {
    if (std::isinf(rl[i])) {
      EXPECT_TRUE(std::isinf(gpu.lse[i]) && gpu.lse[i] < 0) << "lse[" << i << "] of an empty sequence";
      for (int d = 0; d < p.s.Dv; ++d) ASSERT_EQ(gpu.o_at(p, i * p.s.Dv + d), 0.0f);
    } else {
      EXPECT_NEAR(gpu.lse[i], rl[i], 1e-3 * std::max(1.0, std::abs(rl[i]))) << "lse[" << i << "]";
      EXPECT_NEAR(gpu.lse[i], cpu.lse[i], 1e-3 * std::max(1.0, std::abs(rl[i]))) << "lse[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodePagedGpu,
    ::testing::Values(
        Case{"page24_splits2", with_page(shape(2, 8, 2, 128, 128, {100, 47}), 24), 2},
        Case{"gqa_group2", shape(2, 4, 2, 64, 128, {40, 77}), 2},
        Case{"gqa_group3_padded", shape(2, 6, 2, 128, 128, {33, 70})},
        Case{"group12_chunks", shape(1, 12, 1, 64, 64, {50}), 2},
        Case{"len_0_1_37_64", shape(4, 8, 2, 128, 128, {0, 1, 37, 64})},
        Case{"splits3_len0", shape(3, 8, 2, 128, 128, {0, 100, 1000}), 3},
        Case{"auto_splits", shape(2, 32, 8, 128, 128, {2049, 333}), 0},
        Case{"mha_group1", shape(2, 4, 4, 64, 64, {21, 50}), 2}, Case{"gqa_group8", shape(2, 16, 2, 128, 128, {48, 5})},
        Case{"mqa_group16_headchunks", shape(2, 16, 1, 128, 128, {29, 300}), 2},
        Case{"dk192_dv128", shape(2, 8, 2, 192, 128, {45, 190}), 2},
        Case{"dk64_dv256", shape(2, 4, 2, 64, 256, {31, 16})}, Case{"dk256_dv192", shape(1, 4, 1, 256, 192, {140}), 3},
        Case{"fp16", shape(2, 8, 2, 128, 128, {37, 90}, DType::kFP16, DType::kFP16), 2},
        Case{"fp8_bf16q", shape(2, 8, 2, 128, 128, {37, 270}, DType::kFP8E4M3), 2},
        Case{"fp8_fp16q_dk192", shape(2, 8, 2, 192, 128, {50, 3}, DType::kFP8E4M3, DType::kFP16)},
        Case{"fp8_dk64", shape(1, 8, 1, 64, 64, {77}, DType::kFP8E4M3)},
        Case{"logit_cap", shape(2, 8, 2, 128, 128, {37, 64}), 2, 0.5f},
        // Balanced schedule: items cut between CTAs and CTAs holding several
        // items, empty requests among them, head chunks, every cache dtype.
        Case{"balanced_mixed_lens", shape(5, 8, 2, 128, 128, {0, 1, 700, 0, 2000}), kBal},
        Case{"balanced_group12_chunks", shape(3, 12, 1, 64, 64, {50, 0, 900}), kBal},
        Case{"balanced_fp8", shape(4, 8, 2, 128, 128, {37, 1500, 270, 0}, DType::kFP8E4M3), kBal},
        Case{"balanced_fp8_fp16q_dk64_dv256", shape(2, 4, 2, 64, 256, {300, 17}, DType::kFP8E4M3, DType::kFP16), kBal},
        Case{"balanced_dk192_dv128", shape(3, 8, 2, 192, 128, {45, 1900, 190}), kBal},
        Case{"balanced_page24_fp16",
             with_page(shape(3, 8, 2, 128, 128, {100, 47, 1000}, DType::kFP16, DType::kFP16), 24), kBal},
        Case{"balanced_all_empty", shape(2, 8, 2, 128, 128, {0, 0}), kBal},
        Case{"balanced_logit_cap", shape(2, 8, 2, 128, 128, {370, 64}), kBal, 0.5f},
        Case{"balanced_batch64", shape(64, 32, 8, 128, 128, batch_lens(64)), kBal}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

void expect_identical(const Output& a, const Output& b, const std::string& what) {
  EXPECT_EQ(a.o, b.o) << what << ": o differs";
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4), 0) << what << ": lse differs";
}

TEST(DecodePagedGpuLayouts, LayerViewsAreBitIdenticalToContiguous) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (DType ct : {DType::kBF16, DType::kFP8E4M3}) {
    Problem p = make_problem(shape(3, 8, 2, 128, 128, {300, 0, 77}, ct));
    for (int splits : {1, 3, kBal}) {
      Output ref;
      ASSERT_NO_FATAL_FAILURE(run_gpu(p, place(p, KvLayout::kContiguous), splits, ref));
      for (KvLayout l : {KvLayout::kLayerNhd, KvLayout::kLayerHnd})
        for (int layer : {0, 1, 2}) {
          Output o;
          ASSERT_NO_FATAL_FAILURE(run_gpu(p, place(p, l, 3, layer), splits, o));
          expect_identical(o, ref,
                           "layout " + std::to_string(int(l)) + " layer " + std::to_string(layer) + " splits " +
                               std::to_string(splits) + " " + std::string(dtype_name(ct)));
        }
    }
  }
}

TEST(DecodePagedGpuLayouts, VAsSliceOfCombinedBufferIsBitIdentical) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ProblemShape s = shape(2, 8, 2, 192, 128, {45, 130});
  s.v_is_k_prefix = true;
  Problem p = make_problem(s);
  for (int splits : {1, 2, kBal}) {
    Output ref, comb;
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, place(p, KvLayout::kContiguous), splits, ref));
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, place(p, KvLayout::kCombined), splits, comb));
    expect_identical(comb, ref, "combined K/V, splits " + std::to_string(splits));
  }
}

// Pages spread over more than 4 GiB: page * stride_page needs 64-bit arithmetic.
TEST(DecodePagedGpuLayouts, PageOffsetsPast32Bits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Problem p = make_problem(shape(2, 8, 2, 128, 128, {100, 61}));
  const Placed contig = place(p, KvLayout::kContiguous);
  Output ref;
  ASSERT_NO_FATAL_FAILURE(run_gpu(p, contig, 1, ref));

  const int64_t page_elems = int64_t{p.s.P} * p.s.Hkv * p.s.Dk;  // same for V (Dv == Dk)
  const int64_t blk_stride = (int64_t{1} << 28) / 2;             // 256 MiB of bf16 between pages
  const int64_t region = (p.NB - 1) * blk_stride * 2 + 2 * page_elems * 2;
  ASSERT_GT(region, int64_t{1} << 32);
  DevBuf big(static_cast<size_t>(region));
  if (big.p == nullptr) GTEST_SKIP() << "cannot allocate " << region << " bytes";
  CUDA_OK(cudaMemset(big.p, 0x35, big.n));
  const int64_t sz[4] = {p.NB, p.s.P, p.s.Hkv, p.s.Dk}, st[4] = {blk_stride, int64_t{p.s.Hkv} * p.s.Dk, p.s.Dk, 1};
  DecodePagedParams d = base_params(p, contig);
  d.k = make_view(DType::kBF16, 4, sz, st, 0);
  d.v = make_view(DType::kBF16, 4, sz, st, page_elems * 2);
  d.k_region_bytes = d.v_region_bytes = region;
  auto* base = static_cast<uint8_t*>(big.p);
  for (int64_t blk = 0; blk < p.NB; ++blk) {
    CUDA_OK(cudaMemcpy(base + d.k.offset_at(blk, 0, 0, 0), contig.kbuf.data() + blk * page_elems * 2, page_elems * 2,
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(base + d.v.offset_at(blk, 0, 0, 0), contig.vbuf.data() + blk * page_elems * 2, page_elems * 2,
                       cudaMemcpyHostToDevice));
  }
  DevBuf q(p.q.size()), bt(p.block_table.size() * 4), lens(p.lens.size() * 4), o(static_cast<size_t>(d.o_region_bytes)),
      lse(static_cast<size_t>(p.s.B * p.s.Hq) * 4);
  ASSERT_TRUE(q.upload(p.q) && bt.upload(p.block_table) && lens.upload(p.lens));
  CUDA_OK(cudaMemset(o.p, 0xFF, o.n));
  d.q_base = q.p;
  d.k_base = d.v_base = big.p;
  d.o_base = o.p;
  d.lse = static_cast<float*>(lse.p);
  d.block_table = static_cast<const int32_t*>(bt.p);
  d.seq_lens = static_cast<const int32_t*>(lens.p);
  d.num_splits = 1;
  ASSERT_TRUE(validate_decode_paged(d).ok()) << validate_decode_paged(d).to_string();
  CUDA_OK(launch_decode_paged(d, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  Output got;
  got.o.resize(o.n);
  got.lse.resize(ref.lse.size());
  CUDA_OK(cudaMemcpy(got.o.data(), o.p, o.n, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(got.lse.data(), lse.p, lse.n, cudaMemcpyDeviceToHost));
  expect_identical(got, ref, "pages 256 MiB apart");
}

}  // namespace
}  // namespace kvferry::test
