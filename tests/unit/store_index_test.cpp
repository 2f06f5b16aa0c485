#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "kvferry/store/block_index.h"

namespace kvferry::store {
namespace {

// One block: 1 layer x 100 tokens x 576 B = 57600 B, a 61440 B slot; the pool holds 8.
const BlockShape kShape{1, 100, EntryFormat::mla_fp8()};

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostPool::Options o;
    o.chunk_bytes = 61440;  // one slot per chunk
    o.capacity = 8 * 61440;
    o.pin = false;
    pool_ = std::move(HostPool::create(o)).value();
    index_ = std::make_unique<BlockIndex>(*pool_, BlockIndex::Options{1.0, 1.0});
    ns_ = index_->intern_namespace("model-a|mla_fp8|t0");
  }

  // Saves key k with a byte pattern; returns the Status of reserve.
  Status save(uint64_t k, uint8_t fill) {
    auto r = index_->reserve(NsKey{ns_, {0, k}}, kShape);
    if (!r.ok()) return r.status();
    std::memset(r->data, fill, r->bytes);
    index_->commit(*r, block_checksum(r->data, r->bytes));
    return Status::Ok();
  }

  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<BlockIndex> index_;
  NamespaceId ns_ = 0;
};

// The vectorised checksum is the same XXH3-64 as the baseline build, for every length class XXH3
// distinguishes (0, 1-3, 4-8, 9-16, 17-128, 129-240, long inputs with partial stripes) and
// unaligned starts.
TEST(BlockChecksum, TheFastBuildEqualsTheBaselineBitForBit) {
  std::vector<uint8_t> buf((1 << 20) + 4096);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& b : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  std::vector<size_t> sizes = {0,   1,   3,   4,    8,    9,    16,   17,        128,
                               129, 240, 241, 1023, 1024, 1025, 4096, 65536 + 7, (1 << 20) + 3};
  for (size_t n = 0; n < 300; ++n) sizes.push_back(n * 13 + 5);
  for (size_t off : {0, 1, 7, 64}) {
    for (size_t n : sizes) {
      if (off + n > buf.size()) continue;
      ASSERT_EQ(block_checksum(buf.data() + off, n), block_checksum_baseline(buf.data() + off, n))
          << "offset " << off << " size " << n << " (" << block_checksum_impl() << ")";
    }
  }
  EXPECT_NE(block_checksum(buf.data(), 4096), block_checksum(buf.data() + 1, 4096));
}

TEST_F(IndexTest, BlockIsInvisibleUntilCommitted) {
  auto r = index_->reserve(NsKey{ns_, {0, 1}}, kShape);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->bytes, 57600u);
  const BlockKey k{0, 1};
  EXPECT_EQ(index_->lookup(ns_, {&k, 1}).present[0], 0);
  EXPECT_EQ(index_->acquire(NsKey{ns_, k}).status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(index_->reserve(NsKey{ns_, k}, kShape).status().code(), ErrorCode::kAlreadyExists);
  std::memset(r->data, 7, r->bytes);
  index_->commit(*r, block_checksum(r->data, r->bytes));
  EXPECT_EQ(index_->lookup(ns_, {&k, 1}).present[0], 1);
  auto h = index_->acquire(NsKey{ns_, k});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->meta.checksum, block_checksum(h->data, 57600));
  EXPECT_EQ(h->meta.shape, kShape);
  index_->release(*h);
}

TEST_F(IndexTest, AbortFreesTheSlotAndShowsNothing) {
  auto r = index_->reserve(NsKey{ns_, {0, 9}}, kShape);
  ASSERT_TRUE(r.ok());
  const uint64_t used = pool_->used_bytes();
  index_->abort(*r);
  EXPECT_EQ(pool_->used_bytes(), used - r->slot.bytes);
  const BlockKey k{0, 9};
  EXPECT_EQ(index_->lookup(ns_, {&k, 1}).present[0], 0);
  EXPECT_TRUE(index_->reserve(NsKey{ns_, k}, kShape).ok());  // can be saved again
}

TEST_F(IndexTest, LookupReportsPresenceAndLongestPrefix) {
  ASSERT_TRUE(save(1, 1).ok());
  ASSERT_TRUE(save(2, 2).ok());
  ASSERT_TRUE(save(4, 4).ok());
  std::vector<BlockKey> keys = {{0, 1}, {0, 2}, {0, 3}, {0, 4}};
  auto lr = index_->lookup(ns_, keys);
  EXPECT_EQ(lr.prefix, 2u);
  EXPECT_EQ(lr.present, (std::vector<uint8_t>{1, 1, 0, 1}));
  EXPECT_EQ(index_->lookup(ns_, {}).prefix, 0u);
}

