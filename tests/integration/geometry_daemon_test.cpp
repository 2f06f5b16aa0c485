// Loads across geometries through kvferryd (its own process, CPU backend): one engine saves with
// 64-token pages and another loads into 16-token pages (and back); tensor-parallel ranks save
// their head slices and a full-head engine assembles its blocks from them (and TP 1 -> 2); the
// same with a host pool much smaller than the data, so the stored blocks come back from disk.
// Every token row is compared with what was saved.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/connector/kvferry.h"
#include "test_blocks.h"

namespace kvferry {
namespace {

using testing::create;
using testing::DaemonProcess;
using testing::fill_bytes;
using testing::fill_mla;
using testing::iota_ids;
using testing::Region;

constexpr testing::TestKeys kKeys{0x6E0E000000000000ull};

// The bytes of token t of layer l of block b (MLA: a whole entry).
std::vector<uint8_t> mla_row(const Region& r, int64_t l, int64_t b, int64_t t) {
  const int64_t w = r.spec.format.bytes_per_token();
  const uint8_t* p = r.page(l, b) + t * w;
  return {p, p + w};
}

// The bytes of head h (a model head number) of token t, plane pl (K 0, V 1) of an MHA region.
std::vector<uint8_t> head_row(const Region& r, int64_t l, int64_t b, int pl, int64_t t, int32_t h) {
  const auto& f = r.spec.format;
  const int64_t w = int64_t{f.head_dim} * dtype_size(f.dtype), hh = h - f.head_first;
  const int64_t in = f.order == MhaOrder::kNHD ? (t * f.heads + hh) * w : (hh * r.spec.block_size + t) * w;
  const uint8_t* p = r.page(l, b) + pl * r.spec.block_size * f.heads * w + in;
  return {p, p + w};
}

void all_ok(const Result<Client::OpResult>& r, const DaemonProcess& d) {
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (size_t i = 0; i < r->blocks.size(); ++i)
    ASSERT_EQ(r->blocks[i], ErrorCode::kOk) << "entry " << i << "\n" << d.log();
}

// Saves 8 blocks of 64-token pages and loads them into 16-token pages (4 per stored block), then
// saves those 32 small pages and fills two 64-token blocks from eight of them.
void pages_both_ways(const DaemonProcess& d, uint64_t round) {
  auto prefill = testing::connect_client(d, "prefill");
  auto decode = testing::connect_client(d, "decode");
  ASSERT_TRUE(prefill && decode);
  Region big = create(*prefill, "big" + std::to_string(round), {4, 8, 64, EntryFormat::mla_fp8(), Layout::kBlockMajor});
  Region small =
      create(*decode, "small" + std::to_string(round), {4, 32, 16, EntryFormat::mla_fp8(), Layout::kLayerMajor});
  ASSERT_TRUE(big.base && small.base);
  fill_mla(big, 5 + static_cast<uint32_t>(round));
  const auto keys = kKeys.keys(8, round);
  auto sv = prefill->save(big.id, keys, iota_ids(8));
  all_ok(sv, d);
  std::vector<ops::Key> mk;
  std::vector<int64_t> mb;
  std::vector<int32_t> mp;
  ASSERT_TRUE(Client::page_map(keys, 64, iota_ids(32), 16, &mk, &mb, &mp).ok());
  ASSERT_EQ(mk.size(), 32u);
  all_ok(decode->load_mapped(small.id, mk, mb, mp), d);
  for (int64_t l = 0; l < 4; ++l)
    for (int64_t t = 0; t < 8 * 64; ++t)
      ASSERT_EQ(mla_row(small, l, t / 16, t % 16), mla_row(big, l, t / 64, t % 64)) << "layer " << l << " token " << t;
  // And back: the decode engine's 16-token pages fill 64-token blocks.
  const auto skeys = kKeys.keys(32, round + 100);
  all_ok(decode->save(small.id, skeys, iota_ids(32)), d);
  const std::vector<uint8_t> before = testing::snapshot(big);
  std::memset(big.base, 0, static_cast<size_t>(big.spec.region_bytes()));
  ASSERT_TRUE(Client::page_map(std::span(skeys).subspan(8, 8), 16, std::vector<int64_t>{5, 6}, 64, &mk, &mb, &mp).ok());
  all_ok(prefill->load_mapped(big.id, mk, mb, mp), d);
  EXPECT_TRUE(testing::block_equal(big, 5, before, 2));
  EXPECT_TRUE(testing::block_equal(big, 6, before, 3));
}

TEST(GeometryIt, PageSizesBothWaysThroughTheDaemon) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  pages_both_ways(d, 0);
}

TEST(GeometryIt, TensorParallelRanksAndAFullHeadEngine) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  const int32_t H = 8, D = 64;
  // Two TP ranks (heads 0-3 and 4-7, NHD) save their slices of 4 blocks under their own keys.
  std::vector<std::unique_ptr<Client>> ranks;
  std::vector<Region> rr;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(testing::connect_client(d, "rank" + std::to_string(r)));
    ASSERT_TRUE(ranks.back());
    auto f = EntryFormat::parse("mha:bf16:4x64:nhd:slice=" + std::to_string(4 * r) + "/8");
    ASSERT_TRUE(f.ok());
    rr.push_back(create(*ranks.back(), "rank" + std::to_string(r), {3, 4, 16, *f, Layout::kBlockMajor}));
    ASSERT_TRUE(rr.back().base);
    fill_bytes(rr.back(), 40 + static_cast<uint64_t>(r));
    all_ok(ranks.back()->save(rr.back().id, kKeys.keys(4, 10 + static_cast<uint64_t>(r)), iota_ids(4)), d);
  }
  // A full-head HND engine assembles each block from the two slices.
  auto full = testing::connect_client(d, "full");
  ASSERT_TRUE(full);
  Region fr =
      create(*full, "full", {3, 4, 16, EntryFormat::mha(H, D, DType::kBF16, MhaOrder::kHND), Layout::kLayerMajor});
  ASSERT_TRUE(fr.base);
  std::vector<ops::Key> mk;
  std::vector<int64_t> mb;
  for (int64_t b = 0; b < 4; ++b)
    for (int r = 0; r < 2; ++r) {
      mk.push_back(kKeys.key(static_cast<uint64_t>(b), 10 + static_cast<uint64_t>(r)));
      mb.push_back(3 - b);
    }
  all_ok(full->load_mapped(fr.id, mk, mb, std::vector<int32_t>(mk.size(), 0)), d);
  for (int64_t l = 0; l < 3; ++l)
    for (int64_t b = 0; b < 4; ++b)
      for (int pl = 0; pl < 2; ++pl)
        for (int64_t t = 0; t < 16; ++t)
          for (int32_t h = 0; h < H; ++h)
            ASSERT_EQ(head_row(fr, l, 3 - b, pl, t, h), head_row(rr[static_cast<size_t>(h / 4)], l, b, pl, t, h));
  // With one slice missing, nothing of that block is written and both entries say so.
  std::vector<uint8_t> before = testing::snapshot(fr);
  auto half = full->load_mapped(fr.id, std::vector<ops::Key>{mk[0]}, std::vector<int64_t>{0}, std::vector<int32_t>{0});
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->blocks[0], ErrorCode::kInvalidArgument);
  EXPECT_EQ(testing::snapshot(fr), before);
  // TP 1 -> 2: the full engine saves, rank 1 loads its heads with a plain load.
  all_ok(full->save(fr.id, kKeys.keys(4, 20), iota_ids(4)), d);
  all_ok(ranks[1]->load(rr[1].id, kKeys.keys(4, 20), std::vector<int64_t>{3, 2, 1, 0}), d);
  for (int64_t l = 0; l < 3; ++l)
    for (int64_t b = 0; b < 4; ++b)
      for (int pl = 0; pl < 2; ++pl)
        for (int64_t t = 0; t < 16; ++t)
          for (int32_t h = 4; h < 8; ++h) ASSERT_EQ(head_row(rr[1], l, 3 - b, pl, t, h), head_row(fr, l, b, pl, t, h));
}

