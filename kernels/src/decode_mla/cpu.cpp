// CPU implementation of the MLA paged decode (the CUDA kernels' twin; contract in decode_mla.h),
// the request-boundary validation shared with the CUDA launcher (launch.cu), and the choices of
// kernel and split count that launcher makes (built without CUDA too).
#include "kvferry/kernels/decode_mla.h"

#include "decode_mla/mma_sync_fp8_shape.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvferry/layouts/dtype.h"

namespace kvferry {
namespace {

Status bad(const std::string& m) { return {ErrorCode::kInvalidArgument, "decode_mla: " + m}; }

// One token's 576 dequantized values (the contract of decode_mla.h), in float64 (exact for every format).
void load_entry(const DecodeMlaParams& p, const uint8_t* e, double* k) {
  switch (p.format.kind) {
    case FormatKind::kMlaBf16:
      for (int d = 0; d < kMlaDim; ++d) {
        uint16_t h;
        std::memcpy(&h, e + 2 * d, 2);
        k[d] = bf16_to_float(h);
      }
      break;
    case FormatKind::kMlaFp8:
      for (int d = 0; d < kMlaDim; ++d) k[d] = e4m3_to_float(e[d]);  // k_scale applied by the caller
      break;
    case FormatKind::kMlaFp8Ds: {
      float s[kMlaTiles];
      std::memcpy(s, e + kMlaDsScaleOffset, sizeof s);
      for (int d = 0; d < kMlaRank; ++d) k[d] = static_cast<double>(e4m3_to_float(e[d])) * s[d / kMlaTile];
      for (int i = 0; i < kMlaRope; ++i) {
        uint16_t h;
        std::memcpy(&h, e + kMlaDsRopeOffset + 2 * i, 2);
        k[kMlaRank + i] = bf16_to_float(h);
      }
      break;
    }
    default: break;
  }
}

// fp8_math: a Q row as the e4m3 products see it (decode_mla.h), times 2^e undone: each value times
// 2^e rounded to e4m3, e putting the largest magnitude in [128, 256) (as the GPU's exp_above).
void round_q_e4m3(const uint16_t* q, double* out) {
  float amax = 0.0f;
  for (int d = 0; d < kMlaDim; ++d) amax = std::max(amax, std::fabs(bf16_to_float(q[d])));
  int ex = -125;  // the smallest x with amax < 2^x; zero and subnormals: -125
  if (std::isnormal(amax)) std::frexp(amax, &ex);
  const int e = std::clamp(8 - ex, -126, 126);
  for (int d = 0; d < kMlaDim; ++d)
    out[d] = std::ldexp(static_cast<double>(e4m3_to_float(float_to_e4m3(std::ldexp(bf16_to_float(q[d]), e)))), -e);
}

}  // namespace

Status validate_decode_mla(const DecodeMlaParams& p) {
  const EntryFormat& f = p.format;
  switch (f.kind) {
    case FormatKind::kMlaBf16:
    case FormatKind::kMlaFp8:
    case FormatKind::kMlaFp8Ds: break;
    case FormatKind::kMlaFp4:
      // An MLA format, but no decode kernel reads e2m1 values with their separate scale plane.
      return {ErrorCode::kUnsupported, "decode_mla: format " + f.name() +
                                           " is not supported (the decode reads mla_bf16, mla_fp8 and mla_fp8_ds "
                                           "caches; convert mla_fp4 pages to one of those first)"};
    default: return bad("format " + f.name() + " is not one of mla_bf16, mla_fp8, mla_fp8_ds");
  }
  const TensorView& c = p.cache;
  if (c.rank != 3) return bad("cache view " + c.to_string() + " must have rank 3 (blocks, page, entry)");
  if (c.dtype != f.dtype)
    return bad("cache view dtype " + std::string(dtype_name(c.dtype)) + " does not match format " + f.name() + " (" +
               std::string(dtype_name(f.dtype)) + ")");
  if (c.size(2) != f.entry_elems())
    return bad("cache view " + c.to_string() + " has " + std::to_string(c.size(2)) + " elements per entry, " +
               f.name() + " needs " + std::to_string(f.entry_elems()));
  if (c.size(1) < 1) return bad("page size (cache size(1)) must be >= 1");
  const int64_t eb = c.elem_bytes();
  if (c.stride(2) != 1) return bad("cache stride(2) = " + std::to_string(c.stride(2)) + " must be 1");
  if (c.stride(1) < c.size(2))
    return bad("cache stride(1) = " + std::to_string(c.stride(1)) + " is shorter than an entry (" +
               std::to_string(c.size(2)) + ")");
  if (c.size(0) > 1 && c.stride(0) < c.size(1) * c.stride(1))
    return bad("cache stride(0) = " + std::to_string(c.stride(0)) + " overlaps the pages of " + c.to_string());
  if ((c.stride(1) * eb) % 16 != 0 || (c.stride(0) * eb) % 16 != 0 || c.offset % 16 != 0)
    return bad("cache view " + c.to_string() + " rows, blocks and offset must be 16-byte aligned");
  if (p.cache_base == nullptr && c.size(0) > 0) return bad("cache_base is null");
  if (reinterpret_cast<uintptr_t>(p.cache_base) % 16 != 0) return bad("cache_base is not 16-byte aligned");
  KVFERRY_TRY(c.validate(p.region_bytes, 16).with_context("decode_mla: cache view"));
  if (p.batch < 0 || p.batch > 65535) return bad("batch = " + std::to_string(p.batch) + " is outside [0, 65535]");
  if (p.heads != 16 && p.heads != 32 && p.heads != 64 && p.heads != 128)
    return bad("heads = " + std::to_string(p.heads) + " must be one of 16, 32, 64, 128");
  if (!std::isfinite(p.sm_scale) || p.sm_scale <= 0) return bad("sm_scale must be finite and > 0");
  if (!std::isfinite(p.k_scale) || p.k_scale <= 0) return bad("k_scale must be finite and > 0");
  if (f.kind != FormatKind::kMlaFp8 && p.k_scale != 1.0f)
    return bad("k_scale = " + std::to_string(p.k_scale) + " but only mla_fp8 has a per-tensor scale (must be 1)");
  if (p.block_table_stride < 0) return bad("block_table_stride is negative");
  if (p.loader < 0 || p.loader > 2) return bad("loader = " + std::to_string(p.loader) + " is not 0, 1 or 2");
  if (p.group_warps != 0 && p.group_warps != 2 && p.group_warps != 4)
    return bad("group_warps = " + std::to_string(p.group_warps) + " is not 0, 2 or 4");
  if (p.mma < 0 || p.mma > 2) return bad("mma = " + std::to_string(p.mma) + " is not 0, 1 or 2");
  if (p.fp8_math != 0 && p.fp8_math != 1) return bad("fp8_math = " + std::to_string(p.fp8_math) + " is not 0 or 1");
  if (p.wgmma_kernel < 0 || p.wgmma_kernel > 2)
    return bad("wgmma_kernel = " + std::to_string(p.wgmma_kernel) + " is not 0, 1 or 2");
  if (p.seesaw_loader < 0 || p.seesaw_loader > 2)
    return bad("seesaw_loader = " + std::to_string(p.seesaw_loader) + " is not 0, 1 or 2");
  if (p.conv_rows < 0 || p.conv_rows > 32)
    return bad("conv_rows = " + std::to_string(p.conv_rows) + " is not in [0, 32]");
  if (p.fp8_math == 1 && f.kind != FormatKind::kMlaFp8)
    return bad("fp8_math = 1 applies to mla_fp8 caches only, not " + f.name());
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) return bad("workspace is not 16-byte aligned");
  if (p.num_splits < 0 || p.num_splits > kDecodeMlaMaxSplits)
    return bad("num_splits = " + std::to_string(p.num_splits) + " is outside [0, " +
               std::to_string(kDecodeMlaMaxSplits) + "]");
  if (p.batch > 0) {
    if (p.q == nullptr) return bad("q is null");
    if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0) return bad("q is not 16-byte aligned");
    if (p.o == nullptr) return bad("o is null");
    // The GPU kernels write o, and their fp32 partials in the workspace, by 16-byte stores.
    if (reinterpret_cast<uintptr_t>(p.o) % 16 != 0) return bad("o is not 16-byte aligned");
    if (p.lse == nullptr) return bad("lse is null");
    if (p.seq_lens == nullptr) return bad("seq_lens is null");
    if (p.block_table == nullptr && p.block_table_stride > 0) return bad("block_table is null");
  }
  return Status::Ok();
}

