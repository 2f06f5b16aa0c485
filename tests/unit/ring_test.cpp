// Shared-memory SPSC rings: geometry, full/empty, the sleep handshake, and a two-thread stress
// that checks order and that nothing is lost.
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "kvferry/connector/ring.h"

namespace kvferry::ring {
namespace {

struct Mapping {
  explicit Mapping(const Geometry& g) : bytes(g.total_bytes) {
    mem = std::aligned_alloc(4096, bytes);
    std::memset(mem, 0, bytes);
    init(mem, g);
  }
  ~Mapping() { std::free(mem); }
  void* mem;
  uint64_t bytes;
};

TEST(Ring, GeometryRejectsBadSizes) {
  EXPECT_FALSE(Geometry::make(0, 0).ok());
  EXPECT_FALSE(Geometry::make(3, 0).ok());
  EXPECT_FALSE(Geometry::make(1u << 21, 0).ok());
  auto g = Geometry::make(64, 8192);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->sq_offset % 4096, 0u);
  EXPECT_GE(g->cq_offset, g->sq_offset + 64 * sizeof(SubmitEntry));
  EXPECT_GE(g->total_bytes, g->arena_offset + 8192);
}

TEST(Ring, IndicesSitOnTheirOwnCacheLines) {
  EXPECT_EQ(offsetof(RingIndices, tail) - offsetof(RingIndices, head), kCacheLine);
  EXPECT_EQ(offsetof(RingIndices, sleeping) - offsetof(RingIndices, tail), kCacheLine);
  EXPECT_EQ(offsetof(ControlBlock, sq) % kCacheLine, 0u);
  EXPECT_EQ(offsetof(ControlBlock, cq) % kCacheLine, 0u);
}

TEST(Ring, CheckRejectsCorruptControlBlocks) {
  auto g = Geometry::make(16, 4096);
  Mapping m(*g);
  EXPECT_TRUE(check(m.mem, m.bytes).ok());
  EXPECT_FALSE(check(m.mem, m.bytes - 4096).ok()) << "mapping smaller than the geometry";
  static_cast<ControlBlock*>(m.mem)->cq_offset += 64;
  EXPECT_FALSE(check(m.mem, m.bytes).ok());
  static_cast<ControlBlock*>(m.mem)->magic = 0;
  EXPECT_FALSE(check(m.mem, m.bytes).ok());
}

TEST(Ring, FullRingRefusesWithoutLoss) {
  auto g = Geometry::make(8, 0);
  Mapping m(*g);
  Channel c = channel(m.mem, *g);
  SubmitEntry e{};
  for (uint64_t i = 0; i < 8; ++i) {
    e.id = i;
    ASSERT_TRUE(c.sq.try_push(e));
  }
  e.id = 8;
  EXPECT_FALSE(c.sq.try_push(e)) << "a full ring must refuse";
  for (uint64_t i = 0; i < 8; ++i) {
    const SubmitEntry* p = c.sq.peek();
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->id, i);
    c.sq.pop();
  }
  EXPECT_EQ(c.sq.peek(), nullptr);
  EXPECT_TRUE(c.sq.try_push(e));
}

TEST(Ring, SleepHandshake) {
  auto g = Geometry::make(8, 0);
  Mapping m(*g);
  Channel c = channel(m.mem, *g);
  CompletionEntry e{};
  EXPECT_TRUE(c.cq.try_push(e));
  EXPECT_FALSE(c.cq.consumer_needs_doorbell()) << "awake consumer: no doorbell";
  EXPECT_FALSE(c.cq.prepare_sleep()) << "work pending: must not sleep";
  c.cq.pop();
  EXPECT_TRUE(c.cq.prepare_sleep());
  EXPECT_TRUE(c.cq.try_push(e));
  EXPECT_TRUE(c.cq.consumer_needs_doorbell()) << "sleeping consumer: doorbell";
  c.cq.end_sleep();
  EXPECT_EQ(c.cq.doorbells(), 1u);
}

TEST(Ring, TwoThreadsWithDoorbellsLoseNothing) {
  auto g = Geometry::make(16, 0);
  Mapping m(*g);
  Channel c = channel(m.mem, *g);
  int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ASSERT_GE(efd, 0);
  constexpr uint64_t kN = 200000;
  std::thread consumer([&] {
    uint64_t next = 0;
    while (next < kN) {
      const SubmitEntry* p = c.sq.peek();
      if (!p) {
        if (c.sq.prepare_sleep()) {
          wait_doorbell(efd, 100000);
          c.sq.end_sleep();
        }
        continue;
      }
      ASSERT_EQ(p->id, next);
      ASSERT_EQ(p->args[0], next * 3 + 1);
      c.sq.pop();
      ++next;
    }
  });
  SubmitEntry e{};
  for (uint64_t i = 0; i < kN; ++i) {
    e.id = i;
    e.args[0] = i * 3 + 1;
    while (!c.sq.try_push(e)) std::this_thread::yield();
    if (c.sq.consumer_needs_doorbell()) ring_doorbell(efd);
  }
  consumer.join();
  ::close(efd);
}

}  // namespace
}  // namespace kvferry::ring
