// kvferryd end to end: the daemon runs in its own process (CPU backend), clients run in this
// process and in forked children. Every wait is bounded.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/kvferry.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry {
namespace {

using testing::DaemonProcess;
using testing::run_in_child;
using testing::wait_until;
using namespace std::chrono_literals;

const char* kRegions = R"(regions:
  - name: bm
    layers: 5
    blocks: 6
    block_size: 16
    format: mla_fp8_ds
    layout: block_major
  - name: lm
    layers: 5
    blocks: 6
    block_size: 16
    format: mla_fp8_ds
    layout: layer_major
  - name: kv
    layers: 3
    blocks: 4
    block_size: 8
    format: mha:bf16:2x64:hnd
    layout: block_major
limits:
  ring_entries: 64
)";

std::unique_ptr<Client> connect_to(const DaemonProcess& d, const std::string& name = "test") {
  Client::Options o;
  o.socket = d.socket();
  o.name = name;
  auto c = Client::connect(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(*c) : nullptr;
}

uint8_t pattern(uint64_t seed, int64_t b, int64_t t, int64_t e) {
  uint64_t x = seed ^ (static_cast<uint64_t>(b) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(t) << 20) ^
               static_cast<uint64_t>(e) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>((x * 0x94D049BB133111EBull) >> 56) | 1;  // never 0
}

/// Pings through the ring and checks the echo.
void expect_pings(Client& c, int n) {
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(c.ping(1000 + i, 7 * i + 3).ok());
    ring::CompletionEntry ce[1];
    auto r = c.wait(ce, 2'000'000);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_EQ(*r, 1u);
    EXPECT_EQ(ce[0].id, static_cast<uint64_t>(1000 + i));
    EXPECT_EQ(ce[0].status, 0);
    EXPECT_EQ(ce[0].result[0], static_cast<uint64_t>(7 * i + 3));
  }
}

class DaemonIt : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = std::make_unique<DaemonProcess>(kRegions);
    ASSERT_TRUE(d_->ready()) << "kvferryd did not start:\n" << d_->log();
  }
  void TearDown() override {
    if (!d_) return;
    int st = d_->stop();
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "kvferryd did not drain and exit 0 on SIGTERM:\n"
                                                       << d_->log();
  }
  std::unique_ptr<DaemonProcess> d_;
};

class RoundTrip : public DaemonIt, public ::testing::WithParamInterface<std::string> {};

// A child process writes one layer through its view; this process reads the region back through
// the daemon's own mapping, byte for byte (other layers stay zero).
TEST_P(RoundTrip, WriteThroughLayerViewReadBackThroughDaemon) {
  const std::string name = GetParam();
  const uint64_t seed = 0x5eed;
  for (int64_t layer : {int64_t{0}, int64_t{2}, int64_t{4}}) {
    int rc = run_in_child([&] {
      auto c = connect_to(*d_, "writer");
      if (!c) return 10;
      auto id = c->find_region(name);
      if (!id.ok() || !c->map_region(*id).ok()) return 11;
      auto v = c->layer_view(*id, layer);
      if (!v.ok() || v->on_device) return 12;
      auto* base = static_cast<uint8_t*>(v->data);
      const TensorView& tv = v->view;
      for (int64_t b = 0; b < tv.size(0); ++b)
        for (int64_t t = 0; t < tv.size(1); ++t)
          for (int64_t e = 0; e < tv.size(2); ++e)
            base[(b * tv.stride(0) + t * tv.stride(1) + e * tv.stride(2)) * tv.elem_bytes()] =
                pattern(seed + static_cast<uint64_t>(layer), b, t, e);
      return 0;
    });
    ASSERT_EQ(rc, 0) << "writer child failed for layer " << layer;
  }
  auto c = connect_to(*d_, "reader");
  ASSERT_TRUE(c);
  auto id = c->find_region(name);
  ASSERT_TRUE(id.ok());
  const proto::RegionDesc desc = [&] {
    for (auto& r : c->regions())
      if (r.id == *id) return r;
    return proto::RegionDesc{};
  }();
  std::vector<uint8_t> all;
  for (uint64_t off = 0; off < desc.bytes; off += proto::kMaxDebugRead) {
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(proto::kMaxDebugRead, desc.bytes - off));
    auto r = c->debug_read(*id, off, n);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    all.insert(all.end(), r->begin(), r->end());
  }
  ASSERT_EQ(all.size(), desc.bytes);
  std::vector<uint8_t> want(desc.bytes, 0);
  const KvCacheSpec& s = desc.spec;
  for (int64_t layer : {int64_t{0}, int64_t{2}, int64_t{4}})
    for (int64_t b = 0; b < s.blocks; ++b)
      for (int64_t t = 0; t < s.block_size; ++t)
        for (int64_t e = 0; e < s.format.bytes_per_token(); ++e)
          want[static_cast<size_t>(s.page_offset(layer, b) + t * s.format.bytes_per_token() + e)] =
              pattern(seed + static_cast<uint64_t>(layer), b, t, e);
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += all[i] != want[i];
  EXPECT_EQ(bad, 0u) << "bytes that differ between the writer's view and the daemon's mapping";
  // This process maps it too and sees the same bytes.
  auto base = c->map_region(*id);
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(0, std::memcmp(*base, want.data(), want.size()));
}

