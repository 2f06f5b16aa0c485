// `kvferry top`: a live view of a running daemon, per tier and per client, in 80 columns.
//
// Everything comes through one client connection (the daemon's /metrics may be off): the store's
// counters (stats_all: the host pool and each lower tier), the status reply (clients and their op
// counts) and the remote tier's members (peers: JSON, kUnavailable without a remote tier). Rates
// are the differences between two samples over the time between them. The interactive view puts
// the terminal in raw mode (no echo, no line buffering; Ctrl-C still signals) on the alternate
// screen, redraws every interval and quits on `q`; the terminal is restored on every way out
// (q, SIGINT/SIGTERM/SIGHUP, an error). `--once` prints a single frame from two samples.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iterator>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <thread>
#include <vector>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvferry/connector/client.h"

namespace kvferry::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kSampleTimeoutUs = 2'000'000;  // one slow answer must not freeze the view
constexpr size_t kWidth = 80;

struct TopArgs {
  bool once = false;
  double interval = 1.0;
};

/// One remote tier member as `peers` reports it.
struct PeerRow {
  std::string id, state;
  uint64_t blocks_out = 0, bytes_out = 0, blocks_in = 0, bytes_in = 0, errors = 0;
};

/// Everything one refresh reads from the daemon.
struct Sample {
  Clock::time_point at{};
  ops::StatsWire host{};
  std::vector<ops::TierStatsWire> tiers;  ///< disk, remote (what the daemon runs)
  proto::StatusReply status;
  bool have_peers = false;  ///< false: no remote tier
  std::string self;         ///< this daemon's member id
  std::vector<PeerRow> peers;
};

// ---- formatting ----

