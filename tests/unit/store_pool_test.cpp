#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "kvferry/store/host_pool.h"

namespace kvferry::store {
namespace {

std::unique_ptr<HostPool> make_pool(uint64_t capacity, uint64_t chunk) {
  HostPool::Options o;
  o.capacity = capacity;
  o.chunk_bytes = chunk;
  o.pin = false;
  auto p = HostPool::create(o);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return std::move(p).value();
}

TEST(HostPool, SlotsAreDistinctAlignedAndInside) {
  auto pool = make_pool(1 << 20, 256 << 10);  // 4 chunks of 256 KiB
  std::set<uint64_t> offsets;
  std::vector<Slot> slots;
  for (int i = 0; i < 16; ++i) {  // 64 KiB slots: 4 per chunk
    auto s = pool->allocate(60000);
    ASSERT_TRUE(s.ok()) << i << ": " << s.status().to_string();
    EXPECT_EQ(s->bytes, 61440u);
    EXPECT_EQ(s->offset % HostPool::kSlotAlign, 0u);
    EXPECT_LE(s->offset + s->bytes, pool->capacity());
    EXPECT_TRUE(offsets.insert(s->offset).second);
    std::memset(pool->data(*s), i + 1, s->bytes);  // writable
    slots.push_back(*s);
  }
  EXPECT_EQ(pool->used_bytes(), 16u * 61440u);
  auto full = pool->allocate(60000);
  EXPECT_EQ(full.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("host pool full"), std::string::npos);
  EXPECT_FALSE(pool->can_allocate(60000));
  pool->release(slots[5]);
  EXPECT_TRUE(pool->can_allocate(60000));
  auto again = pool->allocate(60000);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->offset, slots[5].offset);
}

TEST(HostPool, SizeClassesUseSeparateChunksAndFreeChunksReturn) {
  auto pool = make_pool(2 << 20, 1 << 20);  // 2 chunks
  auto a = pool->allocate(4096);
  ASSERT_TRUE(a.ok());
  auto b = pool->allocate(1 << 20);  // other size class: the second chunk
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(pool->allocate(8192).status().code(), ErrorCode::kResourceExhausted);
  pool->release(*a);  // chunk 0 empty again: any class may take it
  auto c = pool->allocate(8192);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
}

TEST(HostPool, RejectsBlocksLargerThanAChunkOrEmpty) {
  auto pool = make_pool(4 << 20, 1 << 20);
  auto big = pool->allocate((1 << 20) + 1);
  EXPECT_EQ(big.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("1048577"), std::string::npos);
  EXPECT_EQ(pool->allocate(0).status().code(), ErrorCode::kInvalidArgument);
}

TEST(HostPool, BadChunkSizeIsAnError) {
  HostPool::Options o;
  o.capacity = 1 << 20;
  o.chunk_bytes = 1000;
  EXPECT_EQ(HostPool::create(o).status().code(), ErrorCode::kInvalidArgument);
}

TEST(HostPool, ReportsPopulationProgress) {
  HostPool::Options o;
  o.capacity = 4 << 20;
  o.chunk_bytes = 1 << 20;
  o.pin = false;
  uint64_t last = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_EQ(total, 4u << 20);
    EXPECT_GT(done, last);
    last = done;
  };
  auto p = HostPool::create(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(last, 4u << 20);
}

}  // namespace
}  // namespace kvferry::store