INSTANTIATE_TEST_SUITE_P(Layouts, RoundTrip, ::testing::Values("bm", "lm"));

TEST_F(DaemonIt, MhaViewsAddressBothPlanes) {
  auto c = connect_to(*d_);
  ASSERT_TRUE(c);
  auto id = c->find_region("kv");
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(c->map_region(*id).ok());
  auto k = c->kv_view(*id, 1, false);
  auto v = c->kv_view(*id, 1, true);
  ASSERT_TRUE(k.ok() && v.ok());
  EXPECT_EQ(v->view.offset - k->view.offset, 8 * 2 * 64 * 2);  // one plane: BS x H x D x 2 B
  EXPECT_EQ(k->view.stride(0), 3 * 2 * 8 * 2 * 64);            // L x page, in bf16 elements
  EXPECT_EQ(c->layer_view(*id, 3).status().code(), ErrorCode::kOutOfRange);
  auto bm = c->find_region("bm");
  ASSERT_TRUE(bm.ok());
  EXPECT_EQ(c->layer_view(*bm, 0).status().code(), ErrorCode::kNotFound) << "not mapped yet";
}

TEST_F(DaemonIt, PingOverTheRingsAndReservedOps) {
  auto c = connect_to(*d_);
  ASSERT_TRUE(c);
  expect_pings(*c, 2000);
  ring::SubmitEntry e{};
  e.id = 1;
  e.op = static_cast<uint16_t>(proto::Op::kCorruptForTest);  // served only with --enable-test-faults
  ASSERT_TRUE(c->submit(e).ok());
  e.id = 2;
  e.op = 63;
  ASSERT_TRUE(c->submit(e).ok());
  e.id = 3;
  e.op = 0xffff;
  ASSERT_TRUE(c->submit(e).ok());
  ring::CompletionEntry ce[3];
  size_t got = 0;
  ASSERT_TRUE(wait_until(
      [&] {
        got += c->poll(std::span(ce).subspan(got));
        return got == 3;
      },
      5s));
  EXPECT_EQ(ce[0].status, static_cast<int16_t>(ErrorCode::kUnsupported)) << "fault knob without --enable-test-faults";
  EXPECT_EQ(ce[1].status, static_cast<int16_t>(ErrorCode::kInvalidArgument)) << "unknown op";
  EXPECT_EQ(ce[2].status, static_cast<int16_t>(ErrorCode::kInvalidArgument)) << "op past the table";
}

// A ring full of requests: submit() reports kBusy, nothing is lost, order is kept.
TEST_F(DaemonIt, FullRingIsBackpressureNotLoss) {
  auto c = connect_to(*d_);
  ASSERT_TRUE(c);
  const uint32_t n = c->ring_entries();
  ASSERT_EQ(n, 64u);
  uint64_t submitted = 0;
  bool busy = false;
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (!busy && std::chrono::steady_clock::now() < end) {
    Status st = c->ping(submitted, submitted * 11);
    if (st.code() == ErrorCode::kBusy) {
      busy = true;
      EXPECT_NE(st.message().find("full"), std::string::npos);
    } else {
      ASSERT_TRUE(st.ok()) << st.to_string();
      ++submitted;
    }
  }
  ASSERT_TRUE(busy) << "never saw backpressure";
  EXPECT_GE(submitted, n) << "the submission ring alone holds " << n;
  EXPECT_LE(submitted, 2u * n) << "submission + completion rings hold at most " << 2 * n;
  std::vector<ring::CompletionEntry> got;
  ring::CompletionEntry buf[16];
  ASSERT_TRUE(wait_until(
      [&] {
        size_t k = c->poll(buf);
        got.insert(got.end(), buf, buf + k);
        return got.size() >= submitted;
      },
      5s))
      << got.size() << " of " << submitted;
  ASSERT_EQ(got.size(), submitted);
  for (uint64_t i = 0; i < submitted; ++i) {
    EXPECT_EQ(got[i].id, i);
    EXPECT_EQ(got[i].result[0], i * 11);
  }
  expect_pings(*c, 10);
}

