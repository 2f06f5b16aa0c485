// cuda_vmm.h: cuMemCreate/POSIX fd sharing through driver entry points, and the legacy IPC
// fallback.
#include "kvferry/connector/cuda_vmm.h"

#include "kvferry/kernels/device.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#endif

namespace kvferry::cuda_vmm {

#if defined(KVFERRY_WITH_CUDA)
namespace {

struct Driver {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemRelease) mem_release = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
  decltype(&cuMemGetAddressRange) address_range = nullptr;
  Status status;
};

template <class F>
void load(Driver& d, const char* sym, F& fn) {
  if (!d.status.ok()) return;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  cudaError_t e = cudaGetDriverEntryPointByVersion(sym, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
    d.status = Status(ErrorCode::kUnavailable,
                      std::string("driver entry point ") + sym + " is not available (" + cudaGetErrorName(e) + ")");
    return;
  }
  fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    load(d, "cuMemGetAllocationGranularity", d.granularity);
    load(d, "cuMemCreate", d.create);
    load(d, "cuMemExportToShareableHandle", d.export_handle);
    load(d, "cuMemImportFromShareableHandle", d.import_handle);
    load(d, "cuMemAddressReserve", d.reserve);
    load(d, "cuMemAddressFree", d.address_free);
    load(d, "cuMemMap", d.map);
    load(d, "cuMemUnmap", d.unmap);
    load(d, "cuMemSetAccess", d.set_access);
    load(d, "cuMemRelease", d.mem_release);
    load(d, "cuDeviceGetAttribute", d.attribute);
    load(d, "cuMemGetAddressRange", d.address_range);
  });
  return d;
}

Status cu(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  return {ErrorCode::kCuda, std::string(call) + " failed with CUresult " + std::to_string(static_cast<int>(r))};
}

Status init_device(int device) {
  KVFERRY_CUDA_TRY(cudaSetDevice(device));
  return KVFERRY_CUDA_STATUS(cudaFree(nullptr));
}

CUmemAllocationProp props(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

Status map_here(const Driver& d, Mapping& m) {
  CUdeviceptr va = 0;
  KVFERRY_TRY(cu(d.reserve(&va, m.size, 0, 0, 0), "cuMemAddressReserve"));
  if (Status st = cu(d.map(va, m.size, 0, m.handle, 0), "cuMemMap"); !st.ok()) {
    d.address_free(va, m.size);
    return st;
  }
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = m.device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (Status st = cu(d.set_access(va, m.size, &a, 1), "cuMemSetAccess"); !st.ok()) {
    d.unmap(va, m.size);
    d.address_free(va, m.size);
    return st;
  }
  m.ptr = reinterpret_cast<void*>(va);
  return Status::Ok();
}

}  // namespace

bool vmm_supported(int device) {
  if (!driver().status.ok() || !init_device(device).ok()) return false;
  int vmm = 0, posix = 0;
  const CUdevice dev = device;
  if (driver().attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS ||
      driver().attribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) != CUDA_SUCCESS)
    return false;
  return vmm != 0 && posix != 0;
}

