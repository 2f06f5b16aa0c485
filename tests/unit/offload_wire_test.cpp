// Wire pieces of the data ops: the Hello's optional namespace and the arena layouts of ops.h.
#include <gtest/gtest.h>

#include "kvferry/connector/kvferry.h"
#include "kvferry/connector/ops.h"
#include "kvferry/connector/protocol.h"

namespace kvferry {
namespace {

using namespace proto;

TEST(OffloadWire, HelloCarriesTheNamespaceBehindItsBit) {
  Hello m;
  m.client_name = "engine";
  m.pid = 7;
  m.has_namespace = true;
  m.model = "deepseek-v3";
  m.tenant = "team-a";
  auto f = decode_frame(encode(m));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->first.header.field_mask, kFieldNamespace);
  auto d = decode_hello(f->first.payload, f->first.header.field_mask);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE(d->has_namespace);
  EXPECT_EQ(d->model, "deepseek-v3");
  EXPECT_EQ(d->tenant, "team-a");
  EXPECT_EQ(d->client_name, "engine");
  // A reader that does not know the bit reads the old fields and ignores the rest.
  auto old = decode_hello(f->first.payload, 0);
  ASSERT_TRUE(old.ok());
  EXPECT_FALSE(old->has_namespace);
  EXPECT_EQ(old->pid, 7u);
  // An old client's Hello (no bit) decodes without a namespace.
  Hello o;
  o.client_name = "old";
  auto g = decode_frame(encode(o));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->first.header.field_mask, 0u);
  auto od = decode_hello(g->first.payload, g->first.header.field_mask);
  ASSERT_TRUE(od.ok());
  EXPECT_FALSE(od->has_namespace);
  // The bit set but the fields cut off: a clear error naming the field.
  auto bad = decode_hello(g->first.payload, kFieldNamespace);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("model"), std::string::npos) << bad.status().to_string();
}

TEST(OffloadWire, ArenaLayoutsOfTheDataOps) {
  const auto save = static_cast<uint16_t>(Op::kSave), lookup = static_cast<uint16_t>(Op::kLookup);
  EXPECT_TRUE(ops::has_block_ids(save));
  EXPECT_TRUE(ops::has_block_ids(static_cast<uint16_t>(Op::kLoad)));
  EXPECT_FALSE(ops::has_block_ids(lookup));
  EXPECT_EQ(ops::input_bytes(save, 10), 10u * 24u);
  EXPECT_EQ(ops::input_bytes(lookup, 10), 10u * 16u);
  EXPECT_EQ(ops::status_offset(save, 64, 10), 64u + 240u);
  EXPECT_EQ(ops::request_bytes(save, 3), 80u);    // 72 + 6 -> 80
  EXPECT_EQ(ops::request_bytes(lookup, 4), 72u);  // 64 + 8
  EXPECT_EQ(ops::request_bytes(lookup, 0), 0u);
  // The C ABI mirrors the C++ structs byte for byte.
  EXPECT_EQ(sizeof(kvferry_key), sizeof(ops::Key));
  EXPECT_EQ(sizeof(kvferry_stats_info), sizeof(ops::StatsWire));
  EXPECT_EQ(sizeof(kvferry_ls_entry), sizeof(ops::LsEntry));
  EXPECT_EQ(KVFERRY_OP_SAVE, static_cast<int>(Op::kSave));
  EXPECT_EQ(KVFERRY_OP_LS, static_cast<int>(Op::kLs));
  EXPECT_EQ(KVFERRY_E_CHECKSUM_MISMATCH, static_cast<int>(ErrorCode::kChecksumMismatch));
  EXPECT_EQ(KVFERRY_EVICT_ALL, static_cast<int>(ops::kEvictAll));
}

}  // namespace
}  // namespace kvferry
