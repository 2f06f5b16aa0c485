// Offload and reload through kvferryd (daemon in its own process, CPU backend): round trips,
// other block ids, format conversion on load, eviction under pressure, checksum failures,
// namespaces, a client killed mid-save, and the HTTP metrics.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <regex>

#include "daemon_harness.h"
#include "test_blocks.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/kvferry.h"
#include "kvferry/kernels/convert.h"
#include "kvferry/layouts/dtype.h"

namespace kvferry {
namespace {

using testing::block_equal;
using testing::create;
using testing::DaemonProcess;
using testing::fill_bytes;
using testing::fill_mla;
using testing::http_get;
using testing::metric;
using testing::Region;
using testing::run_in_child;
using testing::snapshot;
using testing::wait_until;
using namespace std::chrono_literals;

constexpr const char* kSmallPool = "tiers:\n  host:\n    capacity: 64MiB\n";

std::unique_ptr<Client> connect(const DaemonProcess& d, const std::string& model = "m",
                                const std::string& tenant = "") {
  return testing::connect_client(d, "offload-test", model, tenant);
}

KvCacheSpec spec_of(EntryFormat f, int64_t layers = 2, int64_t blocks = 16, int64_t bs = 16) {
  return {layers, blocks, bs, f, Layout::kBlockMajor};
}

constexpr testing::TestKeys kKeys{0x1234000000000000ull};

class OffloadIt : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = std::make_unique<DaemonProcess>(kSmallPool, std::vector<std::string>{}, "cpu",
                                         std::vector<std::string>{"--enable-test-faults", "--metrics-listen", ""});
    ASSERT_TRUE(d_->ready()) << d_->log();
  }
  std::unique_ptr<DaemonProcess> d_;
};

TEST_F(OffloadIt, RoundTripOneManyAllIntoOtherBlockIds) {
  auto c = connect(*d_);
  ASSERT_TRUE(c);
  Region r = create(*c, "rt", spec_of(EntryFormat::mla_bf16()));
  fill_bytes(r, 1);
  const auto ref = snapshot(r);
  const int64_t nb = r.spec.blocks;
  for (int64_t n : {int64_t{1}, int64_t{5}, nb}) {
    SCOPED_TRACE("blocks " + std::to_string(n));
    const auto keys = kKeys.keys(n, static_cast<uint64_t>(n));
    std::vector<int64_t> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      src[i] = i;
      dst[i] = nb - 1 - i;  // reversed: every block lands elsewhere (but the middle of an odd n)
    }
    std::memcpy(r.base, ref.data(), ref.size());
    auto sv = c->save(r.id, keys, src);
    ASSERT_TRUE(sv.ok()) << sv.status().to_string();
    EXPECT_EQ(sv->status, ErrorCode::kOk);
    EXPECT_EQ(sv->done, n);
    ASSERT_EQ(sv->blocks.size(), static_cast<size_t>(n));
    auto lk = c->lookup(r.id, keys);
    ASSERT_TRUE(lk.ok());
    EXPECT_EQ(lk->result[0], static_cast<uint64_t>(n)) << "longest hit prefix";
    std::memset(r.base, 0x5a, ref.size());
    auto ld = c->load(r.id, keys, dst);
    ASSERT_TRUE(ld.ok()) << ld.status().to_string();
    EXPECT_EQ(ld->done, n) << d_->log();
    for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(block_equal(r, dst[i], ref, src[i])) << "block " << i;
    // Blocks that were not loaded into stay as the wipe left them.
    if (n < nb) {
      EXPECT_EQ(r.page(0, 0)[0], 0x5a);
    }
  }
  // A saved key that is saved again is fine (already stored), and a miss loads nothing.
  std::memset(r.base, 0x5a, ref.size());
  const ops::Key unknown = kKeys.key(999, 999);
  const std::vector<ops::Key> mixed = {kKeys.key(0, 1), unknown};
  const std::vector<int64_t> ids = {3, 4};
  auto ld = c->load(r.id, mixed, ids);
  ASSERT_TRUE(ld.ok());
  ASSERT_EQ(ld->blocks.size(), 2u);
  EXPECT_EQ(ld->blocks[0], ErrorCode::kOk);
  EXPECT_EQ(ld->blocks[1], ErrorCode::kNotFound);
  EXPECT_EQ(ld->status, ErrorCode::kNotFound);
  EXPECT_EQ(ld->done, 1u);
  EXPECT_EQ(r.page(0, 4)[0], 0x5a) << "a miss wrote nothing";
  // Bad block ids get a per-block error, not a crash.
  const std::vector<int64_t> bad = {-1, 999};
  auto sv = c->save(r.id, mixed, bad);
  ASSERT_TRUE(sv.ok());
  EXPECT_EQ(sv->done, 0u);
  for (auto code : sv->blocks) EXPECT_NE(code, ErrorCode::kOk);
}

