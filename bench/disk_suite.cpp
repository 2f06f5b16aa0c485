// kvferry-bench disk: the disk tier (G3) writing and reading blocks of 256 KiB, 1 MiB and 4 MiB
// next to fio (io_uring, O_DIRECT, iodepth 32, bs = the tier's slot size) on the same file system
// in the same run. The tier is driven directly (host buffers stand in for host-pool slots, one
// registered chunk), then through an in-process kvferryd whose 512 MiB host pool is far too small
// for the data (saves write through to disk; loads promote from disk), each daemon round next to
// a fio round (medians of 3, interleaved: the disk is noisy), in write-back (the default) and
// write-through mode, with where the worker's time went; and the start of a daemon on a disk tier
// holding 100 000 blocks (index rebuild).
// Arguments after --: the directory to use (default ./kvferry-bench-disk, removed afterwards);
// --daemon-only (skip the bare tier and restart rows), --mode=back|through, --rounds=N,
// --sizes=256,1024 (KiB), --durability=none|batch|each (the daemon rows' tiers.disk.durability).
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "kvferry/connector/client.h"
#include "kvferry/daemon/daemon.h"
#include "kvferry/store/disk_tier.h"

namespace kvferry::bench {
namespace {

using Clock = std::chrono::steady_clock;

/// fio's bandwidth (bytes/s) for one job, or 0 when fio is missing or fails.
double fio_bw(const std::string& dir, const char* rw, uint64_t bs, uint64_t total) {
  const std::string file = dir + "/fio.dat";
  const std::string cmd = "fio --name=b --filename=" + file +
                          " --ioengine=io_uring --direct=1 --iodepth=32 --rw=" + rw + " --bs=" + std::to_string(bs) +
                          " --size=" + std::to_string(total / bs * bs) +
                          " --output-format=terse --terse-version=3 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return 0;
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ::pclose(p);
  // Terse v3: field 7 is read bandwidth (KiB/s), field 48 write bandwidth (KiB/s), ';'-separated.
  std::vector<std::string> f;
  size_t s = 0;
  for (size_t i = 0; i <= out.size(); ++i)
    if (i == out.size() || out[i] == ';') {
      f.push_back(out.substr(s, i - s));
      s = i + 1;
    }
  const size_t idx = std::strcmp(rw, "read") == 0 ? 6 : 47;
  if (f.size() <= idx) return 0;
  return std::atof(f[idx].c_str()) * 1024.0;
}

struct Run {
  double write_bps = 0, read_bps = 0;
  bool ok = true;
};

Run run_tier(store::DiskTier& t, uint64_t block, uint64_t nblocks, uint8_t* pool, uint64_t pool_slots,
             const std::vector<uint64_t>& sums) {
  Run r;
  const uint64_t slot = (block + 4095) / 4096 * 4096;
  const uint64_t batch = 32;
  const uint64_t window = 4 * batch;  // requests in flight across batches
  for (store::TierOp op : {store::TierOp::kWrite, store::TierOp::kRead}) {
    const auto t0 = Clock::now();
    uint64_t next = 0, done = 0;
    std::vector<store::TierCompletion> got;
    std::vector<store::TierRequest> reqs;
    const auto deadline = t0 + std::chrono::minutes(5);
    while (done < nblocks && Clock::now() < deadline) {
      while (next < nblocks && next - done + batch <= window) {
        reqs.clear();
        for (uint64_t i = 0; i < batch && next < nblocks; ++i, ++next) {
          store::TierRequest q;
          q.op = op;
          const uint64_t b = next % pool_slots;
          q.record = {"bench|mla|t", {next + 1, 0x1234}, "mla_fp8", block, sums[b], 0};
          q.buf = pool + b * slot;
          q.buf_bytes = slot;
          q.cookie = next;
          reqs.push_back(q);
        }
        if (!t.submit(reqs).ok()) r.ok = false;
      }
      got.clear();
      done += t.poll(got, 1024, std::chrono::milliseconds(100));
      for (auto& c : got)
        if (!c.status.ok()) {
          if (r.ok) std::fprintf(stderr, "disk bench: %s\n", c.status.to_string().c_str());
          r.ok = false;
        }
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    (op == store::TierOp::kWrite ? r.write_bps : r.read_bps) = static_cast<double>(block * nblocks) / s;
  }
  return r;
}

double median3(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// An in-process kvferryd (CPU backend) with a host pool of `pool` bytes over a disk tier at `dir`.
struct InProcess {
  config::Config cfg;
  std::unique_ptr<daemon::Daemon> d;
  std::thread runner;
  std::unique_ptr<Client> c;
  double create_s = 0;
  InProcess(const std::string& dir, uint64_t pool, uint64_t disk, bool write_through,
            config::DiskDurability durability = config::DiskDurability::kBatch) {
    cfg.daemon.socket = "/tmp/kvferry-bench-disk-" + std::to_string(::getpid()) + ".sock";
    cfg.daemon.metrics_listen = "";
    cfg.device.backend = config::Backend::kCpu;
    cfg.host.capacity = pool;
    cfg.disk.path = std::filesystem::absolute(dir).string();
    cfg.disk.capacity = disk;
    cfg.disk.write_through = write_through;
    cfg.disk.durability = durability;
    const auto t0 = Clock::now();
    auto r = daemon::Daemon::create(cfg, daemon::Daemon::Options{});
    create_s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!r.ok()) {
      std::fprintf(stderr, "disk bench: %s\n", r.status().to_string().c_str());
      return;
    }
    d = std::move(*r);
    runner = std::thread([this] { (void)d->run(); });
    Client::Options o;
    o.socket = cfg.daemon.socket;
    o.name = "bench-disk";
    o.model = "bench";
    for (int i = 0; i < 300 && !c; ++i) {
      auto cr = Client::connect(o);
      if (cr.ok())
        c = std::move(*cr);
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~InProcess() {
    c.reset();
    if (d) d->stop();
    if (runner.joinable()) runner.join();
  }
  bool ok() const { return c != nullptr; }
};

std::vector<ops::Key> bench_keys(int64_t n, uint64_t round) {
  std::vector<ops::Key> k(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) k[static_cast<size_t>(i)] = {0xB0000000ull + round, static_cast<uint64_t>(i) + 1};
  return k;
}

/// Sum of one series (`name{labels}`) in Prometheus text (0 when absent).
double metric(const std::string& text, const std::string& series) {
  const size_t at = text.find(series + " ");
  return at == std::string::npos ? 0 : std::atof(text.c_str() + at + series.size() + 1);
}

/// The data worker's time per phase of saves or loads through the tiers (ms).
struct Phases {
  double host = 0, lower_wait = 0, demote = 0, total = 0;
};
Phases phases(const std::string& text, const char* op) {
  auto m = [&](const char* ph) {
    return metric(text, std::string("kvferry_tier_phase_microseconds_total{tier=\"disk\",op=\"") + op + "\",phase=\"" +
                            ph + "\"}") /
           1e3;
  };
  return {m("host"), m("lower_wait"), m("demote"), m("total")};
}
std::string describe(const Phases& a, const Phases& b, double wall_s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%.0f ms wall: in the store %.0f ms, host copy+hash %.0f, lower-tier wait %.0f, demote %.0f",
                wall_s * 1e3, b.total - a.total, b.host - a.host, b.lower_wait - a.lower_wait, b.demote - a.demote);
  return buf;
}

/// Bytes/s of copying `bytes` of `src` through a 256 MiB buffer on two threads (the daemon's
/// host copies run on its worker and one helper): the host side's own bound in the same round.
double memcpy_bw(const uint8_t* src, uint64_t bytes) {
  const uint64_t buf_bytes = uint64_t{256} << 20, half = buf_bytes / 2;
  auto* dst = static_cast<uint8_t*>(std::aligned_alloc(4096, buf_bytes));
  if (!dst) return 0;
  std::memset(dst, 1, buf_bytes);
  const auto t0 = Clock::now();
  auto copy = [&](int part) {
    for (uint64_t at = static_cast<uint64_t>(part) * half; at < bytes; at += buf_bytes)
      std::memcpy(dst + part * half, src + at, static_cast<size_t>(std::min(half, bytes - at)));
  };
  std::thread other(copy, 1);
  copy(0);
  other.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::free(dst);
  return static_cast<double>(bytes) / s;
}

/// Saves and loads `n` blocks of `block` bytes through the daemon, `rounds` rounds each next to fio.
int daemon_rows(const std::string& dir, uint64_t block, int64_t n, bool write_through, int rounds,
                config::DiskDurability durability, Report& rep) {
  namespace fs = std::filesystem;
  // Far too small for the data (4 GiB), and large enough that the daemon keeps as many blocks in
  // flight as fio does (32: the store keeps up to 32 blocks' I/O in flight within half its pool;
  // a 256 MiB pool held 4 MiB blocks to 24 and measured 0.61 of fio on the H200 host's disk).
  const uint64_t pool = uint64_t{512} << 20;
  const uint64_t total = block * static_cast<uint64_t>(n);
  fs::remove(dir + "/kvferry-g3.slots");
  InProcess p(dir, pool, total + total / 4 + (uint64_t{512} << 20), write_through, durability);
  if (!p.ok()) return 1;
  // mha:bf16:1x128 is 512 B per token; 64-token pages of 32 KiB; layers make up the block.
  const KvCacheSpec spec{static_cast<int64_t>(block / (32 << 10)), n, 64, EntryFormat::mha(1, 128, DType::kBF16),
                         Layout::kBlockMajor};
  auto rid = p.c->create_region("disk-bench", spec);
  if (!rid.ok()) return std::fprintf(stderr, "disk bench: %s\n", rid.status().to_string().c_str()), 1;
  auto base = p.c->map_region(*rid);
  if (!base.ok()) return 1;
  auto* b = static_cast<uint8_t*>(*base);
  for (int64_t i = 0; i + 8 <= spec.region_bytes(); i += 8) {
    const uint64_t v = (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull) | 1;
    std::memcpy(b + i, &v, 8);
  }
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  const uint64_t slot = store::DiskTier::slot_bytes_for(block);
  std::vector<double> sw, lw, fw, fr, mc;
  std::vector<std::string> sph, lph;
  int rc = 0;
  for (int round = 0; round < rounds; ++round) {
    fw.push_back(fio_bw(dir, "write", slot, static_cast<uint64_t>(n) * slot));
    const auto keys = bench_keys(n, static_cast<uint64_t>(round) + block);
    const std::string m0 = p.d->metrics_text();
    auto t0 = Clock::now();
    auto sv = p.c->save(*rid, keys, ids, 600'000'000);
    const double ss = std::chrono::duration<double>(Clock::now() - t0).count();
    sw.push_back(static_cast<double>(total) / ss);
    const std::string m1 = p.d->metrics_text();
    sph.push_back(describe(phases(m0, "save"), phases(m1, "save"), ss));
    if (!sv.ok() || sv->done != static_cast<uint32_t>(n)) {
      std::fprintf(stderr, "disk bench: save: %u of %lld\n", sv.ok() ? sv->done : 0u, (long long)n);
      rc = 1;
    }
    fr.push_back(fio_bw(dir, "read", slot, static_cast<uint64_t>(n) * slot));
    fs::remove(dir + "/fio.dat");
    mc.push_back(memcpy_bw(b, total));
    const std::string m2 = p.d->metrics_text();
    t0 = Clock::now();
    auto ld = p.c->load(*rid, keys, ids, 600'000'000);
    const double ls = std::chrono::duration<double>(Clock::now() - t0).count();
    lw.push_back(static_cast<double>(total) / ls);
    lph.push_back(describe(phases(m2, "load"), phases(p.d->metrics_text(), "load"), ls));
    if (!ld.ok() || ld->done != static_cast<uint32_t>(n)) {
      std::fprintf(stderr, "disk bench: load: %u of %lld\n", ld.ok() ? ld->done : 0u, (long long)n);
      rc = 1;
    }
  }
  const char* mode = write_through ? "write-through" : "write-back";
  const std::string tag = std::to_string(block >> 10) + "KiB x " + std::to_string(n) + " kvferryd " + mode;
  rep.add({"save " + tag, median3(sw) / 1e9, "GB/s", median3(fw) / 1e9, "fio io_uring qd32 bs=slot write", true, 0.9,
           std::string(mode) + ", 512 MiB host pool, XXH3"});
  rep.add({"load " + tag, median3(lw) / 1e9, "GB/s", median3(fr) / 1e9, "fio io_uring qd32 bs=slot read", true, 0.9,
           "promoted from disk (XXH3 checked by the tier)"});
  char host[160];
  std::snprintf(host, sizeof host, "host memcpy on 2 threads in the same rounds: %.2f GB/s (median)",
                median3(mc) / 1e9);
  rep.note(tag + ": " + host);
  for (size_t i = 0; i < sph.size(); ++i) {
    rep.note("save " + tag + " round " + std::to_string(i + 1) + ": " + sph[i]);
    rep.note("load " + tag + " round " + std::to_string(i + 1) + ": " + lph[i]);
  }
  return rc;
}

/// Fills a disk tier with 100 000 small blocks through a daemon, then times a daemon's start on it.
int restart_row(const std::string& dir, int64_t n, Report& rep) {
  namespace fs = std::filesystem;
  fs::remove(dir + "/kvferry-g3.slots");
  const uint64_t block = 4096;  // one layer of 8 tokens of mha:bf16:1x128
  const uint64_t disk = static_cast<uint64_t>(n) * store::DiskTier::slot_bytes_for(block) + (uint64_t{512} << 20);
  {
    InProcess p(dir, uint64_t{64} << 20, disk, true);
    if (!p.ok()) return 1;
    const int64_t per = 4096;
    const KvCacheSpec spec{1, per, 8, EntryFormat::mha(1, 128, DType::kBF16), Layout::kBlockMajor};
    auto rid = p.c->create_region("restart", spec);
    if (!rid.ok()) return 1;
    std::vector<int64_t> ids(static_cast<size_t>(per));
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t at = 0; at < n; at += per) {
      const int64_t m = std::min(per, n - at);
      std::vector<ops::Key> keys(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) keys[static_cast<size_t>(i)] = {0xFEED, static_cast<uint64_t>(at + i) + 1};
      auto sv = p.c->save(*rid, keys, std::span<const int64_t>(ids).first(static_cast<size_t>(m)), 600'000'000);
      if (!sv.ok() || sv->done != static_cast<uint32_t>(m)) return 1;
    }
  }
  InProcess p(dir, uint64_t{64} << 20, disk, true);
  if (!p.ok()) return 1;
  rep.add({"restart with " + std::to_string(n) + " blocks on disk", p.create_s, "s", 0, "", false, 0,
           "daemon create: host pool + disk tier recovery (slot headers read)"});
  return 0;
}

int run_disk(const Options& opts) {
  namespace fs = std::filesystem;
  std::string dir;
  bool daemon_only = false;
  std::vector<bool> modes{false, true};  // write-back (the default), write-through
  std::vector<uint64_t> sizes =
      opts.quick ? std::vector<uint64_t>{256 << 10, 1 << 20} : std::vector<uint64_t>{256 << 10, 1 << 20, 4 << 20};
  int rounds = 3;
  auto durability = config::DiskDurability::kBatch;
  for (const std::string& a : opts.args) {
    if (a == "--durability=batch") {
      durability = config::DiskDurability::kBatch;
    } else if (a == "--durability=none") {
      durability = config::DiskDurability::kNone;
    } else if (a == "--durability=each") {
      durability = config::DiskDurability::kEach;
    } else if (a == "--daemon-only") {
      daemon_only = true;
    } else if (a == "--mode=back") {
      modes = {false};
    } else if (a == "--mode=through") {
      modes = {true};
    } else if (a.rfind("--rounds=", 0) == 0) {
      rounds = std::max(1, std::atoi(a.c_str() + 9));
    } else if (a.rfind("--sizes=", 0) == 0) {  // KiB, comma-separated
      sizes.clear();
      for (size_t at = 8; at < a.size();) {
        const size_t comma = std::min(a.find(',', at), a.size());
        sizes.push_back(std::strtoull(a.substr(at, comma - at).c_str(), nullptr, 10) << 10);
        at = comma + 1;
      }
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr,
                   "disk bench: unknown argument %s (DIR --daemon-only --mode=back|through --rounds=N "
                   "--sizes=KiB,KiB --durability=none|batch|each)\n",
                   a.c_str());
      return 2;
    } else {
      dir = a;
    }
  }
  const bool keep_dir = !dir.empty();
  if (dir.empty()) dir = "kvferry-bench-disk";
  fs::create_directories(dir);
  Report rep("disk");
  const uint64_t max_total = opts.quick ? (uint64_t{512} << 20) : (uint64_t{4} << 30);
  const uint64_t pool_bytes = uint64_t{256} << 20;
  auto* pool = static_cast<uint8_t*>(std::aligned_alloc(4096, pool_bytes));
  for (uint64_t i = 0; i < pool_bytes; i += 8) {
    const uint64_t v = (i * 0x9e3779b97f4a7c15ull) | 0x0101010101010101ull;
    std::memcpy(pool + i, &v, 8);
  }
  int rc = 0;
  for (uint64_t block : sizes) {
    const uint64_t slot_bytes = store::DiskTier::slot_bytes_for(block);
    const uint64_t nblocks = std::min<uint64_t>(4096, max_total / block);
    const uint64_t slot = (block + 4095) / 4096 * 4096;
    const uint64_t pool_slots = pool_bytes / slot;
    std::vector<uint64_t> sums(pool_slots);
    for (uint64_t b = 0; b < pool_slots; ++b) sums[b] = store::block_checksum(pool + b * slot, block);
    const double fio_w = daemon_only ? 0 : fio_bw(dir, "write", slot_bytes, nblocks * slot_bytes);
    const double fio_r = daemon_only ? 0 : fio_bw(dir, "read", slot_bytes, nblocks * slot_bytes);
    fs::remove(dir + "/fio.dat");
    for (bool fallback : {false, true}) {
      if (daemon_only) break;
      fs::remove(dir + "/kvferry-g3.slots");
      store::DiskTier::Options o;
      o.path = dir;
      o.capacity = nblocks * slot_bytes + (uint64_t{512} << 20);
      o.force_fallback = fallback;
      o.log = [](std::string_view) {};
      auto t = store::DiskTier::open(o);
      if (!t.ok()) {
        std::fprintf(stderr, "disk bench: %s\n", t.status().to_string().c_str());
        return 1;
      }
      const iovec iov{pool, pool_bytes};
      (void)(*t)->register_buffers({&iov, 1});
      const Run r = run_tier(**t, block, nblocks, pool, pool_slots, sums);
      if (!r.ok) rc = 1;
      const std::string tag = std::to_string(block >> 10) + "KiB " + std::string((*t)->engine());
      rep.add({"write " + tag, r.write_bps / 1e9, "GB/s", fio_w / 1e9, "fio io_uring qd32 bs=slot", true,
               fallback ? 0 : 0.9, ""});
      rep.add({"read " + tag, r.read_bps / 1e9, "GB/s", fio_r / 1e9, "fio io_uring qd32 bs=slot", true,
               fallback ? 0 : 0.9, "XXH3 verified"});
    }
    fs::remove(dir + "/kvferry-g3.slots");
    // Through the daemon: 4096 blocks, at most max_total bytes (this machine's disk and memory).
    const int64_t n = static_cast<int64_t>(std::min<uint64_t>(4096, max_total / block));
    for (bool wt : modes)
      if (daemon_rows(dir, block, n, wt, rounds, durability, rep) != 0) rc = 1;
  }
  if (!daemon_only && restart_row(dir, opts.quick ? 20000 : 100000, rep) != 0) rc = 1;
  rep.note("kvferryd rows: at most " + std::to_string(max_total >> 20) +
           " MiB per size (4096 blocks up to 1 MiB; fewer of 4 MiB), host pool 512 MiB, CPU backend, durability " +
           std::string(durability == config::DiskDurability::kNone   ? "none"
                       : durability == config::DiskDurability::kEach ? "each"
                                                                     : "batch") +
           ", medians of " + std::to_string(rounds) +
           " rounds, each next to a fio round on the same file system; write-back saves write down all but the "
           "last ~450 MiB (the pool keeps them), and their loads find those on the host");
  std::free(pool);
  if (!keep_dir) fs::remove_all(dir);
  const int frc = rep.finish(opts);
  return rc ? rc : frc;
}

}  // namespace

KVFERRY_BENCH_SUITE_WITH_OPTIONS(
    "disk", "disk tier (G3) write/read of 256 KiB-4 MiB blocks vs fio io_uring O_DIRECT qd32", run_disk,
    "  DIR                              directory to use (default ./kvferry-bench-disk, removed afterwards)\n"
    "  --daemon-only                    only the daemon rows (no bare-tier or restart rows)\n"
    "  --mode=back|through              write-back or write-through only (default both)\n"
    "  --rounds=N                       rounds per size (default 3)\n"
    "  --sizes=KiB,KiB                  block sizes (default 256,1024,4096)\n"
    "  --durability=none|batch|each     tiers.disk.durability (default batch)\n");

}  // namespace kvferry::bench
