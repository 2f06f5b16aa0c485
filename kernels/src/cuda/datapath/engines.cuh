#pragma once
// The three engines of the data-path CUDA kernels, the loops each kernel hands its index, load and
// store steps to (kernels/DESIGN.md §2.1): "direct" kernels keep a warp's next item in registers
// (data loads one item ahead, index loads two, pipeline()); "staged" kernels stream items through
// a per-warp ring of shared-memory stages filled by cp.async (staged()); "bulk" kernels (sm_90,
// the conversions) stream units of a block's entries through a per-CTA ring filled by bulk copies
// (bulk_units()). Grids are one resident wave looping grid-stride (grid_for; the bulk kernels:
// grid-stride over units, or one range of units per CTA on a whole layer view); every entry is
// addressed through the view's strides in 64-bit (CacheRef::entry). Which engine a launcher runs
// is engine_select.h's. Private to kernels/src.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/mbarrier.cuh"
#include "cuda/datapath/primitives.cuh"

namespace kvferry::kernels::detail {

// ---- launching: one resident wave, looping grid-stride ----

/// min(want, the device's SMs x per_sm), at least 1: the blocks of one resident wave.
inline unsigned one_wave(int64_t want, int per_sm) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t cap = static_cast<int64_t>(sms) * per_sm;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

/// Blocks for `items` work items handled `per_warp` at a time: at most one full wave of the
/// kernel's resident blocks (occupancy query, cached per kernel; at most `max_per_sm` per SM where
/// that is set), which then loop grid-stride, so no partial last wave leaves SMs idle while the
/// others drain.
template <auto kKernel>
unsigned grid_for(int64_t items, int64_t per_warp, int max_per_sm = 0) {
  static const int per_sm = [] {
    // Kernels that stage through shared memory want all of it (the L1 share shrinks).
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kKernel) == cudaSuccess && fa.sharedSizeBytes > 0)
      (void)cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0) != cudaSuccess || b < 1) b = 1;
    return b;
  }();
  const int64_t warps = (items + per_warp - 1) / per_warp;
  return one_wave((warps + kWarps - 1) / kWarps, max_per_sm > 0 && max_per_sm < per_sm ? max_per_sm : per_sm);
}

