#include <gtest/gtest.h>

#include "kvferry/store/metrics.h"

namespace kvferry::store {
namespace {

TEST(Metrics, RendersTheTextExpositionFormat) {
  Registry r;
  r.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"host\"").add(3);
  r.counter("kvferry_blocks_saved_total", "Blocks saved", "tier=\"disk\"").add(1);
  r.gauge("kvferry_clients", "Connected clients").set(2);
  r.gauge_fn("kvferry_pool_used_bytes", "Host pool bytes in use", "", [] { return 4096.0; });
  Histogram& h = r.histogram("kvferry_op_seconds", "Op latency", "op=\"save\"", {0.001, 0.01});
  h.observe(0.0005);
  h.observe(0.005);
  h.observe(5);
  const std::string t = r.render();
  EXPECT_NE(t.find("# HELP kvferry_blocks_saved_total Blocks saved\n# TYPE kvferry_blocks_saved_total counter\n"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("kvferry_blocks_saved_total{tier=\"host\"} 3\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_blocks_saved_total{tier=\"disk\"} 1\n"), std::string::npos) << t;
  EXPECT_EQ(t.find("# TYPE kvferry_blocks_saved_total", t.find("# TYPE kvferry_blocks_saved_total") + 1),
            std::string::npos)
      << "one TYPE line per family";
  EXPECT_NE(t.find("kvferry_clients 2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_pool_used_bytes 4096\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_op_seconds_bucket{op=\"save\",le=\"0.001\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_op_seconds_bucket{op=\"save\",le=\"0.01\"} 2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_op_seconds_bucket{op=\"save\",le=\"+Inf\"} 3\n"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry_op_seconds_count{op=\"save\"} 3\n"), std::string::npos) << t;
}

TEST(Metrics, HistogramQuantileBound) {
  Histogram h({1, 2, 4, 8});
  for (int i = 0; i < 90; ++i) h.observe(1.5);
  for (int i = 0; i < 10; ++i) h.observe(7);
  EXPECT_EQ(h.quantile_bound(0.5), 2);
  EXPECT_EQ(h.quantile_bound(0.99), 8);
  EXPECT_EQ(h.count(), 100u);
  EXPECT_DOUBLE_EQ(h.sum(), 90 * 1.5 + 70);
}

TEST(Metrics, SameNameAndLabelsGiveTheSameMetric) {
  Registry r;
  Counter& a = r.counter("x_total", "x", "a=\"1\"");
  Counter& b = r.counter("x_total", "x", "a=\"1\"");
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(latency_buckets().front(), 1e-6);
  EXPECT_EQ(latency_buckets().back(), 10.0);
}

}  // namespace
}  // namespace kvferry::store
