// The disk tier (G3) and the fault wrapper, behind the Tier seam. Every test runs on io_uring and on
// the pread/pwrite fallback. Files live under the build directory (a file system with O_DIRECT
// where there is one; otherwise the tests say so and run with direct_io=false).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "kvferry/store/disk_tier.h"
#include "kvferry/store/fault_tier.h"
#include "kvferry/store/tiered_store.h"

#ifndef KVFERRY_DISK_TEST_ROOT
#define KVFERRY_DISK_TEST_ROOT "."
#endif

namespace kvferry::store {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

/// Page-aligned host memory standing in for host-pool slots.
struct Buf {
  explicit Buf(uint64_t n) : bytes(n) {
    const uint64_t len = (n + 4095) / 4096 * 4096;
    p = static_cast<uint8_t*>(std::aligned_alloc(4096, len));
    cap = len;
    std::memset(p, 0xcc, len);
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  uint8_t* p = nullptr;
  uint64_t bytes = 0;
  uint64_t cap = 0;
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A seeded pattern with no zero byte.
void fill(uint8_t* p, uint64_t n, uint64_t seed) {
  uint64_t s = seed * 0x2545f4914f6cdd1dull + 7;
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = splitmix(s);
    for (uint64_t b = 0; b < 8 && i + b < n; ++b) p[i + b] = static_cast<uint8_t>((v >> (8 * b)) | 1);
  }
}

BlockKey key_of(uint64_t i) { return {0xabcdef0000000000ull | i, i * 0x9e3779b97f4a7c15ull + 1}; }

bool direct_io_works(const std::string& dir) {
  const std::string p = dir + "/.direct-probe";
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) return false;
  Buf b(4096);
  const bool ok = ::pwrite(fd, b.p, 4096, 0) == 4096;
  ::close(fd);
  ::unlink(p.c_str());
  return ok;
}

struct Collected {
  std::map<uint64_t, TierCompletion> by_cookie;
};

/// Polls until `n` completions arrived (bounded: 60 s).
Collected collect(Tier& t, size_t n) {
  Collected c;
  std::vector<TierCompletion> got;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (c.by_cookie.size() < n && std::chrono::steady_clock::now() < deadline) {
    got.clear();
    t.poll(got, 1024, 50ms);
    for (auto& x : got) c.by_cookie.emplace(x.cookie, std::move(x));
  }
  EXPECT_EQ(c.by_cookie.size(), n) << "completions missing after 60 s";
  return c;
}

class DiskTierTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    for (char& ch : name)
      if (ch == '/') ch = '_';
    dir_ = std::string(KVFERRY_DISK_TEST_ROOT) + "/disk-" + std::to_string(::getpid()) + "-" + name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    direct_ = direct_io_works(dir_);
    if (!direct_) std::printf("[note] %s has no O_DIRECT: the disk tier runs with direct_io=false\n", dir_.c_str());
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  DiskTier::Options options(uint64_t capacity = 256 * MiB, uint64_t extent = 16 * MiB) {
    DiskTier::Options o;
    o.path = dir_;
    o.capacity = capacity;
    o.extent_bytes = extent;
    o.direct_io = direct_;
    o.force_fallback = GetParam();
    o.queue_depth = 32;
    o.log = [this](std::string_view l) {
      std::lock_guard lk(log_mu_);
      log_.emplace_back(l);
    };
    return o;
  }

  std::unique_ptr<DiskTier> open(DiskTier::Options o) {
    auto r = DiskTier::open(std::move(o));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return nullptr;
    auto t = std::move(r).value();
    if (!GetParam() && t->engine() != "io_uring") {
      skip_reason_ = "io_uring is not available here (" + std::string(t->engine()) + " chosen)";
      return nullptr;
    }
    return t;
  }
#define OPEN_OR_SKIP(var, opts)                                    \
  auto var = open(opts);                                           \
  if (!var && !skip_reason_.empty()) GTEST_SKIP() << skip_reason_; \
  ASSERT_TRUE(var)

  bool logged(std::string_view needle) {
    std::lock_guard lk(log_mu_);
    for (auto& l : log_)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  }

  /// Writes blocks (key_of(first + i), pattern seed = key index) as one batch; returns the statuses.
  std::vector<Status> write_blocks(Tier& t, uint64_t first, size_t n, uint64_t bytes, std::string ns = "m|mla|t") {
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<TierRequest> reqs;
    for (size_t i = 0; i < n; ++i) {
      auto b = std::make_unique<Buf>(bytes);
      fill(b->p, bytes, first + i);
      TierRequest r;
      r.op = TierOp::kWrite;
      r.record = {ns, key_of(first + i), "mla_fp8", bytes, block_checksum(b->p, bytes), 0};
      r.buf = b->p;
      r.buf_bytes = b->cap;
      r.cookie = i;
      reqs.push_back(r);
      bufs.push_back(std::move(b));
    }
    EXPECT_TRUE(t.submit(reqs).ok());
    auto c = collect(t, n);
    std::vector<Status> out;
    for (size_t i = 0; i < n; ++i)
      out.push_back(c.by_cookie.count(i) ? c.by_cookie[i].status : Status(ErrorCode::kTimeout, "lost"));
    return out;
  }

