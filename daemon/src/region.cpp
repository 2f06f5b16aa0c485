// The memfd region backend and backend selection (region.h).
#include "kvferry/daemon/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvferry/connector/wire_io.h"

namespace kvferry::daemon {
namespace {

class MemfdRegion final : public Region {
 public:
  MemfdRegion(proto::RegionDesc d, UniqueFd fd, void* base, uint64_t offset = 0) : fd_(std::move(fd)), base_(base) {
    desc_ = std::move(d);
    offset_ = offset;
  }
  ~MemfdRegion() override {
    if (base_) ::munmap(base_, desc_.alloc_bytes);
  }
  int export_fd() const override { return fd_.get(); }
  uint8_t* base() const override { return static_cast<uint8_t*>(base_) + offset_; }
  Status read(uint64_t offset, std::span<uint8_t> out) const override {
    if (offset > desc_.bytes || out.size() > desc_.bytes - offset)
      return {ErrorCode::kOutOfRange, "read of " + std::to_string(out.size()) + " bytes at " + std::to_string(offset) +
                                          " is past region '" + desc_.name + "' of " + std::to_string(desc_.bytes) +
                                          " bytes"};
    std::memcpy(out.data(), base() + offset, out.size());
    return Status::Ok();
  }

 private:
  UniqueFd fd_;
  void* base_;
};

}  // namespace

proto::RegionDesc describe_region(uint32_t id, const std::string& name, const KvCacheSpec& spec) {
  proto::RegionDesc d;
  d.id = id;
  d.name = name;
  d.spec = spec;
  d.bytes = static_cast<uint64_t>(spec.region_bytes());
  return d;
}

proto::RegionDesc describe_registered(uint32_t id, const proto::RegisterRegion& m) {
  proto::RegionDesc d = describe_region(id, m.name, m.spec);
  d.alloc_bytes = m.alloc_bytes;
  d.backend = m.backend;
  d.device = m.device;
  return d;
}

Result<std::shared_ptr<Region>> create_memfd_region(uint32_t id, const std::string& name, const KvCacheSpec& spec) {
  KVFERRY_TRY(spec.validate().with_context("region '" + name + "'"));
  proto::RegionDesc d = describe_region(id, name, spec);
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  d.alloc_bytes = std::max<uint64_t>(page, (d.bytes + page - 1) / page * page);
  d.backend = proto::Backend::kMemfd;
  d.device = -1;
  UniqueFd fd(::memfd_create(("kvferry-region-" + name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return errno_status("memfd_create", errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(d.alloc_bytes)) != 0)
    return errno_status("ftruncate(region memfd)", errno);
  // Sealed size: an engine cannot shrink the file under the daemon's mapping (SIGBUS).
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return errno_status("fcntl(F_ADD_SEALS)", errno);
  void* base = ::mmap(nullptr, d.alloc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) return errno_status("mmap(region memfd)", errno);
  return std::shared_ptr<Region>(std::make_shared<MemfdRegion>(std::move(d), std::move(fd), base));
}

Result<std::shared_ptr<Region>> import_region(uint32_t id, const proto::RegisterRegion& m, UniqueFd fd) {
  KVFERRY_TRY(m.spec.validate().with_context("registered region '" + m.name + "'"));
  if (m.backend != proto::Backend::kMemfd) return import_cuda_region(id, m, std::move(fd));
  if (!fd) return Status(ErrorCode::kInvalidArgument, "registered region '" + m.name + "' came without its memfd");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status("fstat(registered memfd)", errno);
  if (static_cast<uint64_t>(st.st_size) < m.alloc_bytes)
    return Status(ErrorCode::kInvalidArgument, "registered region '" + m.name + "': the file is " +
                                                   std::to_string(st.st_size) + " bytes, alloc_bytes says " +
                                                   std::to_string(m.alloc_bytes));
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return Status(ErrorCode::kInvalidArgument,
                  "registered region '" + m.name +
                      "': the memfd must be sealed against shrinking (memfd_create with MFD_ALLOW_SEALING, then "
                      "fcntl(F_ADD_SEALS, F_SEAL_SHRINK))");
  void* base = ::mmap(nullptr, m.alloc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) return errno_status("mmap(registered memfd)", errno);
  proto::RegionDesc d = describe_registered(id, m);
  d.backend = proto::Backend::kMemfd;
  d.device = -1;
  return std::shared_ptr<Region>(std::make_shared<MemfdRegion>(std::move(d), std::move(fd), base, m.offset));
}

Result<std::shared_ptr<Region>> create_region(uint32_t id, const std::string& name, const KvCacheSpec& spec,
                                              RegionBackend backend, int gpu) {
  if (backend == RegionBackend::kCuda) return create_cuda_region(id, name, spec, gpu);
  return create_memfd_region(id, name, spec);
}

#if !defined(KVFERRY_WITH_CUDA)
Result<std::shared_ptr<Region>> import_cuda_region(uint32_t, const proto::RegisterRegion& m, UniqueFd) {
  return Result<std::shared_ptr<Region>>(ErrorCode::kUnavailable,
                                         "registered region '" + m.name + "': kvferry was built without CUDA");
}
Result<std::shared_ptr<Region>> create_cuda_region(uint32_t, const std::string& name, const KvCacheSpec&, int) {
  return Result<std::shared_ptr<Region>>(ErrorCode::kUnavailable,
                                         "region '" + name + "': kvferry was built without CUDA");
}
#endif

}  // namespace kvferry::daemon
