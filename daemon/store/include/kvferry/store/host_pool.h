#pragma once
// HostPool: the daemon-owned host tier (G2). One allocation of `capacity` bytes, populated (and,
// with a CUDA device, page-locked for DMA) once at start with progress logged, bound to a NUMA node
// when asked. Carved into chunks; each chunk serves fixed-size slots of one size class, so blocks
// of one size never fragment. Thread-safe.
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kvferry/layouts/status.h"

namespace kvferry::store {

/// A slot of the pool: its byte offset in the pool and its size class (bytes).
struct Slot {
  uint64_t offset = 0;
  uint64_t bytes = 0;  ///< the slot's size (the block's bytes rounded up to kSlotAlign)
  bool valid() const { return bytes != 0; }
};

class HostPool {
 public:
  static constexpr uint64_t kSlotAlign = 4096;

  struct Options {
    uint64_t capacity = uint64_t{1} << 30;
    uint64_t chunk_bytes = uint64_t{64} << 20;  ///< largest slot; chunks are assigned to one slot size
    int numa_node = -1;                         ///< -1: no binding
    bool pin = true;                            ///< page-lock for DMA when a CUDA device is present
    /// Called with (bytes done, bytes total) while the pool is populated and pinned.
    std::function<void(uint64_t, uint64_t)> progress;
  };

  /// Maps, binds, populates and pins the pool. Errors name what failed (mmap, mbind, pinning).
  static Result<std::unique_ptr<HostPool>> create(const Options& opts);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// A slot for a block of `bytes`, or kResourceExhausted when no chunk has room (the caller
  /// evicts and retries), or kInvalidArgument when `bytes` exceeds the chunk size.
  Result<Slot> allocate(uint64_t bytes);
  /// Returns a slot; a chunk whose slots are all free goes back to the free chunks.
  void release(const Slot& slot);

  uint8_t* data(const Slot& slot) const { return base_ + slot.offset; }
  uint8_t* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  /// Bytes held by allocated slots.
  uint64_t used_bytes() const;
  /// Whether a slot of `bytes` could be allocated now without eviction.
  bool can_allocate(uint64_t bytes) const;
  bool pinned() const { return pinned_; }

 private:
  HostPool() = default;
  struct Chunk {
    uint64_t slot_bytes = 0;  ///< 0: free chunk
    std::vector<uint32_t> free_slots;
    uint32_t used = 0;
  };
  static uint64_t slot_size(uint64_t bytes) { return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

  uint8_t* base_ = nullptr;
  uint64_t capacity_ = 0;  ///< usable bytes (whole chunks)
  uint64_t mapped_ = 0;    ///< bytes mapped
  uint64_t chunk_bytes_ = 0;
  bool pinned_ = false;
  mutable std::mutex mu_;
  std::vector<Chunk> chunks_;
  uint64_t used_ = 0;
};

}  // namespace kvferry::store