TEST_F(OffloadIt, LoadConvertsBetweenMlaFormats) {
  auto c = connect(*d_);
  ASSERT_TRUE(c);
  struct Pair {
    EntryFormat from, to;
  };
  const Pair pairs[] = {{EntryFormat::mla_fp8(), EntryFormat::mla_fp8_ds()},
                        {EntryFormat::mla_bf16(), EntryFormat::mla_fp8_ds()},
                        {EntryFormat::mla_fp8_ds(), EntryFormat::mla_bf16()}};
  uint64_t salt = 100;
  for (const auto& p : pairs) {
    SCOPED_TRACE(p.from.name() + " -> " + p.to.name());
    Region a = create(*c, "from-" + p.from.name() + std::to_string(salt), spec_of(p.from));
    Region b = create(*c, "to-" + p.to.name() + std::to_string(salt), spec_of(p.to));
    fill_mla(a, static_cast<uint32_t>(salt));
    const int64_t n = 6;
    const auto keys = kKeys.keys(n, salt++);
    std::vector<int64_t> src = {0, 1, 2, 3, 4, 5}, dst = {10, 11, 12, 13, 14, 15};
    auto sv = c->save(a.id, keys, src);
    ASSERT_TRUE(sv.ok());
    ASSERT_EQ(sv->done, n);
    auto ld = c->load(b.id, keys, dst);
    ASSERT_TRUE(ld.ok());
    EXPECT_EQ(ld->done, n) << d_->log();
    std::vector<uint8_t> want(static_cast<size_t>(b.spec.region_bytes()), 0);
    ASSERT_TRUE(kernels::convert_blocks_cpu(a.base, a.spec, src, want.data(), b.spec, dst).ok());
    for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(block_equal(b, dst[i], want, dst[i])) << "block " << i;
  }
  // An unsupported pair (bf16 stored, mla_fp8 region): a clear per-block error, nothing written.
  Region a = create(*c, "u-from", spec_of(EntryFormat::mla_bf16()));
  Region b = create(*c, "u-to", spec_of(EntryFormat::mla_fp8()));
  fill_mla(a, 7);
  std::memset(b.base, 0x77, static_cast<size_t>(b.spec.region_bytes()));
  const auto keys = kKeys.keys(2, 777);
  const std::vector<int64_t> ids = {0, 1};
  ASSERT_EQ(c->save(a.id, keys, ids)->done, 2u);
  auto ld = c->load(b.id, keys, ids);
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->done, 0u);
  for (auto code : ld->blocks) EXPECT_EQ(code, ErrorCode::kUnsupported);
  EXPECT_EQ(b.base[0], 0x77);
  EXPECT_NE(d_->log().find("no conversion from the stored format mla_bf16"), std::string::npos) << d_->log();
}

