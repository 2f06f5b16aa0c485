// The C ABI (kvferry.h, libkvferry.so) against a real kvferryd in its own process (CPU backend):
// versions and the status list, the params structs, poll/wait never taking a data op's
// completion, data ops from several threads at once, a daemon killed mid-op (the error arrives
// within a second, not after the op timeout), and the engine's CUDA device left as it was.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon_harness.h"
#include "kvferry/connector/kvferry.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/layouts/status.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int64_t kSecond = 1'000'000;

kvferry_client* connect_c(const DaemonProcess& d, const char* model = "c-abi") {
  kvferry_connect_params p{};
  p.field_mask = KVFERRY_CONNECT_F_ABI_VERSION | KVFERRY_CONNECT_F_SOCKET | KVFERRY_CONNECT_F_CLIENT_NAME |
                 KVFERRY_CONNECT_F_NAMESPACE;
  p.abi_version = KVFERRY_ABI_VERSION;
  p.socket = d.socket().c_str();
  p.client_name = "c-abi-test";
  p.model = model;
  kvferry_client* c = nullptr;
  EXPECT_EQ(kvferry_connect_with(&p, &c), 0) << kvferry_last_error() << "\n" << d.log();
  return c;
}

/// A small mla_bf16 region (block_major) created through the params form; returns its id.
uint32_t make_region(kvferry_client* c, const char* name, int64_t blocks = 16, int64_t block_size = 16) {
  kvferry_region_params p{};
  p.field_mask = KVFERRY_REGION_F_SPEC;
  p.name = name;
  p.layers = 2;
  p.blocks = blocks;
  p.block_size = block_size;
  p.format = "mla_bf16";
  p.layout = 0;
  uint32_t id = 0;
  EXPECT_EQ(kvferry_create_region_with(c, &p, &id), 0) << kvferry_last_error();
  return id;
}

kvferry_key key_of(uint64_t i, uint64_t salt = 0) { return {0x6b766672ull ^ salt, i * 0x9e3779b97f4a7c15ull + 1}; }

std::vector<kvferry_key> keys_of(uint64_t first, uint32_t n, uint64_t salt = 0) {
  std::vector<kvferry_key> k(n);
  for (uint32_t i = 0; i < n; ++i) k[i] = key_of(first + i, salt);
  return k;
}

TEST(CAbiVersion, VersionsAndEveryStatusName) {
  EXPECT_EQ(kvferry_abi_version(), static_cast<uint32_t>(KVFERRY_ABI_VERSION));
  EXPECT_EQ(kvferry_protocol_version(), proto::kVersion);
  const std::string v = kvferry_version();
  EXPECT_NE(v.find("abi " + std::to_string(KVFERRY_ABI_VERSION)), std::string::npos) << v;
  std::set<std::string> names;
  for (int i = 0; i < KVFERRY_ERROR_COUNT; ++i) {
    const std::string n = kvferry_status_name(i);
    EXPECT_EQ(n, error_code_name(static_cast<ErrorCode>(i))) << i;
    EXPECT_NE(n, "unknown") << i;
    names.insert(n);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(KVFERRY_ERROR_COUNT)) << "status names must be distinct";
  EXPECT_STREQ(kvferry_status_name(KVFERRY_ERROR_COUNT), "unknown");
  EXPECT_STREQ(kvferry_status_name(-1), "unknown");
  EXPECT_STREQ(kvferry_status_name(40000), "unknown");
  EXPECT_STREQ(kvferry_status_name(KVFERRY_ERROR_DATA_LOSS), "data_loss");
  EXPECT_EQ(KVFERRY_E_BUSY, KVFERRY_ERROR_BUSY);  // ABI-1 names keep their values
}