Status validate_decode_mla_tables(const DecodeMlaParams& p) {
  KVFERRY_TRY(validate_decode_mla(p));
  const int64_t page = p.cache.size(1);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int64_t n = p.seq_lens[b];
    if (n < 0 || n > p.block_table_stride * page)
      return bad("seq_lens[" + std::to_string(b) + "] = " + std::to_string(n) + " is outside [0, " +
                 std::to_string(p.block_table_stride * page) + "]");
    for (int64_t i = 0; i < (n + page - 1) / page; ++i) {
      const int32_t blk = p.block_table[b * p.block_table_stride + i];
      if (blk < 0 || blk >= p.cache.size(0))
        return bad("block_table[" + std::to_string(b) + "][" + std::to_string(i) + "] = " + std::to_string(blk) +
                   " is outside [0, " + std::to_string(p.cache.size(0)) + ")");
    }
  }
  return Status::Ok();
}

Status decode_mla_cpu(const DecodeMlaParams& p) {
  KVFERRY_TRY(validate_decode_mla_tables(p));
  const auto* base = static_cast<const uint8_t*>(p.cache_base);
  const TensorView& c = p.cache;
  const int64_t eb = c.elem_bytes(), page = c.size(1);
  const bool fp8 = p.format.kind == FormatKind::kMlaFp8;
  const double vscale = fp8 ? p.k_scale : 1.0;
  const double xscale = static_cast<double>(p.sm_scale) * vscale;
  const bool f8 = fp8 && p.fp8_math == 1;  // e4m3 Q and P (decode_mla.h)
  std::vector<double> k, x, acc(kMlaRank), qd(kMlaDim);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int64_t n = p.seq_lens[b];
    k.assign(static_cast<size_t>(n) * kMlaDim, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t blk = p.block_table[b * p.block_table_stride + j / page];
      const uint8_t* e = base + c.offset + blk * c.stride(0) * eb + (j % page) * c.stride(1) * eb;
      load_entry(p, e, &k[static_cast<size_t>(j) * kMlaDim]);
    }
    x.assign(static_cast<size_t>(n), 0.0);
    for (int32_t h = 0; h < p.heads; ++h) {
      const uint16_t* q = p.q + (static_cast<int64_t>(b) * p.heads + h) * kMlaDim;
      uint16_t* o = p.o + (static_cast<int64_t>(b) * p.heads + h) * kMlaRank;
      float* lse = p.lse + static_cast<int64_t>(b) * p.heads + h;
      if (n == 0) {
        std::fill(o, o + kMlaRank, uint16_t{0});
        *lse = -std::numeric_limits<float>::infinity();
        continue;
      }
      if (f8)
        round_q_e4m3(q, qd.data());
      else
        for (int d = 0; d < kMlaDim; ++d) qd[d] = bf16_to_float(q[d]);
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const double* kj = &k[static_cast<size_t>(j) * kMlaDim];
        double s = 0;
        for (int d = 0; d < kMlaDim; ++d) s += qd[d] * kj[d];
        x[j] = s * xscale;
        m = std::max(m, x[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      if (f8) {
        // Log2 units against the integer reference R = ceil(max) - 8 (P at most 2^8); P rounded
        // to e4m3; o divided by the sum of the rounded P, the lse taken from the sum of the unrounded.
        constexpr double kLog2e = 1.4426950408889634;
        const double ref = std::ceil(m * kLog2e) - 8;
        double l = 0, lr = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double w = std::exp2(x[j] * kLog2e - ref);
          l += w;
          const double pw = e4m3_to_float(float_to_e4m3(static_cast<float>(w)));
          lr += pw;
          const double* kj = &k[static_cast<size_t>(j) * kMlaDim];
          for (int d = 0; d < kMlaRank; ++d) acc[d] += pw * kj[d];
        }
        for (int d = 0; d < kMlaRank; ++d) o[d] = float_to_bf16(static_cast<float>(acc[d] / lr * vscale));
        *lse = static_cast<float>((ref + std::log2(l)) / kLog2e);
        continue;
      }
      double l = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double w = std::exp(x[j] - m);
        l += w;
        const double* kj = &k[static_cast<size_t>(j) * kMlaDim];
        for (int d = 0; d < kMlaRank; ++d) acc[d] += w * kj[d];
      }
      for (int d = 0; d < kMlaRank; ++d) o[d] = float_to_bf16(static_cast<float>(acc[d] / l * vscale));
      *lse = static_cast<float>(m + std::log(l));
    }
  }
  return Status::Ok();
}

