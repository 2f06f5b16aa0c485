// TEMPORARY minimal config loader (replaced by the config module's real one): reads the keys the
// daemon uses today, rejects unknown top-level sections, and prints them back.
#include "kvferry/config/config.h"

#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace kvferry::config {
namespace {

Status err(const std::string& origin, const YAML::Node& n, const std::string& key, const std::string& what) {
  return {ErrorCode::kConfig, origin + ":" + std::to_string(n.Mark().line + 1) + ": " + key + ": " + what};
}

LogLevel parse_level(const std::string& s, bool* ok) {
  *ok = true;
  if (s == "trace") return LogLevel::kTrace;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warn") return LogLevel::kWarn;
  if (s == "error") return LogLevel::kError;
  if (s == "off") return LogLevel::kOff;
  *ok = false;
  return LogLevel::kInfo;
}

const char* level_name(LogLevel l) {
  static const char* n[] = {"trace", "debug", "info", "warn", "error", "off"};
  return n[static_cast<int>(l)];
}

}  // namespace

const std::vector<KeyDoc>& schema() {
  static const std::vector<KeyDoc> s = {
      {"daemon.socket", "/run/kvferry/kvferry.sock", "control socket", false},
      {"daemon.log_level", "info", "log level", true},
      {"daemon.allowed_uids", "[]", "peer uids allowed", true},
      {"daemon.allowed_gids", "[]", "peer gids allowed", true},
  };
  return s;
}

