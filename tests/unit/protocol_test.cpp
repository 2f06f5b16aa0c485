// Wire protocol: round trips of every message, and the decoder's answers to bad input.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kvferry/connector/protocol.h"

namespace kvferry::proto {
namespace {

KvCacheSpec test_spec() { return KvCacheSpec{4, 16, 64, EntryFormat::mla_fp8_ds(), Layout::kBlockMajor}; }

RegionDesc test_region(uint32_t id) {
  RegionDesc d;
  d.id = id;
  d.name = "r" + std::to_string(id);
  d.spec = test_spec();
  d.bytes = static_cast<uint64_t>(d.spec.region_bytes());
  d.alloc_bytes = d.bytes + 4096;
  d.backend = Backend::kMemfd;
  return d;
}

DecodedFrame one_frame(const Frame& f) {
  auto r = decode_frame(f);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->second, f.size());
  return r->first;
}

TEST(Protocol, HeaderIsLittleEndianFixedWidth) {
  Header h;
  h.type = static_cast<uint16_t>(MsgType::kHello);
  h.length = 0x01020304;
  h.field_mask = 0xa0b0c0d0;
  uint8_t b[kHeaderBytes];
  encode_header(h, b);
  const uint8_t want[kHeaderBytes] = {'K', 'V', 'F', 'Y', 1, 0, 1, 0, 4, 3, 2, 1, 0xd0, 0xc0, 0xb0, 0xa0};
  EXPECT_EQ(0, std::memcmp(b, want, kHeaderBytes));
}

TEST(Protocol, HelloRoundTrip) {
  Hello m{"engine-7", 4242};
  auto f = one_frame(encode(m));
  EXPECT_EQ(f.header.type, static_cast<uint16_t>(MsgType::kHello));
  auto d = decode_hello(f.payload, f.header.field_mask);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->client_name, "engine-7");
  EXPECT_EQ(d->pid, 4242u);
  EXPECT_TRUE(d->peer_token.empty());
}

TEST(Protocol, HelloWithAPeerToken) {
  Hello m{"peer:b", 7, true, "m", "t", "0123456789abcdef0123456789abcdef"};
  auto f = one_frame(encode(m));
  EXPECT_EQ(f.header.field_mask, kFieldNamespace | kFieldPeerToken);
  auto d = decode_hello(f.payload, f.header.field_mask);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->tenant, "t");
  EXPECT_EQ(d->peer_token, m.peer_token);
  // Without the namespace, and a token longer than allowed is refused by name.
  Hello n{"peer:b", 7};
  n.peer_token = std::string(kMaxPeerToken + 1, 'x');
  auto g = one_frame(encode(n));
  auto e = decode_hello(g.payload, g.header.field_mask);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("peer_token"), std::string::npos) << e.status().to_string();
}

TEST(Protocol, WelcomeRoundTripWithRegions) {
  Welcome m;
  m.client_id = 9;
  m.ring_entries = 256;
  m.ring_bytes = 1 << 20;
  m.arena_bytes = 65536;
  m.spin_us = 50;
  m.regions = {test_region(1), test_region(2)};
  m.regions[1].spec.format = EntryFormat::mha(8, 128, DType::kBF16, MhaOrder::kHND);
  m.regions[1].spec.layout = Layout::kLayerMajor;
  m.regions[1].bytes = m.regions[1].alloc_bytes = static_cast<uint64_t>(m.regions[1].spec.region_bytes());
  auto f = one_frame(encode(m));
  auto d = decode_welcome(f.payload, f.header.field_mask);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->client_id, 9u);
  EXPECT_EQ(d->ring_entries, 256u);
  ASSERT_EQ(d->regions.size(), 2u);
  EXPECT_EQ(d->regions[0].name, "r1");
  EXPECT_EQ(d->regions[0].spec.format, EntryFormat::mla_fp8_ds());
  EXPECT_EQ(d->regions[0].alloc_bytes, m.regions[0].alloc_bytes);
  EXPECT_EQ(d->regions[1].spec.format, m.regions[1].spec.format);
  EXPECT_EQ(d->regions[1].spec.layout, Layout::kLayerMajor);
}