  /// Reads key_of(k) and checks it against its pattern; returns the status.
  Status read_check(Tier& t, uint64_t k, uint64_t bytes, std::string ns = "m|mla|t", bool expect_exact = true) {
    Buf b(bytes);
    TierRequest r;
    r.op = TierOp::kRead;
    r.record.ns = ns;
    r.record.key = key_of(k);
    r.buf = b.p;
    r.buf_bytes = b.cap;
    r.cookie = 77;
    EXPECT_TRUE(t.submit({&r, 1}).ok());
    auto c = collect(t, 1);
    if (!c.by_cookie.count(77)) return {ErrorCode::kTimeout, "lost"};
    const TierCompletion& done = c.by_cookie[77];
    if (done.status.ok() && expect_exact) {
      Buf want(bytes);
      fill(want.p, bytes, k);
      EXPECT_EQ(done.record.bytes, bytes);
      EXPECT_EQ(std::memcmp(b.p, want.p, bytes), 0) << "block " << k << " differs";
      EXPECT_EQ(done.record.key, key_of(k));
    }
    return done.status;
  }

  std::string dir_;
  bool direct_ = true;
  std::string skip_reason_;
  std::mutex log_mu_;
  std::vector<std::string> log_;
};

TEST_P(DiskTierTest, RoundTripManySizesByteForByte) {
  OPEN_OR_SKIP(t, options());
  // A "host pool" of one registered chunk, carved into block buffers, as the daemon would offer.
  const std::vector<std::pair<uint64_t, size_t>> sizes = {
      {4 * KiB, 16}, {20 * KiB + 3, 8}, {256 * KiB, 16}, {1 * MiB, 12}};
  uint64_t total = 0;
  for (auto [b, n] : sizes) total += (b + 4095) / 4096 * 4096 * n;
  Buf pool(total);
  iovec iov{pool.p, total};
  EXPECT_TRUE(t->register_buffers({&iov, 1}).ok());
  std::vector<TierRequest> reqs;
  uint64_t off = 0, k = 0;
  std::map<uint64_t, uint64_t> bytes_of;
  for (auto [b, n] : sizes)
    for (size_t i = 0; i < n; ++i, ++k) {
      fill(pool.p + off, b, k);
      TierRequest r;
      r.op = TierOp::kWrite;
      r.record = {"m|mla|t", key_of(k), "mla_bf16", b, block_checksum(pool.p + off, b), 0};
      r.buf = pool.p + off;
      r.buf_bytes = (b + 4095) / 4096 * 4096;
      r.cookie = k;
      reqs.push_back(r);
      bytes_of[k] = b;
      off += r.buf_bytes;
    }
  ASSERT_TRUE(t->submit(reqs).ok());
  auto c = collect(*t, reqs.size());
  for (auto& [cookie, done] : c.by_cookie) {
    EXPECT_TRUE(done.status.ok()) << cookie << ": " << done.status.to_string();
    EXPECT_GT(done.record.generation, 0u);
  }
  EXPECT_EQ(t->usage().blocks, reqs.size());
  // Read everything back into the (wiped) registered chunk, then into unregistered buffers.
  std::memset(pool.p, 0, total);
  for (auto& r : reqs) r.op = TierOp::kRead;
  ASSERT_TRUE(t->submit(reqs).ok());
  auto rc = collect(*t, reqs.size());
  for (auto& r : reqs) {
    ASSERT_TRUE(rc.by_cookie[r.cookie].status.ok()) << rc.by_cookie[r.cookie].status.to_string();
    Buf want(bytes_of[r.cookie]);
    fill(want.p, want.bytes, r.cookie);
    EXPECT_EQ(std::memcmp(r.buf, want.p, want.bytes), 0) << "block " << r.cookie;
    EXPECT_EQ(rc.by_cookie[r.cookie].record.format, "mla_bf16");
  }
  for (uint64_t i : {uint64_t{0}, uint64_t{20}, uint64_t{40}, k - 1}) EXPECT_TRUE(read_check(*t, i, bytes_of[i]).ok());
  // Misses: an absent key, a present key in another namespace.
  EXPECT_EQ(read_check(*t, 9999, 4 * KiB).code(), ErrorCode::kNotFound);
  EXPECT_EQ(read_check(*t, 0, 4 * KiB, "other|mla|t").code(), ErrorCode::kNotFound);
  EXPECT_FALSE(t->lookup("m|mla|t", key_of(9999)));
  auto rec = t->lookup("m|mla|t", key_of(3));
  ASSERT_TRUE(rec);
  EXPECT_EQ(rec->bytes, 4 * KiB);
  // A second write of a stored key is done at once; erase makes it a miss.
  EXPECT_TRUE(write_blocks(*t, 3, 1, 4 * KiB)[0].ok());
  EXPECT_TRUE(t->erase("m|mla|t", key_of(3)).ok());
  EXPECT_EQ(read_check(*t, 3, 4 * KiB).code(), ErrorCode::kNotFound);
  EXPECT_TRUE(t->health().ok);
  EXPECT_GE(t->health().bytes_written, total - 64 * KiB);
}

TEST_P(DiskTierTest, EmptyBatchAndBadRequests) {
  OPEN_OR_SKIP(t, options());
  EXPECT_TRUE(t->submit({}).ok());
  Buf b(8 * KiB);
  TierRequest r;
  r.op = TierOp::kWrite;
  r.record = {"ns", key_of(1), "mla_fp8", 8 * KiB, 0, 0};
  r.buf = b.p;
  r.buf_bytes = 4 * KiB;  // too small
  r.cookie = 1;
  ASSERT_TRUE(t->submit({&r, 1}).ok());
  auto c = collect(*t, 1);
  EXPECT_EQ(c.by_cookie[1].status.code(), ErrorCode::kInvalidArgument);
  r.buf_bytes = b.cap;
  r.record.bytes = 32 * MiB;  // larger than an extent
  r.buf_bytes = 32 * MiB;
  ASSERT_TRUE(t->submit({&r, 1}).ok());
  EXPECT_EQ(collect(*t, 1).by_cookie[1].status.code(), ErrorCode::kInvalidArgument);
}