size_t decode_mla_workspace_bytes(int32_t batch, int32_t heads, int32_t num_splits) {
  if (num_splits <= 1 || batch <= 0) return 0;
  // o partials [batch, splits, heads, 512] then lse partials [batch, splits, heads], fp32.
  return static_cast<size_t>(batch) * num_splits * heads * (kMlaRank + 1) * sizeof(float);
}

int32_t decode_mla_resolved_loader(const DecodeMlaParams& p) {
  if (p.loader == 1 || p.loader == 2) return p.loader;
  // Measured on an H200 (batch 64, 4096 tokens, bf16 cache): bulk copies win where the kernel
  // waits on memory (16 heads: 95 vs 106 us); at 128 heads, where it is compute-bound, cp.async
  // was faster (407 vs 486 us). (fp8 caches run their own kernel, always with bulk copies.)
  return p.heads <= 32 ? 1 : 2;
}

int32_t decode_mla_resolved_group_warps(const DecodeMlaParams& p) {
  if (p.group_warps == 2 || p.group_warps == 4) return p.group_warps;
  // Measured on an H200 (batch 64, 4096 tokens, page 64, bf16 cache), four vs two warps per 16
  // heads: 105 vs 95 us at 16 heads, 507 vs 407 at 128, where the 16 warps of a 64-head CTA run in
  // lockstep and the shorter mma chains expose more latency. (fp8 caches run their own kernel.)
  return 2;
}