/// A fake daemon answering the Hello with a frame of protocol version 2.
TEST(CAbiVersion, DaemonOfAnotherProtocolVersionIsRefusedAtConnect) {
  const std::string dir = testing::make_temp_dir();
  const std::string path = dir + "/fake.sock";
  int ls = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  ASSERT_EQ(::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(ls, 1), 0);
  std::thread fake([&] {
    int s = ::accept(ls, nullptr, nullptr);
    if (s < 0) return;
    uint8_t hdr[proto::kHeaderBytes];
    if (::recv(s, hdr, sizeof hdr, MSG_WAITALL) == static_cast<ssize_t>(sizeof hdr)) {
      proto::Header h;
      h.version = proto::kVersion + 1;
      h.type = static_cast<uint16_t>(proto::MsgType::kWelcome);
      proto::encode_header(h, hdr);
      (void)!::write(s, hdr, sizeof hdr);
    }
    std::this_thread::sleep_for(200ms);
    ::close(s);
  });
  kvferry_connect_params p{};
  p.field_mask = KVFERRY_CONNECT_F_SOCKET | KVFERRY_CONNECT_F_TIMEOUT_MS;
  p.socket = path.c_str();
  p.timeout_ms = 2000;
  kvferry_client* c = nullptr;
  EXPECT_EQ(kvferry_connect_with(&p, &c), KVFERRY_ERROR_VERSION_MISMATCH) << kvferry_last_error();
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(std::string(kvferry_last_error()).find("protocol version"), std::string::npos) << kvferry_last_error();
  fake.join();
  ::close(ls);
  (void)!std::system(("rm -rf '" + dir + "'").c_str());
}

class CAbi : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = std::make_unique<DaemonProcess>("");
    ASSERT_TRUE(d_->ready()) << d_->log();
  }
  std::unique_ptr<DaemonProcess> d_;
};