TEST(Protocol, RegionHandleOptionalFieldFollowsFieldMask) {
  RegionHandle m;
  m.region = test_region(3);
  auto plain = one_frame(encode(m));
  EXPECT_EQ(plain.header.field_mask, 0u);
  auto d0 = decode_region_handle(plain.payload, plain.header.field_mask);
  ASSERT_TRUE(d0.ok());
  EXPECT_FALSE(d0->has_ipc_handle);
  m.has_ipc_handle = true;
  for (int i = 0; i < 64; ++i) m.ipc_handle[i] = static_cast<uint8_t>(i * 7 + 1);
  auto withh = one_frame(encode(m));
  EXPECT_EQ(withh.header.field_mask, kFieldIpcHandle);
  auto d1 = decode_region_handle(withh.payload, withh.header.field_mask);
  ASSERT_TRUE(d1.ok());
  EXPECT_TRUE(d1->has_ipc_handle);
  EXPECT_EQ(0, std::memcmp(d1->ipc_handle, m.ipc_handle, 64));
  // The bit without the bytes is a truncated payload.
  auto d2 = decode_region_handle(plain.payload, kFieldIpcHandle);
  EXPECT_EQ(d2.status().code(), ErrorCode::kProtocol);
  // Unknown bits are ignored (forward compatibility).
  EXPECT_TRUE(decode_region_handle(plain.payload, 1u << 30).ok());
  // A region inside a larger buffer carries its offset (kFieldOffset), after the IPC handle.
  m.offset = 3 * 4096 + 256;
  auto off = one_frame(encode(m));
  EXPECT_EQ(off.header.field_mask, kFieldIpcHandle | kFieldOffset);
  auto d3 = decode_region_handle(off.payload, off.header.field_mask);
  ASSERT_TRUE(d3.ok()) << d3.status().to_string();
  EXPECT_EQ(d3->offset, m.offset);
  EXPECT_EQ(0, std::memcmp(d3->ipc_handle, m.ipc_handle, 64));
  EXPECT_EQ(decode_region_handle(withh.payload, kFieldIpcHandle | kFieldOffset).status().code(), ErrorCode::kProtocol);
}

TEST(Protocol, StatusReplyRoundTrip) {
  StatusReply m;
  m.version = "0.1.0";
  m.uptime_ms = 123456;
  m.pid = 77;
  m.backend = "cpu";
  m.regions.push_back({test_region(1), 2, true});
  m.clients.push_back({5, "eng", 100, 1000, 99});
  auto f = one_frame(encode(m));
  auto d = decode_status_reply(f.payload, 0);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->uptime_ms, 123456u);
  ASSERT_EQ(d->regions.size(), 1u);
  EXPECT_EQ(d->regions[0].holders, 2u);
  EXPECT_TRUE(d->regions[0].from_config);
  ASSERT_EQ(d->clients.size(), 1u);
  EXPECT_EQ(d->clients[0].name, "eng");
  EXPECT_EQ(d->clients[0].ops, 99u);
}

TEST(Protocol, ErrorDebugReadCreateRoundTrip) {
  auto e = one_frame(encode(ErrorMsg{ErrorCode::kPermissionDenied, "uid 5 is not allowed"}));
  auto de = decode_error(e.payload, 0);
  ASSERT_TRUE(de.ok());
  EXPECT_EQ(de->code, ErrorCode::kPermissionDenied);
  EXPECT_EQ(de->message, "uid 5 is not allowed");
  auto r = one_frame(encode(DebugRead{3, 1ull << 40, 4096}));
  auto dr = decode_debug_read(r.payload, 0);
  ASSERT_TRUE(dr.ok());
  EXPECT_EQ(dr->offset, 1ull << 40);
  auto c = one_frame(encode(CreateRegion{"mine", test_spec()}));
  auto dc = decode_create_region(c.payload, 0);
  ASSERT_TRUE(dc.ok());
  EXPECT_EQ(dc->spec.blocks, 16);
}

TEST(Protocol, WrongMagicIsRejected) {
  Frame f = encode(Hello{"x", 1});
  f[0] ^= 0xff;
  auto h = decode_header(std::span<const uint8_t>(f).first(kHeaderBytes));
  EXPECT_EQ(h.status().code(), ErrorCode::kProtocol);
  EXPECT_NE(h.status().message().find("magic"), std::string::npos);
}

TEST(Protocol, WrongVersionIsVersionMismatch) {
  Frame f = encode(Hello{"x", 1});
  f[4] = 2;
  auto h = decode_header(std::span<const uint8_t>(f).first(kHeaderBytes));
  EXPECT_EQ(h.status().code(), ErrorCode::kVersionMismatch);
  EXPECT_NE(h.status().message().find("version 2"), std::string::npos);
}

TEST(Protocol, UnknownTypeIsRejected) {
  for (uint16_t t : {uint16_t{0}, static_cast<uint16_t>(kMaxMsgType + 1), uint16_t{0xffff}}) {
    Frame f = encode(Hello{"x", 1});
    f[6] = static_cast<uint8_t>(t);
    f[7] = static_cast<uint8_t>(t >> 8);
    auto h = decode_header(std::span<const uint8_t>(f).first(kHeaderBytes));
    EXPECT_EQ(h.status().code(), ErrorCode::kProtocol) << t;
    EXPECT_NE(h.status().message().find("unknown message type"), std::string::npos);
  }
}

TEST(Protocol, FourGiBLengthIsRejectedBeforeAnyAllocation) {
  Frame f = encode(Hello{"x", 1});
  f[8] = f[9] = f[10] = f[11] = 0xff;  // 4 GiB - 1
  auto h = decode_header(std::span<const uint8_t>(f).first(kHeaderBytes));
  EXPECT_EQ(h.status().code(), ErrorCode::kProtocol);
  EXPECT_NE(h.status().message().find("exceeds the limit"), std::string::npos);
  EXPECT_FALSE(decode_frame(f).ok());
}

