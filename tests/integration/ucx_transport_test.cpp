// The UCX transport between two processes on this machine: the peer is this test binary run again
// (KVFERRY_UCX_PEER_* in its environment), serving a pool filled with a seeded pattern. Over
// UCX_TLS=tcp through the listener, and over posix,cma,self through worker addresses: gets and puts
// of blocks byte for byte (4 KiB .. 4 MiB, odd sizes, many per batch), the active-message round
// trip, kill -9 of the peer mid-transfer and a stopped peer (typed errors within the bound), a
// refused connection, a wrong secret refused and logged, garbage on the listener port, and a peer
// in a network namespace whose link is cut mid-transfer (where namespaces can be made here).
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <thread>

#include "netns_link.h"
#include "kvferry/store/remote_wire.h"
#include "kvferry/store/ucx_transport.h"

namespace kvferry::store {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
constexpr uint16_t kOpReverse = 100;
constexpr uint16_t kOpFail = 101;

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// The pattern byte at `off` of a pool filled with `seed` (never all zeros).
uint8_t pattern(uint64_t seed, uint64_t off) {
  return uint8_t(mix(seed * 0x9e3779b97f4a7c15ull + off / 8) >> (off % 8 * 8));
}

/// An anonymous mapping filled with the pattern; unmapped by the destructor.
struct Pool {
  explicit Pool(uint64_t bytes, uint64_t seed) : bytes(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) std::abort();
    data = static_cast<uint8_t*>(p);
    auto* w = reinterpret_cast<uint64_t*>(data);
    for (uint64_t i = 0; i < bytes / 8; ++i) w[i] = mix(seed * 0x9e3779b97f4a7c15ull + i);
  }
  ~Pool() { ::munmap(data, bytes); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  uint64_t bytes;
  uint8_t* data;
};

// ---- the peer process: this binary, run again with KVFERRY_UCX_PEER_* set ----

std::string env(const char* k, const char* dflt = "") {
  const char* v = std::getenv(k);
  return v ? v : dflt;
}

int run_peer() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const uint64_t pool_bytes = std::stoull(env("KVFERRY_UCX_PEER_POOL"));
  const uint64_t seed = std::stoull(env("KVFERRY_UCX_PEER_SEED"));
  const int report = std::stoi(env("KVFERRY_UCX_PEER_FD"));
  const std::string log_path = env("KVFERRY_UCX_PEER_LOG");
  Pool pool(pool_bytes, seed);
  UcxTransport::Options o;
  o.name = "peer";
  o.incarnation = 7;
  o.tls = env("KVFERRY_UCX_PEER_TLS");
  o.secret = env("KVFERRY_UCX_PEER_SECRET");
  o.listen_host = env("KVFERRY_UCX_PEER_HOST", "127.0.0.1");
  o.listen = env("KVFERRY_UCX_PEER_LISTEN", "1") == "1";
  o.pool = pool.data;
  o.pool_bytes = pool.bytes;
  // Sanitizer builds on a loaded 2-core machine can starve a progress thread for a second: a
  // keepalive that short then declares a live endpoint dead mid-test.
  o.keepalive = std::chrono::milliseconds(5000);
  o.log = [log_path](const std::string& line) { std::ofstream(log_path, std::ios::app) << line << "\n"; };
  o.on_request = [](const PeerInfo&, uint16_t op, std::span<const uint8_t> body) -> Result<std::vector<uint8_t>> {
    switch (op) {
      case uint16_t(wire::RemoteOp::kPing): return std::vector<uint8_t>(body.begin(), body.end());
      case kOpReverse: return std::vector<uint8_t>(body.rbegin(), body.rend());
      case kOpFail: return Status(ErrorCode::kNotFound, "no such block");
      case uint16_t(wire::RemoteOp::kLookup): {
        KVFERRY_ASSIGN_OR_RETURN(auto q, wire::LookupRequest::decode(body));
        wire::LookupReply r;
        for (auto& k : q.keys) r.entries.push_back({k.lo % 2 == 0, k.lo * 4096, 4096, k.hi, q.ns});
        return r.encode();
      }
      default: return Status(ErrorCode::kUnsupported, "op " + std::to_string(op));
    }
  };
  auto t = UcxTransport::create(o);
  std::string msg;
  if (!t.ok()) {
    msg = "error " + t.status().to_string() + "\n";
  } else {
    std::ostringstream s;
    s << (*t)->listen_port() << "\n";
    for (uint8_t b : (*t)->worker_address()) s << char("0123456789abcdef"[b >> 4]) << char("0123456789abcdef"[b & 15]);
    s << "\n";
    msg = s.str();
  }
  if (::write(report, msg.data(), msg.size()) != ssize_t(msg.size())) return 3;
  ::close(report);
  if (!t.ok()) return 2;
  // Serve until stdin closes (the test is done) or 120 s pass.
  pollfd pf{0, POLLIN, 0};
  const auto end = Clock::now() + 120s;
  char buf[64];
  while (Clock::now() < end) {
    if (::poll(&pf, 1, 200) > 0 && ::read(0, buf, sizeof buf) <= 0) break;
  }
  return 0;
}

