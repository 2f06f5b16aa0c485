// launch_decode_mla on a GPU (both tensor-core paths, mma.sync and wgmma): against the CPU twin (relative L2 error <=
// 1e-2), a per-layer view of block-major buffers of 3 and 61 layers bit-identical to a contiguous cache, an mla_fp8
// cache and the same cache requantized to mla_fp8_ds (scales 1.0) bit-identical, outputs poisoned before each run and
// checked fully written, and sharp scores (maxima jumping from tile to tile) against the CPU twin. Inputs are fresh
// random each run (the seed is printed).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvferry/kernels/decode_mla.h"
#include "kvferry/kernels/device.h"
#include "unit/decode_mla_case.h"

namespace kvferry {
namespace {

using test::MlaCase;

#define CUDA_OK(x) ASSERT_EQ(cudaSuccess, (x)) << #x
#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"
// The wgmma kernel needs sm_90a code and a compute capability 9.0 device. Elsewhere a test runs its
// mma.sync (and auto) parts and then reports itself skipped, naming what it could not run.
#define SKIP_IF_WGMMA_SKIPPED(skipped) \
  if (skipped)                         \
  GTEST_SKIP() << "wgmma kernel unavailable (needs sm_90a code and a compute 9.0 device): its runs were skipped"

uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | rd();
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t n) {
    if (cudaMalloc(&p, n ? n : 16) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

struct Out {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// Runs the GPU kernel on the case with `splits` (0 = auto), K-tile `loader` (0 auto, 1 bulk
// copies, 2 cp.async), `group_warps` (0 auto, 2, 4) and tensor-core path `mma` (0 auto, 1
// mma.sync, 2 wgmma); poisons o and lse first and fails the test when anything was left unwritten
// (a NaN remains).
void run_gpu(const MlaCase& c, int splits, Out* out, int loader = 0, int group_warps = 0, int mma = 1,
             int wgmma_kernel = 0) {
  const size_t no = static_cast<size_t>(c.batch()) * c.heads * kMlaRank, nl = static_cast<size_t>(c.batch()) * c.heads;
  DevBuf region(c.region.size()), q(c.q.size() * 2), table(c.table.size() * 4), lens(c.lens.size() * 4), o(no * 2),
      lse(nl * 4);
  ASSERT_TRUE(region.p && q.p && table.p && lens.p && o.p && lse.p);
  CUDA_OK(cudaMemcpy(region.p, c.region.data(), c.region.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(q.p, c.q.data(), c.q.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(table.p, c.table.data(), c.table.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(lens.p, c.lens.data(), c.lens.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(o.p, 0xff, no * 2));  // bf16 0xFFFF and fp32 0xFFFFFFFF are NaN
  CUDA_OK(cudaMemset(lse.p, 0xff, nl * 4));
  DecodeMlaParams p = c.params(static_cast<uint16_t*>(o.p), static_cast<float*>(lse.p));
  p.cache_base = region.p;
  p.q = static_cast<const uint16_t*>(q.p);
  p.block_table = static_cast<const int32_t*>(table.p);
  p.seq_lens = static_cast<const int32_t*>(lens.p);
  p.num_splits = splits;
  p.loader = loader;
  p.group_warps = group_warps;
  p.mma = mma;
  p.wgmma_kernel = wgmma_kernel;
  const Status v = validate_decode_mla(p);
  ASSERT_TRUE(v.ok()) << v.to_string();
  const size_t ws = decode_mla_workspace_bytes(p.batch, p.heads, decode_mla_splits(p));
  DevBuf work(ws);
  p.workspace = work.p;
  p.workspace_bytes = ws;
  CUDA_OK(launch_decode_mla(p, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  out->o.resize(no);
  out->lse.resize(nl);
  CUDA_OK(cudaMemcpy(out->o.data(), o.p, no * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(out->lse.data(), lse.p, nl * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < no; ++i) ASSERT_FALSE(std::isnan(bf16_to_float(out->o[i]))) << "o[" << i << "] not written";
  for (size_t i = 0; i < nl; ++i) ASSERT_FALSE(std::isnan(out->lse[i])) << "lse[" << i << "] not written";
}

void run_cpu(const MlaCase& c, Out* out) {
  out->o.assign(static_cast<size_t>(c.batch()) * c.heads * kMlaRank, 0xffff);
  out->lse.assign(static_cast<size_t>(c.batch()) * c.heads, std::numeric_limits<float>::quiet_NaN());
  const Status st = decode_mla_cpu(c.params(out->o.data(), out->lse.data()));
  ASSERT_TRUE(st.ok()) << st.to_string();
}

EntryFormat format_of(int f) {
  return f == 0 ? EntryFormat::mla_bf16() : f == 1 ? EntryFormat::mla_fp8() : EntryFormat::mla_fp8_ds();
}

void expect_bit_identical(const Out& a, const Out& b, const char* what) {
  ASSERT_EQ(a.o.size(), b.o.size());
  size_t diff = 0;
  for (size_t i = 0; i < a.o.size(); ++i) diff += a.o[i] != b.o[i];
  EXPECT_EQ(diff, 0u) << what << ": o differs in " << diff << " of " << a.o.size() << " values";
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4)) << what << ": lse differs";
}

// o within the relative L2 bound of the CPU twin's per request (0 for an empty one) and each lse
// within 2e-3 (relative past 1; -inf for an empty request), plus, when `rounded_ds` (a kernel that
// rounds mla_fp8_ds values), what that rounding can move it.
void expect_close_to_cpu(const MlaCase& c, const Out& got, const Out& ref, bool rounded_ds, double bound = 1e-2,
                         double lse_tol = 2e-3) {
  for (int b = 0; b < c.batch(); ++b) {
    for (int h = 0; h < c.heads; ++h) {
      const size_t bh = static_cast<size_t>(b) * c.heads + h;
      if (c.lens[b] == 0) {
        EXPECT_TRUE(std::isinf(got.lse[bh]) && got.lse[bh] < 0) << "lse of an empty request " << got.lse[bh];
      } else {
        EXPECT_NEAR(got.lse[bh], ref.lse[bh],
                    lse_tol * std::max(1.0f, std::abs(ref.lse[bh])) + (rounded_ds ? c.ds_round_bound(b, h) : 0.0))
            << "b " << b << " h " << h;
      }
    }
    const double err = request_rel_l2(c, b, got.o, [&](size_t i) { return double{bf16_to_float(ref.o[i])}; });
    if (c.lens[b] == 0) {
      EXPECT_EQ(err, 0.0) << "o of an empty request must be 0";
    } else {
      EXPECT_LE(err, bound) << "request " << b << " (length " << c.lens[b] << ")";
    }
  }
}

class DecodeMlaGpu : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(DecodeMlaGpu, MatchesCpuWithinBf16Bound) {
  SKIP_WITHOUT_GPU();
  const auto [fmt, heads, page] = GetParam();
  MlaCase c;
  c.format = format_of(fmt);
  c.k_scale = fmt == 1 ? 0.5f : 1.0f;
  c.heads = heads;
  c.page = page;
  c.lens = {0, 1, page + 5, 333, 1000};
  c.seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(c.seed));
  c.build();
  Out ref;
  run_cpu(c, &ref);
  bool wgmma_skipped = false;
  for (int run = 0; run < 23; ++run) {
    // mma.sync: every (splits, loader) pair with both warp layouts; then wgmma with each splits
    // choice, the auto path, and the depth-split wgmma kernel that wgmma_kernel = 2 selects
    // instead of the seesaw one.
    const int splits = run % 3 == 0   ? 1
                       : run % 3 == 1 ? 0
                                      : 7,
              loader = run < 18 ? run / 3 % 3 : 0,
              warps = run < 9    ? 2
                      : run < 18 ? 4
                                 : 0,
              mma = run < 18   ? 1
                    : run < 21 ? 2
                    : run < 22 ? 0
                               : 2;
    const bool depth_split = run == 22;
    if (mma == 2 && !decode_mla_wgmma_available()) {
      wgmma_skipped = true;
      continue;
    }
    // The fp8 kernel has no loader or warp-layout knobs: its three splits choices (runs 0..2) are
    // all there is to run on the mma.sync path.
    if (fmt != 0 && mma == 1 && run >= 3) continue;
    SCOPED_TRACE("splits " + std::to_string(splits) + " loader " + std::to_string(loader) + " group_warps " +
                 std::to_string(warps) + " mma " + std::to_string(mma) + (depth_split ? " depth-split" : ""));
    Out got;
    run_gpu(c, splits, &got, loader, warps, mma, depth_split ? 2 : 0);
    if (HasFatalFailure()) return;
    // The wgmma kernels round mla_fp8_ds values (to bf16, or fp16 with an fp16 scale, both within
    // 2^-9: decode_mla.h).
    DecodeMlaParams path = c.params(nullptr, nullptr);
    path.mma = mma;
    expect_close_to_cpu(c, got, ref, decode_mla_resolved_mma(path) == 2 && fmt == 2);
  }
  SKIP_IF_WGMMA_SKIPPED(wgmma_skipped);
}

INSTANTIATE_TEST_SUITE_P(FormatsHeadsPages, DecodeMlaGpu,
                         ::testing::Combine(::testing::Values(0, 1, 2), ::testing::Values(16, 32, 64, 128),
                                            ::testing::Values(16, 32, 64)));
// Pages the seesaw kernel's tensor copies do not take (not a power of two, or under 16 tokens):
// its cp.async producer, and every kernel's non-power-of-two page arithmetic.
INSTANTIATE_TEST_SUITE_P(OddPages, DecodeMlaGpu,
                         ::testing::Combine(::testing::Values(0), ::testing::Values(64, 128),
                                            ::testing::Values(8, 48)));

// Sharp scores (a large softmax scale): a row's maximum keeps jumping from tile to tile, by more
// than the 2^8 the seesaw kernel lets P grow before it rescales (lazy_max) and by less, so both
// its rescale and its keep-the-reference paths run against the CPU twin, with and without splits.
TEST(DecodeMlaGpuSoftmax, SharpScoresMatchCpu) {
  SKIP_WITHOUT_GPU();
  if (!decode_mla_wgmma_available())
    GTEST_SKIP() << "wgmma kernel unavailable (needs sm_90a code and a compute 9.0 device)";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int fmt : {0, 1, 2}) {
    for (int heads : {64, 128}) {
      MlaCase c;
      c.format = format_of(fmt);
      c.heads = heads;
      c.page = 64;
      c.sm_scale = 2.0f;  // log2-domain scores of standard deviation ~20
      c.lens = {1000, 2500, 64};
      c.seed = seed + fmt * 7 + heads;
      c.build();
      Out ref;
      run_cpu(c, &ref);
      for (int splits : {1, 0}) {
        SCOPED_TRACE(c.format.name() + " heads " + std::to_string(heads) + " splits " + std::to_string(splits));
        Out got;
        run_gpu(c, splits, &got, 0, 0, 2);
        if (HasFatalFailure()) return;
        expect_close_to_cpu(c, got, ref, fmt == 2);
      }
    }
  }
}

// The largest relative L2 distance of o between two outputs over the non-empty requests.
double max_rel_l2(const MlaCase& c, const Out& a, const Out& b) {
  double worst = 0;
  for (int r = 0; r < c.batch(); ++r)
    if (c.lens[r] != 0)
      worst = std::max(worst, request_rel_l2(c, r, a.o, [&](size_t i) { return double{bf16_to_float(b.o[i])}; }));
  return worst;
}

// fp8_math = 1 (decode_mla.h): the e4m3 kernel (64 and 128 heads) against the CPU twin that rounds
// Q and P as it does: o within 3e-2 (measured 0.7-1.5e-2: a logit that differs in its last bits,
// from the fp8 tensor cores' accumulation, can round a P to the neighbouring e4m3 value, 6-12 %
// away), lse within 2e-2; against the exact twin o within 6e-2 (sharp scores 0.25; measured 0.035
// and 0.09-0.13, the rounding of Q itself). At 16 heads the exact path runs (the 1e-2 bound).
// Normal and sharp scores, every splits choice; a per-layer view of 3- and 61-layer buffers
// bit-identical to the contiguous cache.
class DecodeMlaGpuFp8Math : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeMlaGpuFp8Math, MatchesCpuTwin) {
  SKIP_WITHOUT_GPU();
  if (!decode_mla_wgmma_available())
    GTEST_SKIP() << "wgmma kernel unavailable (needs sm_90a code and a compute 9.0 device)";
  const auto [heads, page] = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (float sm_scale : {0.15f, 2.0f}) {
    MlaCase c;
    c.format = EntryFormat::mla_fp8();
    c.k_scale = 0.5f;
    c.heads = heads;
    c.page = page;
    c.sm_scale = sm_scale;
    c.lens = {0, 1, page + 5, 333, 1000, 2500};
    c.fp8_math = 1;
    c.seed = seed + static_cast<uint64_t>(sm_scale);
    c.build();
    Out twin, exact;
    run_cpu(c, &twin);
    MlaCase e = c;
    e.fp8_math = 0;
    run_cpu(e, &exact);
    double worst_twin = 0, worst_exact = 0;
    for (int splits : {1, 0, 7}) {
      SCOPED_TRACE("sm_scale " + std::to_string(sm_scale) + " splits " + std::to_string(splits));
      Out got;
      run_gpu(c, splits, &got, 0, 0, 0);
      if (HasFatalFailure()) return;
      if (splits == 0) {  // the same inputs give the same bits (a race touching one tile would not)
        Out again;
        run_gpu(c, splits, &again, 0, 0, 0);
        if (HasFatalFailure()) return;
        expect_bit_identical(got, again, "a second run");
      }
      if (heads >= 64) {
        {
          SCOPED_TRACE("against the fp8 twin");
          expect_close_to_cpu(c, got, twin, false, 3e-2, 2e-2);
        }
        // The lse is not compared: Q's rounding moves a logit by its terms' size (cancellation),
        // which the twin above accounts for.
        SCOPED_TRACE("against the exact twin");
        expect_close_to_cpu(c, got, exact, false, sm_scale < 1 ? 6e-2 : 0.25, std::numeric_limits<double>::infinity());
      } else {
        expect_close_to_cpu(c, got, exact, false);
      }
      worst_twin = std::max(worst_twin, max_rel_l2(c, got, twin));
      worst_exact = std::max(worst_exact, max_rel_l2(c, got, exact));
    }
    std::printf("heads %d page %d sm_scale %.2f: o vs the fp8 twin %.2e, vs the exact twin %.2e (relative L2)\n", heads,
                page, sm_scale, worst_twin, worst_exact);
  }
  MlaCase flat;
  flat.format = EntryFormat::mla_fp8();
  flat.heads = heads;
  flat.page = page;
  flat.lens = {200, 77, 1, 0, 130};
  flat.fp8_math = 1;
  flat.seed = seed + 11;
  flat.build();
  Out a;
  run_gpu(flat, 0, &a, 0, 0, 0);
  if (HasFatalFailure()) return;
  for (int layers : {3, 61}) {
    MlaCase v = flat;
    v.layers = layers;
    v.layer = layers - 1;
    v.build();
    Out bv;
    run_gpu(v, 0, &bv, 0, 0, 0);
    if (HasFatalFailure()) return;
    expect_bit_identical(a, bv, ("layer view of " + std::to_string(layers)).c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(HeadsPages, DecodeMlaGpuFp8Math,
                         ::testing::Combine(::testing::Values(16, 64, 128), ::testing::Values(16, 32, 64)));

TEST(DecodeMlaGpuLayers, LayerViewBitIdenticalToContiguous) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  bool wgmma_skipped = false;
  for (int fmt : {0, 1, 2}) {
    for (int heads : {16, 128}) {
      for (int warps : {2, 4, 0}) {  // 0: the wgmma kernel (group_warps does not apply)
        const int mma = warps == 0 ? 2 : 1;
        // The loader and warp-layout knobs exist only in the bf16 mma.sync kernel.
        const bool knobs = fmt == 0 && mma == 1;
        if (warps == 4 && !knobs) continue;
        if (mma == 2 && !decode_mla_wgmma_available()) {
          wgmma_skipped = true;
          continue;
        }
        MlaCase flat;
        flat.format = format_of(fmt);
        flat.heads = heads;
        flat.page = 16;
        flat.lens = {200, 77, 1, 0, 130};
        flat.seed = seed + fmt;
        flat.build();
        Out a;
        run_gpu(flat, 0, &a, 1, warps, mma);
        if (knobs) {
          // The two loaders fill shared memory with the same bytes, so they agree bit for bit too.
          Out a1;
          run_gpu(flat, 0, &a1, 2, warps, mma);
          if (HasFatalFailure()) return;
          expect_bit_identical(a, a1, "bulk-copy vs cp.async loader");
        }
        if (HasFatalFailure()) return;
        for (int layers : {3, 61}) {
          for (int layer : {0, layers / 2, layers - 1}) {
            MlaCase v = flat;
            v.layers = layers;
            v.layer = layer;
            v.build();
            ASSERT_GT(v.spec.layer_view(v.layer).stride(0), v.page * v.format.entry_elems());  // not contiguous
            Out b;
            run_gpu(v, 0, &b, knobs && layers == 61 ? 2 : 1, warps, mma);
            if (HasFatalFailure()) return;
            const std::string what = flat.format.name() + " heads " + std::to_string(heads) + " layer " +
                                     std::to_string(layer) + " of " + std::to_string(layers) + " group_warps " +
                                     std::to_string(warps) + " mma " + std::to_string(mma);
            expect_bit_identical(a, b, what.c_str());
          }
        }
      }
    }
  }
  SKIP_IF_WGMMA_SKIPPED(wgmma_skipped);
}

// The mla_fp8 -> mla_fp8_ds requantization of kernels-spec §7.1: nope bytes kept, four fp32 1.0
// scales, rope e4m3 -> bf16 (exact). Applied to every entry of the region, garbage included.
MlaCase requantize_to_ds(const MlaCase& c) {
  MlaCase d = c;
  d.format = EntryFormat::mla_fp8_ds();
  d.spec.format = d.format;
  d.region.assign(static_cast<size_t>(d.spec.region_bytes()), 0);
  const int64_t entries = static_cast<int64_t>(c.region.size()) / kMlaFp8Bytes;
  const float one = 1.0f;
  for (int64_t i = 0; i < entries; ++i) {
    const uint8_t* s = &c.region[i * kMlaFp8Bytes];
    uint8_t* t = &d.region[i * kMlaDsBytes];
    std::memcpy(t, s, kMlaRank);
    for (int k = 0; k < kMlaTiles; ++k) std::memcpy(t + kMlaDsScaleOffset + 4 * k, &one, 4);
    for (int r = 0; r < kMlaRope; ++r) {
      const uint16_t h = float_to_bf16(e4m3_to_float(s[kMlaRank + r]));
      std::memcpy(t + kMlaDsRopeOffset + 2 * r, &h, 2);
    }
  }
  return d;
}

TEST(DecodeMlaGpuFormats, Fp8AndRequantizedDsBitIdentical) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const bool wgmma = decode_mla_wgmma_available();
  for (int heads : {16, 64, 128}) {
    for (int layers : {1, 3}) {
      MlaCase c;
      c.format = EntryFormat::mla_fp8();
      c.heads = heads;
      c.page = 64;
      c.lens = {500, 64, 1, 0, 129};
      c.layers = layers;
      c.layer = layers - 1;
      c.seed = seed + heads + layers;
      c.build();
      const MlaCase d = requantize_to_ds(c);
      for (int splits : {0, 1, 5}) {
        // mma.sync (the fp8 kernel, which has no loader knob), wgmma and the auto path.
        Out a, b, w, wd, au, aud;
        run_gpu(c, splits, &a, 1);
        run_gpu(d, splits, &b, 1);
        if (wgmma) {
          run_gpu(c, splits, &w, 0, 0, 2);
          run_gpu(d, splits, &wd, 0, 0, 2);
        }
        run_gpu(c, splits, &au, 0, 0, 0);
        run_gpu(d, splits, &aud, 0, 0, 0);
        if (HasFatalFailure()) return;
        const std::string what = "heads " + std::to_string(heads) + " splits " + std::to_string(splits);
        expect_bit_identical(a, b, what.c_str());
        if (wgmma) expect_bit_identical(w, wd, (what + " wgmma").c_str());
        expect_bit_identical(au, aud, (what + " auto path").c_str());
      }
    }
  }
  SKIP_IF_WGMMA_SKIPPED(!wgmma);
}

TEST(DecodeMlaGpuLaunch, RejectsAMissingWorkspace) {
  SKIP_WITHOUT_GPU();
  MlaCase c;
  c.lens = {100};
  c.build();
  DevBuf o(c.heads * kMlaRank * 2), lse(c.heads * 4);
  DecodeMlaParams p = c.params(static_cast<uint16_t*>(o.p), static_cast<float*>(lse.p));
  p.num_splits = 4;
  EXPECT_EQ(cudaErrorInvalidValue, launch_decode_mla(p, nullptr));
}

}  // namespace
}  // namespace kvferry
