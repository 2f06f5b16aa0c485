// Ring geometry, validation of a peer's mapping, and eventfd doorbells (ring.h).
#include "kvferry/connector/ring.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

namespace kvferry::ring {

namespace {
uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

Result<Geometry> Geometry::make(uint32_t entries, uint32_t arena_bytes) {
  if (entries < 2 || entries > (1u << 20) || (entries & (entries - 1)) != 0)
    return Result<Geometry>(ErrorCode::kInvalidArgument,
                            "ring entries " + std::to_string(entries) + " must be a power of two in [2, 2^20]");
  if (arena_bytes > (1u << 30))
    return Result<Geometry>(ErrorCode::kInvalidArgument,
                            "arena of " + std::to_string(arena_bytes) + " bytes is over 1 GiB");
  Geometry g;
  g.entries = entries;
  g.arena_bytes = arena_bytes;
  g.sq_offset = align_up(sizeof(ControlBlock), 4096);
  g.cq_offset = align_up(g.sq_offset + uint64_t{entries} * sizeof(SubmitEntry), 4096);
  g.arena_offset = align_up(g.cq_offset + uint64_t{entries} * sizeof(CompletionEntry), 4096);
  g.total_bytes = align_up(g.arena_offset + arena_bytes, 4096);
  return g;
}

void init(void* base, const Geometry& g) {
  auto* cb = new (base) ControlBlock{};
  cb->magic = kRingMagic;
  cb->version = kRingVersion;
  cb->entries = g.entries;
  cb->arena_bytes = g.arena_bytes;
  cb->sq_offset = g.sq_offset;
  cb->cq_offset = g.cq_offset;
  cb->arena_offset = g.arena_offset;
  cb->total_bytes = g.total_bytes;
}

Result<Geometry> check(const void* base, uint64_t mapped_bytes) {
  if (mapped_bytes < sizeof(ControlBlock))
    return Result<Geometry>(ErrorCode::kProtocol,
                            "ring mapping of " + std::to_string(mapped_bytes) + " bytes is too small");
  const auto* cb = static_cast<const ControlBlock*>(base);
  if (cb->magic != kRingMagic || cb->version != kRingVersion)
    return Result<Geometry>(ErrorCode::kProtocol, "ring mapping has a bad magic or version");
  auto g = Geometry::make(cb->entries, cb->arena_bytes);
  if (!g.ok()) return Result<Geometry>(ErrorCode::kProtocol, "ring control block: " + g.status().message());
  if (g->sq_offset != cb->sq_offset || g->cq_offset != cb->cq_offset || g->arena_offset != cb->arena_offset ||
      g->total_bytes != cb->total_bytes || g->total_bytes > mapped_bytes)
    return Result<Geometry>(ErrorCode::kProtocol,
                            "ring control block disagrees with its geometry or the mapping size (" +
                                std::to_string(mapped_bytes) + " bytes)");
  return g;
}

Channel channel(void* base, const Geometry& g) {
  auto* cb = static_cast<ControlBlock*>(base);
  auto* b = static_cast<uint8_t*>(base);
  Channel c;
  c.sq = Ring<SubmitEntry>(&cb->sq, reinterpret_cast<SubmitEntry*>(b + g.sq_offset), g.entries);
  c.cq = Ring<CompletionEntry>(&cb->cq, reinterpret_cast<CompletionEntry*>(b + g.cq_offset), g.entries);
  c.arena = b + g.arena_offset;
  c.arena_bytes = g.arena_bytes;
  return c;
}

void ring_doorbell(int efd) {
  uint64_t one = 1;
  ssize_t n;
  do n = ::write(efd, &one, sizeof one);
  while (n < 0 && errno == EINTR);
}

void drain_doorbell(int efd) {
  uint64_t v;
  ssize_t n;
  do n = ::read(efd, &v, sizeof v);
  while (n < 0 && errno == EINTR);
}

bool wait_doorbell(int efd, int64_t timeout_us) {
  pollfd p{efd, POLLIN, 0};
  int ms = timeout_us < 0 ? -1 : static_cast<int>((timeout_us + 999) / 1000);
  int r;
  do r = ::poll(&p, 1, ms);
  while (r < 0 && errno == EINTR);
  if (r > 0) drain_doorbell(efd);
  return r > 0;
}

}  // namespace kvferry::ring