TEST_F(OffloadIt, EvictionUnderPressureMissesNeverWrongBytes) {
  auto c = connect(*d_);
  ASSERT_TRUE(c);
  // Blocks of 2 x 64 tokens x 1152 B = 144 KiB; 64 MiB of pool holds ~440 of them.
  Region r = create(*c, "ev", spec_of(EntryFormat::mla_bf16(), 2, 64, 64));
  const int64_t rounds = 12;  // 12 x 64 blocks = 108 MiB saved through a 64 MiB pool
  const auto pinned = kKeys.keys(2, 5000);
  std::vector<std::vector<uint8_t>> refs;
  for (int64_t k = 0; k < rounds; ++k) {
    fill_bytes(r, static_cast<uint32_t>(k + 10));
    refs.push_back(snapshot(r));
    std::vector<int64_t> ids(64);
    std::iota(ids.begin(), ids.end(), 0);
    auto sv = c->save(r.id, kKeys.keys(64, static_cast<uint64_t>(k)), ids);
    ASSERT_TRUE(sv.ok());
    EXPECT_EQ(sv->done, 64u) << "round " << k << ": the index evicts to make room";
    if (k == 0) {  // pin two blocks of the first round under their own keys
      const std::vector<int64_t> two = {0, 1};
      ASSERT_EQ(c->save(r.id, pinned, two)->done, 2u);
      auto pn = c->pin(r.id, pinned);
      ASSERT_TRUE(pn.ok());
      EXPECT_EQ(pn->done, 2u);
    }
  }
  auto st = c->stats();
  ASSERT_TRUE(st.ok());
  EXPECT_GT(st->evictions, 0u);
  EXPECT_LE(st->used_bytes, st->capacity_bytes);
  EXPECT_EQ(st->pinned, 2u);
  // Every block of every round: either a miss or exactly the bytes saved.
  int64_t hits = 0, misses = 0;
  for (int64_t k = 0; k < rounds; ++k) {
    std::memset(r.base, 0, static_cast<size_t>(r.spec.region_bytes()));
    std::vector<int64_t> ids(64);
    std::iota(ids.begin(), ids.end(), 0);
    auto ld = c->load(r.id, kKeys.keys(64, static_cast<uint64_t>(k)), ids);
    ASSERT_TRUE(ld.ok());
    for (int64_t i = 0; i < 64; ++i) {
      if (ld->blocks[i] == ErrorCode::kOk) {
        ++hits;
        EXPECT_TRUE(block_equal(r, i, refs[k], i)) << "round " << k << " block " << i;
      } else {
        ++misses;
        EXPECT_EQ(ld->blocks[i], ErrorCode::kNotFound);
      }
    }
  }
  EXPECT_GT(misses, 0);
  EXPECT_GT(hits, 0);
  // The pinned blocks of the first round survived.
  const std::vector<int64_t> two = {5, 6};
  auto ld = c->load(r.id, pinned, two);
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->done, 2u);
  EXPECT_TRUE(block_equal(r, 5, refs[0], 0));
  // Evicting a pinned block keeps it (busy); after unpin it goes.
  auto ev = c->evict(r.id, pinned);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->blocks[0], ErrorCode::kBusy);
  ASSERT_EQ(c->unpin(r.id, pinned)->done, 2u);
  ev = c->evict(r.id, pinned);
  EXPECT_EQ(ev->result[0], 2u);
  EXPECT_EQ(c->lookup(r.id, pinned)->done, 0u);
}

TEST_F(OffloadIt, CorruptedHostSlotIsDetectedNotReturned) {
  auto c = connect(*d_);
  ASSERT_TRUE(c);
  Region r = create(*c, "cs", spec_of(EntryFormat::mla_bf16()));
  fill_bytes(r, 3);
  const auto keys = kKeys.keys(3, 42);
  const std::vector<int64_t> ids = {0, 1, 2}, dst = {8, 9, 10};
  ASSERT_EQ(c->save(r.id, keys, ids)->done, 3u);
  auto k = c->corrupt_for_test(r.id, keys[1], 1000);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->status, ErrorCode::kOk);
  const auto ref = snapshot(r);
  std::memset(r.base + r.spec.page_offset(0, 8), 0x11, static_cast<size_t>(3 * r.spec.block_bytes()));
  auto ld = c->load(r.id, keys, dst);
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->blocks[0], ErrorCode::kOk);
  EXPECT_EQ(ld->blocks[1], ErrorCode::kChecksumMismatch);
  EXPECT_EQ(ld->blocks[2], ErrorCode::kOk);
  EXPECT_EQ(ld->status, ErrorCode::kChecksumMismatch);
  EXPECT_TRUE(block_equal(r, 8, ref, 0));
  EXPECT_TRUE(block_equal(r, 10, ref, 2));
  EXPECT_EQ(r.page(0, 9)[0], 0x11) << "the damaged copy never reached the region";
  // Dropped: a later lookup misses it.
  auto lk = c->lookup(r.id, keys);
  EXPECT_EQ(lk->blocks[1], ErrorCode::kNotFound);
  EXPECT_EQ(c->stats()->checksum_failures, 1u);
}