std::string printf_str(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string printf_str(const char* fmt, ...) {
  char b[256];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  return b;
}

/// "0", "512", "12.3Ki", "1.2Mi", "3.4Gi", "1.0Ti": at most 7 characters.
std::string iec(double v) {
  if (!(v >= 0)) return "-";
  if (v < 1024) return printf_str("%.0f", v);
  static const char* kUnits[] = {"Ki", "Mi", "Gi", "Ti", "Pi"};
  int u = -1;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return printf_str(v >= 100 ? "%.0f%s" : "%.1f%s", v, kUnits[u]);
}

/// A count per second: "0", "12.5", "1234", "12.3k", "4.5M".
std::string per_s(double v) {
  if (!(v >= 0)) return "-";
  if (v < 100) return printf_str(v == std::floor(v) ? "%.0f" : "%.1f", v);
  if (v < 10000) return printf_str("%.0f", v);
  if (v < 1e6) return printf_str("%.1fk", v / 1e3);
  return printf_str("%.1fM", v / 1e6);
}

std::string uptime_str(uint64_t ms) {
  const uint64_t s = ms / 1000;
  if (s < 3600) return printf_str("%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
  if (s < 86400) return printf_str("%" PRIu64 "h%02" PRIu64 "m", s / 3600, s / 60 % 60);
  return printf_str("%" PRIu64 "d%02" PRIu64 "h", s / 86400, s / 3600 % 24);
}

/// The rate of a counter between two samples; -1 (shown "-") without a previous sample or
/// across a reset (the daemon restarted).
double rate(uint64_t now, uint64_t before, double dt, bool have_prev) {
  if (!have_prev || dt <= 0 || now < before) return -1;
  return static_cast<double>(now - before) / dt;
}

const ops::TierStatsWire* find_tier(const Sample& s, const char* name) {
  for (const auto& t : s.tiers)
    if (std::strncmp(t.tier, name, sizeof t.tier) == 0) return &t;
  return nullptr;
}

std::string fixed(const char* chars, size_t n) { return std::string(chars, strnlen(chars, n)); }

/// A table row: TIER, save/load bytes/s, save/load blocks/s, used of capacity, blocks, pinned, evictions/s.
std::string tier_row(const char* tier, double save_bps, double load_bps, double save_blk, double load_blk,
                     const std::string& used, const std::string& blocks, const std::string& pinned, double evict) {
  return printf_str("%-6s %8s %8s %8s %8s %12s %7s %7s %7s", tier, iec(save_bps).c_str(), iec(load_bps).c_str(),
                    per_s(save_blk).c_str(), per_s(load_blk).c_str(), used.c_str(), blocks.c_str(), pinned.c_str(),
                    per_s(evict).c_str());
}

std::string used_str(uint64_t used, uint64_t capacity) {
  const double pct = capacity ? 100.0 * static_cast<double>(used) / static_cast<double>(capacity) : 0.0;
  return printf_str("%7s %3.0f%%", iec(static_cast<double>(used)).c_str(), pct);
}

/// The frame for `cur`, with rates against `prev` (none: dashes). `rows` bounds the lines (0 = all).
std::vector<std::string> render(const Sample* prev, const Sample& cur, const std::string& socket, int rows) {
  std::vector<std::string> out;
  const bool hp = prev && prev->status.pid == cur.status.pid;  // rates only within one daemon's life
  const double dt = hp ? std::chrono::duration<double>(cur.at - prev->at).count() : 0.0;
  auto r = [&](uint64_t now, uint64_t before) { return rate(now, before, dt, hp); };
  const ops::StatsWire& h = cur.host;

  char clock[16];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  std::strftime(clock, sizeof clock, "%H:%M:%S", &tm);
  // The connection of this view is a client too: not counted here, not listed below.
  const uint64_t others = h.clients ? h.clients - 1 : 0;
  out.push_back(printf_str("kvferryd %s pid %u up %s, %s backend, %" PRIu64 " client%s", cur.status.version.c_str(),
                           cur.status.pid, uptime_str(cur.status.uptime_ms).c_str(), cur.status.backend.c_str(), others,
                           others == 1 ? "" : "s"));
  // The socket on the left (its tail when long), the time and the sample interval on the right.
  const std::string right = std::string(clock) + (hp ? printf_str(" (%.1f s)", dt) : std::string(" (first sample)"));
  const size_t room = kWidth - right.size() - 1;
  std::string l2 = socket.size() <= room ? socket : "..." + socket.substr(socket.size() - (room - 3));
  out.push_back(l2 + std::string(kWidth - l2.size() - right.size(), ' ') + right);
  out.emplace_back();

  out.push_back("       ----- bytes/s -----  --- blocks/s ----");
  out.push_back(printf_str("%-6s %8s %8s %8s %8s %12s %7s %7s %7s", "TIER", "save", "load", "save", "load", "used",
                           "blocks", "pinned", "evict/s"));
  const Sample* p = hp ? prev : nullptr;
  out.push_back(
      tier_row("host", r(h.bytes_saved, p ? p->host.bytes_saved : 0), r(h.bytes_loaded, p ? p->host.bytes_loaded : 0),
               r(h.blocks_saved, p ? p->host.blocks_saved : 0), r(h.blocks_loaded, p ? p->host.blocks_loaded : 0),
               used_str(h.used_bytes, h.capacity_bytes), std::to_string(h.entries), std::to_string(h.pinned),
               r(h.evictions, p ? p->host.evictions : 0)));
  std::vector<std::string> health;
  for (const auto& tw : cur.tiers) {
    const std::string name = fixed(tw.tier, sizeof tw.tier);
    const ops::TierStatsWire* pt = p ? find_tier(*p, name.c_str()) : nullptr;
    auto rt = [&](uint64_t now, uint64_t ops::TierStatsWire::*f) { return pt ? r(now, pt->*f) : -1.0; };
    if (tw.flags & ops::kTierStorage) {
      // A lower tier counts bytes, not blocks: written = demoted (saved down), read = promoted.
      out.push_back(tier_row(name.c_str(), rt(tw.bytes_written, &ops::TierStatsWire::bytes_written),
                             rt(tw.bytes_read, &ops::TierStatsWire::bytes_read), -1, -1,
                             used_str(tw.used_bytes, tw.capacity_bytes), std::to_string(tw.blocks),
                             std::to_string(tw.pinned), rt(tw.evictions, &ops::TierStatsWire::evictions)));
    } else if (tw.flags & ops::kTierPeers) {
      // The remote tier: save = out to peers, load = in from peers; its blocks live in the host pool.
      out.push_back(tier_row(name.c_str(), rt(tw.bytes_out, &ops::TierStatsWire::bytes_out),
                             rt(tw.bytes_in, &ops::TierStatsWire::bytes_in),
                             rt(tw.blocks_out, &ops::TierStatsWire::blocks_out),
                             rt(tw.blocks_in, &ops::TierStatsWire::blocks_in), "-", "-", "-", -1));
    }
    std::string st = name + ((tw.flags & ops::kTierHealthy) ? " healthy" : " DEGRADED");
    if (!(tw.flags & ops::kTierHealthy) && tw.reason[0]) st += " (" + fixed(tw.reason, sizeof tw.reason) + ")";
    if (tw.flags & ops::kTierStorage)
      st += printf_str(", %" PRIu64 " I/O errors, %" PRIu64 " bad checksums", tw.io_errors, tw.checksum_failures);
    if (tw.flags & ops::kTierPeers)
      st += printf_str(", %" PRIu64 " peers live, %" PRIu64 " lost, %" PRIu64 " errors", tw.peers_live, tw.peers_lost,
                       tw.errors);
    health.push_back(st);
  }
  out.emplace_back();

  const double lk = r(h.lookups, p ? p->host.lookups : 0);
  const double hits = r(h.hits, p ? p->host.hits : 0);
  const std::string now_ratio = lk > 0 ? printf_str("%.1f%%", 100.0 * hits / lk) : std::string("-");
  const std::string all_ratio =
      h.lookups ? printf_str("%.1f%%", 100.0 * static_cast<double>(h.hits) / static_cast<double>(h.lookups)) : "-";
  out.push_back(printf_str("lookups %s/s, hit ratio %s (%s since start), %" PRIu64 " bad checksums", per_s(lk).c_str(),
                           now_ratio.c_str(), all_ratio.c_str(), h.checksum_failures));
  for (const auto& s : health) out.push_back(s);

  // Remote tier members (after the figures that always show).
  std::vector<std::string> tail;
  if (cur.have_peers) {
    tail.emplace_back();
    tail.push_back(printf_str("%-22s %-11s %8s %8s %8s %8s %6s", "PEER", "STATE", "out B/s", "in B/s", "out blk",
                              "in blk", "errors"));
    for (const auto& m : cur.peers) {
      if (m.state == "self") continue;
      const PeerRow* q = nullptr;
      if (p)
        for (const auto& pm : p->peers)
          if (pm.id == m.id) q = &pm;
      auto rp = [&](uint64_t now, uint64_t PeerRow::*f) { return q ? r(now, q->*f) : -1.0; };
      tail.push_back(printf_str("%-22.22s %-11.11s %8s %8s %8s %8s %6" PRIu64, m.id.c_str(), m.state.c_str(),
                                iec(rp(m.bytes_out, &PeerRow::bytes_out)).c_str(),
                                iec(rp(m.bytes_in, &PeerRow::bytes_in)).c_str(),
                                per_s(rp(m.blocks_out, &PeerRow::blocks_out)).c_str(),
                                per_s(rp(m.blocks_in, &PeerRow::blocks_in)).c_str(), m.errors));
    }
    if (tail.size() == 2) tail.emplace_back("(no other member)");
  }

  // Clients, busiest first.
  struct ClientRow {
    const proto::StatusReply::Client* c;
    double ops;
  };
  std::vector<ClientRow> clients;
  for (const auto& c : cur.status.clients) {
    if (c.pid == static_cast<uint32_t>(::getpid())) continue;
    double ops = -1;
    if (p)
      for (const auto& pc : p->status.clients)
        if (pc.id == c.id) ops = r(c.ops, pc.ops);
    clients.push_back({&c, ops});
  }
  std::stable_sort(clients.begin(), clients.end(),
                   [](const ClientRow& a, const ClientRow& b) { return a.ops > b.ops; });
  tail.emplace_back();
  tail.push_back(printf_str("%-26s %6s %8s %8s %10s %14s", "CLIENT", "ID", "PID", "UID", "ops/s", "ops"));
  // As many clients as the terminal has rows for, then one line that counts the rest.
  size_t fit = clients.size();
  if (rows > 0) {
    const size_t used = out.size() + tail.size(), total = static_cast<size_t>(rows);
    const size_t left = total > used ? total - used : 0;
    if (clients.size() > left) fit = left ? left - 1 : 0;
  }
  for (size_t i = 0; i < fit; ++i) {
    const auto& c = *clients[i].c;
    tail.push_back(printf_str("%-26.26s %6u %8u %8u %10s %14" PRIu64, c.name.c_str(), c.id, c.pid, c.uid,
                              per_s(clients[i].ops).c_str(), c.ops));
  }
  if (fit < clients.size()) tail.push_back(printf_str("... %zu more", clients.size() - fit));
  if (clients.empty()) tail.emplace_back("(no client)");
  out.insert(out.end(), tail.begin(), tail.end());
  if (rows > 0 && out.size() > static_cast<size_t>(rows)) out.resize(static_cast<size_t>(rows));
  for (auto& l : out)  // a long version, socket or degraded reason never widens the view
    if (l.size() > kWidth) l.resize(kWidth);
  return out;
}

// ---- sampling ----

Result<std::unique_ptr<Client>> connect(const std::string& socket) {
  Client::Options o;
  o.socket = socket;
  o.name = "kvferry-top";
  o.timeout_ms = 2000;
  return Client::connect(o);
}

Result<Sample> take_sample(Client& cl) {
  Sample s;
  auto st = cl.stats_all(kSampleTimeoutUs);
  if (!st.ok()) return st.status();
  s.at = Clock::now();
  s.host = st->host;
  s.tiers = std::move(st->tiers);
  auto status = cl.status();
  if (!status.ok()) return status.status();
  s.status = std::move(*status);
  auto text = cl.peers(kSampleTimeoutUs);
  if (text.ok()) {
    const auto j = nlohmann::json::parse(*text, nullptr, false);
    if (!j.is_discarded() && j.contains("members") && j["members"].is_array()) {
      s.have_peers = true;
      s.self = j.value("self", "");
      for (const auto& m : j["members"]) {
        if (!m.is_object()) continue;
        PeerRow row;
        row.id = m.value("id", "");
        row.state = m.value("state", "");
        row.blocks_out = m.value("blocks_out", uint64_t{0});
        row.bytes_out = m.value("bytes_out", uint64_t{0});
        row.blocks_in = m.value("blocks_in", uint64_t{0});
        row.bytes_in = m.value("bytes_in", uint64_t{0});
        row.errors = m.value("errors", uint64_t{0});
        s.peers.push_back(std::move(row));
      }
    }
  } else if (text.status().code() != ErrorCode::kUnavailable || !cl.connection_status().ok()) {
    // kUnavailable on a live connection: no remote tier. Anything else is the connection's end.
    return text.status();
  }
  return s;
}

// ---- the terminal ----

volatile std::sig_atomic_t g_signal = 0;
extern "C" void on_signal(int sig) { g_signal = sig; }

/// Raw mode and the alternate screen for the life of the view; restores both on every exit path
/// and the signal dispositions it replaced.
class Terminal {
 public:
  Terminal() {
    in_tty_ = ::isatty(STDIN_FILENO) == 1;
    out_tty_ = ::isatty(STDOUT_FILENO) == 1;
    if (in_tty_ && ::tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);  // ISIG stays: Ctrl-C still signals
      raw.c_cc[VMIN] = 1;
      raw.c_cc[VTIME] = 0;
      raw_ = ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &raw) == 0;
    }
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: poll() returns EINTR and the loop sees the signal
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
    if (out_tty_) put("\x1b[?1049h\x1b[?25l");  // alternate screen, cursor hidden
  }
  ~Terminal() { restore(); }
  Terminal(const Terminal&) = delete;
  Terminal& operator=(const Terminal&) = delete;

  void restore() {
    if (restored_) return;
    restored_ = true;
    if (out_tty_) put("\x1b[?25h\x1b[?1049l");
    if (raw_) ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved_);
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
  }

  bool out_tty() const { return out_tty_; }

  /// Rows and columns of the output terminal (0, 0 when it is not one).
  std::pair<int, int> size() const {
    winsize ws{};
    if (!out_tty_ || ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0) return {0, 0};
    return {ws.ws_row, ws.ws_col};
  }

  /// Waits up to `ms` for a key; true when `q` came (or stdin ended on a terminal).
  bool wait_quit(int ms) {
    const auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (g_signal == 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      if (left <= 0) return false;
      pollfd pfd{STDIN_FILENO, POLLIN, 0};
      const int n = ::poll(&pfd, stdin_open_ ? 1 : 0, static_cast<int>(left));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) continue;
      char buf[64];
      const ssize_t got = ::read(STDIN_FILENO, buf, sizeof buf);
      if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
        stdin_open_ = false;  // stdin ended (e.g. </dev/null): only a signal stops the view now
        if (in_tty_) return true;
        continue;
      }
      for (ssize_t i = 0; i < got; ++i)
        if (buf[i] == 'q' || buf[i] == 'Q') return true;
    }
    return false;
  }

  static void put(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::write(STDOUT_FILENO, s.data() + off, s.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }

 private:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
  termios saved_{};
  struct sigaction old_[std::size(kSignals)]{};
  bool in_tty_ = false, out_tty_ = false, raw_ = false, restored_ = false, stdin_open_ = true;
};

