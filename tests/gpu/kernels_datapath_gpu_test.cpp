// Every data-path CUDA kernel against its CPU twin, bit for bit, on fresh random data: contiguous
// (L = 1) and cross-layer views (L = 3 middle layer, L = 61 last layer), and a view whose byte
// offsets pass 2^31 and 2^32 (a > 4.3 GB block-major region, the last blocks of layer 60).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <string>
#include <utility>
#include <vector>

#include "../unit/kernels_test_util.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"
#include "kvferry/kernels/gather.h"
#include "kvferry/kernels/write.h"

namespace kvferry {
namespace {

using namespace kernels;

constexpr uint32_t detail_one = 0x3f800000u;  // fp32 1.0

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

/// A region mirrored on host (lazily zeroed mmap) and device (zeroed); blocks [lo_block, NB) are
/// the active range: filled with the same random bytes on both sides and compared afterwards.
struct Mirror {
  KvCacheSpec spec;
  size_t n = 0;
  uint8_t* h = nullptr;
  uint8_t* d = nullptr;
  int64_t lo = 0;  // active byte range [lo, n)

  Mirror(const KvCacheSpec& s, int64_t lo_block, uint32_t seed, bool valid_entries) : spec(s) {
    n = static_cast<size_t>(s.region_bytes());
    h = static_cast<uint8_t*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (h == MAP_FAILED) h = nullptr;
    if (cudaMalloc(&d, n) != cudaSuccess) d = nullptr;
    if (!h || !d) return;
    (void)cudaMemset(d, 0, n);
    lo = s.layout == Layout::kBlockMajor ? s.page_offset(0, lo_block) : 0;
    test::fill_random(h + lo, n - static_cast<size_t>(lo), seed);
    if (valid_entries && s.format.kind != FormatKind::kMha) {
      std::mt19937 g(seed + 1);
      const int64_t e = s.format.bytes_per_token();
      for (int64_t l = 0; l < s.layers; ++l)
        for (int64_t b = lo_block; b < s.blocks; ++b)
          for (int64_t t = 0; t < s.block_size; ++t)
            test::random_entry(s.format.kind, h + s.page_offset(l, b) + t * e, g);
    }
    (void)cudaMemcpy(d + lo, h + lo, n - static_cast<size_t>(lo), cudaMemcpyHostToDevice);
    (void)cudaDeviceSynchronize();  // the test streams are non-blocking: let the fill land first
  }
  ~Mirror() {
    if (h) munmap(h, n);
    if (d) (void)cudaFree(d);
  }
  bool ok() const { return h && d; }
  CacheRef host(int64_t l) const { return {h, static_cast<int64_t>(n), spec.layer_view(l)}; }
  CacheRef dev(int64_t l) const { return {d, static_cast<int64_t>(n), spec.layer_view(l)}; }
  CacheRef host_plane(int64_t l, bool v) const { return {h, static_cast<int64_t>(n), spec.kv_view(l, v)}; }
  CacheRef dev_plane(int64_t l, bool v) const { return {d, static_cast<int64_t>(n), spec.kv_view(l, v)}; }
  /// Offset of the first byte of the first active entry of `layer` (for the report).
  int64_t active_offset(int64_t layer) const { return spec.page_offset(layer, (lo / spec.block_bytes())); }
  /// Byte index of the first difference in the active range, or -1.
  int64_t first_diff() const {
    std::vector<uint8_t> back(n - static_cast<size_t>(lo));
    if (cudaMemcpy(back.data(), d + lo, back.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return -2;
    for (size_t i = 0; i < back.size(); ++i)
      if (back[i] != h[lo + static_cast<int64_t>(i)]) return lo + static_cast<int64_t>(i);
    return -1;
  }
};

template <class T>
struct DevVec {
  T* p = nullptr;
  size_t n = 0;
  explicit DevVec(const std::vector<T>& v) : n(v.size()) {
    if (cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))) == cudaSuccess && n)
      (void)cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    (void)cudaDeviceSynchronize();
  }
  explicit DevVec(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))) == cudaSuccess) (void)cudaMemset(p, 0, n * sizeof(T));
    (void)cudaDeviceSynchronize();
  }
  ~DevVec() { (void)cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> v(n);
    if (n) (void)cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};

