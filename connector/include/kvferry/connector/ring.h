#pragma once
// The per-client data channel (DESIGN.md §5): one memfd holding a submission ring (client ->
// daemon), a completion ring (daemon -> client) and a shared arena for block lists and per-block
// status. Each ring is single-producer / single-consumer with cache-line padded indices and an
// eventfd doorbell. A consumer spins for a bounded time, then sets its `sleeping` flag, re-checks
// and sleeps on its eventfd; a producer rings the doorbell only when that flag is set, so a busy
// pair never makes a system call.
//
// Memory ordering: the producer writes the slot, then stores `tail` (release); the consumer loads
// `tail` (acquire), reads the slot, then stores `head` (release). The sleep handshake is a Dekker
// pair: consumer stores sleeping=1, fence(seq_cst), re-loads tail; producer stores tail,
// fence(seq_cst), loads sleeping. One of the two always sees the other.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kvferry/layouts/status.h"

namespace kvferry::ring {

inline constexpr size_t kCacheLine = 64;
inline constexpr uint32_t kRingMagic = 0x474e5252u;  // "RRNG"
inline constexpr uint32_t kRingVersion = 1;

/// One request (64 bytes, one cache line). Block lists (keys, block ids) of the data ops live in
/// the arena at `arena_offset` (`count` entries); small requests carry everything in `args`.
struct alignas(64) SubmitEntry {
  uint64_t id;  ///< chosen by the client, echoed in the completion
  uint16_t op;  ///< proto::Op
  uint16_t flags;
  uint32_t region;        ///< region id the op addresses (0 = none)
  uint32_t count;         ///< entries of the block list
  uint32_t arena_offset;  ///< byte offset of the block list in the arena
  uint64_t args[5];
};
static_assert(sizeof(SubmitEntry) == 64);

/// One completion (64 bytes). `status` is the request's ErrorCode; per-block results of the data
/// ops are written to the arena at `arena_offset` (one int16 ErrorCode per block, `count` of
/// them), with `done` the number of blocks that succeeded.
struct alignas(64) CompletionEntry {
  uint64_t id;
  int16_t status;  ///< ErrorCode
  uint16_t op;
  uint32_t count;
  uint32_t arena_offset;
  uint32_t done;
  uint64_t result[5];
};
static_assert(sizeof(CompletionEntry) == 64);

/// Indices and the sleep flag of one ring, each on its own cache line.
struct RingIndices {
  alignas(64) std::atomic<uint32_t> head;       ///< next slot to consume (written by the consumer)
  alignas(64) std::atomic<uint32_t> tail;       ///< next slot to fill (written by the producer)
  alignas(64) std::atomic<uint32_t> sleeping;   ///< 1 while the consumer sleeps on its eventfd
  alignas(64) std::atomic<uint64_t> doorbells;  ///< doorbells rung (statistics)
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(RingIndices) == 4 * kCacheLine);

/// The first bytes of the ring memfd.
struct alignas(64) ControlBlock {
  uint32_t magic;
  uint32_t version;
  uint32_t entries;  ///< slots per ring (power of two)
  uint32_t arena_bytes;
  uint64_t sq_offset, cq_offset, arena_offset, total_bytes;
  alignas(64) RingIndices sq;
  RingIndices cq;
};

/// Byte layout of a ring memfd with `entries` slots and an arena of `arena_bytes`.
struct Geometry {
  uint32_t entries = 0;
  uint32_t arena_bytes = 0;
  uint64_t sq_offset = 0, cq_offset = 0, arena_offset = 0, total_bytes = 0;
  static Result<Geometry> make(uint32_t entries, uint32_t arena_bytes);
};

/// Writes the control block of a fresh (zeroed) mapping.
void init(void* base, const Geometry& g);
/// Checks a mapping of `mapped_bytes` received from a peer: magic, version, geometry consistent
/// with the size. Never trusts the peer's offsets beyond the mapping.
Result<Geometry> check(const void* base, uint64_t mapped_bytes);

/// A view of one SPSC ring inside a mapping. Cheap to copy; does not own memory or fds.
template <class Entry>
class Ring {
 public:
  Ring() = default;
  Ring(RingIndices* idx, Entry* slots, uint32_t entries) : idx_(idx), slots_(slots), mask_(entries - 1) {}

  uint32_t capacity() const { return mask_ + 1; }

  // ---- producer side ----
  /// Copies `e` into the ring; false when the ring is full (backpressure: nothing is lost).
  bool try_push(const Entry& e) {
    const uint32_t t = idx_->tail.load(std::memory_order_relaxed);
    if (t - idx_->head.load(std::memory_order_acquire) > mask_) return false;
    slots_[t & mask_] = e;
    idx_->tail.store(t + 1, std::memory_order_release);
    return true;
  }
  /// After one or more pushes: true when the consumer sleeps and the doorbell must be rung.
  bool consumer_needs_doorbell() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (idx_->sleeping.load(std::memory_order_relaxed) == 0) return false;
    idx_->doorbells.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // ---- consumer side ----
  /// Pointer to the next entry, or nullptr when empty. Call pop() after using it.
  const Entry* peek() const {
    const uint32_t h = idx_->head.load(std::memory_order_relaxed);
    if (idx_->tail.load(std::memory_order_acquire) == h) return nullptr;
    return &slots_[h & mask_];
  }
  void pop() { idx_->head.store(idx_->head.load(std::memory_order_relaxed) + 1, std::memory_order_release); }
  bool empty() const {
    return idx_->tail.load(std::memory_order_acquire) == idx_->head.load(std::memory_order_relaxed);
  }
  uint32_t size() const {
    return idx_->tail.load(std::memory_order_acquire) - idx_->head.load(std::memory_order_acquire);
  }
  /// Announces that the consumer is about to sleep; returns false (and clears the flag) when
  /// work arrived meanwhile, so the caller must not sleep.
  bool prepare_sleep() {
    idx_->sleeping.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!empty()) {
      idx_->sleeping.store(0, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  void end_sleep() { idx_->sleeping.store(0, std::memory_order_relaxed); }
  uint64_t doorbells() const { return idx_->doorbells.load(std::memory_order_relaxed); }

 private:
  RingIndices* idx_ = nullptr;
  Entry* slots_ = nullptr;
  uint32_t mask_ = 0;
};

/// Both rings and the arena of one mapping.
struct Channel {
  Ring<SubmitEntry> sq;
  Ring<CompletionEntry> cq;
  uint8_t* arena = nullptr;
  uint32_t arena_bytes = 0;
};
Channel channel(void* base, const Geometry& g);

// ---- eventfd doorbells ----
/// Adds 1 to an eventfd (never blocks: the counter cannot overflow in practice).
void ring_doorbell(int efd);
/// Resets an eventfd's counter (non-blocking eventfd).
void drain_doorbell(int efd);
/// Waits until `efd` is readable or `timeout_us` passes (-1 = forever). Returns false on timeout.
bool wait_doorbell(int efd, int64_t timeout_us);

}  // namespace kvferry::ring
