// kvferry-bench remote: the remote tier's transport between two processes on this machine. Get and
// put of up to 4096 blocks (64 KiB, 256 KiB, 1 MiB, 4 MiB; total bytes capped for this machine),
// one batch (one flush) per round, next to ucx_perftest (-t ucp_get / -t ucp_put_bw, server and
// client on loopback) with the same UCX_TLS and message size in the same run, rounds interleaved
// and medians taken (this VM is noisy). Also the round trip of a 16-key lookup (p50/p99) next to
// ucx_perftest's active-message latency, and the time from a peer's death (kill -9 mid-batch) to
// the first error the caller sees.
// Then the same through two kvferryd processes (the remote tier as engines see it): a client of B
// loads blocks only A holds (B looks them up at A, gets them, verifies them, copies them into its
// region), a client of A sends blocks to B (saved on A, put into B's pool, verified by B), a
// client lookup of 16 keys B must ask A for, and a kill -9 of A in the middle of B's load.
// Arguments after --: --tls=tcp|shm|both (shm = cma,tcp: see the note), --sizes=64,1024 (KiB),
// --rounds=N, --cap=MiB (bytes per round and size), --no-daemons, --local (only the region-to-region
// sends between two daemons of this host), --backend=cpu|cuda (their regions).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "kvferry/connector/client.h"
#include "kvferry/store/placement.h"
#include "kvferry/store/remote_wire.h"
#include "kvferry/store/ucx_transport.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "copy_victim.h"
#include "kvferry/kernels/copy_blocks.h"
#endif

namespace kvferry::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using store::RemoteCopy;
using store::UcxTransport;

uint8_t* map_pool(uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  auto* b = static_cast<uint8_t*>(p);
  for (uint64_t i = 0; i < bytes; i += 4096) b[i] = uint8_t(i >> 12 | 1);  // touched, not zero
  return b;
}

// ---- the peer: this binary run again with KVFERRY_BENCH_REMOTE_* set ----

int run_peer() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const uint64_t bytes = std::strtoull(std::getenv("KVFERRY_BENCH_REMOTE_POOL"), nullptr, 10);
  const int report = std::atoi(std::getenv("KVFERRY_BENCH_REMOTE_FD"));
  uint8_t* pool = map_pool(bytes);
  if (!pool) return 2;
  UcxTransport::Options o;
  o.name = "bench-peer";
  o.tls = std::getenv("KVFERRY_BENCH_REMOTE_TLS");
  o.listen = std::string(o.tls) == "tcp";
  o.pool = pool;
  o.pool_bytes = bytes;
  o.log = [](const std::string&) {};
  o.on_request = [](const store::PeerInfo&, uint16_t op,
                    std::span<const uint8_t> body) -> Result<std::vector<uint8_t>> {
    if (op != uint16_t(store::wire::RemoteOp::kLookup)) return Status(ErrorCode::kUnsupported, "op");
    KVFERRY_ASSIGN_OR_RETURN(auto q, store::wire::LookupRequest::decode(body));
    store::wire::LookupReply r;
    for (auto& k : q.keys) r.entries.push_back({true, (k.lo % 64) << 20, 1u << 20, k.hi, "bf16"});
    return r.encode();
  };
  auto t = UcxTransport::create(o);
  std::ostringstream s;
  if (!t.ok()) {
    s << "error " << t.status().to_string() << "\n\n";
  } else {
    s << (*t)->listen_port() << "\n";
    for (uint8_t b : (*t)->worker_address()) s << char("0123456789abcdef"[b >> 4]) << char("0123456789abcdef"[b & 15]);
    s << "\n";
  }
  const std::string msg = s.str();
  if (::write(report, msg.data(), msg.size()) != ssize_t(msg.size())) return 3;
  ::close(report);
  if (!t.ok()) return 2;
  pollfd pf{0, POLLIN, 0};
  const auto end = Clock::now() + 30min;
  char buf[64];
  while (Clock::now() < end)
    if (::poll(&pf, 1, 500) > 0 && ::read(0, buf, sizeof buf) <= 0) break;
  return 0;
}

[[maybe_unused]] const bool kIsPeer = [] {
  if (std::getenv("KVFERRY_BENCH_REMOTE_POOL")) ::_exit(run_peer());
  return false;
}();

