// kvferry-bench copy: moving 4096 blocks scattered over a 16384-block device region to and from a
// pinned host pool (D2H, H2D, both at once), 16 KiB ... 4 MiB blocks, with the SM copy kernel,
// cudaMemcpyBatchAsync, the automatic choice, and per-block cudaMemcpyAsync (the peer). Each figure
// is a ratio to one 1 GiB pinned copy (or to the both-ways copy) measured in the same run.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"

namespace kvferry::bench {
namespace {

#if defined(KVFERRY_WITH_CUDA)

using kernels::CopyEngine;

#define BENCH_CUDA(x)                                                                                        \
  do {                                                                                                       \
    cudaError_t e_ = (x);                                                                                    \
    if (e_ != cudaSuccess) {                                                                                 \
      std::fprintf(stderr, "copy: %s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                                              \
    }                                                                                                        \
  } while (0)

struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t t0 = nullptr, t1 = nullptr, ja = nullptr, jb = nullptr;
};

/// Times `fn` (which enqueues on s.a and/or s.b) `reps` times after one warm-up; returns seconds per rep.
template <class Fn>
double time_it(Streams& s, int reps, Fn&& fn) {
  cudaDeviceSynchronize();  // fills ran on the legacy stream, which s.a and s.b do not wait for
  auto once = [&] {
    cudaEventRecord(s.t0, s.a);
    cudaStreamWaitEvent(s.b, s.t0, 0);
    fn();
    cudaEventRecord(s.jb, s.b);
    cudaStreamWaitEvent(s.a, s.jb, 0);
    cudaEventRecord(s.t1, s.a);
    cudaEventSynchronize(s.t1);
    float ms = 0;
    cudaEventElapsedTime(&ms, s.t0, s.t1);
    return ms * 1e-3;
  };
  once();
  double total = 0;
  for (int i = 0; i < reps; ++i) total += once();
  return total / reps;
}

int run_copy(const Options& opts) {
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "copy: needs a CUDA GPU (%s)\n", cuda_summary().c_str());
    return 2;
  }
  BENCH_CUDA(cudaSetDevice(opts.device));
  Report rep("copy");
  rep.note(cuda_summary());
  const std::vector<int64_t> sizes = opts.quick ? std::vector<int64_t>{64 << 10, 1 << 20}
                                                : std::vector<int64_t>{16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
  const int64_t nblocks = opts.quick ? 1024 : 4096;
  int64_t region_blocks = opts.quick ? 4096 : 16384;
  const int reps = opts.quick ? 2 : 3;
  const int64_t max_size = sizes.back();

  Streams s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s.a, cudaStreamNonBlocking));
  BENCH_CUDA(cudaStreamCreateWithFlags(&s.b, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&s.t0));
  BENCH_CUDA(cudaEventCreate(&s.t1));
  BENCH_CUDA(cudaEventCreate(&s.ja));
  BENCH_CUDA(cudaEventCreate(&s.jb));

