#include "kvferry/store/host_pool.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "kvferry/kernels/device.h"

namespace kvferry::store {
namespace {

Status errno_status(const char* call, int err) {
  return {ErrorCode::kIo, std::string(call) + " failed: " + std::strerror(err)};
}

// mbind(2) without libnuma: bind [addr, addr+len) to one node before the pages are touched.
Status bind_to_node(void* addr, uint64_t len, int node) {
  constexpr int kMpolBind = 2;
  if (node < 0 || node >= 1024) return {ErrorCode::kConfig, "numa_node " + std::to_string(node) + " is out of range"};
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  if (syscall(SYS_mbind, addr, len, kMpolBind, mask, 1024ul, 0u) != 0) {
    const int e = errno;
    return {ErrorCode::kIo, "binding the host pool to NUMA node " + std::to_string(node) +
                                " failed: " + std::strerror(e) + " (is there such a node?)"};
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<HostPool>> HostPool::create(const Options& opts) {
  if (opts.chunk_bytes < kSlotAlign || opts.chunk_bytes % kSlotAlign != 0)
    return Result<std::unique_ptr<HostPool>>(ErrorCode::kInvalidArgument,
                                             "host pool chunk size must be a positive multiple of 4096 bytes");
  std::unique_ptr<HostPool> p(new HostPool());
  p->chunk_bytes_ = opts.chunk_bytes;
  const uint64_t nchunks = opts.capacity / opts.chunk_bytes;
  p->capacity_ = nchunks * opts.chunk_bytes;
  p->chunks_.resize(nchunks);
  if (p->capacity_ == 0) return p;  // a pool too small for one chunk holds nothing (reported by capacity())
  void* m = mmap(nullptr, p->capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return errno_status("mmap of the host pool", errno);
  p->base_ = static_cast<uint8_t*>(m);
  p->mapped_ = p->capacity_;
  if (opts.numa_node >= 0) KVFERRY_TRY(bind_to_node(m, p->capacity_, opts.numa_node));
  // Touch every page once now, so no block save pays for a page fault, and pin it in slices so
  // the progress callback can report on long pools.
  const uint64_t slice = std::max<uint64_t>(opts.chunk_bytes, uint64_t{256} << 20);
  for (uint64_t off = 0; off < p->capacity_; off += slice) {
    const uint64_t n = std::min(slice, p->capacity_ - off);
    for (uint64_t o = 0; o < n; o += 4096) p->base_[off + o] = 0;
    if (opts.progress) opts.progress(off + n, p->capacity_);
  }
  if (opts.pin) {
    bool pinned = false;
    KVFERRY_TRY(pin_host_memory(p->base_, p->capacity_, &pinned).with_context("pinning the host pool"));
    p->pinned_ = pinned;
  }
  return p;
}

HostPool::~HostPool() {
  if (pinned_) (void)unpin_host_memory(base_);
  if (base_) munmap(base_, mapped_);
}

Result<Slot> HostPool::allocate(uint64_t bytes) {
  const uint64_t sz = slot_size(bytes);
  if (bytes == 0 || sz > chunk_bytes_)
    return Result<Slot>(ErrorCode::kInvalidArgument, "a block of " + std::to_string(bytes) +
                                                         " bytes does not fit a host pool slot (1 .. " +
                                                         std::to_string(chunk_bytes_) + " bytes)");
  std::lock_guard lk(mu_);
  Chunk* free_chunk = nullptr;
  size_t free_idx = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    if (c.slot_bytes == sz && !c.free_slots.empty()) {
      const uint32_t s = c.free_slots.back();
      c.free_slots.pop_back();
      ++c.used;
      used_ += sz;
      return Slot{i * chunk_bytes_ + s * sz, sz};
    }
    if (c.slot_bytes == 0 && !free_chunk) {
      free_chunk = &c;
      free_idx = i;
    }
  }
  if (!free_chunk)
    return Result<Slot>(ErrorCode::kResourceExhausted, "host pool full (" + std::to_string(used_) + " of " +
                                                           std::to_string(capacity_) + " bytes used)");
  const uint32_t n = static_cast<uint32_t>(chunk_bytes_ / sz);
  free_chunk->slot_bytes = sz;
  free_chunk->free_slots.clear();
  for (uint32_t s = n; s-- > 1;) free_chunk->free_slots.push_back(s);
  free_chunk->used = 1;
  used_ += sz;
  return Slot{free_idx * chunk_bytes_, sz};
}

void HostPool::release(const Slot& slot) {
  if (!slot.valid()) return;
  std::lock_guard lk(mu_);
  const size_t i = slot.offset / chunk_bytes_;
  if (i >= chunks_.size()) return;
  Chunk& c = chunks_[i];
  if (c.slot_bytes != slot.bytes || c.used == 0) return;
  c.free_slots.push_back(static_cast<uint32_t>((slot.offset - i * chunk_bytes_) / slot.bytes));
  --c.used;
  used_ -= slot.bytes;
  if (c.used == 0) {
    c.slot_bytes = 0;
    c.free_slots.clear();
  }
}

uint64_t HostPool::used_bytes() const {
  std::lock_guard lk(mu_);
  return used_;
}

bool HostPool::can_allocate(uint64_t bytes) const {
  const uint64_t sz = slot_size(bytes);
  std::lock_guard lk(mu_);
  for (const Chunk& c : chunks_)
    if (c.slot_bytes == 0 || (c.slot_bytes == sz && !c.free_slots.empty())) return true;
  return false;
}

}  // namespace kvferry::store