TEST_F(IndexTest, NamespacesNeverShare) {
  ASSERT_TRUE(save(1, 1).ok());
  const NamespaceId other = index_->intern_namespace("model-b|mla_fp8|t0");
  EXPECT_NE(other, ns_);
  EXPECT_EQ(index_->intern_namespace("model-a|mla_fp8|t0"), ns_);
  const BlockKey k{0, 1};
  EXPECT_EQ(index_->lookup(other, {&k, 1}).present[0], 0);
  EXPECT_EQ(index_->acquire(NsKey{other, k}).status().code(), ErrorCode::kNotFound);
}

TEST_F(IndexTest, FullPoolEvictsLeastRecentlyUsedFirst) {
  for (uint64_t k = 0; k < 8; ++k) ASSERT_TRUE(save(k, static_cast<uint8_t>(k)).ok()) << k;
  // Touch 0 so 1 becomes the least recently used.
  const BlockKey k0{0, 0};
  (void)index_->lookup(ns_, {&k0, 1});
  ASSERT_TRUE(save(100, 100).ok());
  std::vector<BlockKey> keys = {{0, 0}, {0, 1}, {0, 2}, {0, 100}};
  auto lr = index_->lookup(ns_, keys);
  EXPECT_EQ(lr.present, (std::vector<uint8_t>{1, 0, 1, 1}));
  EXPECT_EQ(index_->stats().evictions, 1u);
  // The survivor's bytes are intact (eviction never hands out a slot that is still listed).
  auto h = index_->acquire(NsKey{ns_, {0, 2}});
  ASSERT_TRUE(h.ok());
  for (uint64_t i = 0; i < h->meta.bytes; ++i) ASSERT_EQ(h->data[i], 2);
  EXPECT_EQ(block_checksum(h->data, h->meta.bytes), h->meta.checksum);
  index_->release(*h);
}

TEST_F(IndexTest, PinnedAndHeldBlocksAreNeverEvicted) {
  for (uint64_t k = 0; k < 8; ++k) ASSERT_TRUE(save(k, 1).ok());
  for (uint64_t k = 0; k < 7; ++k) ASSERT_TRUE(index_->pin(NsKey{ns_, {0, k}}, 42).ok());
  auto h = index_->acquire(NsKey{ns_, {0, 7}});  // the only unpinned block is held
  ASSERT_TRUE(h.ok());
  auto r = index_->reserve(NsKey{ns_, {0, 50}}, kShape);
  EXPECT_EQ(r.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("pinned or in-use"), std::string::npos);
  EXPECT_EQ(index_->evict_all(std::nullopt), 0u);
  index_->release(*h);
  EXPECT_TRUE(save(50, 5).ok());  // now block 7 can go
  const BlockKey k7{0, 7};
  EXPECT_EQ(index_->lookup(ns_, {&k7, 1}).present[0], 0);
  // A client that goes away releases its pins.
  EXPECT_EQ(index_->stats().pinned, 7u);
  index_->release_client(42);
  EXPECT_EQ(index_->stats().pinned, 0u);
  EXPECT_EQ(index_->evict_all(ns_), 8u);
  EXPECT_EQ(pool_->used_bytes(), 0u);
}

TEST_F(IndexTest, UnpinNeedsThePinningClient) {
  ASSERT_TRUE(save(1, 1).ok());
  const NsKey k{ns_, {0, 1}};
  EXPECT_EQ(index_->pin(NsKey{ns_, {0, 2}}, 1).code(), ErrorCode::kNotFound);
  ASSERT_TRUE(index_->pin(k, 1).ok());
  EXPECT_EQ(index_->unpin(k, 2).code(), ErrorCode::kNotFound);
  EXPECT_EQ(index_->evict(ns_, std::vector<BlockKey>{{0, 1}}), 0u);  // pinned: kept
  EXPECT_TRUE(index_->unpin(k, 1).ok());
  EXPECT_EQ(index_->evict(ns_, std::vector<BlockKey>{{0, 1}}), 1u);
}

TEST_F(IndexTest, WatermarksEvictDownToTheLowMark) {
  index_ = std::make_unique<BlockIndex>(*pool_, BlockIndex::Options{0.75, 0.5});
  ns_ = index_->intern_namespace("n");
  for (uint64_t k = 0; k < 6; ++k) ASSERT_TRUE(save(k, 1).ok()) << k;  // 6/8 = 0.75: not above high
  EXPECT_EQ(index_->stats().evictions, 0u);
  ASSERT_TRUE(save(6, 1).ok());  // 7/8 > 0.75: evict until (used + new) <= 4/8
  EXPECT_EQ(index_->stats().entries, 4u);
  EXPECT_EQ(index_->stats().evictions, 3u);
}