/// Launches kernel kK over `items` work items, `per_warp` per warp and trip.
template <auto kK, class P>
cudaError_t go(const P& p, int64_t items, int64_t per_warp, cudaStream_t stream, int max_per_sm = 0) {
  kK<<<grid_for<kK>(items, per_warp, max_per_sm), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// ---- direct engine (pipeline): a warp takes one work item (a few entries) per trip, grid-stride
// over one resident wave. Index loads (slots, block tables, block lists) run two trips ahead and
// data loads one trip ahead, so while a warp converts and stores one item, the next item's bytes
// are already in flight: a warp that spends most of its time on arithmetic still keeps memory
// busy. Source rows indexed by token never wait for the slot. ----

/// index(i) issues item i's index loads (an empty result past the end), load(i, idx) its data
/// loads, store(i, idx, data) converts and writes it. index is called exactly once per item of the
/// warp's, in order, and then for the two items after its last (past the end), so it may keep state
/// that advances by one grid stride per call (EntryWalk).
template <class Index, class Load, class Store>
__device__ __forceinline__ void pipeline(int64_t items, Index index, Load load, Store store) {
  const int64_t step = total_warps();
  int64_t i = global_warp();
  if (i >= items) return;
  auto ic = index(i);
  auto in1 = index(i + step);
  auto dc = load(i, ic);
  for (; i < items; i += step) {
    auto dn = load(i + step, in1);
    auto in2 = index(i + 2 * step);
    store(i, ic, dc);
    ic = in1;
    in1 = in2;
    dc = dn;
  }
}

// ---- staged engine: each warp streams its items through a ring of kStages shared-memory stages
// with cp.async, kStages - 1 items ahead, so bytes in flight no longer cost registers; it then
// converts from shared memory and stores. Index loads (where a source address needs one) run one
// trip further ahead in registers. Stage buffers are 16-byte aligned; a stage may start with a
// header (slots, destination pointers) that process() reads back. ----

constexpr int kStages = 4;

/// index(i) -> the item's index data (loads issued a trip before fetch needs them; past the end
/// it must describe an empty item), fetch(i, stage, idx) issues its cp.async (none past the end),
/// process(i, stage) converts and stores it.
/// kSt: the ring's stages (kSt - 1 items in flight ahead of the one processed).
template <int kSt = kStages, class Index, class Fetch, class Process>
__device__ __forceinline__ void staged(int64_t items, Index index, Fetch fetch, Process process) {
  const int64_t step = total_warps();
  const int64_t i0 = global_warp();
  if (i0 >= items) return;
#pragma unroll
  for (int k = 0; k < kSt - 1; ++k) {
    fetch(i0 + k * step, k, index(i0 + k * step));
    cp_commit();
  }
  auto pend = index(i0 + (kSt - 1) * step);
  int stage = 0;
  for (int64_t i = i0; i < items; i += step) {
    const int ahead = stage == 0 ? kSt - 1 : stage - 1;
    fetch(i + (kSt - 1) * step, ahead, pend);
    cp_commit();
    pend = index(i + kSt * step);
    cp_wait<kSt - 1>();
    __syncwarp();
    process(i, stage);
    __syncwarp();
    stage = stage + 1 == kSt ? 0 : stage + 1;
  }
  cp_wait<0>();
}

struct NoIndex {};

/// The warp's ring: kSt stages of kBytes.
template <int kSt, int kBytes>
__device__ __forceinline__ uint8_t* ring_stage(uint8_t (*ring)[kSt][kBytes], int stage) {
  return ring[threadIdx.x >> 5][stage];
}

// ---- bulk engine (sm_90): each CTA streams units (a run of one block's entries, contiguous in
// memory) through a ring of shared-memory stages, each filled by one bulk copy (the TMA engine:
// one instruction a unit, completion counted in bytes on the stage's full barrier, nothing in the
// warps' instruction stream); the warps then convert from shared memory. Warp 0 also refills: at
// unit k it refills the stage of unit k - 1 once every warp has released it (the stage's empty
// barrier), before its own share of unit k with two stages, after it with more. Not used for
// write_mla (its input is contiguous too): that kernel is issue-bound, and the barriers' waits add
// instructions (kernels/DESIGN.md §2.2). ----

using ptx::mbar_arrive;
using ptx::mbar_expect_tx;
using ptx::mbar_fence_init;
using ptx::mbar_init;
using ptx::mbar_wait;

/// CTA c takes units c, c + grid, c + 2 grid, ..., or with `ranges` the units
/// [units * c / grid, units * (c + 1) / grid) in order. issue(unit, stage, full_bar, lane): called by
/// all of warp 0; it arms full_bar with the unit's bytes (mbar_expect_tx) before its copies can
/// land. process(unit, k, stage, warp, lane) converts and stores the warp's share of the unit (k:
/// the CTA's unit count so far). bars: 2 kSt mbarriers.
template <int kStageBytes, int kSt, class Issue, class Process>
__device__ __forceinline__ void bulk_units(int64_t units, uint8_t (*ring)[kStageBytes], uint64_t* bars, Issue issue,
                                           Process process, bool ranges = false) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * kSt;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kSt; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, blockDim.x >> 5);
    }
    mbar_fence_init();
  }
  __syncthreads();
  // The CTA's units: every gridDim-th from its own index (the grid sweeps the units in order, so
  // at any moment the CTAs work on neighbouring ones), or with `ranges` one range of consecutive
  // units per CTA (kernels/DESIGN.md §2.3: what each costs on which views).
  const int64_t step = ranges ? 1 : gridDim.x;
  int64_t u = ranges ? units * blockIdx.x / gridDim.x : blockIdx.x;
  if (ranges) units = units * (blockIdx.x + 1) / gridDim.x;
  // Where warp 0 refills: with two stages, before its share of unit k (the refill is unit k + 1,
  // needed as soon as unit k is done); with three or more, after it, so that warp 0 does not wait
  // on the empty barrier (the slowest warp of unit k - 1) before its own work at every unit: faster
  // for the issue-bound bf16 -> 656 (three stages), slower for two-stage rings (kernels/DESIGN.md
  // §2.3).
  constexpr bool kLateRefill = kSt >= 3;
  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < kSt; ++s)
      if (u + s * step < units) issue(u + s * step, smem_addr(ring[s]), full0 + 8 * s, lane);
  }
  for (int64_t k = 0; u < units; u += step, ++k) {
    const int s = static_cast<int>(k % kSt);
    auto refill = [&] {
      if (warp == 0 && k > 0) {
        const int ps = s == 0 ? kSt - 1 : s - 1;  // the stage of unit k - 1
        const int64_t v = u + (kSt - 1) * step;
        if (v < units) {
          mbar_wait(empty0 + 8 * ps, static_cast<uint32_t>(((k - 1) / kSt) & 1));
          issue(v, smem_addr(ring[ps]), full0 + 8 * ps, lane);
        }
      }
    };
    if constexpr (!kLateRefill) refill();
    mbar_wait(full0 + 8 * s, static_cast<uint32_t>((k / kSt) & 1));
    process(u, k, ring[s], warp, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
    if constexpr (kLateRefill) refill();
  }
}

}  // namespace kvferry::kernels::detail