  // Limits: one 1 GiB pinned copy each way, and both at once.
  const size_t gib = size_t{1} << 30;
  uint8_t *lim_h = nullptr, *lim_d = nullptr;
  BENCH_CUDA(cudaMallocHost(reinterpret_cast<void**>(&lim_h), 2 * gib));
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&lim_d), 2 * gib));
  std::memset(lim_h, 1, 2 * gib);
  const double t_d2h = time_it(s, reps, [&] { cudaMemcpyAsync(lim_h, lim_d, gib, cudaMemcpyDeviceToHost, s.a); });
  const double t_h2d = time_it(s, reps, [&] { cudaMemcpyAsync(lim_d, lim_h, gib, cudaMemcpyHostToDevice, s.a); });
  const double t_both = time_it(s, reps, [&] {
    cudaMemcpyAsync(lim_h, lim_d, gib, cudaMemcpyDeviceToHost, s.a);
    cudaMemcpyAsync(lim_d + gib, lim_h + gib, gib, cudaMemcpyHostToDevice, s.b);
  });
  const double lim_d2h = gib / t_d2h / 1e9, lim_h2d = gib / t_h2d / 1e9, lim_both = 2.0 * gib / t_both / 1e9;
  BENCH_CUDA(cudaFree(lim_d));
  BENCH_CUDA(cudaFreeHost(lim_h));
  rep.add({"pinned 1GiB copy d2h", lim_d2h, "GB/s", lim_d2h, "itself", true, 0, ""});
  rep.add({"pinned 1GiB copy h2d", lim_h2d, "GB/s", lim_h2d, "itself", true, 0, ""});
  rep.add({"pinned 1GiB copy both ways", lim_both, "GB/s", lim_both, "itself", true, 0, ""});

  // The region (device) and the pool (pinned host), sized for the largest block.
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const int64_t fit = static_cast<int64_t>((free_b - (size_t{2} << 30)) / static_cast<size_t>(max_size));
  if (fit < region_blocks) {
    rep.note("region shrunk to " + std::to_string(fit) + " blocks of " + human_bytes(max_size) +
             " to fit device memory (blocks stay scattered)");
    region_blocks = std::max<int64_t>(fit, nblocks);
  }
  uint8_t *region = nullptr, *pool = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&region), static_cast<size_t>(region_blocks * max_size)));
  BENCH_CUDA(cudaMallocHost(reinterpret_cast<void**>(&pool), static_cast<size_t>(nblocks * max_size)));
  BENCH_CUDA(cudaMemset(region, 7, static_cast<size_t>(region_blocks * max_size)));
  std::memset(pool, 3, static_cast<size_t>(nblocks * max_size));

  std::vector<int64_t> ids(static_cast<size_t>(region_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 g(1);
  std::shuffle(ids.begin(), ids.end(), g);
  ids.resize(static_cast<size_t>(nblocks));

  auto ca = kernels::BlockCopier::create(nblocks);
  auto cb = kernels::BlockCopier::create(nblocks);
  if (!ca.ok() || !cb.ok()) {
    std::fprintf(stderr, "copy: %s\n", (ca.ok() ? cb.status() : ca.status()).to_string().c_str());
    return 1;
  }
  rep.note("copy kernel: " + std::to_string((*ca)->kernel_ctas()) + " CTAs x 512 threads; auto picks DMA from " +
           human_bytes(kernels::kCopyAutoThreshold) + " per run");

  enum Dir { kD2H, kH2D, kBoth };
  const char* dir_name[] = {"d2h", "h2d", "both"};
  struct Eng {
    const char* name;
    int engine;  // CopyEngine, or -1 for per-block cudaMemcpyAsync
    int ctas;    // copy kernel CTAs
  };
  const Eng engines[] = {{"kernel", int(CopyEngine::kKernel), 8},      {"kernel x4", int(CopyEngine::kKernel), 4},
                         {"kernel x16", int(CopyEngine::kKernel), 16}, {"dma-batch", int(CopyEngine::kDma), 8},
                         {"auto", int(CopyEngine::kAuto), 8},          {"per-block memcpy", -1, 8}};
  for (int64_t size : sizes) {
    // Runs: region block ids[i] <-> pool slot i; for both ways the first half goes out, the second in.
    std::vector<CopyRun> d2h, h2d;
    for (int64_t i = 0; i < nblocks; ++i) {
      d2h.push_back({ids[static_cast<size_t>(i)] * size, i * size, size});
      h2d.push_back({i * size, ids[static_cast<size_t>(i)] * size, size});
    }
    const size_t half = static_cast<size_t>(nblocks / 2);
    const std::vector<CopyRun> out_half(d2h.begin(), d2h.begin() + static_cast<std::ptrdiff_t>(half));
    const std::vector<CopyRun> in_half(h2d.begin() + static_cast<std::ptrdiff_t>(half), h2d.end());
    for (int dir : {kD2H, kH2D, kBoth}) {
      double best_gbs = 0;
      for (const Eng& e : engines) {
        bool failed = false;
        (*ca)->set_kernel_ctas(e.ctas);
        (*cb)->set_kernel_ctas(e.ctas);
        auto enqueue = [&](const std::vector<CopyRun>& runs, bool to_host, cudaStream_t st, kernels::BlockCopier& c) {
          const void* src = to_host ? static_cast<const void*>(region) : pool;
          void* dst = to_host ? static_cast<void*>(pool) : region;
          if (e.engine < 0) {
            for (const CopyRun& r : runs)
              cudaMemcpyAsync(static_cast<uint8_t*>(dst) + r.dst, static_cast<const uint8_t*>(src) + r.src,
                              static_cast<size_t>(r.bytes), cudaMemcpyDefault, st);
          } else if (!c.copy(src, dst, runs, static_cast<CopyEngine>(e.engine), st).ok()) {
            failed = true;
          }
        };
        const double t = time_it(s, reps, [&] {
          if (dir == kD2H) enqueue(d2h, true, s.a, **ca);
          if (dir == kH2D) enqueue(h2d, false, s.a, **ca);
          if (dir == kBoth) {
            enqueue(out_half, true, s.a, **ca);
            enqueue(in_half, false, s.b, **cb);
          }
        });
        if (failed || cudaGetLastError() != cudaSuccess) {
          std::fprintf(stderr, "copy: %s %s failed\n", dir_name[dir], e.name);
          return 1;
        }
        const double gbs = static_cast<double>(nblocks * size) / t / 1e9;
        best_gbs = std::max(best_gbs, gbs);
        const double lim = dir == kD2H ? lim_d2h : dir == kH2D ? lim_h2d : lim_both;
        double target = 0;
        if (e.engine >= 0) {
          if (e.ctas != 8)
            target = 0;
          else if (dir == kBoth)
            target = 0.85;
          else if (e.engine == int(CopyEngine::kKernel))
            target = 0.92;
          else if (size >= (1 << 20))
            target = 0.97;
          else if (size >= (256 << 10) || e.engine == int(CopyEngine::kAuto))
            target = 0.92;
        }
        std::string note;
        if (e.engine == int(CopyEngine::kAuto))
          note = std::string("-> ") + kernels::copy_engine_name(kernels::choose_copy_engine(d2h, CopyEngine::kAuto));
        rep.add({std::string(dir_name[dir]) + " " + human_bytes(size) + " " + e.name, gbs, "GB/s", lim,
                 dir == kBoth ? "pinned copy both ways" : std::string("pinned 1GiB ") + dir_name[dir], true, target,
                 note});
      }
    }
  }
  BENCH_CUDA(cudaFree(region));
  BENCH_CUDA(cudaFreeHost(pool));
  rep.note(std::to_string(nblocks) + " blocks scattered over a " + std::to_string(region_blocks) +
           "-block region; both ways = half the blocks out, half in, on two streams");
  return rep.finish(opts);
}

#else

int run_copy(const Options&) {
  std::fprintf(stderr, "copy: needs a CUDA GPU (built without CUDA)\n");
  return 2;
}

#endif

}  // namespace

KVFERRY_BENCH_SUITE("copy", "block offload/reload (16 KiB-4 MiB) over PCIe vs a 1 GiB pinned copy", run_copy);

}  // namespace kvferry::bench