// Each bad input gets an error frame or a disconnect; a client connected all along and a new
// client keep working.
TEST_F(DaemonIt, BadInputDoesNotDisturbOtherClients) {
  auto good = connect_to(*d_, "bystander");
  ASSERT_TRUE(good);
  proto::Frame hello = proto::encode(proto::Hello{"bad", 1});
  auto with = [&](auto mutate) {
    proto::Frame f = hello;
    mutate(f);
    return f;
  };
  struct Case {
    const char* name;
    proto::Frame bytes;
    bool close_after;
  };
  std::mt19937 rng(7);
  proto::Frame garbage(4096);
  for (auto& b : garbage) b = static_cast<uint8_t>(rng());
  std::vector<Case> cases = {
      {"garbage", garbage, false},
      {"truncated header then close", proto::Frame(hello.begin(), hello.begin() + 9), true},
      {"truncated payload then close", proto::Frame(hello.begin(), hello.end() - 3), true},
      {"4 GiB length", with([](proto::Frame& f) { f[8] = f[9] = f[10] = f[11] = 0xff; }), false},
      {"unknown type", with([](proto::Frame& f) { f[6] = 0x77; }), false},
      {"wrong version", with([](proto::Frame& f) { f[4] = 9; }), false},
      {"wrong magic", with([](proto::Frame& f) { f[0] = 'X'; }), false},
      {"map before hello", proto::encode(proto::MapRegion{1}), false},
      {"bad spec",
       proto::encode(proto::CreateRegion{"x", KvCacheSpec{0, 1, 1, EntryFormat::mla_fp8(), Layout::kBlockMajor}}),
       false},
  };
  for (auto& cs : cases) {
    SCOPED_TRACE(cs.name);
    int fd = testing::connect_raw(d_->socket());
    ASSERT_GE(fd, 0);
    UniqueFd s(fd);
    ASSERT_EQ(::send(fd, cs.bytes.data(), cs.bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(cs.bytes.size()));
    if (cs.close_after) ::shutdown(fd, SHUT_WR);
    // The daemon answers with an Error frame (then closes) or just closes.
    auto r = proto::recv_frame(fd, 5000);
    if (r.ok()) {
      EXPECT_EQ(r->header.type, static_cast<uint16_t>(proto::MsgType::kError));
      auto e = proto::decode_error(r->payload, r->header.field_mask);
      ASSERT_TRUE(e.ok());
      EXPECT_FALSE(e->message.empty());
      EXPECT_TRUE(e->code == ErrorCode::kProtocol || e->code == ErrorCode::kVersionMismatch) << e->message;
      uint8_t b;
      pollfd pf{fd, POLLIN, 0};
      ASSERT_EQ(::poll(&pf, 1, 5000), 1) << "no disconnect within 5 s";
      EXPECT_LE(::recv(fd, &b, 1, 0), 0) << "the daemon must disconnect after a protocol error (EOF or reset)";
    } else {
      EXPECT_NE(r.status().code(), ErrorCode::kTimeout) << "no answer within 5 s";
    }
    expect_pings(*good, 5);
  }
  // A client that stalls mid-frame does not hold up anyone.
  int stall = testing::connect_raw(d_->socket());
  ASSERT_EQ(::send(stall, hello.data(), 5, MSG_NOSIGNAL), 5);
  auto fresh = connect_to(*d_, "fresh");
  ASSERT_TRUE(fresh);
  expect_pings(*fresh, 5);
  ::close(stall);
  auto st = good->status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->clients.size(), 2u);
}

