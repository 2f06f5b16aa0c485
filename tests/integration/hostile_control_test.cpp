// kvferryd's control plane under hostile and careless clients (issue 36): tenancy enforced from
// the peer's credentials, supplementary groups, SIGHUP removing a uid, a client that never reads,
// half-sent frames, fd exhaustion, quotas. The daemon runs in its own process (CPU backend);
// clients run here and, as other uids, in forked children that report through their exit code.
// Every wait is bounded; every daemon started here is stopped here.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry {
namespace {

using testing::connect_raw;
using testing::DaemonProcess;
using testing::run_in_child;
using testing::wait_until;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// Drops root for `uid` with primary `gid` and exactly the supplementary `groups`.
bool become(uint32_t uid, uint32_t gid, std::vector<gid_t> groups = {}) {
  return ::setgroups(groups.size(), groups.data()) == 0 && ::setgid(gid) == 0 && ::setuid(uid) == 0;
}

Result<std::unique_ptr<Client>> connect_as(const std::string& socket, const std::string& tenant = "",
                                           const std::string& name = "hostile") {
  Client::Options o;
  o.socket = socket;
  o.name = name;
  o.tenant = tenant;
  if (!tenant.empty()) o.model = "m";
  return Client::connect(o);
}

const KvCacheSpec kSmall{2, 3, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor};  // 110592 bytes

/// One StatusRequest round trip on a fresh connection (what `kvferry status` does).
Result<proto::StatusReply> raw_status(const std::string& socket, int timeout_ms = 2000) {
  int fd = connect_raw(socket);
  if (fd < 0) return Status(ErrorCode::kUnavailable, "connect failed");
  UniqueFd s(fd);
  KVFERRY_TRY(proto::send_frame(fd, proto::encode_status_request(), {}, timeout_ms));
  auto f = proto::recv_frame(fd, timeout_ms);
  if (!f.ok()) return f.status();
  if (f->header.type == static_cast<uint16_t>(proto::MsgType::kError)) {
    auto e = proto::decode_error(f->payload, f->header.field_mask);
    return Status(e.ok() ? e->code : ErrorCode::kProtocol, e.ok() ? e->message : "bad error frame");
  }
  return proto::decode_status_reply(f->payload, f->header.field_mask);
}

int64_t vm_rss_kib(pid_t pid) {
  std::istringstream in(testing::read_file("/proc/" + std::to_string(pid) + "/status"));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

/// utime + stime of `pid`, in clock ticks.
int64_t cpu_ticks(pid_t pid) {
  const std::string s = testing::read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t close_paren = s.rfind(')');
  if (close_paren == std::string::npos) return -1;
  std::istringstream in(s.substr(close_paren + 2));
  std::string f;
  int64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> f; ++i) {
    if (i == 14) utime = std::stoll(f);
    if (i == 15) stime = std::stoll(f);
  }
  return utime + stime;
}

/// True once the peer closed `fd` (without reading anything from it).
bool peer_closed(int fd, std::chrono::milliseconds timeout) {
  return wait_until(
      [&] {
        pollfd p{fd, POLLRDHUP, 0};
        return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP)) != 0;
      },
      timeout);
}

size_t count_lines(const std::string& text, const std::string& needle) {
  size_t n = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) n += line.find(needle) != std::string::npos ? 1 : 0;
  return n;
}

void raise_nofile() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 4096);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

/// A pipe a child blocks on until the parent says go (or 20 s pass).
struct Gate {
  int fd[2] = {-1, -1};
  Gate() {
    if (::pipe2(fd, O_CLOEXEC) != 0) std::abort();
  }
  ~Gate() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void open() { (void)!::write(fd[1], "g", 1); }
  bool wait(int timeout_ms = 20000) {
    pollfd p{fd[0], POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return false;
    char c;
    return ::read(fd[0], &c, 1) == 1;
  }
};

#define NEEDS_ROOT() \
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other uids"

// ---- tenancy ----

const char* kTenants = R"(daemon:
  allowed_uids: [0, 1001, 1002, 1003]
regions:
  - name: shared
    layers: 2
    blocks: 3
    block_size: 16
  - name: a-only
    layers: 2
    blocks: 3
    block_size: 16
    tenant: a
tenants:
  - name: a
    uids: [1001]
  - name: b
    uids: [1002]
)";

