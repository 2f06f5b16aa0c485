// `kvferry top` against a running kvferryd (a small host pool over a disk tier): `--once` during
// live saves and loads shows non-zero save and load rates for the host pool and the disk and the
// busy client's op rate; the live view under a pseudo-terminal puts the terminal in raw mode,
// redraws, quits on `q` (exit 0) and on Ctrl-C (exit 130), and gives the terminal back as it was
// (canonical mode and echo, the main screen). Every wait is bounded.
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <termios.h>
#include <utmp.h>

#include <atomic>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <thread>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"

namespace kvferry {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// A directory removed with everything in it at the end of the test.
struct TempDir {
  std::string path = testing::make_temp_dir();
  ~TempDir() {
    if (std::system(("rm -rf '" + path + "'").c_str()) != 0)
      std::fprintf(stderr, "could not remove %s\n", path.c_str());
  }
};

/// A host pool of 8 MiB over a 64 MiB disk tier in `dir`.
std::unique_ptr<DaemonProcess> start_daemon(const std::string& dir) {
  return std::make_unique<DaemonProcess>("tiers:\n  host:\n    capacity: 8MiB\n  disk:\n    path: " + dir +
                                         "\n    capacity: 64MiB\n    direct_io: false\n");
}

/// Saves and loads 32 blocks of 288 KiB (more than the host pool holds, so the disk works too)
/// in a loop until stopped or 30 s have passed.
class Traffic {
 public:
  explicit Traffic(const std::string& socket) {
    Client::Options o;
    o.socket = socket;
    o.name = "operator-top-traffic";
    o.model = "m";
    auto c = Client::connect(o);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (!c.ok()) return;
    client_ = std::move(*c);
    const KvCacheSpec spec{4, kBlocks, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
    auto rid = client_->create_region("top", spec);
    EXPECT_TRUE(rid.ok()) << rid.status().to_string();
    if (!rid.ok()) return;
    auto base = client_->map_region(*rid);
    EXPECT_TRUE(base.ok());
    if (!base.ok()) return;
    for (int64_t i = 0; i < spec.region_bytes(); ++i)
      static_cast<uint8_t*>(*base)[i] = static_cast<uint8_t>(i * 37 + 1);
    thread_ = std::thread([this, id = *rid] { loop(id); });
  }
  ~Traffic() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t rounds() const { return rounds_; }

 private:
  static constexpr int64_t kBlocks = 32;
  void loop(uint32_t rid) {
    std::vector<int64_t> ids(kBlocks);
    std::iota(ids.begin(), ids.end(), 0);
    const auto end = Clock::now() + 30s;
    for (uint64_t round = 0; !stop_ && Clock::now() < end; ++round) {
      std::vector<ops::Key> keys;
      for (int64_t i = 0; i < kBlocks; ++i) keys.push_back({0x70B0000000000000ull + round, static_cast<uint64_t>(i)});
      if (!client_->save(rid, keys, ids, 10'000'000).ok()) return;
      if (!client_->load(rid, keys, ids, 10'000'000).ok()) return;
      // Blocks saved two rounds ago come back from the disk (the pool holds about one round).
      if (round >= 2) {
        for (auto& k : keys) k.hi -= 2;
        if (!client_->load(rid, keys, ids, 10'000'000).ok()) return;
      }
      ++rounds_;
    }
  }
  std::unique_ptr<Client> client_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rounds_{0};
};

/// The whitespace-separated fields of the line of `text` whose first field is `first`.
std::vector<std::string> row(const std::string& text, const std::string& first) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::vector<std::string> v;
    for (std::string w; f >> w;) v.push_back(w);
    if (!v.empty() && v[0] == first) return v;
  }
  return {};
}

bool nonzero_rate(const std::string& v) { return !v.empty() && v != "0" && v != "-"; }

TEST(OperatorTop, OnceShowsTheRatesOfLiveTraffic) {
  TempDir tier_dir;
  auto d = start_daemon(tier_dir.path);
  ASSERT_TRUE(d->ready()) << d->log();
  Traffic traffic(d->socket());
  ASSERT_TRUE(testing::wait_until([&] { return traffic.rounds() >= 3; }, 20s)) << d->log();
  // `timeout` bounds the run; top's own samples are bounded by its 2 s op timeouts.
  const std::string cmd =
      std::string("timeout 30 '") + KVFERRY_CLI_PATH + "' --socket '" + d->socket() + "' top --once --interval 1 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  ASSERT_EQ(::pclose(p), 0) << out;

  // TIER save-B/s load-B/s save-blk/s load-blk/s used pct blocks pinned evict/s
  const auto host = row(out, "host");
  ASSERT_GE(host.size(), 6u) << out;
  EXPECT_TRUE(nonzero_rate(host[1])) << "host save bytes/s\n" << out;
  EXPECT_TRUE(nonzero_rate(host[2])) << "host load bytes/s\n" << out;
  EXPECT_TRUE(nonzero_rate(host[3])) << "host save blocks/s\n" << out;
  EXPECT_TRUE(nonzero_rate(host[4])) << "host load blocks/s\n" << out;
  // The disk: written (demotions) and read (promotions) within the second.
  const auto disk = row(out, "disk");
  ASSERT_GE(disk.size(), 6u) << out;
  EXPECT_TRUE(nonzero_rate(disk[1])) << "disk bytes written/s\n" << out;
  EXPECT_TRUE(nonzero_rate(disk[2])) << "disk bytes read/s\n" << out;
  EXPECT_NE(out.find("disk healthy"), std::string::npos) << out;
  // The busy client, with its op rate; top's own connection is not listed.
  const auto client = row(out, "operator-top-traffic");
  ASSERT_GE(client.size(), 6u) << out;
  EXPECT_TRUE(nonzero_rate(client[4])) << "the client's ops/s\n" << out;
  EXPECT_EQ(out.find("kvferry-top"), std::string::npos) << out;
  EXPECT_EQ(out.find("\x1b["), std::string::npos) << "no terminal escapes into a pipe\n" << out;
  std::istringstream lines(out);
  for (std::string l; std::getline(lines, l);) EXPECT_LE(l.size(), 80u) << l;
}

