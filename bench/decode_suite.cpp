// kvferry-bench decode: MLA paged decode (launch_decode_mla), batch 64, 4096 tokens per request,
// page 64, heads 16 and 128 (KVFERRY_BENCH_HEADS: others), caches mla_bf16 / mla_fp8 /
// mla_fp8_ds, contiguous per-layer cache and layer 3 of a block-major buffer of 8 layers. Each
// time is compared with the KV-bytes floor: the request's cache bytes at the device-to-device copy
// rate measured in the same run (a copy reads and writes, so the rate counts both: 2 * bytes /
// time). A layer view's time is also compared with the contiguous cache's, the two sampled in turn.
// `decode --mha` hands over to the decode-mha suite.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench.h"
#include "kvferry/kernels/decode_mla.h"
#include "kvferry/kernels/device.h"
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/kv_cache_spec.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime.h>

#include <chrono>

#include "launch_gate.h"
#endif

namespace kvferry::bench {
namespace {

/// The suite's own arguments (listed by `kvferry-bench decode --help`): DecodeMlaParams fields for
/// comparison and tuning, applied to every row.
struct DecodeArgs {
  int32_t wgmma_kernel = 0;
  int32_t seesaw_loader = 0;
  int32_t conv_rows = DecodeMlaParams{}.conv_rows;
};

/// Parses opts.args into `a`; false (after a message) on an argument it does not know.
bool parse_decode_args(const Options& opts, DecodeArgs* a) {
  for (const std::string& s : opts.args) {
    if (s == "--wgmma-kernel=auto") {
      a->wgmma_kernel = 0;
    } else if (s == "--wgmma-kernel=seesaw") {
      a->wgmma_kernel = 1;
    } else if (s == "--wgmma-kernel=depth-split") {
      a->wgmma_kernel = 2;
    } else if (s == "--seesaw-loader=auto") {
      a->seesaw_loader = 0;
    } else if (s == "--seesaw-loader=tensor") {
      a->seesaw_loader = 1;
    } else if (s == "--seesaw-loader=cp.async") {
      a->seesaw_loader = 2;
    } else if (s.rfind("--conv-rows=", 0) == 0 && s.size() > 12 &&
               s.find_first_not_of("0123456789", 12) == std::string::npos && std::atoi(s.c_str() + 12) <= 32) {
      a->conv_rows = std::atoi(s.c_str() + 12);
    } else {
      std::fprintf(stderr, "decode bench: unknown argument %s (kvferry-bench decode --help lists them)\n", s.c_str());
      return false;
    }
  }
  return true;
}

#if defined(KVFERRY_WITH_CUDA)

constexpr int kBatch = 64;
// Tokens per request; KVFERRY_BENCH_TOKENS (diagnosis: a multiple of the page, 64-65536) sets
// another length, e.g. to separate a kernel's per-tile time from its fixed cost.
const int kTokens = [] {
  const char* v = std::getenv("KVFERRY_BENCH_TOKENS");
  const long t = v ? std::strtol(v, nullptr, 10) : 0;
  return t >= 64 && t <= 65536 && t % 64 == 0 ? static_cast<int>(t) : 4096;
}();
// Head counts; KVFERRY_BENCH_HEADS (diagnosis: a comma list of 16, 32, 64, 128) sets others, e.g. to
// see where the wgmma kernel overtakes mma.sync. Anything else in the list leaves the default.
const std::vector<int> kHeads = [] {
  std::vector<int> hs;
  const char* v = std::getenv("KVFERRY_BENCH_HEADS");
  for (const char* c = v; c != nullptr && *c != '\0';) {
    char* e = nullptr;
    const long h = std::strtol(c, &e, 10);
    if (e == c || (h != 16 && h != 32 && h != 64 && h != 128) || (*e != ',' && *e != '\0')) {
      hs.clear();
      break;
    }
    hs.push_back(static_cast<int>(h));
    c = *e == ',' ? e + 1 : e;
  }
  if (hs.empty()) hs = {16, 128};
  return hs;
}();
constexpr int kPage = 64;
constexpr int kLayers = 8;
constexpr int kLayer = 3;
constexpr double kH200CopyRate = 4270e9;  // DESIGN.md §8, bytes/s (read + write)

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

// bf16 in +-[2^-7, 2): sign, exponent 120..127, random mantissa.
uint16_t rand_bf16(uint64_t r) {
  return static_cast<uint16_t>(((r & 1) << 15) | ((120 + (r >> 1) % 8) << 7) | ((r >> 4) & 0x7f));
}
// e4m3 in +-[2^-4, 2): exponent 3..7.
uint8_t rand_e4m3(uint64_t r) {
  return static_cast<uint8_t>(((r & 1) << 7) | ((3 + (r >> 1) % 5) << 3) | ((r >> 4) & 7));
}

// One layer's pages (blocks x page entries), packed.
std::vector<uint8_t> make_layer(FormatKind kind, int64_t blocks, Rng& rng) {
  const EntryFormat f = kind == FormatKind::kMlaBf16  ? EntryFormat::mla_bf16()
                        : kind == FormatKind::kMlaFp8 ? EntryFormat::mla_fp8()
                                                      : EntryFormat::mla_fp8_ds();
  const int64_t eb = f.bytes_per_token();
  std::vector<uint8_t> v(static_cast<size_t>(blocks * kPage * eb));
  for (int64_t e = 0; e < blocks * kPage; ++e) {
    uint8_t* p = &v[e * eb];
    if (kind == FormatKind::kMlaBf16) {
      for (int d = 0; d < kMlaDim; ++d) {
        const uint16_t h = rand_bf16(rng.next());
        std::memcpy(p + 2 * d, &h, 2);
      }
    } else if (kind == FormatKind::kMlaFp8) {
      for (int d = 0; d < kMlaDim; ++d) p[d] = rand_e4m3(rng.next());
    } else {
      for (int d = 0; d < kMlaRank; ++d) p[d] = rand_e4m3(rng.next());
      for (int t = 0; t < kMlaTiles; ++t) {
        const float s = 0.25f + static_cast<float>(rng.next() % 1024) / 1024.0f;
        std::memcpy(p + kMlaDsScaleOffset + 4 * t, &s, 4);
      }
      for (int i = 0; i < kMlaRope; ++i) {
        const uint16_t h = rand_bf16(rng.next());
        std::memcpy(p + kMlaDsRopeOffset + 2 * i, &h, 2);
      }
    }
  }
  return v;
}

#define BENCH_CUDA(x)                                                                                          \
  do {                                                                                                         \
    const cudaError_t e_ = (x);                                                                                \
    if (e_ != cudaSuccess) {                                                                                   \
      std::fprintf(stderr, "decode: %s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                                                \
    }                                                                                                          \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int run_decode(const Options& opts) {
  if (opts.mha) return run_suite("decode-mha", opts);
  DecodeArgs args;
  if (!parse_decode_args(opts, &args)) return 2;
  Report report("decode");
  for (const std::string& a : opts.args) report.note("run with " + a);
  if (cuda_device_count() == 0) {
    report.note("no CUDA device: " + cuda_summary());
    return report.finish(opts);
  }
  BENCH_CUDA(cudaSetDevice(opts.device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, opts.device));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev0, ev1;
  BENCH_CUDA(cudaEventCreate(&ev0));
  BENCH_CUDA(cudaEventCreate(&ev1));
  const int warm = 3, reps = opts.quick ? 5 : 25;
  constexpr int kPairRounds = 8;  // a layer view and its contiguous cache: 8 x reps samples each
  // A sample times this many back-to-back calls (split kernel and merge each) and divides; the
  // default is one. Each sample's events and calls are queued behind a gate (launch_gate: a warp
  // sleeping kGateNs on the GPU), so the events time the calls and not the host's launch latency,
  // which a sample of one call between an idle stream's events includes (each row's note gives
  // that time, "with launch": on the H200 up to 2 us more, for the rows with a split merge).
  constexpr uint64_t kGateNs = 200'000;
  const int kLaunchesPerSample = [] {
    const char* e = std::getenv("KVFERRY_BENCH_LAUNCHES");
    const int n = e ? std::atoi(e) : 1;
    return n >= 1 && n <= 100 ? n : 1;
  }();

  // The limit: a 1 GiB device-to-device copy.
  double copy_rate = 0;
  {
    const size_t n = size_t{1} << 30;
    void *a = nullptr, *b = nullptr;
    BENCH_CUDA(cudaMalloc(&a, n));
    BENCH_CUDA(cudaMalloc(&b, n));
    BENCH_CUDA(cudaMemsetAsync(a, 1, n, stream));
    std::vector<double> ts;
    for (int i = 0; i < warm + 5; ++i) {
      BENCH_CUDA(cudaEventRecord(ev0, stream));
      BENCH_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, stream));
      BENCH_CUDA(cudaEventRecord(ev1, stream));
      BENCH_CUDA(cudaEventSynchronize(ev1));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, ev0, ev1));
      if (i >= warm) ts.push_back(ms * 1e-3);
    }
    copy_rate = 2.0 * static_cast<double>(n) / median(ts);
    BENCH_CUDA(cudaFree(a));
    BENCH_CUDA(cudaFree(b));
  }
  report.note(std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) +
              " SMs; D2D copy rate (read+write) " + std::to_string(copy_rate / 1e9) + " GB/s");
  report.note("each time is the median over samples of " + std::to_string(kLaunchesPerSample) +
              " back-to-back calls (split kernel and merge), divided by " + std::to_string(kLaunchesPerSample));

  const int64_t blocks = int64_t{kBatch} * kTokens / kPage;
  Rng rng{0x2545f4914f6cdd1dull};
  // Block table: every request gets kTokens / kPage blocks of a random permutation.
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int64_t i = 0; i < blocks; ++i) table[i] = static_cast<int32_t>(i);
  for (int64_t i = blocks - 1; i > 0; --i) std::swap(table[i], table[rng.next() % (i + 1)]);
  std::vector<int32_t> lens(kBatch, kTokens);
  int32_t *d_table = nullptr, *d_lens = nullptr;
  uint16_t *d_q = nullptr, *d_o = nullptr;
  float* d_lse = nullptr;
  void* d_work = nullptr;
  const int max_heads = 128;
  BENCH_CUDA(cudaMalloc(&d_table, table.size() * 4));
  BENCH_CUDA(cudaMalloc(&d_lens, lens.size() * 4));
  BENCH_CUDA(cudaMalloc(&d_q, size_t{kBatch} * max_heads * kMlaDim * 2));
  BENCH_CUDA(cudaMalloc(&d_o, size_t{kBatch} * max_heads * kMlaRank * 2));
  BENCH_CUDA(cudaMalloc(&d_lse, size_t{kBatch} * max_heads * 4));
  const size_t work_bytes = decode_mla_workspace_bytes(kBatch, max_heads, kDecodeMlaMaxSplits);
  BENCH_CUDA(cudaMalloc(&d_work, work_bytes));
  BENCH_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  {
    std::vector<uint16_t> q(size_t{kBatch} * max_heads * kMlaDim);
    for (auto& x : q) x = rand_bf16(rng.next());
    BENCH_CUDA(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  }

  const FormatKind kinds[] = {FormatKind::kMlaBf16, FormatKind::kMlaFp8, FormatKind::kMlaFp8Ds};
  // One contiguous cache and one 8-layer region, allocated once at the largest format's size and
  // reused by every format: memory allocated after large regions were freed measured up to 11 %
  // slower on an H200 (kernels/DESIGN.md §2.6), which would charge the later formats for placement.
  const KvCacheSpec flat_max{1, blocks, kPage, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  const KvCacheSpec multi_max{kLayers, blocks, kPage, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  void *d_flat = nullptr, *d_multi = nullptr;
  BENCH_CUDA(cudaMalloc(&d_flat, flat_max.region_bytes()));
  BENCH_CUDA(cudaMalloc(&d_multi, multi_max.region_bytes()));
  for (FormatKind kind : kinds) {
    const EntryFormat f = kind == FormatKind::kMlaBf16  ? EntryFormat::mla_bf16()
                          : kind == FormatKind::kMlaFp8 ? EntryFormat::mla_fp8()
                                                        : EntryFormat::mla_fp8_ds();
    const std::vector<uint8_t> layer = make_layer(kind, blocks, rng);
    const KvCacheSpec flat{1, blocks, kPage, f, Layout::kBlockMajor};
    const KvCacheSpec multi{kLayers, blocks, kPage, f, Layout::kBlockMajor};
    BENCH_CUDA(cudaMemcpy(d_flat, layer.data(), layer.size(), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemset(d_multi, 0xff, multi.region_bytes()));
    BENCH_CUDA(cudaMemcpy2D(static_cast<uint8_t*>(d_multi) + multi.page_offset(kLayer, 0), multi.block_stride_bytes(),
                            layer.data(), flat.page_bytes(), flat.page_bytes(), blocks, cudaMemcpyHostToDevice));
    const double kv_bytes = static_cast<double>(kBatch) * kTokens * f.bytes_per_token();
    const double floor_us = kv_bytes / copy_rate * 1e6;
    for (int heads : kHeads) {
      // DESIGN.md §8 targets (H200): bf16 100 / 135 us, fp8 caches 70 / 120 us at 16 / 128 heads
      // (32 and 64 heads, measured for diagnosis only, are held to the 128-head ones).
      const double target_us = kind == FormatKind::kMlaBf16 ? (heads == 16 ? 100 : 135) : (heads == 16 ? 70 : 120);
      const double flops = 2.0 * kBatch * heads * kTokens * (kMlaDim + kMlaRank);
      // mla_fp8 also with fp8_math = 1 (e4m3 products, its own error contract: decode_mla.h).
      const int runs = kind == FormatKind::kMlaFp8 ? 5 : 3;
      for (int run = 0; run < runs; ++run) {
        // run 0: contiguous, 1: layer view (both with the auto path: tensor-core kernel, loader and
        // warp layout), 2: contiguous with the tensor-core kernel that auto did not pick (for
        // comparison, with its own auto knobs); 3, 4: as 0, 1 with fp8_math = 1
        const int cross = run == 1 || run == 4;
        const bool f8 = run >= 3;
        DecodeMlaParams p;
        p.format = f;
        p.cache_base = cross ? d_multi : d_flat;
        p.region_bytes = cross ? multi.region_bytes() : flat.region_bytes();
        p.cache = cross ? multi.layer_view(kLayer) : flat.layer_view(0);
        p.q = d_q;
        p.block_table = d_table;
        p.block_table_stride = kTokens / kPage;
        p.seq_lens = d_lens;
        p.batch = kBatch;
        p.heads = heads;
        p.sm_scale = 1.0f / std::sqrt(192.0f);
        p.k_scale = kind == FormatKind::kMlaFp8 ? 0.5f : 1.0f;
        p.o = d_o;
        p.lse = d_lse;
        p.workspace = d_work;
        p.workspace_bytes = work_bytes;
        p.loader = 0;
        p.fp8_math = f8 ? 1 : 0;
        p.wgmma_kernel = args.wgmma_kernel;
        p.seesaw_loader = args.seesaw_loader;
        p.conv_rows = args.conv_rows;
        if (run == 2) p.mma = 3 - decode_mla_resolved_mma(p);
        const int mma = decode_mla_wgmma_available() ? decode_mla_resolved_mma(p) : 1;
        const int loader = decode_mla_resolved_loader(p);
        const int warps = decode_mla_resolved_group_warps(p);
        const Status v = validate_decode_mla(p);
        if (!v.ok()) {
          std::fprintf(stderr, "decode: %s\n", v.to_string().c_str());
          return 1;
        }
        const int splits = decode_mla_splits(p);
        // A layer view is compared with the same calls on the contiguous cache, sampled in turn
        // with it (one sample of each a round, the order alternating), so that a drift of the
        // GPU's clocks during the suite touches both alike. Sampled one after the other, the two
        // bf16 16-head rows once differed by 1.2 % on an H200 where other runs gave 0.2 %. In turn,
        // medians of 25 still moved by up to 1.4 % between runs (H200, mla_fp8 16 heads: 0.986 -
        // 1.006), so the pair takes kPairRounds times as many samples.
        DecodeMlaParams p_flat = p;
        p_flat.cache_base = d_flat;
        p_flat.region_bytes = flat.region_bytes();
        p_flat.cache = flat.layer_view(0);
        // gated: the sample's launches queued behind the gate (the row's figure); else from an
        // idle stream, the host's launch latency included (the note's "with launch").
        int late = 0;  // gated samples the host took longer to queue than the gate held the stream
        // Medians of the calls of ps[0 .. n) into us[0 .. n).
        auto sample = [&](bool gated, const DecodeMlaParams* const(&ps)[2], int n, double(&us)[2]) -> int {
          std::vector<double> ts[2];
          const int rounds = n > 1 ? kPairRounds * reps : reps;
          for (int i = 0; i < warm + rounds; ++i)
            for (int j = 0; j < n; ++j) {
              const int c = i & 1 ? n - 1 - j : j;
              if (gated) BENCH_CUDA(launch_gate(kGateNs, stream));
              const auto h0 = std::chrono::steady_clock::now();
              BENCH_CUDA(cudaEventRecord(ev0, stream));
              for (int k = 0; k < kLaunchesPerSample; ++k) BENCH_CUDA(launch_decode_mla(*ps[c], stream));
              BENCH_CUDA(cudaEventRecord(ev1, stream));
              if (gated && i >= warm &&
                  std::chrono::steady_clock::now() - h0 > std::chrono::nanoseconds(static_cast<int64_t>(kGateNs)))
                ++late;
              BENCH_CUDA(cudaEventSynchronize(ev1));
              float ms = 0;
              BENCH_CUDA(cudaEventElapsedTime(&ms, ev0, ev1));
              if (i >= warm) ts[c].push_back(ms * 1e3 / kLaunchesPerSample);
            }
          for (int c = 0; c < n; ++c) us[c] = median(ts[c]);
          return 0;
        };
        // cross: [0] the contiguous cache, [1] the layer view (the row's figure).
        double us2[2] = {0, 0}, launch2[2] = {0, 0};
        const DecodeMlaParams* const pair[2] = {&p_flat, &p};
        const DecodeMlaParams* const alone[2] = {&p, nullptr};
        if (sample(true, cross ? pair : alone, cross ? 2 : 1, us2) != 0 || sample(false, alone, 1, launch2) != 0)
          return 1;
        const double us = us2[cross ? 1 : 0], us_launch = launch2[0];
        if (late > 0)
          report.note(f.name() + " h" + std::to_string(heads) + ": " + std::to_string(late) + " of " +
                      std::to_string(cross ? 2 * kPairRounds * reps : reps) +
                      " samples took the host longer to queue than the gate's " + std::to_string(kGateNs / 1000) +
                      " us (their times include launch latency)");
        Row r;
        r.name = f.name() + " h" + std::to_string(heads) + (cross ? " layer 3 of 8" : " contiguous") +
                 (run == 2 ? (mma == 2 ? " wgmma" : " mma.sync") : "") + (f8 ? " fp8 math" : "");
        r.value = us;
        r.unit = "us";
        r.limit = floor_us;
        r.limit_name = "KV bytes at D2D rate";
        r.higher_is_better = false;
        r.target = kv_bytes / kH200CopyRate * 1e6 / target_us;
        // The kernel: wgmma, the fp8 mma.sync kernel (its own fixed layout), or bf16 mma.sync.
        const std::string kernel = mma == 2 ? (f8 && heads >= 64 ? "wgmma e4m3 products" : "wgmma")
                                   : kind != FormatKind::kMlaBf16
                                       ? "mma.sync fp8 in registers"
                                       : std::string("mma.sync ") + (loader == 1 ? "bulk " : "cp.async ") +
                                             std::to_string(warps) + " warps/16h";
        char note[224];
        std::snprintf(note, sizeof note,
                      "%.0f GB/s, %.0f TFLOP/s, splits %d, %s, H200 target %.0f us, with launch %.1f us",
                      kv_bytes / us * 1e-3, flops / us * 1e-6, splits, kernel.c_str(), target_us, us_launch);
        r.note = note;
        report.add(r);
        if (cross) {
          Row x;
          x.name = f.name() + " h" + std::to_string(heads) + " layer view vs contiguous" + (f8 ? " fp8 math" : "");
          x.value = us;
          x.unit = "us";
          x.limit = us2[0];
          x.limit_name = "contiguous, sampled in turn";
          x.higher_is_better = false;
          x.target = 0.99;
          report.add(x);
        }
      }
    }
  }
  BENCH_CUDA(cudaFree(d_flat));
  BENCH_CUDA(cudaFree(d_multi));
  BENCH_CUDA(cudaFree(d_table));
  BENCH_CUDA(cudaFree(d_lens));
  BENCH_CUDA(cudaFree(d_q));
  BENCH_CUDA(cudaFree(d_o));
  BENCH_CUDA(cudaFree(d_lse));
  BENCH_CUDA(cudaFree(d_work));
  BENCH_CUDA(cudaEventDestroy(ev0));
  BENCH_CUDA(cudaEventDestroy(ev1));
  BENCH_CUDA(cudaStreamDestroy(stream));
  return report.finish(opts);
}

#else

int run_decode(const Options& opts) {
  if (opts.mha) return run_suite("decode-mha", opts);
  DecodeArgs args;
  if (!parse_decode_args(opts, &args)) return 2;
  Report report("decode");
  report.note("built without CUDA: nothing to measure");
  return report.finish(opts);
}

#endif

}  // namespace

KVFERRY_BENCH_SUITE_WITH_OPTIONS(
    "decode", "MLA paged decode (bf16 / fp8 / fp8_ds caches, contiguous vs layer view); --mha: MHA", run_decode,
    "  --wgmma-kernel=auto|seesaw|depth-split  the wgmma path's split kernel (DecodeMlaParams::wgmma_kernel);\n"
    "                                          depth-split runs every cache format on it\n"
    "  --seesaw-loader=auto|tensor|cp.async    how the seesaw kernel's tiles arrive (seesaw_loader); cp.async\n"
    "                                          sends fp8 caches to the depth-split kernel\n"
    "  --conv-rows=N                           rows of each 32-token fp8 tile the depth-split kernel's\n"
    "                                          producer warps convert, 0..32 (conv_rows; default 12)\n"
    "  diagnosis environment variables (KVFERRY_BENCH_TOKENS, _HEADS, _LAUNCHES): bench/README.md\n");

}  // namespace kvferry::bench