TEST(Protocol, TruncatedFramesNeedMoreOrFail) {
  Frame f = encode(Hello{"engine", 1});
  for (size_t n = 0; n < f.size(); ++n) {
    auto r = decode_frame(std::span<const uint8_t>(f).first(n));
    ASSERT_TRUE(r.ok()) << n;
    EXPECT_EQ(r->second, 0u) << "a partial frame of " << n << " bytes must ask for more";
  }
  EXPECT_EQ(decode_header(std::span<const uint8_t>(f).first(10)).status().code(), ErrorCode::kProtocol);
  // A payload cut short inside a field: the field is named.
  auto d = decode_hello(std::span<const uint8_t>(f).subspan(kHeaderBytes, 6), 0);
  EXPECT_EQ(d.status().code(), ErrorCode::kProtocol);
  EXPECT_NE(d.status().message().find("client_name"), std::string::npos);
}

TEST(Protocol, HugeCountsAndStringsAreRejected) {
  Writer w;
  w.u32(1);
  w.u32(256);
  w.u64(1 << 20);
  w.u32(0);
  w.u32(0);
  w.u32(0xffffffff);  // regions count
  auto d = decode_welcome(w.buffer(), 0);
  EXPECT_EQ(d.status().code(), ErrorCode::kProtocol);
  Writer s;
  s.u32(0xfffffff0);  // string length
  auto h = decode_hello(s.buffer(), 0);
  EXPECT_EQ(h.status().code(), ErrorCode::kProtocol);
}

TEST(Protocol, BadSpecInsideAMessageIsRejected) {
  CreateRegion m{"r", test_spec()};
  m.spec.layers = 0;
  auto f = encode(m);
  auto d = decode_create_region(std::span<const uint8_t>(f).subspan(kHeaderBytes), 0);
  EXPECT_EQ(d.status().code(), ErrorCode::kProtocol);
  EXPECT_NE(d.status().message().find("layers"), std::string::npos);
}

TEST(Protocol, GarbageNeverCrashesAndIsMostlyRejected) {
  std::mt19937_64 rng(12345);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b(rng() % 96);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (i % 2 == 0 && b.size() >= kHeaderBytes) {  // half with a valid magic/version to reach payloads
      Header h;
      h.type = static_cast<uint16_t>(1 + rng() % kMaxMsgType);
      h.length = static_cast<uint32_t>(b.size() - kHeaderBytes);
      h.field_mask = static_cast<uint32_t>(rng());
      encode_header(h, b.data());
    }
    auto r = decode_frame(b);
    if (r.ok() && r->second > 0 && validate_payload(r->first.header, r->first.payload).ok()) ++accepted;
  }
  EXPECT_LT(accepted, 20000);
}

}  // namespace
}  // namespace kvferry::proto

namespace kvferry::proto {
namespace {

TEST(Protocol, RegisterRegionRoundTripAndChecks) {
  RegisterRegion m;
  m.name = "engine-own";
  m.spec = KvCacheSpec{2, 8, 16, EntryFormat::mla_fp8(), Layout::kBlockMajor};
  m.backend = Backend::kMemfd;
  m.alloc_bytes = static_cast<uint64_t>(m.spec.region_bytes()) + 100;
  Frame f = encode(m);
  auto d = decode_register_region(std::span<const uint8_t>(f).subspan(kHeaderBytes), 0);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->alloc_bytes, m.alloc_bytes);
  EXPECT_EQ(d->backend, Backend::kMemfd);
  m.alloc_bytes = 10;  // smaller than the spec
  Frame small = encode(m);
  EXPECT_EQ(decode_register_region(std::span<const uint8_t>(small).subspan(kHeaderBytes), 0).status().code(),
            ErrorCode::kProtocol);
  m.alloc_bytes = static_cast<uint64_t>(m.spec.region_bytes());
  m.backend = Backend::kCudaIpc;  // without its handle
  Frame noh = encode(m);
  EXPECT_EQ(decode_register_region(std::span<const uint8_t>(noh).subspan(kHeaderBytes), 0).status().code(),
            ErrorCode::kProtocol);
  // At an offset inside the buffer: carried under kFieldOffset, checked against alloc_bytes and
  // the format's alignment.
  m.backend = Backend::kMemfd;
  m.alloc_bytes = static_cast<uint64_t>(m.spec.region_bytes()) + 4096;
  m.offset = 4096;
  Frame at = encode(m);
  auto h = decode_header(std::span<const uint8_t>(at).first(kHeaderBytes));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->field_mask & kFieldOffset, kFieldOffset);
  auto o = decode_register_region(std::span<const uint8_t>(at).subspan(kHeaderBytes), h->field_mask);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->offset, 4096u);
  for (uint64_t bad : {uint64_t{4104}, uint64_t{8192}}) {  // misaligned; past the end
    m.offset = bad;
    Frame f2 = encode(m);
    EXPECT_EQ(decode_register_region(std::span<const uint8_t>(f2).subspan(kHeaderBytes), kFieldOffset).status().code(),
              ErrorCode::kProtocol)
        << bad;
  }
}

}  // namespace
}  // namespace kvferry::proto