/// `kvferry top` on a pseudo-terminal of 24 x 80. The parent keeps the terminal side open, so its
/// modes can be read before, during and after the view.
class PtyTop {
 public:
  explicit PtyTop(const std::string& socket) {
    winsize ws{};
    ws.ws_row = 24;
    ws.ws_col = 80;
    if (::openpty(&master_, &slave_, nullptr, nullptr, &ws) != 0) return;
    ::tcgetattr(slave_, &before_);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(master_);
      if (::login_tty(slave_) != 0) ::_exit(126);
      ::execl(KVFERRY_CLI_PATH, "kvferry", "--socket", socket.c_str(), "top", "--interval", "0.2",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~PtyTop() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      testing::wait_pid(pid_, 5s);
    }
    if (master_ >= 0) ::close(master_);
    if (slave_ >= 0) ::close(slave_);
  }
  bool started() const { return pid_ > 0; }

  /// Reads output until `pred(output)` holds or `timeout` passes.
  bool read_until(const std::function<bool(const std::string&)>& pred, std::chrono::milliseconds timeout) {
    const auto end = Clock::now() + timeout;
    while (!pred(out_)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      if (left <= 0) return false;
      drain(static_cast<int>(std::min<int64_t>(left, 50)));
    }
    return true;
  }
  /// Waits for the exit (reading output meanwhile); its exit code, or -1 after `timeout`.
  int wait_exit(std::chrono::milliseconds timeout) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end) {
      drain(20);
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        reaped_ = true;
        drain(0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
    }
    return -1;
  }
  void type(const char* keys) const {
    EXPECT_EQ(::write(master_, keys, std::strlen(keys)), ssize_t(std::strlen(keys)));
  }
  termios modes() const {
    termios t{};
    ::tcgetattr(slave_, &t);
    return t;
  }
  const termios& before() const { return before_; }
  const std::string& out() const { return out_; }
  static size_t count(const std::string& s, const std::string& what) {
    size_t n = 0;
    for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
    return n;
  }

 private:
  void drain(int wait_ms) {
    pollfd pfd{master_, POLLIN, 0};
    while (::poll(&pfd, 1, wait_ms) > 0) {
      char buf[8192];
      const ssize_t n = ::read(master_, buf, sizeof buf);
      if (n <= 0) return;
      out_.append(buf, static_cast<size_t>(n));
      wait_ms = 0;
    }
  }
  int master_ = -1, slave_ = -1;
  pid_t pid_ = -1;
  bool reaped_ = false;
  termios before_{};
  std::string out_;
};

constexpr tcflag_t kCookedBits = ICANON | ECHO;

/// Starts the view, waits for two frames (the second with rates) and checks raw mode meanwhile.
void expect_running_view(PtyTop& top, const DaemonProcess& d) {
  ASSERT_TRUE(top.started());
  ASSERT_EQ(top.before().c_lflag & kCookedBits, kCookedBits) << "a new terminal starts cooked";
  ASSERT_TRUE(top.read_until([](const std::string& o) { return PtyTop::count(o, "q quits") >= 2; }, 15s))
      << top.out() << "\n"
      << d.log();
  EXPECT_EQ(top.modes().c_lflag & kCookedBits, 0u) << "raw mode while the view runs";
  EXPECT_NE(top.out().find("\x1b[?1049h"), std::string::npos) << "the alternate screen";
  EXPECT_NE(top.out().find("TIER"), std::string::npos) << top.out();
  EXPECT_NE(top.out().find("\ndisk "), std::string::npos) << top.out();
}

void expect_terminal_restored(const PtyTop& top) {
  EXPECT_EQ(top.modes().c_lflag & kCookedBits, kCookedBits) << "canonical mode and echo are back";
  EXPECT_EQ(top.modes().c_lflag, top.before().c_lflag);
  const size_t leave = top.out().rfind("\x1b[?1049l");
  ASSERT_NE(leave, std::string::npos) << "the main screen is back";
  EXPECT_EQ(top.out().find("\x1b[H", leave), std::string::npos) << "nothing drawn after leaving";
}

TEST(OperatorTop, LiveViewQuitsOnQAndRestoresTheTerminal) {
  TempDir tier_dir;
  auto d = start_daemon(tier_dir.path);
  ASSERT_TRUE(d->ready()) << d->log();
  Traffic traffic(d->socket());
  PtyTop top(d->socket());
  expect_running_view(top, *d);
  top.type("x");  // other keys do nothing
  top.type("q");
  EXPECT_EQ(top.wait_exit(5s), 0) << top.out();
  expect_terminal_restored(top);
}

TEST(OperatorTop, LiveViewRestoresTheTerminalOnCtrlC) {
  TempDir tier_dir;
  auto d = start_daemon(tier_dir.path);
  ASSERT_TRUE(d->ready()) << d->log();
  PtyTop top(d->socket());
  expect_running_view(top, *d);
  top.type("\x03");  // the terminal's VINTR: SIGINT to the view's process group
  EXPECT_EQ(top.wait_exit(5s), 128 + SIGINT) << top.out();
  expect_terminal_restored(top);
}

}  // namespace
}  // namespace kvferry