// A client SIGKILLed mid-request releases its rings and its regions (a region another client
// holds stays); a reconnecting client works.
TEST_F(DaemonIt, KilledClientReleasesItsResources) {
  auto me = connect_to(*d_, "survivor");
  ASSERT_TRUE(me);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(pipefd[0]);
    Client::Options o;
    o.socket = d_->socket();
    o.name = "victim";
    auto c = Client::connect(o);
    if (!c.ok()) ::_exit(1);
    KvCacheSpec s{2, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
    auto only = (*c)->create_region("victim-only", s);
    auto shared = (*c)->create_region("shared", s);
    if (!only.ok() || !shared.ok()) ::_exit(2);
    for (uint64_t i = 0; i < 40; ++i) (void)(*c)->ping(i, i);  // left unreaped: in flight
    char ok = 'k';
    if (::write(pipefd[1], &ok, 1) != 1) ::_exit(3);
    ::pause();
    ::_exit(0);
  }
  ::close(pipefd[1]);
  char ok = 0;
  ASSERT_EQ(::read(pipefd[0], &ok, 1), 1);
  ::close(pipefd[0]);
  auto shared_id = me->create_region("shared", KvCacheSpec{2, 4, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  ASSERT_TRUE(shared_id.ok()) << shared_id.status().to_string();
  auto before = me->status();
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->clients.size(), 2u);
  EXPECT_EQ(before->regions.size(), 5u);
  ::kill(child, SIGKILL);
  ASSERT_NE(testing::wait_pid(child, 5s), -1);
  proto::StatusReply after;
  ASSERT_TRUE(wait_until(
      [&] {
        auto s = me->status();
        if (!s.ok()) return false;
        after = *s;
        return after.clients.size() == 1;
      },
      5s))
      << "the killed client is still listed";
  std::vector<std::string> names;
  for (auto& r : after.regions) {
    names.push_back(r.desc.name);
    if (r.desc.name == "shared") {
      EXPECT_EQ(r.holders, 1u);
    }
  }
  EXPECT_EQ(after.regions.size(), 4u);
  EXPECT_EQ(std::count(names.begin(), names.end(), "victim-only"), 0) << "its own region is released";
  EXPECT_EQ(std::count(names.begin(), names.end(), "shared"), 1) << "a region another client holds stays";
  auto again = connect_to(*d_, "victim-again");
  ASSERT_TRUE(again);
  expect_pings(*again, 10);
  expect_pings(*me, 10);
}

// An engine registers a buffer it allocated (a sealed memfd): the daemon reads what the engine
// wrote, another process maps it by name, and it goes away with its last holder.
// A KV tensor inside a larger allocation registers at its offset, with no copy: saves and loads
// touch only the region's bytes (the bytes before it in the buffer stay), debug reads see the
// region, bad offsets are refused, and no other client maps it (its descriptor names the buffer).
TEST_F(DaemonIt, RegisteredBufferAtAnOffset) {
  const KvCacheSpec spec{2, 4, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  const uint64_t bytes = static_cast<uint64_t>(spec.region_bytes());
  const uint64_t offset = 3 * 4096 + 16;  // a multiple of the format's 16-byte alignment
  const uint64_t alloc = (offset + bytes + 4095) / 4096 * 4096;
  int fd = ::memfd_create("engine-kv-big", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  UniqueFd mfd(fd);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(alloc)), 0);
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  void* base = ::mmap(nullptr, alloc, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(base, MAP_FAILED);
  auto* all = static_cast<uint8_t*>(base);
  std::memset(all, 0xAB, alloc);
  auto c = connect_to(*d_, "offset-owner");
  ASSERT_TRUE(c);
  Client::OwnBuffer buf;
  buf.fd = fd;
  buf.base = base;
  buf.alloc_bytes = alloc;
  buf.offset = offset + 8;  // not aligned
  EXPECT_EQ(c->register_region("at-offset", spec, buf).status().code(), ErrorCode::kInvalidArgument);
  buf.offset = alloc - bytes + 16;  // past the end
  EXPECT_EQ(c->register_region("at-offset", spec, buf).status().code(), ErrorCode::kInvalidArgument);
  buf.offset = offset;
  auto id = c->register_region("at-offset", spec, buf);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto v = c->layer_view(*id, 0);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->data, all + offset);
  uint8_t* region = all + offset;
  for (uint64_t i = 0; i < bytes; ++i) region[i] = static_cast<uint8_t>(i * 7 + 1);
  auto back = c->debug_read(*id, 100, 64);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(0, std::memcmp(back->data(), region + 100, 64));
  const std::vector<ops::Key> keys{{0x0FF5, 1}, {0x0FF5, 2}};
  auto sv = c->save(*id, keys, std::vector<int64_t>{0, 1});
  ASSERT_TRUE(sv.ok());
  ASSERT_EQ(sv->done, 2u);
  const std::vector<uint8_t> saved(region, region + bytes);
  std::memset(region, 0, bytes);
  auto ld = c->load(*id, keys, std::vector<int64_t>{3, 2});
  ASSERT_TRUE(ld.ok());
  ASSERT_EQ(ld->done, 2u);
  const int64_t bb = spec.block_bytes();
  EXPECT_EQ(0, std::memcmp(region + 3 * bb, saved.data(), static_cast<size_t>(bb)));
  EXPECT_EQ(0, std::memcmp(region + 2 * bb, saved.data() + bb, static_cast<size_t>(bb)));
  for (uint64_t i = 0; i < offset; ++i) ASSERT_EQ(all[i], 0xAB) << "byte " << i << " before the region";
  for (uint64_t i = offset + bytes; i < alloc; ++i) ASSERT_EQ(all[i], 0xAB) << "byte " << i << " after the region";
  // Another client cannot map it: what it would map is the whole buffer.
  auto o = connect_to(*d_, "offset-peer");
  ASSERT_TRUE(o);
  auto m = o->map_region(*id);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("offset"), std::string::npos) << m.status().to_string();
  c.reset();
  ::munmap(base, alloc);
}

