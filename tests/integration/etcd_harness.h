#pragma once
// Test harness: a real etcd (Debian's etcd-server) on free loopback ports with its data in a
// temporary directory, started and stopped by the test. Every wait is bounded.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace kvferry::testing::etcd {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline std::string find_etcd() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd", "/usr/sbin/etcd"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

/// A free loopback TCP port (bound once with port 0, then released).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    std::abort();
  ::close(fd);
  return ntohs(a.sin_port);
}

/// waitpid with a deadline; -1 on timeout.
inline int wait_pid(pid_t pid, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  int st = 0;
  while (Clock::now() < end) {
    if (::waitpid(pid, &st, WNOHANG) == pid) return st;
    std::this_thread::sleep_for(5ms);
  }
  return -1;
}

/// A blocking GET on loopback with a 1 s socket timeout; the raw reply ("" on failure).
inline std::string http_get(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, req.data(), req.size()) == ssize_t(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(n));
    }
  }
  ::close(fd);
  return out;
}

/// One etcd process with its data in a temporary directory; stopped and removed by the destructor.
class Etcd {
 public:
  Etcd() {
    char tmpl[] = "/tmp/kvferry-etcd-XXXXXX";
    if (!::mkdtemp(tmpl)) std::abort();
    dir_ = tmpl;
    client_port_ = free_port();
    peer_port_ = free_port();
  }
  ~Etcd() {
    kill(SIGTERM);
    const std::string cmd = "rm -rf '" + dir_ + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir_.c_str());
  }

  /// Starts etcd and waits (at most 15 s) until /health says true.
  bool start(const std::string& bin) {
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    const std::string data = dir_ + "/data", log = dir_ + "/etcd.log";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::execl(bin.c_str(), bin.c_str(), "--name", "default", "--data-dir", data.c_str(), "--listen-client-urls",
              client.c_str(), "--advertise-client-urls", client.c_str(), "--listen-peer-urls", peer.c_str(),
              "--initial-advertise-peer-urls", peer.c_str(), "--initial-cluster", ("default=" + peer).c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const auto end = Clock::now() + 15s;
    while (Clock::now() < end) {
      if (http_get(client_port_, "/health").find("\"health\":\"true\"") != std::string::npos) return true;
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  void kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    if (wait_pid(pid_, 5s) == -1) {
      ::kill(pid_, SIGKILL);
      wait_pid(pid_, 5s);
    }
    pid_ = -1;
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(client_port_); }
  std::string log() const { return dir_ + "/etcd.log"; }

 private:
  std::string dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace kvferry::testing::etcd