TEST_F(CAbi, ConnectParamsAreCheckedByFieldMask) {
  kvferry_connect_params p{};
  p.field_mask = KVFERRY_CONNECT_F_ABI_VERSION | KVFERRY_CONNECT_F_SOCKET;
  p.socket = d_->socket().c_str();
  p.abi_version = KVFERRY_ABI_VERSION + 1;  // a caller built against a newer header
  kvferry_client* c = nullptr;
  EXPECT_EQ(kvferry_connect_with(&p, &c), KVFERRY_ERROR_VERSION_MISMATCH);
  EXPECT_NE(std::string(kvferry_last_error()).find("abi"), std::string::npos) << kvferry_last_error();
  p.abi_version = KVFERRY_ABI_VERSION;
  p.field_mask |= uint64_t{1} << 40;  // a field this library does not know
  EXPECT_EQ(kvferry_connect_with(&p, &c), KVFERRY_ERROR_VERSION_MISMATCH);
  p.field_mask = KVFERRY_CONNECT_F_SOCKET | KVFERRY_CONNECT_F_TIMEOUT_MS;
  p.timeout_ms = -1;
  EXPECT_EQ(kvferry_connect_with(&p, &c), KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(kvferry_connect_with(nullptr, &c), KVFERRY_ERROR_INVALID_ARGUMENT);
  p.field_mask = KVFERRY_CONNECT_F_SOCKET;  // a caller of abi 1 fields only: defaults for the rest
  ASSERT_EQ(kvferry_connect_with(&p, &c), 0) << kvferry_last_error();
  EXPECT_EQ(kvferry_connection_status(c), 0);
  kvferry_close(c);
}

TEST_F(CAbi, RegionParamsDescribeAndRegisterBesideTheOldCalls) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "made");
  kvferry_region_desc desc{};
  desc.field_mask = KVFERRY_REGION_DESC_F_ALL_V2 | (uint64_t{1} << 30);  // an unknown bit is cleared
  ASSERT_EQ(kvferry_describe_region(c, id, &desc), 0) << kvferry_last_error();
  EXPECT_EQ(desc.field_mask, static_cast<uint64_t>(KVFERRY_REGION_DESC_F_ALL_V2));
  EXPECT_EQ(desc.id, id);
  EXPECT_STREQ(desc.name, "made");
  EXPECT_STREQ(desc.format, "mla_bf16");
  EXPECT_EQ(desc.layers, 2);
  EXPECT_EQ(desc.blocks, 16);
  EXPECT_EQ(desc.mapped, 1);
  EXPECT_NE(desc.base, nullptr);
  EXPECT_EQ(desc.block_bytes, 2u * 16u * 1152u);
  void* base = nullptr;
  ASSERT_EQ(kvferry_map_region(c, id, &base), 0);
  EXPECT_EQ(base, desc.base);
  kvferry_region_desc basic{};
  basic.field_mask = KVFERRY_REGION_DESC_F_BASIC;  // an older caller's struct: only what it asks
  ASSERT_EQ(kvferry_describe_region(c, id, &basic), 0);
  EXPECT_EQ(basic.field_mask, static_cast<uint64_t>(KVFERRY_REGION_DESC_F_BASIC));
  EXPECT_EQ(basic.base, nullptr);
  EXPECT_EQ(kvferry_describe_region(c, 9999, &desc), KVFERRY_ERROR_NOT_FOUND);

  kvferry_region_params bad{};
  bad.field_mask = KVFERRY_REGION_F_SPEC;
  bad.name = "bad";
  bad.layers = 2;
  bad.blocks = 4;
  bad.block_size = 16;
  bad.format = "mla_fp9";
  uint32_t rid = 0;
  EXPECT_EQ(kvferry_create_region_with(c, &bad, &rid), KVFERRY_ERROR_INVALID_ARGUMENT);
  bad.format = "mla_bf16";
  bad.field_mask = 0;
  EXPECT_EQ(kvferry_create_region_with(c, &bad, &rid), KVFERRY_ERROR_INVALID_ARGUMENT);
  bad.field_mask = KVFERRY_REGION_F_SPEC | (uint64_t{1} << 20);
  EXPECT_EQ(kvferry_create_region_with(c, &bad, &rid), KVFERRY_ERROR_VERSION_MISMATCH);

  // Registration: the params form and the 14-argument form, each with its own memfd.
  const int64_t bytes = 2 * 4 * 16 * 1152;
  for (int form = 0; form < 2; ++form) {
    int fd = ::memfd_create("c-abi-own", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, bytes), 0);
    ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    void* own = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT_NE(own, MAP_FAILED);
    std::memset(own, 0x5a + form, bytes);
    const std::string name = "own" + std::to_string(form);
    uint32_t reg = 0;
    if (form == 0) {
      kvferry_region_params p{};
      p.field_mask = KVFERRY_REGION_F_SPEC | KVFERRY_REGION_F_BUFFER;
      p.name = name.c_str();
      p.layers = 2;
      p.blocks = 4;
      p.block_size = 16;
      p.format = "mla_bf16";
      p.backend = 0;
      p.fd = fd;
      p.device = -1;
      p.base = own;
      p.alloc_bytes = bytes;
      ASSERT_EQ(kvferry_register_region_with(c, &p, &reg), 0) << kvferry_last_error();
      p.field_mask = KVFERRY_REGION_F_SPEC;  // no buffer fields: refused
      EXPECT_EQ(kvferry_register_region_with(c, &p, &reg), KVFERRY_ERROR_INVALID_ARGUMENT);
    } else {
      ASSERT_EQ(kvferry_register_region(c, name.c_str(), 2, 4, 16, "mla_bf16", 0, 0, fd, nullptr, own, bytes, -1, &reg),
                0)
          << kvferry_last_error();
    }
    uint8_t back[64];
    ASSERT_EQ(kvferry_debug_read(c, reg, 128, back, sizeof back), 0) << kvferry_last_error();
    for (uint8_t b : back) ASSERT_EQ(b, 0x5a + form);
    kvferry_region_desc rd{};
    rd.field_mask = KVFERRY_REGION_DESC_F_ALL_V2;
    ASSERT_EQ(kvferry_describe_region(c, reg, &rd), 0);
    EXPECT_EQ(rd.base, own);
    EXPECT_STREQ(rd.name, name.c_str());
  }
  kvferry_close(c);  // the registered buffers are this test's: left mapped until exit
}

