#pragma once
// What the data-path integration tests share: a client of a DaemonProcess, a region it created and
// mapped, seeded block contents, the keys a test saves under, block comparisons, and the output
// of the kvferry CLI. Every helper fails the test (with the daemon's log where there is one)
// instead of returning something silently empty.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "kvferry/connector/client.h"
#include "kvferry/kernels/write.h"
#include "kvferry/layouts/dtype.h"

namespace kvferry::testing {

/// A client of `d` named `name`, in the namespace of (`model`, `tenant`); nullptr (and a failed
/// test) when it cannot connect.
inline std::unique_ptr<Client> connect_client(const DaemonProcess& d, const std::string& name,
                                              const std::string& model = "m", const std::string& tenant = "") {
  Client::Options o;
  o.socket = d.socket();
  o.name = name;
  o.model = model;
  o.tenant = tenant;
  auto c = Client::connect(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string() << "\n" << d.log();
  return c.ok() ? std::move(*c) : nullptr;
}

/// A region a client created, mapped into this process (the client owns the mapping).
struct Region {
  uint32_t id = 0;
  KvCacheSpec spec;
  uint8_t* base = nullptr;
  uint8_t* page(int64_t l, int64_t b) const { return base + spec.page_offset(l, b); }
  /// The first page of block `b`: in a block-major region the whole block (block_bytes) starts here.
  uint8_t* block(int64_t b) const { return page(0, b); }
};

/// Creates and maps region `name` of `spec` through `c`; a failed test and base == nullptr when it cannot.
inline Region create(Client& c, const std::string& name, const KvCacheSpec& spec) {
  Region r;
  auto id = c.create_region(name, spec);
  EXPECT_TRUE(id.ok()) << id.status().to_string();
  if (!id.ok()) return r;
  r.id = *id;
  r.spec = spec;
  auto b = c.map_region(*id);
  EXPECT_TRUE(b.ok());
  r.base = b.ok() ? static_cast<uint8_t*>(*b) : nullptr;
  return r;
}

/// Fills every block of an MLA region through write_mla with seeded bf16 inputs: real cache
/// contents, so a conversion between MLA formats has meaningful scales.
inline void fill_mla(Region& r, uint32_t seed) {
  const int64_t tokens = r.spec.blocks * r.spec.block_size;
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  std::iota(slots.begin(), slots.end(), 0);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (int64_t l = 0; l < r.spec.layers; ++l) {
    std::vector<uint16_t> kv(static_cast<size_t>(tokens * 512)), pe(static_cast<size_t>(tokens * 64));
    for (auto& v : kv) v = float_to_bf16(u(rng));
    for (auto& v : pe) v = float_to_bf16(u(rng));
    kernels::WriteMlaParams p;
    p.kv_c = kv.data();
    p.k_pe = pe.data();
    p.slots = slots.data();
    p.tokens = tokens;
    p.cache = {r.base, r.spec.region_bytes(), r.spec.layer_view(l)};
    p.mode = r.spec.format.kind == FormatKind::kMlaFp8     ? kernels::MlaWriteMode::kFp8
             : r.spec.format.kind == FormatKind::kMlaFp8Ds ? kernels::MlaWriteMode::kFp8Ds
                                                           : kernels::MlaWriteMode::kCopy;
    ASSERT_TRUE(kernels::write_mla_cpu(p).ok());
  }
}

/// Fills the whole region with a seeded non-zero byte pattern (any format: the bytes are opaque).
inline void fill_bytes(Region& r, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < r.spec.region_bytes(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(r.base + i, &v, static_cast<size_t>(std::min<int64_t>(8, r.spec.region_bytes() - i)));
  }
}

/// The keys one test file saves under: hi = `tag` ^ round, lo = a golden-ratio walk over the
/// index (+ `lo_add`). Each file has its own tag; a round is one set of blocks.
struct TestKeys {
  uint64_t tag;
  uint64_t lo_add = 1;
  ops::Key key(uint64_t i, uint64_t round = 0) const { return {tag ^ round, i * 0x9e3779b97f4a7c15ull + lo_add}; }
  std::vector<ops::Key> keys(int64_t n, uint64_t round = 0) const {
    std::vector<ops::Key> k;
    for (int64_t i = 0; i < n; ++i) k.push_back(key(static_cast<uint64_t>(i), round));
    return k;
  }
};

/// Block ids 0 .. n-1.
inline std::vector<int64_t> iota_ids(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

/// A copy of the region's bytes.
inline std::vector<uint8_t> snapshot(const Region& r) { return {r.base, r.base + r.spec.region_bytes()}; }

/// Whether block `b` of `r` holds, in every layer, what block `bref` held in `ref` (a snapshot of
/// a region of the same spec).
inline bool block_equal(const Region& r, int64_t b, const std::vector<uint8_t>& ref, int64_t bref) {
  for (int64_t l = 0; l < r.spec.layers; ++l)
    if (std::memcmp(r.page(l, b), ref.data() + r.spec.page_offset(l, bref), static_cast<size_t>(r.spec.page_bytes())))
      return false;
  return true;
}

/// Calls send(k) for k = 0, 1, ... back to back until three calls have started after `killed`
/// turned true (within 30 s, or until a call itself fails): their results. For tests that kill a
/// receiver while sends go on.
inline std::vector<Client::OpResult> sends_after_kill(const std::atomic<bool>& killed,
                                                      const std::function<Result<Client::OpResult>(uint64_t)>& send) {
  std::vector<Client::OpResult> after;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (uint64_t k = 0; k < 1000000 && after.size() < 3 && std::chrono::steady_clock::now() < end; ++k) {
    const bool dead = killed.load();
    auto r = send(k);
    if (!r.ok()) break;
    if (dead) after.push_back(*r);
  }
  return after;
}

/// How many of blocks 0 .. n-1 of `got` equal those of `want` (block-major regions of one spec).
inline int64_t equal_blocks(const Region& got, const Region& want, int64_t n) {
  int64_t eq = 0;
  for (int64_t b = 0; b < n; ++b)
    eq += std::memcmp(got.block(b), want.block(b), static_cast<size_t>(got.spec.block_bytes())) == 0;
  return eq;
}

/// Runs the kvferry CLI at `cli` against `d` with `args`; returns its stdout (the exit status is checked).
inline std::string run_cli(const std::string& cli, const DaemonProcess& d, const std::string& args) {
  const std::string cmd = "'" + cli + "' --socket '" + d.socket() + "' " + args;
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << cmd << "\n" << out;
  return out;
}

}  // namespace kvferry::testing
