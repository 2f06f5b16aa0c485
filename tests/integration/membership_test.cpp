// Membership in a real etcd (Debian's etcd-server), started by the test on free loopback ports with
// its data in a temporary directory: members join and see each other; a member killed with -9 is
// seen to leave within 2 x TTL and rejoins with a new incarnation; a clean stop revokes at once;
// etcd going away is reported (and a restarted etcd is rejoined), never a hang. Every wait is bounded.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "etcd_harness.h"
#include "kvferry/store/membership.h"

namespace kvferry::store {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using testing::etcd::Etcd;
using testing::etcd::find_etcd;
using testing::etcd::free_port;
using testing::etcd::http_get;
using testing::etcd::wait_pid;

MemberRecord record(const std::string& id) {
  MemberRecord m;
  m.id = id;
  m.address = "127.0.0.1:" + std::to_string(13000 + id.size());
  m.pool_bytes = uint64_t{1} << 30;
  m.slot_align = 4096;
  m.formats = {"mla_fp8_656", "bf16"};
  return m;
}

EtcdMembershipOptions options(const Etcd& e, std::chrono::seconds ttl) {
  EtcdMembershipOptions o;
  o.endpoint = e.url();
  o.prefix = "/kvferry-test/members/";
  o.ttl = ttl;
  o.request_timeout = 1000ms;
  o.retry_interval = 200ms;
  o.log = [](const std::string&) {};
  return o;
}

std::unique_ptr<Membership> member(const Etcd& e, const std::string& id, std::chrono::seconds ttl,
                                   uint64_t incarnation = 0) {
  MemberRecord r = record(id);
  r.incarnation = incarnation;
  auto m = make_etcd_membership(options(e, ttl), r);
  if (!m.ok()) ADD_FAILURE() << m.status().to_string();
  return m.ok() ? std::move(*m) : nullptr;
}

auto has_n(size_t n) {
  return [n](const std::vector<MemberRecord>& v) { return v.size() == n; };
}
auto has_id(const std::string& id, bool present = true) {
  return [id, present](const std::vector<MemberRecord>& v) {
    bool found = std::any_of(v.begin(), v.end(), [&](auto& m) { return m.id == id; });
    return found == present;
  };
}

class MembershipEtcd : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = find_etcd();
    if (bin_.empty()) GTEST_SKIP() << "no etcd binary (Debian package etcd-server): membership tests need a real etcd";
    etcd_ = std::make_unique<Etcd>();
    ASSERT_TRUE(etcd_->start(bin_)) << "etcd did not come up; see " << etcd_->log();
  }
  std::string bin_;
  std::unique_ptr<Etcd> etcd_;
};

/// A member in a child process: joins, writes its incarnation to `fd`, then waits to be killed.
pid_t member_child(const Etcd& e, const std::string& id, std::chrono::seconds ttl, int fd) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    auto m = make_etcd_membership(options(e, ttl), record(id));
    if (!m.ok() || !(*m)->start().ok()) ::_exit(3);
    uint64_t inc = (*m)->self().incarnation;
    if (::write(fd, &inc, sizeof inc) != sizeof inc) ::_exit(4);
    for (int i = 0; i < 600; ++i) ::sleep(1);  // bounded: the test kills it long before
    ::_exit(0);
  }
  return pid;
}

uint64_t read_u64(int fd, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  ::fcntl(fd, F_SETFL, O_NONBLOCK);
  uint64_t v = 0;
  while (Clock::now() < end) {
    if (::read(fd, &v, sizeof v) == sizeof v) return v;
    std::this_thread::sleep_for(5ms);
  }
  return 0;
}

TEST_F(MembershipEtcd, ThreeMembersSeeEachOther) {
  auto a = member(*etcd_, "a", 2s), b = member(*etcd_, "b", 2s), c = member(*etcd_, "c", 2s);
  ASSERT_TRUE(a && b && c);
  std::atomic<int> joined{0};
  a->set_listener([&](const MembershipEvent& ev) {
    if (ev.type == MembershipEventType::kJoined) ++joined;
  });
  for (auto* m : {a.get(), b.get(), c.get()}) ASSERT_TRUE(m->start().ok());
  for (auto* m : {a.get(), b.get(), c.get()}) {
    ASSERT_TRUE(m->wait_until(has_n(3), 5s)) << m->self().id << " sees " << m->members().size();
    EXPECT_TRUE(m->health().ok());
  }
  EXPECT_EQ(joined.load(), 3);  // self, then b and c through the watch (or the first read)
  auto seen = a->members();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[1].id, "b");
  EXPECT_EQ(seen[1], b->self());  // the whole record crosses etcd intact
  EXPECT_NE(seen[1].incarnation, 0u);
}

