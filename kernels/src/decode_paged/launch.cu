// Launcher of the CUDA paged MHA/GQA decode: dispatch on dtypes and head dims,
// split choice, and the LSE merge of split partials.
#include "decode_paged/kernel.cuh"

namespace kvferry {
namespace {

using namespace decode_paged_detail;

KernelFn pick_kernel(DType qt, DType ct, int dk, int dv) {
  if (qt == DType::kBF16 && ct == DType::kBF16) return pick_bf16(dk, dv);
  if (qt == DType::kFP16 && ct == DType::kFP16) return pick_fp16(dk, dv);
  if (qt == DType::kBF16 && ct == DType::kFP8E4M3) return pick_fp8_bf16q(dk, dv);
  if (qt == DType::kFP16 && ct == DType::kFP8E4M3) return pick_fp8_fp16q(dk, dv);
  return nullptr;
}

int group_of(const DecodePagedParams& p) { return static_cast<int>(p.q.size(1) / std::max<int64_t>(1, p.k.size(2))); }

KernelFn kernel_for(const DecodePagedParams& p) {
  return pick_kernel(p.q.dtype, p.k.dtype, static_cast<int>(p.k.size(3)), static_cast<int>(p.v.size(3)));
}

int smem_bytes(const DecodePagedParams& p) {
  return smem_total(static_cast<int>(p.k.size(3)), static_cast<int>(p.v.size(3)),
                    static_cast<int>(dtype_size(p.k.dtype)));
}

// Raises the kernel's dynamic shared-memory cap to its plan. The attribute belongs to the current
// device's context; the call is cheap, so it is made per launch.
cudaError_t prepare(KernelFn fn, int smem) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

// Resident CTAs per SM and SM count for `fn` at `smem` bytes; false when CUDA cannot say.
bool residency(KernelFn fn, int smem, int& occ, int& sms) {
  int dev = 0;
  occ = sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      prepare(fn, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, reinterpret_cast<const void*>(fn), kThreads, smem) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

// Launches `kernel` so that it may start while the previous kernel on the stream finishes
// (programmatic dependent launch; the kernel waits in griddep_wait), or plainly if refused.
template <class K>
cudaError_t launch_dependent(K kernel, dim3 grid, const Args& a, int dv, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (cudaLaunchKernelEx(&cfg, kernel, a, dv) == cudaSuccess) return cudaSuccess;
  (void)cudaGetLastError();
  kernel<<<grid, kThreads, 0, stream>>>(a, dv);
  return cudaGetLastError();
}

// Minimum units (16-token warp tiles) per CTA group of the balanced grid, by max_seq_len.
constexpr int64_t kMinUnitsPerCta = 16;

}  // namespace

int decode_paged_balanced_grid(const DecodePagedParams& p) {
  if (p.q.rank != 3 || p.k.rank != 4 || p.v.rank != 4 || p.k.size(2) < 1) return 0;
  KernelFn fn = kernel_for(p);
  int occ = 0, sms = 0;
  if (fn == nullptr || !residency(fn, smem_bytes(p), occ, sms)) return 0;
  // Groups of IH CTAs (one per kv head and head chunk), as many as fit the resident slots.
  const int64_t G = group_of(p);
  const int64_t ih = p.k.size(2) * ((G + kN - 1) / kN);
  const int64_t units = p.q.size(0) * ((int64_t{p.max_seq_len} + kTW - 1) / kTW);
  const int64_t resident = int64_t{std::max(1, occ)} * sms;
  const int64_t groups = std::max<int64_t>(1, std::min(resident / ih, (units + kMinUnitsPerCta - 1) / kMinUnitsPerCta));
  if (groups * ih > 0x7fffffff) return 0;
  return static_cast<int>(groups * ih);
}

int decode_paged_choose_splits(const DecodePagedParams& p) {
  // The split schedule, not the balanced one: on the H200 the balanced schedule measured 2-3 %
  // slower for the uniform-length benchmark batches (its CTAs restart their pipelines and merge
  // at every request end, and all finish together), although it leaves no partial last wave.
  if (p.q.rank != 3 || p.k.rank != 4 || p.v.rank != 4) return 1;
  KernelFn fn = kernel_for(p);
  int occ = 0, sms = 0;
  if (fn == nullptr || !residency(fn, smem_bytes(p), occ, sms)) return 1;
  const int64_t G = group_of(p);
  const int64_t base = p.q.size(0) * p.k.size(2) * ((G + kN - 1) / kN);
  const int64_t resident = std::max(1, occ) * int64_t{sms};
  const int64_t tiles = (p.max_seq_len + kT - 1) / kT;
  if (base <= 0 || tiles <= 0) return 1;
  // Cost of S splits: waves * (tiles per split + a per-CTA overhead of ~1 tile), plus a merge.
  const int smax = static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(1, tiles / 2)));
  int best = 1;
  double best_cost = 1e300;
  for (int S = 1; S <= smax; ++S) {
    const double waves = static_cast<double>((base * S + resident - 1) / resident);
    const double cost = waves * (static_cast<double>((tiles + S - 1) / S) + 1.0) + (S > 1 ? 1.0 : 0.0);
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = S;
    }
  }
  return best;
}

