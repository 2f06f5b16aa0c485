// CPU twins of the cache writers: hand-checked cases, the spec's math, and the cross-layer
// equivalence design (kernels-spec section 8) for L in {1, 2, 3, 61}, layer first/middle/last.
#include <gtest/gtest.h>

#include <cfloat>
#include <string>

#include "kernels_test_util.h"
#include "kvferry/kernels/write.h"

namespace kvferry {
namespace {

using kernels::MlaWriteMode;
using test::Bytes;
using test::Region;

float f32_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

EntryFormat mla_format(MlaWriteMode m) {
  switch (m) {
    case MlaWriteMode::kCopy: return EntryFormat::mla_bf16();
    case MlaWriteMode::kFp8: return EntryFormat::mla_fp8();
    case MlaWriteMode::kFp8Ds: return EntryFormat::mla_fp8_ds();
  }
  return EntryFormat::mla_bf16();
}

struct MlaInputs {
  std::vector<uint16_t> kv_c, k_pe;
  std::vector<int64_t> slots;
};

MlaInputs mla_inputs(int64_t tokens, int64_t total_slots, uint32_t seed) {
  MlaInputs in;
  in.kv_c = test::random_bf16(static_cast<size_t>(tokens * kMlaRank), seed);
  in.k_pe = test::random_bf16(static_cast<size_t>(tokens * kMlaRope), seed + 1);
  in.slots = test::random_slots(total_slots, tokens, seed + 2);
  return in;
}

kernels::WriteMlaParams mla_params(const MlaInputs& in, kernels::CacheRef cache, MlaWriteMode mode) {
  kernels::WriteMlaParams p;
  p.kv_c = in.kv_c.data();
  p.k_pe = in.k_pe.data();
  p.slots = in.slots.data();
  p.tokens = static_cast<int64_t>(in.slots.size());
  p.cache = cache;
  p.mode = mode;
  p.scale = 0.5f;
  return p;
}

TEST(KernelsWriteMla, CopyPutsNopeThenRopeAtTheSlot) {
  Region r(test::mk_spec(1, 2, 4, EntryFormat::mla_bf16()), 1);
  const Bytes before = r.bytes;
  MlaInputs in = mla_inputs(1, 8, 3);
  in.slots = {5};  // block 1, token 1
  ASSERT_TRUE(kernels::write_mla_cpu(mla_params(in, r.layer(0), MlaWriteMode::kCopy)).ok());
  const uint8_t* e = r.bytes.data() + (1 * 4 + 1) * kMlaBf16Bytes;
  EXPECT_EQ(std::memcmp(e, in.kv_c.data(), 1024), 0);
  EXPECT_EQ(std::memcmp(e + 1024, in.k_pe.data(), 128), 0);
  // Nothing else changed.
  EXPECT_EQ(std::memcmp(r.bytes.data(), before.data(), 5 * kMlaBf16Bytes), 0);
  EXPECT_EQ(std::memcmp(e + kMlaBf16Bytes, before.data() + 6 * kMlaBf16Bytes, 2 * kMlaBf16Bytes), 0);
}

TEST(KernelsWriteMla, Fp8DividesByTheScaleAndSaturates) {
  Region r(test::mk_spec(1, 1, 2, EntryFormat::mla_fp8()), 2);
  MlaInputs in = mla_inputs(1, 2, 4);
  in.slots = {1};
  in.kv_c[0] = float_to_bf16(1.0f);     // 1 / 0.5 = 2 -> 0x40
  in.kv_c[1] = float_to_bf16(-1000.f);  // saturates to -448 -> 0xFE
  in.kv_c[2] = float_to_bf16(0.0f);
  in.k_pe[0] = float_to_bf16(0.75f);  // 1.5 -> 0x3C
  ASSERT_TRUE(kernels::write_mla_cpu(mla_params(in, r.layer(0), MlaWriteMode::kFp8)).ok());
  const uint8_t* e = r.bytes.data() + kMlaFp8Bytes;
  EXPECT_EQ(e[0], 0x40);
  EXPECT_EQ(e[1], 0xFE);
  EXPECT_EQ(e[2], 0x00);
  EXPECT_EQ(e[512], 0x3C);
  for (int i = 3; i < 512; ++i) ASSERT_EQ(e[i], float_to_e4m3(bf16_to_float(in.kv_c[i]) / 0.5f)) << i;
}

TEST(KernelsWriteMla, DsTileScalesFollowTheSpec) {
  Region r(test::mk_spec(1, 1, 1, EntryFormat::mla_fp8_ds()), 3);
  MlaInputs in = mla_inputs(1, 1, 5);
  in.slots = {0};
  for (int i = 0; i < 128; ++i) in.kv_c[i] = float_to_bf16(0.0f);  // tile 0 all zero
  in.kv_c[128] = float_to_bf16(-448.0f);                           // tile 1 amax 448 -> scale 1
  for (int i = 129; i < 256; ++i) in.kv_c[i] = float_to_bf16(static_cast<float>(i - 200));
  ASSERT_TRUE(kernels::write_mla_cpu(mla_params(in, r.layer(0), MlaWriteMode::kFp8Ds)).ok());
  const uint8_t* e = r.bytes.data();
  EXPECT_EQ(f32_at(e + 512), FLT_MIN);
  for (int i = 0; i < 128; ++i) ASSERT_EQ(e[i], 0) << i;
  EXPECT_EQ(f32_at(e + 516), 1.0f);
  EXPECT_EQ(e[128], 0xFE);
  EXPECT_EQ(e[129], float_to_e4m3(-71.0f));
  for (int t = 2; t < 4; ++t) {
    float amax = 0;
    for (int i = 128 * t; i < 128 * (t + 1); ++i) amax = std::fmax(amax, std::fabs(bf16_to_float(in.kv_c[i])));
    const float s = std::fmax(amax / 448.0f, FLT_MIN);
    EXPECT_EQ(f32_at(e + 512 + 4 * t), s);
    for (int i = 128 * t; i < 128 * (t + 1); ++i) ASSERT_EQ(e[i], float_to_e4m3(bf16_to_float(in.kv_c[i]) / s));
  }
  EXPECT_EQ(std::memcmp(e + 528, in.k_pe.data(), 128), 0);
}

TEST(KernelsWriteMla, RejectsBadInput) {
  Region r(test::mk_spec(1, 2, 4, EntryFormat::mla_fp8_ds()), 1);
  MlaInputs in = mla_inputs(3, 8, 3);
  auto p = mla_params(in, r.layer(0), MlaWriteMode::kFp8Ds);
  in.slots[0] = 8;
  Status st = kernels::write_mla_cpu(p);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(st.message().find("slot 8"), std::string::npos) << st.to_string();
  p.mode = MlaWriteMode::kCopy;  // 656-byte view under a bf16 mode
  st = kernels::write_mla_cpu(p);
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cache"), std::string::npos) << st.to_string();
  p.mode = MlaWriteMode::kFp8Ds;
  p.kv_c_stride = 100;
  EXPECT_FALSE(kernels::write_mla_cpu(p).ok());
}

// Cross-layer: a contiguous per-layer cache and layer l of a block-major buffer, same writes;
// the layer must match bit for bit and the other layers keep their garbage.
class KernelsWriteCrossLayer : public ::testing::TestWithParam<int64_t> {};

TEST_P(KernelsWriteCrossLayer, MlaAllModes) {
  const int64_t layers = GetParam();
  for (MlaWriteMode mode : {MlaWriteMode::kCopy, MlaWriteMode::kFp8, MlaWriteMode::kFp8Ds}) {
    const EntryFormat f = mla_format(mode);
    const int64_t nb = 6, bs = 8;
    const MlaInputs in = mla_inputs(30, nb * bs, 11);
    for (int64_t l : test::probe_layers(layers)) {
      Region one(test::mk_spec(1, nb, bs, f), 21);
      Region u(test::mk_spec(layers, nb, bs, f), 22);
      test::copy_layer(u, l, one, true);
      const Bytes garbage = u.bytes;
      ASSERT_TRUE(kernels::write_mla_cpu(mla_params(in, one.layer(0), mode)).ok());
      ASSERT_TRUE(kernels::write_mla_cpu(mla_params(in, u.layer(l), mode), {3}).ok());
      EXPECT_TRUE(test::layer_equal(u, l, one)) << "mode " << int(mode) << " L " << layers << " layer " << l;
      Region g(u.spec, 0);
      std::memcpy(g.bytes.data(), garbage.data(), garbage.size());
      EXPECT_TRUE(test::others_equal(u, g, l)) << "neighbour layers changed, L " << layers << " layer " << l;
    }
  }
}

TEST_P(KernelsWriteCrossLayer, MhaPlanes) {
  const int64_t layers = GetParam();
  const int64_t nb = 5, bs = 4, h = 2, d = 16, tokens = 14;
  for (MhaOrder order : {MhaOrder::kNHD, MhaOrder::kHND}) {
    for (DType cd : {DType::kBF16, DType::kFP8E4M3}) {
      const EntryFormat f = EntryFormat::mha(h, d, cd, order);
      const auto key = test::random_bf16(tokens * h * d, 31);
      const auto val = test::random_bf16(tokens * h * d, 32);
      const auto slots = test::random_slots(nb * bs, tokens, 33);
      for (int64_t l : test::probe_layers(layers)) {
        Region one(test::mk_spec(1, nb, bs, f), 41);
        Region u(test::mk_spec(layers, nb, bs, f), 42);
        test::copy_layer(u, l, one, true);
        const Bytes garbage = u.bytes;
        auto run = [&](Region& r, int64_t layer) {
          kernels::WriteMhaParams p;
          p.key = key.data();
          p.value = val.data();
          p.key_stride = p.value_stride = h * d;
          p.slots = slots.data();
          p.tokens = tokens;
          p.k_cache = r.plane(layer, false);
          p.v_cache = r.plane(layer, true);
          p.k_scale = 0.25f;
          p.v_scale = 2.0f;
          return kernels::write_mha_cpu(p);
        };
        ASSERT_TRUE(run(one, 0).ok());
        ASSERT_TRUE(run(u, l).ok());
        EXPECT_TRUE(test::layer_equal(u, l, one));
        Region g(u.spec, 0);
        std::memcpy(g.bytes.data(), garbage.data(), garbage.size());
        EXPECT_TRUE(test::others_equal(u, g, l));
      }
    }
  }
}

TEST_P(KernelsWriteCrossLayer, Indexer) {
  const int64_t layers = GetParam();
  const int64_t nb = 4, bs = 16, tokens = 40;
  const auto k = test::random_bf16(tokens * 128, 51);
  const auto slots = test::random_slots(nb * bs, tokens, 52);
  for (bool ue8m0 : {false, true}) {
    for (int64_t l : test::probe_layers(layers)) {
      Region one(test::mk_spec(1, nb, bs, EntryFormat::indexer_fp8()), 61);
      Region u(test::mk_spec(layers, nb, bs, EntryFormat::indexer_fp8()), 62);
      test::copy_layer(u, l, one, true);
      const Bytes garbage = u.bytes;
      auto run = [&](Region& r, int64_t layer) {
        kernels::IndexerWriteParams p;
        p.k = k.data();
        p.slots = slots.data();
        p.tokens = tokens;
        p.cache = r.layer(layer);
        p.ue8m0 = ue8m0;
        return kernels::indexer_write_cpu(p);
      };
      ASSERT_TRUE(run(one, 0).ok());
      ASSERT_TRUE(run(u, l).ok());
      EXPECT_TRUE(test::layer_equal(u, l, one));
      Region g(u.spec, 0);
      std::memcpy(g.bytes.data(), garbage.data(), garbage.size());
      EXPECT_TRUE(test::others_equal(u, g, l));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, KernelsWriteCrossLayer, ::testing::Values(1, 2, 3, 61));

TEST(KernelsIndexer, ValuesThenScalesLayout) {
  const int64_t bs = 4;
  Region r(test::mk_spec(1, 2, bs, EntryFormat::indexer_fp8()), 7);
  std::vector<uint16_t> k(2 * 128);
  for (int i = 0; i < 128; ++i) k[i] = float_to_bf16(i == 5 ? 3.0f : 0.5f);         // amax 3
  for (int i = 0; i < 128; ++i) k[128 + i] = float_to_bf16(i == 0 ? 1e-6f : 0.0f);  // amax < 1e-4
  std::vector<int64_t> slots{6, 1};                                                 // block 1 token 2, block 0 token 1
  for (bool ue8m0 : {false, true}) {
    kernels::IndexerWriteParams p;
    p.k = k.data();
    p.slots = slots.data();
    p.tokens = 2;
    p.cache = r.layer(0);
    p.ue8m0 = ue8m0;
    ASSERT_TRUE(kernels::indexer_write_cpu(p).ok());
    const uint8_t* b1 = r.bytes.data() + bs * 132;
    const float s0 = ue8m0 ? 0.0078125f : 3.0f / 448.0f;  // 3/448 = 0.0067 -> 2^-7
    EXPECT_EQ(f32_at(b1 + bs * 128 + 2 * 4), s0);
    EXPECT_EQ(b1[2 * 128 + 5], float_to_e4m3(3.0f / s0));
    EXPECT_EQ(b1[2 * 128 + 0], float_to_e4m3(0.5f / s0));
    const float s1 = ue8m0 ? 2.384185791015625e-07f : 1e-4f / 448.0f;  // 2.23e-7 -> 2^-22
    EXPECT_EQ(f32_at(r.bytes.data() + bs * 128 + 1 * 4), s1);
  }
}

}  // namespace
}  // namespace kvferry