TEST_F(CAbi, StatsParamsFormMatchesTheOldOne) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "r");
  auto k = keys_of(0, 4);
  std::vector<int64_t> b{0, 1, 2, 3};
  uint32_t done = 0;
  ASSERT_EQ(kvferry_save(c, id, k.data(), b.data(), 4, nullptr, &done), 0) << kvferry_last_error();
  kvferry_stats_info old{};
  ASSERT_EQ(kvferry_stats(c, &old), 0);
  kvferry_store_stats s{};
  s.field_mask = KVFERRY_STATS_F_ALL_V2;
  ASSERT_EQ(kvferry_get_stats(c, &s), 0) << kvferry_last_error();
  EXPECT_EQ(s.field_mask, static_cast<uint64_t>(KVFERRY_STATS_F_STORE));
  EXPECT_EQ(s.entries, 4u);
  EXPECT_EQ(s.entries, old.entries);
  EXPECT_EQ(s.blocks_saved, old.blocks_saved);
  EXPECT_EQ(s.capacity_bytes, old.capacity_bytes);
  kvferry_store_stats none{};
  none.field_mask = 0;  // room for nothing: nothing asked of the daemon, nothing written
  none.entries = 77;
  ASSERT_EQ(kvferry_get_stats(c, &none), 0);
  EXPECT_EQ(none.field_mask, 0u);
  EXPECT_EQ(none.entries, 77u);
  kvferry_close(c);
}

// A host-only daemon runs no lower tier: kvferry_get_tier_stats writes no entry (and leaves the
// caller's entries as they were); NULL arguments are refused with a message, not a crash.
TEST_F(CAbi, TierStatsOfAHostOnlyDaemonAreEmpty) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  kvferry_tier_stats t[4];
  std::memset(t, 0x5a, sizeof t);
  for (auto& e : t) e.field_mask = KVFERRY_TIER_F_ALL_V3;
  uint32_t n = 99;
  ASSERT_EQ(kvferry_get_tier_stats(c, t, 4, &n), 0) << kvferry_last_error();
  EXPECT_EQ(n, 0u);
  for (const auto& e : t) {
    EXPECT_EQ(e.field_mask, static_cast<uint64_t>(KVFERRY_TIER_F_ALL_V3));
    EXPECT_EQ(e.blocks, 0x5a5a5a5a5a5a5a5aull);
  }
  n = 99;
  ASSERT_EQ(kvferry_get_tier_stats(c, nullptr, 0, &n), 0) << kvferry_last_error();  // room for none
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(kvferry_get_tier_stats(nullptr, t, 4, &n), KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvferry_last_error()).find("NULL"), std::string::npos) << kvferry_last_error();
  EXPECT_EQ(kvferry_get_tier_stats(c, nullptr, 4, &n), KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvferry_last_error()).find("NULL"), std::string::npos) << kvferry_last_error();
  EXPECT_EQ(kvferry_get_tier_stats(c, t, 4, nullptr), KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvferry_last_error()).find("NULL"), std::string::npos) << kvferry_last_error();
  kvferry_store_stats s{};  // the host's figures stay where they were
  s.field_mask = KVFERRY_STATS_F_ALL_V2;
  ASSERT_EQ(kvferry_get_stats(c, &s), 0) << kvferry_last_error();
  EXPECT_GT(s.capacity_bytes, 0u);
  kvferry_close(c);
}

