#include "kvferry/store/fault_tier.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace kvferry::store {

FaultTier::FaultTier(std::unique_ptr<Tier> inner, Knobs knobs)
    : inner_(std::move(inner)), knobs_(knobs), rng_(knobs.seed) {}

FaultTier::~FaultTier() {
  // The inner tier may still write from a corrupted copy: let it finish first.
  inner_.reset();
}

void FaultTier::set_knobs(const Knobs& k) {
  std::lock_guard lk(mu_);
  knobs_ = k;
}

FaultTier::Counts FaultTier::counts() const {
  std::lock_guard lk(mu_);
  return counts_;
}

bool FaultTier::roll(double rate) {
  if (rate <= 0) return false;
  return std::uniform_real_distribution<double>(0, 1)(rng_) < rate;
}

void FaultTier::hold(TierCompletion c) {
  held_.push_back({std::chrono::steady_clock::now() + knobs_.delay, std::move(c)});
}

TierHealth FaultTier::health() const {
  TierHealth h = inner_->health();
  std::lock_guard lk(mu_);
  if (degraded_) {
    h.ok = false;
    h.reason = reason_;
  }
  h.io_errors += counts_.errors;
  return h;
}

Status FaultTier::submit(std::span<const TierRequest> batch) {
  std::vector<TierRequest> pass;
  {
    std::lock_guard lk(mu_);
    for (const TierRequest& r : batch) {
      const uint64_t n = ++seq_;
      const bool eligible =
          !(knobs_.reads_only && r.op != TierOp::kRead) && !(knobs_.writes_only && r.op != TierOp::kWrite);
      if (eligible && knobs_.error_errno != 0 && (n == knobs_.error_on_nth || roll(knobs_.error_rate))) {
        const int e = knobs_.error_errno;
        ++counts_.errors;
        Status s = e == ENOSPC ? Status(ErrorCode::kResourceExhausted, "injected ENOSPC: no space left on device")
                               : Status(ErrorCode::kIo, std::string("injected ") + std::strerror(e));
        if (e == EIO) {
          degraded_ = true;
          reason_ = "injected EIO";
        }
        hold({r.cookie, r.op, std::move(s), r.record});
        continue;
      }
      Pending p{r.cookie, Action::kPass, r.buf, r.record.bytes};
      TierRequest fwd = r;
      if (eligible && roll(knobs_.short_rate)) {
        ++counts_.shorts;
        if (r.op == TierOp::kWrite) {  // the write never lands
          hold({r.cookie, r.op,
                Status(ErrorCode::kIo, "injected short write: 0 of " + std::to_string(r.record.bytes) + " bytes"),
                r.record});
          continue;
        }
        p.action = Action::kShortRead;
      } else if (eligible && r.op == TierOp::kRead && roll(knobs_.corrupt_read_rate)) {
        p.action = Action::kCorruptRead;
      } else if (eligible && r.op == TierOp::kWrite && r.record.bytes > 0 && roll(knobs_.corrupt_write_rate)) {
        p.action = Action::kCorruptWrite;
        const size_t len = (r.buf_bytes + 4095) / 4096 * 4096;
        p.copy = {static_cast<uint8_t*>(std::aligned_alloc(4096, len)), &std::free};
        std::memcpy(p.copy.get(), r.buf, r.buf_bytes);
        p.copy.get()[rng_() % r.record.bytes] ^= 0x5a;
        fwd.buf = p.copy.get();
        ++counts_.corrupted_writes;
      }
      fwd.cookie = next_cookie_++;
      pending_.emplace(fwd.cookie, std::move(p));
      pass.push_back(std::move(fwd));
    }
  }
  return inner_->submit(pass);
}

size_t FaultTier::poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  size_t n = 0;
  for (int round = 0; round < 100000; ++round) {
    std::vector<TierCompletion> got;
    const auto now = std::chrono::steady_clock::now();
    {
      std::lock_guard lk(mu_);
      while (n < max && !held_.empty() && held_.front().due <= now) {
        out.push_back(std::move(held_.front().c));
        held_.pop_front();
        ++n;
      }
    }
    if (n > 0 || now >= until) break;
    // Short waits on the inner tier, so held completions come out close to their due time.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    (void)inner_->poll(got, max, std::min(left, std::chrono::milliseconds(5)));
    std::lock_guard lk(mu_);
    for (TierCompletion& c : got) {
      auto it = pending_.find(c.cookie);
      if (it == pending_.end()) continue;
      Pending& p = it->second;
      c.cookie = p.cookie;
      const uint64_t bytes = c.record.bytes;  // a read request does not know its size; the completion does
      if (c.status.ok() && p.action == Action::kShortRead) {
        const uint64_t half = bytes / 2;
        std::memset(p.buf + half, 0xee, bytes - half);
        c.status = {ErrorCode::kDataLoss,
                    "injected short read: " + std::to_string(half) + " of " + std::to_string(bytes) + " bytes"};
      } else if (c.status.ok() && p.action == Action::kCorruptRead && bytes > 0) {
        p.buf[rng_() % bytes] ^= 0xa5;
        ++counts_.corrupted_reads;
      }
      pending_.erase(it);
      hold(std::move(c));
    }
  }
  return n;
}

Result<FaultTier::Knobs> parse_fault_spec(std::string_view spec) {
  FaultTier::Knobs k;
  auto bad = [&](std::string_view item, const char* why) {
    return Result<FaultTier::Knobs>(ErrorCode::kInvalidArgument, "fault spec item '" + std::string(item) + "': " + why);
  };
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key(item.substr(0, eq));
    const std::string val(eq == std::string_view::npos ? "" : item.substr(eq + 1));
    char* end = nullptr;
    auto num = [&](double* out) {
      *out = std::strtod(val.c_str(), &end);
      return !val.empty() && end && *end == 0;
    };
    double v = 0;
    if (key == "reads_only") {
      k.reads_only = true;
    } else if (key == "writes_only") {
      k.writes_only = true;
    } else if (key == "errno") {
      if (val == "EIO")
        k.error_errno = EIO;
      else if (val == "ENOSPC")
        k.error_errno = ENOSPC;
      else if (num(&v) && v > 0)
        k.error_errno = static_cast<int>(v);
      else
        return bad(item, "expected EIO, ENOSPC or a positive number");
    } else if (!num(&v) || v < 0) {
      return bad(item, "expected key=non-negative number");
    } else if (key == "rate") {
      k.error_rate = v;
    } else if (key == "nth") {
      k.error_on_nth = static_cast<uint64_t>(v);
    } else if (key == "short") {
      k.short_rate = v;
    } else if (key == "corrupt_read") {
      k.corrupt_read_rate = v;
    } else if (key == "corrupt_write") {
      k.corrupt_write_rate = v;
    } else if (key == "delay_us") {
      k.delay = std::chrono::microseconds(static_cast<int64_t>(v));
    } else if (key == "seed") {
      k.seed = static_cast<uint64_t>(v);
    } else {
      return bad(item, "unknown key");
    }
  }
  if ((k.error_rate > 0 || k.error_on_nth > 0) && k.error_errno == 0) k.error_errno = EIO;
  return k;
}

}  // namespace kvferry::store