/// A view (layers, the layer under test, whether it passes 4 GB) and the engine the launches are
/// run with: the default, which picks one per kernel, or one forced, so every engine's kernels stay
/// bit-identical to the CPU twins whichever one a launcher picks.
struct Case {
  int64_t layers, layer;
  bool big;
  DatapathEngine engine = DatapathEngine::kAuto;
};

/// Every view with the default engine and with direct and staged forced. (kBulk forces nothing
/// the default does not pick: the bulk engine where a conversion's views allow it, each kernel's
/// default elsewhere.)
std::vector<Case> cases() {
  std::vector<Case> v;
  for (DatapathEngine e : {DatapathEngine::kAuto, DatapathEngine::kDirect, DatapathEngine::kStaged})
    for (Case c : {Case{1, 0, false}, Case{3, 1, false}, Case{61, 60, false}, Case{61, 60, true}}) {
      c.engine = e;
      v.push_back(c);
    }
  return v;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << "layers " << c.layers << ", layer " << c.layer << (c.big ? ", 4 GB" : "") << ", engine "
      << static_cast<int>(c.engine);
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const DatapathEngine e = i.param.engine;
  return "L" + std::to_string(i.param.layers) + "_layer" + std::to_string(i.param.layer) + (i.param.big ? "_4GB" : "") +
         (e == DatapathEngine::kDirect   ? "_direct"
          : e == DatapathEngine::kStaged ? "_staged"
                                         : "");
}