TEST_F(IndexTest, ReloadedWatermarksEvictAtOnceAndKeepPins) {
  for (uint64_t k = 0; k < 6; ++k) ASSERT_TRUE(save(k, static_cast<uint8_t>(k + 1)).ok());
  ASSERT_TRUE(index_->pin(NsKey{ns_, {0, 0}}, 1).ok());  // the least recently used one
  auto bad = index_->set_watermarks(0.3, 0.5);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(index_->watermarks().high_watermark, 1.0) << "a rejected pair changes nothing";
  auto n = index_->set_watermarks(0.5, 0.25);  // 6 of 8 slots used: above 0.5, down to 2 slots
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 4u);
  const BlockKey all[] = {{0, 0}, {0, 1}, {0, 2}, {0, 3}, {0, 4}, {0, 5}};
  EXPECT_EQ(index_->lookup(ns_, all).present, (std::vector<uint8_t>{1, 0, 0, 0, 0, 1}));
  EXPECT_EQ(index_->watermarks().low_watermark, 0.25);
  EXPECT_EQ(*index_->set_watermarks(0.9, 0.8), 0u) << "below the high mark nothing goes";
}

TEST_F(IndexTest, CorruptionKnobFlipsAStoredByte) {
  ASSERT_TRUE(save(1, 3).ok());
  ASSERT_TRUE(index_->corrupt_for_test(NsKey{ns_, {0, 1}}, 10).ok());
  auto h = index_->acquire(NsKey{ns_, {0, 1}});
  ASSERT_TRUE(h.ok());
  EXPECT_NE(block_checksum(h->data, h->meta.bytes), h->meta.checksum);
  index_->release(*h);
  EXPECT_EQ(index_->corrupt_for_test(NsKey{ns_, {0, 1}}, 1 << 20).code(), ErrorCode::kOutOfRange);
}

TEST_F(IndexTest, ConcurrentSaversAndReadersKeepTheIndexConsistent) {
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      for (uint64_t i = 0; i < 200; ++i) {
        const uint64_t k = (i * 7 + static_cast<uint64_t>(t)) % 20;
        auto r = index_->reserve(NsKey{ns_, {1, k}}, kShape);
        if (r.ok()) {
          std::memset(r->data, static_cast<int>(k), r->bytes);
          index_->commit(*r, block_checksum(r->data, r->bytes));
        }
        auto h = index_->acquire(NsKey{ns_, {1, (k + 3) % 20}});
        if (h.ok()) {
          EXPECT_EQ(block_checksum(h->data, h->meta.bytes), h->meta.checksum);
          index_->release(*h);
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  const IndexStats s = index_->stats();
  EXPECT_EQ(s.writing, 0u);
  EXPECT_LE(s.used_bytes, pool_->capacity());
  EXPECT_EQ(s.used_bytes, s.entries * 61440u);
}

TEST_F(IndexTest, ListShowsNamespaceFormatAndSize) {
  ASSERT_TRUE(save(5, 1).ok());
  auto l = index_->list(std::nullopt, 10);
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].ns, "model-a|mla_fp8|t0");
  EXPECT_EQ(l[0].format, "mla_fp8");
  EXPECT_EQ(l[0].bytes, 57600u);
  EXPECT_EQ(l[0].key.hex(), "00000000000000000000000000000005");
  EXPECT_EQ(l[0].tier, "host");
}

