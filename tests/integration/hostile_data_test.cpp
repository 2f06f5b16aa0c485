// The data path under hostile and careless clients (kvferryd in its own process, CPU backend).
// A raw client speaks the wire protocol itself and maps its rings, so it can do what a buggy or
// malicious engine can: rewrite a submitted slot or the arena while the daemon reads it, point
// requests past the arena, name one destination twice. The daemon must neither crash nor serve
// wrong bytes, and must keep serving everyone else.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/ops.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/connector/ring.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry {
namespace {

using testing::DaemonProcess;
using testing::run_in_child;
using testing::wait_until;
using namespace std::chrono_literals;

constexpr const char* kRegionYaml =
    "regions:\n"
    "  - name: r\n    layers: 2\n    blocks: 32\n    block_size: 16\n    format: mla_bf16\n"
    "  - name: q\n    layers: 2\n    blocks: 32\n    block_size: 16\n    format: mla_fp8\n";

/// A client that speaks the protocol by hand: the handshake, then the raw rings.
struct RawClient {
  UniqueFd sock, ring_fd, sq_efd, cq_efd;
  void* base = nullptr;
  uint64_t bytes = 0;
  ring::Geometry g;
  ring::Channel ch;
  proto::Welcome welcome;

  ~RawClient() {
    if (base) ::munmap(base, bytes);
  }
  static std::unique_ptr<RawClient> connect(const std::string& path, const std::string& tenant = "") {
    auto c = std::make_unique<RawClient>();
    c->sock.reset(testing::connect_raw(path));
    if (!c->sock) return nullptr;
    proto::Hello h;
    h.client_name = "hostile";
    h.pid = static_cast<uint32_t>(::getpid());
    h.has_namespace = true;
    h.model = "m";
    h.tenant = tenant;
    if (!proto::send_frame(c->sock.get(), proto::encode(h)).ok()) return nullptr;
    auto f = proto::recv_frame(c->sock.get(), 5000);
    if (!f.ok() || f->header.type != static_cast<uint16_t>(proto::MsgType::kWelcome) || f->fds.size() != 3)
      return nullptr;
    auto w = proto::decode_welcome(f->payload, f->header.field_mask);
    if (!w.ok()) return nullptr;
    c->welcome = *w;
    c->ring_fd = std::move(f->fds[0]);
    c->sq_efd = std::move(f->fds[1]);
    c->cq_efd = std::move(f->fds[2]);
    c->bytes = w->ring_bytes;
    void* p = ::mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->ring_fd.get(), 0);
    if (p == MAP_FAILED) return nullptr;
    c->base = p;
    auto g = ring::check(p, c->bytes);
    if (!g.ok()) return nullptr;
    c->g = *g;
    c->ch = ring::channel(p, *g);
    return c;
  }
  uint32_t region(const std::string& name) const {
    for (auto& r : welcome.regions)
      if (r.name == name) return r.id;
    return 0;
  }
  ring::SubmitEntry* slots() { return reinterpret_cast<ring::SubmitEntry*>(static_cast<uint8_t*>(base) + g.sq_offset); }
  bool submit(const ring::SubmitEntry& e) {
    if (!ch.sq.try_push(e)) return false;
    if (ch.sq.consumer_needs_doorbell()) ring::ring_doorbell(sq_efd.get());
    return true;
  }
  /// Waits (bounded) for the completion of request `id`, dropping others.
  std::optional<ring::CompletionEntry> wait(uint64_t id, std::chrono::milliseconds timeout = 5s) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      while (const ring::CompletionEntry* c = ch.cq.peek()) {
        const ring::CompletionEntry e = *c;
        ch.cq.pop();
        if (e.id == id) return e;
      }
      std::this_thread::sleep_for(100us);
    }
    return std::nullopt;
  }
  size_t drain() {
    size_t n = 0;
    while (ch.cq.peek()) {
      ch.cq.pop();
      ++n;
    }
    return n;
  }
};

