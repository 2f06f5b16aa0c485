#include "kvferry/store/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kvferry::store {
namespace {

std::string num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string series(const std::string& name, const std::string& labels, const std::string& extra = "") {
  std::string l = labels;
  if (!extra.empty()) l = l.empty() ? extra : l + "," + extra;
  return l.empty() ? name : name + "{" + l + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  std::sort(bounds_.begin(), bounds_.end());
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::observe(double v) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_.add(v);
}

std::vector<uint64_t> Histogram::cumulative() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    out[i] = acc;
  }
  return out;
}

double Histogram::quantile_bound(double q) const {
  const auto c = cumulative();
  const uint64_t total = c.back();
  if (total == 0) return 0;
  const double want = q * static_cast<double>(total);
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (static_cast<double>(c[i]) >= want) return bounds_[i];
  return INFINITY;
}

std::vector<double> latency_buckets() {
  std::vector<double> b;
  for (double decade = 1e-6; decade < 10; decade *= 10)
    for (double m : {1.0, 2.5, 5.0}) b.push_back(decade * m);
  b.push_back(10.0);
  return b;
}

Registry::Family& Registry::family(const std::string& name, const std::string& help, const char* type) {
  Family& f = families_[name];
  if (f.type.empty()) {
    f.help = help;
    f.type = type;
  }
  return f;
}

Counter& Registry::counter(const std::string& name, const std::string& help, const std::string& labels) {
  std::lock_guard lk(mu_);
  auto& slot = family(name, help, "counter").counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const std::string& labels) {
  std::lock_guard lk(mu_);
  auto& slot = family(name, help, "gauge").gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help, const std::string& labels,
                               std::vector<double> bounds) {
  std::lock_guard lk(mu_);
  auto& slot = family(name, help, "histogram").histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return *slot;
}

void Registry::gauge_fn(const std::string& name, const std::string& help, const std::string& labels,
                        std::function<double()> fn) {
  std::lock_guard lk(mu_);
  family(name, help, "gauge").fns[labels] = std::move(fn);
}

std::string Registry::render() const {
  std::lock_guard lk(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " " + f.help + "\n# TYPE " + name + " " + f.type + "\n";
    for (const auto& [l, c] : f.counters) out += series(name, l) + " " + std::to_string(c->value()) + "\n";
    for (const auto& [l, g] : f.gauges) out += series(name, l) + " " + num(g->value()) + "\n";
    for (const auto& [l, fn] : f.fns) out += series(name, l) + " " + num(fn()) + "\n";
    for (const auto& [l, h] : f.histograms) {
      const auto c = h->cumulative();
      for (size_t i = 0; i < h->bounds().size(); ++i)
        out += series(name + "_bucket", l, "le=\"" + num(h->bounds()[i]) + "\"") + " " + std::to_string(c[i]) + "\n";
      out += series(name + "_bucket", l, "le=\"+Inf\"") + " " + std::to_string(c.back()) + "\n";
      out += series(name + "_sum", l) + " " + num(h->sum()) + "\n";
      out += series(name + "_count", l) + " " + std::to_string(c.back()) + "\n";
    }
  }
  return out;
}

}  // namespace kvferry::store