TEST_P(DiskTierTest, RestartRecoversBlocksAndOrder) {
  for (Durability d : {Durability::kBatch, Durability::kEach}) {
    SCOPED_TRACE(d == Durability::kBatch ? "batch" : "each");
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<BlockRecord> before;
    {
      auto o = options();
      o.durability = d;
      OPEN_OR_SKIP(t, o);
      ASSERT_TRUE(t->recover().ok());
      for (uint64_t batch = 0; batch < 3; ++batch)
        for (const Status& s : write_blocks(*t, batch * 10, 10, 256 * KiB)) EXPECT_TRUE(s.ok()) << s.to_string();
      for (const Status& s : write_blocks(*t, 100, 4, 1 * MiB, "other|mla|t")) EXPECT_TRUE(s.ok());
      before = t->list(std::nullopt, 1000);
      ASSERT_EQ(before.size(), 34u);
    }
    auto t = open(options());
    ASSERT_TRUE(t);
    auto n = t->recover();
    ASSERT_TRUE(n.ok()) << n.status().to_string();
    EXPECT_EQ(*n, 34u);
    auto after = t->list(std::nullopt, 1000);
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) {  // newest first, generations kept
      EXPECT_EQ(after[i].key, before[i].key);
      EXPECT_EQ(after[i].generation, before[i].generation);
      EXPECT_EQ(after[i].checksum, before[i].checksum);
      EXPECT_EQ(after[i].ns, before[i].ns);
    }
    for (uint64_t k = 0; k < 30; ++k) EXPECT_TRUE(read_check(*t, k, 256 * KiB).ok()) << k;
    for (uint64_t k = 100; k < 104; ++k) EXPECT_TRUE(read_check(*t, k, 1 * MiB, "other|mla|t").ok()) << k;
    EXPECT_EQ(t->recover().status().code(), ErrorCode::kBusy);
    // New writes continue the generation sequence.
    ASSERT_TRUE(write_blocks(*t, 200, 1, 4 * KiB)[0].ok());
    EXPECT_GT(t->lookup("m|mla|t", key_of(200))->generation, before.front().generation);
  }
}

TEST_P(DiskTierTest, KillNineDuringWritesKeepsEveryCompletedBlock) {
  {
    OPEN_OR_SKIP(probe, options());  // skips here when io_uring is not available
  }
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  int pfd[2];
  ASSERT_EQ(::pipe(pfd), 0);
  const uint64_t bytes = 64 * KiB;
  auto o = options();
  o.log = nullptr;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pfd[0]);
    auto r = DiskTier::open(o);
    if (!r.ok()) ::_exit(2);
    auto& t = *r.value();
    std::vector<std::unique_ptr<Buf>> bufs;
    for (uint64_t batch = 0; batch < 2000; ++batch) {  // bounded; the parent kills it long before
      std::vector<TierRequest> reqs;
      bufs.clear();
      for (uint64_t i = 0; i < 8; ++i) {
        const uint64_t k = batch * 8 + i;
        auto b = std::make_unique<Buf>(bytes);
        fill(b->p, bytes, k);
        TierRequest q;
        q.op = TierOp::kWrite;
        q.record = {"m|mla|t", key_of(k), "mla_fp8", bytes, block_checksum(b->p, bytes), 0};
        q.buf = b->p;
        q.buf_bytes = b->cap;
        q.cookie = k;
        reqs.push_back(q);
        bufs.push_back(std::move(b));
      }
      if (!t.submit(reqs).ok()) ::_exit(3);
      size_t got = 0;
      std::vector<TierCompletion> done;
      for (int spin = 0; got < reqs.size() && spin < 2000; ++spin) {
        done.clear();
        got += t.poll(done, 64, std::chrono::milliseconds(10));
        for (auto& d : done)
          if (d.status.ok()) {
            const uint64_t k = d.cookie;
            if (::write(pfd[1], &k, sizeof k) != sizeof k) ::_exit(4);
          }
      }
    }
    ::_exit(0);
  }
  ::close(pfd[1]);
  std::vector<uint64_t> reported;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (reported.size() < 200 && std::chrono::steady_clock::now() < deadline) {
    uint64_t k;
    const ssize_t n = ::read(pfd[0], &k, sizeof k);
    if (n != sizeof k) break;
    reported.push_back(k);
  }
  ::kill(child, SIGKILL);
  int wst = 0;
  ::waitpid(child, &wst, 0);
  uint64_t k;  // completions reported between our last read and the kill count too
  ::fcntl(pfd[0], F_SETFL, O_NONBLOCK);
  while (::read(pfd[0], &k, sizeof k) == sizeof k) reported.push_back(k);
  ::close(pfd[0]);
  ASSERT_GE(reported.size(), 8u) << "the writer reported too little before it was killed";

  auto t = open(options());
  ASSERT_TRUE(t);
  auto n = t->recover();
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_GE(*n, reported.size());
  for (uint64_t key : reported) EXPECT_TRUE(read_check(*t, key, bytes).ok()) << "completed block " << key << " lost";
  // Whatever else is there (in flight at the kill) is exact or refused, never wrong.
  size_t extra = 0, refused = 0;
  for (const BlockRecord& r : t->list(std::nullopt, 100000)) {
    const uint64_t kk = r.key.hi & 0xffffffffull;
    if (std::find(reported.begin(), reported.end(), kk) != reported.end()) continue;
    ++extra;
    Status s = read_check(*t, kk, bytes);
    if (!s.ok()) {
      ++refused;
      EXPECT_EQ(s.code(), ErrorCode::kChecksumMismatch) << s.to_string();
    }
  }
  std::printf("[info] kill -9: %zu completed blocks all back; %zu more found (%zu refused as damaged)\n",
              reported.size(), extra, refused);
}