// Tenant b cannot map, create by name, debug-read or see in status what tenant a owns, and may
// not claim tenant a; tenant a can. Root (admin by default) sees everything.
TEST(HostileControl, CrossTenantRegionsAreRefused) {
  NEEDS_ROOT();
  DaemonProcess d(kTenants);
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string sock = d.socket();
  Gate made, done;
  const pid_t a = ::fork();
  if (a == 0) {
    if (!become(1001, 1001)) ::_exit(20);
    auto c = connect_as(sock, "", "tenant-a");
    if (!c.ok()) ::_exit(21);
    auto own = (*c)->find_region("a-only");
    if (!own.ok() || !(*c)->map_region(*own).ok()) ::_exit(22);
    auto shared = (*c)->find_region("shared");
    if (!shared.ok() || !(*c)->map_region(*shared).ok()) ::_exit(23);
    if (!(*c)->create_region("a-made", kSmall).ok()) ::_exit(24);
    made.open();
    ::_exit(done.wait() ? 0 : 25);
  }
  ASSERT_TRUE(made.wait()) << "tenant a's client did not get going:\n" << d.log();
  // Root is admin: it sees every region and client, and learns the ids to attack with.
  auto all = raw_status(sock);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  uint32_t a_only = 0, a_made = 0, shared = 0;
  for (auto& r : all->regions) {
    if (r.desc.name == "a-only") a_only = r.desc.id;
    if (r.desc.name == "a-made") a_made = r.desc.id;
    if (r.desc.name == "shared") shared = r.desc.id;
  }
  ASSERT_TRUE(a_only && a_made && shared);
  ASSERT_EQ(all->clients.size(), 1u);

  const int rc = run_in_child([&] {
    if (!become(1002, 1002)) return 20;
    // Claiming the other tenant is refused at the Hello, naming the uid and the tenant.
    auto claim = connect_as(sock, "a");
    if (claim.ok()) return 21;
    if (claim.status().code() != ErrorCode::kPermissionDenied) return 22;
    if (claim.status().message().find("uid 1002") == std::string::npos) return 23;
    if (claim.status().message().find("'a'") == std::string::npos) return 24;
    auto c = connect_as(sock, "", "tenant-b");
    if (!c.ok()) return 25;
    for (auto& r : (*c)->regions())
      if (r.name == "a-only" || r.name == "a-made") return 26;  // the Welcome lists only b's and shared ones
    if (!(*c)->map_region(shared).ok()) return 27;
    for (uint32_t id : {a_only, a_made}) {
      auto m = (*c)->map_region(id);
      if (m.ok() || m.status().code() != ErrorCode::kPermissionDenied) return 28;
      auto r = (*c)->debug_read(id, 0, 64);
      if (r.ok() || r.status().code() != ErrorCode::kPermissionDenied) return 29;
    }
    auto same_name = (*c)->create_region("a-made", kSmall);
    if (same_name.ok() || same_name.status().code() != ErrorCode::kPermissionDenied) return 30;
    // The session survives its refused requests.
    if (!(*c)->map_region(shared).ok()) return 31;
    // Status shows b only its own and shared regions and its own clients, before and after a Hello.
    for (int pass = 0; pass < 2; ++pass) {
      auto st = pass == 0 ? raw_status(sock) : (*c)->status();
      if (!st.ok()) return 32;
      for (auto& r : st->regions)
        if (r.desc.name == "a-only" || r.desc.name == "a-made") return 33;
      for (auto& cl : st->clients)
        if (cl.uid != 1002) return 34;
      if (pass == 1 && st->clients.size() != 1) return 35;
    }
    return 0;
  });
  done.open();
  EXPECT_EQ(testing::wait_pid(a, 10s), 0) << "tenant a's client failed";
  EXPECT_EQ(rc, 0) << "20: setuid, 21-24: claimed another tenant, 25: connect, 26: Welcome lists a's regions, "
                      "27: shared region refused, 28: mapped a's region, 29: debug-read a's region, "
                      "30: created over a's name, 31: session lost, 32-35: status shows a's regions or clients\n"
                   << d.log();
  EXPECT_EQ(d.stop(), 0);
}

