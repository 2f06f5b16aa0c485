// kvferry-bench kernels: each data-path kernel's bytes moved (read + written, index arrays
// included) per second, as a ratio to a device-to-device copy (read + write counted) measured in
// the same run; on a contiguous per-layer cache and on a layer view of a block-major buffer.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"
#include "kvferry/kernels/gather.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/kv_cache_spec.h"

#if defined(KVFERRY_WITH_CUDA)
#include "shape_ceiling.h"
#endif

namespace kvferry::bench {
namespace {

using namespace kernels;

KvCacheSpec spec_of(EntryFormat f, int64_t layers, int64_t blocks, int64_t block_size = 64) {
  KvCacheSpec s;
  s.layers = layers;
  s.blocks = blocks;
  s.block_size = block_size;
  s.format = f;
  return s;
}

/// The suite's own arguments (listed by `kvferry-bench kernels --help`).
struct KernelsArgs {
  DatapathEngine engine = DatapathEngine::kAuto;
  ConvertUnitOrder unit_order = ConvertUnitOrder::kAuto;
};

/// Parses opts.args into `a`; false (after a message) on an argument it does not know.
bool parse_kernels_args(const Options& opts, KernelsArgs* a) {
  for (const std::string& s : opts.args) {
    if (s == "--engine=auto") {
      a->engine = DatapathEngine::kAuto;
    } else if (s == "--engine=direct") {
      a->engine = DatapathEngine::kDirect;
    } else if (s == "--engine=staged") {
      a->engine = DatapathEngine::kStaged;
    } else if (s == "--engine=bulk") {
      a->engine = DatapathEngine::kBulk;
    } else if (s == "--unit-order=auto") {
      a->unit_order = ConvertUnitOrder::kAuto;
    } else if (s == "--unit-order=stride") {
      a->unit_order = ConvertUnitOrder::kGridStride;
    } else if (s == "--unit-order=ranges") {
      a->unit_order = ConvertUnitOrder::kRanges;
    } else {
      std::fprintf(stderr, "kernels bench: unknown argument %s (kvferry-bench kernels --help lists them)\n", s.c_str());
      return false;
    }
  }
  return true;
}

#if defined(KVFERRY_WITH_CUDA)

/// Device memory for every row of a run, allocated once before the first row and handed out as a
/// stack (each `Dev` gives its bytes back when it goes out of scope, in reverse order of taking).
/// Regions allocated per row land wherever the allocator puts them after the earlier rows' 32 GB
/// regions were freed, and on an H200 such placements copy up to 11 % slower than the same bytes
/// allocated up front (kernels/DESIGN.md §2.6): the rows then measured the placement, and the order of
/// the passes, rather than the kernel. With one arena, every row and every pass reads and writes
/// memory taken the same way, as the daemon's own cache region is taken once at start.
struct Arena {
  uint8_t* base = nullptr;
  size_t size = 0, used = 0;
  size_t align = 256;  // where each buffer starts (KVFERRY_BENCH_ALIGN)
  int misses = 0;      // allocations it had no room for (cudaMalloc'd instead)
};
Arena g_arena;

/// A device allocation (from g_arena where it has room, else cudaMalloc), memset to a pattern
/// whose bytes are finite as e4m3, bf16 and fp32.
struct Dev {
  void* p = nullptr;
  size_t n = 0, mark = SIZE_MAX;  // mark: g_arena.used before this allocation, if taken from it
  explicit Dev(size_t bytes) : n(bytes) {
    const size_t want = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    const size_t at = (g_arena.used + g_arena.align - 1) / g_arena.align * g_arena.align;
    if (g_arena.base && at <= g_arena.size && g_arena.size - at >= want) {
      mark = g_arena.used;
      p = g_arena.base + at;
      g_arena.used = at + want;
    } else {
      if (g_arena.base) ++g_arena.misses;
      if (cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
        p = nullptr;
        return;
      }
    }
    (void)cudaMemset(p, 0x3c, bytes);
  }
  template <class T>
  explicit Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
    if (p) (void)cudaMemcpy(p, v.data(), n, cudaMemcpyHostToDevice);
  }
  ~Dev() {
    if (mark != SIZE_MAX)
      g_arena.used = mark;
    else if (p)
      (void)cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

/// Seconds per launch: after warm-up launches, `trials` batches of `reps` back-to-back launches
/// each timed by a pair of events; the median batch (robust to a stray clock or neighbour blip).
double time_launch(cudaStream_t st, int reps, const std::function<cudaError_t()>& fn, bool* ok) {
  // The buffers were filled on the legacy stream, which a non-blocking stream does not wait for.
  *ok &= cudaDeviceSynchronize() == cudaSuccess;
  constexpr int kTrials = 7;
  cudaEvent_t ev[kTrials + 1];
  for (cudaEvent_t& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < 3; ++i) *ok &= fn() == cudaSuccess;
  cudaEventRecord(ev[0], st);
  for (int t = 0; t < kTrials; ++t) {
    for (int i = 0; i < reps; ++i) *ok &= fn() == cudaSuccess;
    cudaEventRecord(ev[t + 1], st);
  }
  *ok &= cudaEventSynchronize(ev[kTrials]) == cudaSuccess;
  std::vector<double> s;
  for (int t = 0; t < kTrials; ++t) {
    float ms = 0;
    cudaEventElapsedTime(&ms, ev[t], ev[t + 1]);
    s.push_back(ms * 1e-3 / reps);
  }
  for (cudaEvent_t& e : ev) cudaEventDestroy(e);
  std::sort(s.begin(), s.end());
  return s[kTrials / 2];
}

int run_kernels(const Options& opts) {
  KernelsArgs args;
  if (!parse_kernels_args(opts, &args)) return 2;
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "kernels: needs a CUDA GPU (%s)\n", cuda_summary().c_str());
    return 2;
  }
  if (cudaSetDevice(opts.device) != cudaSuccess) return 1;
  Report rep("kernels");
  rep.note(cuda_summary());
  for (const std::string& a : opts.args) rep.note("run with " + a);
  cudaStream_t st;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) return 1;
  const int reps = opts.quick ? 3 : 10;
  // Enough work per launch that launch gaps and the last partial wave are noise next to the
  // 1 GiB copy of the limit: about 1 GB moved per launch where the region budget allows.
  const int64_t max_tokens = opts.quick ? 16384 : (int64_t{1} << 21);
  const double moved = opts.quick ? 64e6 : 1.2e9;  // bytes a launch should move
  // Layers of the cross-layer buffer; KVFERRY_BENCH_LAYERS (diagnosis) sets another count (2-256).
  const int64_t xl = [&]() -> int64_t {
    const char* v = std::getenv("KVFERRY_BENCH_LAYERS");
    const long l = v ? std::strtol(v, nullptr, 10) : 0;
    return l >= 2 && l <= 256 ? l : (opts.quick ? 8 : 61);
  }();
  const double budget = opts.quick ? 1e9 : 32e9;  // bytes of one cross-layer region at most

