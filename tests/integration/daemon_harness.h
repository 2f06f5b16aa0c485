#pragma once
// Test harness: runs kvferryd as a separate process with a config in a temporary directory,
// and offers bounded waits. Every wait in these tests has a deadline.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvferry::testing {

inline std::string make_temp_dir() {
  char tmpl[] = "/tmp/kvferry-it-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  if (!d) std::abort();
  ::chmod(d, 0755);  // lets a test client running as another uid reach the socket
  return d;
}

/// Polls `pred` every 5 ms until it holds or `timeout` passes.
inline bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

/// waitpid with a deadline; returns the wait status or -1 on timeout.
inline int wait_pid(pid_t pid, std::chrono::milliseconds timeout) {
  int st = -1;
  bool done = wait_until([&] { return ::waitpid(pid, &st, WNOHANG) == pid; }, timeout);
  return done ? st : -1;
}

inline int connect_raw(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// A kvferryd process. The config's `daemon.socket` is set to dir/kvferry.sock.
class DaemonProcess {
 public:
  /// `extra_yaml` is appended to a config that sets the socket (mode 0666) and the CPU backend.
  /// `args` are extra kvferryd arguments (e.g. --enable-test-faults). `max_fds` > 0 starts the
  /// daemon with RLIMIT_NOFILE lowered to it (fd exhaustion tests).
  /// `wrapper` runs kvferryd through another program (e.g. {"ip", "netns", "exec", "ns"}).
  explicit DaemonProcess(const std::string& extra_yaml, std::vector<std::string> env = {}, std::string backend = "cpu",
                         std::vector<std::string> args = {}, uint64_t max_fds = 0,
                         std::vector<std::string> wrapper = {})
      : dir_(make_temp_dir()), backend_(std::move(backend)) {
    socket_ = dir_ + "/kvferry.sock";
    config_ = dir_ + "/kvferry.yaml";
    log_ = dir_ + "/kvferryd.log";
    write_config(extra_yaml);
    pid_ = ::fork();
    if (pid_ == 0) {
      int lf = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      ::dup2(lf, 2);
      ::dup2(lf, 1);
      for (auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
      if (max_fds > 0) {
        const rlimit rl{max_fds, max_fds};
        if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) ::_exit(126);
      }
      std::vector<char*> argv;
      for (auto& w : wrapper) argv.push_back(w.data());
      std::string bin = KVFERRYD_PATH;
      argv.push_back(wrapper.empty() ? const_cast<char*>("kvferryd") : bin.data());
      argv.push_back(const_cast<char*>("--config"));
      argv.push_back(config_.data());
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      if (wrapper.empty())
        ::execv(KVFERRYD_PATH, argv.data());
      else
        ::execvp(argv[0], argv.data());
      ::_exit(127);
    }
    bool exited = false;
    ready_ = wait_until(
                 [&] {
                   int fd = connect_raw(socket_);
                   if (fd >= 0) {
                     ::close(fd);
                     return true;
                   }
                   // A daemon that refused to start has exited: stop waiting (without reaping it).
                   siginfo_t si{};
                   exited = ::waitid(P_PID, static_cast<id_t>(pid_), &si, WEXITED | WNOHANG | WNOWAIT) == 0 &&
                            si.si_pid == pid_;
                   return exited;
                 },
                 std::chrono::seconds(10)) &&
             !exited;
  }
  ~DaemonProcess() {
    if (pid_ > 0 && !stopped_) stop();
    // A sanitizer build of kvferryd reports into its log (and aborts): that fails the test even
    // when the test did not look at how the daemon ended.
    const std::string l = log();
    for (const char* mark :
         {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "WARNING: ThreadSanitizer"})
      if (l.find(mark) != std::string::npos) {
        ADD_FAILURE() << "kvferryd's log has a sanitizer report:\n" << l;
        break;
      }
    std::string cmd = "rm -rf '" + dir_ + "'";
    if (std::system(cmd.c_str()) != 0) {
    }
  }
  /// `extra_yaml` may start with a "daemon:" section of its own: its keys join the harness's.
  void write_config(const std::string& extra_yaml) {
    std::ofstream f(config_);
    std::string daemon_keys, rest = extra_yaml;
    if (rest.rfind("daemon:\n", 0) == 0) {
      size_t at = 8;
      while (at < rest.size() && rest.compare(at, 2, "  ") == 0) {
        const size_t nl = rest.find('\n', at);
        const size_t end = nl == std::string::npos ? rest.size() : nl + 1;
        daemon_keys += rest.substr(at, end - at);
        at = end;
      }
      rest = rest.substr(at);
    }
    // No metrics port (tests pass --metrics-listen when they want one), DebugRead on (tests read
    // regions back through it) unless the test says otherwise, and a small host pool unless the
    // test sets its own tiers.
    if (daemon_keys.find("debug_read:") == std::string::npos) daemon_keys += "  debug_read: true\n";
    f << "daemon:\n  socket: " << socket_ << "\n  socket_mode: 0666\n  log_level: debug\n  metrics_listen: \"\"\n"
      << daemon_keys << "device:\n  backend: " << backend_ << "\n"
      << rest;
    if (extra_yaml.find("tiers:") == std::string::npos) f << "tiers:\n  host:\n    capacity: 64MiB\n";
  }
  /// SIGTERM and wait (bounded); returns the wait status (-1 when it did not exit in time).
  int stop(int sig = SIGTERM) {
    stopped_ = true;
    ::kill(pid_, sig);
    int st = wait_pid(pid_, std::chrono::seconds(10));
    if (st == -1) {
      ::kill(pid_, SIGKILL);
      wait_pid(pid_, std::chrono::seconds(5));
    }
    return st;
  }
  bool ready() const { return ready_; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  std::string log() const { return read_file(log_); }

 private:
  std::string dir_, backend_, socket_, config_, log_;
  pid_t pid_ = -1;
  bool ready_ = false, stopped_ = false;
};

/// GET `path` from 127.0.0.1:port; the whole response ("" on failure). Bounded by a 2 s timeout.
inline std::string http_get(uint16_t port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return out;
}

/// The value of the metric line starting with `line_prefix` (-1 when absent).
inline double metric(const std::string& body, const std::string& line_prefix) {
  const size_t p = body.find("\n" + line_prefix + " ");
  if (p == std::string::npos) return -1;
  return std::stod(body.substr(p + line_prefix.size() + 2));
}

/// The port of /metrics that kvferryd logged ("metrics on ... (port N)"), 0 when none yet.
inline uint16_t metrics_port(const std::string& log) {
  const size_t p = log.find("metrics on ");
  if (p == std::string::npos) return 0;
  const size_t q = log.find("(port ", p);
  return q == std::string::npos ? 0 : static_cast<uint16_t>(std::atoi(log.c_str() + q + 6));
}

/// Runs `fn` in a forked child; returns its exit code, or -1 when it did not exit in time.
inline int run_in_child(const std::function<int()>& fn, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  pid_t p = ::fork();
  if (p == 0) ::_exit(fn());
  int st = wait_pid(p, timeout);
  if (st == -1) {
    ::kill(p, SIGKILL);
    wait_pid(p, std::chrono::seconds(5));
    return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace kvferry::testing