[[maybe_unused]] const bool kIsPeer = [] {
  if (std::getenv("KVFERRY_UCX_PEER_POOL")) ::_exit(run_peer());
  return false;
}();

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) std::abort();
  return std::string(buf, size_t(n));
}

/// A peer process; killed (if still running) and reaped by the destructor.
struct PeerProcess {
  pid_t pid = -1;
  int stdin_w = -1;
  uint16_t port = 0;
  std::vector<uint8_t> worker_address;
  std::string log_path;
  std::string error;

  struct Spec {
    std::string tls = "tcp";
    std::string secret;
    uint64_t pool_bytes = 32u << 20;
    uint64_t seed = 1;
    std::string host = "127.0.0.1";
    bool listen = true;
    std::string netns;  ///< run inside this network namespace (ip netns exec)
  };

  static std::unique_ptr<PeerProcess> spawn(const Spec& s) {
    auto p = std::make_unique<PeerProcess>();
    char tmpl[] = "/tmp/kvferry-ucx-peer-XXXXXX.log";
    int lf = ::mkstemps(tmpl, 4);
    if (lf >= 0) ::close(lf);
    p->log_path = tmpl;
    int rep[2], in[2];
    if (::pipe2(rep, O_CLOEXEC) != 0 || ::pipe2(in, O_CLOEXEC) != 0) std::abort();
    const std::string exe = self_exe();
    p->pid = ::fork();
    if (p->pid == 0) {
      ::dup2(in[0], 0);
      int fd = ::dup(rep[1]);  // without O_CLOEXEC: it survives the exec
      ::setenv("KVFERRY_UCX_PEER_FD", std::to_string(fd).c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_POOL", std::to_string(s.pool_bytes).c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_SEED", std::to_string(s.seed).c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_TLS", s.tls.c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_SECRET", s.secret.c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_HOST", s.host.c_str(), 1);
      ::setenv("KVFERRY_UCX_PEER_LISTEN", s.listen ? "1" : "0", 1);
      ::setenv("KVFERRY_UCX_PEER_LOG", p->log_path.c_str(), 1);
      if (s.netns.empty()) {
        ::execl(exe.c_str(), exe.c_str(), static_cast<char*>(nullptr));
      } else {
        ::execlp("ip", "ip", "netns", "exec", s.netns.c_str(), exe.c_str(), static_cast<char*>(nullptr));
      }
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(rep[1]);
    p->stdin_w = in[1];
    std::string out;
    const auto end = Clock::now() + 15s;
    pollfd pf{rep[0], POLLIN, 0};
    while (Clock::now() < end && std::count(out.begin(), out.end(), '\n') < 2) {
      if (::poll(&pf, 1, 100) <= 0) continue;
      char buf[4096];
      ssize_t n = ::read(rep[0], buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, size_t(n));
    }
    ::close(rep[0]);
    std::istringstream is(out);
    std::string first, hex;
    std::getline(is, first);
    std::getline(is, hex);
    if (first.empty() || first.rfind("error", 0) == 0) {
      p->error = first.empty() ? "peer did not report" : first;
      return p;
    }
    p->port = uint16_t(std::stoi(first));
    for (size_t i = 0; i + 1 < hex.size(); i += 2)
      p->worker_address.push_back(uint8_t(std::stoi(hex.substr(i, 2), nullptr, 16)));
    return p;
  }

  std::string log() const {
    std::ifstream f(log_path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

  /// SIGKILL and reap (bounded).
  void kill() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    reap(5s);
  }
  bool reap(std::chrono::milliseconds timeout) {
    const auto end = Clock::now() + timeout;
    int st;
    while (Clock::now() < end) {
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return true;
      }
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
  /// SIGSTOP, and wait (bounded) until it has really stopped: kill() returns before that.
  bool stop() {
    ::kill(pid, SIGSTOP);
    const auto end = Clock::now() + 5s;
    int st;
    while (Clock::now() < end) {
      if (::waitpid(pid, &st, WNOHANG | WUNTRACED) == pid && WIFSTOPPED(st)) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }
  bool running() const {
    int st;
    return pid > 0 && ::waitpid(pid, &st, WNOHANG) == 0;
  }

  ~PeerProcess() {
    if (stdin_w >= 0) ::close(stdin_w);
    if (pid > 0 && !reap(3s)) kill();
    ::unlink(log_path.c_str());
  }
};

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    std::abort();
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Mode {
  const char* name;
  const char* tls;
  bool by_worker_address;  ///< shared memory transports only serve endpoints made from a worker address
};

class UcxTransportTest : public ::testing::TestWithParam<Mode> {
 protected:
  std::unique_ptr<PeerProcess> start_peer(PeerProcess::Spec s = {}) {
    s.tls = GetParam().tls;
    s.listen = !GetParam().by_worker_address;
    auto p = PeerProcess::spawn(s);
    EXPECT_TRUE(p->error.empty()) << p->error;
    return p;
  }
  std::unique_ptr<UcxTransport> local(Pool& pool, const std::string& secret = "") {
    UcxTransport::Options o;
    o.name = "local";
    o.incarnation = 1;
    o.tls = GetParam().tls;
    o.secret = secret;
    o.listen = false;
    o.pool = pool.data;
    o.pool_bytes = pool.bytes;
    // A loaded 2-core CI machine can hold a batch past the 5 s default; the tests that are about
    // deadlines pass their own.
    o.op_timeout = std::chrono::seconds(30);
    o.keepalive = std::chrono::milliseconds(5000);  // as the peer's (see there)
    o.log = [this](const std::string& line) { log_ += line + "\n"; };
    auto t = UcxTransport::create(o);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() ? std::move(*t) : nullptr;
  }
  Result<PeerId> connect(UcxTransport& t, const PeerProcess& p) {
    if (GetParam().by_worker_address) return t.connect_worker(p.worker_address);
    return t.connect("127.0.0.1", p.port);
  }
  std::string log_;
};

constexpr uint64_t kPeerSeed = 1, kLocalSeed = 99;

::testing::AssertionResult holds_peer_bytes(const Pool& local, const RemoteCopy& c) {
  for (uint64_t i = 0; i < c.bytes; ++i) {
    if (local.data[c.local_offset + i] != pattern(kPeerSeed, c.remote_offset + i))
      return ::testing::AssertionFailure()
             << "byte " << i << " of the run at remote " << c.remote_offset << " (+" << c.bytes << ") differs";
  }
  return ::testing::AssertionSuccess();
}

TEST_P(UcxTransportTest, GetBlocksByteForByte) {
  auto peer = start_peer();
  ASSERT_TRUE(peer->error.empty());
  Pool pool(32u << 20, kLocalSeed);
  auto t = local(pool);
  ASSERT_TRUE(t);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto info = t->peer(*id);
  ASSERT_TRUE(info && info->alive);
  EXPECT_EQ(info->name, "peer");
  EXPECT_EQ(info->incarnation, 7u);

  // Sizes 4 KiB .. 4 MiB and an odd one, two of each, at scattered offsets; a gap after each run.
  std::vector<RemoteCopy> copies;
  uint64_t local_off = 0, remote_off = 3u << 20;
  for (uint64_t size : {uint64_t{4096}, uint64_t{65536}, uint64_t{1} << 20, uint64_t{4} << 20, uint64_t{12345}}) {
    for (int rep = 0; rep < 2; ++rep) {
      copies.push_back({local_off, remote_off % (28u << 20), size});
      local_off += size + 4096;
      remote_off += size * 3 + 8192 + 17;
    }
  }
  ASSERT_LT(local_off, pool.bytes);
  auto st = t->get(*id, copies);
  ASSERT_EQ(st.size(), copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_TRUE(st[i].ok()) << i << ": " << st[i].to_string();
    EXPECT_TRUE(holds_peer_bytes(pool, copies[i]));
    // The byte after the run is untouched.
    const uint64_t after = copies[i].local_offset + copies[i].bytes;
    EXPECT_EQ(pool.data[after], pattern(kLocalSeed, after));
  }

  // None, and many in one batch (one flush).
  EXPECT_TRUE(t->get(*id, {}).empty());
  std::vector<RemoteCopy> many;
  for (uint64_t i = 0; i < 256; ++i) many.push_back({(16u << 20) + i * 65536, (255 - i) * 65536, 65536});
  auto ms = t->get(*id, many);
  for (size_t i = 0; i < many.size(); ++i) {
    ASSERT_TRUE(ms[i].ok()) << ms[i].to_string();
    ASSERT_TRUE(holds_peer_bytes(pool, many[i]));
  }

  // Runs past either pool fail alone.
  std::vector<RemoteCopy> bad{{0, 0, 4096}, {pool.bytes - 100, 0, 4096}, {8192, (32u << 20) - 100, 4096}};
  auto bs = t->get(*id, bad);
  EXPECT_TRUE(bs[0].ok()) << bs[0].to_string();
  EXPECT_EQ(bs[1].code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(bs[2].code(), ErrorCode::kOutOfRange);
  EXPECT_GT(t->counters().bytes_got, 0u);
}

TEST_P(UcxTransportTest, PutThenGetBack) {
  auto peer = start_peer();
  ASSERT_TRUE(peer->error.empty());
  Pool pool(32u << 20, kLocalSeed);
  auto t = local(pool);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<RemoteCopy> out, back;
  uint64_t off = 0;
  for (uint64_t size : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{4} << 20, uint64_t{777}}) {
    out.push_back({off, off + (1u << 20), size});
    back.push_back({off + (16u << 20), off + (1u << 20), size});
    off += size + 8192;
  }
  for (auto& s : t->put(*id, out)) EXPECT_TRUE(s.ok()) << s.to_string();
  for (auto& s : t->get(*id, back)) EXPECT_TRUE(s.ok()) << s.to_string();
  for (size_t i = 0; i < out.size(); ++i)
    EXPECT_EQ(std::memcmp(pool.data + out[i].local_offset, pool.data + back[i].local_offset, out[i].bytes), 0) << i;
  EXPECT_GT(t->counters().bytes_put, 0u);
}

TEST_P(UcxTransportTest, ActiveMessageRoundTrip) {
  auto peer = start_peer();
  ASSERT_TRUE(peer->error.empty());
  Pool pool(1u << 20, kLocalSeed);
  auto t = local(pool);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::mt19937 rng(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{60000}}) {
    std::vector<uint8_t> body(n);
    for (auto& b : body) b = uint8_t(rng() | 1);
    auto r = t->call(*id, uint16_t(wire::RemoteOp::kPing), body);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(*r, body);
    auto rev = t->call(*id, kOpReverse, body);
    ASSERT_TRUE(rev.ok());
    EXPECT_TRUE(std::equal(rev->begin(), rev->end(), body.rbegin()));
  }
  auto f = t->call(*id, kOpFail, {});
  EXPECT_EQ(f.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(f.status().message().find("no such block"), std::string::npos);
  EXPECT_EQ(t->call(*id, 999, {}).status().code(), ErrorCode::kUnsupported);

  // A lookup in the wire format both daemons share.
  wire::LookupRequest q{"m|fp8|t", {{1, 2}, {3, 4}, {5, 7}}};  // found: even lo
  auto lr = t->call(*id, uint16_t(wire::RemoteOp::kLookup), q.encode());
  ASSERT_TRUE(lr.ok()) << lr.status().to_string();
  auto reply = wire::LookupReply::decode(*lr);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->entries.size(), 3u);
  EXPECT_TRUE(reply->entries[0].found);
  EXPECT_FALSE(reply->entries[2].found);
  EXPECT_EQ(reply->entries[1].offset, 4u * 4096);
  EXPECT_EQ(reply->entries[1].format, "m|fp8|t");

  // Concurrent callers each get their own answer.
  std::vector<std::thread> ths;
  ths.reserve(4);
  std::atomic<int> good{0};
  for (int c = 0; c < 4; ++c) {
    ths.emplace_back([&, c] {
      for (int i = 0; i < 25; ++i) {
        std::vector<uint8_t> b{uint8_t(c), uint8_t(i)};
        auto r = t->call(*id, uint16_t(wire::RemoteOp::kPing), b);
        if (r.ok() && *r == b) ++good;
      }
    });
  }
  for (auto& th : ths) th.join();
  EXPECT_EQ(good.load(), 100);
}

TEST_P(UcxTransportTest, PeerKilledMidTransferGivesTypedErrorsInBound) {
  PeerProcess::Spec spec;
  spec.pool_bytes = 128u << 20;
  auto peer = start_peer(spec);
  ASSERT_TRUE(peer->error.empty());
  Pool pool(128u << 20, kLocalSeed);
  auto t = local(pool);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<RemoteCopy> copies;
  for (uint64_t i = 0; i < 32; ++i) copies.push_back({i << 22, i << 22, 4u << 20});
  if (!GetParam().by_worker_address) {
    // Over TCP a get needs the target's progress: a stopped peer holds the batch in flight.
    ASSERT_TRUE(peer->stop());
  }
  auto fut = std::async(std::launch::async, [&] { return t->get(*id, copies, 20s); });
  std::this_thread::sleep_for(300ms);
  if (!GetParam().by_worker_address) {
    ASSERT_EQ(fut.wait_for(0s), std::future_status::timeout) << "the batch finished against a stopped peer";
  }
  peer->kill();
  const auto t0 = Clock::now();
  ASSERT_EQ(fut.wait_for(10s), std::future_status::ready) << "no answer after the peer died";
  const auto took = Clock::now() - t0;
  auto st = fut.get();
  size_t failed = 0;
  for (size_t i = 0; i < st.size(); ++i) {
    if (st[i].ok()) {
      EXPECT_TRUE(holds_peer_bytes(pool, copies[i]));  // what succeeded is right
      continue;
    }
    ++failed;
    EXPECT_EQ(st[i].code(), ErrorCode::kUnavailable) << st[i].to_string();
    EXPECT_NE(st[i].message().find("peer lost"), std::string::npos) << st[i].to_string();
  }
  if (!GetParam().by_worker_address) {
    EXPECT_EQ(failed, copies.size());
    EXPECT_LT(took, 2s) << "first error after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                        << " ms";
  }
  // The peer is known to be gone: the next operation fails at once.
  if (failed) {
    auto again = t->get(*id, std::span(copies).first(1), 5s);
    EXPECT_EQ(again[0].code(), ErrorCode::kUnavailable) << again[0].to_string();
    EXPECT_FALSE(t->peer(*id)->alive);
    EXPECT_EQ(t->call(*id, uint16_t(wire::RemoteOp::kPing), {}).status().code(), ErrorCode::kUnavailable);
  }
}

TEST_P(UcxTransportTest, StoppedPeerHitsTheDeadline) {
  if (GetParam().by_worker_address) GTEST_SKIP() << "cma reads need no progress from the target: nothing to stall";
  auto peer = start_peer();
  ASSERT_TRUE(peer->error.empty());
  Pool pool(32u << 20, kLocalSeed);
  auto t = local(pool);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  ASSERT_TRUE(peer->stop());
  std::vector<RemoteCopy> copies{{0, 0, 4u << 20}, {4u << 20, 4u << 20, 4u << 20}};
  const auto t0 = Clock::now();
  auto st = t->get(*id, copies, 500ms);
  EXPECT_LT(Clock::now() - t0, 2s);
  for (auto& s : st) EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
  const auto t1 = Clock::now();
  auto c = t->call(*id, uint16_t(wire::RemoteOp::kPing), {}, 500ms);
  EXPECT_FALSE(c.ok());
  EXPECT_LT(Clock::now() - t1, 2s);
  ::kill(peer->pid, SIGCONT);
}

TEST_P(UcxTransportTest, WrongSecretIsRefused) {
  PeerProcess::Spec spec;
  spec.secret = "alpha-0123456789";
  auto peer = start_peer(spec);
  ASSERT_TRUE(peer->error.empty());
  Pool pool(1u << 20, kLocalSeed);
  {
    auto t = local(pool, "beta-0123456789");
    auto id = connect(*t, *peer);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), ErrorCode::kPermissionDenied) << id.status().to_string();
  }
  {
    auto t = local(pool, "");  // no secret at all
    auto id = connect(*t, *peer);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), ErrorCode::kPermissionDenied) << id.status().to_string();
    EXPECT_GE(t->counters().handshakes_refused, 1u);
  }
  // The peer logged the refusals (bounded wait: the log is written by its progress thread).
  for (int i = 0; i < 100 && peer->log().find("refused") == std::string::npos; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_NE(peer->log().find("refused"), std::string::npos) << peer->log();
  // The right secret is let in.
  auto t = local(pool, "alpha-0123456789");
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<RemoteCopy> one{{0, 4096, 4096}};
  EXPECT_TRUE(t->get(*id, one)[0].ok());
  EXPECT_TRUE(holds_peer_bytes(pool, one[0]));
}

TEST_P(UcxTransportTest, GarbageOnTheListenerDoesNotHurtIt) {
  if (GetParam().by_worker_address) GTEST_SKIP() << "no listener in worker-address mode";
  auto peer = start_peer();
  ASSERT_TRUE(peer->error.empty());
  std::mt19937_64 rng(11);
  auto raw = [&](size_t bytes) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(peer->port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      std::vector<uint8_t> junk(bytes);
      for (auto& b : junk) b = uint8_t(rng());
      if (bytes && ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL) < 0) {
        // the listener may drop us first: that is fine
      }
    }
    ::close(fd);
  };
  raw(0);
  raw(16);
  raw(65536);
  {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(peer->port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      const char req[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      (void)!::send(fd, req, sizeof req - 1, MSG_NOSIGNAL);
    }
    ::close(fd);
  }
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(peer->running()) << "the peer died of garbage";
  Pool pool(1u << 20, kLocalSeed);
  auto t = local(pool);
  auto id = connect(*t, *peer);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<RemoteCopy> one{{0, 8192, 65536}};
  EXPECT_TRUE(t->get(*id, one)[0].ok());
  EXPECT_TRUE(holds_peer_bytes(pool, one[0]));
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxTransportTest,
                         ::testing::Values(Mode{"tcp", "tcp", false}, Mode{"shm", "cma,tcp", true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(UcxTransport, RefusedConnectionFailsFast) {
  Pool pool(1u << 20, kLocalSeed);
  UcxTransport::Options o;
  o.listen = false;
  o.pool = pool.data;
  o.pool_bytes = pool.bytes;
  o.log = [](const std::string&) {};
  auto t = UcxTransport::create(o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const auto t0 = Clock::now();
  auto id = (*t)->connect("127.0.0.1", uint16_t(free_port()));
  EXPECT_FALSE(id.ok());
  EXPECT_TRUE(id.status().code() == ErrorCode::kUnavailable || id.status().code() == ErrorCode::kTimeout)
      << id.status().to_string();
  EXPECT_LT(Clock::now() - t0, 1500ms);
}

TEST(UcxTransport, WithoutASecretOnlyLoopback) {
  UcxTransport::Options o;
  o.listen_host = "0.0.0.0";
  auto t = UcxTransport::create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), ErrorCode::kPermissionDenied);
}

TEST(UcxTransport, HmacKnownAnswer) {
  // RFC 4231 test case 2.
  const std::string data = "what do ya want for nothing?";
  auto mac = hmac_sha256("Jefe", {reinterpret_cast<const uint8_t*>(data.data()), data.size()});
  std::string hex;
  for (uint8_t b : mac) hex += "0123456789abcdef"[b >> 4], hex += "0123456789abcdef"[b & 15];
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

// ---- a peer in a network namespace, its link cut mid-transfer ----

TEST(UcxTransportNetns, LinkCutMidTransfer) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  testing::NetnsLink net("kvf-ucx", "kvf", 213);
  if (!net.made()) GTEST_SKIP() << "ip netns add does not work here";
  ASSERT_EQ(net.link(), "");
  const std::string &ns = net.ns(), &b_ip = net.far_ip();

  PeerProcess::Spec s;
  s.tls = "tcp";
  s.secret = "netns-secret-0123";  // not loopback: a secret is required
  s.host = b_ip;
  s.netns = ns;
  s.pool_bytes = 128u << 20;
  auto peer = PeerProcess::spawn(s);
  ASSERT_TRUE(peer->error.empty()) << peer->error;

  Pool pool(128u << 20, kLocalSeed);
  UcxTransport::Options o;
  o.listen = false;
  o.tls = "tcp";
  o.secret = s.secret;
  o.pool = pool.data;
  o.pool_bytes = pool.bytes;
  o.connect_timeout = 3000ms;
  o.log = [](const std::string&) {};
  auto t = UcxTransport::create(o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Result<PeerId> id = Status(ErrorCode::kUnavailable, "not tried");
  for (int i = 0; i < 3 && !id.ok(); ++i) id = (*t)->connect(b_ip, peer->port);  // the veth may need a moment
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<RemoteCopy> one{{0, 0, 1u << 20}};
  ASSERT_TRUE((*t)->get(*id, one)[0].ok());
  ASSERT_TRUE(holds_peer_bytes(pool, one[0]));

  std::vector<RemoteCopy> copies;
  for (uint64_t i = 0; i < 32; ++i) copies.push_back({i << 22, i << 22, 4u << 20});
  ASSERT_TRUE(peer->stop());  // hold the batch in flight
  auto fut = std::async(std::launch::async, [&] { return (*t)->get(*id, copies, 2000ms); });
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(net.cut());  // the cable is cut: no RST, no FIN
  ::kill(peer->pid, SIGCONT);
  ASSERT_EQ(fut.wait_for(8s), std::future_status::ready) << "no answer after the link was cut";
  auto cut = fut.get();
  for (auto& st : cut) {
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(st.code() == ErrorCode::kTimeout || st.code() == ErrorCode::kUnavailable) << st.to_string();
  }
  peer->kill();  // its side of the cut connection is of no further interest
}

}  // namespace
}  // namespace kvferry::store