TEST_P(DiskTierTest, CorruptedSlotsAreCaughtAndDropped) {
  uint64_t data_off = 0, header_off = 0;
  std::string file;
  {
    OPEN_OR_SKIP(t, options());
    for (const Status& s : write_blocks(*t, 0, 8, 256 * KiB)) ASSERT_TRUE(s.ok());
    data_off = t->slot_of("m|mla|t", key_of(2))->first + DiskTier::kHeaderBytes + 1000;
    header_off = t->slot_of("m|mla|t", key_of(5))->first + 100;
    file = t->file_path();
  }
  {
    const int fd = ::open(file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char garbage[] = "garbage written over a slot by the test";
    ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(data_off)),
              static_cast<ssize_t>(sizeof garbage));
    ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(header_off)),
              static_cast<ssize_t>(sizeof garbage));
    ::fsync(fd);
    ::close(fd);
  }
  auto t = open(options());
  ASSERT_TRUE(t);
  auto n = t->recover();
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 7u);  // the damaged header's block is gone
  EXPECT_TRUE(logged("damaged header"));
  EXPECT_FALSE(t->lookup("m|mla|t", key_of(5)));
  // The damaged data is caught by its checksum on read and dropped, never served.
  Status s = read_check(*t, 2, 256 * KiB);
  EXPECT_EQ(s.code(), ErrorCode::kChecksumMismatch) << s.to_string();
  EXPECT_TRUE(logged("no longer matches its XXH3"));
  EXPECT_FALSE(t->lookup("m|mla|t", key_of(2)));
  EXPECT_EQ(read_check(*t, 2, 256 * KiB).code(), ErrorCode::kNotFound);
  EXPECT_EQ(t->health().checksum_failures, 1u);
  for (uint64_t k : {0, 1, 3, 4, 6, 7}) EXPECT_TRUE(read_check(*t, k, 256 * KiB).ok()) << k;
}

TEST_P(DiskTierTest, FullTierEvictsOldestUnpinnedThenFails) {
  // Two extents of 1 MiB: 3 slots of 256 KiB + header each, 6 in all.
  const uint64_t table = 4096 * 2;
  auto o = options(table + 2 * MiB, 1 * MiB);
  OPEN_OR_SKIP(t, o);
  for (const Status& s : write_blocks(*t, 0, 6, 256 * KiB)) ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(t->pin("m|mla|t", key_of(0)).ok());
  auto st = write_blocks(*t, 10, 3, 256 * KiB);
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.to_string();
  auto victims = t->take_victims();
  ASSERT_EQ(victims.size(), 3u);
  EXPECT_EQ(victims[0].key, key_of(1));  // oldest unpinned first
  EXPECT_EQ(victims[1].key, key_of(2));
  EXPECT_EQ(victims[2].key, key_of(3));
  EXPECT_TRUE(read_check(*t, 0, 256 * KiB).ok());
  EXPECT_EQ(read_check(*t, 1, 256 * KiB).code(), ErrorCode::kNotFound);
  for (uint64_t k : {4, 5, 10, 11, 12}) EXPECT_TRUE(read_check(*t, k, 256 * KiB).ok()) << k;
  // Everything pinned: the next write fails with a clear per-block error.
  for (uint64_t k : {4, 5, 10, 11, 12}) ASSERT_TRUE(t->pin("m|mla|t", key_of(k)).ok());
  auto full = write_blocks(*t, 20, 2, 256 * KiB);
  for (const Status& s : full) {
    EXPECT_EQ(s.code(), ErrorCode::kResourceExhausted);
    EXPECT_NE(s.message().find("is full"), std::string::npos) << s.message();
  }
  // Explicit eviction returns victims (unpinned only).
  ASSERT_TRUE(t->unpin("m|mla|t", key_of(4)).ok());
  auto ev = t->evict(1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, key_of(4));
  EXPECT_EQ(t->erase("m|mla|t", key_of(5)).code(), ErrorCode::kBusy);
  EXPECT_EQ(t->usage().blocks, 5u);
  EXPECT_EQ(t->usage().pinned, 5u);
  // A block of another size class takes an extent once one is empty.
  for (uint64_t k : {0, 5, 10, 11, 12}) ASSERT_TRUE(t->unpin("m|mla|t", key_of(k)).ok());
  auto big = write_blocks(*t, 30, 1, 600 * KiB);
  EXPECT_TRUE(big[0].ok()) << big[0].to_string();
  EXPECT_TRUE(read_check(*t, 30, 600 * KiB).ok());
}