  // Limit: a device-to-device copy, read + write counted.
  double d2d = 0;
  {
    const size_t n = opts.quick ? (size_t{256} << 20) : (size_t{1} << 30);
    Dev a(n), b(n);
    if (!a.p || !b.p) return 1;
    bool ok = true;
    const double t = time_launch(
        st, reps, [&] { return cudaMemcpyAsync(b.p, a.p, n, cudaMemcpyDeviceToDevice, st); }, &ok);
    d2d = 2.0 * static_cast<double>(n) / t / 1e9;
    rep.add({"device-to-device copy", d2d, "GB/s", d2d, "itself", true, 0, "read + write"});
  }

  // What each traffic shape allows on this GPU: plain coalesced streams reading and writing in the
  // data-path kernels' proportions (quantising writers shrink about 2:1, dequantising gathers
  // expand about 1:2), as ratios to the same D2D copy. Informational: the target stays the D2D copy.
  {
    struct Shape {
      const char* name;
      int reads, writes;
    };
    for (const Shape sh :
         {Shape{"ceiling: stream read 1 : write 1", 1, 1}, Shape{"ceiling: stream read 1 : write 2", 1, 2},
          Shape{"ceiling: stream read 2 : write 1", 2, 1}}) {
      const int64_t units = static_cast<int64_t>(moved / (16.0 * (sh.reads + sh.writes))) / 32 * 32;
      Dev a(static_cast<size_t>(units * 16 * sh.reads)), b(static_cast<size_t>(units * 16 * sh.writes));
      if (!a.p || !b.p) return 1;
      bool ok = true;
      const double t = time_launch(
          st, reps, [&] { return launch_shape_stream(a.p, b.p, units, sh.reads, sh.writes, st); }, &ok);
      if (!ok) {
        rep.note(std::string(sh.name) + ": launch failed");
        continue;
      }
      rep.add({sh.name, 16.0 * static_cast<double>(units * (sh.reads + sh.writes)) / t / 1e9, "GB/s", d2d, "d2d copy",
               true, 0, "what the shape allows"});
    }
  }