TEST_F(DaemonIt, EngineRegisteredBufferIsSharedAndReleased) {
  const KvCacheSpec spec{3, 5, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  const uint64_t bytes = static_cast<uint64_t>(spec.region_bytes());
  const uint64_t alloc = (bytes + 4095) / 4096 * 4096;
  auto make_memfd = [&](bool seal) {
    int fd = ::memfd_create("engine-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(alloc)), 0);
    if (seal) {
      EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    }
    return UniqueFd(fd);
  };
  auto c = connect_to(*d_, "registrant");
  ASSERT_TRUE(c);
  UniqueFd fd = make_memfd(true);
  void* base = ::mmap(nullptr, alloc, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  ASSERT_NE(base, MAP_FAILED);
  Client::OwnBuffer buf;
  buf.fd = fd.get();
  buf.base = base;
  buf.alloc_bytes = alloc;
  auto id = c->register_region("engine-own", spec, buf);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto v = c->layer_view(*id, 2);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->data, static_cast<uint8_t*>(base) + spec.page_offset(2, 0));
  auto* p = static_cast<uint8_t*>(v->data);
  for (int64_t b = 0; b < spec.blocks; ++b)
    for (int64_t i = 0; i < spec.page_bytes(); ++i) p[b * v->view.stride(0) + i] = pattern(99, b, 0, i);
  const uint64_t off = static_cast<uint64_t>(spec.page_offset(2, 4));
  auto back = c->debug_read(*id, off, static_cast<uint32_t>(spec.page_bytes()));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  for (int64_t i = 0; i < spec.page_bytes(); ++i) ASSERT_EQ((*back)[static_cast<size_t>(i)], pattern(99, 4, 0, i));
  // Another process maps it by name and sees the same bytes.
  int rc = run_in_child([&] {
    auto o = connect_to(*d_, "peer");
    if (!o) return 10;
    auto st = o->status();
    if (!st.ok()) return 11;
    uint32_t rid = 0;
    for (auto& r : st->regions)
      if (r.desc.name == "engine-own") rid = r.desc.id;
    auto m = o->map_region(rid);
    if (!m.ok()) return 12;
    return std::memcmp(static_cast<uint8_t*>(*m) + off, back->data(), back->size()) == 0 ? 0 : 13;
  });
  EXPECT_EQ(rc, 0) << "10 connect, 11 status, 12 map, 13 bytes differ";
  // Refusals: an unsealed memfd, a name in use, a missing fd.
  UniqueFd loose = make_memfd(false);
  void* lb = ::mmap(nullptr, alloc, PROT_READ | PROT_WRITE, MAP_SHARED, loose.get(), 0);
  Client::OwnBuffer lbuf = buf;
  lbuf.fd = loose.get();
  lbuf.base = lb;
  auto r1 = c->register_region("loose", spec, lbuf);
  EXPECT_EQ(r1.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r1.status().message().find("F_SEAL_SHRINK"), std::string::npos) << r1.status().message();
  EXPECT_EQ(c->register_region("engine-own", spec, buf).status().code(), ErrorCode::kAlreadyExists);
  ::munmap(lb, alloc);
  // The registrant leaves: the region goes with it (nobody else holds it now).
  c.reset();
  auto watcher = connect_to(*d_, "watcher");
  ASSERT_TRUE(wait_until(
      [&] {
        auto st = watcher->status();
        if (!st.ok()) return false;
        for (auto& r : st->regions)
          if (r.desc.name == "engine-own") return false;
        return true;
      },
      5s));
  ::munmap(base, alloc);
}

TEST_F(DaemonIt, DisallowedUidIsRefusedWithAClearMessage) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  const std::string sock = d_->socket();
  int rc = run_in_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 20;
    Client::Options o;
    o.socket = sock;
    auto c = Client::connect(o);
    if (c.ok()) return 21;
    if (c.status().code() != ErrorCode::kPermissionDenied) return 22;
    if (c.status().message().find("uid 65534") == std::string::npos) return 23;
    if (c.status().message().find("not allowed") == std::string::npos) return 24;
    return 0;
  });
  EXPECT_EQ(rc, 0) << "20: setuid failed, 21: accepted, 22: wrong code, 23/24: unclear message";
  expect_pings(*connect_to(*d_), 3);
}