// The remote tier's calls against a daemon without one: they say so (unavailable), and bad
// arguments are refused with a message before anything is sent.
TEST_F(CAbi, RemoteCallsWithoutARemoteTier) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  uint32_t rid = 0;
  ASSERT_EQ(kvferry_create_region(c, "remote-probe", 2, 4, 16, "mla_bf16", 0, &rid), 0) << kvferry_last_error();
  kvferry_key keys[2] = {{1, 2}, {3, 4}};
  int64_t ids[2] = {0, 1};
  int16_t st[2] = {};
  uint32_t done = 0;
  EXPECT_EQ(kvferry_send(c, rid, keys, ids, 2, "127.0.0.1:1", st, &done), KVFERRY_ERROR_UNAVAILABLE);
  EXPECT_NE(std::string(kvferry_last_error()).find("remote tier"), std::string::npos) << kvferry_last_error();
  EXPECT_EQ(kvferry_send_into(c, rid, keys, ids, 2, "127.0.0.1:1", 0, ids, st, &done), KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvferry_last_error()).find("peer_region"), std::string::npos) << kvferry_last_error();
  EXPECT_EQ(kvferry_send_into(c, rid, keys, ids, 2, "127.0.0.1:1", 5, nullptr, st, &done),
            KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(kvferry_send_into(c, rid, keys, ids, 2, "127.0.0.1:1", 5, ids, st, &done), KVFERRY_ERROR_UNAVAILABLE);
  char buf[64];
  uint32_t need = 0;
  EXPECT_EQ(kvferry_peers_json(c, buf, sizeof buf, &need), KVFERRY_ERROR_UNAVAILABLE);
  uint32_t prefix = 7;
  ASSERT_EQ(kvferry_lookup_wait(c, rid, keys, 2, 50, st, &prefix), 0) << kvferry_last_error();  // no wait: a miss
  EXPECT_EQ(prefix, 0u);
  EXPECT_EQ(st[0], KVFERRY_E_NOT_FOUND);
  kvferry_close(c);
}

// With a disk tier: one entry named "disk", its fields by field_mask (BASIC and STORAGE, never
// PEERS); an entry that has room for BASIC only gets BASIC only.
TEST(CAbiTierStats, DiskTierEntryByFieldMask) {
  const std::string dir = testing::make_temp_dir();
  {
    DaemonProcess d("tiers:\n  host:\n    capacity: 8MiB\n  disk:\n    path: " + dir +
                    "\n    capacity: 64MiB\n    direct_io: false\n");
    ASSERT_TRUE(d.ready()) << d.log();
    kvferry_client* c = connect_c(d);
    ASSERT_NE(c, nullptr);
    kvferry_tier_stats t[2];
    std::memset(t, 0x5a, sizeof t);
    t[0].field_mask = KVFERRY_TIER_F_ALL_V3 | (uint64_t{1} << 40);  // an unknown bit is cleared
    uint32_t n = 0;
    ASSERT_EQ(kvferry_get_tier_stats(c, t, 2, &n), 0) << kvferry_last_error();
    ASSERT_EQ(n, 1u);
    EXPECT_EQ(t[0].field_mask, static_cast<uint64_t>(KVFERRY_TIER_F_BASIC | KVFERRY_TIER_F_STORAGE));
    EXPECT_STREQ(t[0].tier, "disk");
    EXPECT_EQ(t[0].healthy, 1);
    EXPECT_STREQ(t[0].reason, "");
    EXPECT_GT(t[0].capacity_bytes, 0u);  // whole slots of the 64 MiB file
    EXPECT_LE(t[0].capacity_bytes, uint64_t{64} << 20);
    EXPECT_LE(t[0].used_bytes, t[0].capacity_bytes);
    EXPECT_EQ(t[0].io_errors, 0u);
    EXPECT_EQ(t[0].peers_live, 0x5a5a5a5a5a5a5a5aull);  // not the disk's: left as it was
    EXPECT_EQ(t[1].blocks, 0x5a5a5a5a5a5a5a5aull);      // past *n: untouched
    kvferry_tier_stats basic;
    std::memset(&basic, 0x5a, sizeof basic);
    basic.field_mask = KVFERRY_TIER_F_BASIC;  // an older caller's room
    ASSERT_EQ(kvferry_get_tier_stats(c, &basic, 1, &n), 0) << kvferry_last_error();
    ASSERT_EQ(n, 1u);
    EXPECT_EQ(basic.field_mask, static_cast<uint64_t>(KVFERRY_TIER_F_BASIC));
    EXPECT_STREQ(basic.tier, "disk");
    EXPECT_EQ(basic.capacity_bytes, 0x5a5a5a5a5a5a5a5aull);
    kvferry_close(c);
  }
  (void)!std::system(("rm -rf '" + dir + "'").c_str());
}

