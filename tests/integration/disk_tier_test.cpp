// The disk tier (G3) through kvferryd (its own process, CPU backend): a host pool much smaller
// than the data, so blocks stream to disk and come back; kill -9 during saves and a restart on the
// same slot file; a slot damaged on disk; a full disk, EIO and short I/O through the fault
// wrapper (--test-disk-faults); the pread/pwrite engine; format conversion on a load from disk;
// ls, /metrics, /healthz and stats (`kvferry stats`, Client::stats_all) naming the tier.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "daemon_harness.h"
#include "test_blocks.h"
#include "kvferry/connector/client.h"
#include "kvferry/kernels/convert.h"

namespace kvferry {
namespace {

using testing::block_equal;
using testing::create;
using testing::DaemonProcess;
using testing::fill_bytes;
using testing::fill_mla;
using testing::http_get;
using testing::iota_ids;
using testing::metric;
using testing::metrics_port;
using testing::Region;
using testing::run_cli;
using testing::snapshot;
using namespace std::chrono_literals;

/// A directory for the slot file, outside any daemon's own temporary directory (a restarted
/// daemon must find it), removed at the end.
struct DiskDir {
  std::string path = testing::make_temp_dir();
  ~DiskDir() {
    const std::string cmd = "rm -rf '" + path + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", path.c_str());
  }
  std::string slots() const { return path + "/kvferry-g3.slots"; }
};

/// Whether `dir` takes O_DIRECT (tmpfs does not): the tests then keep direct_io on.
bool supports_direct(const std::string& dir) {
  const std::string p = dir + "/.odirect-probe";
  int fd = ::open(p.c_str(), O_CREAT | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(p.c_str());
  return fd >= 0;
}

/// The config of a daemon with a `host` pool over a disk tier of `disk` at `dir`.
std::string tier_yaml(const std::string& dir, const std::string& host, const std::string& disk,
                      const std::string& more = "") {
  return "tiers:\n  host:\n    capacity: " + host + "\n  disk:\n    path: " + dir + "\n    capacity: " + disk +
         "\n    direct_io: " + (supports_direct(dir) ? "true" : "false") + "\n" + more;
}

std::unique_ptr<Client> connect(const DaemonProcess& d, const std::string& model = "m") {
  return testing::connect_client(d, "disk-tier-test", model);
}

/// 64 blocks of 4 layers x 64 tokens (144 KiB of mla_fp8, 288 KiB of mla_bf16), block-major.
KvCacheSpec spec_of(EntryFormat f, int64_t blocks = 64) { return {4, blocks, 64, f, Layout::kBlockMajor}; }

constexpr testing::TestKeys kKeys{0xD15C000000000000ull};

struct Tally {
  int exact = 0, miss = 0, other = 0, wrong = 0;
};

/// Loads round `k`'s keys into `r` (block i <- key i) and checks every block against `ref`: a
/// block is exact, a miss or another error; never wrong bytes reported as ok.
Tally load_and_check(Client& c, Region& r, uint64_t k, const std::vector<uint8_t>& ref) {
  Tally t;
  std::memset(r.base, 0xEE, static_cast<size_t>(r.spec.region_bytes()));
  const int64_t n = r.spec.blocks;
  auto ld = c.load(r.id, kKeys.keys(n, k), iota_ids(n));
  EXPECT_TRUE(ld.ok()) << ld.status().to_string();
  if (!ld.ok()) return t;
  for (int64_t i = 0; i < n; ++i) {
    const ErrorCode e = ld->blocks[static_cast<size_t>(i)];
    if (e == ErrorCode::kOk)
      block_equal(r, i, ref, i) ? ++t.exact : ++t.wrong;
    else if (e == ErrorCode::kNotFound)
      ++t.miss;
    else
      ++t.other;
  }
  return t;
}

/// Offsets of the slot headers in a slot file (4 KiB pages that start with the slot magic).
std::vector<uint64_t> slot_headers(const std::string& file) {
  std::vector<uint64_t> out;
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  std::vector<char> page(4096);
  struct stat st {};
  ::fstat(fd, &st);
  for (off_t off = 0; off + 4096 <= st.st_size; off += 4096) {
    if (::pread(fd, page.data(), 4096, off) != 4096) break;
    if (std::memcmp(page.data(), "KVFG3SLT", 8) == 0) out.push_back(static_cast<uint64_t>(off));
  }
  ::close(fd);
  return out;
}

class DiskTierIt : public ::testing::TestWithParam<const char*> {};

// Six rounds of 64 blocks (9 MiB each) through an 8 MiB host pool: every block comes back exact
// (from the host or the disk), and ls, /metrics and /healthz show the disk.
TEST_P(DiskTierIt, RoundTripThroughHostAndDisk) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB", std::string("    io_engine: ") + GetParam() + "\n"), {}, "cpu",
                  {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "rt", spec_of(EntryFormat::mla_fp8()));
  constexpr int kRounds = 6;
  std::vector<std::vector<uint8_t>> refs;
  for (int k = 0; k < kRounds; ++k) {
    fill_bytes(r, static_cast<uint64_t>(k));
    refs.push_back(snapshot(r));
    auto sv = c->save(r.id, kKeys.keys(r.spec.blocks, static_cast<uint64_t>(k)), iota_ids(r.spec.blocks));
    ASSERT_TRUE(sv.ok());
    ASSERT_EQ(sv->done, r.spec.blocks) << static_cast<int>(sv->status) << "\n" << d.log();
  }
  if (std::string(GetParam()) == "posix") {
    EXPECT_NE(d.log().find("pread/pwrite"), std::string::npos) << d.log();
  }
  // Every key is found (lookup sees both tiers).
  for (int k = 0; k < kRounds; ++k) {
    auto lk = c->lookup(r.id, kKeys.keys(r.spec.blocks, static_cast<uint64_t>(k)));
    ASSERT_TRUE(lk.ok());
    EXPECT_EQ(lk->result[0], static_cast<uint64_t>(r.spec.blocks)) << "round " << k;
  }
  auto ls = c->ls(0);
  ASSERT_TRUE(ls.ok());
  int on_disk = 0;
  for (const auto& e : *ls) on_disk += std::string(e.tier) == "disk";
  EXPECT_GT(on_disk, 64) << "most blocks live on the disk only";
  for (int k = 0; k < kRounds; ++k) {
    const Tally t = load_and_check(*c, r, static_cast<uint64_t>(k), refs[static_cast<size_t>(k)]);
    EXPECT_EQ(t.wrong, 0);
    EXPECT_EQ(t.exact, r.spec.blocks) << "round " << k << ": " << t.miss << " misses, " << t.other << " errors\n"
                                      << d.log();
  }
  const uint16_t port = metrics_port(d.log());
  ASSERT_NE(port, 0);
  const std::string m = http_get(port, "/metrics");
  EXPECT_GT(metric(m, "kvferry_blocks_saved_total{tier=\"disk\"}"), 0) << m;
  EXPECT_GT(metric(m, "kvferry_blocks_loaded_total{tier=\"disk\"}"), 0) << m;
  EXPECT_GT(metric(m, "kvferry_blocks_stored{tier=\"disk\"}"), 0) << m;
  EXPECT_GT(metric(m, "kvferry_pool_used_bytes{tier=\"disk\"}"), 0) << m;
  EXPECT_EQ(metric(m, "kvferry_pool_capacity_bytes{tier=\"disk\"}") > 0, true) << m;
  EXPECT_EQ(metric(m, "kvferry_tier_healthy{tier=\"disk\"}"), 1) << m;
  const std::string h = http_get(port, "/healthz");
  EXPECT_NE(h.find("disk ok"), std::string::npos) << h;
}

INSTANTIATE_TEST_SUITE_P(Engines, DiskTierIt, ::testing::Values("auto", "posix"));

// kill -9 while a save is in flight, restart on the same slot file: every save that completed
// (write-through, durability batch) loads back exact; the one in flight is absent or exact.
TEST(DiskTierRestart, KillDuringSavesThenRecover) {
  DiskDir dir;
  const std::string yaml = tier_yaml(dir.path, "8MiB", "256MiB", "    write_through: true\n");
  std::vector<std::vector<uint8_t>> refs;
  constexpr int kDone = 5;
  {
    DaemonProcess d(yaml);
    ASSERT_TRUE(d.ready()) << d.log();
    auto c = connect(d);
    ASSERT_TRUE(c);
    Region r = create(*c, "kill", spec_of(EntryFormat::mla_fp8()));
    for (int k = 0; k <= kDone; ++k) {
      fill_bytes(r, uint64_t{100} + static_cast<uint64_t>(k));
      refs.push_back(snapshot(r));
      if (k == kDone) break;
      auto sv = c->save(r.id, kKeys.keys(r.spec.blocks, static_cast<uint64_t>(k)), iota_ids(r.spec.blocks));
      ASSERT_TRUE(sv.ok());
      ASSERT_EQ(sv->done, r.spec.blocks) << d.log();
    }
    // The last round is in flight when the daemon dies.
    auto id = c->submit_save(r.id, kKeys.keys(r.spec.blocks, kDone), iota_ids(r.spec.blocks));
    ASSERT_TRUE(id.ok());
    std::this_thread::sleep_for(3ms);
    d.stop(SIGKILL);
  }
  DaemonProcess d(yaml);
  ASSERT_TRUE(d.ready()) << d.log();
  EXPECT_NE(d.log().find("disk tier: recovered"), std::string::npos) << d.log();
  auto c = connect(d);  // another client, another connection: the namespace is found by name
  ASSERT_TRUE(c);
  Region r = create(*c, "after", spec_of(EntryFormat::mla_fp8()));
  for (int k = 0; k < kDone; ++k) {
    const Tally t = load_and_check(*c, r, static_cast<uint64_t>(k), refs[static_cast<size_t>(k)]);
    EXPECT_EQ(t.wrong, 0);
    EXPECT_EQ(t.exact, r.spec.blocks) << "completed round " << k << ": " << t.miss << " misses, " << t.other
                                      << " errors\n"
                                      << d.log();
  }
  const Tally t = load_and_check(*c, r, kDone, refs[kDone]);
  EXPECT_EQ(t.wrong, 0);
  EXPECT_EQ(t.other, 0);
  EXPECT_EQ(t.exact + t.miss, r.spec.blocks);
}

// Garbage written into the data of every slot on disk: the checksum catches it on the load, the
// block is reported (kChecksumMismatch) and dropped, and the next load is a plain miss.
TEST(DiskTierDamage, CorruptSlotIsCaughtAndDropped) {
  DiskDir dir;
  const std::string yaml = tier_yaml(dir.path, "8MiB", "256MiB", "    write_through: true\n");
  {
    DaemonProcess d(yaml);
    ASSERT_TRUE(d.ready()) << d.log();
    auto c = connect(d);
    ASSERT_TRUE(c);
    Region r = create(*c, "dmg", spec_of(EntryFormat::mla_fp8(), 16));
    fill_bytes(r, 7);
    auto sv = c->save(r.id, kKeys.keys(16, 7), iota_ids(16));
    ASSERT_TRUE(sv.ok());
    ASSERT_EQ(sv->done, 16u);
    d.stop();
  }
  const auto headers = slot_headers(dir.slots());
  ASSERT_EQ(headers.size(), 16u);
  int fd = ::open(dir.slots().c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const char garbage[16] = "garbage-garbage";
  for (uint64_t h : headers)
    ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(h + 4096 + 1000)),
              static_cast<ssize_t>(sizeof garbage));
  ::fsync(fd);
  ::close(fd);
  DaemonProcess d(yaml, {}, "cpu", {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "dmg2", spec_of(EntryFormat::mla_fp8(), 16));
  auto ld = c->load(r.id, kKeys.keys(16, 7), iota_ids(16));
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->done, 0u);
  for (ErrorCode e : ld->blocks) EXPECT_EQ(e, ErrorCode::kChecksumMismatch);
  auto again = c->load(r.id, kKeys.keys(16, 7), iota_ids(16));
  ASSERT_TRUE(again.ok());
  for (ErrorCode e : again->blocks) EXPECT_EQ(e, ErrorCode::kNotFound);
  const std::string m = http_get(metrics_port(d.log()), "/metrics");
  EXPECT_EQ(metric(m, "kvferry_tier_checksum_failures{tier=\"disk\"}"), 16) << m;
  EXPECT_EQ(metric(m, "kvferry_blocks_stored{tier=\"disk\"}"), 0) << m;
}

/// Saves `rounds` rounds through a small pool and loads them back: no wrong bytes ever.
Tally churn(DaemonProcess& d, int rounds, uint64_t salt) {
  Tally all;
  auto c = connect(d);
  if (!c) return all;
  Region r = create(*c, "churn", spec_of(EntryFormat::mla_fp8()));
  std::vector<std::vector<uint8_t>> refs;
  for (int k = 0; k < rounds; ++k) {
    fill_bytes(r, salt + static_cast<uint64_t>(k));
    refs.push_back(snapshot(r));
    auto sv = c->save(r.id, kKeys.keys(r.spec.blocks, salt + static_cast<uint64_t>(k)), iota_ids(r.spec.blocks));
    EXPECT_TRUE(sv.ok());
  }
  for (int k = 0; k < rounds; ++k) {
    const Tally t = load_and_check(*c, r, salt + static_cast<uint64_t>(k), refs[static_cast<size_t>(k)]);
    all.exact += t.exact;
    all.miss += t.miss;
    all.other += t.other;
    all.wrong += t.wrong;
  }
  return all;
}

// A disk tier smaller than the data: it evicts its oldest blocks; the newest come back exact, the
// oldest are misses, nothing is wrong.
TEST(DiskTierFaults, FullDiskEvictsOldest) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "24MiB"));
  ASSERT_TRUE(d.ready()) << d.log();
  const Tally t = churn(d, 6, 1000);
  EXPECT_EQ(t.wrong, 0);
  EXPECT_GT(t.exact, 64) << d.log();
  EXPECT_GT(t.miss, 64) << d.log();
}