TEST_F(DaemonIt, CAbiHasTheSameReach) {
  kvferry_client* c = nullptr;
  ASSERT_EQ(kvferry_connect(d_->socket().c_str(), "c-abi", &c), 0) << kvferry_last_error();
  uint32_t n = 0;
  ASSERT_EQ(kvferry_region_count(c, &n), 0);
  EXPECT_EQ(n, 3u);
  kvferry_region_info info;
  ASSERT_EQ(kvferry_get_region_info(c, 0, &info), 0);
  EXPECT_STREQ(info.name, "bm");
  EXPECT_EQ(kvferry_get_region_info(c, 99, &info), static_cast<int>(ErrorCode::kOutOfRange));
  EXPECT_NE(std::string(kvferry_last_error()).find("99"), std::string::npos);
  uint32_t id = 0;
  ASSERT_EQ(kvferry_create_region(c, "c-made", 2, 3, 16, "mla_bf16", 1, &id), 0) << kvferry_last_error();
  kvferry_view v;
  ASSERT_EQ(kvferry_layer_view(c, id, 1, &v), 0) << kvferry_last_error();
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.strides[0], 16 * 576);  // layer-major: one page per block step, in bf16 elements
  EXPECT_EQ(v.offset, 3 * 16 * 1152);
  auto* p = static_cast<uint8_t*>(v.data);
  for (int i = 0; i < 64; ++i) p[i] = static_cast<uint8_t>(i + 1);
  uint8_t back[64];
  ASSERT_EQ(kvferry_debug_read(c, id, static_cast<uint64_t>(v.offset), back, 64), 0) << kvferry_last_error();
  for (int i = 0; i < 64; ++i) EXPECT_EQ(back[i], i + 1);
  ASSERT_EQ(kvferry_ping(c, 5, 55), 0);
  kvferry_cqe ce[4];
  uint32_t got = 0;
  ASSERT_EQ(kvferry_wait(c, ce, 4, 2'000'000, &got), 0) << kvferry_last_error();
  ASSERT_EQ(got, 1u);
  EXPECT_EQ(ce[0].id, 5u);
  EXPECT_EQ(ce[0].result[0], 55u);
  EXPECT_EQ(kvferry_wait(c, ce, 4, 20'000, &got), KVFERRY_E_TIMEOUT);
  EXPECT_STREQ(kvferry_status_name(KVFERRY_E_TIMEOUT), "timeout");
  EXPECT_EQ(kvferry_create_region(c, "bad", 2, 3, 16, "mla_fp9", 0, &id),
            static_cast<int>(ErrorCode::kInvalidArgument));
  EXPECT_NE(std::string(kvferry_last_error()).find("mla_fp9"), std::string::npos);
  kvferry_close(c);
  kvferry_client* none = nullptr;
  EXPECT_EQ(kvferry_connect((d_->dir() + "/nope.sock").c_str(), "x", &none), static_cast<int>(ErrorCode::kUnavailable));
  EXPECT_NE(std::string(kvferry_last_error()).find("nope.sock"), std::string::npos);
}

TEST_F(DaemonIt, StatusCliPrintsRegionsAndClients) {
  auto c = connect_to(*d_, "cli-visible");
  ASSERT_TRUE(c);
  std::string cmd = std::string("KVFERRY_SOCKET=") + d_->socket() + " " + KVFERRY_CLI_PATH + " status --json";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[8192];
  size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  buf[n] = 0;
  EXPECT_EQ(::pclose(p), 0);
  std::string out(buf);
  EXPECT_NE(out.find("\"version\":\"0.1.0\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"name\":\"lm\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"name\":\"cli-visible\""), std::string::npos) << out;
  std::string plain = std::string(KVFERRY_CLI_PATH) + " --socket " + d_->socket() + " status > /dev/null";
  EXPECT_EQ(std::system(plain.c_str()), 0);
}

TEST_F(DaemonIt, SighupAppliesReloadableKeysAndNamesTheOthers) {
  d_->write_config(
      std::string(kRegions).replace(std::string(kRegions).find("ring_entries: 64"), 16, "ring_entries: 128"));
  ::kill(d_->pid(), SIGHUP);
  ASSERT_TRUE(wait_until([&] { return d_->log().find("limits.ring_entries") != std::string::npos; }, 5s)) << d_->log();
  EXPECT_NE(d_->log().find("needs a restart"), std::string::npos);
  auto c = connect_to(*d_);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->ring_entries(), 64u) << "a key that needs a restart keeps its running value";
}

