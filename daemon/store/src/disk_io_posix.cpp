// The pread/pwrite engine of the disk tier: where io_uring is refused (or forced off), a small
// pool of threads runs each request as one system call.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "disk_io.h"

namespace kvferry::store::disk {
namespace {

class PosixEngine final : public IoEngine {
 public:
  PosixEngine(int fd, unsigned threads) : fd_(fd) {
    if (threads == 0) threads = 1;
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { serve(); });
  }
  ~PosixEngine() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  std::string_view name() const override { return "pread/pwrite"; }

  void push(const IoReq& r) override {
    {
      std::lock_guard lk(mu_);
      todo_.push_back(r);
    }
    work_cv_.notify_one();
  }

  Status run(std::vector<IoDone>& out, int timeout_ms) override {
    std::unique_lock lk(mu_);
    if (timeout_ms > 0 && done_.empty() && !woken_)
      done_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return !done_.empty() || woken_; });
    woken_ = false;
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
    return Status::Ok();
  }

  void wake() override {
    {
      std::lock_guard lk(mu_);
      woken_ = true;
    }
    done_cv_.notify_all();
  }

  Status register_buffers(std::span<const iovec>) override { return Status::Ok(); }

 private:
  void serve() {
    std::unique_lock lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || !todo_.empty(); });
      if (todo_.empty()) return;  // stop_ and nothing left
      IoReq r = todo_.front();
      todo_.pop_front();
      lk.unlock();
      int64_t res = 0;
      switch (r.kind) {
        case IoReq::kRead: res = ::pread(fd_, r.buf, r.len, static_cast<off_t>(r.offset)); break;
        case IoReq::kWrite: res = ::pwrite(fd_, r.buf, r.len, static_cast<off_t>(r.offset)); break;
        case IoReq::kFsync: res = ::fdatasync(fd_); break;
      }
      if (res < 0) res = -errno;
      lk.lock();
      done_.push_back({r.tag, res});
      done_cv_.notify_all();
    }
  }

  int fd_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<IoReq> todo_;
  std::vector<IoDone> done_;
  bool woken_ = false;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<IoEngine> make_posix_engine(int fd, unsigned threads) {
  return std::make_unique<PosixEngine>(fd, threads);
}

}  // namespace kvferry::store::disk