TEST_P(DiskTierTest, ShortReadOfATruncatedFileIsDataLoss) {
  OPEN_OR_SKIP(t, options());
  for (const Status& s : write_blocks(*t, 0, 2, 256 * KiB)) ASSERT_TRUE(s.ok());
  const uint64_t slot = t->slot_of("m|mla|t", key_of(1))->first;
  ASSERT_EQ(::truncate(t->file_path().c_str(), static_cast<off_t>(slot + DiskTier::kHeaderBytes + 64 * KiB)), 0);
  Status s = read_check(*t, 1, 256 * KiB);
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find("short read"), std::string::npos) << s.message();
  EXPECT_FALSE(t->lookup("m|mla|t", key_of(1)));
  EXPECT_TRUE(read_check(*t, 0, 256 * KiB).ok());
}

TEST_P(DiskTierTest, FaultWrapperErrorsShortIoDelayAndCorruption) {
  auto inner = open(options());
  if (!inner && !skip_reason_.empty()) GTEST_SKIP() << skip_reason_;
  ASSERT_TRUE(inner);
  DiskTier* disk = inner.get();
  FaultTier::Knobs k;
  k.error_errno = EIO;
  k.error_on_nth = 3;
  FaultTier ft(std::move(inner), k);
  auto st = write_blocks(ft, 0, 8, 64 * KiB);
  for (size_t i = 0; i < st.size(); ++i) {
    if (i == 2)
      EXPECT_EQ(st[i].code(), ErrorCode::kIo) << st[i].to_string();
    else
      EXPECT_TRUE(st[i].ok()) << i << ": " << st[i].to_string();
  }
  EXPECT_FALSE(ft.health().ok);
  EXPECT_EQ(ft.health().reason, "injected EIO");
  EXPECT_EQ(read_check(ft, 2, 64 * KiB).code(), ErrorCode::kNotFound);  // the failed write is not there

  k = {};
  k.error_errno = ENOSPC;
  k.error_rate = 1;
  k.writes_only = true;
  ft.set_knobs(k);
  EXPECT_EQ(write_blocks(ft, 50, 1, 64 * KiB)[0].code(), ErrorCode::kResourceExhausted);
  EXPECT_TRUE(read_check(ft, 0, 64 * KiB).ok());  // reads unaffected

  k = {};
  k.short_rate = 1;
  ft.set_knobs(k);
  EXPECT_EQ(read_check(ft, 1, 64 * KiB).code(), ErrorCode::kDataLoss);
  EXPECT_EQ(write_blocks(ft, 60, 1, 64 * KiB)[0].code(), ErrorCode::kIo);
  EXPECT_FALSE(ft.lookup("m|mla|t", key_of(60)));

  // Corruption on write: the stored copy is wrong, so the tier's checksum refuses it on read.
  k = {};
  k.corrupt_write_rate = 1;
  ft.set_knobs(k);
  ASSERT_TRUE(write_blocks(ft, 70, 1, 64 * KiB)[0].ok());
  k = {};
  ft.set_knobs(k);
  EXPECT_EQ(read_check(ft, 70, 64 * KiB).code(), ErrorCode::kChecksumMismatch);
  EXPECT_FALSE(disk->lookup("m|mla|t", key_of(70)));

  // Corruption on read: reported ok, and the caller's own checksum check catches it.
  k.corrupt_read_rate = 1;
  ft.set_knobs(k);
  Buf b(64 * KiB);
  TierRequest r;
  r.op = TierOp::kRead;
  r.record.ns = "m|mla|t";
  r.record.key = key_of(4);
  r.buf = b.p;
  r.buf_bytes = b.cap;
  r.cookie = 5;
  ASSERT_TRUE(ft.submit({&r, 1}).ok());
  auto c = collect(ft, 1);
  ASSERT_TRUE(c.by_cookie[5].status.ok());
  EXPECT_NE(block_checksum(b.p, 64 * KiB), c.by_cookie[5].record.checksum);
  EXPECT_EQ(ft.counts().corrupted_reads, 1u);

  // Delay: completions are held.
  k = {};
  k.delay = 30ms;
  ft.set_knobs(k);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(read_check(ft, 5, 64 * KiB).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 30ms);
}

TEST_P(DiskTierTest, OpenRefusalsNameThePathAndErrno) {
  auto o = options();
  o.path = dir_ + "/no/such/dir/slots";
  auto r = DiskTier::open(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(o.path), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("errno 2"), std::string::npos) << r.status().message();
  o = options(4 * MiB, 16 * MiB);
  r = DiskTier::open(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kConfig);
  EXPECT_FALSE(parse_durability("sometimes").ok());
  EXPECT_EQ(*parse_durability("each"), Durability::kEach);
}

TEST_P(DiskTierTest, RecoveryOfManySmallSlotsIsBoundedAndPrinted) {
  const size_t kBlocks = 20000;
  const uint64_t bytes = 4 * KiB;  // 8 KiB slots
  {
    auto o = options(kBlocks * 8 * KiB + 32 * MiB, 16 * MiB);
    o.durability = Durability::kNone;
    OPEN_OR_SKIP(t, o);
    Buf b(bytes);
    std::vector<TierRequest> reqs;
    for (size_t base = 0; base < kBlocks; base += 1000) {
      reqs.clear();
      for (size_t i = base; i < base + 1000; ++i) {
        TierRequest r;
        r.op = TierOp::kWrite;
        b.p[0] = static_cast<uint8_t>(i | 1);  // content is not checked here, only the headers' count
        r.record = {"m|mla|t", key_of(i), "mla_fp8", bytes, 0, 0};
        r.buf = b.p;  // every write from the same buffer: the record's checksum is unused
        r.buf_bytes = b.cap;
        r.cookie = i;
        reqs.push_back(r);
      }
      ASSERT_TRUE(t->submit(reqs).ok());
      auto c = collect(*t, reqs.size());
      for (auto& [ck, d] : c.by_cookie) ASSERT_TRUE(d.status.ok()) << d.status.to_string();
    }
  }
  auto o = options(kBlocks * 8 * KiB + 32 * MiB, 16 * MiB);
  auto t = open(o);
  ASSERT_TRUE(t);
  const auto t0 = std::chrono::steady_clock::now();
  auto n = t->recover();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(*n, kBlocks);
  std::printf("[info] recovery of %zu slot headers (%s): %.0f ms\n", kBlocks, std::string(t->engine()).c_str(), ms);
}

