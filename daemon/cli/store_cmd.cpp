// `kvferry stats`, `kvferry ls`, `kvferry evict`: the block store of a running daemon, through
// the data ops of a short-lived client connection.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvferry/connector/client.h"

namespace kvferry::cli {
namespace {

struct Common {
  std::string region;  ///< picks the namespace's format family
  std::string model, tenant;
  bool json = false;
};

Result<std::unique_ptr<Client>> connect(const std::string& socket, const Common& c) {
  Client::Options o;
  o.socket = socket;
  o.name = "kvferry-cli";
  o.model = c.model;
  o.tenant = c.tenant;
  return Client::connect(o);
}

Result<uint32_t> region_id(Client& cl, const std::string& name) {
  if (name.empty()) return uint32_t{0};
  return cl.find_region(name);
}

bool parse_key(const std::string& hex, ops::Key* k) {
  if (hex.empty() || hex.size() > 32) return false;
  const std::string h = std::string(32 - hex.size(), '0') + hex;
  char* end = nullptr;
  k->hi = std::strtoull(h.substr(0, 16).c_str(), &end, 16);
  if (*end) return false;
  k->lo = std::strtoull(h.substr(16).c_str(), &end, 16);
  return !*end;
}

std::string key_hex(const ops::Key& k) {
  char b[40];
  std::snprintf(b, sizeof b, "%016" PRIx64 "%016" PRIx64, k.hi, k.lo);
  return b;
}

int report(const char* cmd, const Status& st) {
  // A refusal (the caller's uid, group or tenant may not do this) is said as one, plainly.
  if (st.code() == ErrorCode::kPermissionDenied)
    std::fprintf(stderr, "kvferry %s: refused: %s\n", cmd, st.message().c_str());
  else
    std::fprintf(stderr, "kvferry %s: %s\n", cmd, st.to_string().c_str());
  return 1;
}

/// "12.0 MiB", or "1.2 GiB" from 1 GiB on.
std::string size_str(uint64_t bytes) {
  char b[32];
  if (bytes >= (uint64_t{1} << 30))
    std::snprintf(b, sizeof b, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  else
    std::snprintf(b, sizeof b, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return b;
}

/// "1.2 of 4.0 GiB": both in the capacity's unit.
std::string used_of(uint64_t used, uint64_t capacity) {
  const bool gib = capacity >= (uint64_t{1} << 30);
  const double unit = gib ? 1 << 30 : 1 << 20;
  char b[64];
  std::snprintf(b, sizeof b, "%.1f of %.1f %s", static_cast<double>(used) / unit, static_cast<double>(capacity) / unit,
                gib ? "GiB" : "MiB");
  return b;
}

/// One lower tier as a JSON object: tier, healthy, reason, then its storage and/or cluster figures.
nlohmann::ordered_json tier_json(const ops::TierStatsWire& t) {
  nlohmann::ordered_json o = {{"tier", std::string(t.tier)},
                              {"healthy", (t.flags & ops::kTierHealthy) != 0},
                              {"reason", std::string(t.reason)}};
  if (t.flags & ops::kTierStorage) {
    o["capacity_bytes"] = t.capacity_bytes;
    o["used_bytes"] = t.used_bytes;
    o["blocks"] = t.blocks;
    o["pinned"] = t.pinned;
    o["evictions"] = t.evictions;
    o["io_errors"] = t.io_errors;
    o["checksum_failures"] = t.checksum_failures;
    o["bytes_written"] = t.bytes_written;
    o["bytes_read"] = t.bytes_read;
  }
  if (t.flags & ops::kTierPeers) {
    o["member"] = std::string(t.member);
    o["peers_live"] = t.peers_live;
    o["peers_lost"] = t.peers_lost;
    o["blocks_out"] = t.blocks_out;
    o["bytes_out"] = t.bytes_out;
    o["blocks_in"] = t.blocks_in;
    o["bytes_in"] = t.bytes_in;
    o["errors"] = t.errors;
  }
  return o;
}

/// One lower tier as a line of `kvferry stats`, after the host's lines.
void print_tier(const ops::TierStatsWire& t) {
  const std::string health =
      (t.flags & ops::kTierHealthy) ? std::string("healthy") : "degraded (" + std::string(t.reason) + ")";
  std::string line;
  if (t.flags & ops::kTierStorage)
    line += std::to_string(t.blocks) + " blocks (" + std::to_string(t.pinned) + " pinned), " +
            used_of(t.used_bytes, t.capacity_bytes) + ", " + health + ", " + std::to_string(t.io_errors) +
            " I/O errors, " + std::to_string(t.checksum_failures) + " checksum failures, " +
            std::to_string(t.evictions) + " evicted, " + size_str(t.bytes_written) + " written, " +
            size_str(t.bytes_read) + " read";
  if (t.flags & ops::kTierPeers)
    line += std::string(line.empty() ? "" : "; ") + "member " + t.member + ", " + std::to_string(t.peers_live) +
            " peers live, " + std::to_string(t.peers_lost) + " lost, out " + std::to_string(t.blocks_out) +
            " blocks / " + size_str(t.bytes_out) + ", in " + std::to_string(t.blocks_in) + " blocks / " +
            size_str(t.bytes_in) + ", " + std::to_string(t.errors) + " errors, " + health;
  if (line.empty()) line = health;
  std::printf("%-11s %s\n", t.tier, line.c_str());
}

int run_stats(const std::string& socket, const Common& c) {
  auto cl = connect(socket, c);
  if (!cl.ok()) return report("stats", cl.status());
  auto s = (*cl)->stats_all();
  if (!s.ok()) return report("stats", s.status());
  const ops::StatsWire& w = s->host;
  const double occ = w.capacity_bytes ? 100.0 * static_cast<double>(w.used_bytes) / w.capacity_bytes : 0.0;
  if (c.json) {
    // The host's keys at the top level (as before tier stats), the lower tiers under "tiers".
    nlohmann::ordered_json j = {{"tier", "host"},
                                {"entries", w.entries},
                                {"writing", w.writing},
                                {"pinned", w.pinned},
                                {"used_bytes", w.used_bytes},
                                {"capacity_bytes", w.capacity_bytes},
                                {"occupancy", occ / 100.0},
                                {"pool_page_locked", w.pool_pinned != 0},
                                {"evictions", w.evictions},
                                {"evicted_bytes", w.evicted_bytes},
                                {"lookups", w.lookups},
                                {"hits", w.hits},
                                {"misses", w.misses},
                                {"blocks_saved", w.blocks_saved},
                                {"bytes_saved", w.bytes_saved},
                                {"blocks_loaded", w.blocks_loaded},
                                {"bytes_loaded", w.bytes_loaded},
                                {"checksum_failures", w.checksum_failures},
                                {"clients", w.clients},
                                {"tiers", nlohmann::ordered_json::array()}};
    for (const auto& t : s->tiers) j["tiers"].push_back(tier_json(t));
    print_json(j);
    return 0;
  }
  std::printf("host pool   %.1f of %.1f MiB used (%.1f%%), %s\n", w.used_bytes / 1048576.0,
              w.capacity_bytes / 1048576.0, occ, w.pool_pinned ? "page-locked" : "pageable");
  std::printf("blocks      %" PRIu64 " stored, %" PRIu64 " being written, %" PRIu64 " pinned\n", w.entries, w.writing,
              w.pinned);
  std::printf("saved       %" PRIu64 " blocks, %.1f MiB\n", w.blocks_saved, w.bytes_saved / 1048576.0);
  std::printf("loaded      %" PRIu64 " blocks, %.1f MiB\n", w.blocks_loaded, w.bytes_loaded / 1048576.0);
  std::printf("lookups     %" PRIu64 " keys: %" PRIu64 " hits, %" PRIu64 " misses\n", w.lookups, w.hits, w.misses);
  std::printf("evictions   %" PRIu64 " blocks, %.1f MiB\n", w.evictions, w.evicted_bytes / 1048576.0);
  std::printf("checksums   %" PRIu64 " damaged blocks caught\n", w.checksum_failures);
  std::printf("clients     %" PRIu64 " connected (this one included)\n", w.clients);
  for (const auto& t : s->tiers) print_tier(t);
  return 0;
}

int run_ls(const std::string& socket, const Common& c, uint32_t limit) {
  auto cl = connect(socket, c);
  if (!cl.ok()) return report("ls", cl.status());
  auto rid = region_id(**cl, c.region);
  if (!rid.ok()) return report("ls", rid.status());
  auto l = (*cl)->ls(*rid, limit);
  if (!l.ok()) return report("ls", l.status());
  if (c.json) {
    auto j = nlohmann::ordered_json::array();
    for (const auto& e : *l)
      j.push_back({{"namespace", std::string(e.ns)},
                   {"key", key_hex(e.key)},
                   {"tier", std::string(e.tier)},
                   {"format", std::string(e.format)},
                   {"bytes", e.bytes},
                   {"pins", e.pins}});
    print_json(j);
    return 0;
  }
  std::printf("%-40s %-32s %-5s %-11s %10s %4s\n", "NAMESPACE", "KEY", "TIER", "FORMAT", "BYTES", "PINS");
  for (const auto& e : *l)
    std::printf("%-40s %-32s %-5s %-11s %10" PRIu64 " %4u\n", e.ns, key_hex(e.key).c_str(), e.tier, e.format, e.bytes,
                e.pins);
  std::printf("%zu block(s)\n", l->size());
  return 0;
}

int run_evict(const std::string& socket, const Common& c, const std::vector<std::string>& hex, bool all) {
  if (!all && (c.region.empty() || hex.empty())) {
    std::fprintf(
        stderr, "kvferry evict: give --all (with --region: that namespace only), or --region NAME with --key HEX...\n");
    return 2;
  }
  std::vector<ops::Key> keys;
  for (const auto& h : hex) {
    ops::Key k;
    if (!parse_key(h, &k)) {
      std::fprintf(stderr, "kvferry evict: '%s' is not a key (up to 32 hex digits)\n", h.c_str());
      return 2;
    }
    keys.push_back(k);
  }
  auto cl = connect(socket, c);
  if (!cl.ok()) return report("evict", cl.status());
  auto rid = region_id(**cl, c.region);
  if (!rid.ok()) return report("evict", rid.status());
  const uint64_t flags = all ? (c.region.empty() ? ops::kEvictAllNs : ops::kEvictAll) : 0;
  auto r = (*cl)->evict(*rid, keys, flags);
  if (!r.ok()) return report("evict", r.status());
  if (c.json) {
    nlohmann::ordered_json j = {{"evicted", r->result[0]}, {"keys", nlohmann::ordered_json::array()}};
    for (size_t i = 0; i < r->blocks.size() && i < keys.size(); ++i)
      j["keys"].push_back({{"key", key_hex(keys[i])}, {"status", std::string(error_code_name(r->blocks[i]))}});
    print_json(j);
  } else {
    for (size_t i = 0; i < r->blocks.size() && i < keys.size(); ++i)
      std::printf("%s %s\n", key_hex(keys[i]).c_str(),
                  r->blocks[i] == ErrorCode::kOk     ? "evicted"
                  : r->blocks[i] == ErrorCode::kBusy ? "kept (pinned or in use)"
                                                     : std::string(error_code_name(r->blocks[i])).c_str());
    std::printf("%" PRIu64 " block(s) evicted\n", r->result[0]);
  }
  return 0;
}

int run_peers(const std::string& socket, const Common& c) {
  auto cl = connect(socket, c);
  if (!cl.ok()) return report("peers", cl.status());
  auto text = (*cl)->peers();
  if (!text.ok()) return report("peers", text.status());
  const auto j = nlohmann::ordered_json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.contains("members"))
    return report("peers", Status(ErrorCode::kProtocol, "the daemon's answer is not the expected JSON"));
  if (c.json) {  // written again, so that every --json output comes from the one writer
    print_json(j);
    return 0;
  }
  std::printf("this daemon: %s (%s)\n", j.value("self", "").c_str(),
              j.value("healthy", false) ? "in the cluster" : ("degraded: " + j.value("reason", "")).c_str());
  std::printf("%-24s %-22s %-20s %10s %12s %10s %12s %7s\n", "MEMBER", "ADDRESS", "STATE", "BLOCKS_OUT", "MIB_OUT",
              "BLOCKS_IN", "MIB_IN", "ERRORS");
  for (const auto& m : j["members"]) {
    std::printf("%-24s %-22s %-20s %10" PRIu64 " %12.1f %10" PRIu64 " %12.1f %7" PRIu64 "\n", m.value("id", "").c_str(),
                m.value("address", "").c_str(), m.value("state", "").c_str(), m.value("blocks_out", uint64_t{0}),
                m.value("bytes_out", uint64_t{0}) / 1048576.0, m.value("blocks_in", uint64_t{0}),
                m.value("bytes_in", uint64_t{0}) / 1048576.0, m.value("errors", uint64_t{0}));
  }
  return 0;
}

void add_common(CLI::App* sub, Common* c, bool with_region) {
  if (with_region) sub->add_option("--region", c->region, "region whose namespace (format family) to address");
  sub->add_option("--model", c->model, "namespace model (as the engine registered it)");
  sub->add_option("--tenant", c->tenant, "namespace tenant");
  sub->add_flag("--json", c->json, "machine-readable output");
}

}  // namespace

void add_store_commands(CLI::App& app, std::function<int()>* run, const std::string* socket_path) {
  auto common = std::make_shared<Common>();
  auto limit = std::make_shared<uint32_t>(0);
  auto keys = std::make_shared<std::vector<std::string>>();
  auto all = std::make_shared<bool>(false);

  CLI::App* st = app.add_subcommand("stats", "host pool occupancy, blocks, hits and misses, evictions");
  add_common(st, common.get(), false);
  st->callback([=] { *run = [=] { return run_stats(*socket_path, *common); }; });

  CLI::App* ls = app.add_subcommand("ls", "stored blocks: namespace, key, tier, format, size, pins");
  add_common(ls, common.get(), true);
  ls->add_option("--limit", *limit, "at most this many blocks (0 = what one answer holds)");
  ls->callback([=] { *run = [=] { return run_ls(*socket_path, *common, *limit); }; });

  CLI::App* pe = app.add_subcommand("peers", "the remote tier's cluster: members, their state and traffic");
  add_common(pe, common.get(), false);
  pe->callback([=] { *run = [=] { return run_peers(*socket_path, *common); }; });

  CLI::App* ev = app.add_subcommand("evict", "drop stored blocks (pinned and in-use ones stay)");
  add_common(ev, common.get(), true);
  ev->add_option("--key", *keys, "key(s) to evict, hex (with --region)");
  ev->add_flag("--all", *all, "every unpinned block (of --region's namespace, else of every namespace)");
  ev->callback([=] { *run = [=] { return run_evict(*socket_path, *common, *keys, *all); }; });
}

}  // namespace kvferry::cli
