#pragma once
// Shapes of the mma.sync kernel for fp8 caches (mma_sync_fp8.cu) that the host-side split
// search (cpu.cpp, compiled without CUDA) needs: its shared memory and CTAs per SM.
#include "kvferry/layouts/entry_format.h"

#if defined(__CUDACC__)
#define KVFERRY_MLA_HD __host__ __device__
#else
#define KVFERRY_MLA_HD
#endif

namespace kvferry::mla_detail {

constexpr int kFp8TileN = 32;                      // tokens per K tile
constexpr int kFp8QGroupBytes = 16 * kMlaDim * 2;  // Q of 16 heads in mma fragment order (18 KiB)
constexpr int kFp8QOff = 512;                      // [0, 64): mbarriers; [64, 320): per-head row scales
// Shared-memory pitch of a raw entry: 656 (mla_fp8_ds) or 576 + 16 = 592 (mla_fp8), 16 and 80 mod
// 128, so the 8 rows of an ldmatrix fall in 8 different 16-byte bank groups.
KVFERRY_MLA_HD constexpr int kFp8RawPitch(bool ds) { return ds ? kMlaDsBytes : kMlaFp8Bytes + 16; }

/// Raw tile stages for a CTA of `hb` heads: two, so three 16-head CTAs fit on an SM (measured on an
/// H200, mla_fp8 at 16 heads: 81 us with 2 stages and 3 CTAs per SM, 83 with 3 and 84 with 4
/// stages at 2 CTAs per SM); 4 for 64 heads (one CTA per SM either way).
KVFERRY_MLA_HD constexpr int fp8_stages(int hb) { return hb == 64 ? 4 : 2; }
/// A head group's S exchange: the four warps' S partials (8 KiB), the fp16 P tile (1 KiB) and
/// one float per row and warp (256 B).
constexpr int kFp8XPartBytes = 4 * 4 * 32 * 16;
constexpr int kFp8XPBytes = 2 * 32 * 16;
constexpr int kFp8GroupXBytes = kFp8XPartBytes + kFp8XPBytes + 16 * 4 * 4;
KVFERRY_MLA_HD constexpr int fp8_smem_bytes(bool ds, int hb, int stages) {
  return kFp8QOff + hb / 16 * (kFp8QGroupBytes + kFp8GroupXBytes) + stages * kFp8TileN * kFp8RawPitch(ds);
}
/// CTAs of `hb` heads that fit on one SM (228 KiB of shared memory, 1 KiB reserved per CTA).
KVFERRY_MLA_HD constexpr int fp8_ctas_per_sm(bool ds, int hb, int stages) {
  const int by_smem = 228 * 1024 / (fp8_smem_bytes(ds, hb, stages) + 1024);
  const int by_threads = 2048 / (hb * 8 + 32);  // four warps per 16 heads and a producer warp
  // Registers: the consumer warps keep 64 fp32 accumulators and need ~128 registers; more CTAs
  // than 65536 / (threads * 136) would spill.
  const int by_regs = 65536 / ((hb * 8 + 32) * 136);
  const int n = by_smem < by_threads ? by_smem : by_threads;
  return n < by_regs ? n : (by_regs > 0 ? by_regs : 1);
}

}  // namespace kvferry::mla_detail
