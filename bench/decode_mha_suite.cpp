// decode-mha: paged MHA/GQA decode time against the KV-bytes floor at the device-to-device copy
// rate measured in the same run, contiguous vs cross-layer (a layer view of a block-major buffer).
// `kvferry-bench decode --mha` reaches this suite too.
//
// What it measured on an H200, and what that chose: kernels/DESIGN.md §4.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "kvferry/kernels/decode_paged.h"
#include "kvferry/kernels/device.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvferry::bench {
namespace {

#if defined(KVFERRY_WITH_CUDA)

struct Shape {
  std::string name;
  int B, Hq, Hkv, Dk, Dv, P, len;
  DType ct;
};

/// One device allocation (freed on scope exit).
struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (p != nullptr) cudaFree(p);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// Calls of `fn` back to back between one pair of events: the host's launch cost then overlaps
/// the previous call, as in a decode step, for the kernel and the floor's copy alike.
constexpr int kBackToBack = 8;

/// Median microseconds per call of `fn` enqueued on `s` (`iters` samples of kBackToBack calls).
template <class F>
double time_us(cudaStream_t s, int warm, int iters, F&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < warm; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, s);
    for (int r = 0; r < kBackToBack; ++r) fn();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e3 / kBackToBack);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

/// Device-to-device copy rate in GB/s, read + write bytes counted (the HBM traffic of a copy).
double d2d_rate(cudaStream_t s, size_t bytes, int iters) {
  Dev src(bytes), dst(bytes);
  if (src.p == nullptr || dst.p == nullptr) return 0;
  cudaMemsetAsync(src.p, 0x11, bytes, s);
  const double us = time_us(s, 3, iters, [&] { cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice, s); });
  return us > 0 ? 2.0 * static_cast<double>(bytes) / (us * 1e3) : 0;
}

std::string split_name(int splits) {
  return splits == kDecodePagedBalanced ? std::string("balanced") : "S=" + std::to_string(splits);
}

struct Run {
  double us = 0;
  int splits = 0;
  bool ok = false;
};