TEST(OffloadFaults, TheFaultKnobNeedsItsSwitch) {
  DaemonProcess d(kSmallPool, {}, "cpu", {"--metrics-listen", ""});
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "nf", spec_of(EntryFormat::mla_bf16()));
  const auto keys = kKeys.keys(1);
  const std::vector<int64_t> ids = {0};
  ASSERT_EQ(c->save(r.id, keys, ids)->done, 1u);
  auto k = c->corrupt_for_test(r.id, keys[0], 0);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->status, ErrorCode::kUnsupported);
  EXPECT_EQ(c->load(r.id, keys, ids)->done, 1u);
}

TEST_F(OffloadIt, NamespacesShareWithinAndNeverAcross) {
  auto a = connect(*d_, "llama", "t1");
  auto b = connect(*d_, "llama", "t1");
  auto other_model = connect(*d_, "qwen", "t1");
  auto other_tenant = connect(*d_, "llama", "t2");
  ASSERT_TRUE(a && b && other_model && other_tenant);
  Region ra = create(*a, "ns", spec_of(EntryFormat::mla_bf16()));
  fill_bytes(ra, 9);
  const auto ref = snapshot(ra);
  const auto keys = kKeys.keys(4, 77);
  const std::vector<int64_t> ids = {0, 1, 2, 3};
  ASSERT_EQ(a->save(ra.id, keys, ids)->done, 4u);
  // b maps the same region (same format family) and shares the hits.
  Region rb;
  rb.id = ra.id;
  rb.spec = ra.spec;
  rb.base = static_cast<uint8_t*>(*b->map_region(ra.id));
  EXPECT_EQ(b->lookup(rb.id, keys)->done, 4u);
  std::memset(rb.base, 0, ref.size());
  const std::vector<int64_t> dst = {12, 13, 14, 15};
  EXPECT_EQ(b->load(rb.id, keys, dst)->done, 4u);
  EXPECT_TRUE(block_equal(rb, 12, ref, 0));
  // Another model or another tenant: the same keys miss.
  for (Client* c : {other_model.get(), other_tenant.get()}) {
    ASSERT_TRUE(c->map_region(ra.id).ok());
    auto lk = c->lookup(ra.id, keys);
    ASSERT_TRUE(lk.ok());
    EXPECT_EQ(lk->done, 0u);
    EXPECT_EQ(lk->result[0], 0u);
    EXPECT_EQ(c->load(ra.id, keys, dst)->done, 0u);
  }
  // A region of another family (MHA) never sees MLA blocks of the same model.
  Region mha = create(*a, "mha", spec_of(EntryFormat::mha(2, 64, DType::kBF16), 2, 16, 16));
  EXPECT_EQ(a->lookup(mha.id, keys)->done, 0u);
  // ls names the namespace.
  auto ls = a->ls(ra.id);
  ASSERT_TRUE(ls.ok());
  ASSERT_EQ(ls->size(), 4u);
  EXPECT_STREQ((*ls)[0].ns, "llama|mla|t1");
}

