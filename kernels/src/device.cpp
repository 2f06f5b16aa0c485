#include "kvferry/kernels/device.h"

#include <string>

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry {

int cuda_device_count() {
#if defined(KVFERRY_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string cuda_summary() {
#if defined(KVFERRY_WITH_CUDA)
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorName(e) + ")";
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  std::string name = cudaGetDeviceProperties(&p, 0) == cudaSuccess ? p.name : "?";
  int rt = 0;
  (void)cudaRuntimeGetVersion(&rt);
  return "CUDA " + std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10) + ", " + std::to_string(n) +
         " device(s), device 0: " + name;
#else
  return "built without CUDA";
#endif
}

Status pin_host_memory(void* ptr, size_t bytes, bool* pinned) {
  *pinned = false;
#if defined(KVFERRY_WITH_CUDA)
  if (cuda_device_count() == 0 || bytes == 0) return Status::Ok();
  KVFERRY_CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  *pinned = true;
#else
  (void)ptr;
  (void)bytes;
#endif
  return Status::Ok();
}

Status unpin_host_memory(void* ptr) {
#if defined(KVFERRY_WITH_CUDA)
  KVFERRY_CUDA_TRY(cudaHostUnregister(ptr));
#else
  (void)ptr;
#endif
  return Status::Ok();
}

Status cuda_status(int err, const char* call, const char* file, int line) {
  if (err == 0) return Status::Ok();
  std::string what = std::string(call) + " failed";
#if defined(KVFERRY_WITH_CUDA)
  const auto e = static_cast<cudaError_t>(err);
  what += std::string(": ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
#else
  what += ": CUDA error " + std::to_string(err);
#endif
  what += " at " + std::string(file) + ":" + std::to_string(line);
  return {ErrorCode::kCuda, what};
}

}  // namespace kvferry
