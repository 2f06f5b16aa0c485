#pragma once
// Blocking frame I/O on a Unix stream socket, with file descriptors passed as SCM_RIGHTS, and
// the owner type of a file descriptor. Shared by the connector and the daemon.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvferry/connector/protocol.h"

namespace kvferry {

/// Owns one file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// Status for a failed system call: kIo with the call and strerror(errno).
Status errno_status(const char* call, int err);

namespace proto {

/// Most descriptors one frame carries.
inline constexpr int kMaxFds = 4;

/// A received frame: header, payload and the descriptors that came with it.
struct RecvFrame {
  Header header;
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;
};

/// Sends a whole frame; `fds` ride with its first byte. Waits at most `timeout_ms` for the
/// socket to accept the bytes (works on blocking and non-blocking sockets; no SIGPIPE).
Status send_frame(int sock, std::span<const uint8_t> frame, std::span<const int> fds = {}, int timeout_ms = 5000);

/// Receives exactly one frame: the 16-byte header (with any descriptors) then exactly `length`
/// payload bytes, so nothing of a following frame is read ahead. Waits at most `timeout_ms` in
/// total (-1 = forever). A closed peer yields kUnavailable; a bad header its decode error.
Result<RecvFrame> recv_frame(int sock, int timeout_ms);

}  // namespace proto
}  // namespace kvferry