TEST_F(OffloadIt, KilledClientMidSaveLeavesNoPinNorHalfBlock) {
  const KvCacheSpec spec = spec_of(EntryFormat::mla_bf16(), 4, 128, 64);  // 288 KiB blocks, 36 MiB
  const int64_t nb = spec.blocks;
  int rc = run_in_child([&] {
    Client::Options o;
    o.socket = d_->socket();
    o.model = "kill";
    auto c = Client::connect(o);
    if (!c.ok()) return 2;
    Region r = create(**c, "victim", spec);
    if (!r.base) return 3;
    fill_bytes(r, 31);
    const auto first = kKeys.keys(4, 1);
    const std::vector<int64_t> ids = {0, 1, 2, 3};
    auto sv = (*c)->save(r.id, first, ids);
    if (!sv.ok() || sv->done != 4) return 4;
    if ((*c)->pin(r.id, first)->done != 4) return 5;
    // Queue big saves and die while they run.
    std::vector<int64_t> all(static_cast<size_t>(nb));
    std::iota(all.begin(), all.end(), 0);
    for (uint64_t s = 2; s < 6; ++s)
      if (!(*c)->submit_save(r.id, kKeys.keys(nb, s), all).ok()) return 6;
    ::raise(SIGKILL);
    return 7;
  });
  EXPECT_EQ(rc, 128 + SIGKILL);
  auto c = connect(*d_, "kill");
  ASSERT_TRUE(c);
  // Once the daemon has seen the death and the saves drained: no pins, nothing half-written.
  ASSERT_TRUE(wait_until(
      [&] {
        auto s = c->stats();
        return s.ok() && s->pinned == 0 && s->writing == 0 && s->clients == 1;
      },
      10s))
      << d_->log();
  // Every block that is visible holds exactly the bytes the child wrote.
  Region r = create(*c, "check", spec);
  std::vector<uint8_t> ref(static_cast<size_t>(spec.region_bytes()));
  {
    Region tmp = r;
    tmp.base = ref.data();
    fill_bytes(tmp, 31);
  }
  size_t visible = 0;
  for (uint64_t s = 1; s < 6; ++s) {
    const auto keys = kKeys.keys(s == 1 ? 4 : nb, s);
    std::vector<int64_t> ids(keys.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::memset(r.base, 0, ref.size());
    auto ld = c->load(r.id, keys, ids);
    ASSERT_TRUE(ld.ok());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (ld->blocks[i] == ErrorCode::kNotFound) continue;
      ASSERT_EQ(ld->blocks[i], ErrorCode::kOk);
      ++visible;
      EXPECT_TRUE(block_equal(r, static_cast<int64_t>(i), ref, static_cast<int64_t>(i)))
          << "set " << s << " block " << i;
    }
  }
  EXPECT_GE(visible, 4u) << "the blocks saved before the kill stay";
  // The pins of the dead client are gone: none of its pinned blocks is kept as busy (they were
  // evicted under the pressure of the later saves, or go now).
  auto ev = c->evict(r.id, kKeys.keys(4, 1));
  ASSERT_TRUE(ev.ok());
  for (auto code : ev->blocks)
    EXPECT_TRUE(code == ErrorCode::kOk || code == ErrorCode::kNotFound) << error_code_name(code);
}