cudaError_t launch_decode_paged(const DecodePagedParams& p, cudaStream_t stream) {
  const int dv = static_cast<int>(p.v.size(3));
  KernelFn fn = kernel_for(p);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const int B = static_cast<int>(p.q.size(0)), Hq = static_cast<int>(p.q.size(1));
  const int Hkv = static_cast<int>(p.k.size(2));
  if (B == 0 || Hq == 0) return cudaSuccess;
  int S = p.num_splits;
  if (S == 0) S = decode_paged_choose_splits(p);
  const bool balanced = S == kDecodePagedBalanced;
  int grid = 0;
  if (balanced) {
    grid = decode_paged_balanced_grid(p);
    if (grid < 1 || p.workspace == nullptr ||
        p.workspace_bytes < decode_paged_balanced_workspace_bytes(B, Hq, Hkv, dv, grid))
      return cudaErrorInvalidValue;
  } else if (S < 1) {
    return cudaErrorInvalidValue;
  } else if (S > 1 && (p.workspace == nullptr || p.workspace_bytes < decode_paged_workspace_bytes(B, Hq, dv, S))) {
    return cudaErrorInvalidValue;
  }
  const int64_t ce = dtype_size(p.k.dtype), qe = dtype_size(p.q.dtype);
  Args a{};
  a.q = static_cast<const uint8_t*>(p.q_base) + p.q.offset;
  a.q_sb = p.q.stride(0) * qe;
  a.q_sh = p.q.stride(1) * qe;
  a.k = static_cast<const uint8_t*>(p.k_base) + p.k.offset;
  a.k_sp = p.k.stride(0) * ce;
  a.k_st = p.k.stride(1) * ce;
  a.k_sh = p.k.stride(2) * ce;
  a.v = static_cast<const uint8_t*>(p.v_base) + p.v.offset;
  a.v_sp = p.v.stride(0) * ce;
  a.v_st = p.v.stride(1) * ce;
  a.v_sh = p.v.stride(2) * ce;
  a.bt = p.block_table;
  a.bt_stride = p.block_table_stride;
  a.max_blocks = p.max_blocks_per_seq;
  a.lens = p.seq_lens;
  a.o = static_cast<uint8_t*>(p.o_base) + p.o.offset;
  a.o_sb = p.o.stride(0) * qe;
  a.o_sh = p.o.stride(1) * qe;
  a.lse = p.lse;
  const bool fp8 = p.k.dtype == DType::kFP8E4M3;
  a.score_scale = p.sm_scale * (fp8 ? p.k_scale : 1.0f);
  a.logit_cap = p.logit_cap;
  a.v_scale = fp8 ? p.v_scale : 1.0f;
  a.Hq = Hq;
  a.G = Hq / Hkv;
  a.HC = (a.G + kN - 1) / kN;
  a.Dk = static_cast<int>(p.q.size(2));
  a.P = static_cast<int>(p.k.size(1));
  a.S = balanced ? 1 : S;
  a.p_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((1 << sh) == a.P) a.p_shift = sh;
  a.B = B;
  a.IH = Hkv * a.HC;
  a.balanced = balanced ? 1 : 0;
  a.grid = grid;
  a.ws_lse = static_cast<float*>(p.workspace);
  a.ws_o = a.ws_lse + (balanced ? (int64_t{B} * a.IH + grid) * kN : int64_t{B} * Hq * S);
  if (const cudaError_t e = prepare(fn, smem_bytes(p)); e != cudaSuccess) return e;
  const int64_t blocks_x = balanced ? int64_t{grid} : int64_t{Hkv} * a.HC * S;
  if (blocks_x > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 g(static_cast<unsigned>(blocks_x), balanced ? 1u : static_cast<unsigned>(B));
  fn<<<g, kThreads, smem_bytes(p), stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || (!balanced && S == 1)) return e;
  const dim3 mg(static_cast<unsigned>(Hq), static_cast<unsigned>(B));
  if (p.q.dtype == DType::kBF16)
    return balanced ? launch_dependent(decode_paged_merge_balanced_kernel<__nv_bfloat16>, mg, a, dv, stream)
                    : launch_dependent(decode_paged_merge_kernel<__nv_bfloat16>, mg, a, dv, stream);
  return balanced ? launch_dependent(decode_paged_merge_balanced_kernel<__half>, mg, a, dv, stream)
                  : launch_dependent(decode_paged_merge_kernel<__half>, mg, a, dv, stream);
}

}  // namespace kvferry