/// Builds q, K/V (contiguous or layer 1 of a 3-layer block-major buffer), a random block table,
/// and times the decode. splits == 0: the launcher's choice; kDecodePagedBalanced.
Run run_case(const Shape& c, bool cross_layer, int splits, cudaStream_t s, int warm, int iters, Report& rep) {
  Run r;
  const int64_t eb = dtype_size(c.ct), qe = 2;
  const int64_t pages_per_seq = (c.len + c.P - 1) / c.P;
  const int64_t NB = c.B * pages_per_seq;
  const int64_t kpage = int64_t{c.P} * c.Hkv * c.Dk, vpage = int64_t{c.P} * c.Hkv * c.Dv;
  const int L = cross_layer ? 3 : 1, layer = cross_layer ? 1 : 0;
  const int64_t per_layer = kpage + vpage, blk = L * per_layer;
  const size_t kv_bytes = static_cast<size_t>(NB * blk * eb);
  Dev kv(kv_bytes), q(static_cast<size_t>(c.B * c.Hq * c.Dk * qe)), o(static_cast<size_t>(c.B * c.Hq * c.Dv * qe)),
      lse(static_cast<size_t>(c.B * c.Hq * 4)), bt(static_cast<size_t>(NB * 4)), lens(static_cast<size_t>(c.B * 4));
  if (kv.p == nullptr || q.p == nullptr || o.p == nullptr || lse.p == nullptr || bt.p == nullptr || lens.p == nullptr) {
    rep.note(c.name + ": out of device memory");
    return r;
  }
  // Finite non-zero fill (0x3a3a: bf16 ~7e-4, fp16 ~0.7, e4m3 0x3a = 1.25); neighbours differ.
  cudaMemsetAsync(kv.p, 0x3a, kv_bytes, s);
  cudaMemsetAsync(q.p, 0x3c, static_cast<size_t>(c.B * c.Hq * c.Dk * qe), s);
  std::vector<int32_t> table(static_cast<size_t>(NB)), ls(static_cast<size_t>(c.B), c.len);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  cudaMemcpyAsync(bt.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(lens.p, ls.data(), ls.size() * 4, cudaMemcpyHostToDevice, s);

  DecodePagedParams d;
  const DType qt = c.ct == DType::kFP16 ? DType::kFP16 : DType::kBF16;
  d.q_base = q.p;
  d.q = contiguous_view(qt, {c.B, c.Hq, c.Dk});
  d.q_region_bytes = c.B * c.Hq * c.Dk * qe;
  const int64_t ksz[4] = {NB, c.P, c.Hkv, c.Dk}, vsz[4] = {NB, c.P, c.Hkv, c.Dv};
  const int64_t kst[4] = {blk, int64_t{c.Hkv} * c.Dk, c.Dk, 1}, vst[4] = {blk, int64_t{c.Hkv} * c.Dv, c.Dv, 1};
  d.k_base = d.v_base = kv.p;
  d.k_region_bytes = d.v_region_bytes = static_cast<int64_t>(kv_bytes);
  d.k = make_view(c.ct, 4, ksz, kst, layer * per_layer * eb);
  d.v = make_view(c.ct, 4, vsz, vst, (layer * per_layer + kpage) * eb);
  d.block_table = static_cast<const int32_t*>(bt.p);
  d.block_table_stride = pages_per_seq;
  d.max_blocks_per_seq = static_cast<int32_t>(pages_per_seq);
  d.seq_lens = static_cast<const int32_t*>(lens.p);
  d.max_seq_len = c.len;
  d.o_base = o.p;
  d.o = contiguous_view(qt, {c.B, c.Hq, c.Dv});
  d.o_region_bytes = c.B * c.Hq * c.Dv * qe;
  d.lse = static_cast<float*>(lse.p);
  d.sm_scale = 1.0f / 11.3137f;
  d.k_scale = d.v_scale = 1.0f;
  d.num_splits = splits != 0 ? splits : decode_paged_choose_splits(d);
  const size_t ws_bytes = static_cast<size_t>(decode_paged_workspace_bytes(d));
  Dev ws(std::max<size_t>(ws_bytes, 16));
  d.workspace = ws.p;
  d.workspace_bytes = static_cast<int64_t>(ws_bytes);
  if (Status st = validate_decode_paged(d); !st.ok()) {
    rep.note(c.name + ": " + st.to_string());
    return r;
  }
  cudaError_t err = cudaSuccess;
  r.us = time_us(s, warm, iters, [&] {
    const cudaError_t e = launch_decode_paged(d, s);
    if (e != cudaSuccess) err = e;
  });
  if (err != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess) {
    rep.note(c.name + ": launch failed: " + cudaGetErrorString(err));
    return r;
  }
  r.splits = d.num_splits;
  r.ok = true;
  return r;
}

int run_decode_mha(const Options& opts) {
  Report rep("decode-mha");
  if (cuda_device_count() == 0) {
    rep.note("no CUDA device: nothing measured (" + cuda_summary() + ")");
    return rep.finish(opts);
  }
  cudaSetDevice(opts.device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const int warm = opts.quick ? 3 : 10, iters = opts.quick ? 10 : 40;
  const double rate = d2d_rate(s, opts.quick ? (size_t{256} << 20) : (size_t{1} << 30), iters);  // GB/s
  rep.note(cuda_summary());
  rep.note("d2d copy rate " + std::to_string(rate) + " GB/s (read + write counted); floor = K+V bytes / rate");
  const int len = opts.quick ? 1024 : 4096;
  std::vector<Shape> shapes = {
      {"llama3-8b gqa4 d128 bf16", 64, 32, 8, 128, 128, 16, len, DType::kBF16},
      {"dk192 dv128 gqa4 bf16", 64, 32, 8, 192, 128, 16, len, DType::kBF16},
      {"llama3-8b gqa4 d128 fp8", 64, 32, 8, 128, 128, 16, len, DType::kFP8E4M3},
  };
  for (const Shape& c : shapes) {
    const double bytes = double(c.B) * c.len * c.Hkv * (c.Dk + c.Dv) * double(dtype_size(c.ct));
    const double floor_us = rate > 0 ? bytes / (rate * 1e3) : 0;
    const Run a = run_case(c, false, 0, s, warm, iters, rep);
    const Run x = run_case(c, true, 0, s, warm, iters, rep);
    if (!a.ok || !x.ok) continue;
    const std::string sp = split_name(a.splits) + ", " + human_bytes(static_cast<int64_t>(bytes)) + " K+V";
    char eff[64];
    std::snprintf(eff, sizeof eff, ", %.0f GB/s read", bytes / (a.us * 1e3));
    rep.add(Row{c.name + " contiguous", a.us, "us", floor_us, "KV bytes at d2d rate", false, 0.7, sp + eff});
    std::snprintf(eff, sizeof eff, ", %.0f GB/s read", bytes / (x.us * 1e3));
    rep.add(Row{c.name + " cross-layer L3", x.us, "us", floor_us, "KV bytes at d2d rate", false, 0.7, sp + eff});
    rep.add(Row{c.name + " cross-layer / contig", x.us, "us", a.us, "contiguous, same run", false, 0.99, ""});
  }
  if (!opts.quick) {  // split sweep of every shape (the launcher's choice is in the rows above)
    for (const Shape& c : shapes) {
      const double bytes = double(c.B) * c.len * c.Hkv * (c.Dk + c.Dv) * double(dtype_size(c.ct));
      for (int S : {1, 2, 3, 4, 6, kDecodePagedBalanced}) {
        const Run a = run_case(c, false, S, s, warm, iters / 2, rep);
        if (!a.ok) continue;
        rep.add(Row{c.name + " contiguous " + split_name(S), a.us, "us", rate > 0 ? bytes / (rate * 1e3) : 0,
                    "KV bytes at d2d rate", false, 0, "split sweep"});
      }
    }
  }
  cudaStreamDestroy(s);
  return rep.finish(opts);
}

#else

int run_decode_mha(const Options& opts) {
  Report rep("decode-mha");
  rep.note("built without CUDA: nothing measured");
  return rep.finish(opts);
}

#endif

}  // namespace

KVFERRY_BENCH_SUITE("decode-mha", "paged MHA/GQA decode vs the KV-bytes floor at the d2d copy rate", run_decode_mha);

}  // namespace kvferry::bench