/// One frame: on a terminal it overwrites the previous one in place (home, clear to end of line
/// per line, clear below), elsewhere it is printed as plain lines, a blank line between frames.
std::string frame_text(const std::vector<std::string>& lines, bool tty, int cols) {
  std::string f = tty ? "\x1b[H" : "";
  for (const auto& l : lines) {
    f += (tty && cols > 0 && l.size() > static_cast<size_t>(cols)) ? l.substr(0, static_cast<size_t>(cols)) : l;
    f += tty ? "\x1b[K\n" : "\n";
  }
  f += tty ? "\x1b[J" : "\n";
  return f;
}

int fail(const Status& st) {
  if (st.code() == ErrorCode::kPermissionDenied)
    std::fprintf(stderr, "kvferry top: refused: %s\n", st.message().c_str());
  else
    std::fprintf(stderr, "kvferry top: %s\n", st.to_string().c_str());
  return 1;
}

int run_once(const std::string& socket, const TopArgs& a) {
  auto cl = connect(socket);
  if (!cl.ok()) return fail(cl.status());
  auto first = take_sample(**cl);
  if (!first.ok()) return fail(first.status());
  std::this_thread::sleep_for(std::chrono::duration<double>(a.interval));
  auto second = take_sample(**cl);
  if (!second.ok()) return fail(second.status());
  Terminal::put(frame_text(render(&*first, *second, socket, 0), false, 0));
  return 0;
}