// ENOSPC from the device on some writes: the tier evicts and retries once; blocks that still
// fail leave the host unsaved (misses), nothing is wrong.
TEST(DiskTierFaults, EnospcRetriesThenFailsPerBlock) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB"), {}, "cpu",
                  {"--metrics-listen", "127.0.0.1:0", "--test-disk-faults", "errno=ENOSPC,rate=0.3,writes_only"});
  ASSERT_TRUE(d.ready()) << d.log();
  const Tally t = churn(d, 5, 2000);
  EXPECT_EQ(t.wrong, 0);
  EXPECT_GT(t.exact, 64);
  const std::string m = http_get(metrics_port(d.log()), "/metrics");
  EXPECT_GT(metric(m, "kvferry_tier_space_retries_total{tier=\"disk\"}"), 0) << m;
}

// EIO on every write: demotions fail, the tier reads degraded in /healthz and /metrics, saves
// keep succeeding on the host, and what is still on the host loads exact.
TEST(DiskTierFaults, EioDegradesAndHostServesOn) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB"), {}, "cpu",
                  {"--metrics-listen", "127.0.0.1:0", "--test-disk-faults", "errno=EIO,rate=1,writes_only"});
  ASSERT_TRUE(d.ready()) << d.log();
  EXPECT_NE(d.log().find("never in production"), std::string::npos);
  const Tally t = churn(d, 4, 3000);
  EXPECT_EQ(t.wrong, 0);
  EXPECT_EQ(t.other, 0);
  EXPECT_GT(t.exact, 0);
  EXPECT_GT(t.miss, 0);
  const uint16_t port = metrics_port(d.log());
  const std::string m = http_get(port, "/metrics");
  EXPECT_EQ(metric(m, "kvferry_tier_healthy{tier=\"disk\"}"), 0) << m;
  EXPECT_GT(metric(m, "kvferry_tier_write_failures_total{tier=\"disk\"}"), 0) << m;
  const std::string h = http_get(port, "/healthz");
  EXPECT_NE(h.find("200"), std::string::npos) << h;
  EXPECT_NE(h.find("disk degraded"), std::string::npos) << h;
  // Still serving: a fresh save and load on the host.
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "after-eio", spec_of(EntryFormat::mla_fp8(), 8));
  fill_bytes(r, 99);
  const auto ref = snapshot(r);
  ASSERT_EQ(c->save(r.id, kKeys.keys(8, 99), iota_ids(8))->done, 8u);
  const Tally t2 = load_and_check(*c, r, 99, ref);
  EXPECT_EQ(t2.exact, 8);
}