TEST(DaemonCli, CheckConfigPrintsTheEffectiveConfig) {
  const std::string dir = testing::make_temp_dir();
  {
    std::ofstream f(dir + "/ok.yaml");
    f << "daemon:\n  socket: /tmp/x.sock\n";
    std::ofstream g(dir + "/bad.yaml");
    g << "device:\n  backend: tpu\n";
  }
  std::string ok = std::string(KVFERRYD_PATH) + " --check-config " + dir + "/ok.yaml > " + dir + "/out.txt 2>&1";
  EXPECT_EQ(std::system(ok.c_str()), 0);
  EXPECT_NE(testing::read_file(dir + "/out.txt").find("/tmp/x.sock"), std::string::npos);
  std::string bad = std::string(KVFERRYD_PATH) + " --check-config " + dir + "/bad.yaml > " + dir + "/err.txt 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
  EXPECT_NE(testing::read_file(dir + "/err.txt").find("device.backend"), std::string::npos);
  std::string ver = std::string(KVFERRYD_PATH) + " --version > " + dir + "/v.txt";
  EXPECT_EQ(std::system(ver.c_str()), 0);
  EXPECT_NE(testing::read_file(dir + "/v.txt").find("0.1.0"), std::string::npos);
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

TEST(DaemonNotify, ReadyWatchdogStoppingReachTheNotifySocket) {
#if !defined(KVFERRY_TEST_WITH_SYSTEMD)
  GTEST_SKIP() << "built without libsystemd (KVFERRY_WITH_SYSTEMD=OFF): kvferryd does not notify";
#else
  const std::string dir = testing::make_temp_dir();
  const std::string path = dir + "/notify.sock";
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  UniqueFd s(fd);
  std::string e1 = "NOTIFY_SOCKET=" + path, e2 = "WATCHDOG_USEC=200000";
  DaemonProcess d("", {e1, e2});
  ASSERT_TRUE(d.ready()) << d.log();
  std::string seen;
  auto read_until = [&](const std::string& what) {
    return wait_until(
        [&] {
          char buf[512];
          ssize_t n;
          while ((n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0)
            seen += std::string(buf, static_cast<size_t>(n)) + "\n";
          return seen.find(what) != std::string::npos;
        },
        5s);
  };
  EXPECT_TRUE(read_until("READY=1")) << seen;
  EXPECT_TRUE(read_until("WATCHDOG=1")) << seen;
  int st = d.stop();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  EXPECT_TRUE(read_until("STOPPING=1")) << seen;
  EXPECT_LT(seen.find("READY=1"), seen.find("STOPPING=1"));
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
#endif
}

}  // namespace
}  // namespace kvferry
