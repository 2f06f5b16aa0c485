#pragma once
// TaskPool: the offload service's persistent hashing threads, which saves and loads share to
// checksum, verify and (for host regions) copy blocks beside the caller's own work.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvferry::store {

/// A fixed set of threads, created once, that help callers run parallel_for. Concurrent callers
/// share them; each caller works on its own items too, so a busy pool only slows, never stalls.
class TaskPool {
 public:
  explicit TaskPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { serve(); });
  }
  ~TaskPool() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int helpers() const { return static_cast<int>(threads_.size()); }

  /// Runs fn(i) for i in [0, n); returns when every item is done. Small jobs stay on the caller.
  void parallel_for(size_t n, uint64_t bytes_per_item, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    const size_t want = std::min<size_t>(threads_.size(), n - 1);
    if (want == 0 || n * bytes_per_item < (size_t{2} << 20)) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->fn = &fn;
    {
      std::lock_guard lk(mu_);
      for (size_t t = 0; t < want; ++t) queue_.push_back(job);
    }
    if (want == threads_.size())
      cv_.notify_all();
    else
      for (size_t t = 0; t < want; ++t) cv_.notify_one();
    work(*job);
    std::unique_lock lk(job->mu);
    job->cv.wait(lk, [&] { return job->done.load() == n; });
  }

 private:
  struct Job {
    size_t n = 0;
    const std::function<void(size_t)>* fn = nullptr;  // valid until done == n
    std::atomic<size_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  static void work(Job& j) {
    for (size_t i = j.next.fetch_add(1); i < j.n; i = j.next.fetch_add(1)) {
      (*j.fn)(i);
      if (j.done.fetch_add(1) + 1 == j.n) {
        std::lock_guard lk(j.mu);
        j.cv.notify_all();
      }
    }
  }
  void serve() {
    for (;;) {
      std::shared_ptr<Job> j;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        j = std::move(queue_.front());
        queue_.pop_front();
      }
      work(*j);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvferry::store