  // The arena: the largest row (a conversion between two cross-layer regions of up to `budget`
  // bytes each) and its inputs. KVFERRY_BENCH_ARENA=0 (diagnosis) allocates per row instead.
  const char* arena_env = std::getenv("KVFERRY_BENCH_ARENA");
  if (!(arena_env && std::string(arena_env) == "0")) {
    size_t want = static_cast<size_t>(2 * budget) + (size_t{6} << 30), free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b > (size_t{2} << 30))
      want = std::min(want, free_b - (size_t{2} << 30));
    void* a = nullptr;
    if (cudaMalloc(&a, want) == cudaSuccess) {
      g_arena = {static_cast<uint8_t*>(a), want, 0};
      // KVFERRY_BENCH_ALIGN (diagnosis): where in the arena each buffer starts (a power of two
      // from 256 bytes; default 256).
      if (const char* v = std::getenv("KVFERRY_BENCH_ALIGN")) {
        const long al = std::strtol(v, nullptr, 10);
        if (al >= 256 && (al & (al - 1)) == 0) {
          g_arena.align = static_cast<size_t>(al);
          rep.note("arena buffers start at multiples of " + std::to_string(al) + " bytes (KVFERRY_BENCH_ALIGN)");
        }
      }
      rep.note("one arena of " + std::to_string(want >> 20) +
               " MiB, allocated before the first row, holds every row's buffers");
    } else {
      (void)cudaGetLastError();
      rep.note("no arena (" + std::to_string(want >> 20) + " MiB not available): regions allocated per row");
    }
  }

  // KVFERRY_BENCH_MAP=1 (diagnosis): a 1 GiB device-to-device copy at every 8 GiB of the arena, as
  // a ratio to the limit measured on fresh buffers (does the memory the rows run on copy as fast?).
  if (g_arena.base && std::getenv("KVFERRY_BENCH_MAP")) {
    constexpr size_t kG = size_t{1} << 30;
    for (size_t off = 0; off + 2 * kG <= g_arena.size; off += 8 * kG) {
      bool ok = true;
      uint8_t* const a = g_arena.base + off;
      const double t = time_launch(
          st, reps, [&] { return cudaMemcpyAsync(a + kG, a, kG, cudaMemcpyDeviceToDevice, st); }, &ok);
      if (ok)
        rep.add({"arena copy at " + std::to_string(off / kG) + " GiB", 2.0 * kG / t / 1e9, "GB/s", d2d, "d2d copy",
                 true, 0, "where the rows' buffers lie"});
    }
  }
  // KVFERRY_BENCH_SKIP_GB (diagnosis): leave that many GiB at the arena's start unused, so every row
  // runs on memory further up.
  const size_t skip = [] {
    const char* v = std::getenv("KVFERRY_BENCH_SKIP_GB");
    return v ? static_cast<size_t>(std::max(0L, std::strtol(v, nullptr, 10))) << 30 : size_t{0};
  }();
  if (g_arena.base && skip > 0 && skip < g_arena.size) {
    g_arena.used = skip;
    rep.note("rows start " + std::to_string(skip >> 30) + " GiB into the arena (KVFERRY_BENCH_SKIP_GB)");
  }

  struct ArenaGuard {
    ~ArenaGuard() {
      if (g_arena.base) (void)cudaFree(g_arena.base);
      g_arena = {};
    }
  } arena_guard;

  // KVFERRY_BENCH_VIEWS (diagnosis): the order of the two passes, e.g. "10" runs the cross-layer
  // pass first, "010" the contiguous pass again after it.
  const char* views_env = std::getenv("KVFERRY_BENCH_VIEWS");
  const std::string views = views_env && *views_env ? views_env : "01";
  for (char view_c : views) {
    const int cross = view_c == '1' ? 1 : 0;
    const int64_t layers = cross ? xl : 1, layer = cross ? xl / 2 : 0;
    const std::string view = cross ? " L" + std::to_string(xl) + "/" + std::to_string(layer) : " contiguous";
    // Tokens so that a launch moves about `moved` bytes (`moved_per_token` each) while the
    // cross-layer region of the widest format of a kernel stays within budget.
    auto tokens_for = [&](int64_t bytes_per_token, int64_t moved_per_token) {
      const int64_t t = static_cast<int64_t>(budget / static_cast<double>(xl * bytes_per_token));
      const int64_t w = static_cast<int64_t>(moved / static_cast<double>(moved_per_token));
      return std::max<int64_t>(64, std::min({max_tokens, t, w}) / 64 * 64);
    };
    // A row with the 0.85 target, or (suffix given) an informational one named name + view + suffix.
    auto add = [&](const std::string& name, double bytes, double t, bool ok, const char* suffix = nullptr,
                   const char* note = "") {
      const std::string row = name + view + (suffix ? suffix : "");
      if (!ok) {
        rep.note(row + ": launch failed");
        return;
      }
      rep.add({row, bytes / t / 1e9, "GB/s", d2d, "d2d copy", true, suffix ? 0 : 0.85, note});
    };
    std::mt19937 g(7);
    // Slots and block tables are random permutations here; KVFERRY_BENCH_ORDERED=1 (diagnosis) keeps
    // them in order everywhere. The gathers and dequant_paged read through random block tables and
    // slots as an engine's do (blocks of a sequence are scattered; a sparse indexer picks tokens
    // anywhere), and that is their target row. The writers' target row takes its slots by block
    // (below): the slots of the tokens an engine writes by the thousand in one launch, a prefill's.
    // Random slots are a decode step's pattern, one token per request, a few hundred per launch at
    // most (a latency, not a bandwidth); their rows are informational, next to a raw scatter of the
    // same bytes to the same slots, which is what that pattern allows any kernel (kernels/DESIGN.md
    // §2.2: the writers run above it).
    static const bool ordered = std::getenv("KVFERRY_BENCH_ORDERED") != nullptr;
    // KVFERRY_BENCH_ONLY (diagnosis): run only the sections whose name contains it (write_mla,
    // write_mha, indexer, gather, dequant, convert).
    static const std::string only = std::getenv("KVFERRY_BENCH_ONLY") ? std::getenv("KVFERRY_BENCH_ONLY") : "";
    auto want = [&](const char* section) {
      return only.empty() || std::string(section).find(only) != std::string::npos;
    };
    // The writers again with two other slot orders: "slots by block" (the blocks in random order,
    // each block's 64 tokens in order: an engine's prefill, whose block table scatters the blocks of
    // a sequence; the target row) and "slots in order" (informational: what the kernel does when the
    // scatter itself costs nothing).
    auto again_in_order = [&](const std::string& name, Dev& slots, int64_t n, double bytes,
                              const std::function<cudaError_t()>& fn) {
      constexpr int64_t kBs = 64;  // spec_of's block size
      std::vector<int64_t> blocks(static_cast<size_t>(n / kBs));
      std::iota(blocks.begin(), blocks.end(), 0);
      std::mt19937 gb(11);  // its own generator: the other rows keep their slots and tables
      std::shuffle(blocks.begin(), blocks.end(), gb);
      for (const bool by_block : {true, false}) {
        std::vector<int64_t> sl(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i)
          sl[static_cast<size_t>(i)] = by_block ? blocks[static_cast<size_t>(i / kBs)] * kBs + i % kBs : i;
        const std::string row = name + view + (by_block ? ", slots by block" : ", slots in order");
        bool ok = cudaMemcpy(slots.p, sl.data(), sl.size() * sizeof(int64_t), cudaMemcpyHostToDevice) == cudaSuccess;
        const double t = time_launch(st, reps, fn, &ok);
        if (!ok) {
          rep.note(row + ": launch failed");
          continue;
        }
        rep.add({row, bytes / t / 1e9, "GB/s", d2d, "d2d copy", true, by_block ? 0.85 : 0, ""});
      }
    };
    // The same bytes to the same random slots without the conversion (launch_scatter_ceiling):
    // what the slot order allows a writer, with plain loads and with evict-first loads (the policy
    // the quantising writers read with). Informational rows, no target.
    auto raw_scatter = [&](const std::string& name, const Dev& in, int64_t in_bytes, const Dev& cache,
                           const KvCacheSpec& s, int64_t out_bytes, int64_t scale_bytes, const Dev& slots, int64_t n,
                           double bytes) {
      for (const bool once : {false, true}) {
        bool ok = true;
        uint8_t* const base = cache.as<uint8_t>() + s.page_offset(layer, 0);
        const double t = time_launch(
            st, reps,
            [&] {
              return launch_scatter_ceiling(in.p, in_bytes, base, s.block_stride_bytes(), s.block_size, out_bytes,
                                            scale_bytes, slots.as<int64_t>(), n, once, st);
            },
            &ok);
        const std::string row = name + view + (once ? ", raw scatter, loads evict-first" : ", raw scatter");
        if (!ok) {
          rep.note(row + ": launch failed");
          continue;
        }
        rep.add({row, bytes / t / 1e9, "GB/s", d2d, "d2d copy", true, 0, "its bytes to its slots, unconverted"});
      }
    };
    auto perm = [&](int64_t n) {
      std::vector<int64_t> v(static_cast<size_t>(n));
      std::iota(v.begin(), v.end(), 0);
      if (!ordered) std::shuffle(v.begin(), v.end(), g);
      return v;
    };

    // ---- write_mla, three modes ----
    for (MlaWriteMode mode : {MlaWriteMode::kCopy, MlaWriteMode::kFp8, MlaWriteMode::kFp8Ds}) {
      if (!want("write_mla")) break;
      const EntryFormat f = mode == MlaWriteMode::kCopy  ? EntryFormat::mla_bf16()
                            : mode == MlaWriteMode::kFp8 ? EntryFormat::mla_fp8()
                                                         : EntryFormat::mla_fp8_ds();
      const int64_t n = tokens_for(1152, 1152 + 8 + f.bytes_per_token());
      const KvCacheSpec s = spec_of(f, layers, n / 64);
      Dev cache(static_cast<size_t>(s.region_bytes())), kv(static_cast<size_t>(n * 1152)), slots(perm(n));
      if (!cache.p || !kv.p || !slots.p) return 1;
      WriteMlaParams p;
      p.engine = args.engine;
      p.kv_c = kv.p;
      p.k_pe = kv.as<uint8_t>() + n * 1024;
      p.slots = slots.as<int64_t>();
      p.tokens = n;
      p.cache = {cache.p, s.region_bytes(), s.layer_view(layer)};
      p.mode = mode;
      p.scale = 0.5f;
      bool ok = validate_write_mla(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_write_mla(p, st); }, &ok);
      const char* nm[] = {"write_mla bf16", "write_mla fp8", "write_mla fp8_ds"};
      const double bytes = static_cast<double>(n) * (1152 + 8 + f.bytes_per_token());
      add(nm[int(mode)], bytes, t, ok, ", random slots", "a decode step's pattern");
      if (ok) raw_scatter(nm[int(mode)], kv, 1152, cache, s, f.bytes_per_token(), 0, slots, n, bytes);
      if (ok) again_in_order(nm[int(mode)], slots, n, bytes, [&] { return launch_write_mla(p, st); });
    }

    // ---- write_mha, bf16 NHD and fp8 HND, 8 x 128 ----
    for (DType dt : {DType::kBF16, DType::kFP8E4M3}) {
      if (!want("write_mha")) break;
      const EntryFormat f = EntryFormat::mha(8, 128, dt, dt == DType::kBF16 ? MhaOrder::kNHD : MhaOrder::kHND);
      const int64_t n = tokens_for(f.bytes_per_token(), 4096 + 8 + f.bytes_per_token());
      const KvCacheSpec s = spec_of(f, layers, n / 64);
      Dev cache(static_cast<size_t>(s.region_bytes())), kv(static_cast<size_t>(n * 2 * 2048)), slots(perm(n));
      if (!cache.p || !kv.p || !slots.p) return 1;
      WriteMhaParams p;
      p.engine = args.engine;
      p.key = kv.p;
      p.value = kv.as<uint8_t>() + n * 2048;
      p.key_stride = p.value_stride = 1024;
      p.slots = slots.as<int64_t>();
      p.tokens = n;
      p.k_cache = {cache.p, s.region_bytes(), s.kv_view(layer, false)};
      p.v_cache = {cache.p, s.region_bytes(), s.kv_view(layer, true)};
      bool ok = validate_write_mha(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_write_mha(p, st); }, &ok);
      const char* name = dt == DType::kBF16 ? "write_mha bf16 8x128 nhd" : "write_mha fp8 8x128 hnd";
      const double bytes = static_cast<double>(n) * (4096 + 8 + f.bytes_per_token());
      add(name, bytes, t, ok, ", random slots", "a decode step's pattern");
      if (ok) again_in_order(name, slots, n, bytes, [&] { return launch_write_mha(p, st); });
    }

    // ---- indexer ----
    if (want("indexer")) {
      const int64_t n = tokens_for(kIndexerBytes, 256 + 8 + kIndexerBytes);
      const KvCacheSpec s = spec_of(EntryFormat::indexer_fp8(), layers, n / 64);
      Dev cache(static_cast<size_t>(s.region_bytes())), k(static_cast<size_t>(n * 256)), slots(perm(n));
      if (!cache.p || !k.p || !slots.p) return 1;
      IndexerWriteParams p;
      p.engine = args.engine;
      p.k = k.p;
      p.slots = slots.as<int64_t>();
      p.tokens = n;
      p.cache = {cache.p, s.region_bytes(), s.layer_view(layer)};
      p.ue8m0 = true;
      bool ok = validate_indexer_write(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_indexer_write(p, st); }, &ok);
      const double bytes = static_cast<double>(n) * (256 + 8 + 132);
      add("indexer_write ue8m0", bytes, t, ok, ", random slots", "a decode step's pattern");
      if (ok) raw_scatter("indexer_write ue8m0", k, 256, cache, s, kIndexerHeadDim, 4, slots, n, bytes);
      if (ok) again_in_order("indexer_write ue8m0", slots, n, bytes, [&] { return launch_indexer_write(p, st); });
    }

    // ---- gathers: 64 requests over a random block table ----
    for (GatherMode mode : {GatherMode::kCopy, GatherMode::kDequantFp8, GatherMode::kDequantDs}) {
      if (!want("gather")) break;
      const EntryFormat f = mode == GatherMode::kCopy         ? EntryFormat::mla_bf16()
                            : mode == GatherMode::kDequantFp8 ? EntryFormat::mla_fp8()
                                                              : EntryFormat::mla_fp8_ds();
      const int64_t n = tokens_for(1152, 1152 + f.bytes_per_token()), nb = n / 64, batch = 64, per = nb / batch;
      const KvCacheSpec s = spec_of(f, layers, nb);
      const auto blocks = perm(nb);
      std::vector<int32_t> bt(blocks.begin(), blocks.end()), cu;
      for (int64_t r = 0; r <= batch; ++r) cu.push_back(static_cast<int32_t>(r * per * 64));
      Dev cache(static_cast<size_t>(s.region_bytes())), out(static_cast<size_t>(n * 1152)), dbt(bt), dcu(cu);
      if (!cache.p || !out.p || !dbt.p || !dcu.p) return 1;
      GatherParams p;
      p.engine = args.engine;
      p.cache = {cache.p, s.region_bytes(), s.layer_view(layer)};
      p.dst = out.p;
      p.dst_stride = 576;
      p.block_table = dbt.as<int32_t>();
      p.block_table_stride = per;
      p.cu_seq_lens = dcu.as<int32_t>();
      p.batch = batch;
      p.total_rows = cu.back();
      p.mode = mode;
      p.scale = 0.5f;
      bool ok = validate_gather(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_gather(p, st); }, &ok);
      const char* nm[] = {"gather bf16 copy", "gather fp8->bf16", "gather 656->bf16"};
      add(nm[int(mode)], static_cast<double>(p.total_rows) * (f.bytes_per_token() + 1152), t, ok);
    }

    // ---- dequantize_k_cache_paged ----
    if (want("dequant")) {
      const int64_t n = tokens_for(kMlaDsBytes, kMlaDsBytes + 4 + 1152);
      const KvCacheSpec s = spec_of(EntryFormat::mla_fp8_ds(), layers, n / 64);
      const auto sl = perm(n);
      std::vector<int32_t> sl32(sl.begin(), sl.end());
      Dev cache(static_cast<size_t>(s.region_bytes())), out(static_cast<size_t>(n * 1152)), slots(sl32);
      if (!cache.p || !out.p || !slots.p) return 1;
      DequantPagedParams p;
      p.engine = args.engine;
      p.cache = {cache.p, s.region_bytes(), s.layer_view(layer)};
      p.slots = slots.as<int32_t>();
      p.count = n;
      p.dst = out.p;
      bool ok = validate_dequant_paged(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_dequant_paged(p, st); }, &ok);
      add("dequant_paged 656->bf16", static_cast<double>(n) * (656 + 4 + 1152), t, ok);
    }

    // ---- conversions of one layer's whole view ----
    struct K {
      ConvertKind kind;
      EntryFormat s, d;
      const char* name;
    };
    for (const K& k :
         {K{ConvertKind::kFp8ToDs, EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds(), "convert 576->656"},
          K{ConvertKind::kDsToFp8, EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp8(), "convert 656->576"},
          K{ConvertKind::kBf16ToDs, EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds(), "convert bf16->656"},
          K{ConvertKind::kDsToBf16, EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16(), "convert 656->bf16"}}) {
      if (!want("convert")) break;
      // KVFERRY_BENCH_PAGE (diagnosis): the conversions' block size (default 64).
      static const int64_t page = [] {
        const char* v = std::getenv("KVFERRY_BENCH_PAGE");
        const long b = v ? std::strtol(v, nullptr, 10) : 64;
        return b >= 1 && b <= 1024 ? static_cast<int64_t>(b) : int64_t{64};
      }();
      const int64_t n = tokens_for(std::max(k.s.bytes_per_token(), k.d.bytes_per_token()),
                                   k.s.bytes_per_token() + k.d.bytes_per_token());
      const KvCacheSpec ss = spec_of(k.s, layers, n / page, page), ds = spec_of(k.d, layers, n / page, page);
      Dev src(static_cast<size_t>(ss.region_bytes())), dst(static_cast<size_t>(ds.region_bytes()));
      Dev flags(static_cast<size_t>(n / page * 4));
      if (!src.p || !dst.p || !flags.p) return 1;
      ConvertParams p;
      p.engine = args.engine;
      p.unit_order = args.unit_order;
      p.kind = k.kind;
      p.src = {src.p, ss.region_bytes(), ss.layer_view(layer)};
      p.dst = {dst.p, ds.region_bytes(), ds.layer_view(layer)};
      p.count = n / page;
      p.not_lossless = flags.as<int32_t>();
      // KVFERRY_BENCH_CONVERT_ORDER (diagnosis): "random" hands the conversions their blocks through
      // a shuffled list (the kernel then visits them in that order), "list" through a list in
      // order, instead of the whole view.
      static const int listed = [] {
        const char* v = std::getenv("KVFERRY_BENCH_CONVERT_ORDER");
        return v == nullptr ? 0 : std::string(v) == "random" ? 2 : std::string(v) == "list" ? 1 : 0;
      }();
      std::vector<int64_t> order(static_cast<size_t>(listed ? p.count : 0));
      std::iota(order.begin(), order.end(), 0);
      if (listed == 2) std::shuffle(order.begin(), order.end(), g);
      Dev order_d(order);
      if (listed) p.src_blocks = p.dst_blocks = order_d.as<int64_t>();
      bool ok = validate_convert(p).ok();
      const double t = time_launch(
          st, reps, [&] { return launch_convert(p, st); }, &ok);
      const double bytes = static_cast<double>(n) * (k.s.bytes_per_token() + k.d.bytes_per_token());
      add(k.name, bytes, t, ok);
      if (ok) {  // the same blocks read and written on the same layout, unconverted (informational)
        bool ok2 = true;
        const uint8_t* const sb = src.as<uint8_t>() + ss.page_offset(layer, 0);
        uint8_t* const db = dst.as<uint8_t>() + ds.page_offset(layer, 0);
        const double tc = time_launch(
            st, reps,
            [&] {
              return launch_block_ceiling(sb, page * k.s.bytes_per_token(), ss.block_stride_bytes(), db,
                                          page * k.d.bytes_per_token(), ds.block_stride_bytes(), n / page, st);
            },
            &ok2);
        add(k.name, bytes, tc, ok2, ", block copy", "its blocks, unconverted");
      }
    }
  }
  if (g_arena.misses > 0)
    rep.note(std::to_string(g_arena.misses) + " allocations did not fit the arena and were allocated per row");
  rep.note("cross-layer rows use layer " + std::to_string(xl / 2) + " of a block-major buffer of " +
           std::to_string(xl) + " layers (stride(0) = L x page); a launch moves about " +
           std::to_string(static_cast<int64_t>(moved / 1e6)) + " MB, fewer where a region would pass " +
           std::to_string(static_cast<int64_t>(budget / 1e9)) + " GB; median of 7 batches of " + std::to_string(reps) +
           " launches");
  cudaStreamDestroy(st);
  return rep.finish(opts);
}

