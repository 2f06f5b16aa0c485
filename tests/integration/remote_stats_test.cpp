// `kvferry stats` and Client::stats_all naming the remote tier (issue 37): two kvferryd on
// 127.0.0.1 with static peers (UCX over TCP). After A sends blocks to B, A's "remote" entry counts
// them out and B's counts them in; each sees one live peer; once B is killed, A counts it lost.
// No disk tier runs, so no "disk" entry appears. Every wait is bounded.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <nlohmann/json.hpp>

#include "daemon_harness.h"
#include "etcd_harness.h"
#include "test_blocks.h"
#include "kvferry/connector/client.h"

namespace kvferry {
namespace {

using testing::DaemonProcess;
using testing::run_cli;
using namespace std::chrono_literals;

std::unique_ptr<Client> connect(const DaemonProcess& d) { return testing::connect_client(d, "remote-stats-test"); }

/// A daemon on the remote tier listening on `port`, with the others of `ports` as static peers.
std::string remote_yaml(int port, const std::vector<int>& ports) {
  std::string peers;
  for (int p : ports) peers += (peers.empty() ? "" : ", ") + std::string("\"127.0.0.1:") + std::to_string(p) + "\"";
  return "tiers:\n  host:\n    capacity: 64MiB\n  remote:\n    listen: 127.0.0.1:" + std::to_string(port) +
         "\n    transport: tcp\n    timeout: 3s\n    peers: [" + peers + "]\n";
}

/// The "remote" entry of `c`'s stats; fails the test when there is none or there is another tier.
ops::TierStatsWire remote_entry(Client& c) {
  auto s = c.stats_all();
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  if (!s.ok()) return {};
  EXPECT_EQ(s->tiers.size(), 1u);
  for (const auto& t : s->tiers)
    if (std::string(t.tier) == "remote") return t;
  ADD_FAILURE() << "no remote entry";
  return {};
}

TEST(RemoteStats, StatsNameTheRemoteTier) {
  const std::vector<int> ports{testing::etcd::free_port(), testing::etcd::free_port()};
  const std::string id_a = "127.0.0.1:" + std::to_string(ports[0]), id_b = "127.0.0.1:" + std::to_string(ports[1]);
  DaemonProcess pa(remote_yaml(ports[0], ports));
  auto pb = std::make_unique<DaemonProcess>(remote_yaml(ports[1], ports));
  ASSERT_TRUE(pa.ready()) << pa.log();
  ASSERT_TRUE(pb->ready()) << pb->log();
  auto a = connect(pa), b = connect(*pb);
  ASSERT_TRUE(a && b);

  constexpr int64_t n = 16;
  const KvCacheSpec spec{4, n, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  auto rid = a->create_region("src", spec);
  ASSERT_TRUE(rid.ok()) << rid.status().to_string();
  auto base = a->map_region(*rid);
  ASSERT_TRUE(base.ok());
  for (int64_t i = 0; i < spec.region_bytes(); ++i) static_cast<uint8_t*>(*base)[i] = static_cast<uint8_t>(i * 131 + 7);
  std::vector<ops::Key> keys;
  for (int64_t i = 0; i < n; ++i) keys.push_back({0x57A7500000000000ull, static_cast<uint64_t>(i) + 1});
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto sd = a->send(*rid, keys, ids, id_b);
  ASSERT_TRUE(sd.ok()) << sd.status().to_string();
  ASSERT_EQ(sd->done, uint64_t(n)) << pa.log();

  const ops::TierStatsWire ta = remote_entry(*a);
  EXPECT_EQ(ta.flags & (ops::kTierPresent | ops::kTierHealthy | ops::kTierStorage | ops::kTierPeers),
            ops::kTierPresent | ops::kTierHealthy | ops::kTierPeers);
  EXPECT_STREQ(ta.member, id_a.c_str());
  EXPECT_EQ(ta.peers_live, 1u);
  EXPECT_EQ(ta.peers_lost, 0u);
  EXPECT_GE(ta.blocks_out, uint64_t(n));
  EXPECT_GE(ta.bytes_out, uint64_t(n) * uint64_t(spec.block_bytes()));
  EXPECT_EQ(ta.errors, 0u);
  const ops::TierStatsWire tb = remote_entry(*b);
  EXPECT_STREQ(tb.member, id_b.c_str());
  EXPECT_EQ(tb.peers_live, 1u);

  const std::string text = run_cli(KVFERRY_CLI_PATH, pa, "stats --json");
  const auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << text;
  EXPECT_EQ(j.value("tier", ""), "host") << text;
  ASSERT_TRUE(j.contains("tiers") && j["tiers"].is_array() && j["tiers"].size() == 1) << text;
  const auto& e = j["tiers"][0];
  EXPECT_EQ(e.value("tier", ""), "remote") << text;
  EXPECT_EQ(e.value("member", ""), id_a) << text;
  EXPECT_TRUE(e.value("healthy", false)) << text;
  EXPECT_EQ(e.value("peers_live", uint64_t{0}), 1u) << text;
  EXPECT_GE(e.value("blocks_out", uint64_t{0}), uint64_t(n)) << text;
  EXPECT_FALSE(e.contains("used_bytes")) << text;
  const std::string human = run_cli(KVFERRY_CLI_PATH, pa, "stats");
  EXPECT_NE(human.find("\nremote      member " + id_a + ", 1 peers live, 0 lost, out "), std::string::npos) << human;
  EXPECT_EQ(human.find("\ndisk"), std::string::npos) << human;

  // B dies: A's next sends to it fail, and A counts it lost.
  pb->stop(SIGKILL);
  b.reset();
  bool lost = false;
  for (int i = 0; i < 20 && !lost; ++i) {
    (void)a->send(*rid, std::span<const ops::Key>(keys).first(1), std::span<const int64_t>(ids).first(1), id_b);
    lost = remote_entry(*a).peers_lost == 1;
    if (!lost) std::this_thread::sleep_for(250ms);
  }
  EXPECT_TRUE(lost) << pa.log();
  const ops::TierStatsWire after = remote_entry(*a);
  EXPECT_EQ(after.peers_live, 0u);
  EXPECT_GT(after.errors, 0u);
}

}  // namespace
}  // namespace kvferry