TEST(OffloadLookups, LookupsDoNotWaitBehindTransfers) {
  // Each save's copy waits 500 ms first (--test-copy-delay-ms), so the three saves below hold both
  // data workers for a second or more however fast this machine copies, while a lookup takes
  // microseconds: a lookup that waited behind them would come back after the last one.
  DaemonProcess d(kSmallPool, {}, "cpu", {"--metrics-listen", "", "--test-copy-delay-ms", "500"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto a = connect(d, "busy");
  auto b = connect(d, "busy");
  ASSERT_TRUE(a && b);
  // Saves of 128 blocks of 2 x 64 tokens x 1152 B = 18 MiB each (three fit the 64 MiB pool, so
  // nothing is evicted).
  const KvCacheSpec spec = spec_of(EntryFormat::mla_bf16(), 2, 128, 64);
  Region r = create(*a, "busy", spec);
  fill_bytes(r, 4);
  ASSERT_TRUE(b->map_region(r.id).ok());
  const auto small = kKeys.keys(4, 900);
  const std::vector<int64_t> four = {0, 1, 2, 3};
  ASSERT_EQ(a->save(r.id, small, four)->done, 4u);
  std::vector<int64_t> all(128);
  std::iota(all.begin(), all.end(), 0);
  std::vector<uint64_t> ids;
  for (uint64_t s = 901; s < 904; ++s) {  // queued behind one another on two workers
    auto id = a->submit_save(r.id, kKeys.keys(128, s), all);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  auto lk = b->lookup(r.id, small, 5'000'000);
  ASSERT_TRUE(lk.ok());
  EXPECT_EQ(lk->done, 4u);
  // The lookup came back while the last save was still queued or running.
  auto last = a->wait_op(ids.back(), 0);
  EXPECT_FALSE(last.ok()) << "the saves finished before a lookup that was submitted after them";
  if (!last.ok()) {
    EXPECT_EQ(last.status().code(), ErrorCode::kTimeout);
  }
  for (uint64_t id : ids) {
    auto w = a->wait_op(id, 30'000'000);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_EQ(w->done, 128u);
  }
}

// limits.request_timeout on data ops: a save slower than it stores nothing and says why, a load
// slower than it writes nothing; SIGHUP raises the limit and the same save then succeeds.
TEST(OffloadTimeout, SlowOpsFailWithATimeoutAndLeaveNothingHalfVisible) {
  const std::string base = "tiers:\n  host:\n    capacity: 64MiB\nlimits:\n  request_timeout: ";
  DaemonProcess d(base + "150ms\n", {}, "cpu", {"--metrics-listen", "", "--test-copy-delay-ms", "400"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "to", spec_of(EntryFormat::mla_bf16()));
  fill_bytes(r, 77);
  const auto ref = snapshot(r);
  const auto keys = kKeys.keys(4, 77);
  const std::vector<int64_t> src = {0, 1, 2, 3}, dst = {8, 9, 10, 11};
  auto sv = c->save(r.id, keys, src);
  ASSERT_TRUE(sv.ok()) << sv.status().to_string();
  EXPECT_EQ(sv->status, ErrorCode::kTimeout);
  EXPECT_EQ(sv->done, 0u);
  for (auto code : sv->blocks) EXPECT_EQ(code, ErrorCode::kTimeout);
  EXPECT_EQ(c->lookup(r.id, keys)->done, 0u) << "nothing of a timed-out save is visible";
  auto st = c->stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->entries, 0u);
  EXPECT_EQ(st->writing, 0u) << "no reservation is left behind";
  // A longer limit through SIGHUP: the save goes through, then a load times out again once the
  // limit is short, leaving its target blocks as they were.
  d.write_config(base + "5s\n");
  ::kill(d.pid(), SIGHUP);
  ASSERT_TRUE(wait_until([&] { return d.log().find("applying 'limits.request_timeout'") != std::string::npos; }, 5s))
      << d.log();
  sv = c->save(r.id, keys, src);
  ASSERT_TRUE(sv.ok());
  EXPECT_EQ(sv->done, 4u) << d.log();
  d.write_config(base + "150ms\n");
  ::kill(d.pid(), SIGHUP);
  ASSERT_TRUE(wait_until(
      [&] {
        const std::string log = d.log();
        return log.find("applying 'limits.request_timeout'") != log.rfind("applying 'limits.request_timeout'");
      },
      5s))
      << d.log();
  auto ld = c->load(r.id, keys, dst);
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->status, ErrorCode::kTimeout);
  EXPECT_EQ(ld->done, 0u);
  EXPECT_EQ(snapshot(r), ref) << "a timed-out load wrote nothing";
  EXPECT_EQ(c->lookup(r.id, keys)->done, 4u) << "the stored blocks stay";
}

// The reloadable watermarks reach the running index: lowering them evicts at once (pinned blocks
// stay), and saves afterwards keep the pool under the new high mark.
TEST(OffloadReload, SighupReappliesTheWatermarks) {
  const std::string pool = "tiers:\n  host:\n    capacity: 64MiB\n";
  DaemonProcess d(pool, {}, "cpu", {"--metrics-listen", ""});
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "wm", spec_of(EntryFormat::mla_bf16(), 2, 64, 64));  // 144 KiB blocks
  fill_bytes(r, 5);
  std::vector<int64_t> ids(64);
  std::iota(ids.begin(), ids.end(), 0);
  for (uint64_t k = 0; k < 3; ++k) ASSERT_EQ(c->save(r.id, kKeys.keys(64, k), ids)->done, 64u);  // 27 MiB
  const auto pinned = kKeys.keys(2, 0);                                                          // the oldest blocks
  ASSERT_EQ(c->pin(r.id, pinned)->done, 2u);
  auto before = c->stats();
  ASSERT_TRUE(before.ok());
  const double cap = static_cast<double>(before->capacity_bytes);
  ASSERT_GT(static_cast<double>(before->used_bytes), 0.3 * cap);
  d.write_config(pool + "    high_watermark: 0.3\n    low_watermark: 0.2\n");
  ::kill(d.pid(), SIGHUP);
  ASSERT_TRUE(wait_until([&] { return d.log().find("watermarks now 0.3 / 0.2") != std::string::npos; }, 5s)) << d.log();
  auto after = c->stats();
  ASSERT_TRUE(after.ok());
  EXPECT_LE(static_cast<double>(after->used_bytes), 0.2 * cap) << "evicted down to the new low mark at once";
  EXPECT_GT(after->evictions, before->evictions);
  EXPECT_EQ(c->lookup(r.id, pinned)->done, 2u) << "pinned blocks are never evicted";
  for (uint64_t k = 3; k < 6; ++k) ASSERT_EQ(c->save(r.id, kKeys.keys(64, k), ids)->done, 64u);
  auto later = c->stats();
  ASSERT_TRUE(later.ok());
  EXPECT_LE(static_cast<double>(later->used_bytes), 0.3 * cap + 64 * 147456.0) << "the new high mark holds";
  // An invalid pair is refused by the config loader: the running values stay.
  d.write_config(pool + "    high_watermark: 0.2\n    low_watermark: 0.5\n");
  ::kill(d.pid(), SIGHUP);
  ASSERT_TRUE(wait_until([&] { return d.log().find("reload failed") != std::string::npos; }, 5s)) << d.log();
}

TEST(OffloadMetrics, MetricsAndHealthzOverHttpMove) {
  DaemonProcess d(kSmallPool, {}, "cpu", {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(d.ready()) << d.log();
  std::smatch m;
  const std::string log = d.log();
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(metrics on \S+ \(port (\d+)\))"))) << log;
  const uint16_t port = static_cast<uint16_t>(std::stoi(m[1]));
  const std::string health = http_get(port, "/healthz");
  EXPECT_NE(health.find("200 OK"), std::string::npos) << health;
  EXPECT_NE(health.find("ok"), std::string::npos);
  const std::string before = http_get(port, "/metrics");
  EXPECT_EQ(metric(before, "kvferry_blocks_saved_total{tier=\"host\"}"), 0) << before;
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "metrics", spec_of(EntryFormat::mla_bf16()));
  fill_bytes(r, 5);
  const auto keys = kKeys.keys(3);
  const std::vector<int64_t> ids = {0, 1, 2};
  ASSERT_EQ(c->save(r.id, keys, ids)->done, 3u);
  ASSERT_EQ(c->load(r.id, keys, ids)->done, 3u);
  std::vector<ops::Key> probe = keys;
  probe.push_back(kKeys.key(12345, 6789));
  ASSERT_TRUE(c->lookup(r.id, probe).ok());
  const std::string after = http_get(port, "/metrics");
  EXPECT_EQ(metric(after, "kvferry_blocks_saved_total{tier=\"host\"}"), 3) << after;
  EXPECT_EQ(metric(after, "kvferry_blocks_loaded_total{tier=\"host\"}"), 3);
  EXPECT_EQ(metric(after, "kvferry_bytes_saved_total{tier=\"host\"}"), 3.0 * r.spec.block_bytes());
  EXPECT_EQ(metric(after, "kvferry_lookups_total{result=\"hit\"}"), 3);
  EXPECT_EQ(metric(after, "kvferry_lookups_total{result=\"miss\"}"), 1);
  EXPECT_EQ(metric(after, "kvferry_clients"), 1);
  EXPECT_GT(metric(after, "kvferry_pool_used_bytes{tier=\"host\"}"), 0);
  EXPECT_EQ(metric(after, "kvferry_ring_op_seconds_count{op=\"save\"}"), 1);
  EXPECT_EQ(metric(after, "kvferry_ring_op_seconds_count{op=\"lookup\"}"), 1);
}

TEST_F(OffloadIt, CliStatsLsEvictAndTheCAbi) {
  // The C ABI: save, lookup, load, stats, ls, evict.
  kvferry_client* cc = nullptr;
  ASSERT_EQ(kvferry_connect_ns(d_->socket().c_str(), "c-abi", "cmodel", "", &cc), 0) << kvferry_last_error();
  uint32_t rid = 0;
  ASSERT_EQ(kvferry_create_region(cc, "cabi", 2, 8, 16, "mla_bf16", 0, &rid), 0) << kvferry_last_error();
  void* base = nullptr;
  ASSERT_EQ(kvferry_map_region(cc, rid, &base), 0);
  Region r{rid, spec_of(EntryFormat::mla_bf16(), 2, 8, 16), static_cast<uint8_t*>(base)};
  fill_bytes(r, 77);
  const auto ref = snapshot(r);
  kvferry_key keys[2] = {{1, 2}, {3, 4}};
  int64_t ids[2] = {0, 1}, dst[2] = {6, 7};
  int16_t st[2] = {-1, -1};
  uint32_t done = 0;
  ASSERT_EQ(kvferry_save(cc, rid, keys, ids, 2, st, &done), 0) << kvferry_last_error();
  EXPECT_EQ(done, 2u);
  uint32_t prefix = 0;
  ASSERT_EQ(kvferry_lookup(cc, rid, keys, 2, st, &prefix), 0);
  EXPECT_EQ(prefix, 2u);
  uint64_t req = 0;
  ASSERT_EQ(kvferry_submit_load(cc, rid, keys, dst, 2, &req), 0);
  ASSERT_EQ(kvferry_wait_op(cc, req, 10'000'000, st, 2, &done, nullptr), 0) << kvferry_last_error();
  EXPECT_EQ(st[0], 0);
  EXPECT_TRUE(block_equal(r, 7, ref, 1));
  kvferry_stats_info si{};
  ASSERT_EQ(kvferry_stats(cc, &si), 0);
  EXPECT_EQ(si.entries, 2u);
  kvferry_ls_entry le[4];
  uint32_t n = 0;
  ASSERT_EQ(kvferry_ls(cc, rid, le, 4, &n), 0);
  EXPECT_EQ(n, 2u);
  // The CLI sees the same store.
  const std::string cli = std::string(KVFERRY_CLI_PATH) + " --socket " + d_->socket();
  auto run = [](const std::string& cmd) {
    std::string out;
    FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
    char buf[512];
    while (p && std::fgets(buf, sizeof buf, p)) out += buf;
    if (p) ::pclose(p);
    return out;
  };
  const std::string stats = run(cli + " stats --json");
  EXPECT_NE(stats.find("\"entries\":2"), std::string::npos) << stats;
  const std::string ls = run(cli + " ls --json");
  EXPECT_NE(ls.find("\"namespace\":\"cmodel|mla|\""), std::string::npos) << ls;
  EXPECT_NE(ls.find("\"key\":\"00000000000000010000000000000002\""), std::string::npos) << ls;
  const std::string ev = run(cli + " evict --all --json");
  EXPECT_NE(ev.find("\"evicted\":2"), std::string::npos) << ev;
  ASSERT_EQ(kvferry_stats(cc, &si), 0);
  EXPECT_EQ(si.entries, 0u);
  kvferry_close(cc);
}

}  // namespace
}  // namespace kvferry