// Read blocks are checked on the verifier threads while the I/O thread keeps reading: many large
// reads in flight, in several batches (one of them mixing reads with a write), with one, two and
// four verifiers. Every request completes exactly once, every good block byte for byte, and the
// one damaged block is refused, counted, logged and dropped, whichever thread checked it.
TEST_P(DiskTierTest, VerifierThreadsServeEachReadOnceAndRefuseDamage) {
  const uint64_t bytes = 1 * MiB + 4 * KiB + 123;  // a large block with a ragged tail
  const size_t n = 24, damaged = 7;
  for (unsigned verifiers : {1u, 2u, 4u}) {
    SCOPED_TRACE(std::to_string(verifiers) + " verifier thread(s)");
    fs::remove(dir_ + "/kvferry-g3.slots");
    auto o = options(64 * MiB, 16 * MiB);
    o.queue_depth = 8;  // fewer than the reads: refills happen while others are verified
    o.verify_threads = verifiers;
    OPEN_OR_SKIP(t, o);
    for (const Status& s : write_blocks(*t, 0, n, bytes)) ASSERT_TRUE(s.ok()) << s.to_string();
    {
      const int fd = ::open(t->file_path().c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      const char garbage[] = "bytes flipped under the tier";
      const uint64_t off = t->slot_of("m|mla|t", key_of(damaged))->first + DiskTier::kHeaderBytes + bytes - 64;
      ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(off)), static_cast<ssize_t>(sizeof garbage));
      ASSERT_EQ(::fsync(fd), 0);
      ::close(fd);
    }
    const uint64_t cap = (bytes + 4095) / 4096 * 4096;
    Buf pool(cap * (n + 1));
    std::memset(pool.p, 0, pool.cap);
    const iovec iov{pool.p, pool.cap};
    ASSERT_TRUE(t->register_buffers({&iov, 1}).ok());
    std::vector<TierRequest> reqs;
    for (size_t i = 0; i < n; ++i) {
      TierRequest r;
      r.op = TierOp::kRead;
      r.record.ns = "m|mla|t";
      r.record.key = key_of(i);
      r.buf = pool.p + i * cap;
      r.buf_bytes = cap;
      r.cookie = i;
      reqs.push_back(r);
    }
    TierRequest w;  // the last batch also writes a block
    w.op = TierOp::kWrite;
    w.buf = pool.p + n * cap;
    w.buf_bytes = cap;
    fill(w.buf, bytes, 500);
    w.record = {"m|mla|t", key_of(500), "mla_fp8", bytes, block_checksum(w.buf, bytes), 0};
    w.cookie = 500;
    for (size_t b = 0; b < n; b += 8) {
      std::vector<TierRequest> batch(reqs.begin() + static_cast<std::ptrdiff_t>(b),
                                     reqs.begin() + static_cast<std::ptrdiff_t>(b + 8));
      if (b + 8 == n) batch.insert(batch.begin() + 3, w);
      ASSERT_TRUE(t->submit(batch).ok());
    }
    // Exactly one completion per request: nothing more turns up after all are in.
    auto c = collect(*t, n + 1);
    std::vector<TierCompletion> extra;
    EXPECT_EQ(t->poll(extra, 64, 200ms), 0u);
    EXPECT_TRUE(c.by_cookie[500].status.ok()) << c.by_cookie[500].status.to_string();
    for (size_t i = 0; i < n; ++i) {
      const TierCompletion& d = c.by_cookie[i];
      if (i == damaged) {
        EXPECT_EQ(d.status.code(), ErrorCode::kChecksumMismatch) << d.status.to_string();
        continue;
      }
      ASSERT_TRUE(d.status.ok()) << i << ": " << d.status.to_string();
      Buf want(bytes);
      fill(want.p, bytes, i);
      EXPECT_EQ(std::memcmp(pool.p + i * cap, want.p, bytes), 0) << "block " << i;
      EXPECT_EQ(d.record.key, key_of(i));
    }
    EXPECT_EQ(t->health().checksum_failures, 1u);
    EXPECT_TRUE(logged("no longer matches its XXH3"));
    EXPECT_FALSE(t->lookup("m|mla|t", key_of(damaged)));
    EXPECT_TRUE(t->lookup("m|mla|t", key_of(500)));
    EXPECT_EQ(t->health().bytes_read, (n - 1) * bytes);
    EXPECT_TRUE(read_check(*t, 500, bytes).ok());
  }
}