TEST(GeometryIt, CAbiMappedLoadAndBadArguments) {
  DaemonProcess d("");
  ASSERT_TRUE(d.ready()) << d.log();
  auto c = testing::connect_client(d, "c-abi-owner");
  ASSERT_TRUE(c);
  Region big = create(*c, "big", {2, 2, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  ASSERT_TRUE(big.base);
  fill_mla(big, 3);
  all_ok(c->save(big.id, kKeys.keys(2, 30), iota_ids(2)), d);
  kvferry_client* cc = nullptr;
  ASSERT_EQ(kvferry_connect_ns(d.socket().c_str(), "c-abi", "m", "", &cc), 0) << kvferry_last_error();
  uint32_t rid = 0;
  const KvCacheSpec small_spec{2, 8, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor};
  ASSERT_EQ(kvferry_create_region(cc, "small", small_spec.layers, small_spec.blocks, small_spec.block_size, "mla_bf16",
                                  0, &rid),
            0)
      << kvferry_last_error();
  void* base = nullptr;
  ASSERT_EQ(kvferry_map_region(cc, rid, &base), 0) << kvferry_last_error();
  const auto keys = kKeys.keys(2, 30);
  std::vector<kvferry_key> k;
  std::vector<int64_t> b;
  std::vector<int32_t> p;
  for (int i = 0; i < 8; ++i) {
    k.push_back({keys[static_cast<size_t>(i / 4)].hi, keys[static_cast<size_t>(i / 4)].lo});
    b.push_back(i);
    p.push_back(i % 4);
  }
  p[7] = 4;  // past the 4 parts of a 64-token block: region block 7 fails alone
  std::vector<int16_t> st(8, -1);
  uint32_t done = 0;
  EXPECT_EQ(kvferry_load_mapped(cc, rid, k.data(), b.data(), p.data(), 8, st.data(), &done),
            KVFERRY_ERROR_OUT_OF_RANGE);
  EXPECT_EQ(done, 7u);
  EXPECT_EQ(st[7], KVFERRY_ERROR_OUT_OF_RANGE);
  const auto* sb = static_cast<const uint8_t*>(base);
  for (int64_t t = 0; t < 7 * 16; ++t)
    ASSERT_EQ(0, std::memcmp(sb + small_spec.page_offset(1, t / 16) + (t % 16) * 1152,
                             big.page(1, t / 64) + (t % 64) * 1152, 1152))
        << "token " << t;
  EXPECT_EQ(kvferry_load_mapped(cc, rid, k.data(), b.data(), nullptr, 8, st.data(), &done),
            KVFERRY_ERROR_INVALID_ARGUMENT);
  uint64_t req = 0;
  EXPECT_EQ(kvferry_submit_load_mapped(cc, rid, k.data(), b.data(), p.data(), 8, nullptr),
            KVFERRY_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(kvferry_submit_load_mapped(cc, rid, k.data(), b.data(), p.data(), 7, &req), 0) << kvferry_last_error();
  uint32_t d2 = 0;
  EXPECT_EQ(kvferry_wait_op(cc, req, 10'000'000, st.data(), 8, &d2, nullptr), 0) << kvferry_last_error();
  EXPECT_EQ(d2, 7u);
  kvferry_close(cc);
}

// The same page maps with an 8 MiB host pool over a disk tier: the 64-token blocks are on disk
// when the 16-token engine asks, and come back exact.
TEST(GeometryIt, PageMapsFromTheDiskTier) {
  const std::string dir = testing::make_temp_dir();
  const std::string probe = dir + "/.odirect";
  const int fd = ::open(probe.c_str(), O_CREAT | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  DaemonProcess d("tiers:\n  host:\n    capacity: 8MiB\n  disk:\n    path: " + dir +
                  "\n    capacity: 256MiB\n    direct_io: " + (fd >= 0 ? "true" : "false") + "\n");
  ASSERT_TRUE(d.ready()) << d.log();
  auto prefill = testing::connect_client(d, "prefill");
  auto decode = testing::connect_client(d, "decode");
  ASSERT_TRUE(prefill && decode);
  Region big = create(*prefill, "big", {4, 64, 64, EntryFormat::mla_bf16(), Layout::kBlockMajor});  // 18 MiB
  Region small = create(*decode, "small", {4, 64, 16, EntryFormat::mla_bf16(), Layout::kBlockMajor});
  ASSERT_TRUE(big.base && small.base);
  fill_bytes(big, 77);
  const auto keys = kKeys.keys(64, 40);
  all_ok(prefill->save(big.id, keys, iota_ids(64)), d);
  // The first 16 stored blocks (the oldest: demoted to disk) into the 64 small pages.
  std::vector<ops::Key> mk;
  std::vector<int64_t> mb;
  std::vector<int32_t> mp;
  ASSERT_TRUE(Client::page_map(std::span(keys).first(16), 64, iota_ids(64), 16, &mk, &mb, &mp).ok());
  all_ok(decode->load_mapped(small.id, mk, mb, mp), d);
  for (int64_t l = 0; l < 4; ++l)
    for (int64_t t = 0; t < 16 * 64; ++t)
      ASSERT_EQ(mla_row(small, l, t / 16, t % 16), mla_row(big, l, t / 64, t % 64)) << "layer " << l << " token " << t;
  const std::string cmd = "rm -rf '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

}  // namespace
}  // namespace kvferry
