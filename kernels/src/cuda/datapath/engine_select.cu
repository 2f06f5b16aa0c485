// Engine selection of the data-path launchers (engine_select.h).
#include "cuda/datapath/engine_select.h"

#include <cuda_runtime.h>

namespace kvferry::kernels::detail {
namespace {

/// The engine a launcher's params force, or -1 for its default (DatapathEngine::kAuto): the engine
/// that measured faster on an H200 (kvferry-bench kernels, the engines in one run): bulk for the
/// conversions (where their entries allow it, else staged, and direct for bf16 -> 656), direct for
/// the writers, the indexer, the gathers and dequant_paged (kernels/DESIGN.md §2.1).
int forced_engine(DatapathEngine e) {
  switch (e) {
    case DatapathEngine::kDirect: return 0;
    case DatapathEngine::kStaged: return 1;
    case DatapathEngine::kBulk: return 2;
    default: return -1;
  }
}

}  // namespace

bool use_staged(DatapathEngine e, bool by_default) {
  const int forced = forced_engine(e);
  return forced < 0 || forced == 2 ? by_default : forced == 1;
}

bool use_bulk(DatapathEngine e, bool by_default, int smem, const void* bulk_kernel) {
  const int forced = forced_engine(e);
  if (forced >= 0 && forced != 2) return false;
  if (forced < 0 && !by_default) return false;
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