// poll()/wait() used to hand a data op's completion out as a raw one: its arena part leaked and
// its wait_op timed out. Now they hand out raw completions only.
TEST_F(CAbi, PollAndWaitNeverTakeADataOpsCompletion) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "r");
  void* arena = nullptr;
  uint32_t arena_bytes = 0;
  ASSERT_EQ(kvferry_arena(c, &arena, &arena_bytes), 0);
  // Each lookup takes ~ 1/8 of the arena: a leak would exhaust it within the loop.
  const uint32_t n = arena_bytes / 8 / 18;
  auto k = keys_of(0, n);
  std::vector<int16_t> st(n);
  for (int round = 0; round < 64; ++round) {
    uint64_t req = 0;
    ASSERT_EQ(kvferry_submit_lookup(c, id, k.data(), n, &req), 0) << round << ": " << kvferry_last_error();
    ASSERT_EQ(kvferry_ping(c, 1000 + round, round), 0);
    kvferry_cqe ce[8];
    uint32_t got = 0;
    // The ping comes out of wait/poll; the lookup never does.
    ASSERT_EQ(kvferry_wait(c, ce, 8, 2 * kSecond, &got), 0) << kvferry_last_error();
    ASSERT_EQ(got, 1u);
    EXPECT_EQ(ce[0].id, 1000u + round);
    EXPECT_EQ(ce[0].result[0], static_cast<uint64_t>(round));
    const auto t0 = Clock::now();
    while (Clock::now() - t0 < 2ms) {
      ASSERT_EQ(kvferry_poll(c, ce, 8, &got), 0);
      ASSERT_EQ(got, 0u) << "poll handed out a completion: id " << ce[0].id;
    }
    EXPECT_EQ(kvferry_wait(c, ce, 8, 1000, &got), KVFERRY_E_TIMEOUT);
    uint32_t done = 99;
    uint64_t res[5] = {};
    ASSERT_EQ(kvferry_wait_op(c, req, 2 * kSecond, st.data(), n, &done, res), 0)
        << round << ": " << kvferry_last_error();
    EXPECT_EQ(done, 0u);  // all misses
    EXPECT_EQ(res[0], 0u);
    EXPECT_EQ(st[0], KVFERRY_ERROR_NOT_FOUND);
    // handed out once
    EXPECT_EQ(kvferry_wait_op(c, req, 0, nullptr, 0, nullptr, nullptr), KVFERRY_ERROR_NOT_FOUND);
  }
  // A zero timeout checks without sleeping: a finished op is returned, an unknown one is not found.
  uint64_t req = 0;
  ASSERT_EQ(kvferry_submit_lookup(c, id, k.data(), 1, &req), 0);
  int rc = KVFERRY_E_TIMEOUT;
  const auto t0 = Clock::now();
  while (rc == KVFERRY_E_TIMEOUT && Clock::now() - t0 < 2s)
    rc = kvferry_wait_op(c, req, 0, nullptr, 0, nullptr, nullptr);
  EXPECT_EQ(rc, 0) << kvferry_last_error();
  kvferry_close(c);
}