std::vector<ops::Key> keys_for(int64_t n, uint64_t salt) {
  std::vector<ops::Key> k(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    k[static_cast<size_t>(i)] = {salt * 0x9E3779B97F4A7C15ull + 1, static_cast<uint64_t>(i) + 1};
  return k;
}

std::unique_ptr<Client> connect(const DaemonProcess& d, const std::string& tenant = "") {
  Client::Options o;
  o.socket = d.socket();
  o.name = "well-behaved";
  o.model = "m";
  o.tenant = tenant;
  auto c = Client::connect(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string() << "\n" << d.log();
  return c.ok() ? std::move(*c) : nullptr;
}

/// Maps region `name`, fills it with a seeded pattern and returns its base.
uint8_t* map_and_fill(Client& c, const std::string& name, uint32_t seed) {
  auto id = c.find_region(name);
  if (!id.ok()) return nullptr;
  auto b = c.map_region(*id);
  if (!b.ok()) return nullptr;
  auto* base = static_cast<uint8_t*>(*b);
  const auto& desc = c.regions();
  uint64_t bytes = 0;
  for (auto& r : desc)
    if (r.id == *id) bytes = r.bytes;
  std::mt19937 rng(seed);
  for (uint64_t i = 0; i < bytes; ++i) base[i] = static_cast<uint8_t>(rng() | 1);
  return base;
}

bool alive(const DaemonProcess& d) { return ::kill(d.pid(), 0) == 0 && testing::connect_raw(d.socket()) >= 0; }

// A second thread rewrites every submission slot's count and arena_offset, and the arena's block
// lists, while the daemon serves them. Before the daemon copied a slot once, this crashed it
// within a second (a count checked against the arena, then re-read larger).
TEST(HostileData, RewritingSlotsAndArenaAfterSubmitNeverCrashes) {
  DaemonProcess d(kRegionYaml);
  ASSERT_TRUE(d.ready()) << d.log();
  auto raw = RawClient::connect(d.socket());
  ASSERT_TRUE(raw);
  const uint32_t rid = raw->region("r");
  ASSERT_NE(rid, 0u);
  std::atomic<bool> stop{false};
  std::thread racer([&] {
    std::mt19937_64 rng(7);
    ring::SubmitEntry* s = raw->slots();
    const uint32_t n = raw->g.entries;
    uint8_t* arena = raw->ch.arena;
    while (!stop.load(std::memory_order_relaxed)) {
      for (uint32_t i = 0; i < n; ++i) {
        const uint64_t r = rng();
        volatile uint32_t* count = &s[i].count;
        volatile uint32_t* off = &s[i].arena_offset;
        *count = (r & 1) ? static_cast<uint32_t>(r >> 8) : static_cast<uint32_t>(r >> 40) & 0xffff;
        *off = (r & 2) ? static_cast<uint32_t>(r >> 16) : static_cast<uint32_t>(r >> 20) & 0xfff8;
      }
      // Block ids and keys in the first 64 KiB of the arena become random too.
      for (int i = 0; i < 64; ++i) {
        const uint64_t v = rng();
        std::memcpy(arena + (rng() % (65536 - 8)), &v, sizeof v);
      }
    }
  });
  const uint16_t ops_[] = {static_cast<uint16_t>(proto::Op::kLookup),    static_cast<uint16_t>(proto::Op::kSave),
                           static_cast<uint16_t>(proto::Op::kLoad),      static_cast<uint16_t>(proto::Op::kPin),
                           static_cast<uint16_t>(proto::Op::kUnpin),     static_cast<uint16_t>(proto::Op::kEvict),
                           static_cast<uint16_t>(proto::Op::kLs),        static_cast<uint16_t>(proto::Op::kStats),
                           static_cast<uint16_t>(proto::Op::kLoadMapped)};
  uint64_t id = 1, submitted = 0;
  const auto end = std::chrono::steady_clock::now() + 2s;
  std::mt19937 rng(3);
  while (std::chrono::steady_clock::now() < end && submitted < 200000) {
    ring::SubmitEntry e{};
    e.id = id++;
    e.op = ops_[rng() % std::size(ops_)];
    e.region = rid;
    e.count = 1 + rng() % 64;
    e.arena_offset = (rng() % 8) * 4096;
    if (raw->submit(e))
      ++submitted;
    else
      std::this_thread::sleep_for(50us);
    raw->drain();
  }
  stop = true;
  racer.join();
  ASSERT_GT(submitted, 100u);
  ASSERT_TRUE(alive(d)) << "the daemon died under rewritten slots\n" << d.log();

  // Everyone else is still served, byte for byte, in a region the hostile client never named.
  // Until the daemon has seen it leave, its pins (an admin's: no quota) may fill the pool, and its
  // queued saves may churn it: the round trip retries its save until it can pin the blocks, so
  // that eviction cannot turn the check into a miss (a miss would be right, not wrong).
  raw.reset();
  auto c = connect(d, "good");
  ASSERT_TRUE(c);
  uint8_t* base = map_and_fill(*c, "q", 11);
  ASSERT_NE(base, nullptr);
  const auto region = *c->find_region("q");
  const KvCacheSpec spec{2, 32, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  std::vector<uint8_t> before(base, base + spec.region_bytes());
  const auto keys = keys_for(4, 99);
  const std::vector<int64_t> src = {0, 1, 2, 3}, dst = {20, 21, 22, 23};
  bool pinned = false;
  for (int attempt = 0; attempt < 100 && !pinned; ++attempt) {
    auto sv = c->save(region, keys, src, 5'000'000);
    ASSERT_TRUE(sv.ok()) << sv.status().to_string();
    auto pn = c->pin(region, keys, 5'000'000);
    ASSERT_TRUE(pn.ok());
    pinned = pn->done == 4;
    if (!pinned) {  // the hostile client's pins are released once the daemon saw it leave
      (void)c->unpin(region, keys, 5'000'000);
      std::this_thread::sleep_for(100ms);
    }
  }
  if (!pinned) {
    auto st = c->stats(1'000'000);
    ASSERT_TRUE(st.ok());
    FAIL() << "the pool never kept 4 fresh blocks long enough to pin them: " << st->entries << " stored, "
           << st->writing << " being written, " << st->pinned << " pinned, " << st->used_bytes << " of "
           << st->capacity_bytes << " bytes\n"
           << d.log().substr(0, 4000);
  }
  auto ld = c->load(region, keys, dst, 5'000'000);
  ASSERT_TRUE(ld.ok());
  ASSERT_EQ(ld->done, 4u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(0, std::memcmp(base + spec.page_offset(0, dst[i]), before.data() + spec.page_offset(0, src[i]),
                             static_cast<size_t>(spec.block_bytes())))
        << "block " << dst[i];
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// Requests pointing past the arena, misaligned, or with counts that overflow it: each gets its
// own clear status, nothing else happens.
TEST(HostileData, OutOfRangeMisalignedAndOversizedRequestsAreRefused) {
  DaemonProcess d(kRegionYaml);
  ASSERT_TRUE(d.ready()) << d.log();
  auto raw = RawClient::connect(d.socket());
  ASSERT_TRUE(raw);
  const uint32_t rid = raw->region("r");
  const uint32_t arena = raw->ch.arena_bytes;
  struct Case {
    uint16_t op;
    uint32_t count, offset;
    ErrorCode want;
  };
  const uint16_t save = static_cast<uint16_t>(proto::Op::kSave), lookup = static_cast<uint16_t>(proto::Op::kLookup);
  const Case cases[] = {
      {save, 1, 4, ErrorCode::kMisaligned},
      {lookup, 1, arena, ErrorCode::kOutOfRange},
      {lookup, 1, arena - 8, ErrorCode::kOutOfRange},
      {save, 0xffffffffu, 0, ErrorCode::kOutOfRange},
      {lookup, arena / 16, 0, ErrorCode::kOutOfRange},  // keys fit, statuses do not
      {static_cast<uint16_t>(proto::Op::kLs), 0, 0xfffffff8u, ErrorCode::kOutOfRange},
      {static_cast<uint16_t>(proto::Op::kStats), 0, arena - 8, ErrorCode::kOutOfRange},
      // load_mapped: keys, ids and statuses fit, its parts (after them) do not.
      {static_cast<uint16_t>(proto::Op::kLoadMapped), 1,
       arena - static_cast<uint32_t>(ops::request_bytes(static_cast<uint16_t>(proto::Op::kLoadMapped), 1)),
       ErrorCode::kOutOfRange},
  };
  uint64_t id = 100;
  for (const Case& k : cases) {
    SCOPED_TRACE("op " + std::to_string(k.op) + " count " + std::to_string(k.count) + " offset " +
                 std::to_string(k.offset));
    ring::SubmitEntry e{};
    e.id = ++id;
    e.op = k.op;
    e.region = rid;
    e.count = k.count;
    e.arena_offset = k.offset;
    ASSERT_TRUE(raw->submit(e));
    auto c = raw->wait(e.id);
    ASSERT_TRUE(c.has_value()) << d.log();
    EXPECT_EQ(static_cast<ErrorCode>(c->status), k.want);
  }
  // An unknown region and an unknown op.
  ring::SubmitEntry e{};
  e.id = ++id;
  e.op = lookup;
  e.region = 9999;
  e.count = 1;
  ASSERT_TRUE(raw->submit(e));
  auto c = raw->wait(e.id);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(static_cast<ErrorCode>(c->status), ErrorCode::kNotFound);
  e.id = ++id;
  e.op = 63;
  ASSERT_TRUE(raw->submit(e));
  c = raw->wait(e.id);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(static_cast<ErrorCode>(c->status), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(alive(d));
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A load naming one target block twice used to return ok with a mix of both blocks in it. Each
// entry naming a duplicated destination is refused; the others run; the target is untouched.
TEST(HostileData, DuplicateDestinationsAreRefusedPerBlock) {
  DaemonProcess d(kRegionYaml);
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  uint8_t* base = map_and_fill(*c, "r", 5);
  ASSERT_NE(base, nullptr);
  const uint32_t rid = *c->find_region("r");
  const KvCacheSpec spec{2, 32, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  const auto keys = keys_for(3, 7);
  ASSERT_EQ(c->save(rid, keys, std::vector<int64_t>{0, 1, 2})->done, 3u);
  std::memset(base + spec.page_offset(0, 10), 0x5A, static_cast<size_t>(spec.block_bytes() * 2));
  auto ld = c->load(rid, keys, std::vector<int64_t>{10, 10, 11});
  ASSERT_TRUE(ld.ok());
  ASSERT_EQ(ld->blocks.size(), 3u);
  EXPECT_EQ(ld->blocks[0], ErrorCode::kInvalidArgument);
  EXPECT_EQ(ld->blocks[1], ErrorCode::kInvalidArgument);
  EXPECT_EQ(ld->blocks[2], ErrorCode::kOk);
  EXPECT_EQ(ld->done, 1u);
  for (int64_t i = 0; i < spec.block_bytes(); ++i)
    ASSERT_EQ(base[spec.page_offset(0, 10) + i], 0x5A) << "the twice-named target was written at byte " << i;
  EXPECT_EQ(0, std::memcmp(base + spec.page_offset(0, 11), base + spec.page_offset(0, 2),
                           static_cast<size_t>(spec.block_bytes())));
  // A save naming one key twice: neither runs, the third does.
  const auto k2 = keys_for(2, 8);
  const std::vector<ops::Key> dup = {k2[0], k2[0], k2[1]};
  auto sv = c->save(rid, dup, std::vector<int64_t>{3, 4, 5});
  ASSERT_TRUE(sv.ok());
  EXPECT_EQ(sv->blocks[0], ErrorCode::kInvalidArgument);
  EXPECT_EQ(sv->blocks[1], ErrorCode::kInvalidArgument);
  EXPECT_EQ(sv->blocks[2], ErrorCode::kOk);
  EXPECT_EQ(c->lookup(rid, std::vector<ops::Key>{k2[0]})->done, 0u);
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A 656 -> 576 load that turns out lossy reports data_loss and leaves its target as it was
// (it used to overwrite it with the lossy conversion first).
TEST(HostileData, LossyConversionLeavesItsTargetUntouched) {
  DaemonProcess d(
      "regions:\n"
      "  - name: ds\n    layers: 2\n    blocks: 8\n    block_size: 64\n    format: mla_fp8_ds\n"
      "  - name: f8\n    layers: 2\n    blocks: 8\n    block_size: 64\n    format: mla_fp8\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  // Random bytes make tile scales that differ within a token: not representable per tensor.
  uint8_t* src = map_and_fill(*c, "ds", 21);
  ASSERT_NE(src, nullptr);
  const uint32_t ds = *c->find_region("ds"), f8 = *c->find_region("f8");
  auto dst = c->map_region(f8);
  ASSERT_TRUE(dst.ok());
  const KvCacheSpec spec{2, 8, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  auto* out = static_cast<uint8_t*>(*dst);
  std::memset(out, 0x33, static_cast<size_t>(spec.region_bytes()));
  // Keep the fp32 tile scales finite and positive so the source is a valid block.
  const KvCacheSpec sspec{2, 8, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor};
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t b = 0; b < 8; ++b)
      for (int64_t t = 0; t < 64; ++t) {
        uint8_t* e = src + sspec.page_offset(l, b) + t * 656;
        for (int s = 0; s < 4; ++s) {
          const float scale = 0.01f * static_cast<float>(1 + s + t % 7);
          std::memcpy(e + 512 + 4 * s, &scale, 4);
        }
      }
  const auto keys = keys_for(2, 31);
  ASSERT_EQ(c->save(ds, keys, std::vector<int64_t>{0, 1})->done, 2u);
  auto ld = c->load(f8, keys, std::vector<int64_t>{4, 5});
  ASSERT_TRUE(ld.ok());
  for (auto code : ld->blocks) EXPECT_EQ(code, ErrorCode::kDataLoss);
  for (int64_t i = 0; i < spec.region_bytes(); ++i) ASSERT_EQ(out[i], 0x33) << "byte " << i << " was written";
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// One tenant queues many slow saves; another tenant's save submitted after them is served in
// turn, not after the whole queue.
TEST(HostileData, TenantsAreServedInTurn) {
  DaemonProcess d(std::string(kRegionYaml) + "tiers:\n  host:\n    capacity: 256MiB\n", {}, "cpu",
                  {"--test-copy-delay-ms", "150"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto hog = connect(d, "hog");
  auto other = connect(d, "other");
  ASSERT_TRUE(hog && other);
  ASSERT_NE(map_and_fill(*hog, "r", 1), nullptr);
  const uint32_t rid = *hog->find_region("r");
  std::vector<uint64_t> hog_ops;
  for (int i = 0; i < 8; ++i) {
    auto id = hog->submit_save(rid, keys_for(2, 1000 + i), std::vector<int64_t>{2 * i, 2 * i + 1});
    ASSERT_TRUE(id.ok());
    hog_ops.push_back(*id);
  }
  std::this_thread::sleep_for(20ms);  // the hog's saves are queued first
  auto mine = other->submit_save(rid, keys_for(1, 5000), std::vector<int64_t>{31});
  ASSERT_TRUE(mine.ok());
  auto r = other->wait_op(*mine, 10'000'000);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->done, 1u);
  // With 2 workers and 150 ms per save, the hog's queue takes >= 600 ms; served in turn, ours
  // ran within the first rounds, so the hog's last saves are still pending now.
  auto last = hog->wait_op(hog_ops.back(), 0);
  EXPECT_FALSE(last.ok()) << "the other tenant's save waited behind the hog's whole queue";
  for (uint64_t id : hog_ops) EXPECT_TRUE(hog->wait_op(id, 10'000'000).ok());
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// Names of namespaces never seen again do not stay in the daemon: a client inventing a new
// tenant name per connection costs nothing once it leaves (it used to cost ~1 KB per name,
// forever). kvferry_namespaces counts the live ones.
TEST(HostileData, NamespaceTableIsBoundedByWhatIsLive) {
  DaemonProcess d(kRegionYaml, {}, "cpu", {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(d.ready()) << d.log();
  const uint16_t port = testing::metrics_port(d.log());
  ASSERT_NE(port, 0) << d.log();
  auto keeper = connect(d, "keeper");
  ASSERT_TRUE(keeper);
  ASSERT_NE(map_and_fill(*keeper, "r", 9), nullptr);
  const uint32_t rid = *keeper->find_region("r");
  ASSERT_EQ(keeper->save(rid, keys_for(1, 2), std::vector<int64_t>{0})->done, 1u);
  for (int i = 0; i < 40; ++i) {
    auto c = connect(d, "ephemeral-" + std::to_string(i));
    ASSERT_TRUE(c);
    ASSERT_EQ(c->lookup(rid, keys_for(1, 1))->done, 0u);
    if (i == 0) {
      EXPECT_EQ(testing::metric(testing::http_get(port, "/metrics"), "kvferry_namespaces"), 2);
    }
  }
  // The ephemeral ones are gone with their clients; the keeper's stays (it holds a block).
  EXPECT_TRUE(
      wait_until([&] { return testing::metric(testing::http_get(port, "/metrics"), "kvferry_namespaces") == 1; }, 5s))
      << testing::http_get(port, "/metrics");
  keeper.reset();
  auto ls = connect(d)->ls(0);
  ASSERT_TRUE(ls.ok());
  EXPECT_EQ(ls->size(), 1u) << "the stored block keeps its namespace after its client left";
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A pin hog fills its tenant's pinned-bytes quota and no further: another tenant still saves
// into the pool; the hog's in-flight quota refuses a second big transfer while the first runs.
TEST(HostileData, PinAndInflightQuotasHoldPerTenant) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  // Blocks of 2 layers x 16 tokens x 1152 B = 36 KiB (a 40 KiB slot): 4 of them fit the quota.
  DaemonProcess d(std::string("daemon:\n  allowed_uids: [0, 65534]\n") + kRegionYaml +
                      "limits:\n  tenant:\n    pinned_bytes: 160KiB\n    inflight_bytes: 64KiB\n",
                  {}, "cpu", {"--test-copy-delay-ms", "300"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto root = connect(d, "other");
  ASSERT_TRUE(root);
  ASSERT_NE(map_and_fill(*root, "r", 4), nullptr);
  const int rc = run_in_child([&]() -> int {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
    Client::Options o;
    o.socket = d.socket();
    o.model = "m";
    auto c = Client::connect(o);
    if (!c.ok()) return 91;
    const uint32_t r = *(*c)->find_region("r");
    const auto keys = keys_for(8, 500);
    std::vector<int64_t> ids(8);
    std::iota(ids.begin(), ids.end(), 0);
    // Two saves of 4 blocks (144 KiB each, over the 64 KiB quota alone: allowed as the only
    // one); the second, submitted while the first is in flight, is refused at once.
    auto first = (*c)->submit_save(r, std::span(keys).first(4), std::span<const int64_t>(ids).first(4));
    auto second = (*c)->submit_save(r, std::span(keys).last(4), std::span<const int64_t>(ids).last(4));
    if (!first.ok() || !second.ok()) return 92;
    auto r2 = (*c)->wait_op(*second, 5'000'000);
    if (!r2.ok() || r2->status != ErrorCode::kResourceExhausted) return 93;
    auto r1 = (*c)->wait_op(*first, 10'000'000);
    if (!r1.ok() || r1->done != 4) return 94;
    if ((*c)->save(r, std::span(keys).last(4), std::span<const int64_t>(ids).last(4))->done != 4) return 95;
    auto p = (*c)->pin(r, keys);
    if (!p.ok()) return 96;
    if (p->done != 4) return 97;  // four 40 KiB slots fit 160 KiB; the rest are refused
    int refused = 0;
    for (auto code : p->blocks) refused += code == ErrorCode::kResourceExhausted;
    if (refused != 4) return 98;
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log();
  // The other tenant is not held back by the hog's pins or quota.
  const uint32_t rid = *root->find_region("r");
  EXPECT_EQ(root->save(rid, keys_for(4, 600), std::vector<int64_t>{10, 11, 12, 13})->done, 4u) << d.log();
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A data op names a region by id: another tenant's region is as absent to it as a region that
// does not exist (a save from it would read the other tenant's cache, a load would write it).
TEST(HostileData, SaveAndLoadNeverReachAnotherTenantsRegion) {
  DaemonProcess d(
      "daemon:\n  admin_uids: []\n"
      "regions:\n"
      "  - name: theirs\n    layers: 2\n    blocks: 8\n    block_size: 16\n    format: mla_bf16\n    tenant: a\n"
      "  - name: shared\n    layers: 2\n    blocks: 8\n    block_size: 16\n    format: mla_bf16\n"
      "tenants:\n  - name: a\n    uids: [4242]\n  - name: b\n    uids: [0]\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto raw = RawClient::connect(d.socket(), "b");
  ASSERT_TRUE(raw) << d.log();
  EXPECT_EQ(raw->region("theirs"), 0u) << "tenant b was offered tenant a's region";
  const uint32_t theirs = 1;  // config regions are numbered in order: the id is easy to guess
  ASSERT_NE(raw->region("shared"), 0u);
  // Keys and block ids in the arena; a save and a load naming tenant a's region by its id.
  const ops::Key key{1, 2};
  const int64_t block = 0;
  std::memcpy(raw->ch.arena, &key, sizeof key);
  std::memcpy(raw->ch.arena + sizeof key, &block, sizeof block);
  uint64_t id = 1;
  for (auto op : {proto::Op::kSave, proto::Op::kLoad, proto::Op::kLookup, proto::Op::kPin}) {
    ring::SubmitEntry e{};
    e.id = id++;
    e.op = static_cast<uint16_t>(op);
    e.region = theirs;
    e.count = 1;
    ASSERT_TRUE(raw->submit(e));
    auto c = raw->wait(e.id);
    ASSERT_TRUE(c.has_value()) << d.log();
    EXPECT_EQ(static_cast<ErrorCode>(c->status), ErrorCode::kNotFound) << "op " << e.op;
  }
  // The shared region works for the same client.
  ring::SubmitEntry e{};
  e.id = id++;
  e.op = static_cast<uint16_t>(proto::Op::kSave);
  e.region = raw->region("shared");
  e.count = 1;
  ASSERT_TRUE(raw->submit(e));
  auto c = raw->wait(e.id);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(static_cast<ErrorCode>(c->status), ErrorCode::kOk);
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A non-admin client (another uid) lists and evicts only its own tenant's blocks.
TEST(HostileData, LsAndEvictAllStayWithinTheTenant) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  DaemonProcess d(std::string("daemon:\n  allowed_uids: [0, 65534]\n") + kRegionYaml);
  ASSERT_TRUE(d.ready()) << d.log();
  auto root = connect(d, "root-tenant");
  ASSERT_TRUE(root);
  ASSERT_NE(map_and_fill(*root, "r", 3), nullptr);
  const uint32_t rid = *root->find_region("r");
  ASSERT_EQ(root->save(rid, keys_for(3, 77), std::vector<int64_t>{0, 1, 2})->done, 3u);
  const int rc = run_in_child([&]() -> int {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
    Client::Options o;
    o.socket = d.socket();
    o.model = "m";
    o.tenant = "root-tenant";  // claims root's tenant: the daemon must not grant it
    auto c = Client::connect(o);
    if (!c.ok()) return 91;
    auto ls = (*c)->ls(0);
    if (!ls.ok()) return 92;
    if (!ls->empty()) return 93;  // sees root's blocks
    auto ev = (*c)->evict(0, {}, ops::kEvictAllNs);
    if (!ev.ok()) return 94;
    if (ev->result[0] != 0) return 95;  // evicted root's blocks
    const uint32_t r = *(*c)->find_region("r");
    if ((*c)->lookup(r, keys_for(3, 77))->done != 0) return 96;  // reached root's namespace
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log();
  EXPECT_EQ(root->lookup(rid, keys_for(3, 77))->done, 3u) << "another tenant evicted root's blocks";
  EXPECT_EQ(d.stop(), 0) << d.log();
}

}  // namespace
}  // namespace kvferry