// Short reads and writes: the blocks they hit fail (or are misses), nothing is wrong.
TEST(DiskTierFaults, ShortIoFailsBlocksNeverWrongBytes) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB"), {}, "cpu", {"--test-disk-faults", "short=0.3,seed=5"});
  ASSERT_TRUE(d.ready()) << d.log();
  const Tally t = churn(d, 5, 4000);
  EXPECT_EQ(t.wrong, 0);
  EXPECT_GT(t.exact, 64);
  EXPECT_GT(t.other + t.miss, 0);
}

// Blocks saved from an mla_fp8 region and pushed to disk load into an mla_fp8_ds region,
// converted on the way (576 -> 656), as from the host.
TEST(DiskTierConvert, LoadFromDiskConvertsFormat) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB"));
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region a = create(*c, "fp8", spec_of(EntryFormat::mla_fp8(), 16));
  Region b = create(*c, "fp8ds", spec_of(EntryFormat::mla_fp8_ds(), 16));
  fill_mla(a, 42);
  const auto keys = kKeys.keys(16, 42);
  ASSERT_EQ(c->save(a.id, keys, iota_ids(16))->done, 16u);
  std::vector<uint8_t> want(static_cast<size_t>(b.spec.region_bytes()), 0);
  ASSERT_TRUE(kernels::convert_blocks_cpu(a.base, a.spec, iota_ids(16), want.data(), b.spec, iota_ids(16)).ok());
  // Push them out of the host pool with other blocks (write-back demotes them to disk).
  Region f = create(*c, "filler", spec_of(EntryFormat::mla_fp8()));
  for (int k = 0; k < 4; ++k) {
    fill_bytes(f, 500 + static_cast<uint64_t>(k));
    ASSERT_EQ(c->save(f.id, kKeys.keys(64, 500 + static_cast<uint64_t>(k)), iota_ids(64))->done, 64u);
  }
  auto ls = c->ls(a.id);
  ASSERT_TRUE(ls.ok());
  int disk_only = 0;
  for (const auto& e : *ls)
    for (const auto& k : keys) disk_only += e.key.hi == k.hi && e.key.lo == k.lo && std::string(e.tier) == "disk";
  EXPECT_GT(disk_only, 0) << "the fp8 blocks were pushed to disk";
  auto ld = c->load(b.id, keys, iota_ids(16));
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(ld->done, 16u) << d.log();
  for (int64_t i = 0; i < 16; ++i)
    EXPECT_EQ(
        std::memcmp(b.block(i), want.data() + b.spec.page_offset(0, i), static_cast<size_t>(b.spec.block_bytes())), 0)
        << "block " << i;
}

