// The io_uring engine of the disk tier: one long-lived ring per I/O thread, the slot file
// registered as fixed file 0, the caller's buffers as fixed buffers where offered, and an eventfd
// read kept armed in the ring so that submit() can end a wait without a timeout.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "disk_io.h"

namespace kvferry::store::disk {
namespace {

constexpr uint64_t kWakeTag = ~uint64_t{0};

Status uring_status(const char* call, int err) {
  return {ErrorCode::kIo,
          std::string(call) + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")"};
}

/// Owns one io_uring instance.
class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (live_) io_uring_queue_exit(&ring_);
  }
  int init(unsigned entries) {
    const int rc = io_uring_queue_init(entries, &ring_, 0);
    live_ = rc == 0;
    return rc;
  }
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
  bool live_ = false;
};

/// Owns one file descriptor.
class OwnedFd {
 public:
  explicit OwnedFd(int fd = -1) : fd_(fd) {}
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

class UringEngine final : public IoEngine {
 public:
  UringEngine(int fd, unsigned depth) : fd_(fd), depth_(depth) {}

  Status init() {
    // Room for `depth` requests, the wake read, and a margin; the CQ is twice that by default.
    if (const int rc = ring_.init(depth_ + 8); rc < 0) return uring_status("io_uring_queue_init", -rc);
    if (io_uring_register_files(ring_.get(), &fd_, 1) == 0) fixed_file_ = true;
    wake_fd_ = std::make_unique<OwnedFd>(::eventfd(0, EFD_CLOEXEC));
    if (wake_fd_->get() < 0) return uring_status("eventfd", errno);
    arm_wake();
    return submit();
  }

  std::string_view name() const override { return "io_uring"; }

  void push(const IoReq& r) override {
    io_uring_sqe* sqe = next_sqe();
    const int fd = fixed_file_ ? 0 : fd_;
    switch (r.kind) {
      case IoReq::kRead:
        if (r.buf_index >= 0)
          io_uring_prep_read_fixed(sqe, fd, r.buf, static_cast<unsigned>(r.len), r.offset, r.buf_index);
        else
          io_uring_prep_read(sqe, fd, r.buf, static_cast<unsigned>(r.len), r.offset);
        break;
      case IoReq::kWrite:
        if (r.buf_index >= 0)
          io_uring_prep_write_fixed(sqe, fd, r.buf, static_cast<unsigned>(r.len), r.offset, r.buf_index);
        else
          io_uring_prep_write(sqe, fd, r.buf, static_cast<unsigned>(r.len), r.offset);
        break;
      case IoReq::kFsync: io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC); break;
    }
    if (fixed_file_) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
    io_uring_sqe_set_data64(sqe, r.tag);
  }

  Status run(std::vector<IoDone>& out, int timeout_ms) override {
    KVFERRY_TRY(submit());
    size_t got = reap(out);
    if (got == 0 && !woken_ && timeout_ms > 0) {
      __kernel_timespec ts{};
      ts.tv_sec = timeout_ms / 1000;
      ts.tv_nsec = static_cast<long long>(timeout_ms % 1000) * 1000000;
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe_timeout(ring_.get(), &cqe, &ts);
      if (rc < 0 && rc != -ETIME && rc != -EINTR && rc != -EAGAIN) return uring_status("io_uring_wait_cqe", -rc);
      got = reap(out);
    }
    if (woken_) {
      woken_ = false;
      arm_wake();
      KVFERRY_TRY(submit());
    }
    return Status::Ok();
  }

  void wake() override {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_->get(), &one, sizeof one);
  }

  Status register_buffers(std::span<const iovec> bufs) override {
    if (has_buffers_) (void)io_uring_unregister_buffers(ring_.get());
    has_buffers_ = false;
    if (bufs.empty()) return Status::Ok();
    const int rc = io_uring_register_buffers(ring_.get(), bufs.data(), static_cast<unsigned>(bufs.size()));
    if (rc < 0) return uring_status("io_uring_register_buffers", -rc);
    has_buffers_ = true;
    return Status::Ok();
  }

 private:
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    while (sqe == nullptr) {  // SQ full: hand what is queued to the kernel and take a fresh entry
      (void)io_uring_submit(ring_.get());
      sqe = io_uring_get_sqe(ring_.get());
    }
    return sqe;
  }

  void arm_wake() {
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_read(sqe, wake_fd_->get(), &wake_buf_, sizeof wake_buf_, 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  Status submit() {
    for (int attempt = 0; attempt < 100; ++attempt) {
      const int rc = io_uring_submit(ring_.get());
      if (rc >= 0) return Status::Ok();
      if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) return uring_status("io_uring_submit", -rc);
    }
    return {ErrorCode::kBusy, "io_uring_submit kept failing with EAGAIN/EBUSY"};
  }

  // Each CQE is marked seen as soon as its two fields are copied out, so the CQ never replays one
  // whatever happens after.
  size_t reap(std::vector<IoDone>& out) {
    size_t n = 0;
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring_.get(), &cqe) == 0 && cqe != nullptr) {
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      const int64_t res = cqe->res;
      io_uring_cqe_seen(ring_.get(), cqe);
      if (tag == kWakeTag) {
        woken_ = true;
        continue;
      }
      out.push_back({tag, res});
      ++n;
    }
    return n;
  }

  int fd_;
  unsigned depth_;
  Ring ring_;
  std::unique_ptr<OwnedFd> wake_fd_;
  uint64_t wake_buf_ = 0;
  bool fixed_file_ = false;
  bool has_buffers_ = false;
  bool woken_ = false;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_uring_engine(int fd, unsigned depth) {
  auto e = std::make_unique<UringEngine>(fd, depth);
  KVFERRY_TRY(e->init());
  return std::unique_ptr<IoEngine>(std::move(e));
}

}  // namespace kvferry::store::disk