int32_t decode_mla_resolved_mma(const DecodeMlaParams& p) {
  if (p.mma == 1 || p.mma == 2) return p.mma;
  // Measured (batch 64, 4096 tokens, page 64; kvferry-bench decode with KVFERRY_BENCH_HEADS),
  // wgmma (seesaw kernel, fewer than 64 heads padded to 64 rows) vs mma.sync, contiguous cache:
  //   H100:  bf16     16 heads 117 vs 126 us, 32: 119 vs 192, 64: 131 vs 214
  //          mla_fp8  16 heads 109 vs 78,     32: 111 vs 115, 64: 115 vs 171
  //          fp8_ds   16 heads 115 vs 83,     32: 115 vs 119, 64: 124 vs 177
  //   H200:  bf16 16 heads 88.4-89.1 vs 95.0-95.3, 32: 92 vs 190; mla_fp8 32 heads 105 vs 116;
  //          fp8_ds 32 heads 114 vs 118; 128 heads mla_fp8 187 vs 302, fp8_ds 200 vs 322.
  // The same order at 512, 1024 and 16384 tokens, with two small exceptions up to 1024 tokens:
  // mla_fp8_ds at 32 heads on an H100 (wgmma 1-5 % slower, where mla_fp8 still gains) and bf16 at
  // 16 heads on an H200 (1.5-3 % slower, against 7 % faster at 4096 tokens). So wgmma, except for the fp8 caches at
  // 16 heads (their mma.sync kernel reads the cache once for 16 heads with no padded rows).
  // mla_fp8 and mla_fp8_ds must take the same kernel, or a requantized cache would not give the
  // same bits.
  return p.format.kind == FormatKind::kMlaBf16 || p.heads >= 32 ? 2 : 1;
}

int32_t decode_mla_auto_splits(const DecodeMlaParams& p, int sm_count) {
  if (p.num_splits > 0) return p.num_splits;
  if (p.batch <= 0 || sm_count <= 0) return 1;
  const int hb = p.heads > 64 ? 64 : p.heads;  // heads per CTA
  const int groups = p.heads / hb;
  int per_sm = 1;  // wgmma: one CTA per SM (~200-220 KiB of shared memory: Q, K tile stages, S exchange)
  if (decode_mla_resolved_mma(p) != 2 && p.format.kind != FormatKind::kMlaBf16) {
    // The fp8 kernel (mma_sync_fp8.cu): its shared memory, threads and registers.
    const bool ds = p.format.kind == FormatKind::kMlaFp8Ds;
    per_sm = std::max(1, mla_detail::fp8_ctas_per_sm(ds, hb, mla_detail::fp8_stages(hb)));
  } else if (decode_mla_resolved_mma(p) != 2) {
    // The bf16 kernel (mma_sync_bf16.cu): 128 registers per thread with four warps per 16 heads, ~240
    // with two, and its shared memory (Q rows, two K tile stages, S exchange of NW * 2 KiB per 16
    // heads; 228 KiB per SM).
    const int nw = decode_mla_resolved_group_warps(p);
    const int row = (kMlaDim + 8) * 2, tile = 32 * row;
    const int smem = 16 + hb * row + 2 * tile + hb / 16 * nw * 2048;
    const int regs = hb / 16 * nw * 32 * (nw == 4 ? 128 : 240);
    per_sm = std::max(1, std::min(65536 / regs, 228 * 1024 / (smem + 1024)));
  }
  const int64_t slots = static_cast<int64_t>(sm_count) * per_sm;
  const int64_t max_tokens = p.block_table_stride * std::max<int64_t>(p.cache.size(1), 1);
  // Each split should keep at least 4 tiles of 32 tokens, or the merge costs more than it gains.
  const int64_t cap = std::clamp<int64_t>(max_tokens / 128, 1, kDecodeMlaMaxSplits);
  int32_t best = 1;
  double best_cost = 1e30;
  for (int32_t s = 1; s <= cap; ++s) {
    const int64_t ctas = static_cast<int64_t>(p.batch) * groups * s;
    const int64_t whole_waves = (ctas + slots - 1) / slots;
    const double waves = static_cast<double>(whole_waves);
    const double cost = waves / s + 0.01 * s;  // wave time falls as 1/s; each split adds merge work
    if (cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

}  // namespace kvferry