/// The lines of `text` that start with `word` and a space.
std::vector<std::string> lines_starting(const std::string& text, const std::string& word) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    if (line.rfind(word + " ", 0) == 0) out.push_back(line);
    at = end + 1;
  }
  return out;
}

// Blocks pushed down to the disk show up in the stats under the disk's name: through the C++
// client, `kvferry stats --json` (a "tiers" entry beside the host's keys) and the human output.
TEST(DiskTierStats, StatsNameTheDiskTier) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "256MiB"));
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  Region r = create(*c, "stats", spec_of(EntryFormat::mla_fp8()));
  for (int k = 0; k < 3; ++k) {  // 27 MiB through an 8 MiB pool: write-back demotes most of it
    fill_bytes(r, 600 + static_cast<uint64_t>(k));
    auto sv = c->save(r.id, kKeys.keys(r.spec.blocks, 600 + static_cast<uint64_t>(k)), iota_ids(r.spec.blocks));
    ASSERT_TRUE(sv.ok());
    ASSERT_EQ(sv->done, r.spec.blocks) << d.log();
  }

  auto all = c->stats_all();
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  ASSERT_EQ(all->tiers.size(), 1u);
  const ops::TierStatsWire& t = all->tiers[0];
  EXPECT_STREQ(t.tier, "disk");
  EXPECT_EQ(t.flags & (ops::kTierPresent | ops::kTierHealthy | ops::kTierStorage | ops::kTierPeers),
            ops::kTierPresent | ops::kTierHealthy | ops::kTierStorage);
  EXPECT_GT(t.blocks, 0u);
  EXPECT_GT(t.used_bytes, 0u);
  EXPECT_GT(t.capacity_bytes, 0u);  // whole slots of the 256 MiB file
  EXPECT_LE(t.capacity_bytes, uint64_t{256} << 20);
  EXPECT_LE(t.used_bytes, t.capacity_bytes);
  EXPECT_GT(t.bytes_written, 0u);
  EXPECT_EQ(t.io_errors, 0u);
  EXPECT_STREQ(t.reason, "");
  auto host = c->stats();  // the old call: the host's figures, unchanged
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->capacity_bytes, all->host.capacity_bytes);

  const std::string text = run_cli(KVFERRY_CLI_PATH, d, "stats --json");
  const auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << text;
  EXPECT_EQ(j.value("tier", ""), "host") << text;
  EXPECT_EQ(j.value("capacity_bytes", uint64_t{0}), uint64_t{8} << 20) << text;
  EXPECT_TRUE(j.contains("entries") && j.contains("blocks_saved") && j.contains("clients")) << text;
  ASSERT_TRUE(j.contains("tiers") && j["tiers"].is_array()) << text;
  int disks = 0;
  for (const auto& e : j["tiers"]) {
    EXPECT_NE(e.value("tier", ""), "remote") << text;
    if (e.value("tier", "") != "disk") continue;
    ++disks;
    EXPECT_GT(e.value("blocks", uint64_t{0}), 0u) << text;
    EXPECT_GT(e.value("used_bytes", uint64_t{0}), 0u) << text;
    EXPECT_EQ(e.value("capacity_bytes", uint64_t{0}), t.capacity_bytes) << text;
    EXPECT_TRUE(e.value("healthy", false)) << text;
    EXPECT_EQ(e.value("io_errors", uint64_t{1}), 0u) << text;
    EXPECT_FALSE(e.contains("peers_live")) << text;
  }
  EXPECT_EQ(disks, 1) << text;

  const std::string human = run_cli(KVFERRY_CLI_PATH, d, "stats");
  const auto disk_lines = lines_starting(human, "disk");
  ASSERT_EQ(disk_lines.size(), 1u) << human;
  EXPECT_NE(disk_lines[0].find(" blocks"), std::string::npos) << human;
  char used_of[64];
  std::snprintf(used_of, sizeof used_of, " of %.1f MiB, ", static_cast<double>(t.capacity_bytes) / (1 << 20));
  EXPECT_NE(disk_lines[0].find(used_of), std::string::npos) << human;
  EXPECT_NE(disk_lines[0].find("healthy, 0 I/O errors, 0 checksum failures"), std::string::npos) << human;
  EXPECT_NE(human.find("host pool"), std::string::npos) << human;
}

