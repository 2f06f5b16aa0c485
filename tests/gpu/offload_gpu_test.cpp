// Offload and reload through kvferryd with the CUDA backend: the region lives in GPU memory,
// saves and loads go through the pinned host pool; bytes are checked after a round trip into
// other block ids, and after a load into a region of another MLA format. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "../integration/daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/cuda_vmm.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/device.h"
#include "kvferry/layouts/geometry.h"

namespace kvferry {
namespace {

std::vector<uint8_t> seeded(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(OffloadGpu, RoundTripThroughThePinnedPool) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  testing::DaemonProcess d("tiers:\n  host:\n    capacity: 256MiB\n", {}, "cuda", {"--metrics-listen", ""});
  ASSERT_TRUE(d.ready()) << d.log();
  Client::Options o;
  o.socket = d.socket();
  o.model = "gpu";
  auto c = Client::connect(o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const KvCacheSpec spec{4, 64, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  auto rid = (*c)->create_region("gpu-rt", spec);
  ASSERT_TRUE(rid.ok()) << rid.status().to_string() << d.log();
  auto base = (*c)->map_region(*rid);
  ASSERT_TRUE(base.ok());
  auto lv = (*c)->layer_view(*rid, 0);
  ASSERT_TRUE(lv.ok() && lv->on_device) << "the CUDA backend gives GPU regions";
  const size_t bytes = static_cast<size_t>(spec.region_bytes());
  // bf16 bit patterns that are finite (exponent never all ones) so conversions stay meaningful.
  auto host = seeded(bytes, 11);
  for (size_t i = 1; i < bytes; i += 2) host[i] &= 0x3f;
  ASSERT_TRUE(cuda_vmm::copy_to_device(*base, host.data(), bytes, 0).ok());
  const int64_t n = 32;
  std::vector<ops::Key> keys;
  std::vector<int64_t> src(n), dst(n);
  for (int64_t i = 0; i < n; ++i) {
    keys.push_back({7, static_cast<uint64_t>(i)});
    src[i] = i;
    dst[i] = 63 - i;
  }
  auto sv = (*c)->save(*rid, keys, src);
  ASSERT_TRUE(sv.ok());
  ASSERT_EQ(sv->done, n) << d.log();
  std::vector<uint8_t> wipe(bytes, 0x3c);
  ASSERT_TRUE(cuda_vmm::copy_to_device(*base, wipe.data(), bytes, 0).ok());
  auto ld = (*c)->load(*rid, keys, dst);
  ASSERT_TRUE(ld.ok());
  ASSERT_EQ(ld->done, n) << d.log();
  std::vector<uint8_t> back(bytes);
  ASSERT_TRUE(cuda_vmm::copy_to_host(back.data(), *base, bytes, 0).ok());
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(std::memcmp(back.data() + spec.page_offset(0, dst[i]), host.data() + spec.page_offset(0, src[i]),
                          static_cast<size_t>(spec.block_bytes())),
              0)
        << "block " << i;
  // Into a GPU region of mla_fp8_ds: the daemon quantizes on the way; equal to the CPU conversion.
  const KvCacheSpec spec2{4, 64, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  auto rid2 = (*c)->create_region("gpu-ds", spec2);
  ASSERT_TRUE(rid2.ok());
  auto base2 = (*c)->map_region(*rid2);
  ASSERT_TRUE(base2.ok());
  auto cv = (*c)->load(*rid2, keys, src);
  ASSERT_TRUE(cv.ok());
  ASSERT_EQ(cv->done, n) << d.log();
  std::vector<uint8_t> got(static_cast<size_t>(spec2.region_bytes())), want(got.size(), 0);
  ASSERT_TRUE(cuda_vmm::copy_to_host(got.data(), *base2, got.size(), 0).ok());
  ASSERT_TRUE(kernels::convert_blocks_cpu(host.data(), spec, src, want.data(), spec2, src).ok());
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(std::memcmp(got.data() + spec2.page_offset(0, i), want.data() + spec2.page_offset(0, i),
                          static_cast<size_t>(spec2.block_bytes())),
              0)
        << "converted block " << i;
  auto st = (*c)->stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->pool_pinned, 1u) << "the pool is page-locked with a CUDA device";
}

// Layer-major blocks of 576 KiB, 512 of them in two ops of 144 MiB: several sub-batches per op
// (with 32 MiB sub-batches, five: more than the copiers of one stream), both ops in flight (both
// workers, each on its own stream), and a damaged block in the middle of a load that must never
// reach the GPU.
TEST(OffloadGpu, PipelinedBatchesInFlightStopADamagedBlock) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  testing::DaemonProcess d("tiers:\n  host:\n    capacity: 1GiB\n", {}, "cuda",
                           {"--metrics-listen", "", "--enable-test-faults"});
  ASSERT_TRUE(d.ready()) << d.log();
  Client::Options o;
  o.socket = d.socket();
  o.model = "gpu-pipe";
  auto c = Client::connect(o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const KvCacheSpec spec{8, 1024, 64, EntryFormat::mla_bf16(), Layout::kLayerMajor};
  auto rid = (*c)->create_region("gpu-pipe", spec);
  ASSERT_TRUE(rid.ok()) << rid.status().to_string() << d.log();
  auto base = (*c)->map_region(*rid);
  ASSERT_TRUE(base.ok());
  const size_t bytes = static_cast<size_t>(spec.region_bytes());
  std::vector<uint8_t> host(bytes);
  uint64_t x = 0x2545f4914f6cdd1dull;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(host.data() + i, &x, 8);
  }
  ASSERT_TRUE(cuda_vmm::copy_to_device(*base, host.data(), bytes, 0).ok());
  const int64_t n = 512, per_op = 256;
  std::vector<ops::Key> keys;
  std::vector<int64_t> src(n), dst(n);
  for (int64_t i = 0; i < n; ++i) {
    keys.push_back({9, static_cast<uint64_t>(i)});
    src[i] = i;
    dst[i] = n + i;
  }
  auto run = [&](bool load) {
    std::vector<uint64_t> ids;
    for (int64_t b = 0; b < n; b += per_op) {
      std::span<const ops::Key> k(keys.data() + b, per_op);
      std::span<const int64_t> blk((load ? dst : src).data() + b, per_op);
      auto id = load ? (*c)->submit_load(*rid, k, blk) : (*c)->submit_save(*rid, k, blk);
      EXPECT_TRUE(id.ok()) << id.status().to_string();
      if (id.ok()) ids.push_back(*id);
    }
    std::vector<ErrorCode> codes;
    for (uint64_t id : ids) {
      auto r = (*c)->wait_op(id, 60'000'000);
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      if (r.ok()) codes.insert(codes.end(), r->blocks.begin(), r->blocks.end());
    }
    return codes;
  };
  auto saved = run(false);
  ASSERT_EQ(saved.size(), static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(saved[i], ErrorCode::kOk) << "save of block " << i << "\n" << d.log();
  const int64_t damaged = 380;  // in the middle of the second op
  auto cr = (*c)->corrupt_for_test(*rid, keys[damaged], 4321);
  ASSERT_TRUE(cr.ok() && cr->status == ErrorCode::kOk);
  // Wipe the destination blocks (in each layer, blocks n..2n-1 are contiguous).
  std::vector<uint8_t> wipe(static_cast<size_t>(n * spec.page_bytes()), 0x3c);
  for (int64_t l = 0; l < spec.layers; ++l)
    ASSERT_TRUE(
        cuda_vmm::copy_to_device(static_cast<uint8_t*>(*base) + spec.page_offset(l, n), wipe.data(), wipe.size(), 0)
            .ok());
  auto loaded = run(true);
  ASSERT_EQ(loaded.size(), static_cast<size_t>(n));
  std::vector<uint8_t> back(bytes);
  ASSERT_TRUE(cuda_vmm::copy_to_host(back.data(), *base, bytes, 0).ok());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t l = 0; l < spec.layers; ++l) {
      const uint8_t* got = back.data() + spec.page_offset(l, dst[i]);
      if (i == damaged) {
        EXPECT_EQ(loaded[i], ErrorCode::kChecksumMismatch);
        EXPECT_TRUE(std::all_of(got, got + spec.page_bytes(), [](uint8_t b) { return b == 0x3c; }))
            << "damaged bytes reached the GPU (layer " << l << ")";
      } else {
        ASSERT_EQ(loaded[i], ErrorCode::kOk) << "load of block " << i;
        EXPECT_EQ(std::memcmp(got, host.data() + spec.page_offset(l, src[i]), static_cast<size_t>(spec.page_bytes())),
                  0)
            << "block " << i << " layer " << l;
      }
    }
  }
}

// limits.request_timeout on the CUDA path: a save that outlives it stores nothing, a later one
// with time to spare succeeds.
TEST(OffloadGpu, RequestTimeoutLeavesNothingVisible) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  testing::DaemonProcess d("tiers:\n  host:\n    capacity: 64MiB\nlimits:\n  request_timeout: 150ms\n", {}, "cuda",
                           {"--metrics-listen", "", "--test-copy-delay-ms", "400"});
  ASSERT_TRUE(d.ready()) << d.log();
  Client::Options o;
  o.socket = d.socket();
  o.model = "gpu-timeout";
  auto c = Client::connect(o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const KvCacheSpec spec{2, 16, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  auto rid = (*c)->create_region("gpu-to", spec);
  ASSERT_TRUE(rid.ok()) << rid.status().to_string();
  const std::vector<ops::Key> keys = {{3, 1}, {3, 2}, {3, 3}};
  const std::vector<int64_t> ids = {0, 1, 2};
  auto sv = (*c)->save(*rid, keys, ids);
  ASSERT_TRUE(sv.ok()) << sv.status().to_string();
  EXPECT_EQ(sv->status, ErrorCode::kTimeout);
  EXPECT_EQ(sv->done, 0u);
  for (auto code : sv->blocks) EXPECT_EQ(code, ErrorCode::kTimeout);
  auto lk = (*c)->lookup(*rid, keys);
  ASSERT_TRUE(lk.ok());
  EXPECT_EQ(lk->done, 0u) << "nothing of a timed-out save is visible";
  auto st = (*c)->stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->entries, 0u);
  EXPECT_EQ(st->writing, 0u);
}

// Loads across geometries into GPU regions (issue 40): 64-token pages into 16-token layer-major
// ones through the copy engines, a TP rank's HND head slice out of full NHD blocks, and 64-token
// mla_bf16 blocks into 16-token mla_fp8_ds pages (converted on the host); every byte checked
// against the same map computed on the host.
TEST(OffloadGpu, MappedLoadsAcrossGeometries) {
  if (testing::run_in_child([] { return cuda_device_count() > 0 ? 0 : 1; }) != 0) GTEST_SKIP() << "no CUDA device";
  testing::DaemonProcess d("tiers:\n  host:\n    capacity: 256MiB\n", {}, "cuda", {"--metrics-listen", ""});
  ASSERT_TRUE(d.ready()) << d.log();
  Client::Options o;
  o.socket = d.socket();
  o.model = "gpu-geo";
  auto c = Client::connect(o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  struct Case {
    KvCacheSpec saved, loaded;
  };
  const auto mha = [](int32_t heads, MhaOrder order, int32_t first) {
    return EntryFormat::mha_slice(heads, 64, DType::kBF16, order, first, 8);
  };
  const std::vector<Case> cases = {
      {{4, 8, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor},
       {4, 32, 16, EntryFormat::mla_fp8(), Layout::kLayerMajor}},
      {{3, 8, 16, mha(8, MhaOrder::kNHD, 0), Layout::kBlockMajor},
       {3, 8, 16, mha(4, MhaOrder::kHND, 4), Layout::kLayerMajor}},
      {{4, 8, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor},
       {4, 32, 16, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor}},
  };
  int k = 0;
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.saved.format.name() + " -> " + cs.loaded.format.name());
    ++k;
    auto a = (*c)->create_region("geo-a" + std::to_string(k), cs.saved);
    auto b = (*c)->create_region("geo-b" + std::to_string(k), cs.loaded);
    ASSERT_TRUE(a.ok() && b.ok()) << d.log();
    auto abase = (*c)->map_region(*a);
    auto bbase = (*c)->map_region(*b);
    ASSERT_TRUE(abase.ok() && bbase.ok());
    auto host = seeded(static_cast<size_t>(cs.saved.region_bytes()), 20 + k);
    if (cs.saved.format.kind == FormatKind::kMlaFp8)
      for (auto& v : host) v = static_cast<uint8_t>(v % 0x7E);  // finite e4m3
    if (cs.saved.format.kind == FormatKind::kMlaBf16)
      for (size_t i = 1; i < host.size(); i += 2) host[i] &= 0x3f;  // finite bf16
    ASSERT_TRUE(cuda_vmm::copy_to_device(*abase, host.data(), host.size(), 0).ok());
    std::vector<ops::Key> keys;
    for (int64_t i = 0; i < 8; ++i) keys.push_back({0x6E0, static_cast<uint64_t>(k * 100 + i)});
    std::vector<int64_t> ids(8);
    std::iota(ids.begin(), ids.end(), int64_t{0});
    auto sv = (*c)->save(*a, keys, ids);
    ASSERT_TRUE(sv.ok() && sv->done == 8) << d.log();
    std::vector<ops::Key> mk;
    std::vector<int64_t> mb;
    std::vector<int32_t> mp;
    std::vector<int64_t> all(static_cast<size_t>(cs.loaded.blocks));
    std::iota(all.begin(), all.end(), int64_t{0});
    ASSERT_TRUE(Client::page_map(keys, cs.saved.block_size, all, cs.loaded.block_size, &mk, &mb, &mp).ok());
    auto ld = (*c)->load_mapped(*b, mk, mb, mp);
    ASSERT_TRUE(ld.ok());
    ASSERT_EQ(ld->done, mk.size()) << d.log();
    // The same map on the host: convert whole blocks where the formats differ, then map.
    std::vector<uint8_t> conv = host;
    KvCacheSpec cspec = cs.saved;
    if (!same_entries(cs.saved.format, cs.loaded.format)) {
      cspec.format = cs.loaded.format;
      conv.assign(static_cast<size_t>(cspec.region_bytes()), 0);
      ASSERT_TRUE(kernels::convert_blocks_cpu(host.data(), cs.saved, ids, conv.data(), cspec, ids).ok());
    }
    std::vector<uint8_t> want(static_cast<size_t>(cs.loaded.region_bytes()), 0), got(want.size());
    ASSERT_TRUE(cuda_vmm::copy_to_host(got.data(), *bbase, got.size(), 0).ok());
    std::vector<CopyRun> runs;
    for (size_t e = 0; e < mk.size(); ++e) {
      auto span = token_span(cs.saved.block_size, cs.loaded.block_size, mp[e]);
      ASSERT_TRUE(span.ok());
      ASSERT_TRUE(push_token_runs(&runs, cspec, static_cast<int64_t>(e * 8 / mk.size()), span->src_token, cs.loaded,
                                  mb[e], span->dst_token, span->tokens)
                      .ok());
    }
    for (const CopyRun& r : runs) std::memcpy(want.data() + r.dst, conv.data() + r.src, static_cast<size_t>(r.bytes));
    if (cs.loaded.format.kind == FormatKind::kMha) {  // only the runs' bytes are the rank's; compare those
      for (const CopyRun& r : runs)
        ASSERT_EQ(0, std::memcmp(got.data() + r.dst, want.data() + r.dst, static_cast<size_t>(r.bytes)));
    } else {
      ASSERT_EQ(got, want);
    }
  }
}

}  // namespace
}  // namespace kvferry