// Several threads submit and wait at once on one client, each for its own ops, while another
// thread pings and waits for raw completions.
TEST_F(CAbi, DataOpsFromSeveralThreadsAtOnce) {
  kvferry_client* c = connect_c(*d_);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "r", 64);
  void* base = nullptr;
  ASSERT_EQ(kvferry_map_region(c, id, &base), 0);
  kvferry_view v;
  ASSERT_EQ(kvferry_layer_view(c, id, 0, &v), 0);
  const int64_t block_stride = v.strides[0] * v.elem_bytes;
  constexpr int kThreads = 3;
  constexpr int kRounds = 150;
  std::atomic<int> failures{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> ts;
  ts.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      // Thread t owns blocks [16 t, 16 t + 16) and keys salted with t.
      for (int r = 0; r < kRounds && !failures; ++r) {
        const uint32_t n = 1 + (r % 8);
        auto k = keys_of(uint64_t(r) * 8, n, t + 1);
        std::vector<int64_t> blocks(n);
        for (uint32_t i = 0; i < n; ++i) {
          blocks[i] = 16 * t + i;
          std::memset(static_cast<uint8_t*>(base) + blocks[i] * block_stride, 1 + t * 16 + r % 16, 64);
        }
        uint64_t req = 0;
        int rc;
        while ((rc = kvferry_submit_save(c, id, k.data(), blocks.data(), n, &req)) == KVFERRY_E_BUSY)
          std::this_thread::yield();
        if (rc != 0) {
          ADD_FAILURE() << "submit_save: " << kvferry_last_error();
          ++failures;
          return;
        }
        std::vector<int16_t> st(n, -1);
        uint32_t done = 0;
        rc = kvferry_wait_op(c, req, 10 * kSecond, st.data(), n, &done, nullptr);
        if (rc != 0 || done != n) {
          ADD_FAILURE() << "save round " << r << " thread " << t << ": rc " << rc << " " << kvferry_last_error();
          ++failures;
          return;
        }
        uint32_t prefix = 0;
        std::vector<int16_t> hit(n, -1);
        rc = kvferry_lookup(c, id, k.data(), n, hit.data(), &prefix);
        if (rc != 0 || prefix != n) {
          ADD_FAILURE() << "lookup round " << r << " thread " << t << ": rc " << rc << " prefix " << prefix;
          ++failures;
          return;
        }
      }
    });
  }
  std::thread pinger([&] {
    uint64_t i = 0;
    while (!stop) {
      if (kvferry_ping(c, 7'000'000 + i, i) != 0) continue;
      kvferry_cqe ce[4];
      uint32_t got = 0;
      if (kvferry_wait(c, ce, 4, 10 * kSecond, &got) != 0 || got != 1 || ce[0].id != 7'000'000 + i ||
          ce[0].result[0] != i) {
        ADD_FAILURE() << "ping " << i << ": " << kvferry_last_error();
        ++failures;
        return;
      }
      ++i;
    }
  });
  for (auto& t : ts) t.join();
  stop = true;
  pinger.join();
  EXPECT_EQ(failures.load(), 0);
  kvferry_close(c);
}

