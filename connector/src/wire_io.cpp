// Frame I/O with SCM_RIGHTS (wire_io.h).
#include "kvferry/connector/wire_io.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

namespace kvferry {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Status errno_status(const char* call, int err) {
  return {ErrorCode::kIo, std::string(call) + ": " + std::strerror(err)};
}

namespace proto {
namespace {

using Clock = std::chrono::steady_clock;

/// Milliseconds left until `deadline` (-1 = none), at least 0.
int ms_left(Clock::time_point deadline, bool forever) {
  if (forever) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

Status wait_io(int sock, short ev, Clock::time_point deadline, bool forever) {
  for (;;) {
    pollfd p{sock, ev, 0};
    int r = ::poll(&p, 1, ms_left(deadline, forever));
    if (r > 0) return Status::Ok();
    if (r == 0) return {ErrorCode::kTimeout, "timed out waiting on the socket"};
    if (errno != EINTR) return errno_status("poll", errno);
  }
}

/// Reads exactly `n` bytes; the first read collects descriptors when `fds` is set.
Status read_exact(int sock, uint8_t* buf, size_t n, std::vector<UniqueFd>* fds, Clock::time_point deadline,
                  bool forever) {
  size_t got = 0;
  while (got < n) {
    iovec iov{buf + got, n - got};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxFds)];
    if (fds) {
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
    }
    ssize_t r = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        KVFERRY_TRY(wait_io(sock, POLLIN, deadline, forever));
        continue;
      }
      return errno_status("recvmsg", errno);
    }
    if (r == 0) return {ErrorCode::kUnavailable, "the peer closed the connection"};
    if (fds) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          fds->emplace_back(fd);
        }
      }
      if (mh.msg_flags & MSG_CTRUNC) return {ErrorCode::kProtocol, "too many file descriptors in one frame"};
    }
    got += static_cast<size_t>(r);
  }
  return Status::Ok();
}

}  // namespace

Status send_frame(int sock, std::span<const uint8_t> frame, std::span<const int> fds, int timeout_ms) {
  if (fds.size() > static_cast<size_t>(kMaxFds)) return {ErrorCode::kInvalidArgument, "too many fds for one frame"};
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  size_t sent = 0;
  bool first = true;
  while (sent < frame.size()) {
    iovec iov{const_cast<uint8_t*>(frame.data() + sent), frame.size() - sent};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxFds)];
    if (first && !fds.empty()) {
      mh.msg_control = cbuf;
      mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t r = ::sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        KVFERRY_TRY(wait_io(sock, POLLOUT, deadline, timeout_ms < 0));
        continue;
      }
      return errno_status("sendmsg", errno);
    }
    first = false;
    sent += static_cast<size_t>(r);
  }
  return Status::Ok();
}

Result<RecvFrame> recv_frame(int sock, int timeout_ms) {
  const bool forever = timeout_ms < 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(forever ? 0 : timeout_ms);
  RecvFrame f;
  uint8_t hb[kHeaderBytes];
  KVFERRY_TRY(read_exact(sock, hb, kHeaderBytes, &f.fds, deadline, forever));
  auto h = decode_header(hb);
  if (!h.ok()) return h.status();
  f.header = *h;
  f.payload.resize(h->length);
  if (h->length) KVFERRY_TRY(read_exact(sock, f.payload.data(), h->length, nullptr, deadline, forever));
  return f;
}

}  // namespace proto
}  // namespace kvferry