// A tier destroyed while its reads are in flight or with the verifiers neither hangs nor crashes:
// the I/O thread waits for the verifiers to hand back every read it gave them.
TEST_P(DiskTierTest, DestroyWhileReadsAreVerified) {
  const uint64_t bytes = 512 * KiB;
  const size_t n = 32;
  Buf pool(bytes * n);
  std::vector<TierRequest> reqs;
  {
    auto o = options(64 * MiB, 16 * MiB);
    o.verify_threads = 2;
    OPEN_OR_SKIP(t, o);
    for (const Status& s : write_blocks(*t, 0, n, bytes)) ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t i = 0; i < n; ++i) {
      TierRequest r;
      r.op = TierOp::kRead;
      r.record.ns = "m|mla|t";
      r.record.key = key_of(i);
      r.buf = pool.p + i * bytes;
      r.buf_bytes = bytes;
      r.cookie = i;
      reqs.push_back(r);
    }
    for (int round = 0; round < 4; ++round) ASSERT_TRUE(t->submit(reqs).ok());
    // Let some reads land, then destroy the tier with the rest in flight or being checked.
    std::vector<TierCompletion> got;
    t->poll(got, 1, 5s);
    EXPECT_FALSE(got.empty());
  }
  SUCCEED();
}

INSTANTIATE_TEST_SUITE_P(Engines, DiskTierTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("fallback") : std::string("uring"); });

// ---- TieredStore: the host pool over the disk tier, pipelined in steps ----

/// A host region (CPU backend) of `blocks` blocks of 8 layers x 16 tokens of mla_fp8 (72 KiB),
/// filled with a seeded non-zero pattern.
struct TierRegion {
  TierRegion(int64_t blocks, uint64_t seed)
      : spec{8, blocks, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor},
        bytes(static_cast<size_t>(spec.region_bytes())) {
    fill(bytes.data(), bytes.size(), seed);
  }
  RegionAccess access() { return {bytes.data(), spec, false}; }
  const uint8_t* block(int64_t b) const { return bytes.data() + spec.page_offset(0, b); }
  KvCacheSpec spec;
  std::vector<uint8_t> bytes;
};

/// A 4 MiB host pool over `lower`, with steps of 512 KiB (7 blocks), so a request of dozens of
/// blocks runs many steps with the lower tier's I/O in flight across them.
struct Tiers {
  Registry metrics;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<BlockIndex> index;
  std::unique_ptr<OffloadService> svc;
  std::unique_ptr<TieredStore> store;
  Tier* lower = nullptr;
  NamespaceId ns = 0;

  Tiers(std::unique_ptr<Tier> t, bool write_through, bool trust, uint64_t pool_bytes = 4 * MiB) {
    HostPool::Options o;
    o.capacity = pool_bytes;
    o.chunk_bytes = 1 * MiB;
    o.pin = false;
    pool = std::move(HostPool::create(o)).value();
    BlockIndex::Options io;
    io.write_back = true;
    index = std::make_unique<BlockIndex>(*pool, io);
    svc = std::move(OffloadService::create(*index, metrics, {})).value();
    const iovec whole{pool->base(), static_cast<size_t>(pool->capacity())};
    EXPECT_TRUE(t->register_buffers({&whole, 1}).ok());
    TieredStore::Options so;
    so.write_through = write_through;
    so.trust_lower_reads = trust;
    so.step_bytes = 512 * KiB;
    lower = t.get();
    store = std::make_unique<TieredStore>(*index, *svc, metrics, std::move(t), so);
    ns = index->intern_namespace("m|mla|t");
  }
  uint64_t counter(const std::string& series) const {
    const std::string text = metrics.render();
    const size_t at = text.find(series + " ");
    return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + series.size() + 1, nullptr, 10);
  }
};

std::vector<BlockKey> tier_keys(size_t n, uint64_t salt) {
  std::vector<BlockKey> k(n);
  for (size_t i = 0; i < n; ++i) k[i] = {salt, i * 2654435761u + 1};
  return k;
}

constexpr auto kNever = OffloadService::kNoDeadline;