// kill -9 of the daemon while a save sleeps inside it: the waits return unavailable within a
// second (the ops' own timeout is 60 s), for the async op, the sync op on another thread and a
// raw wait alike; later calls fail the same way at once.
TEST(CAbiDeadDaemon, KilledDaemonFailsEveryPendingOpWithinASecond) {
  DaemonProcess d("", {}, "cpu", {"--test-copy-delay-ms", "20000"});
  ASSERT_TRUE(d.ready()) << d.log();
  kvferry_client* c = connect_c(d);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "r");
  auto k = keys_of(0, 4);
  std::vector<int64_t> b{0, 1, 2, 3};
  uint64_t req = 0;
  ASSERT_EQ(kvferry_submit_save(c, id, k.data(), b.data(), 4, &req), 0) << kvferry_last_error();
  std::atomic<int> sync_rc{-1};
  std::atomic<int64_t> sync_ms{-1};
  std::atomic<int64_t> killed_at{0};
  std::thread sync_waiter([&] {
    auto k2 = keys_of(100, 2);
    std::vector<int64_t> b2{8, 9};
    uint32_t done = 0;
    const int rc = kvferry_save(c, id, k2.data(), b2.data(), 2, nullptr, &done);  // 60 s op timeout
    sync_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count() - killed_at;
    sync_rc = rc;
  });
  std::atomic<int> raw_rc{-1};
  std::thread raw_waiter([&] {
    kvferry_cqe ce[2];
    uint32_t got = 0;
    raw_rc = kvferry_wait(c, ce, 2, 60 * kSecond, &got);
  });
  std::this_thread::sleep_for(300ms);  // both saves are inside the daemon's delayed copy
  EXPECT_EQ(kvferry_wait_op(c, req, 0, nullptr, 0, nullptr, nullptr), KVFERRY_E_TIMEOUT);
  killed_at = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
  const auto t0 = Clock::now();
  ASSERT_EQ(::kill(d.pid(), SIGKILL), 0);
  const int rc = kvferry_wait_op(c, req, 60 * kSecond, nullptr, 0, nullptr, nullptr);
  const auto waited = Clock::now() - t0;
  EXPECT_EQ(rc, KVFERRY_ERROR_UNAVAILABLE) << kvferry_last_error();
  EXPECT_LT(waited, 1s) << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms";
  const std::string why = kvferry_last_error();
  EXPECT_NE(why.find("lost"), std::string::npos) << why;
  sync_waiter.join();
  raw_waiter.join();
  EXPECT_EQ(sync_rc.load(), KVFERRY_ERROR_UNAVAILABLE);
  EXPECT_LT(sync_ms.load(), 1000);
  EXPECT_EQ(raw_rc.load(), KVFERRY_ERROR_UNAVAILABLE);
  // Everything after fails at once, with the same word.
  const auto t1 = Clock::now();
  EXPECT_EQ(kvferry_connection_status(c), KVFERRY_ERROR_UNAVAILABLE);
  EXPECT_EQ(kvferry_submit_lookup(c, id, k.data(), 1, &req), KVFERRY_ERROR_UNAVAILABLE);
  uint32_t prefix = 0;
  EXPECT_EQ(kvferry_lookup(c, id, k.data(), 1, nullptr, &prefix), KVFERRY_ERROR_UNAVAILABLE);
  EXPECT_EQ(kvferry_ping(c, 1, 1), KVFERRY_ERROR_UNAVAILABLE);
  EXPECT_LT(Clock::now() - t1, 500ms);
  kvferry_close(c);
  d.stop(SIGKILL);  // reaps the process
}

// The connection check without a wait in flight sees the death too.
TEST(CAbiDeadDaemon, ConnectionStatusSeesAStoppedDaemon) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  kvferry_client* c = connect_c(d);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(kvferry_connection_status(c), 0);
  d.stop(SIGTERM);
  EXPECT_TRUE(testing::wait_until([&] { return kvferry_connection_status(c) == KVFERRY_ERROR_UNAVAILABLE; }, 2s));
  uint32_t prefix = 0;
  auto k = keys_of(0, 1);
  EXPECT_EQ(kvferry_lookup(c, 1, k.data(), 1, nullptr, &prefix), KVFERRY_ERROR_UNAVAILABLE);
  kvferry_close(c);
}

// Mapping a region on another GPU leaves the engine's current device as it was.
TEST(CAbiCuda, CurrentDeviceIsRestoredAfterMapping) {
#if !defined(KVFERRY_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (KVFERRY_WITH_CUDA=OFF): no device to switch";
#else
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "needs two CUDA devices (found " << n << "): with one there is no other device to switch to";
  }
  DaemonProcess d("", {}, "cuda");  // gpu 0
  ASSERT_TRUE(d.ready()) << d.log();
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  kvferry_client* c = connect_c(d);
  ASSERT_NE(c, nullptr);
  const uint32_t id = make_region(c, "gpu0");
  kvferry_region_desc rd{};
  rd.field_mask = KVFERRY_REGION_DESC_F_ALL_V2;
  ASSERT_EQ(kvferry_describe_region(c, id, &rd), 0);
  EXPECT_EQ(rd.device, 0);
  int now = -1;
  ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
  EXPECT_EQ(now, 1) << "create/map switched the engine's device";
  kvferry_close(c);
  ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
  EXPECT_EQ(now, 1) << "close switched the engine's device";
#endif
}

}  // namespace
}  // namespace kvferry