struct Peer {
  pid_t pid = -1;
  int stdin_w = -1;
  uint16_t port = 0;
  std::vector<uint8_t> worker_address;
  std::string error;
  ~Peer() {
    if (stdin_w >= 0) ::close(stdin_w);
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

std::unique_ptr<Peer> spawn_peer(const std::string& tls, uint64_t pool_bytes) {
  auto p = std::make_unique<Peer>();
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    p->error = "no /proc/self/exe";
    return p;
  }
  exe[n] = 0;
  int rep[2], in[2];
  if (::pipe2(rep, O_CLOEXEC) != 0 || ::pipe2(in, O_CLOEXEC) != 0) {
    p->error = "pipe";
    return p;
  }
  p->pid = ::fork();
  if (p->pid == 0) {
    ::dup2(in[0], 0);
    int fd = ::dup(rep[1]);
    ::setenv("KVFERRY_BENCH_REMOTE_FD", std::to_string(fd).c_str(), 1);
    ::setenv("KVFERRY_BENCH_REMOTE_POOL", std::to_string(pool_bytes).c_str(), 1);
    ::setenv("KVFERRY_BENCH_REMOTE_TLS", tls.c_str(), 1);
    ::execl(exe, exe, "--list", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(rep[1]);
  p->stdin_w = in[1];
  std::string out;
  pollfd pf{rep[0], POLLIN, 0};
  const auto end = Clock::now() + 60s;  // populating a large pool takes a while on this VM
  while (Clock::now() < end && std::count(out.begin(), out.end(), '\n') < 2) {
    if (::poll(&pf, 1, 100) <= 0) continue;
    char buf[4096];
    ssize_t k = ::read(rep[0], buf, sizeof buf);
    if (k <= 0) break;
    out.append(buf, size_t(k));
  }
  ::close(rep[0]);
  std::istringstream is(out);
  std::string first, hex;
  std::getline(is, first);
  std::getline(is, hex);
  if (first.empty() || first.rfind("error", 0) == 0) {
    p->error = first.empty() ? "peer did not start" : first;
    return p;
  }
  p->port = uint16_t(std::atoi(first.c_str()));
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    p->worker_address.push_back(uint8_t(std::strtoul(hex.substr(i, 2).c_str(), nullptr, 16)));
  return p;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string run_capture(const std::string& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return "";
  std::string out;
  char buf[4096];
  while (size_t k = std::fread(buf, 1, sizeof buf, p)) out.append(buf, k);
  ::pclose(p);
  return out;
}

/// The numbers of ucx_perftest's final (-f) line: iterations, latency 50%/avg/overall (us),
/// bandwidth avg/overall (MB/s = MiB/s), message rate avg/overall. Empty when it failed.
std::vector<double> perftest(const std::string& tls, const std::string& test, uint64_t size, uint64_t iters) {
  const int port = free_port();
  if (!port) return {};
  const std::string envs = "UCX_TLS=" + tls + " ";
  const std::string common = " -p " + std::to_string(port) + " -t " + test + " -s " + std::to_string(size) + " -n " +
                             std::to_string(iters) + " -w " + std::to_string(std::max<uint64_t>(iters / 10, 4)) +
                             " -f -e -O 32";  // 32 in flight: without -O a ucp_get round waits for each get
  pid_t srv = ::fork();
  if (srv == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int dn = ::open("/dev/null", O_RDWR);
    ::dup2(dn, 1);
    ::dup2(dn, 2);
    const std::string cmd = "exec env " + envs + "timeout 120 ucx_perftest -p " + std::to_string(port);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // The server takes exactly one TCP connection for its set-up, so it is not probed: the client
  // is retried (bounded) until the server listens.
  std::string out;
  for (int i = 0; i < 25 && out.find_first_of("0123456789") == std::string::npos; ++i) {
    std::this_thread::sleep_for(200ms);
    out = run_capture(envs + "timeout 120 ucx_perftest 127.0.0.1" + common + " 2>/dev/null | tail -n 1");
  }
  ::kill(srv, SIGKILL);
  ::waitpid(srv, nullptr, 0);
  std::istringstream is(out);
  std::vector<double> v;
  double x;
  while (is >> x) v.push_back(x);
  return v.size() >= 8 ? v : std::vector<double>{};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- through two kvferryd processes ----

/// A kvferryd started from the binary next to this one, with its config in a temporary directory.
struct DaemonProc {
  pid_t pid = -1;
  std::string dir, socket, error;
  int port = 0;
  ~DaemonProc() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (!dir.empty() && std::system(("rm -rf '" + dir + "'").c_str()) != 0)
      std::fprintf(stderr, "rm %s\n", dir.c_str());
  }
  std::string id() const { return "127.0.0.1:" + std::to_string(port); }
};

std::unique_ptr<DaemonProc> spawn_daemon(int port, const std::vector<int>& peers, uint64_t pool_bytes,
                                         const std::string& backend = "cpu", int gpu = 0) {
  auto d = std::make_unique<DaemonProc>();
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    d->error = "no /proc/self/exe";
    return d;
  }
  exe[n] = 0;
  std::string bin(exe);
  bin = bin.substr(0, bin.rfind('/') + 1) + "kvferryd";
  if (::access(bin.c_str(), X_OK) != 0) {
    d->error = "no kvferryd next to kvferry-bench (" + bin + ")";
    return d;
  }
  char tmpl[] = "/tmp/kvferry-bench-remote-XXXXXX";
  if (!::mkdtemp(tmpl)) {
    d->error = "mkdtemp";
    return d;
  }
  d->dir = tmpl;
  d->socket = d->dir + "/kvferry.sock";
  d->port = port;
  std::string peer_list;
  for (int p : peers) peer_list += (peer_list.empty() ? "\"127.0.0.1:" : ", \"127.0.0.1:") + std::to_string(p) + "\"";
  const std::string cfg = d->dir + "/kvferry.yaml";
  {
    std::ofstream f(cfg);
    f << "daemon:\n  socket: " << d->socket << "\n  log_level: warn\n  metrics_listen: \"\"\n"
      << "device:\n  backend: " << backend << "\n  gpu: " << gpu << "\n"
      << "tiers:\n  host:\n    capacity: " << pool_bytes << "\n  remote:\n    listen: 127.0.0.1:" << port
      << "\n    peers: [" << peer_list << "]\n    transport: tcp\n    timeout: 60s\n"
      << "limits:\n  request_timeout: 120s\n";
  }
  d->pid = ::fork();
  if (d->pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int lf = ::open((d->dir + "/kvferryd.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(lf, 1);
    ::dup2(lf, 2);
    ::execl(bin.c_str(), bin.c_str(), "--config", cfg.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto end = Clock::now() + 60s;  // populating the pool takes a while
  while (Clock::now() < end) {
    Client::Options o;
    o.socket = d->socket;
    if (Client::connect(o).ok()) return d;
    int st;
    if (::waitpid(d->pid, &st, WNOHANG) == d->pid) {
      d->pid = -1;
      break;
    }
    std::this_thread::sleep_for(50ms);
  }
  std::ifstream lf(d->dir + "/kvferryd.log");
  std::stringstream ss;
  ss << lf.rdbuf();
  d->error = "kvferryd did not start: " + ss.str();
  return d;
}

std::unique_ptr<Client> bench_client(const DaemonProc& d) {
  Client::Options o;
  o.socket = d.socket;
  o.name = "kvferry-bench";
  o.model = "bench";
  auto c = Client::connect(o);
  return c.ok() ? std::move(*c) : nullptr;
}

/// Two daemons A and B on free loopback ports (static peers of each other, `pool` bytes of host
/// pool, regions on `backend`) and a client of each.
struct TwoDaemons {
  std::unique_ptr<DaemonProc> a, b;
  std::unique_ptr<Client> ca, cb;
};

/// Starts them; false (with the reason printed and rc = 1) when they cannot start.
bool start_two(uint64_t pool, const std::string& backend, TwoDaemons& t, int& rc, int gpu_a = 0, int gpu_b = 0) {
  const int pa = free_port(), pb = free_port();
  t.a = spawn_daemon(pa, {pa, pb}, pool, backend, gpu_a);
  t.b = t.a->error.empty() ? spawn_daemon(pb, {pa, pb}, pool, backend, gpu_b) : nullptr;
  if (!t.a->error.empty() || !t.b->error.empty()) {
    std::fprintf(stderr, "remote bench: %s\n", (t.a->error.empty() ? t.b->error : t.a->error).c_str());
    rc = 1;
    return false;
  }
  t.ca = bench_client(*t.a);
  t.cb = bench_client(*t.b);
  if (!t.ca || !t.cb) {
    std::fprintf(stderr, "remote bench: cannot connect to the daemons\n");
    rc = 1;
    return false;
  }
  return true;
}

/// Region `name` of `n` blocks of `size` bytes (MHA 1x128 bf16, 512 B per token, x 64 tokens x
/// size/32 KiB layers, block-major) on A and on B: their ids, or nullopt (printed, rc = 1).
std::optional<std::pair<uint32_t, uint32_t>> two_regions(TwoDaemons& t, const std::string& name, uint64_t size,
                                                         uint64_t n, int& rc) {
  const KvCacheSpec spec{int64_t(size / (32u << 10)), int64_t(n), 64, EntryFormat::mha(1, 128, DType::kBF16),
                         Layout::kBlockMajor};
  auto ra = t.ca->create_region(name, spec);
  auto rb = t.cb->create_region(name, spec);
  if (!ra.ok() || !rb.ok()) {
    std::fprintf(stderr, "remote bench: region: %s\n", (ra.ok() ? rb.status() : ra.status()).to_string().c_str());
    rc = 1;
    return std::nullopt;
  }
  return std::make_pair(*ra, *rb);
}

/// `n` keys of round `round` whose rendezvous owner (over `ids`) is `ids[owner]`.
std::vector<ops::Key> keys_owned_by(const std::vector<std::string>& ids, size_t owner, uint64_t n, uint64_t round) {
  const store::RendezvousPlacement pl(ids);
  std::vector<ops::Key> out;
  for (uint64_t i = 0; out.size() < n; ++i) {
    const ops::Key k{0xBE7C000000000000ull ^ round, i * 0x9e3779b97f4a7c15ull + 1};
    if (pl.owners({k.hi, k.lo}, 1).front() == owner) out.push_back(k);
  }
  return out;
}

bool all_done(const Result<Client::OpResult>& r, uint64_t n, const char* what, int& rc) {
  if (r.ok() && r->done == n) return true;
  std::fprintf(stderr, "remote bench: %s: %s\n", what,
               r.ok() ? (std::to_string(r->done) + " of " + std::to_string(n) + " blocks, first error " +
                         std::to_string(int(r->status)))
                            .c_str()
                      : r.status().to_string().c_str());
  rc = 1;
  return false;
}

void daemon_rows(Report& rep, const Options& opts, const std::vector<uint64_t>& sizes, int rounds, uint64_t cap,
                 int& rc) {
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  const uint64_t per_size = std::max(std::min<uint64_t>(cap, 4096 * max_size), max_size * 2);
  // A holds one size's blocks, B fetches them (and receives sends): room for both, and slack.
  const uint64_t pool = per_size * 2 + (uint64_t{128} << 20);
  TwoDaemons t;
  if (!start_two(pool, "cpu", t, rc)) return;
  auto &a = t.a, &b = t.b;
  auto &ca = t.ca, &cb = t.cb;
  const std::vector<std::string> ids{a->id(), b->id()};
  std::vector<ops::Key> last_keys;
  uint32_t last_rb = 0;
  std::vector<int64_t> last_ids;
  for (uint64_t size : sizes) {
    const uint64_t n = std::min<uint64_t>(4096, per_size / size);
    const auto regions = two_regions(t, "bench-" + std::to_string(size >> 10) + "k", size, n, rc);
    if (!regions) return;
    const uint32_t* ra = &regions->first;
    const uint32_t* rb = &regions->second;
    const int64_t region_bytes = int64_t(n * size);
    auto base = ca->map_region(*ra);
    if (base.ok()) {
      auto* p = static_cast<uint8_t*>(*base);
      for (int64_t i = 0; i < region_bytes; i += 4096) p[i] = uint8_t(i >> 12 | 1);
    }
    std::vector<int64_t> bids(n);
    for (uint64_t i = 0; i < n; ++i) bids[i] = int64_t(i);
    std::vector<double> load_bw, send_bw, get_base, put_base;
    // Each size starts from empty pools (an earlier size's blocks would be evicted under this one's).
    (void)ca->evict(0, {}, ops::kEvictAllNs);
    (void)cb->evict(0, {}, ops::kEvictAllNs);
    const auto keys = keys_owned_by(ids, 0, n, size);
    if (!all_done(ca->save(*ra, keys, bids), n, "save on A", rc)) return;
    for (int r = 0; r < rounds; ++r) {
      (void)cb->evict(*rb, {}, ops::kEvictAll);  // B asks A again every round
      auto t0 = Clock::now();
      auto ld = cb->load(*rb, keys, bids);
      const double ls = std::chrono::duration<double>(Clock::now() - t0).count();
      load_bw.push_back(all_done(ld, n, "load on B of A's blocks", rc) ? double(n * size) / ls : 0);
      const auto sk = keys_owned_by(ids, 0, n, (size << 8) + uint64_t(r) + 1);  // fresh keys: nothing to skip
      t0 = Clock::now();
      auto sd = ca->send(*ra, sk, bids, b->id());
      const double ss = std::chrono::duration<double>(Clock::now() - t0).count();
      send_bw.push_back(all_done(sd, n, "send A -> B", rc) ? double(n * size) / ss : 0);
      (void)ca->evict(*ra, sk, 0);
      (void)cb->evict(*rb, sk, 0);
      auto g = perftest("tcp", "ucp_get", size, n);
      auto pp = perftest("tcp", "ucp_put_bw", size, n);
      get_base.push_back(g.empty() ? 0 : g[5] * 1048576.0);
      put_base.push_back(pp.empty() ? 0 : pp[5] * 1048576.0);
    }
    const std::string what = human_bytes(int64_t(size)) + " x" + std::to_string(n) + " tcp";
    rep.add({"daemons: load on B of A's blocks " + what, median(load_bw) / 1e9, "GB/s", median(get_base) / 1e9,
             "ucx_perftest -t ucp_get -e -O32 tcp", true, 0.8, "lookup + get + XXH3 check + copy into the region"});
    rep.add({"daemons: send A -> B " + what, median(send_bw) / 1e9, "GB/s", median(put_base) / 1e9,
             "ucx_perftest -t ucp_put_bw -e -O32 tcp", true, 0.8,
             "save on A (copy + XXH3) + reserve + put + B's XXH3 check"});
    last_keys = keys;
    last_rb = *rb;
    last_ids = bids;
  }

  // A client lookup of 16 keys that B does not hold: B asks their owner A (one control round trip).
  {
    std::vector<ops::Key> k16(last_keys.begin(), last_keys.begin() + std::min<size_t>(16, last_keys.size()));
    (void)cb->evict(last_rb, {}, ops::kEvictAll);
    std::vector<double> us;
    for (int i = 0; i < (opts.quick ? 200 : 2000); ++i) {
      const auto t0 = Clock::now();
      auto r = cb->lookup(last_rb, k16);
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (!r.ok() || r->done != k16.size()) {
        std::fprintf(stderr, "remote bench: remote lookup found %u of %zu\n", r.ok() ? r->done : 0, k16.size());
        rc = 1;
        break;
      }
    }
    std::sort(us.begin(), us.end());
    auto pt = perftest("tcp", "ucp_am_lat", 300, opts.quick ? 200 : 2000);
    const double rtt = pt.empty() ? 0 : 2 * pt[1];
    rep.add({"daemons: client lookup 16 remote keys p50 tcp", us[us.size() / 2], "us", rtt,
             "ucx_perftest ucp_am_lat RTT p50", false, 0, "client ring -> B -> A -> B -> client"});
    rep.add({"daemons: client lookup 16 remote keys p99 tcp", us[us.size() * 99 / 100], "us", rtt,
             "ucx_perftest ucp_am_lat RTT p50", false, 0, ""});
  }

  // kill -9 of A in the middle of B's load of A's blocks: time to the client's completion.
  {
    (void)cb->evict(last_rb, {}, ops::kEvictAll);
    auto fut = std::async(std::launch::async, [&] { return cb->load(last_rb, last_keys, last_ids); });
    std::this_thread::sleep_for(20ms);
    const auto t0 = Clock::now();
    ::kill(a->pid, SIGKILL);
    ::waitpid(a->pid, nullptr, 0);
    a->pid = -1;
    auto res = fut.get();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    uint64_t lost = 0;
    if (res.ok())
      for (ErrorCode e : res->blocks) lost += e == ErrorCode::kUnavailable;
    rep.add({"daemons: A killed -9 mid-load -> B's client completes", ms, "ms", 20000, "2 x lease TTL (10 s)", false, 0,
             res.ok()
                 ? std::to_string(res->done) + " blocks loaded, " + std::to_string(lost) + " kUnavailable (peer lost)"
                 : res.status().to_string()});
  }
}

#if defined(KVFERRY_WITH_CUDA)
/// Device buffers of `bytes` on `da` and `db` (peer access enabled between them where they differ)
/// and a stream on `da`; false (nothing left allocated) when they cannot be had.
bool two_buffers(uint64_t bytes, int da, int db, void** a, void** b, cudaStream_t* s) {
  *a = *b = nullptr;
  *s = nullptr;
  bool ok = cudaSetDevice(db) == cudaSuccess && cudaMalloc(b, bytes) == cudaSuccess;
  ok = ok && cudaSetDevice(da) == cudaSuccess && cudaMalloc(a, bytes) == cudaSuccess;
  if (ok && da != db) {
    const cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
    ok = e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
  }
  ok = ok && cudaStreamCreateWithFlags(s, cudaStreamNonBlocking) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    if (*a) cudaFree(*a);
    if (*b) cudaFree(*b);
    *a = *b = nullptr;
  }
  return ok;
}

/// One copy of `bytes` from device `da` to device `db` (the limit of a region-to-region send
/// between daemons on those GPUs: a device-to-device copy on one, cudaMemcpyPeerAsync over NVLink
/// between two): GB/s, median of `rounds`; 0 when it cannot run.
double d2d_limit(uint64_t bytes, int rounds, int da, int db) {
  void *a = nullptr, *b = nullptr;
  cudaStream_t s = nullptr;
  if (!two_buffers(bytes, da, db, &a, &b, &s)) {
    (void)cudaGetLastError();
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    return 0;
  }
  std::vector<double> bw;
  for (int r = 0; r < rounds + 1; ++r) {
    const auto t0 = Clock::now();
    if (da == db)
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s);
    else
      cudaMemcpyPeerAsync(b, db, a, da, bytes, s);
    cudaStreamSynchronize(s);
    if (r) bw.push_back(double(bytes) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  cudaStreamDestroy(s);
  cudaFree(a);
  cudaFree(b);
  return median(bw);
}

/// The same block copies as a send (block i of a region to block `to[i]` of another, `size` bytes
/// each) as batched DMA in this process from device `da` to `db` (kernels::BlockCopier, the
/// daemon's copier): what the copy engines give such a batch without the daemons. GB/s, median of
/// `rounds`; 0 when it cannot run.
double batch_limit(uint64_t size, const std::vector<int64_t>& to, int rounds, int da, int db) {
  const uint64_t n = to.size(), bytes = n * size;
  void *a = nullptr, *b = nullptr;
  cudaStream_t s = nullptr;
  if (!two_buffers(bytes, da, db, &a, &b, &s)) return 0;
  auto copier = kernels::BlockCopier::create(int64_t(n));
  if (!copier.ok()) {
    cudaStreamDestroy(s);
    cudaFree(a);
    cudaFree(b);
    return 0;
  }
  std::vector<CopyRun> runs(n);
  for (uint64_t i = 0; i < n; ++i) runs[i] = {int64_t(i * size), to[i] * int64_t(size), int64_t(size)};
  std::vector<double> bw;
  for (int r = 0; r < rounds + 1; ++r) {
    const auto t0 = Clock::now();
    const Status st = (*copier)->copy(a, b, runs, kernels::CopyEngine::kDma, s);
    cudaStreamSynchronize(s);
    if (r && st.ok()) bw.push_back(double(bytes) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  copier->reset();
  cudaStreamDestroy(s);
  cudaFree(a);
  cudaFree(b);
  return bw.empty() ? 0 : median(bw);
}

/// Milliseconds per launch of a memory-bound kernel (copy_victim.h) on GPU 0 in this process,
/// median of 7 x 40 launches; < 0 when it cannot run.
double victim_ms(float* y, const float* x, int64_t n, cudaStream_t s) {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) return -1;
  std::vector<double> ms;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0, s);
    for (int k = 0; k < 40; ++k) launch_victim_stream(y, x, n, s);
    cudaEventRecord(e1, s);
    float t = 0;
    if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&t, e0, e1) != cudaSuccess) return -1;
    ms.push_back(double(t) / 40);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(ms);
}
#endif

/// Memcpy of `bytes` between two buffers (the limit of a region-to-region send between daemons
/// with host regions): GB/s, median of `rounds`.
double memcpy_limit(uint64_t bytes, int rounds) {
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  std::vector<double> bw;
  for (int r = 0; r < rounds + 1; ++r) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (r) bw.push_back(double(bytes) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(bw);
}

/// Two daemons of this host, a client of A sending into B's region (tiers.remote.local_transfer:
/// B's region imported once, then copied into region to region, nothing stored), up to 4096 blocks
/// of each size, next to one copy of the same bytes in the same run: device to device on GPU 0
/// with `backend` cuda (both daemons on one GPU: the path two GPUs of one host take, without
/// NVLink), memcpy with host regions.
void local_rows(Report& rep, const Options& opts, const std::vector<uint64_t>& sizes, int rounds, uint64_t cap,
                const std::string& backend, int& rc, int gpu_a = 0, int gpu_b = 0) {
  (void)opts;
  TwoDaemons t;
  if (!start_two(uint64_t{256} << 20, backend, t, rc, gpu_a, gpu_b)) return;  // nothing is stored on either side
  const std::string where = backend == "cuda" ? " gpu " + std::to_string(gpu_a) + "->" + std::to_string(gpu_b) : "";
  auto &a = t.a, &b = t.b;
  auto& ca = t.ca;
  for (uint64_t size : sizes) {
    const uint64_t n = std::min<uint64_t>(4096, std::max<uint64_t>(1, cap / size));
    const auto regions = two_regions(t, "local-" + std::to_string(size >> 10) + "k", size, n, rc);
    if (!regions) return;
    const uint32_t* ra = &regions->first;
    const uint32_t* rb = &regions->second;
    std::vector<int64_t> mine(n), theirs(n);
    for (uint64_t i = 0; i < n; ++i) {
      mine[i] = int64_t(i);
      theirs[i] = int64_t((i * 2654435761u) % n);  // scattered over B's region
    }
    std::vector<double> bw;
    for (int r = 0; r < rounds + 1; ++r) {  // the first round imports B's region: not counted
      const auto keys = keys_owned_by({a->id(), b->id()}, 0, n, (size << 8) + uint64_t(r) + 7);
      const auto t0 = Clock::now();
      auto sd = ca->send_into(*ra, keys, mine, b->id(), *rb, theirs);
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!all_done(sd, n, "send A -> B region to region", rc)) return;
      if (r) bw.push_back(double(n * size) / sec);
    }
    double limit = 0, batch = 0;
    std::string what = "memcpy of the same bytes";
    if (backend == "cuda") {
#if defined(KVFERRY_WITH_CUDA)
      limit = d2d_limit(n * size, rounds, gpu_a, gpu_b);
      batch = batch_limit(size, theirs, rounds, gpu_a, gpu_b);
      what = gpu_a == gpu_b ? "one cudaMemcpyAsync D2D" : "one cudaMemcpyPeerAsync";
#endif
    } else {
      limit = memcpy_limit(n * size, rounds);
    }
    rep.add({"daemons, one host: send A -> B region to region " + human_bytes(int64_t(size)) + " x" +
                 std::to_string(n) + " " + backend + where,
             median(bw) / 1e9, "GB/s", limit / 1e9, what, true, backend == "cuda" && size >= (256u << 10) ? 0.9 : 0,
             backend == "cuda" ? "DMA from A's region into B's (imported), + B's check of the ids"
                               : "memcpy from A's region into B's (imported), + B's check of the ids"});
    if (batch > 0)
      rep.add({"daemons, one host: the same, next to its copies batched in one process " + human_bytes(int64_t(size)) +
                   " x" + std::to_string(n) + " " + backend + where,
               median(bw) / 1e9, "GB/s", batch / 1e9, "the same runs, one cudaMemcpyBatchAsync", true, 0,
               "what the daemons add to the copy engines' time"});
  }
#if defined(KVFERRY_WITH_CUDA)
  // What the sends cost an engine on the receiving GPU: a memory-bound kernel in this process (a
  // third one), timed alone and while A sends 1 MiB blocks into B's region back to back.
  if (backend == "cuda") {
    const uint64_t size = 1u << 20, n = 1024;
    const auto vr = two_regions(t, "victim", size, n, rc);
    float *x = nullptr, *y = nullptr;
    cudaStream_t s = nullptr;
    const int64_t elems = int64_t{64} << 20;  // 768 MB moved per launch
    if (vr && cudaSetDevice(gpu_b) == cudaSuccess &&
        cudaMalloc(reinterpret_cast<void**>(&x), elems * 4) == cudaSuccess &&
        cudaMalloc(reinterpret_cast<void**>(&y), elems * 4) == cudaSuccess &&
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
      cudaMemset(x, 0, size_t(elems) * 4);
      cudaMemset(y, 0, size_t(elems) * 4);
      std::vector<int64_t> ids(n);
      for (uint64_t i = 0; i < n; ++i) ids[i] = int64_t(i);
      const double alone = victim_ms(y, x, elems, s);
      std::atomic<bool> stop{false};
      std::atomic<uint64_t> sent{0};
      const auto t0 = Clock::now();
      std::thread sender([&] {
        for (uint64_t r = 0; r < 100000 && !stop.load(); ++r) {
          const auto keys = keys_owned_by({a->id(), b->id()}, 0, n, (uint64_t{1} << 40) + r);
          auto sd = ca->send_into(vr->first, keys, ids, b->id(), vr->second, ids);
          if (!sd.ok() || sd->done != n) break;
          sent += n * size;
        }
      });
      std::this_thread::sleep_for(20ms);
      const double with = victim_ms(y, x, elems, s);
      stop = true;
      sender.join();
      const double gbs = double(sent.load()) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
      if (alone > 0 && with > 0)
        rep.add({"another process's memory-bound kernel on the receiving GPU, region-to-region sends" + where, with,
                 "ms", alone, "same kernel alone", false, 0.97,
                 "slowdown x" + std::to_string(with / alone).substr(0, 5) + " (limit 1.03); sends ran at " +
                     std::to_string(gbs).substr(0, 6) + " GB/s"});
    } else {
      std::fprintf(stderr, "remote bench: the interference row cannot run\n");
    }
    if (s) cudaStreamDestroy(s);
    if (x) cudaFree(x);
    if (y) cudaFree(y);
  }
#endif
  rep.note("region to region: two daemons on this host, " + backend +
           " regions; the first send of each size imports B's region and is not counted" +
           (backend != "cuda" ? std::string()
            : gpu_a == gpu_b  ? "; both daemons on GPU " + std::to_string(gpu_a) +
                                   ", so the copies stay inside it (daemons on two GPUs of one host take the same "
                                   "path over NVLink: --gpus=0,1)"
                             : "; A on GPU " + std::to_string(gpu_a) + ", B on GPU " + std::to_string(gpu_b) +
                                   ": A's copy engines write into B's GPU over the link between them"));
}

struct Mode {
  std::string name;  ///< row label
  std::string tls;
  bool by_address;
};

int run_remote(const Options& opts) {
  std::vector<Mode> modes{{"tcp", "tcp", false}, {"shm", "cma,tcp", true}};
  std::vector<uint64_t> sizes{64u << 10, 256u << 10, 1u << 20, 4u << 20};
  int rounds = opts.quick ? 1 : 3;
  bool daemons = true, local_only = false;
  std::string backend = "cpu";
  int gpus[2] = {0, 0};  // A's and B's GPU in the region-to-region rows
  uint64_t cap = opts.quick ? (uint64_t{256} << 20) : (uint64_t{1} << 30);
  for (const std::string& a : opts.args) {
    if (a == "--tls=tcp")
      modes.resize(1);
    else if (a == "--tls=shm")
      modes.erase(modes.begin());
    else if (a == "--tls=both") {
    } else if (a == "--no-daemons")
      daemons = false;
    else if (a == "--local")
      local_only = true;
    else if (a.rfind("--backend=", 0) == 0)
      backend = a.substr(10);
    else if (a.rfind("--gpus=", 0) == 0 && std::sscanf(a.c_str() + 7, "%d,%d", &gpus[0], &gpus[1]) == 2 &&
             gpus[0] >= 0 && gpus[1] >= 0) {
    } else if (a.rfind("--rounds=", 0) == 0)
      rounds = std::max(1, std::atoi(a.c_str() + 9));
    else if (a.rfind("--cap=", 0) == 0)
      cap = std::strtoull(a.c_str() + 6, nullptr, 10) << 20;
    else if (a.rfind("--sizes=", 0) == 0) {
      sizes.clear();
      for (size_t at = 8; at < a.size();) {
        const size_t comma = std::min(a.find(',', at), a.size());
        sizes.push_back(std::strtoull(a.substr(at, comma - at).c_str(), nullptr, 10) << 10);
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "remote bench: unknown argument %s (--tls=tcp|shm|both --sizes=KiB,.. --rounds=N --cap=MiB "
                   "--no-daemons --local --backend=cpu|cuda --gpus=A,B)\n",
                   a.c_str());
      return 2;
    }
  }
  if (backend != "cpu" && backend != "cuda") {
    std::fprintf(stderr, "remote bench: --backend=cpu|cuda, not %s\n", backend.c_str());
    return 2;
  }
  if (local_only) {
    Report rep("remote");
    int rc = 0;
    local_rows(rep, opts, sizes, rounds, cap, backend, rc, gpus[0], gpus[1]);
    const int frc = rep.finish(opts);
    return rc ? rc : frc;
  }
  if (run_capture("command -v ucx_perftest").empty()) {
    std::fprintf(stderr, "remote bench: ucx_perftest not found (Debian package ucx-utils)\n");
    return 1;
  }
  Report rep("remote");
  int rc = 0;
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  const uint64_t pool_bytes = std::max(std::min<uint64_t>(cap, 4096 * max_size), max_size * 2);
  uint8_t* pool = map_pool(pool_bytes);
  if (!pool) {
    std::fprintf(stderr, "remote bench: cannot map %llu bytes\n", static_cast<unsigned long long>(pool_bytes));
    return 1;
  }
  for (const Mode& m : modes) {
    auto peer = spawn_peer(m.tls, pool_bytes);
    if (!peer->error.empty()) {
      std::fprintf(stderr, "remote bench: peer over %s: %s\n", m.tls.c_str(), peer->error.c_str());
      rc = 1;
      continue;
    }
    UcxTransport::Options o;
    o.name = "bench";
    o.tls = m.tls;
    o.listen = false;
    o.pool = pool;
    o.pool_bytes = pool_bytes;
    o.op_timeout = 60s;
    o.log = [](const std::string& l) { std::fprintf(stderr, "remote bench: %s\n", l.c_str()); };
    auto t = UcxTransport::create(o);
    if (!t.ok()) {
      std::fprintf(stderr, "remote bench: %s\n", t.status().to_string().c_str());
      rc = 1;
      continue;
    }
    auto id = m.by_address ? (*t)->connect_worker(peer->worker_address) : (*t)->connect("127.0.0.1", peer->port);
    if (!id.ok()) {
      std::fprintf(stderr, "remote bench: connect over %s: %s\n", m.tls.c_str(), id.status().to_string().c_str());
      rc = 1;
      continue;
    }
    for (uint64_t size : sizes) {
      const uint64_t n = std::min<uint64_t>(4096, pool_bytes / size);
      std::vector<RemoteCopy> copies(n);
      for (uint64_t i = 0; i < n; ++i) copies[i] = {i * size, ((i * 2654435761u) % n) * size, size};  // scattered
      std::vector<double> ours[2], base[2];
      for (int r = 0; r < rounds; ++r) {
        for (int put = 0; put < 2; ++put) {
          const auto t0 = Clock::now();
          auto st = put ? (*t)->put(*id, copies) : (*t)->get(*id, copies);
          const double s = std::chrono::duration<double>(Clock::now() - t0).count();
          const bool all_ok = std::all_of(st.begin(), st.end(), [](const Status& x) { return x.ok(); });
          if (!all_ok) {
            for (auto& x : st)
              if (!x.ok()) {
                std::fprintf(stderr, "remote bench: %s\n", x.to_string().c_str());
                break;
              }
            rc = 1;
          }
          ours[put].push_back(all_ok ? double(n * size) / s : 0);
          auto pt = perftest(m.tls, put ? "ucp_put_bw" : "ucp_get", size, n);
          base[put].push_back(pt.empty() ? 0 : pt[5] * 1048576.0);
        }
      }
      for (int put = 0; put < 2; ++put) {
        const std::string what =
            std::string(put ? "put " : "get ") + human_bytes(int64_t(size)) + " x" + std::to_string(n) + " " + m.name;
        rep.add({what, median(ours[put]) / 1e9, "GB/s", median(base[put]) / 1e9,
                 std::string("ucx_perftest -t ") + (put ? "ucp_put_bw" : "ucp_get") + " -e -O32 " + m.tls, true,
                 m.name == "tcp" ? 0.8 : 0.9, "median of " + std::to_string(rounds)});
      }
    }

    // A remote lookup of 16 keys: one control round trip.
    {
      store::wire::LookupRequest q{"model|bf16|tenant", {}};
      for (uint64_t k = 0; k < 16; ++k) q.keys.push_back({k * 7919, k});
      const auto body = q.encode();
      std::vector<double> us;
      for (int i = 0; i < (opts.quick ? 200 : 2000); ++i) {
        const auto t0 = Clock::now();
        auto r = (*t)->call(*id, uint16_t(store::wire::RemoteOp::kLookup), body);
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        if (!r.ok()) {
          std::fprintf(stderr, "remote bench: lookup: %s\n", r.status().to_string().c_str());
          rc = 1;
          break;
        }
      }
      std::sort(us.begin(), us.end());
      auto pt = perftest(m.tls, "ucp_am_lat", body.size(), opts.quick ? 200 : 2000);
      const double rtt = pt.empty() ? 0 : 2 * pt[1];  // perftest prints half the round trip
      rep.add({"lookup 16 keys p50 " + m.name, us[us.size() / 2], "us", rtt, "ucx_perftest ucp_am_lat RTT p50", false,
               0, ""});
      rep.add({"lookup 16 keys p99 " + m.name, us[us.size() * 99 / 100], "us", rtt, "ucx_perftest ucp_am_lat RTT p50",
               false, 0, ""});
    }

    // A peer killed in the middle of a batch: how long until the caller has its errors.
    if (!m.by_address) {
      auto victim = spawn_peer(m.tls, 64u << 20);
      auto vid = victim->error.empty() ? (*t)->connect("127.0.0.1", victim->port)
                                       : Result<store::PeerId>(Status(ErrorCode::kUnavailable, victim->error));
      if (vid.ok()) {
        std::vector<RemoteCopy> big;
        for (uint64_t i = 0; i < 16; ++i) big.push_back({i << 22, i << 22, 4u << 20});
        ::kill(victim->pid, SIGSTOP);
        int st;
        for (int i = 0;
             i < 5000 && !(::waitpid(victim->pid, &st, WNOHANG | WUNTRACED) == victim->pid && WIFSTOPPED(st)); ++i)
          std::this_thread::sleep_for(1ms);
        auto fut = std::async(std::launch::async, [&] { return (*t)->get(*vid, big, 20s); });
        std::this_thread::sleep_for(100ms);
        const auto t0 = Clock::now();
        ::kill(victim->pid, SIGKILL);
        ::waitpid(victim->pid, nullptr, 0);
        victim->pid = -1;
        auto res = fut.get();
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        const bool typed = !res.empty() && res[0].code() == ErrorCode::kUnavailable;
        rep.add({"peer kill -9 -> first error " + m.name, ms, "ms", 20000, "2 x lease TTL (10 s)", false, 0,
                 typed ? "kUnavailable peer lost"
                       : "unexpected: " + (res.empty() ? std::string("none") : res[0].to_string())});
      }
    }
  }
  rep.note(
      "two processes on this machine; blocks scattered over the peer's pool, one batch (one flush) per round; "
      "at most " +
      std::to_string(cap >> 20) + " MiB per size (4096 blocks up to " + human_bytes(int64_t(cap / 4096)) + ")");
  rep.note(
      "shm = UCX_TLS=cma,tcp from worker addresses: with peer error handling (which the transport needs to turn a "
      "dead peer into an error), UCX 1.13 refuses posix and self (no peer-failure handler) and, measured, moves "
      "the one-sided data over tcp too (ucx_perftest -e agrees); ucx_perftest over posix,cma,self without -e "
      "reaches ~20 GB/s on 1 MiB gets: that gap is the price of peer error handling in this UCX");
  rep.note(
      "ucx_perftest runs with the same UCX_TLS, -e (peer error handling, as the transport) and -O 32 (32 "
      "operations in flight; without it ucp_get waits for each get)");
  ::munmap(pool, pool_bytes);
  if (daemons) daemon_rows(rep, opts, sizes, rounds, cap, rc);
  if (daemons) local_rows(rep, opts, sizes, rounds, cap, backend, rc, gpus[0], gpus[1]);
  const int frc = rep.finish(opts);
  return rc ? rc : frc;
}

}  // namespace

KVFERRY_BENCH_SUITE_WITH_OPTIONS(
    "remote", "remote tier: UCX get/put of 64 KiB-4 MiB blocks between two processes vs ucx_perftest", run_remote,
    "  --tls=tcp|shm|both   transports (UCX_TLS tcp, or cma,tcp; default both)\n"
    "  --sizes=KiB,KiB      block sizes (default 64,256,1024,4096)\n"
    "  --rounds=N           rounds per size (default 3, 1 with --quick)\n"
    "  --cap=MiB            bytes moved per row at most (default 1024, 256 with --quick)\n"
    "  --no-daemons         leave out the rows through two daemons\n"
    "  --local              only the rows of region-to-region sends between two daemons of this host\n"
    "  --backend=cpu|cuda   the regions of those rows (default cpu; cuda: next to a D2D or peer copy)\n"
    "  --gpus=A,B           with cuda: daemon A's and daemon B's GPU (default 0,0; 0,1 for NVLink)\n");

}  // namespace kvferry::bench
