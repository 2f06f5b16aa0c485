// kvferry-bench disk: the disk tier (G3) writing and reading blocks of 256 KiB, 1 MiB and 4 MiB
// next to fio (io_uring, O_DIRECT, iodepth 32, bs = the tier's slot size) on the same file system
// in the same run. The tier is driven directly (host buffers stand in for host-pool slots, one
// registered chunk); the daemon's path through it is measured once it is integrated.
// Arguments after --: the directory to use (default ./kvferry-bench-disk, removed afterwards).
#include <sys/uio.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench.h"
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

int run_disk(const Options& opts) {
  namespace fs = std::filesystem;
  const std::string dir = opts.args.empty() ? std::string("kvferry-bench-disk") : opts.args[0];
  fs::create_directories(dir);
  Report rep("disk");
  const std::vector<uint64_t> sizes =
      opts.quick ? std::vector<uint64_t>{256 << 10, 1 << 20} : std::vector<uint64_t>{256 << 10, 1 << 20, 4 << 20};
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
    const double fio_w = fio_bw(dir, "write", slot_bytes, nblocks * slot_bytes);
    const double fio_r = fio_bw(dir, "read", slot_bytes, nblocks * slot_bytes);
    fs::remove(dir + "/fio.dat");
    for (bool fallback : {false, true}) {
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
  }
  std::free(pool);
  if (opts.args.empty()) fs::remove_all(dir);
  const int frc = rep.finish(opts);
  return rc ? rc : frc;
}

}  // namespace

KVFERRY_BENCH_SUITE("disk", "disk tier (G3) write/read of 256 KiB-4 MiB blocks vs fio io_uring O_DIRECT qd32",
                    run_disk);

}  // namespace kvferry::bench
