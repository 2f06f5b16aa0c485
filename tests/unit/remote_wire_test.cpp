// The remote tier's control messages: frames and operation bodies round-trip, and decoding
// refuses every truncation, a wrong magic or version, a lying length and counts that cannot fit.
#include <gtest/gtest.h>

#include <random>

#include "kvferry/store/remote_wire.h"

namespace kvferry::store::wire {
namespace {

TEST(RemoteWire, FrameRoundTripAndRejects) {
  std::vector<uint8_t> body{1, 2, 3, 4, 5};
  auto f = frame(MsgType::kRequest, 42, body, 0x5);
  ASSERT_EQ(f.size(), kHeaderBytes + body.size());
  Header h;
  std::span<const uint8_t> b;
  ASSERT_TRUE(parse_frame(f, h, b).ok());
  EXPECT_EQ(h.type, MsgType::kRequest);
  EXPECT_EQ(h.request_id, 42u);
  EXPECT_EQ(h.field_mask, 0x5u);
  EXPECT_TRUE(std::equal(b.begin(), b.end(), body.begin(), body.end()));

  for (size_t n = 0; n < f.size(); ++n)  // every truncation
    EXPECT_EQ(parse_frame(std::span(f).first(n), h, b).code(), ErrorCode::kProtocol) << n;
  auto bad = f;
  bad[0] ^= 1;
  EXPECT_EQ(parse_frame(bad, h, b).code(), ErrorCode::kProtocol);
  bad = f;
  bad[4] = 9;
  EXPECT_EQ(parse_frame(bad, h, b).code(), ErrorCode::kVersionMismatch);
  bad = f;
  bad.push_back(0);  // length disagrees with the buffer
  EXPECT_EQ(parse_frame(bad, h, b).code(), ErrorCode::kProtocol);
}

TEST(RemoteWire, BodiesRoundTrip) {
  LookupRequest q{"model|fp8|tenant", {{1, 2}, {~0ull, 7}}};
  auto q2 = LookupRequest::decode(q.encode());
  ASSERT_TRUE(q2.ok());
  EXPECT_EQ(q2->ns, q.ns);
  EXPECT_EQ(q2->keys, q.keys);

  LookupReply r{{{true, 4096, 1000, 0xabc, "bf16"}, {false, 0, 0, 0, ""}}};
  auto r2 = LookupReply::decode(r.encode());
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->entries, r.entries);

  ReserveRequest rv{"ns", "mla_fp8@61x64", 1u << 20, {{3, 4}, {5, 6}}, true, 0, {}};
  auto rv2 = ReserveRequest::decode(rv.encode());
  ASSERT_TRUE(rv2.ok());
  EXPECT_EQ(rv2->keys, rv.keys);
  EXPECT_EQ(rv2->bytes, rv.bytes);
  EXPECT_EQ(rv2->format, rv.format);
  EXPECT_TRUE(rv2->send);
  ReserveRequest land{"ns", "mla_fp8@61x64", 1u << 20, {{3, 4}, {5, 6}}, true, 7, {11, -1}};
  auto land2 = ReserveRequest::decode(land.encode());
  ASSERT_TRUE(land2.ok());
  EXPECT_EQ(land2->land_region, 7u);
  EXPECT_EQ(land2->land_ids, (std::vector<int64_t>{11, -1}));
  const auto enc = land.encode();
  EXPECT_FALSE(ReserveRequest::decode(std::span(enc).first(enc.size() - 8)).ok());  // an id short

  ReserveReply rr{{{ErrorCode::kOk, 8192, 77}, {ErrorCode::kAlreadyExists, 0, 0}}};
  auto rr2 = ReserveReply::decode(rr.encode());
  ASSERT_TRUE(rr2.ok());
  EXPECT_EQ(rr2->entries, rr.entries);

  CommitRequest c{{{77, 0xfeed, true}, {78, 0, false}}};
  auto c2 = CommitRequest::decode(c.encode());
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->items, c.items);
  auto cr = CommitReply::decode(CommitReply{{ErrorCode::kOk, ErrorCode::kChecksumMismatch}}.encode());
  ASSERT_TRUE(cr.ok());
  EXPECT_EQ(cr->codes, (std::vector<ErrorCode>{ErrorCode::kOk, ErrorCode::kChecksumMismatch}));

  Notify n{"ns", {{1, 1}, {2, 2}}, {ErrorCode::kOk, ErrorCode::kUnavailable}};
  auto n2 = Notify::decode(n.encode());
  ASSERT_TRUE(n2.ok());
  EXPECT_EQ(n2->codes, n.codes);

  LocalExportRequest le{"m|mla|t", 7};
  auto le2 = LocalExportRequest::decode(le.encode());
  ASSERT_TRUE(le2.ok());
  EXPECT_EQ(le2->ns, le.ns);
  EXPECT_EQ(le2->region, 7u);
  LocalExportReply lr{"boot", "/run/kvferry/b.sock", "tok"};
  auto lr2 = LocalExportReply::decode(lr.encode());
  ASSERT_TRUE(lr2.ok());
  EXPECT_EQ(lr2->boot_id, "boot");
  EXPECT_EQ(lr2->socket, lr.socket);
  EXPECT_EQ(lr2->token, "tok");
  LocalLanded ll{"ns", "tok", 3, {{1, 1}, {2, 2}}, {5, -1}};
  auto ll2 = LocalLanded::decode(ll.encode());
  ASSERT_TRUE(ll2.ok());
  EXPECT_EQ(ll2->region, 3u);
  EXPECT_EQ(ll2->token, "tok");
  EXPECT_EQ(ll2->ids, ll.ids);
  EXPECT_EQ(ll2->keys[1].lo, 2u);
  const auto lle = ll.encode();
  for (size_t k = 0; k < lle.size(); ++k) EXPECT_FALSE(LocalLanded::decode(std::span(lle).first(k)).ok()) << k;
}

TEST(RemoteWire, DecodingNeverTrustsALength) {
  LookupRequest q{"ns", {{1, 2}, {3, 4}, {5, 6}}};
  auto enc = q.encode();
  for (size_t n = 0; n < enc.size(); ++n) EXPECT_FALSE(LookupRequest::decode(std::span(enc).first(n)).ok()) << n;
  auto extra = enc;
  extra.push_back(1);
  EXPECT_FALSE(LookupRequest::decode(extra).ok());  // trailing bytes
  // A count of 2^32-1 keys in a short message is refused before anything is allocated.
  Writer w;
  w.str("ns");
  w.u32(0xffffffffu);
  EXPECT_FALSE(LookupRequest::decode(w.buffer()).ok());
  // Random bytes never crash a decoder.
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> junk(rng() % 64);
    for (auto& b : junk) b = uint8_t(rng());
    (void)LookupRequest::decode(junk);
    (void)LookupReply::decode(junk);
    (void)ReserveRequest::decode(junk);
    (void)ReserveReply::decode(junk);
    (void)CommitRequest::decode(junk);
    (void)CommitReply::decode(junk);
    (void)Notify::decode(junk);
    (void)LocalExportRequest::decode(junk);
    (void)LocalExportReply::decode(junk);
    (void)LocalLanded::decode(junk);
    Reader r(junk);
    (void)PeerHello::decode(r);
  }
}

}  // namespace
}  // namespace kvferry::store::wire
