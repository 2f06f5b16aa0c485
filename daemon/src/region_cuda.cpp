// CUDA region backend (region.h): cuMemCreate with a POSIX-fd shareable handle, or, where the
// driver lacks that, cudaMalloc with a legacy IPC handle.
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kvferry/connector/cuda_vmm.h"
#include "kvferry/daemon/region.h"

#if defined(KVFERRY_WITH_CUDA)
namespace kvferry::daemon {
namespace {

Status check_read(const proto::RegionDesc& d, uint64_t offset, size_t n) {
  if (offset > d.bytes || n > d.bytes - offset)
    return {ErrorCode::kOutOfRange, "read of " + std::to_string(n) + " bytes at " + std::to_string(offset) +
                                        " is past region '" + d.name + "' of " + std::to_string(d.bytes) + " bytes"};
  return Status::Ok();
}

class VmmRegion final : public Region {
 public:
  VmmRegion(proto::RegionDesc d, cuda_vmm::Mapping m, uint64_t offset = 0) : m_(m) {
    desc_ = std::move(d);
    offset_ = offset;
  }
  ~VmmRegion() override {
    if (m_.fd >= 0) ::close(m_.fd);
    cuda_vmm::release(m_);
  }
  int export_fd() const override { return m_.fd; }
  uint8_t* base() const override { return static_cast<uint8_t*>(m_.ptr) + offset_; }
  bool on_device() const override { return true; }
  Status read(uint64_t offset, std::span<uint8_t> out) const override {
    KVFERRY_TRY(check_read(desc_, offset, out.size()));
    return cuda_vmm::copy_to_host(out.data(), base() + offset, out.size(), m_.device);
  }

 private:
  cuda_vmm::Mapping m_;
};

class IpcRegion final : public Region {
 public:
  /// `opened`: the memory belongs to another process (cudaIpcOpenMemHandle), not to us.
  IpcRegion(proto::RegionDesc d, void* p, const uint8_t h[64], bool opened = false, uint64_t offset = 0)
      : p_(p), opened_(opened) {
    desc_ = std::move(d);
    offset_ = offset;
    std::memcpy(h_, h, 64);
  }
  ~IpcRegion() override {
    if (opened_)
      cuda_vmm::ipc_close(p_, desc_.device);
    else
      cuda_vmm::free_ipc(p_, desc_.device);
  }
  int export_fd() const override { return -1; }
  uint8_t* base() const override { return static_cast<uint8_t*>(p_) + offset_; }
  bool on_device() const override { return true; }
  bool ipc_handle(uint8_t out[64]) const override {
    std::memcpy(out, h_, 64);
    return true;
  }
  Status read(uint64_t offset, std::span<uint8_t> out) const override {
    KVFERRY_TRY(check_read(desc_, offset, out.size()));
    return cuda_vmm::copy_to_host(out.data(), base() + offset, out.size(), desc_.device);
  }

 private:
  void* p_;
  bool opened_;
  uint8_t h_[64];
};

}  // namespace

Result<std::shared_ptr<Region>> import_cuda_region(uint32_t id, const proto::RegisterRegion& m, UniqueFd fd) {
  proto::RegionDesc d = describe_registered(id, m);
  if (m.backend == proto::Backend::kCudaVmm) {
    if (!fd) return Status(ErrorCode::kInvalidArgument, "registered region '" + m.name + "' came without its fd");
    auto vm = cuda_vmm::import_fd(m.device, fd.get(), m.alloc_bytes);
    if (!vm.ok()) return vm.status().with_context("importing registered region '" + m.name + "'");
    vm->fd = fd.release();  // kept to export the region to other clients
    return std::shared_ptr<Region>(std::make_shared<VmmRegion>(std::move(d), *vm, m.offset));
  }
  auto p = cuda_vmm::ipc_open(m.device, m.ipc_handle);
  if (!p.ok()) return p.status().with_context("importing registered region '" + m.name + "'");
  return std::shared_ptr<Region>(std::make_shared<IpcRegion>(std::move(d), *p, m.ipc_handle, true, m.offset));
}

Result<std::shared_ptr<Region>> create_cuda_region(uint32_t id, const std::string& name, const KvCacheSpec& spec,
                                                   int gpu) {
  KVFERRY_TRY(spec.validate().with_context("region '" + name + "'"));
  proto::RegionDesc d = describe_region(id, name, spec);
  d.device = gpu;
  // KVFERRY_CUDA_IPC=1 forces the legacy IPC fallback (to test it on machines with VMM).
  const char* force_ipc = std::getenv("KVFERRY_CUDA_IPC");
  if (!(force_ipc && *force_ipc == '1') && cuda_vmm::vmm_supported(gpu)) {
    auto m = cuda_vmm::create_exportable(gpu, d.bytes);
    if (m.ok()) {
      d.alloc_bytes = m->size;
      d.backend = proto::Backend::kCudaVmm;
      return std::shared_ptr<Region>(std::make_shared<VmmRegion>(std::move(d), *m));
    }
    spdlog::warn("region '{}': cuMemCreate with a POSIX fd failed ({}); falling back to cudaMalloc + IPC", name,
                 m.status().to_string());
  }
  uint8_t h[64];
  auto p = cuda_vmm::malloc_ipc(gpu, d.bytes, h);
  if (!p.ok()) return p.status().with_context("region '" + name + "'");
  d.alloc_bytes = std::max<uint64_t>(d.bytes, 1);
  d.backend = proto::Backend::kCudaIpc;
  return std::shared_ptr<Region>(std::make_shared<IpcRegion>(std::move(d), *p, h));
}

}  // namespace kvferry::daemon
#endif