class KernelsGpu : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  /// Spec with enough blocks that the big case's region passes 4.5e9 bytes.
  KvCacheSpec spec(EntryFormat f) const {
    const Case c = GetParam();
    KvCacheSpec s = test::mk_spec(c.layers, 8, c.big ? 64 : 16, f);
    if (c.big) s.blocks = (int64_t{4'500'000'000} + s.block_bytes() - 1) / s.block_bytes();
    return s;
  }
  int64_t lo_block(const KvCacheSpec& s) const { return GetParam().big ? s.blocks - 6 : 0; }
  std::vector<int64_t> slots(const KvCacheSpec& s, int64_t count, uint32_t seed) const {
    const int64_t b0 = lo_block(s);
    auto v = test::random_slots((s.blocks - b0) * s.block_size, count, seed);
    for (auto& x : v)
      if (x >= 0) x += b0 * s.block_size;
    return v;
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  void expect_same(const Mirror& m, const char* what) {
    const int64_t at = m.first_diff();
    EXPECT_EQ(at, -1) << what << ": device and CPU differ at byte " << at << " (layer view offset "
                      << m.active_offset(GetParam().layer) << ")";
  }
  cudaStream_t stream_ = nullptr;
};

TEST_P(KernelsGpu, WriteMla) {
  const Case c = GetParam();
  // Input layouts: kv_c [tokens, 512] and k_pe [tokens, 64] packed; both column ranges of one
  // [tokens, 576] tensor; rows padded (strides 520 and 72 elements). The engines read each
  // differently (the bulk engine copies packed and fused rows a unit at a time, padded ones per row).
  enum { kPacked, kFused, kPadded };
  for (int layout : {kPacked, kFused, kPadded}) {
    for (MlaWriteMode mode : {MlaWriteMode::kCopy, MlaWriteMode::kFp8, MlaWriteMode::kFp8Ds}) {
      SCOPED_TRACE(::testing::Message() << "input layout " << layout << ", mode " << static_cast<int>(mode));
      const EntryFormat f = mode == MlaWriteMode::kCopy  ? EntryFormat::mla_bf16()
                            : mode == MlaWriteMode::kFp8 ? EntryFormat::mla_fp8()
                                                         : EntryFormat::mla_fp8_ds();
      const KvCacheSpec s = spec(f);
      Mirror m(s, lo_block(s), 100 + static_cast<uint32_t>(mode), false);
      ASSERT_TRUE(m.ok());
      const int64_t tokens = 3 * s.block_size + 5;
      const int64_t kv_stride = layout == kFused ? 576 : layout == kPadded ? 520 : 512;
      const int64_t pe_stride = layout == kFused ? 576 : layout == kPadded ? 72 : 64;
      const auto kv = test::random_bf16(static_cast<size_t>(tokens * kv_stride), 7, 3.0f);
      const auto pe = test::random_bf16(static_cast<size_t>(tokens * pe_stride), 8, 3.0f);
      const auto sl = slots(s, tokens, 9);
      DevVec<uint16_t> dkv(kv), dpe(pe);
      DevVec<int64_t> dsl(sl);
      WriteMlaParams p;
      p.tokens = tokens;
      p.mode = mode;
      p.scale = 0.037f;
      p.kv_c_stride = kv_stride;
      p.k_pe_stride = pe_stride;
      p.kv_c = kv.data();
      p.k_pe = layout == kFused ? kv.data() + 512 : pe.data();
      p.slots = sl.data();
      p.cache = m.host(c.layer);
      ASSERT_TRUE(write_mla_cpu(p).ok());
      p.kv_c = dkv.p;
      p.k_pe = layout == kFused ? dkv.p + 512 : dpe.p;
      p.slots = dsl.p;
      p.cache = m.dev(c.layer);
      ASSERT_TRUE(validate_write_mla(p).ok());
      p.engine = GetParam().engine;
      CUDA_OK(launch_write_mla(p, stream_));
      sync();
      expect_same(m, "write_mla");
    }
  }
}

TEST_P(KernelsGpu, WriteMha) {
  const Case c = GetParam();
  for (auto [dt, order] : {std::pair{DType::kBF16, MhaOrder::kNHD}, std::pair{DType::kFP8E4M3, MhaOrder::kHND},
                           std::pair{DType::kFP16, MhaOrder::kHND}}) {
    const int64_t h = 4, d = 64;
    const KvCacheSpec s = spec(EntryFormat::mha(h, d, dt, order));
    Mirror m(s, lo_block(s), 200, false);
    ASSERT_TRUE(m.ok());
    const int64_t tokens = 2 * s.block_size + 3;
    const auto k = test::random_bf16(static_cast<size_t>(tokens * h * d), 11);
    const auto v = test::random_bf16(static_cast<size_t>(tokens * h * d), 12);
    const auto sl = slots(s, tokens, 13);
    DevVec<uint16_t> dk(k), dv(v);
    DevVec<int64_t> dsl(sl);
    WriteMhaParams p;
    p.tokens = tokens;
    p.input_dtype = dt == DType::kFP16 ? DType::kFP16 : DType::kBF16;
    p.key_stride = p.value_stride = h * d;
    p.k_scale = 0.1f;
    p.v_scale = 3.0f;
    p.key = k.data();
    p.value = v.data();
    p.slots = sl.data();
    p.k_cache = m.host_plane(c.layer, false);
    p.v_cache = m.host_plane(c.layer, true);
    ASSERT_TRUE(write_mha_cpu(p).ok());
    p.key = dk.p;
    p.value = dv.p;
    p.slots = dsl.p;
    p.k_cache = m.dev_plane(c.layer, false);
    p.v_cache = m.dev_plane(c.layer, true);
    p.engine = GetParam().engine;
    CUDA_OK(launch_write_mha(p, stream_));
    sync();
    expect_same(m, "write_mha");
  }
}

TEST_P(KernelsGpu, IndexerWrite) {
  const Case c = GetParam();
  // k_stride 132: rows only 8-byte aligned (the kernel's 8-byte path; 128 takes the 16-byte one).
  for (const auto& [ue8m0, k_stride] : {std::pair{false, 128}, std::pair{true, 128}, std::pair{false, 132}}) {
    const KvCacheSpec s = spec(EntryFormat::indexer_fp8());
    Mirror m(s, lo_block(s), 300, false);
    ASSERT_TRUE(m.ok());
    const int64_t tokens = 2 * s.block_size + 7;
    auto k = test::random_bf16(static_cast<size_t>(tokens * k_stride), 21, 2.0f);
    for (int i = 0; i < 128; ++i) k[static_cast<size_t>(i)] = 0;  // amax below the 1e-4 floor
    // NaN (both signs, a payload) and an infinity in rows of their own: the fast paths hand them
    // to the exact ones (the ue8m0 path tests a row's raw bits for NaN once).
    const std::pair<int, uint16_t> specials[] = {{1, 0x7fc0}, {2, 0xffc0}, {3, 0x7f81}, {4, 0x7f80}, {5, 0xff80}};
    for (const auto& [row, bits] : specials) k[static_cast<size_t>(row * k_stride + 3 + 8 * row)] = bits;
    const auto sl = slots(s, tokens, 22);
    DevVec<uint16_t> dk(k);
    DevVec<int64_t> dsl(sl);
    IndexerWriteParams p;
    p.tokens = tokens;
    p.k_stride = k_stride;
    p.ue8m0 = ue8m0;
    p.k = k.data();
    p.slots = sl.data();
    p.cache = m.host(c.layer);
    ASSERT_TRUE(indexer_write_cpu(p).ok());
    p.k = dk.p;
    p.slots = dsl.p;
    p.cache = m.dev(c.layer);
    p.engine = GetParam().engine;
    CUDA_OK(launch_indexer_write(p, stream_));
    sync();
    expect_same(m, "indexer_write");
  }
}

TEST_P(KernelsGpu, Gathers) {
  const Case c = GetParam();
  struct M {
    GatherMode mode;
    EntryFormat f;
    int64_t row_bytes, dst_eb;
  };
  for (const M& g : {M{GatherMode::kCopy, EntryFormat::mla_bf16(), 1152, 2},
                     M{GatherMode::kCopy, EntryFormat::indexer_fp8(), 132, 1},
                     M{GatherMode::kDequantFp8, EntryFormat::mla_fp8(), 1152, 2},
                     M{GatherMode::kDequantDs, EntryFormat::mla_fp8_ds(), 1152, 2}}) {
    const KvCacheSpec s = spec(g.f);
    Mirror m(s, lo_block(s), 400, true);
    ASSERT_TRUE(m.ok());
    const int64_t b0 = lo_block(s), span = s.blocks - b0, bs = s.block_size;
    std::mt19937 rng(31);
    const int64_t batch = 3, cols = 4;
    std::vector<int32_t> bt(static_cast<size_t>(batch * cols));
    for (auto& x : bt) x = static_cast<int32_t>(b0 + static_cast<int64_t>(rng() % span));
    const std::vector<int32_t> starts{3, 0, static_cast<int32_t>(bs - 1)};
    const std::vector<int32_t> cu{0, static_cast<int32_t>(2 * bs + 1), static_cast<int32_t>(2 * bs + 1),
                                  static_cast<int32_t>(3 * bs + 3)};
    const int64_t rows = cu.back();
    DevVec<int32_t> dbt(bt), dstarts(starts), dcu(cu);
    test::Bytes out(static_cast<size_t>(rows * g.row_bytes));
    DevVec<uint8_t> dout(out.size());
    GatherParams p;
    p.mode = g.mode;
    p.scale = 1.7f;
    p.batch = batch;
    p.total_rows = rows;
    p.block_table_stride = cols;
    p.dst_stride = g.row_bytes / g.dst_eb;
    p.cache = m.host(c.layer);
    p.dst = out.data();
    p.block_table = bt.data();
    p.cu_seq_lens = cu.data();
    p.seq_starts = starts.data();
    ASSERT_TRUE(gather_cpu(p).ok());
    p.cache = m.dev(c.layer);
    p.dst = dout.p;
    p.block_table = dbt.p;
    p.cu_seq_lens = dcu.p;
    p.seq_starts = dstarts.p;
    p.engine = GetParam().engine;
    CUDA_OK(launch_gather(p, stream_));
    sync();
    const auto back = dout.get();
    EXPECT_EQ(std::memcmp(back.data(), out.data(), out.size()), 0) << "gather mode " << int(g.mode);
    bool nonzero = false;
    for (uint8_t b : back) nonzero |= b != 0;
    EXPECT_TRUE(nonzero);
  }
}

TEST_P(KernelsGpu, DequantPaged) {
  const Case c = GetParam();
  const KvCacheSpec s = spec(EntryFormat::mla_fp8_ds());
  Mirror m(s, lo_block(s), 500, true);
  ASSERT_TRUE(m.ok());
  const auto sl64 = slots(s, 2 * s.block_size, 41);
  const std::vector<int32_t> sl(sl64.begin(), sl64.end());
  DevVec<int32_t> dsl(sl);
  test::Bytes out(sl.size() * 1152);
  DevVec<uint8_t> dout(out.size());
  DequantPagedParams p;
  p.count = static_cast<int64_t>(sl.size());
  p.cache = m.host(c.layer);
  p.slots = sl.data();
  p.dst = out.data();
  ASSERT_TRUE(dequant_paged_cpu(p).ok());
  p.cache = m.dev(c.layer);
  p.slots = dsl.p;
  p.dst = dout.p;
  p.engine = GetParam().engine;
  CUDA_OK(launch_dequant_paged(p, stream_));
  sync();
  const auto back = dout.get();
  EXPECT_EQ(std::memcmp(back.data(), out.data(), out.size()), 0);
}

TEST_P(KernelsGpu, Conversions) {
  const Case c = GetParam();
  struct K {
    ConvertKind kind;
    EntryFormat s, d;
  };
  // Blocks of 16 and (small cases) 64 entries: the launcher picks its engine and unit by block size.
  for (const int64_t block_size : {int64_t{16}, int64_t{64}})
    for (const K& k : {K{ConvertKind::kFp8ToDs, EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds()},
                       K{ConvertKind::kDsToFp8, EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp8()},
                       K{ConvertKind::kBf16ToDs, EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds()},
                       K{ConvertKind::kDsToBf16, EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16()}}) {
      if (c.big && block_size != 64) continue;  // the big case has 64-entry blocks
      SCOPED_TRACE(::testing::Message() << "block size " << block_size << ", kind " << static_cast<int>(k.kind));
      KvCacheSpec ss = spec(k.s), ds = spec(k.d);
      ss.block_size = ds.block_size = block_size;
      ds.blocks = ss.blocks = std::max(ss.blocks, ds.blocks);
      // The contiguous case converts 2048 blocks: many units per CTA, so the bulk engine's rings
      // wrap (refills behind the empty barriers, both barrier parities) as they do in real use.
      if (c.layers == 1 && !c.big) ss.blocks = ds.blocks = 2048;
      Mirror src(ss, lo_block(ss), 600, true), dst(ds, lo_block(ds), 601, false);
      ASSERT_TRUE(src.ok() && dst.ok());
      if (k.kind == ConvertKind::kDsToFp8) {  // half the entries lossless: scales 1.0, rope e4m3 values
        for (int64_t b = lo_block(ss); b < ss.blocks; b += 2)
          for (int64_t l = 0; l < ss.layers; ++l)
            for (int64_t t = 0; t < ss.block_size; ++t) {
              uint8_t* e = src.h + ss.page_offset(l, b) + t * 656;
              for (int q = 0; q < 4; ++q) std::memcpy(e + 512 + 4 * q, &detail_one, 4);
              for (int i = 0; i < 64; ++i) {
                const uint16_t h = float_to_bf16(e4m3_to_float(static_cast<uint8_t>(e[i] & 0x7e)));
                std::memcpy(e + 528 + 2 * i, &h, 2);
              }
            }
        CUDA_OK(
            cudaMemcpy(src.d + src.lo, src.h + src.lo, src.n - static_cast<size_t>(src.lo), cudaMemcpyHostToDevice));
        CUDA_OK(cudaDeviceSynchronize());
      }
      const int64_t b0 = lo_block(ss), span = ss.blocks - b0;
      std::vector<int64_t> sb, db;
      for (int64_t i = 0; i < span; ++i) {
        sb.push_back(b0 + i);
        db.push_back(b0 + (i * 5 + 1) % span);
      }
      DevVec<int64_t> dsb(sb), ddb(db);
      std::vector<int32_t> flags(sb.size(), 0);
      DevVec<int32_t> dflags(flags.size());
      ConvertParams p;
      p.kind = k.kind;
      p.count = static_cast<int64_t>(sb.size());
      p.src = src.host(c.layer);
      p.dst = dst.host(c.layer);
      p.src_blocks = sb.data();
      p.dst_blocks = db.data();
      p.not_lossless = flags.data();
      ASSERT_TRUE(convert_cpu(p).ok());
      p.src = src.dev(c.layer);
      p.dst = dst.dev(c.layer);
      p.src_blocks = dsb.p;
      p.dst_blocks = ddb.p;
      p.not_lossless = dflags.p;
      ASSERT_TRUE(validate_convert(p).ok());
      p.engine = GetParam().engine;
      CUDA_OK(launch_convert(p, stream_));
      sync();
      expect_same(dst, "convert");
      EXPECT_EQ(dflags.get(), flags);
      if (k.kind == ConvertKind::kDsToFp8) {
        int bad = 0;
        for (int32_t f : flags) bad += f;
        EXPECT_GT(bad, 0);
        EXPECT_LT(bad, static_cast<int>(flags.size()));
      }
      // All layers in one launch (small cases only; the big one checks one layer).
      if (!c.big) {
        auto all = make_convert_params(src.d, ss, dst.d, ds);
        ASSERT_TRUE(all.ok());
        auto hall = make_convert_params(src.h, ss, dst.h, ds);
        all->count = hall->count = p.count;
        all->src_blocks = dsb.p;
        all->dst_blocks = ddb.p;
        hall->src_blocks = sb.data();
        hall->dst_blocks = db.data();
        ASSERT_TRUE(convert_cpu(*hall).ok());
        all->engine = GetParam().engine;
        CUDA_OK(launch_convert(*all, stream_));
        sync();
        expect_same(dst, "convert all layers");
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Views, KernelsGpu, ::testing::ValuesIn(cases()), case_name);

// copy_blocks: region (device) <-> pinned host pool with each engine, compared with memcpy.
TEST(KernelsGpuCopy, EnginesMatchMemcpy) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (Layout layout : {Layout::kBlockMajor, Layout::kLayerMajor}) {
    const auto region = test::mk_spec(5, 64, 16, EntryFormat::mla_fp8_ds(), layout);
    const auto pool = test::mk_spec(5, 20, 16, EntryFormat::mla_fp8_ds());
    std::vector<int64_t> rb, hb;
    for (int64_t i = 0; i < 20; ++i) {
      rb.push_back((i * 7 + 3) % 64);
      hb.push_back(i);
    }
    auto save = copy_plan(region, rb, pool, hb);
    auto load = copy_plan(pool, hb, region, rb);
    ASSERT_TRUE(save.ok() && load.ok());
    const size_t rn = static_cast<size_t>(region.region_bytes()), pn = static_cast<size_t>(pool.region_bytes());
    std::vector<uint8_t> host_region(rn);
    test::fill_random(host_region.data(), rn, 5);
    uint8_t *dreg = nullptr, *dreg2 = nullptr, *pinned = nullptr;
    CUDA_OK(cudaMalloc(&dreg, rn));
    CUDA_OK(cudaMalloc(&dreg2, rn));
    CUDA_OK(cudaMallocHost(&pinned, pn));
    CUDA_OK(cudaMemcpy(dreg, host_region.data(), rn, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> want_pool(pn, 0);
    ASSERT_TRUE(
        copy_blocks_cpu(host_region.data(), static_cast<int64_t>(rn), want_pool.data(), static_cast<int64_t>(pn), *save)
            .ok());
    auto copier = BlockCopier::create(4096, 4);
    ASSERT_TRUE(copier.ok()) << copier.status().to_string();
    for (CopyEngine e : {CopyEngine::kKernel, CopyEngine::kDma, CopyEngine::kAuto}) {
      std::memset(pinned, 0, pn);
      CUDA_OK(cudaMemset(dreg2, 0, rn));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE((*copier)->copy(dreg, pinned, *save, e, stream).ok());
      CUDA_OK(cudaStreamSynchronize(stream));
      EXPECT_EQ(std::memcmp(pinned, want_pool.data(), pn), 0) << "save, engine " << copy_engine_name(e);
      ASSERT_TRUE((*copier)->copy(pinned, dreg2, *load, e, stream).ok());
      ASSERT_TRUE((*copier)->copy(dreg2, dreg2, {}, e, stream).ok());
      CUDA_OK(cudaStreamSynchronize(stream));
      std::vector<uint8_t> back(rn);
      CUDA_OK(cudaMemcpy(back.data(), dreg2, rn, cudaMemcpyDeviceToHost));
      for (const CopyRun& r : *load)
        ASSERT_EQ(std::memcmp(back.data() + r.dst, host_region.data() + r.dst, static_cast<size_t>(r.bytes)), 0)
            << "load, engine " << copy_engine_name(e);
    }
    // An unaligned run takes the kernel's byte path.
    std::vector<CopyRun> odd{{3, 5, 1001}};
    ASSERT_TRUE((*copier)->copy(dreg, pinned, odd, CopyEngine::kKernel, stream).ok());
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(std::memcmp(pinned + 5, host_region.data() + 3, 1001), 0);
    EXPECT_EQ((*copier)->copy(dreg, pinned, odd, CopyEngine::kDma, nullptr).code(), ErrorCode::kInvalidArgument);
    (void)cudaFree(dreg);
    (void)cudaFree(dreg2);
    (void)cudaFreeHost(pinned);
  }
  (void)cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kvferry