#else

int run_kernels(const Options& opts) {
  KernelsArgs args;
  if (!parse_kernels_args(opts, &args)) return 2;
  std::fprintf(stderr, "kernels: needs a CUDA GPU (built without CUDA)\n");
  return 2;
}

#endif

/// The CPU twins of the conversions the daemon runs on the host while a block is staged, and the
/// CPU copy_blocks, as bytes (read + written) per second over a memcpy of the same bytes, on one
/// thread and on every hardware thread. Needs no GPU.
int run_kernels_cpu(const Options& opts) {
  Report rep("kernels-cpu");
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t layers = 8, blocks = opts.quick ? 16 : 64, bs = 64;
  const int reps = opts.quick ? 2 : 5;
  struct K {
    EntryFormat s, d;
    const char* name;
  };
  const K kinds[] = {{EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds(), "convert 576->656"},
                     {EntryFormat::mla_fp8_ds(), EntryFormat::mla_fp8(), "convert 656->576"},
                     {EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds(), "convert bf16->656"},
                     {EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16(), "convert 656->bf16"}};
  std::vector<int64_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  auto timed = [&](const std::function<void()>& fn) {
    fn();
    const double t0 = now_s();
    for (int i = 0; i < reps; ++i) fn();
    return (now_s() - t0) / reps;
  };
  for (int threads : {1, hw}) {
    const std::string tn = " x" + std::to_string(threads) + " threads";
    for (const K& k : kinds) {
      const KvCacheSpec ss = spec_of(k.s, layers, blocks), ds = spec_of(k.d, layers, blocks);
      std::vector<uint8_t> src(static_cast<size_t>(ss.region_bytes()), 0x3c),
          dst(static_cast<size_t>(ds.region_bytes()));
      const double bytes = static_cast<double>(ss.region_bytes() + ds.region_bytes());
      // Limit: memcpy of the destination's size, split over the same threads, read + write counted.
      const std::vector<CopyRun> runs = [&] {
        std::vector<CopyRun> r;
        const int64_t n = std::min(ss.region_bytes(), ds.region_bytes()), piece = n / 64;
        for (int64_t o = 0; o + piece <= n; o += piece) r.push_back({o, o, piece});
        return r;
      }();
      double copied = 0;
      for (const CopyRun& r : runs) copied += 2.0 * static_cast<double>(r.bytes);
      const double tl = timed([&] {
        (void)copy_blocks_cpu(src.data(), ss.region_bytes(), dst.data(), ds.region_bytes(), runs, {threads});
      });
      Status st;
      const double tc = timed([&] { st = convert_blocks_cpu(src.data(), ss, ids, dst.data(), ds, ids, {threads}); });
      if (!st.ok()) {
        std::fprintf(stderr, "kernels-cpu: %s\n", st.to_string().c_str());
        return 1;
      }
      rep.add({std::string(k.name) + tn, bytes / tc / 1e9, "GB/s", copied / tl / 1e9, "memcpy", true, 0, ""});
    }
  }
  rep.note(std::to_string(layers) + " layers x " + std::to_string(blocks) + " blocks x " + std::to_string(bs) +
           " tokens per call; " + std::to_string(hw) + " hardware threads");
  return rep.finish(opts);
}

}  // namespace

KVFERRY_BENCH_SUITE("kernels-cpu", "CPU twins of the format conversions vs memcpy (the daemon's host path)",
                    run_kernels_cpu);

KVFERRY_BENCH_SUITE_WITH_OPTIONS(
    "kernels", "data-path kernels' bytes/s vs a device-to-device copy, contiguous and cross-layer", run_kernels,
    "  --engine=auto|direct|staged|bulk   run every kernel on that engine (the params' engine field;\n"
    "                                     bulk: the conversions on sm_90, the others keep their default)\n"
    "  --unit-order=auto|stride|ranges    the bulk conversions' unit order (ConvertParams::unit_order)\n"
    "  diagnosis environment variables (KVFERRY_BENCH_*): bench/README.md\n");

}  // namespace kvferry::bench