Result<Mapping> create_exportable(int device, uint64_t bytes) {
  const Driver& d = driver();
  KVFERRY_TRY(d.status);
  KVFERRY_TRY(init_device(device));
  CUmemAllocationProp p = props(device);
  size_t gran = 0;
  KVFERRY_TRY(cu(d.granularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity"));
  Mapping m;
  m.device = device;
  m.size = std::max<uint64_t>(gran, (bytes + gran - 1) / gran * gran);
  CUmemGenericAllocationHandle h = 0;
  KVFERRY_TRY(cu(d.create(&h, m.size, &p, 0), "cuMemCreate"));
  m.handle = h;
  int fd = -1;
  if (Status st =
          cu(d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "cuMemExportToShareableHandle");
      !st.ok()) {
    d.mem_release(h);
    return st;
  }
  m.fd = fd;
  if (Status st = map_here(d, m); !st.ok()) {
    d.mem_release(h);
    return st;
  }
  return m;
}

Result<Mapping> import_fd(int device, int fd, uint64_t size) {
  const Driver& d = driver();
  KVFERRY_TRY(d.status);
  KVFERRY_TRY(init_device(device));
  Mapping m;
  m.device = device;
  m.size = size;
  CUmemGenericAllocationHandle h = 0;
  KVFERRY_TRY(cu(d.import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                 "cuMemImportFromShareableHandle"));
  m.handle = h;
  if (Status st = map_here(d, m); !st.ok()) {
    d.mem_release(h);
    return st;
  }
  return m;
}

void release(Mapping& m) {
  const Driver& d = driver();
  if (!d.status.ok()) return;
  if (m.ptr) {
    auto va = reinterpret_cast<CUdeviceptr>(m.ptr);
    d.unmap(va, m.size);
    d.address_free(va, m.size);
    m.ptr = nullptr;
  }
  if (m.handle) {
    d.mem_release(m.handle);
    m.handle = 0;
  }
}

Result<void*> malloc_ipc(int device, uint64_t bytes, uint8_t handle[64]) {
  KVFERRY_TRY(init_device(device));
  void* p = nullptr;
  KVFERRY_CUDA_TRY(cudaMalloc(&p, bytes ? bytes : 1));
  cudaIpcMemHandle_t h{};
  if (Status st = KVFERRY_CUDA_STATUS(cudaIpcGetMemHandle(&h, p)); !st.ok()) {
    cudaFree(p);
    return st;
  }
  static_assert(sizeof(h) == 64);
  std::memcpy(handle, &h, 64);
  return p;
}

void free_ipc(void* p, int device) {
  if (!p) return;
  cudaSetDevice(device);
  cudaFree(p);
}

Result<void*> ipc_open(int device, const uint8_t handle[64]) {
  KVFERRY_TRY(init_device(device));
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle, 64);
  void* p = nullptr;
  KVFERRY_CUDA_TRY(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return p;
}

void ipc_close(void* p, int device) {
  if (!p) return;
  cudaSetDevice(device);
  cudaIpcCloseMemHandle(p);
}

Status grant_access(void* ptr, int owner_device, int device) {
  if (owner_device == device) return Status::Ok();
  int can = 0;
  KVFERRY_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, owner_device));
  if (!can)
    return {ErrorCode::kUnavailable,
            "GPU " + std::to_string(device) + " has no peer access to GPU " + std::to_string(owner_device)};
  const Driver& d = driver();
  KVFERRY_TRY(d.status);
  CUdeviceptr base = 0;
  size_t size = 0;
  KVFERRY_TRY(cu(d.address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)), "cuMemGetAddressRange"));
  CUmemAccessDesc a[2]{};
  for (int i = 0; i < 2; ++i) {
    a[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a[i].location.id = i == 0 ? owner_device : device;
    a[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  return cu(d.set_access(base, size, a, 2), "cuMemSetAccess");
}

Status copy_to_host(void* dst, const void* src, size_t n, int device) {
  KVFERRY_CUDA_TRY(cudaSetDevice(device));
  return KVFERRY_CUDA_STATUS(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}

Status copy_to_device(void* dst, const void* src, size_t n, int device) {
  KVFERRY_CUDA_TRY(cudaSetDevice(device));
  return KVFERRY_CUDA_STATUS(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
}

#else  // !KVFERRY_WITH_CUDA

namespace {
Status no_cuda() { return {ErrorCode::kUnavailable, "kvferry was built without CUDA"}; }
}  // namespace
bool vmm_supported(int) { return false; }
Result<Mapping> create_exportable(int, uint64_t) { return no_cuda(); }
Result<Mapping> import_fd(int, int, uint64_t) { return no_cuda(); }
void release(Mapping&) {}
Result<void*> malloc_ipc(int, uint64_t, uint8_t*) { return no_cuda(); }
void free_ipc(void*, int) {}
Result<void*> ipc_open(int, const uint8_t*) { return no_cuda(); }
void ipc_close(void*, int) {}
Status grant_access(void*, int, int) { return no_cuda(); }
Status copy_to_host(void*, const void*, size_t, int) { return no_cuda(); }
Status copy_to_device(void*, const void*, size_t, int) { return no_cuda(); }

#endif

}  // namespace kvferry::cuda_vmm
