// `kvferry layout`: prints how a KV cache spec maps to bytes (per-layer views, a block's byte
// runs, coalesced runs), the same arithmetic the daemon and the kernels use.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "kvferry/layouts/layouts.h"

namespace kvferry::cli {
namespace {

struct LayoutArgs {
  int64_t layers = 61;
  int64_t blocks = 1024;
  int64_t block_size = 64;
  std::string format = "mla_fp8_ds";
  std::string layout = "block_major";
  std::vector<int64_t> sample = {0, 1, 2, 5, 6, 7};
};

int run_layout(const LayoutArgs& a) {
  auto fmt = EntryFormat::parse(a.format);
  if (!fmt.ok()) {
    std::fprintf(stderr, "kvferry layout: %s\n", fmt.status().to_string().c_str());
    return 2;
  }
  KvCacheSpec spec{a.layers, a.blocks, a.block_size, *fmt,
                   a.layout == "layer_major" ? Layout::kLayerMajor : Layout::kBlockMajor};
  if (a.layout != "block_major" && a.layout != "layer_major") {
    std::fprintf(stderr, "kvferry layout: --layout must be block_major or layer_major, not '%s'\n", a.layout.c_str());
    return 2;
  }
  if (Status st = spec.validate(); !st.ok()) {
    std::fprintf(stderr, "kvferry layout: %s\n", st.to_string().c_str());
    return 2;
  }
  std::printf("spec: %lld layers x %lld blocks x %lld tokens of %s, %s\n", static_cast<long long>(spec.layers),
              static_cast<long long>(spec.blocks), static_cast<long long>(spec.block_size), fmt->name().c_str(),
              a.layout.c_str());
  std::printf("  bytes/token/layer %lld, page %lld B, block (all layers) %lld B, region %lld B (%.2f GiB)\n",
              static_cast<long long>(fmt->bytes_per_token()), static_cast<long long>(spec.page_bytes()),
              static_cast<long long>(spec.block_bytes()), static_cast<long long>(spec.region_bytes()),
              static_cast<double>(spec.region_bytes()) / (1 << 30));
  const int64_t picks[3] = {0, spec.layers / 2, spec.layers - 1};
  for (int i = 0; i < 3; ++i) {
    if (i > 0 && picks[i] == picks[i - 1]) continue;
    const int64_t l = picks[i];
    if (fmt->kind == FormatKind::kMha) {
      std::printf("  layer %-3lld K %s\n            V %s\n", static_cast<long long>(l),
                  spec.kv_view(l, false).to_string().c_str(), spec.kv_view(l, true).to_string().c_str());
    } else if (fmt->kind == FormatKind::kMlaFp4) {
      // A page holds two planes, not 324-byte entries: the entry view would mislead.
      std::printf("  layer %-3lld values %s\n            scales %s\n", static_cast<long long>(l),
                  spec.mla_fp4_values_view(l).to_string().c_str(), spec.mla_fp4_scales_view(l).to_string().c_str());
    } else {
      std::printf("  layer %-3lld view %s\n", static_cast<long long>(l), spec.layer_view(l).to_string().c_str());
    }
  }
  if (spec.blocks > 0) {
    auto runs = spec.block_runs(spec.blocks - 1);
    std::printf("  last block: %zu byte run(s), first {offset %lld, %lld B}\n", runs->size(),
                static_cast<long long>(runs->front().offset), static_cast<long long>(runs->front().bytes));
  }
  std::vector<int64_t> sample;
  for (int64_t b : a.sample)
    if (b < spec.blocks) sample.push_back(b);
  auto co = spec.coalesce(sample);
  if (!co.ok()) {
    std::fprintf(stderr, "kvferry layout: %s\n", co.status().to_string().c_str());
    return 2;
  }
  std::printf("  blocks {");
  for (size_t i = 0; i < sample.size(); ++i) std::printf("%s%lld", i ? "," : "", static_cast<long long>(sample[i]));
  std::printf("} coalesce to %zu run(s):", co->size());
  for (const ByteRun& r : *co)
    std::printf(" {%lld, %lld}", static_cast<long long>(r.offset), static_cast<long long>(r.bytes));
  std::printf("\n");
  return 0;
}

}  // namespace

void add_layout_command(CLI::App& app, std::function<int()>* run) {
  auto args = std::make_shared<LayoutArgs>();  // the app and the run callback share it
  CLI::App* sub = app.add_subcommand("layout", "print how a KV cache spec maps to bytes (no daemon needed)");
  sub->add_option("--layers", args->layers, "attention layers sharing the allocation")->capture_default_str();
  sub->add_option("--blocks", args->blocks, "blocks (pages) in the region")->capture_default_str();
  sub->add_option("--block-size", args->block_size, "tokens per block")->capture_default_str();
  sub->add_option(
         "--format", args->format,
         "mla_bf16 | mla_fp8 | mla_fp8_ds | mla_fp4 | indexer_fp8 | mha:DTYPE:HxD[:nhd|:hnd][:slice=FIRST/TOTAL]")
      ->capture_default_str();
  sub->add_option("--layout", args->layout, "block_major | layer_major")->capture_default_str();
  sub->add_option("--sample", args->sample, "block ids to coalesce")->expected(1, -1);
  sub->callback([args, run] { *run = [args] { return run_layout(*args); }; });
}

}  // namespace kvferry::cli
