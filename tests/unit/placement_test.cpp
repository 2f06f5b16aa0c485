// Rendezvous placement: deterministic, balanced, and a membership change moves only the keys it
// must (about 1/n of them, and only to or from the member that changed); replicas are distinct.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "kvferry/store/membership.h"
#include "kvferry/store/placement.h"

namespace kvferry::store {
namespace {

std::vector<BlockKey> keys(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<BlockKey> out(n);
  for (auto& k : out) k = {rng(), rng()};
  return out;
}

std::vector<std::string> names(size_t n) {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.push_back("daemon-" + std::to_string(i));
  return out;
}

TEST(Placement, EmptyAndSingle) {
  RendezvousPlacement none({});
  EXPECT_TRUE(none.owners({1, 2}, 2).empty());
  EXPECT_EQ(none.owner({1, 2}), "");
  RendezvousPlacement one({"a"});
  EXPECT_EQ(one.owner({1, 2}), "a");
  EXPECT_EQ(one.owners({1, 2}, 3).size(), 1u);
}

TEST(Placement, DeterministicAndOrderIndependent) {
  auto ids = names(7);
  RendezvousPlacement a(ids);
  std::reverse(ids.begin(), ids.end());
  RendezvousPlacement b(ids);
  for (auto& k : keys(2000, 1)) EXPECT_EQ(a.owner(k), b.owner(k));
}

TEST(Placement, Balanced) {
  const size_t n = 8, total = 80000;
  RendezvousPlacement p(names(n));
  std::map<std::string, size_t> count;
  for (auto& k : keys(total, 2)) ++count[p.owner(k)];
  ASSERT_EQ(count.size(), n);
  for (auto& [id, c] : count) {
    EXPECT_GT(c, total / n * 9 / 10) << id;
    EXPECT_LT(c, total / n * 11 / 10) << id;
  }
}

TEST(Placement, JoinMovesOnlyKeysTheNewMemberWins) {
  const size_t n = 5, total = 50000;
  auto ids = names(n);
  RendezvousPlacement before(ids);
  ids.push_back("daemon-new");
  RendezvousPlacement after(ids);
  size_t moved = 0;
  for (auto& k : keys(total, 3)) {
    auto o1 = before.owner(k), o2 = after.owner(k);
    if (o1 != o2) {
      ++moved;
      EXPECT_EQ(o2, "daemon-new");  // a key only ever moves to the member that joined
    }
  }
  const double frac = double(moved) / total;  // expected 1/(n+1)
  EXPECT_NEAR(frac, 1.0 / (n + 1), 0.02) << "moved " << moved;
}

TEST(Placement, LeaveMovesOnlyTheLeaversKeys) {
  const size_t n = 6, total = 50000;
  auto ids = names(n);
  RendezvousPlacement before(ids);
  const std::string gone = ids[2];
  ids.erase(ids.begin() + 2);
  RendezvousPlacement after(ids);
  size_t moved = 0;
  for (auto& k : keys(total, 4)) {
    auto o1 = before.owner(k), o2 = after.owner(k);
    if (o1 != o2) {
      ++moved;
      EXPECT_EQ(o1, gone);  // only the leaver's keys move
    } else {
      EXPECT_NE(o1, gone);
    }
  }
  EXPECT_NEAR(double(moved) / total, 1.0 / n, 0.02);
}

TEST(Placement, ReplicasAreDistinctAndStable) {
  auto ids = names(5);
  RendezvousPlacement p(ids);
  ids.push_back("daemon-x");
  RendezvousPlacement q(ids);
  size_t changed_sets = 0;
  const size_t total = 20000;
  for (auto& k : keys(total, 5)) {
    auto r = p.owners(k, 2);
    ASSERT_EQ(r.size(), 2u);
    EXPECT_NE(r[0], r[1]);
    EXPECT_EQ(p.ids()[r[0]], p.owner(k));  // the first replica is the owner
    std::set<std::string> s1{p.ids()[r[0]], p.ids()[r[1]]};
    auto r2 = q.owners(k, 2);
    std::set<std::string> s2{q.ids()[r2[0]], q.ids()[r2[1]]};
    if (s1 != s2) {
      ++changed_sets;
      EXPECT_TRUE(s2.count("daemon-x"));  // a replica set changes only by taking in the new member
    }
  }
  // The new member enters a key's top 2 of 6 with probability 2/6.
  EXPECT_NEAR(double(changed_sets) / total, 2.0 / 6, 0.02);
}

TEST(Placement, IncarnationDoesNotMatter) {
  // The seed depends on the id only: a restarted member keeps its keys.
  EXPECT_EQ(member_seed("daemon-1"), member_seed(std::string("daemon-") + "1"));
  EXPECT_NE(member_seed("daemon-1"), member_seed("daemon-2"));
}

TEST(MemberRecordJson, RoundTripAndRejects) {
  MemberRecord m{"d1", 0xfedcba9876543210ull, "10.0.0.1:7000", uint64_t{64} << 30, 4096, {"bf16", "mla_fp8_656"}};
  auto back = MemberRecord::from_json(m.to_json());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);  // 64-bit values survive (carried as strings)
  EXPECT_EQ(MemberRecord::from_json("{").status().code(), ErrorCode::kProtocol);
  EXPECT_EQ(MemberRecord::from_json("[1]").status().code(), ErrorCode::kProtocol);
  EXPECT_EQ(MemberRecord::from_json(R"({"address":"x"})").status().code(), ErrorCode::kProtocol);
}

TEST(StaticMembership, EveryPeerIsLive) {
  auto m = make_static_membership({"self", 1, "127.0.0.1:1", 0, 0, {}},
                                  {{"p1", 0, "127.0.0.1:2", 0, 0, {}}, {"p2", 0, "127.0.0.1:3", 0, 0, {}}});
  ASSERT_TRUE(m.ok());
  int joined = 0;
  (*m)->set_listener([&](const MembershipEvent& ev) { joined += ev.type == MembershipEventType::kJoined; });
  ASSERT_TRUE((*m)->start().ok());
  EXPECT_EQ(joined, 3);
  auto v = (*m)->members();
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].id, "p1");  // sorted by id
  EXPECT_TRUE((*m)->health().ok());
  EXPECT_TRUE((*m)->wait_until([](auto& v) { return v.size() == 3; }, std::chrono::milliseconds(10)));
  EXPECT_FALSE((*m)->wait_until([](auto& v) { return v.size() == 4; }, std::chrono::milliseconds(10)));
  (*m)->stop();
}

TEST(StaticMembership, RejectsDuplicates) {
  EXPECT_FALSE(make_static_membership({"a", 0, "", 0, 0, {}}, {{"a", 0, "", 0, 0, {}}}).ok());
  EXPECT_FALSE(make_static_membership({"", 0, "", 0, 0, {}}, {}).ok());
}

}  // namespace
}  // namespace kvferry::store