Result<Config> load_string(std::string_view yaml, std::string_view origin_sv) {
  const std::string origin(origin_sv);
  Config c;
  try {
    YAML::Node root = YAML::Load(std::string(yaml));
    if (!root || root.IsNull()) return c;
    for (auto it : root) {
      const std::string k = it.first.as<std::string>();
      if (k != "daemon" && k != "device" && k != "regions" && k != "tiers" && k != "integrity" && k != "limits")
        return err(origin, it.first, k, "unknown key");
    }
    if (auto d = root["daemon"]) {
      if (d["socket"]) c.daemon.socket = d["socket"].as<std::string>();
      if (d["socket_mode"])
        c.daemon.socket_mode =
            static_cast<uint32_t>(std::strtoul(d["socket_mode"].as<std::string>().c_str(), nullptr, 8));
      if (d["group"]) c.daemon.group = d["group"].as<std::string>();
      if (d["allowed_uids"]) c.daemon.allowed_uids = d["allowed_uids"].as<std::vector<uint32_t>>();
      if (d["allowed_gids"]) c.daemon.allowed_gids = d["allowed_gids"].as<std::vector<uint32_t>>();
      if (d["log_level"]) {
        bool ok;
        c.daemon.log_level = parse_level(d["log_level"].as<std::string>(), &ok);
        if (!ok) return err(origin, d["log_level"], "daemon.log_level", "not one of trace|debug|info|warn|error|off");
      }
    }
    if (auto d = root["device"]) {
      if (d["backend"]) {
        const std::string b = d["backend"].as<std::string>();
        if (b == "auto")
          c.device.backend = Backend::kAuto;
        else if (b == "cuda")
          c.device.backend = Backend::kCuda;
        else if (b == "cpu")
          c.device.backend = Backend::kCpu;
        else
          return err(origin, d["backend"], "device.backend", "not one of auto|cuda|cpu");
      }
      if (d["gpu"]) c.device.gpu = d["gpu"].as<int>();
    }
    if (auto rs = root["regions"]) {
      for (auto r : rs) {
        RegionConfig rc;
        rc.name = r["name"].as<std::string>();
        if (r["layers"]) rc.spec.layers = r["layers"].as<int64_t>();
        if (r["blocks"]) rc.spec.blocks = r["blocks"].as<int64_t>();
        if (r["block_size"]) rc.spec.block_size = r["block_size"].as<int64_t>();
        if (r["format"]) {
          auto f = EntryFormat::parse(r["format"].as<std::string>());
          if (!f.ok()) return err(origin, r["format"], "regions.format", f.status().message());
          rc.spec.format = *f;
        }
        if (r["layout"])
          rc.spec.layout = r["layout"].as<std::string>() == "layer_major" ? Layout::kLayerMajor : Layout::kBlockMajor;
        if (Status st = rc.spec.validate(); !st.ok()) return err(origin, r, "regions", st.message());
        c.regions.push_back(rc);
      }
    }
    if (auto l = root["limits"]) {
      if (l["max_clients"]) c.limits.max_clients = l["max_clients"].as<uint32_t>();
      if (l["ring_entries"]) c.limits.ring_entries = l["ring_entries"].as<uint32_t>();
      if (l["watchdog"]) {
        auto d = parse_duration(l["watchdog"].as<std::string>());
        if (!d.ok()) return err(origin, l["watchdog"], "limits.watchdog", d.status().message());
        c.limits.watchdog = std::chrono::duration_cast<std::chrono::milliseconds>(*d);
      }
    }
  } catch (const YAML::Exception& e) {
    return Status(ErrorCode::kConfig, origin + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  return c;
}

Result<Config> load_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status(ErrorCode::kConfig, "cannot open config file '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return load_string(ss.str(), path);
}

std::string to_yaml(const Config& c) {
  std::ostringstream o;
  o << "daemon:\n  socket: " << c.daemon.socket << "\n  socket_mode: 0" << std::oct << c.daemon.socket_mode << std::dec
    << "\n  log_level: " << level_name(c.daemon.log_level) << "\n";
  o << "device:\n  backend: "
    << (c.device.backend == Backend::kAuto   ? "auto"
        : c.device.backend == Backend::kCuda ? "cuda"
                                             : "cpu")
    << "\n  gpu: " << c.device.gpu << "\n";
  o << "regions:" << (c.regions.empty() ? " []\n" : "\n");
  for (const auto& r : c.regions)
    o << "  - name: " << r.name << "\n    layers: " << r.spec.layers << "\n    blocks: " << r.spec.blocks
      << "\n    block_size: " << r.spec.block_size << "\n    format: " << r.spec.format.name()
      << "\n    layout: " << (r.spec.layout == Layout::kBlockMajor ? "block_major" : "layer_major") << "\n";
  o << "limits:\n  max_clients: " << c.limits.max_clients << "\n  ring_entries: " << c.limits.ring_entries
    << "\n  watchdog: " << c.limits.watchdog.count() << "ms\n";
  return o.str();
}

std::vector<std::string> non_reloadable_changes(const Config& a, const Config& b) {
  std::vector<std::string> v;
  if (a.daemon.socket != b.daemon.socket) v.push_back("daemon.socket");
  if (a.device.backend != b.device.backend) v.push_back("device.backend");
  if (a.regions.size() != b.regions.size()) v.push_back("regions");
  if (a.limits.ring_entries != b.limits.ring_entries) v.push_back("limits.ring_entries");
  return v;
}

std::vector<std::string> reloadable_changes(const Config& a, const Config& b) {
  std::vector<std::string> v;
  if (a.daemon.log_level != b.daemon.log_level) v.push_back("daemon.log_level");
  if (a.daemon.allowed_uids != b.daemon.allowed_uids) v.push_back("daemon.allowed_uids");
  if (a.daemon.allowed_gids != b.daemon.allowed_gids) v.push_back("daemon.allowed_gids");
  return v;
}

Result<uint64_t> parse_size(std::string_view s) {
  char* end = nullptr;
  const std::string str(s);
  const uint64_t v = std::strtoull(str.c_str(), &end, 10);
  if (end == str.c_str()) return Status(ErrorCode::kConfig, "bad size '" + str + "'");
  return v;
}

Result<std::chrono::nanoseconds> parse_duration(std::string_view s) {
  const std::string str(s);
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  const std::string unit(end);
  if (end == str.c_str()) return Status(ErrorCode::kConfig, "bad duration '" + str + "'");
  double ns = unit == "ns"                  ? v
              : unit == "us"                ? v * 1e3
              : unit == "ms"                ? v * 1e6
              : unit == "s" || unit.empty() ? v * 1e9
              : unit == "m"                 ? v * 60e9
              : unit == "h"                 ? v * 3600e9
                                            : -1;
  if (ns < 0) return Status(ErrorCode::kConfig, "bad duration unit in '" + str + "'");
  return std::chrono::nanoseconds(static_cast<int64_t>(ns));
}

}  // namespace kvferry::config
