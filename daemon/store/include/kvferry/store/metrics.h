#pragma once
// Metrics in the Prometheus text exposition format (version 0.0.4): counters, gauges and
// histograms registered once by name (+ a fixed label set) and updated lock-free on hot paths.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvferry::store {

class Counter {
 public:
  void add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

class Gauge {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  void add(double d) {
    double cur = v_.load(std::memory_order_relaxed);
    while (!v_.compare_exchange_weak(cur, cur + d, std::memory_order_relaxed)) {
    }
  }
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

/// Cumulative histogram with fixed upper bounds (e.g. seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  /// Cumulative counts per bound, then +Inf.
  std::vector<uint64_t> cumulative() const;
  double sum() const { return sum_.value(); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  /// The smallest bound b with at least q of the observations <= b (an upper estimate).
  double quantile_bound(double q) const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  ///< per bound + one for +Inf (not cumulative)
  std::atomic<uint64_t> count_{0};
  Gauge sum_;
};

/// Latency buckets for op histograms, in seconds: 1 us .. 10 s.
std::vector<double> latency_buckets();

/// Owns metrics by family name and renders them. Registration is rare (start-up); the returned
/// references stay valid for the registry's life.
class Registry {
 public:
  /// `labels` like `tier="host",op="save"` (already formatted); families share name/help/type.
  Counter& counter(const std::string& name, const std::string& help, const std::string& labels = "");
  Gauge& gauge(const std::string& name, const std::string& help, const std::string& labels = "");
  Histogram& histogram(const std::string& name, const std::string& help, const std::string& labels = "",
                       std::vector<double> bounds = latency_buckets());
  /// A gauge computed when rendering (e.g. pool occupancy read from the index).
  void gauge_fn(const std::string& name, const std::string& help, const std::string& labels,
                std::function<double()> fn);

  /// The whole registry in the text exposition format.
  std::string render() const;

 private:
  struct Family {
    std::string help;
    std::string type;
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
    std::map<std::string, std::function<double()>> fns;
  };
  Family& family(const std::string& name, const std::string& help, const char* type);
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

}  // namespace kvferry::store