// Without `tenants:`, every uid is its own tenant: another uid cannot map what one created.
TEST(HostileControl, ImplicitTenantPerUid) {
  NEEDS_ROOT();
  DaemonProcess d("daemon:\n  allowed_uids: [0, 1001, 1002]\n");
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string sock = d.socket();
  Gate made, done;
  const pid_t a = ::fork();
  if (a == 0) {
    if (!become(1001, 1001)) ::_exit(20);
    auto c = connect_as(sock, "t2");  // a claimed tenant stays inside the uid's own
    if (!c.ok() || !(*c)->create_region("mine", kSmall).ok()) ::_exit(21);
    made.open();
    ::_exit(done.wait() ? 0 : 22);
  }
  ASSERT_TRUE(made.wait()) << d.log();
  auto all = raw_status(sock);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->regions.size(), 1u);
  const uint32_t id = all->regions[0].desc.id;
  const int rc = run_in_child([&] {
    if (!become(1002, 1002)) return 20;
    auto c = connect_as(sock, "t2");
    if (!c.ok()) return 21;
    if (!(*c)->regions().empty()) return 22;
    auto m = (*c)->map_region(id);
    if (m.ok() || m.status().code() != ErrorCode::kPermissionDenied) return 23;
    auto st = raw_status(sock);
    if (!st.ok() || !st->regions.empty()) return 24;
    return 0;
  });
  done.open();
  EXPECT_EQ(testing::wait_pid(a, 10s), 0);
  EXPECT_EQ(rc, 0) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

TEST(HostileControl, DebugReadIsOffUnlessConfigured) {
  DaemonProcess d("daemon:\n  debug_read: false\nregions:\n  - name: r\n    layers: 2\n    blocks: 3\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = connect_as(d.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto id = (*c)->find_region("r");
  ASSERT_TRUE(id.ok());
  auto r = (*c)->debug_read(*id, 0, 64);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(r.status().message().find("daemon.debug_read"), std::string::npos) << r.status().message();
  EXPECT_EQ(d.stop(), 0);
}

// A uid mapped to no tenant is refused, and the CLI says so plainly.
TEST(HostileControl, CliSaysRefused) {
  NEEDS_ROOT();
  DaemonProcess d(kTenants);
  ASSERT_TRUE(d.ready()) << d.log();
  char out[] = "/tmp/kvferry-cli-XXXXXX";
  const int ofd = ::mkstemp(out);
  ASSERT_GE(ofd, 0);
  ::close(ofd);
  ::chmod(out, 0666);
  const std::string cmd = std::string("'") + KVFERRY_CLI_PATH + "' --socket '" + d.socket() + "' ls 2>'" + out + "'";
  const int rc = run_in_child([&] {
    if (!become(1003, 1003)) return 20;
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) && WEXITSTATUS(st) == 1 ? 0 : 21;
  });
  const std::string err = testing::read_file(out);
  ::unlink(out);
  EXPECT_EQ(rc, 0) << err;
  EXPECT_NE(err.find("refused: "), std::string::npos) << err;
  EXPECT_NE(err.find("uid 1003"), std::string::npos) << err;
  EXPECT_EQ(d.stop(), 0);
}

// ---- groups and SIGHUP ----