int run_live(const std::string& socket, const TopArgs& a) {
  const int period_ms = static_cast<int>(a.interval * 1000);
  g_signal = 0;
  Terminal term;
  std::unique_ptr<Client> cl;
  std::optional<Sample> prev;
  std::string error;
  for (;;) {
    if (!cl) {
      auto c = connect(socket);
      if (c.ok()) {
        cl = std::move(*c);
        error.clear();
      } else {
        error = c.status().to_string();
      }
    }
    std::optional<Sample> cur;
    if (cl) {
      auto s = take_sample(*cl);
      if (s.ok()) {
        cur = std::move(*s);
      } else {
        error = s.status().to_string();
        cl.reset();  // the daemon went (or restarted): connect again next time
        prev.reset();
      }
    }
    const auto [rows, cols] = term.size();
    std::vector<std::string> lines;
    if (cur)
      lines = render(prev ? &*prev : nullptr, *cur, socket, rows > 0 ? rows - 1 : 0);
    else
      lines = {"kvferry top: " + socket, "", "not connected: " + error, "(retrying every interval; q quits)"};
    lines.push_back(cur ? "q quits" : "");
    Terminal::put(frame_text(lines, term.out_tty(), cols));
    if (cur) prev = std::move(cur);
    if (term.wait_quit(period_ms) || g_signal != 0) break;
  }
  const int sig = g_signal;
  term.restore();
  return sig ? 128 + sig : 0;
}

}  // namespace

void add_top_command(CLI::App& app, std::function<int()>* run, const std::string* socket_path) {
  auto args = std::make_shared<TopArgs>();
  CLI::App* sub = app.add_subcommand("top", "live view of a running kvferryd: per tier and per client rates (q quits)");
  sub->add_flag("--once", args->once, "print one frame (two samples --interval apart) and exit");
  sub->add_option("--interval", args->interval, "seconds between samples (default 1)")->check(CLI::Range(0.1, 60.0));
  sub->callback([args, run, socket_path] {
    *run = [args, socket_path] { return args->once ? run_once(*socket_path, *args) : run_live(*socket_path, *args); };
  });
}

}  // namespace kvferry::cli
