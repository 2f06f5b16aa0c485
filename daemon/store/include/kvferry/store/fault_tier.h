#pragma once
// FaultTier: a test-only Tier that wraps another and injects faults at the seam, so callers'
// error paths run without hooks inside production tiers. Knobs: an errno on a fraction of
// requests or on the n-th one (EIO also marks the tier degraded; ENOSPC reads as
// kResourceExhausted), short I/O (a read that moved only part of the block: kDataLoss; a write
// that did not land: kIo), a delay before completions are handed out, and corruption of the bytes
// on write (the inner tier stores a flipped copy; the caller's buffer is untouched) or on read (a
// byte of the caller's buffer is flipped after a successful read and reported kOk: the caller's
// own checksum check must catch it). Thread-safe like the tier it wraps.
#include <chrono>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>
#include <deque>

#include "kvferry/store/tier.h"

namespace kvferry::store {

class FaultTier final : public Tier {
 public:
  struct Knobs {
    int error_errno = 0;                 ///< errno injected by error_rate / error_on_nth (0: none)
    double error_rate = 0;               ///< fraction of requests failed with error_errno
    uint64_t error_on_nth = 0;           ///< fail exactly the n-th request (1-based) with error_errno; 0: never
    double short_rate = 0;               ///< fraction of requests that come back short
    double corrupt_read_rate = 0;        ///< fraction of successful reads whose bytes get a flipped byte
    double corrupt_write_rate = 0;       ///< fraction of writes stored with a flipped byte
    std::chrono::microseconds delay{0};  ///< each completion is held this long
    bool reads_only = false;             ///< faults hit reads only
    bool writes_only = false;            ///< faults hit writes only
    uint64_t seed = 1;
  };
  struct Counts {
    uint64_t errors = 0, shorts = 0, corrupted_reads = 0, corrupted_writes = 0;
  };

  FaultTier(std::unique_ptr<Tier> inner, Knobs knobs);
  ~FaultTier() override;

  void set_knobs(const Knobs& k);
  Counts counts() const;
  Tier& inner() { return *inner_; }

  std::string_view name() const override { return inner_->name(); }
  Result<uint64_t> recover() override { return inner_->recover(); }
  Status register_buffers(std::span<const iovec> b) override { return inner_->register_buffers(b); }
  Status submit(std::span<const TierRequest> batch) override;
  size_t poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) override;
  std::optional<BlockRecord> lookup(std::string_view ns, const BlockKey& key) override {
    return inner_->lookup(ns, key);
  }
  Status erase(std::string_view ns, const BlockKey& key) override { return inner_->erase(ns, key); }
  std::vector<BlockRecord> list(std::optional<std::string_view> ns, size_t limit) const override {
    return inner_->list(ns, limit);
  }
  Status pin(std::string_view ns, const BlockKey& key) override { return inner_->pin(ns, key); }
  Status unpin(std::string_view ns, const BlockKey& key) override { return inner_->unpin(ns, key); }
  std::vector<BlockRecord> evict(uint64_t bytes) override { return inner_->evict(bytes); }
  std::vector<BlockRecord> take_victims() override { return inner_->take_victims(); }
  TierUsage usage() const override { return inner_->usage(); }
  TierHealth health() const override;

 private:
  enum class Action : uint8_t { kPass, kShortRead, kCorruptRead, kCorruptWrite };
  struct Pending {
    uint64_t cookie;
    Action action;
    uint8_t* buf;
    uint64_t bytes;  ///< a write's size (0 for a read)
    std::unique_ptr<uint8_t, void (*)(void*)> copy{nullptr, nullptr};
  };
  struct Held {
    std::chrono::steady_clock::time_point due;
    TierCompletion c;
  };
  bool roll(double rate);
  void hold(TierCompletion c);

  std::unique_ptr<Tier> inner_;
  mutable std::mutex mu_;
  Knobs knobs_;
  std::mt19937_64 rng_;
  uint64_t seq_ = 0;
  uint64_t next_cookie_ = 1;
  Counts counts_;
  bool degraded_ = false;
  std::string reason_;
  std::unordered_map<uint64_t, Pending> pending_;
  std::deque<Held> held_;
};

/// Parses a fault spec for tests (kvferryd --test-disk-faults): comma-separated items of
/// `errno=EIO|ENOSPC|<n>`, `rate=F`, `nth=N`, `short=F`, `corrupt_read=F`, `corrupt_write=F`,
/// `delay_us=N`, `seed=N`, `reads_only`, `writes_only`. E.g. "errno=EIO,rate=1,writes_only".
Result<FaultTier::Knobs> parse_fault_spec(std::string_view spec);

}  // namespace kvferry::store