// A member of an allowed group through a supplementary group only is let in, and maps to the
// tenant of that group.
TEST(HostileControl, SupplementaryGroupIsEnough) {
  NEEDS_ROOT();
  DaemonProcess d(
      "daemon:\n  allowed_gids: [4242]\nregions:\n  - name: g-only\n    layers: 2\n    blocks: 3\n    tenant: g\n"
      "tenants:\n  - name: g\n    gids: [4242]\n");
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string sock = d.socket();
  const int rc = run_in_child([&] {
    if (!become(5000, 5000, {4242})) return 20;
    auto c = connect_as(sock);
    if (!c.ok()) return 21;
    auto id = (*c)->find_region("g-only");
    if (!id.ok() || !(*c)->map_region(*id).ok()) return 22;
    return 0;
  });
  EXPECT_EQ(rc, 0) << "21: refused, 22: not its tenant's region\n" << d.log();
  // The same uid without the group is refused.
  const int rc2 = run_in_child([&] {
    if (!become(5000, 5000)) return 20;
    auto c = connect_as(sock);
    return !c.ok() && c.status().code() == ErrorCode::kPermissionDenied ? 0 : 21;
  });
  EXPECT_EQ(rc2, 0) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

// SIGHUP with a uid taken off the allow-list closes that uid's open session within a bounded time;
// other sessions stay.
TEST(HostileControl, SighupRemovalClosesOpenSessions) {
  NEEDS_ROOT();
  DaemonProcess d("daemon:\n  allowed_uids: [0, 1001]\n");
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string sock = d.socket();
  auto root = connect_as(sock, "", "root");
  ASSERT_TRUE(root.ok());
  Gate up, reloaded;
  const pid_t child = ::fork();
  if (child == 0) {
    if (!become(1001, 1001)) ::_exit(20);
    auto c = connect_as(sock);
    if (!c.ok()) ::_exit(21);
    up.open();
    if (!reloaded.wait()) ::_exit(22);
    const bool gone = wait_until([&] { return !(*c)->connection_status().ok(); }, 3s);
    ::_exit(gone ? 0 : 23);
  }
  ASSERT_TRUE(up.wait()) << d.log();
  d.write_config("daemon:\n  allowed_uids: [0]\n");
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  ASSERT_TRUE(wait_until([&] { return d.log().find("no longer allowed") != std::string::npos; }, 3s)) << d.log();
  reloaded.open();
  EXPECT_EQ(testing::wait_pid(child, 10s), 0) << "23: the removed uid kept its session\n" << d.log();
  EXPECT_TRUE((*root)->connection_status().ok());
  EXPECT_TRUE((*root)->status().ok());
  EXPECT_EQ(d.stop(), 0);
}

// ---- a client that never reads ----

TEST(HostileControl, NonReaderDoesNotDelayOthers) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  auto other = connect_as(d.socket(), "", "other");
  ASSERT_TRUE(other.ok());
  // Floods StatusRequests and never reads a reply, with a small receive buffer.
  int bad = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(bad, 0);
  const int small = 4096;
  ASSERT_EQ(::setsockopt(bad, SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, d.socket().c_str(), sizeof a.sun_path - 1);
  ASSERT_EQ(::connect(bad, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  UniqueFd bad_fd(bad);
  const proto::Frame req = proto::encode_status_request();
  size_t sent = 0;
  const auto flood_end = Clock::now() + 1s;
  while (Clock::now() < flood_end) {
    const ssize_t r = ::send(bad, req.data(), req.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      sent += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) break;
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_GT(sent, 64 * req.size()) << "the flood did not get going";
  // Meanwhile another client's status and a new connection's status are answered at once.
  std::chrono::microseconds worst{0};
  for (int i = 0; i < 20; ++i) {
    const auto t0 = Clock::now();
    auto st = i % 2 ? (*other)->status() : raw_status(d.socket());
    const auto dt = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    worst = std::max(worst, dt);
  }
  std::printf("worst status round trip next to a non-reader: %lld us\n", static_cast<long long>(worst.count()));
  EXPECT_LT(worst, 100ms) << "a status round trip took " << worst.count() << " us next to a non-reader";
  // The non-reader is disconnected after limits.send_timeout (2 s), with a log line.
  EXPECT_TRUE(peer_closed(bad, 5s)) << d.log();
  EXPECT_TRUE(wait_until([&] { return d.log().find("limits.send_timeout") != std::string::npos; }, 2s)) << d.log();
  EXPECT_TRUE((*other)->status().ok());
  EXPECT_EQ(d.stop(), 0);
}

// ---- half-sent frames, the handshake deadline and the cap ----

TEST(HostileControl, HalfSentFramesCostNoMemory) {
  raise_nofile();
  DaemonProcess d("limits:\n  handshake_timeout: 1500ms\n  max_unauthenticated: 1000\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto other = connect_as(d.socket(), "", "other");
  ASSERT_TRUE(other.ok());
  const int64_t rss0 = vm_rss_kib(d.pid());
  ASSERT_GT(rss0, 0);
  // 500 connections announce a Hello of kMaxPayload bytes; half of them send 1000 bytes of it.
  proto::Header h;
  h.type = static_cast<uint16_t>(proto::MsgType::kHello);
  h.length = proto::kMaxPayload;
  uint8_t hb[proto::kHeaderBytes];
  proto::encode_header(h, hb);
  std::vector<uint8_t> part(1000, 0x5a);
  std::vector<UniqueFd> conns;
  conns.reserve(500);
  for (int i = 0; i < 500; ++i) {
    const int fd = connect_raw(d.socket());
    ASSERT_GE(fd, 0) << "connection " << i;
    conns.emplace_back(fd);
    ASSERT_EQ(::send(fd, hb, sizeof hb, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof hb));
    if (i % 2) {
      ASSERT_EQ(::send(fd, part.data(), part.size(), MSG_NOSIGNAL), static_cast<ssize_t>(part.size()));
    }
  }
  // Connected clients keep being served meanwhile.
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    ASSERT_TRUE((*other)->status().ok());
    EXPECT_LT(Clock::now() - t0, 100ms);
  }
  std::this_thread::sleep_for(300ms);
  const int64_t rss1 = vm_rss_kib(d.pid());
  std::printf("kvferryd VmRSS %lld KiB before 500 half-sent frames, %lld KiB with them\n", static_cast<long long>(rss0),
              static_cast<long long>(rss1));
  EXPECT_LT(rss1 - rss0, 200 * 1024) << "VmRSS grew from " << rss0 << " KiB to " << rss1 << " KiB";
  // All of them are closed after the handshake deadline.
  for (auto& c : conns) ASSERT_TRUE(peer_closed(c.get(), 5s)) << d.log();
  EXPECT_NE(d.log().find("limits.handshake_timeout"), std::string::npos);
  EXPECT_TRUE((*other)->status().ok());
  auto fresh = connect_as(d.socket(), "", "fresh");
  EXPECT_TRUE(fresh.ok()) << fresh.status().to_string();
  EXPECT_EQ(d.stop(), 0);
}

TEST(HostileControl, UnauthenticatedConnectionsAreCapped) {
  DaemonProcess d("limits:\n  max_unauthenticated: 8\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto engine = connect_as(d.socket(), "", "engine");  // a Hello'd client does not count
  ASSERT_TRUE(engine.ok());
  std::vector<UniqueFd> idle;
  idle.reserve(8);
  for (int i = 0; i < 8; ++i) idle.emplace_back(connect_raw(d.socket()));
  ASSERT_TRUE(wait_until([&] { return count_lines(d.log(), "client") >= 1; }, 2s));
  std::this_thread::sleep_for(200ms);  // the daemon has accepted the eight
  UniqueFd over(connect_raw(d.socket()));
  ASSERT_TRUE(over);
  auto f = proto::recv_frame(over.get(), 3000);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_EQ(f->header.type, static_cast<uint16_t>(proto::MsgType::kError));
  auto e = proto::decode_error(f->payload, f->header.field_mask);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->code, ErrorCode::kResourceExhausted);
  EXPECT_NE(e->message.find("limits.max_unauthenticated"), std::string::npos) << e->message;
  EXPECT_TRUE(peer_closed(over.get(), 2s));
  EXPECT_TRUE((*engine)->status().ok());
  idle.clear();
  EXPECT_TRUE(wait_until([&] { return connect_as(d.socket(), "", "later").ok(); }, 3s)) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

// ---- fd exhaustion ----

TEST(HostileControl, FdExhaustionBacksOff) {
  raise_nofile();
  DaemonProcess d("limits:\n  max_unauthenticated: 1000\n", {}, "cpu", {}, 64);
  ASSERT_TRUE(d.ready()) << d.log();
  auto engine = connect_as(d.socket(), "", "engine");
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  // Connect until the daemon runs out of descriptors (it then sheds pending connections).
  std::vector<UniqueFd> conns;
  for (int i = 0; i < 150; ++i) {
    const int fd = connect_raw(d.socket());
    if (fd < 0) break;
    conns.emplace_back(fd);
  }
  ASSERT_TRUE(wait_until([&] { return d.log().find("out of file descriptors") != std::string::npos; }, 3s)) << d.log();
  const int64_t t0 = cpu_ticks(d.pid());
  const auto w0 = Clock::now();
  // The connected client is served all along.
  int served = 0;
  while (Clock::now() - w0 < 1s) {
    const auto s0 = Clock::now();
    ASSERT_TRUE((*engine)->status().ok()) << d.log();
    EXPECT_LT(Clock::now() - s0, 200ms);
    ++served;
    std::this_thread::sleep_for(50ms);
  }
  const int64_t t1 = cpu_ticks(d.pid());
  const double cpu_s = static_cast<double>(t1 - t0) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double wall_s = std::chrono::duration<double>(Clock::now() - w0).count();
  std::printf("kvferryd out of fds: %.3f s of CPU in %.3f s, %d status replies, %zu connections held here\n", cpu_s,
              wall_s, served, conns.size());
  EXPECT_LT(cpu_s, 0.3 * wall_s) << "the daemon burned " << cpu_s << " s of CPU in " << wall_s << " s";
  EXPECT_GE(served, 10);
  const std::string log = d.log();
  EXPECT_LT(count_lines(log, "accept:"), 20u) << "accept error lines: " << count_lines(log, "accept:");
  // Once the connections go, new clients are accepted again.
  conns.clear();
  EXPECT_TRUE(wait_until([&] { return connect_as(d.socket(), "", "later").ok(); }, 5s)) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

// ---- quotas ----

TEST(HostileControl, TenantQuotasHold) {
  // Root as an ordinary tenant: no admin here.
  DaemonProcess d(
      "daemon:\n  admin_uids: []\nlimits:\n  tenant:\n    clients: 2\n    regions: 3\n"
      "tenants:\n  - name: small\n    uids: [0]\n    quota:\n      regions: 2\n      region_bytes: 4MiB\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto c1 = connect_as(d.socket(), "", "c1");
  auto c2 = connect_as(d.socket(), "small", "c2");
  ASSERT_TRUE(c1.ok() && c2.ok());
  auto c3 = connect_as(d.socket(), "", "c3");
  ASSERT_FALSE(c3.ok());
  EXPECT_EQ(c3.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(c3.status().message().find("quota of 2 clients"), std::string::npos) << c3.status().message();
  // Region bytes: 4 MiB; one region of 5 MiB does not fit.
  const KvCacheSpec big{2, 20, 128, EntryFormat::mla_bf16(), Layout::kBlockMajor};  // 5.6 MiB
  auto r = (*c1)->create_region("big", big);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("region bytes"), std::string::npos) << r.status().message();
  // Regions: 2 (the tenant's own quota wins over limits.tenant.regions).
  ASSERT_TRUE((*c1)->create_region("r1", kSmall).ok());
  ASSERT_TRUE((*c2)->create_region("r2", kSmall).ok());
  auto r3 = (*c1)->create_region("r3", kSmall);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(r3.status().message().find("quota of 2 regions"), std::string::npos) << r3.status().message();
  // Mapping an existing region by name is not a new region.
  EXPECT_TRUE((*c2)->create_region("r1", kSmall).ok());
  // A client that leaves frees its slot.
  c1->reset();
  EXPECT_TRUE(wait_until([&] { return connect_as(d.socket(), "", "c4").ok(); }, 3s)) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

}  // namespace
}  // namespace kvferry