// A daemon without a disk tier names none: no entry from the client, an empty "tiers" list and
// no disk line from the CLI.
TEST(DiskTierStats, HostOnlyDaemonNamesNoDisk) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  auto all = c->stats_all();
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_TRUE(all->tiers.empty());
  const std::string text = run_cli(KVFERRY_CLI_PATH, d, "stats --json");
  const auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << text;
  EXPECT_EQ(j.value("tier", ""), "host") << text;
  ASSERT_TRUE(j.contains("tiers") && j["tiers"].is_array()) << text;
  EXPECT_TRUE(j["tiers"].empty()) << text;
  const std::string human = run_cli(KVFERRY_CLI_PATH, d, "stats");
  EXPECT_TRUE(lines_starting(human, "disk").empty()) << human;
  EXPECT_NE(human.find("host pool"), std::string::npos) << human;
}

// The tier entries are written only where the request's arena part has room: near the end of the
// arena the daemon writes fewer (or none) and says so in `count`; args[1] caps them; a request
// without kStatsTiers gets the StatsWire alone, as before. Nothing past what count says is touched.
TEST(DiskTierStats, TierEntriesStayInsideTheArena) {
  DiskDir dir;
  DaemonProcess d(tier_yaml(dir.path, "8MiB", "64MiB"));
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect(d);
  ASSERT_TRUE(c);
  const std::span<uint8_t> arena = c->arena();
  constexpr uint64_t kWire = sizeof(ops::StatsWire), kTier = sizeof(ops::TierStatsWire);
  struct Case {
    uint64_t tail;   // arena bytes from the request's offset to the arena's end
    uint64_t flags;  // args[0]
    uint64_t most;   // args[1]
    uint32_t count;  // the completion's count
  };
  const Case cases[] = {
      {kWire, ops::kStatsTiers, 0, 1},              // no room after the StatsWire
      {kWire + kTier - 8, ops::kStatsTiers, 0, 1},  // not quite room for one
      {kWire + kTier, ops::kStatsTiers, 0, 2},      // room for exactly one
      {kWire + 3 * kTier, ops::kStatsTiers, 0, 2},  // room to spare: one disk entry
      {kWire + 3 * kTier, ops::kStatsTiers, 1, 2},  // capped by args[1]
      {kWire + 3 * kTier, 0, 0, 1},                 // the old request: the StatsWire alone
  };
  uint64_t id = 1000;
  for (const Case& k : cases) {
    const uint64_t off = arena.size() - k.tail;
    ASSERT_EQ(off % 8, 0u);
    std::memset(arena.data() + off, 0xAB, k.tail);
    ring::SubmitEntry e{};
    e.id = ++id;
    e.op = static_cast<uint16_t>(proto::Op::kStats);
    e.arena_offset = static_cast<uint32_t>(off);
    e.args[0] = k.flags;
    e.args[1] = k.most;
    ASSERT_TRUE(c->submit(e).ok());
    ring::CompletionEntry ce{};
    auto got = c->wait({&ce, 1}, 5'000'000);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    ASSERT_EQ(ce.id, e.id);
    ASSERT_EQ(ce.status, 0) << "tail " << k.tail;
    EXPECT_EQ(ce.count, k.count) << "tail " << k.tail << ", args " << k.flags << "/" << k.most;
    const uint64_t written = kWire + uint64_t{ce.count - 1} * kTier;
    if (ce.count == 2) {
      ops::TierStatsWire t;
      std::memcpy(&t, arena.data() + off + kWire, sizeof t);
      EXPECT_STREQ(t.tier, "disk");
      EXPECT_GT(t.capacity_bytes, 0u);
      EXPECT_LE(t.capacity_bytes, uint64_t{64} << 20);
    }
    for (uint64_t i = off + written; i < arena.size(); ++i)
      ASSERT_EQ(arena[i], 0xAB) << "byte " << i - off << " of the request's part, tail " << k.tail;
  }
  // A request whose StatsWire itself does not fit is refused, as before.
  ring::SubmitEntry e{};
  e.id = ++id;
  e.op = static_cast<uint16_t>(proto::Op::kStats);
  e.arena_offset = static_cast<uint32_t>(arena.size() - 8);
  e.args[0] = ops::kStatsTiers;
  ASSERT_TRUE(c->submit(e).ok());
  ring::CompletionEntry ce{};
  ASSERT_TRUE(c->wait({&ce, 1}, 5'000'000).ok());
  EXPECT_EQ(ce.status, static_cast<int16_t>(ErrorCode::kOutOfRange));
}

}  // namespace
}  // namespace kvferry
