#pragma once
// GPU memory shared between processes, used by the daemon (export) and the connector (import).
// Driver API calls are reached through cudaGetDriverEntryPointByVersion: nothing links libcuda,
// so binaries start on machines without a driver. Compiles without CUDA; every call then
// returns kUnavailable.
#include <cstddef>
#include <cstdint>

#include "kvferry/layouts/status.h"

namespace kvferry::cuda_vmm {

/// A cuMemCreate allocation mapped in this process. `fd` is set by create_exportable only.
struct Mapping {
  int device = -1;
  uint64_t handle = 0;  ///< CUmemGenericAllocationHandle
  void* ptr = nullptr;
  uint64_t size = 0;  ///< bytes mapped (allocation granularity multiple)
  int fd = -1;        ///< POSIX fd exported from `handle` (owned by the caller)
};

/// True when the driver exposes the VMM calls with POSIX-fd handles on `device`.
bool vmm_supported(int device);
/// Allocates at least `bytes` on `device` with cuMemCreate (POSIX-fd shareable), maps it here
/// read-write and exports the fd.
Result<Mapping> create_exportable(int device, uint64_t bytes);
/// Imports an exported fd of `size` bytes and maps it read-write on `device`.
Result<Mapping> import_fd(int device, int fd, uint64_t size);
/// Unmaps and releases (does not close `fd`).
void release(Mapping& m);

/// Fallback: cudaMalloc + cudaIpcGetMemHandle (64 bytes).
Result<void*> malloc_ipc(int device, uint64_t bytes, uint8_t handle[64]);
void free_ipc(void* p, int device);
/// Opens a legacy IPC handle of another process on `device`.
Result<void*> ipc_open(int device, const uint8_t handle[64]);
void ipc_close(void* p, int device);

/// Lets `device` read and write the mapping that holds `ptr` (imported on another device): what
/// the copy engines of `device` need to write into it directly, over NVLink where the GPUs have
/// peer access. A legacy IPC mapping needs nothing here (it was opened with lazy peer access).
/// kUnavailable when the two devices cannot reach each other.
Status grant_access(void* ptr, int owner_device, int device);

/// Synchronous copies between host and device memory (cudaMemcpy).
Status copy_to_host(void* dst, const void* src, size_t n, int device);
Status copy_to_device(void* dst, const void* src, size_t n, int device);

}  // namespace kvferry::cuda_vmm
