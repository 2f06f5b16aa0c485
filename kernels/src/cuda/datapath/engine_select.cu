// Engine selection of the data-path launchers (engine_select.h). The defaults the launchers pass
// are the engines that measured faster on an H200 (kvferry-bench kernels, the engines in one run):
// bulk for the conversions (where their entries allow it, else staged, and direct for
// bf16 -> 656), direct for the writers, the indexer, the gathers and dequant_paged
// (kernels/DESIGN.md §2.1).
#include "cuda/datapath/engine_select.h"

#include <cuda_runtime.h>

namespace kvferry::kernels::detail {

bool use_staged(DatapathEngine e, bool by_default) {
  switch (e) {
    case DatapathEngine::kDirect: return false;
    case DatapathEngine::kStaged: return true;
    default: return by_default;  // kAuto, and kBulk on a kernel without a bulk engine
  }
}

bool use_bulk(DatapathEngine e, bool by_default, int smem, const void* bulk_kernel) {
  switch (e) {
    case DatapathEngine::kDirect:
    case DatapathEngine::kStaged: return false;
    case DatapathEngine::kBulk: break;
    default:
      if (!by_default) return false;
  }
  int dev = 0, major = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major < 9 ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || smem > optin)
    return false;
  static const bool built = [bulk_kernel] {
    cudaFuncAttributes fa{};
    return cudaFuncGetAttributes(&fa, bulk_kernel) == cudaSuccess && fa.binaryVersion >= 90 && fa.ptxVersion >= 90;
  }();
  return built;
}

}  // namespace kvferry::kernels::detail
