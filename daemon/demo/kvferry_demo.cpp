// kvferry-demo: an engine-like client of kvferryd. It creates a small DeepSeek-like MLA region,
// fills blocks through write_mla with seeded data, saves them to the daemon's host pool, wipes
// the region, loads them back into other block ids and checks every byte; then loads them into
// a region of another format of the MLA family (the daemon converts on the way) and checks the
// bytes against the CPU conversion and the values against the fp8 bound. Exit code 0 only when
// every check passed.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvferry/connector/client.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/dtype.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

using namespace kvferry;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string socket;
  std::string model = "deepseek-demo";
  int64_t layers = 4, blocks = 64, block_size = 64;
  std::string format = "mla_fp8_ds";
  uint32_t seed = 2024;
  bool convert = true;
  bool keep = false;
};

/// The region's bytes seen from this process: host memory directly, GPU memory through a staging copy.
struct Mapped {
  uint32_t id = 0;
  KvCacheSpec spec;
  uint8_t* base = nullptr;
  bool device = false;
  std::vector<uint8_t> staging;  // device regions: host copy

  uint8_t* host() { return device ? staging.data() : base; }
  Status pull() {  // device -> staging
    if (!device) return Status::Ok();
#if defined(KVFERRY_WITH_CUDA)
    staging.resize(static_cast<size_t>(spec.region_bytes()));
    if (cudaMemcpy(staging.data(), base, staging.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      return {ErrorCode::kCuda, "cudaMemcpy D2H of the region failed"};
    return Status::Ok();
#else
    return {ErrorCode::kUnavailable, "a GPU region in a build without CUDA"};
#endif
  }
  Status push() {  // staging -> device
    if (!device) return Status::Ok();
#if defined(KVFERRY_WITH_CUDA)
    if (cudaMemcpy(base, staging.data(), staging.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      return {ErrorCode::kCuda, "cudaMemcpy H2D of the region failed"};
    return Status::Ok();
#else
    return {ErrorCode::kUnavailable, "a GPU region in a build without CUDA"};
#endif
  }
};

Result<Mapped> make_region(Client& c, const std::string& name, const KvCacheSpec& spec) {
  auto id = c.create_region(name, spec);
  if (!id.ok()) return id.status();
  auto lv = c.layer_view(*id, 0);
  if (!lv.ok()) return lv.status();
  auto base = c.map_region(*id);
  if (!base.ok()) return base.status();
  Mapped m;
  m.id = *id;
  m.spec = spec;
  m.base = static_cast<uint8_t*>(*base);
  m.device = lv->on_device;
  if (m.device) m.staging.assign(static_cast<size_t>(spec.region_bytes()), 0);
  return m;
}

/// Seeded bf16 inputs of one layer: kv_c [tokens, 512], k_pe [tokens, 64].
struct Inputs {
  std::vector<uint16_t> kv_c, k_pe;
};
Inputs make_inputs(int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  Inputs in;
  in.kv_c.resize(static_cast<size_t>(tokens * 512));
  in.k_pe.resize(static_cast<size_t>(tokens * 64));
  for (auto& v : in.kv_c) v = float_to_bf16(u(rng));
  for (auto& v : in.k_pe) v = float_to_bf16(u(rng));
  return in;
}

kernels::MlaWriteMode mode_of(const EntryFormat& f) {
  if (f.kind == FormatKind::kMlaFp8) return kernels::MlaWriteMode::kFp8;
  if (f.kind == FormatKind::kMlaFp8Ds) return kernels::MlaWriteMode::kFp8Ds;
  return kernels::MlaWriteMode::kCopy;
}

#if defined(KVFERRY_WITH_CUDA)
/// The CUDA writer straight into a GPU region; then the staging copy is pulled.
Status fill_cuda(Mapped& m, const std::vector<int64_t>& slots, const std::vector<Inputs>& inputs) {
  const int64_t tokens = static_cast<int64_t>(slots.size());
  void *kv = nullptr, *pe = nullptr, *sl = nullptr;
  cudaStream_t s = nullptr;
  Status st;
  auto check = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && st.ok()) st = Status(ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorString(e));
    return st.ok();
  };
  if (check(cudaMalloc(&kv, tokens * 512 * 2), "cudaMalloc(kv_c)") &&
      check(cudaMalloc(&pe, tokens * 64 * 2), "cudaMalloc(k_pe)") &&
      check(cudaMalloc(&sl, tokens * sizeof(int64_t)), "cudaMalloc(slots)") &&
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate") &&
      check(cudaMemcpy(sl, slots.data(), tokens * sizeof(int64_t), cudaMemcpyHostToDevice), "cudaMemcpy(slots)")) {
    for (int64_t l = 0; l < m.spec.layers && st.ok(); ++l) {
      const Inputs& in = inputs[static_cast<size_t>(l)];
      if (!check(cudaStreamSynchronize(s), "cudaStreamSynchronize") ||  // the previous layer read kv/pe
          !check(cudaMemcpy(kv, in.kv_c.data(), in.kv_c.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy(kv_c)") ||
          !check(cudaMemcpy(pe, in.k_pe.data(), in.k_pe.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy(k_pe)"))
        break;
      kernels::WriteMlaParams p;
      p.kv_c = kv;
      p.k_pe = pe;
      p.input_dtype = DType::kBF16;
      p.slots = static_cast<const int64_t*>(sl);
      p.tokens = tokens;
      p.cache = {m.base, m.spec.region_bytes(), m.spec.layer_view(l)};
      p.mode = mode_of(m.spec.format);
      p.scale = 1.0f;
      if (Status v = kernels::validate_write_mla(p); !v.ok()) {
        st = v;
        break;
      }
      check(kernels::launch_write_mla(p, s), "launch_write_mla");
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  if (s) cudaStreamDestroy(s);
  if (kv) cudaFree(kv);
  if (pe) cudaFree(pe);
  if (sl) cudaFree(sl);
  KVFERRY_TRY(st);
  return m.pull();
}
#endif

/// Fills blocks [0, n) of every layer through write_mla: the CUDA writer into a GPU region, the
/// CPU twin into host memory.
Status fill(Mapped& m, int64_t n, uint32_t seed, std::vector<Inputs>* inputs) {
  const int64_t tokens = n * m.spec.block_size;
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) slots[static_cast<size_t>(t)] = t;  // blocks 0..n-1, every token
#if defined(KVFERRY_WITH_CUDA)
  if (m.device) {
    for (int64_t l = 0; l < m.spec.layers; ++l)
      inputs->push_back(make_inputs(tokens, seed + static_cast<uint32_t>(l) * 7919u));
    return fill_cuda(m, slots, *inputs);
  }
#endif
  for (int64_t l = 0; l < m.spec.layers; ++l) {
    inputs->push_back(make_inputs(tokens, seed + static_cast<uint32_t>(l) * 7919u));
    const Inputs& in = inputs->back();
    kernels::WriteMlaParams p;
    p.kv_c = in.kv_c.data();
    p.k_pe = in.k_pe.data();
    p.input_dtype = DType::kBF16;
    p.slots = slots.data();
    p.tokens = tokens;
    p.cache = {m.host(), m.spec.region_bytes(), m.spec.layer_view(l)};
    p.mode = mode_of(m.spec.format);
    p.scale = 1.0f;
    KVFERRY_TRY(kernels::write_mla_cpu(p, {4}).with_context("write_mla layer " + std::to_string(l)));
  }
  return m.push();
}

/// The 576 values of an entry of an MLA format (mla_fp8 with scale 1).
void decode_entry(const EntryFormat& f, const uint8_t* e, float out[576]) {
  if (f.kind == FormatKind::kMlaBf16) {
    for (int i = 0; i < 576; ++i) {
      uint16_t h;
      std::memcpy(&h, e + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
  } else if (f.kind == FormatKind::kMlaFp8) {
    for (int i = 0; i < 576; ++i) out[i] = e4m3_to_float(e[i]);
  } else {
    float s[4];
    std::memcpy(s, e + 512, sizeof s);
    for (int i = 0; i < 512; ++i) out[i] = e4m3_to_float(e[i]) * s[i / 128];
    for (int i = 0; i < 64; ++i) {
      uint16_t h;
      std::memcpy(&h, e + 528 + 2 * i, 2);
      out[512 + i] = bf16_to_float(h);
    }
  }
}

ops::Key key_of(uint32_t seed, int64_t i) {
  // Engines use a chained hash of the block's token ids; any 128-bit value works here.
  uint64_t x = (uint64_t{seed} << 32) ^ static_cast<uint64_t>(i) ^ 0x9e3779b97f4a7c15ull;
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return {mix(x), mix(x + 1)};
}

double gbps(uint64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0; }

int fail_with(const char* what, const Status& st) {
  std::fprintf(stderr, "kvferry-demo: %s: %s\n", what, st.to_string().c_str());
  return 1;
}

int run(const Args& a) {
  auto fmt = EntryFormat::parse(a.format);
  if (!fmt.ok()) return fail_with("--format", fmt.status());
  if (!fmt->is_mla()) return fail_with("--format", {ErrorCode::kInvalidArgument, "the demo writes MLA formats only"});
  // write_mla has no fp4 mode, and the checks below read entries token-interleaved, which
  // mla_fp4's per-page value and scale planes are not.
  if (fmt->kind == FormatKind::kMlaFp4)
    return fail_with("--format", {ErrorCode::kUnsupported,
                                  "the demo writes mla_bf16, mla_fp8 and mla_fp8_ds (write_mla has no mla_fp4 mode)"});
  KvCacheSpec spec{a.layers, a.blocks, a.block_size, *fmt, Layout::kBlockMajor};
  if (Status st = spec.validate(); !st.ok()) return fail_with("region shape", st);
  if (a.blocks < 2) return fail_with("--blocks", {ErrorCode::kInvalidArgument, "need at least 2 blocks"});

  Client::Options o;
  o.socket = a.socket;
  o.name = "kvferry-demo";
  o.model = a.model;
  auto client = Client::connect(o);
  if (!client.ok()) return fail_with("connect", client.status());
  Client& c = **client;
  const std::string tag = std::to_string(::getpid());
  auto reg = make_region(c, "demo-" + tag, spec);
  if (!reg.ok()) return fail_with("create region", reg.status());
  Mapped& r = *reg;
  const int64_t n = a.blocks / 2;
  const uint64_t block_bytes = static_cast<uint64_t>(spec.block_bytes());
  std::printf("region %u: %lld layers x %lld blocks x %lld tokens of %s (%s), %.1f MiB; block = %.1f KiB\n", r.id,
              static_cast<long long>(spec.layers), static_cast<long long>(spec.blocks),
              static_cast<long long>(spec.block_size), spec.format.name().c_str(), r.device ? "GPU" : "host memory",
              spec.region_bytes() / 1048576.0, block_bytes / 1024.0);

  // 1. Fill blocks [0, n) through write_mla with seeded inputs.
  std::vector<Inputs> inputs;
  if (Status st = fill(r, n, a.seed, &inputs); !st.ok()) return fail_with("fill", st);
  std::vector<uint8_t> ref(r.host(), r.host() + spec.region_bytes());  // what was written
  std::printf("wrote %lld blocks through write_mla (%s, seed %u)\n", static_cast<long long>(n),
              r.device ? "CUDA kernel" : "CPU twin", a.seed);

  std::vector<ops::Key> keys;
  std::vector<int64_t> src_ids, dst_ids;
  for (int64_t i = 0; i < n; ++i) {
    keys.push_back(key_of(a.seed, i));
    src_ids.push_back(i);
    dst_ids.push_back(n + i);  // different block ids on the way back
  }

  // 2. Save.
  auto t0 = Clock::now();
  auto sv = c.save(r.id, keys, src_ids);
  const double save_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!sv.ok()) return fail_with("save", sv.status());
  if (sv->done != n) {
    std::fprintf(stderr, "kvferry-demo: save: %u of %lld blocks saved (first failure: %s)\n", sv->done,
                 static_cast<long long>(n), std::string(error_code_name(sv->status)).c_str());
    return 1;
  }
  std::printf("saved   %lld blocks (%.1f MiB) in %.2f ms: %.2f GB/s\n", static_cast<long long>(n),
              n * block_bytes / 1048576.0, save_s * 1e3, gbps(n * block_bytes, save_s));

  // 3. Lookup: every saved key hits, unknown keys miss.
  std::vector<ops::Key> probe = keys;
  probe.push_back(key_of(a.seed + 1, 0));
  auto lk = c.lookup(r.id, probe);
  if (!lk.ok()) return fail_with("lookup", lk.status());
  if (lk->result[0] != static_cast<uint64_t>(n) || lk->done != n) {
    std::fprintf(stderr, "kvferry-demo: lookup: prefix %llu, %u hits; expected %lld\n",
                 static_cast<unsigned long long>(lk->result[0]), lk->done, static_cast<long long>(n));
    return 1;
  }
  std::printf("lookup  %zu keys: longest hit prefix %llu, 1 unknown key missed\n", probe.size(),
              static_cast<unsigned long long>(lk->result[0]));

  // 4. Overwrite the whole region, then load into blocks [n, 2n).
  std::memset(r.host(), 0xA5, static_cast<size_t>(spec.region_bytes()));
  if (Status st = r.push(); !st.ok()) return fail_with("overwrite", st);
  t0 = Clock::now();
  auto ld = c.load(r.id, keys, dst_ids);
  const double load_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!ld.ok()) return fail_with("load", ld.status());
  if (ld->done != n) {
    std::fprintf(stderr, "kvferry-demo: load: %u of %lld blocks loaded (first failure: %s)\n", ld->done,
                 static_cast<long long>(n), std::string(error_code_name(ld->status)).c_str());
    return 1;
  }
  std::printf("loaded  %lld blocks into block ids %lld..%lld in %.2f ms: %.2f GB/s\n", static_cast<long long>(n),
              static_cast<long long>(n), static_cast<long long>(2 * n - 1), load_s * 1e3,
              gbps(n * block_bytes, load_s));

  // 5. Check every byte of every page.
  if (Status st = r.pull(); !st.ok()) return fail_with("read back", st);
  int64_t bad_pages = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t l = 0; l < spec.layers; ++l)
      if (std::memcmp(r.host() + spec.page_offset(l, n + i), ref.data() + spec.page_offset(l, i),
                      static_cast<size_t>(spec.page_bytes())) != 0)
        ++bad_pages;
  if (bad_pages) {
    std::fprintf(stderr, "kvferry-demo: MISMATCH: %lld of %lld pages differ after the round trip\n",
                 static_cast<long long>(bad_pages), static_cast<long long>(n * spec.layers));
    return 1;
  }
  std::printf("checked %lld pages (%.1f MiB) byte for byte: identical\n", static_cast<long long>(n * spec.layers),
              n * block_bytes / 1048576.0);

  // 6. Load into a region of another format of the family; the daemon converts.
  if (a.convert) {
    const EntryFormat to =
        spec.format.kind == FormatKind::kMlaFp8Ds ? EntryFormat::mla_bf16() : EntryFormat::mla_fp8_ds();
    KvCacheSpec spec2{spec.layers, spec.blocks, spec.block_size, to, Layout::kBlockMajor};
    auto reg2 = make_region(c, "demo-" + tag + "-" + to.name(), spec2);
    if (!reg2.ok()) return fail_with("create the second region", reg2.status());
    Mapped& r2 = *reg2;
    t0 = Clock::now();
    auto cv = c.load(r2.id, keys, src_ids);
    const double cv_s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!cv.ok()) return fail_with("load with conversion", cv.status());
    if (cv->done != n) {
      std::fprintf(stderr, "kvferry-demo: load into %s: %u of %lld blocks (first failure: %s)\n", to.name().c_str(),
                   cv->done, static_cast<long long>(n), std::string(error_code_name(cv->status)).c_str());
      return 1;
    }
    if (Status st = r2.pull(); !st.ok()) return fail_with("read back", st);
    // Bytes: exactly what the CPU conversion of the written blocks gives.
    std::vector<uint8_t> want(static_cast<size_t>(spec2.region_bytes()), 0);
    if (Status st = kernels::convert_blocks_cpu(ref.data(), spec, src_ids, want.data(), spec2, src_ids); !st.ok())
      return fail_with("reference conversion", st);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(r2.host() + spec2.page_offset(0, i), want.data() + spec2.page_offset(0, i),
                      static_cast<size_t>(spec2.block_bytes())) != 0)
        ++bad;
    // Values: within the fp8 bound of the original bf16 inputs (e4m3 keeps 3 mantissa bits:
    // relative error <= 2^-4 per quantization, plus half the subnormal step of its scale).
    double worst = 0;
    int64_t out_of_bound = 0;
    float got[576];
    for (int64_t l = 0; l < spec.layers; ++l)
      for (int64_t t = 0; t < n * spec.block_size; ++t) {
        const int64_t b = t / spec.block_size, tok = t % spec.block_size;
        decode_entry(to, r2.host() + spec2.page_offset(l, b) + tok * to.bytes_per_token(), got);
        const uint16_t* kv = inputs[static_cast<size_t>(l)].kv_c.data() + t * 512;
        const uint16_t* pe = inputs[static_cast<size_t>(l)].k_pe.data() + t * 64;
        float amax[4] = {0, 0, 0, 0};
        for (int i = 0; i < 512; ++i) amax[i / 128] = std::max(amax[i / 128], std::fabs(bf16_to_float(kv[i])));
        for (int i = 0; i < 576; ++i) {
          const float x = i < 512 ? bf16_to_float(kv[i]) : bf16_to_float(pe[i - 512]);
          // Per e4m3 quantization with scale s: |err| <= 2^-4 |x| + s * 2^-10 (half the subnormal
          // step). mla_fp8 is written with scale 1; 656 nope tiles use amax / 448.
          const double src_abs = spec.format.kind == FormatKind::kMlaFp8 ? std::ldexp(1.0, -10) : 0.0;
          const double tile = i < 512 ? amax[i / 128] / 448.0 : 0.0;
          const double bound = 0.13 * std::fabs(x) + src_abs + tile * std::ldexp(1.0, -9) + 1e-7;
          const double err = std::fabs(static_cast<double>(got[i]) - x);
          worst = std::max(worst, err / bound);
          if (!(err <= bound)) ++out_of_bound;
        }
      }
    if (bad || out_of_bound) {
      std::fprintf(stderr,
                   "kvferry-demo: MISMATCH after conversion to %s: %lld blocks differ from the CPU "
                   "conversion, %lld values outside the fp8 bound\n",
                   to.name().c_str(), static_cast<long long>(bad), static_cast<long long>(out_of_bound));
      return 1;
    }
    std::printf("loaded  %lld blocks into a %s region (converted by the daemon) in %.2f ms: %.2f GB/s\n",
                static_cast<long long>(n), to.name().c_str(), cv_s * 1e3, gbps(n * block_bytes, cv_s));
    std::printf(
        "checked the converted blocks: identical to the CPU conversion, values within the fp8 bound "
        "(worst error %.2f of the bound)\n",
        worst);
  }

  // 7. Leave the pool as found unless asked to keep the blocks.
  if (!a.keep) {
    auto ev = c.evict(r.id, keys);
    if (ev.ok()) std::printf("evicted %llu blocks\n", static_cast<unsigned long long>(ev->result[0]));
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvferry-demo: save, wipe, load back and check KV blocks through kvferryd"};
  Args a;
  app.add_option("--socket", a.socket, "daemon control socket (default: $KVFERRY_SOCKET or /run/kvferry/kvferry.sock)");
  app.add_option("--model", a.model, "namespace model");
  app.add_option("--layers", a.layers, "layers of the region")->check(CLI::Range(1, 128));
  app.add_option("--blocks", a.blocks, "blocks of the region (half are saved and loaded into the other half)")
      ->check(CLI::Range(2, 1 << 16));
  app.add_option("--block-size", a.block_size, "tokens per block")->check(CLI::Range(1, 1024));
  app.add_option("--format", a.format, "mla_fp8_ds | mla_bf16 | mla_fp8");
  app.add_option("--seed", a.seed, "seed of the written data");
  app.add_flag("!--no-convert", a.convert, "skip the load into a region of another format");
  app.add_flag("--keep", a.keep, "leave the saved blocks in the daemon (for kvferry ls)");
  CLI11_PARSE(app, argc, argv);
  return run(a);
}