// A namespace lives while a lease or a stored block holds it; then its name is forgotten and its
// id reused, so made-up names cannot grow the table. Past the limit, a new name is refused.
TEST(IndexNamespaces, LeasedOrStoredNamespacesLiveTheRestAreForgotten) {
  HostPool::Options o;
  o.chunk_bytes = 61440;
  o.capacity = 4 * 61440;
  o.pin = false;
  auto pool = std::move(HostPool::create(o)).value();
  BlockIndex::Options io{1.0, 1.0};
  io.max_namespaces = 3;
  BlockIndex idx(*pool, io);
  auto a = idx.acquire_namespace("m|mla|a", "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*idx.acquire_namespace("m|mla|a", "a"), *a);  // one id, two leases
  EXPECT_EQ(idx.namespaces(), 1u);
  auto r = idx.reserve(NsKey{*a, {0, 1}}, kShape);
  ASSERT_TRUE(r.ok());
  idx.commit(*r, 0);
  idx.release_namespace(*a);
  idx.release_namespace(*a);
  EXPECT_EQ(idx.namespaces(), 1u) << "a stored block keeps its namespace";
  EXPECT_EQ(idx.list(std::nullopt, 10).at(0).ns, "m|mla|a");
  for (int i = 0; i < 100; ++i) {  // made-up names, each released at once
    auto b = idx.acquire_namespace("m|mla|x" + std::to_string(i), "x");
    ASSERT_TRUE(b.ok());
    idx.release_namespace(*b);
  }
  EXPECT_EQ(idx.namespaces(), 1u);
  auto b = idx.acquire_namespace("b", "b"), c = idx.acquire_namespace("c", "c");
  ASSERT_TRUE(b.ok() && c.ok());
  EXPECT_EQ(idx.acquire_namespace("d", "d").status().code(), ErrorCode::kResourceExhausted);
  idx.release_namespace(*c);
  EXPECT_TRUE(idx.acquire_namespace("d", "d").ok()) << "a forgotten namespace frees its place";
  EXPECT_EQ(idx.evict_all(*a), 1u);
  EXPECT_EQ(idx.namespaces(), 2u) << "the last block of 'a' went, and so did 'a'";
}

// Pins count against the client's account: a client cannot pin past its tenant's bytes quota,
// a second pin of one block by one client costs nothing more, and leaving returns the bytes.
TEST_F(IndexTest, PinnedBytesQuotaHoldsPerAccount) {
  for (uint64_t k = 0; k < 6; ++k) ASSERT_TRUE(save(k, static_cast<uint8_t>(k + 1)).ok());
  const PinAccount acct{77, 3 * 61440};
  for (uint64_t k = 0; k < 3; ++k) ASSERT_TRUE(index_->pin(NsKey{ns_, {0, k}}, 1, acct).ok());
  EXPECT_TRUE(index_->pin(NsKey{ns_, {0, 0}}, 1, acct).ok()) << "pinning a block twice is free";
  EXPECT_EQ(index_->pin(NsKey{ns_, {0, 3}}, 1, acct).code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(index_->pin(NsKey{ns_, {0, 3}}, 2, acct).code(), ErrorCode::kResourceExhausted)
      << "another client of the same account shares its quota";
  EXPECT_TRUE(index_->pin(NsKey{ns_, {0, 3}}, 3, PinAccount{78, 61440}).ok()) << "another account has its own";
  EXPECT_EQ(index_->pinned_bytes(77), 3u * 61440);
  EXPECT_EQ(index_->stats().pinned, 4u);
  ASSERT_TRUE(index_->unpin(NsKey{ns_, {0, 0}}, 1).ok());
  EXPECT_EQ(index_->pinned_bytes(77), 3u * 61440) << "still pinned once";
  ASSERT_TRUE(index_->unpin(NsKey{ns_, {0, 0}}, 1).ok());
  EXPECT_EQ(index_->pinned_bytes(77), 2u * 61440);
  index_->release_client(1);
  EXPECT_EQ(index_->pinned_bytes(77), 0u);
  EXPECT_EQ(index_->stats().pinned, 1u);
  EXPECT_TRUE(index_->pin(NsKey{ns_, {0, 4}}, 2, acct).ok());
}

// The stats are counters kept by every change, equal to a walk of the index.
TEST_F(IndexTest, StatsCountersFollowEveryChange) {
  auto r = index_->reserve(NsKey{ns_, {0, 100}}, kShape);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(index_->stats().writing, 1u);
  index_->abort(*r);
  for (uint64_t k = 0; k < 5; ++k) ASSERT_TRUE(save(k, 1).ok());
  ASSERT_TRUE(index_->pin(NsKey{ns_, {0, 1}}, 9).ok());
  auto s = index_->stats();
  EXPECT_EQ(s.entries, 5u);
  EXPECT_EQ(s.writing, 0u);
  EXPECT_EQ(s.pinned, 1u);
  EXPECT_EQ(index_->evict_all(ns_), 4u);
  s = index_->stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.pinned, 1u);
  index_->release_client(9);
  EXPECT_EQ(index_->stats().pinned, 0u);
}

// Filters by tenant: list and evict_all see only the namespaces a filter accepts.
TEST_F(IndexTest, ListAndEvictAllFilterByTenant) {
  const NamespaceId other = *index_->acquire_namespace("model-a|mla_fp8|t1", "t1");
  ASSERT_TRUE(save(1, 1).ok());
  auto r = index_->reserve(NsKey{other, {0, 2}}, kShape);
  ASSERT_TRUE(r.ok());
  index_->commit(*r, 0);
  auto only_t1 = [](NamespaceId, const std::string&, const std::string& t) { return t == "t1"; };
  auto l = index_->list(only_t1, 10);
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].ns, "model-a|mla_fp8|t1");
  EXPECT_EQ(index_->evict_all(only_t1), 1u);
  EXPECT_EQ(index_->list(std::nullopt, 10).size(), 1u) << "the other tenant's block stays";
}

}  // namespace
}  // namespace kvferry::store