TEST_F(MembershipEtcd, KilledMemberLeavesWithinTwoTtlAndRejoinsWithNewIncarnation) {
  constexpr auto kTtl = 2s;
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  // The child first, while this process has no membership threads of its own yet.
  pid_t child = member_child(*etcd_, "victim", kTtl, p[1]);
  const uint64_t inc1 = read_u64(p[0], 10s);
  ASSERT_NE(inc1, 0u) << "child did not join";

  // Declared before the members: a member's watch thread may still call the listener until the
  // member is destroyed, so what the listener touches must outlive it.
  std::mutex mu;
  std::vector<MembershipEvent> events;
  auto a = member(*etcd_, "a", kTtl), b = member(*etcd_, "b", kTtl);
  a->set_listener([&](const MembershipEvent& ev) {
    std::lock_guard lk(mu);
    events.push_back(ev);
  });
  ASSERT_TRUE(a->start().ok());
  ASSERT_TRUE(b->start().ok());
  ASSERT_TRUE(a->wait_until(has_n(3), 5s));
  ASSERT_TRUE(b->wait_until(has_n(3), 5s));

  ::kill(child, SIGKILL);
  ASSERT_NE(wait_pid(child, 5s), -1);
  const auto t0 = Clock::now();
  ASSERT_TRUE(a->wait_until(has_id("victim", false), 2 * kTtl + 1s));
  ASSERT_TRUE(b->wait_until(has_id("victim", false), 2 * kTtl + 1s));
  const auto gone_after = Clock::now() - t0;
  EXPECT_LE(gone_after, 2 * kTtl) << "seen leaving after "
                                  << std::chrono::duration_cast<std::chrono::milliseconds>(gone_after).count() << " ms";
  // The listener hears of it too (just after the view changed).
  auto left_event = [&] {
    std::lock_guard lk(mu);
    return std::any_of(events.begin(), events.end(), [](auto& ev) {
      return ev.type == MembershipEventType::kLeft && ev.member.id == "victim" && ev.member.incarnation != 0;
    });
  };
  for (int i = 0; i < 200 && !left_event(); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(left_event());

  // It comes back as a new process: a new incarnation under the same id.
  child = member_child(*etcd_, "victim", kTtl, p[1]);
  const uint64_t inc2 = read_u64(p[0], 10s);
  ASSERT_NE(inc2, 0u);
  EXPECT_GT(inc2, inc1);
  ASSERT_TRUE(a->wait_until(
      [&](const std::vector<MemberRecord>& v) {
        return std::any_of(v.begin(), v.end(), [&](auto& m) { return m.id == "victim" && m.incarnation == inc2; });
      },
      5s));
  ::kill(child, SIGKILL);
  wait_pid(child, 5s);
  ::close(p[0]);
  ::close(p[1]);
}

TEST_F(MembershipEtcd, CleanStopRevokesAtOnce) {
  constexpr auto kTtl = 10s;  // far longer than the wait below: only a revocation explains it
  auto a = member(*etcd_, "a", kTtl), b = member(*etcd_, "b", kTtl);
  ASSERT_TRUE(a->start().ok());
  ASSERT_TRUE(b->start().ok());
  ASSERT_TRUE(a->wait_until(has_n(2), 5s));
  const auto t0 = Clock::now();
  b->stop();
  EXPECT_LT(Clock::now() - t0, 2s);  // stop itself is bounded
  ASSERT_TRUE(a->wait_until(has_id("b", false), 1500ms));
  EXPECT_FALSE(b->health().ok());
  b->stop();  // idempotent
}

TEST_F(MembershipEtcd, EtcdGoingAwayIsReportedAndRejoined) {
  constexpr auto kTtl = 2s;
  std::mutex mu;  // outlives the member (its watch thread calls the listener)
  std::vector<MembershipEventType> types;
  auto a = member(*etcd_, "a", kTtl);
  a->set_listener([&](const MembershipEvent& ev) {
    std::lock_guard lk(mu);
    types.push_back(ev.type);
  });
  ASSERT_TRUE(a->start().ok());
  ASSERT_TRUE(a->wait_until(has_n(1), 5s));

  etcd_->kill(SIGKILL);
  const auto t0 = Clock::now();
  // health() turning bad wakes wait_until too.
  a->wait_until([&](const std::vector<MemberRecord>&) { return !a->health().ok(); }, 2 * kTtl);
  EXPECT_FALSE(a->health().ok());
  EXPECT_LE(Clock::now() - t0, 2 * kTtl);
  EXPECT_EQ(a->health().code(), ErrorCode::kUnavailable) << a->health().to_string();
  {
    std::lock_guard lk(mu);
    EXPECT_TRUE(std::find(types.begin(), types.end(), MembershipEventType::kLost) != types.end());
  }

  // The same etcd (same data, same ports) comes back: the member rejoins on its own.
  ASSERT_TRUE(etcd_->start(bin_)) << "etcd did not restart; see " << etcd_->log();
  a->wait_until([&](const std::vector<MemberRecord>&) { return a->health().ok(); }, 10s);
  EXPECT_TRUE(a->health().ok()) << a->health().to_string();
  {
    std::lock_guard lk(mu);
    EXPECT_TRUE(std::find(types.begin(), types.end(), MembershipEventType::kRestored) != types.end());
  }
  EXPECT_TRUE(a->wait_until(has_id("a"), 5s));

  // And a stop while etcd is gone returns promptly.
  etcd_->kill(SIGKILL);
  const auto t1 = Clock::now();
  a->stop();
  EXPECT_LT(Clock::now() - t1, 3s);
}

TEST(MembershipEtcdUnreachable, StartFailsPromptly) {
  EtcdMembershipOptions o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(free_port());  // nobody listens there
  o.request_timeout = 500ms;
  auto m = make_etcd_membership(o, record("lonely"));
  ASSERT_TRUE(m.ok());
  const auto t0 = Clock::now();
  Status s = (*m)->start();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
  EXPECT_LT(Clock::now() - t0, 2s);
}

TEST(MembershipEtcdOptions, RejectsBadInput) {
  EtcdMembershipOptions o;
  EXPECT_FALSE(make_etcd_membership(o, record("has/slash")).ok());
  o.endpoint = "https://127.0.0.1:2379";
  EXPECT_EQ(make_etcd_membership(o, record("x")).status().code(), ErrorCode::kUnsupported);
  o.endpoint = "127.0.0.1";
  EXPECT_EQ(make_etcd_membership(o, record("x")).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::store
