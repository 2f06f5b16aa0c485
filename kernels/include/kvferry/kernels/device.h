#pragma once
// Which compute backend is present, and the one converter from cudaError_t to Status.
#include <cstddef>
#include <string>

#include "kvferry/layouts/status.h"

namespace kvferry {

/// Number of usable CUDA devices; 0 without a build with CUDA, without a driver or without a GPU
/// (any CUDA error counts as "no GPU": without one cudaGetDeviceCount returns error 35).
int cuda_device_count();

/// A one-line description of the CUDA situation, e.g. "CUDA 13.0, 1 device: NVIDIA H200" or
/// "built without CUDA" or "no CUDA device (cudaErrorInsufficientDriver)".
std::string cuda_summary();

/// Page-locks `bytes` of existing host memory at `ptr` for DMA (cudaHostRegister, portable and
/// mapped) when a CUDA device is present. Without CUDA or a device: Ok and nothing happens,
/// `*pinned` says which. The caller unpins with unpin_host_memory before freeing.
Status pin_host_memory(void* ptr, size_t bytes, bool* pinned);
/// Undoes pin_host_memory (cudaHostUnregister).
Status unpin_host_memory(void* ptr);

/// Status for a CUDA runtime error code `err` (an int so callers need no CUDA header), naming the
/// call and where it was made. Ok when err == 0.
Status cuda_status(int err, const char* call, const char* file, int line);

}  // namespace kvferry

/// KVFERRY_CUDA_STATUS(cudaMemcpy(...)): the call's Status (kCuda naming the call and this line).
#define KVFERRY_CUDA_STATUS(call) ::kvferry::cuda_status(static_cast<int>(call), #call, __FILE__, __LINE__)

/// KVFERRY_CUDA_TRY(cudaMemcpyAsync(...)); returns a kCuda Status naming the call on failure.
#define KVFERRY_CUDA_TRY(call) KVFERRY_TRY(::kvferry::cuda_status(static_cast<int>(call), #call, __FILE__, __LINE__))
