#pragma once
// Regions: one KV cache allocation described by a KvCacheSpec, owned by the daemon and shared
// with engines (DESIGN.md §3). Backends: a sealed memfd of host memory (CPU), a cuMemCreate
// allocation exported as a POSIX fd, or cudaMalloc + a legacy IPC handle (fallback).
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kvferry/connector/protocol.h"
#include "kvferry/connector/wire_io.h"
#include "kvferry/layouts/status.h"

namespace kvferry::daemon {

/// Which backend new regions use.
enum class RegionBackend : uint8_t { kCpu, kCuda };

/// A region's memory and what an engine needs to map it. Not copyable; shared through
/// shared_ptr by the daemon's registry and the clients that mapped it. Thread-safe for read().
class Region {
 public:
  virtual ~Region() = default;
  const proto::RegionDesc& desc() const { return desc_; }
  /// The descriptor to pass with SCM_RIGHTS (memfd or cuMem POSIX fd), -1 when the backend has
  /// none (legacy CUDA IPC: see ipc_handle()).
  virtual int export_fd() const = 0;
  /// The 64-byte legacy IPC handle, when the backend uses one.
  virtual bool ipc_handle(uint8_t out[64]) const {
    (void)out;
    return false;
  }
  /// Copies `out.size()` bytes at `offset` through the daemon's own mapping (bounds-checked).
  virtual Status read(uint64_t offset, std::span<uint8_t> out) const = 0;
  /// The daemon's own mapping of the region (host memory, or a CUDA device pointer when
  /// on_device()): what the data ops copy blocks from and to.
  virtual uint8_t* base() const = 0;
  virtual bool on_device() const { return false; }
  /// Where the region starts in its buffer (a registered KV tensor inside a larger allocation);
  /// 0 for every region the daemon made. Such a region is not exported to other clients: the
  /// descriptor they map by names the whole allocation.
  uint64_t offset() const { return offset_; }

 protected:
  proto::RegionDesc desc_;
  uint64_t offset_ = 0;
};

/// The descriptor of region `id` named `name` of `spec` (its bytes from the spec); the backend's
/// fields (alloc_bytes, backend, device) are for the caller to fill.
proto::RegionDesc describe_region(uint32_t id, const std::string& name, const KvCacheSpec& spec);
/// The descriptor of a buffer an engine registered (RegisterRegion), as region `id`.
proto::RegionDesc describe_registered(uint32_t id, const proto::RegisterRegion& m);

/// Creates a region of `spec` named `name` with id `id` on `backend` (`gpu`: CUDA device).
Result<std::shared_ptr<Region>> create_region(uint32_t id, const std::string& name, const KvCacheSpec& spec,
                                              RegionBackend backend, int gpu);

/// A sealed memfd region (always available).
Result<std::shared_ptr<Region>> create_memfd_region(uint32_t id, const std::string& name, const KvCacheSpec& spec);

/// A CUDA region on device `gpu`: cuMemCreate + POSIX fd, else cudaMalloc + legacy IPC.
/// kUnavailable in a build without CUDA or without a device.
Result<std::shared_ptr<Region>> create_cuda_region(uint32_t id, const std::string& name, const KvCacheSpec& spec,
                                                   int gpu);

/// Imports a buffer an engine allocated and registered (proto::RegisterRegion): a memfd (it must
/// carry F_SEAL_SHRINK, so the engine cannot pull pages from under the daemon's mapping), a cuMem
/// POSIX fd, or a legacy CUDA IPC handle. Takes `fd` (unused for IPC). The region is exported to
/// other clients the same way it came in.
Result<std::shared_ptr<Region>> import_region(uint32_t id, const proto::RegisterRegion& m, UniqueFd fd);

/// CUDA part of import_region (kUnavailable without CUDA).
Result<std::shared_ptr<Region>> import_cuda_region(uint32_t id, const proto::RegisterRegion& m, UniqueFd fd);

}  // namespace kvferry::daemon