// Saves of 96 blocks (6.75 MiB) through a 4 MiB pool and loads back into other block ids, byte
// for byte, in write-back and write-through mode, with and without trusting the tier's read
// checks; then a save and a load told to yield at every step return prefixes that the rest
// completes.
TEST_P(DiskTierTest, TieredStorePipelinedStepsRoundTripByteForByte) {
  for (bool wt : {false, true}) {
    for (bool trust : {false, true}) {
      SCOPED_TRACE(std::string(wt ? "write-through" : "write-back") + (trust ? ", trusted reads" : ""));
      fs::remove(dir_ + "/kvferry-g3.slots");
      OPEN_OR_SKIP(disk, options());
      Tiers t(std::move(disk), wt, trust);
      const int64_t n = 96;
      TierRegion src(n, 11 + wt * 2 + trust), dst(n, 99);
      const auto keys = tier_keys(n, 1000 + wt * 2 + trust);
      std::vector<int64_t> from(n), to(n);
      std::iota(from.begin(), from.end(), 0);
      for (int64_t i = 0; i < n; ++i) to[i] = n - 1 - i;
      auto sv = t.store->save(src.access(), t.ns, keys, from, kNever);
      ASSERT_EQ(sv.size(), static_cast<size_t>(n));
      for (size_t i = 0; i < sv.size(); ++i) ASSERT_TRUE(sv[i].ok()) << i << ": " << sv[i].to_string();
      // Write-through: every block is on disk once its save completed. Write-back: every block
      // is on the host or on disk (the pool keeps the newest).
      for (size_t i = 0; i < keys.size(); ++i) {
        const bool on_disk = t.lower->lookup("m|mla|t", keys[i]).has_value();
        if (wt) {
          EXPECT_TRUE(on_disk) << i;
        }
        if (!on_disk) {
          EXPECT_TRUE(t.index->lookup(t.ns, {&keys[i], 1}).present[0]) << i;
        }
      }
      auto ld = t.store->load(dst.access(), t.ns, keys, to, kNever);
      ASSERT_EQ(ld.size(), static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(ld[i].ok()) << i << ": " << ld[i].to_string();
        EXPECT_EQ(std::memcmp(dst.block(to[i]), src.block(i), static_cast<size_t>(src.spec.block_bytes())), 0)
            << "block " << i;
      }
      const uint64_t trusted = t.counter("kvferry_tier_verified_promotions_total{tier=\"disk\"}");
      if (trust)
        EXPECT_GT(trusted, 0u);
      else
        EXPECT_EQ(trusted, 0u);
      EXPECT_EQ(t.index->stats().writing, 0u);

      // Turns: yield at every step boundary once 100 KiB are done.
      const auto more = tier_keys(40, 5000 + wt * 2 + trust);
      std::vector<int64_t> ids(40);
      std::iota(ids.begin(), ids.end(), 0);
      TieredStore::Turn turn;
      turn.bytes = 100 * KiB;
      turn.yield = [] { return true; };
      size_t done = 0, calls = 0;
      while (done < more.size()) {
        auto r = t.store->save(src.access(), t.ns, std::span(more).subspan(done), std::span(ids).subspan(done), kNever,
                               turn);
        ASSERT_FALSE(r.empty());
        for (const Status& st : r) EXPECT_TRUE(st.ok()) << st.to_string();
        done += r.size();
        ++calls;
      }
      EXPECT_GT(calls, 2u);
      done = calls = 0;
      while (done < more.size()) {
        auto r = t.store->load(dst.access(), t.ns, std::span(more).subspan(done), std::span(ids).subspan(done), kNever,
                               turn);
        ASSERT_FALSE(r.empty());
        for (const Status& st : r) EXPECT_TRUE(st.ok()) << st.to_string();
        done += r.size();
        ++calls;
      }
      EXPECT_GT(calls, 2u);
      for (int64_t i = 0; i < 40; ++i)
        EXPECT_EQ(std::memcmp(dst.block(i), src.block(i), static_cast<size_t>(src.spec.block_bytes())), 0) << i;
      EXPECT_EQ(t.index->stats().writing, 0u);
    }
  }
}

// A promoted block is not hashed again when the tier checked it, but a slot damaged on disk is
// still caught (by the tier), reported once and dropped; its neighbours load byte for byte.
TEST_P(DiskTierTest, TieredStoreTrustedPromotionStillCatchesADamagedSlot) {
  OPEN_OR_SKIP(disk, options());
  DiskTier* dt = disk.get();
  Tiers t(std::move(disk), true, true);
  const int64_t n = 24;
  TierRegion src(n, 5), dst(n, 6);
  const auto keys = tier_keys(n, 77);
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  for (const Status& s : t.store->save(src.access(), t.ns, keys, ids, kNever)) ASSERT_TRUE(s.ok()) << s.to_string();
  t.index->evict_all(std::nullopt);  // every block now lives on disk only
  const uint64_t off = dt->slot_of("m|mla|t", keys[9])->first + DiskTier::kHeaderBytes + 4000;
  {
    const int fd = ::open(dt->file_path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char garbage[] = "garbage over a promoted block";
    ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(off)), static_cast<ssize_t>(sizeof garbage));
    ::fsync(fd);
    ::close(fd);
  }
  auto ld = t.store->load(dst.access(), t.ns, keys, ids, kNever);
  ASSERT_EQ(ld.size(), static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (i == 9) {
      EXPECT_EQ(ld[i].code(), ErrorCode::kChecksumMismatch) << ld[i].to_string();
      continue;
    }
    ASSERT_TRUE(ld[i].ok()) << i << ": " << ld[i].to_string();
    EXPECT_EQ(std::memcmp(dst.block(i), src.block(i), static_cast<size_t>(src.spec.block_bytes())), 0) << i;
  }
  EXPECT_EQ(t.counter("kvferry_tier_verified_promotions_total{tier=\"disk\"}"), static_cast<uint64_t>(n - 1));
  EXPECT_EQ(t.store->load(dst.access(), t.ns, {&keys[9], 1}, {&ids[9], 1}, kNever)[0].code(), ErrorCode::kNotFound);
}

// A tier that does not check its reads (here: one whose reads get corrupted after they landed)
// is not trusted: the load's own checksum catches the damage and drops the block.
TEST_P(DiskTierTest, TieredStoreUntrustedReadsAreVerifiedByTheLoad) {
  OPEN_OR_SKIP(disk, options());
  auto ft = std::make_unique<FaultTier>(std::move(disk), FaultTier::Knobs{});
  FaultTier* f = ft.get();
  Tiers t(std::move(ft), true, false);
  const int64_t n = 8;
  TierRegion src(n, 8), dst(n, 9);
  const auto keys = tier_keys(n, 88);
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  for (const Status& s : t.store->save(src.access(), t.ns, keys, ids, kNever)) ASSERT_TRUE(s.ok()) << s.to_string();
  t.index->evict_all(std::nullopt);
  FaultTier::Knobs k;
  k.corrupt_read_rate = 1;
  f->set_knobs(k);
  auto ld = t.store->load(dst.access(), t.ns, keys, ids, kNever);
  ASSERT_EQ(ld.size(), static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(ld[i].code(), ErrorCode::kChecksumMismatch) << i << ": " << ld[i].to_string();
  EXPECT_EQ(f->counts().corrupted_reads, static_cast<uint64_t>(n));
}

}  // namespace
}  // namespace kvferry::store
