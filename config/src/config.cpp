// The config loader: one declarative table (key, doc, reloadable, codec) drives the YAML parse,
// to_yaml(), schema() and the reload diff. Defaults come from the structs in config.h, so the
// table never repeats them.
#include "kvferry/config/config.h"
#include "kvferry/config/host_port.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace kvferry::config {
namespace {

constexpr size_t kMaxFileBytes = 1 << 20;

// Where a value came from: every error names the file, the line and the key.
struct Ctx {
  std::string origin;

  Status fail(const YAML::Node& n, std::string_view key, std::string_view msg) const {
    return fail_at(n.Mark().line, key, msg);
  }
  Status fail_at(int line0, std::string_view key, std::string_view msg) const {
    std::string s = origin;
    if (line0 >= 0) s += ":" + std::to_string(line0 + 1);
    s += ": ";
    if (!key.empty()) s += std::string(key) + ": ";
    s += msg;
    return {ErrorCode::kConfig, std::move(s)};
  }
};

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20 || ch == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

// Shown in messages: the text as written, shortened.
std::string shown(const YAML::Node& n) {
  if (!n.IsScalar()) return n.IsSequence() ? "a list" : n.IsMap() ? "a mapping" : "nothing";
  std::string s = n.Scalar();
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return "'" + s + "'";
}

// A quoted scalar ("64" or '64') is a string: yaml-cpp tags it "!" where a plain one gets "?".
bool is_plain(const YAML::Node& n) { return n.IsScalar() && n.Tag() != "!"; }

Status need_scalar(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::string_view expect) {
  if (n.IsNull()) return ctx.fail(n, key, "has no value (expected " + std::string(expect) + ")");
  if (!n.IsScalar()) return ctx.fail(n, key, shown(n) + " is not " + std::string(expect));
  return Status::Ok();
}

/// A decimal integer, optionally signed; false for anything else, including a value past int64
/// (std::from_chars reports the overflow: accumulating digits by hand would be undefined there).
bool parse_int(std::string_view s, int64_t* out) {
  if (s.empty()) return false;
  if (s[0] == '+') {
    s.remove_prefix(1);
    if (s.empty() || s[0] == '+' || s[0] == '-') return false;
  }
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || end != s.data() + s.size()) return false;
  *out = v;
  return true;
}

// ---- codecs: parse a node into a member, print it back as YAML text that parses to the same ----

struct SizeC {
  uint64_t min = 0;
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, uint64_t& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "a size, e.g. 64GiB"));
    Result<uint64_t> r = parse_size(n.Scalar());
    if (!r.ok()) return ctx.fail(n, key, r.status().message());
    if (*r < min) return ctx.fail(n, key, shown(n) + " is below the minimum " + format_size(min));
    out = *r;
    return Status::Ok();
  }
  std::string emit(uint64_t v) const { return format_size(v); }
};

struct MillisC {
  std::chrono::milliseconds min{0}, max{std::chrono::hours(24)};
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::chrono::milliseconds& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "a duration, e.g. 500ms"));
    Result<std::chrono::nanoseconds> r = parse_duration(n.Scalar());
    if (!r.ok()) return ctx.fail(n, key, r.status().message());
    if (r->count() % 1000000 != 0) return ctx.fail(n, key, shown(n) + " is not a whole number of milliseconds");
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*r);
    if (ms < min || ms > max)
      return ctx.fail(n, key, shown(n) + " is outside [" + format_duration(min) + ", " + format_duration(max) + "]");
    out = ms;
    return Status::Ok();
  }
  std::string emit(std::chrono::milliseconds v) const { return format_duration(v); }
};

template <class T>
struct IntC {
  int64_t min, max;
  bool pow2 = false;
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, T& out) const {
    const std::string expect = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    KVFERRY_TRY(need_scalar(ctx, key, n, expect));
    int64_t v = 0;
    if (!is_plain(n) || !parse_int(n.Scalar(), &v)) return ctx.fail(n, key, shown(n) + " is not " + expect);
    if (v < min || v > max)
      return ctx.fail(n, key, shown(n) + " is outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    if (pow2 && (v <= 0 || (v & (v - 1)) != 0)) return ctx.fail(n, key, shown(n) + " is not a power of two");
    out = static_cast<T>(v);
    return Status::Ok();
  }
  std::string emit(T v) const { return std::to_string(v); }
};

// A fraction in (lo, hi] (lo excluded).
struct FractionC {
  double lo = 0, hi = 1;
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, double& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "a number in (0, 1]"));
    const std::string& s = n.Scalar();
    char* end = nullptr;
    errno = 0;
    const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
    if (!is_plain(n) || s.empty() || end != s.c_str() + s.size() || errno != 0 || !std::isfinite(v) ||
        s.find_first_of("xXpP") != std::string::npos)
      return ctx.fail(n, key, shown(n) + " is not a number");
    if (!(v > lo && v <= hi)) return ctx.fail(n, key, shown(n) + " is outside (0, 1]");
    out = v;
    return Status::Ok();
  }
  // The shortest text that reads back as the same double ("0.95", not "0.94999999999999996").
  std::string emit(double v) const {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);
  }
};

struct BoolC {
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, bool& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "true or false"));
    const std::string& s = n.Scalar();
    if (is_plain(n) && (s == "true" || s == "True" || s == "TRUE")) {
      out = true;
    } else if (is_plain(n) && (s == "false" || s == "False" || s == "FALSE")) {
      out = false;
    } else {
      return ctx.fail(n, key, shown(n) + " is not true or false");
    }
    return Status::Ok();
  }
  std::string emit(bool v) const { return v ? "true" : "false"; }
};

// A string; `check` returns "" when the value is fine, else what is wrong with it.
using Check = std::function<std::string(const std::string&)>;

struct StrC {
  Check check;
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::string& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "a string (\"\" for none)"));
    if (check) {
      const std::string why = check(n.Scalar());
      if (!why.empty()) return ctx.fail(n, key, shown(n) + " " + why);
    }
    out = n.Scalar();
    return Status::Ok();
  }
  std::string emit(const std::string& v) const { return quote(v); }
};

template <class E>
struct EnumC {
  std::vector<std::pair<std::string, E>> names;
  std::string list() const {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i) s += (i ? (i + 1 == names.size() ? " or " : ", ") : "") + names[i].first;
    return s;
  }
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, E& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, list()));
    for (const auto& [name, v] : names) {
      if (n.Scalar() == name) {
        out = v;
        return Status::Ok();
      }
    }
    return ctx.fail(n, key, shown(n) + " is not " + list());
  }
  std::string emit(E v) const {
    for (const auto& [name, e] : names)
      if (e == v) return name;
    return "?";
  }
};

// File mode bits written in octal with a leading 0 ("0660"), as chmod takes them.
struct ModeC {
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, uint32_t& out) const {
    KVFERRY_TRY(need_scalar(ctx, key, n, "an octal mode, e.g. 0660"));
    const std::string& s = n.Scalar();
    bool ok = s.size() >= 2 && s.size() <= 5 && s[0] == '0';
    uint32_t v = 0;
    for (size_t i = 1; ok && i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '7') ok = false;
      v = v * 8 + static_cast<uint32_t>(s[i] - '0');
    }
    if (!ok) return ctx.fail(n, key, shown(n) + " is not an octal mode (expected e.g. 0660)");
    if (v > 0777) return ctx.fail(n, key, shown(n) + " has bits beyond 0777");
    out = v;
    return Status::Ok();
  }
  std::string emit(uint32_t v) const {
    char buf[8];
    std::snprintf(buf, sizeof buf, "0%03o", v & 0777u);
    return buf;
  }
};

// A list of ids (uids or gids).
struct IdListC {
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::vector<uint32_t>& out) const {
    if (!n.IsSequence()) return ctx.fail(n, key, shown(n) + " is not a list of ids (expected e.g. [1000, 1001] or [])");
    std::vector<uint32_t> v;
    const IntC<uint32_t> id{0, 4294967294};
    for (size_t i = 0; i < n.size(); ++i) {
      uint32_t x = 0;
      KVFERRY_TRY(id.parse(ctx, std::string(key) + "[" + std::to_string(i) + "]", n[i], x));
      v.push_back(x);
    }
    out = std::move(v);
    return Status::Ok();
  }
  std::string emit(const std::vector<uint32_t>& v) const {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }
};

struct StrListC {
  Check check;
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::vector<std::string>& out) const {
    if (!n.IsSequence()) return ctx.fail(n, key, shown(n) + " is not a list (expected e.g. [\"10.0.0.2:7470\"] or [])");
    std::vector<std::string> v;
    const StrC one{check};
    for (size_t i = 0; i < n.size(); ++i) {
      std::string x;
      KVFERRY_TRY(one.parse(ctx, std::string(key) + "[" + std::to_string(i) + "]", n[i], x));
      v.push_back(std::move(x));
    }
    out = std::move(v);
    return Status::Ok();
  }
  std::string emit(const std::vector<std::string>& v) const {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quote(v[i]);
    return s + "]";
  }
};

// ---- value checks ----

std::string check_host_port(const std::string& s, bool empty_ok, bool port0_ok = false) {
  if (s.empty()) return empty_ok ? "" : "is empty (expected host:port)";
  HostPort hp;
  const HostPortFault fault = parse_host_port(s, &hp);
  if (fault == HostPortFault::kNotHostPort) return "is not host:port (e.g. 127.0.0.1:9464)";
  if (fault == HostPortFault::kBadPort || (hp.port == 0 && !port0_ok))
    return port0_ok ? "has no port in [0, 65535] (expected host:port; 0 picks a free one)"
                    : "has no port in [1, 65535] (expected host:port)";
  for (const char c : hp.host) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == ':' || c == '[' ||
          c == ']'))
      return "has a character not allowed in a host name";
  }
  return "";
}

std::string check_name(const std::string& s, size_t max_len) {
  if (s.empty()) return "is empty";
  if (s.size() > max_len) return "is longer than " + std::to_string(max_len) + " characters";
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'))
      return "may only hold letters, digits, '_', '-' and '.'";
  return "";
}

std::string check_socket(const std::string& s) {
  if (s.empty() || s[0] != '/') return "is not an absolute path";
  if (s.size() >= 108) return "is longer than a Unix socket path may be (107 bytes)";
  if (s.back() == '/') return "names a directory, not a socket file";
  return "";
}

// ---- regions: a list of mappings with keys of their own ----

const std::vector<KeyDoc>& region_keys() {
  static const std::vector<KeyDoc> kKeys = {
      {"regions[].name", "(required)", "unique name engines ask for (letters, digits, '_', '-', '.')", false},
      {"regions[].layers", "(required)", "layers of the model (>= 1)", false},
      {"regions[].blocks", "(required)", "blocks (pages) of the region (>= 1)", false},
      {"regions[].block_size", "64", "tokens per block", false},
      {"regions[].format", "mla_bf16",
       "entry format: mla_bf16 | mla_fp8 | mla_fp8_ds | mla_fp4 | indexer_fp8 | "
       "mha:DTYPE:HxD[:nhd|:hnd][:slice=FIRST/TOTAL]",
       false},
      {"regions[].layout", "block_major", "block_major (NB, L, BS, E) or layer_major (L, NB, BS, E)", false},
      {"regions[].tenant", "\"\"", "the tenant (a name under tenants) it belongs to; \"\" = shared by every tenant",
       false},
  };
  return kKeys;
}

std::string suggestion(std::string_view key, const std::vector<std::string>& known);

struct RegionsC {
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::vector<RegionConfig>& out) const {
    if (!n.IsSequence()) return ctx.fail(n, key, shown(n) + " is not a list of regions (or [])");
    std::vector<RegionConfig> regions;
    std::map<std::string, size_t> names;
    static const std::vector<std::string> kSub = {"name",   "layers", "blocks", "block_size",
                                                  "format", "layout", "tenant"};
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node r = n[i];
      const std::string at = std::string(key) + "[" + std::to_string(i) + "]";
      if (!r.IsMap()) return ctx.fail(r, at, shown(r) + " is not a mapping (name, layers, blocks, ...)");
      RegionConfig rc;
      std::set<std::string> seen;
      for (const auto& kv : r) {
        const std::string k = kv.first.IsScalar() ? kv.first.Scalar() : std::string();
        const std::string sub = at + "." + k;
        if (!kv.first.IsScalar()) return ctx.fail(kv.first, at, "a key must be a plain name");
        if (!seen.insert(k).second) return ctx.fail(kv.first, sub, "duplicate key");
        const YAML::Node& v = kv.second;
        if (k == "name") {
          KVFERRY_TRY(StrC{[](const std::string& s) { return check_name(s, 64); }}.parse(ctx, sub, v, rc.name));
        } else if (k == "layers") {
          KVFERRY_TRY((IntC<int64_t>{1, 4096}.parse(ctx, sub, v, rc.spec.layers)));
        } else if (k == "blocks") {
          KVFERRY_TRY((IntC<int64_t>{1, int64_t{1} << 40}.parse(ctx, sub, v, rc.spec.blocks)));
        } else if (k == "block_size") {
          KVFERRY_TRY((IntC<int64_t>{1, 65536}.parse(ctx, sub, v, rc.spec.block_size)));
        } else if (k == "format") {
          KVFERRY_TRY(need_scalar(ctx, sub, v, "an entry format, e.g. mla_bf16"));
          Result<EntryFormat> f = EntryFormat::parse(v.Scalar());
          if (!f.ok()) return ctx.fail(v, sub, f.status().message());
          rc.spec.format = *f;
        } else if (k == "layout") {
          KVFERRY_TRY(
              (EnumC<Layout>{{{"block_major", Layout::kBlockMajor}, {"layer_major", Layout::kLayerMajor}}}.parse(
                  ctx, sub, v, rc.spec.layout)));
        } else if (k == "tenant") {
          // Checked against `tenants` once every key is read (Loader::cross_checks).
          KVFERRY_TRY(StrC{[](const std::string& s) { return s.empty() ? "" : check_name(s, 64); }}.parse(ctx, sub, v,
                                                                                                          rc.tenant));
        } else {
          std::vector<std::string> known;
          known.reserve(kSub.size());
          for (const std::string& s : kSub) known.push_back(at + "." + s);
          return ctx.fail(kv.first, "", "unknown key '" + sub + "'" + suggestion(sub, known));
        }
      }
      for (const char* req : {"name", "layers", "blocks"})
        if (!seen.count(req)) return ctx.fail(r, at, std::string("'") + req + "' is missing");
      if (Status s = rc.spec.validate(); !s.ok()) return ctx.fail(r, at + " ('" + rc.name + "')", s.message());
      if (auto [it, fresh] = names.emplace(rc.name, i); !fresh)
        return ctx.fail(
            r, at + ".name",
            "'" + rc.name + "' is already the name of " + std::string(key) + "[" + std::to_string(it->second) + "]");
      regions.push_back(std::move(rc));
    }
    out = std::move(regions);
    return Status::Ok();
  }
  // A block under "regions:" (or "[]"); parsed back by parse().
  std::string emit(const std::vector<RegionConfig>& v) const {
    if (v.empty()) return "[]";
    std::string s;
    for (const RegionConfig& r : v) {
      s += "\n  - name: " + quote(r.name);
      s += "\n    layers: " + std::to_string(r.spec.layers);
      s += "\n    blocks: " + std::to_string(r.spec.blocks);
      s += "\n    block_size: " + std::to_string(r.spec.block_size);
      s += "\n    format: " + quote(r.spec.format.name());
      s += std::string("\n    layout: ") + (r.spec.layout == Layout::kBlockMajor ? "block_major" : "layer_major");
      s += "\n    tenant: " + quote(r.tenant);
    }
    return s;
  }
};

// ---- tenants: a list of mappings (name, uids, gids, quota.*) ----

const std::vector<KeyDoc>& tenant_keys() {
  static const std::vector<KeyDoc> kKeys = {
      {"tenants[].name", "(required)", "unique tenant name (letters, digits, '_', '-', '.')", true},
      {"tenants[].uids", "[]", "peer uids that may use this tenant", true},
      {"tenants[].gids", "[]", "peer gids (primary or supplementary) that may use this tenant", true},
      {"tenants[].quota.clients", "0", "connected clients at most (0 = limits.tenant.clients)", true},
      {"tenants[].quota.regions", "0", "regions created or registered at most (0 = limits.tenant.regions)", true},
      {"tenants[].quota.region_bytes", "0", "bytes of those regions at most (0 = limits.tenant.region_bytes)", true},
      {"tenants[].quota.pinned_bytes", "0", "bytes of pinned blocks at most (0 = limits.tenant.pinned_bytes)", true},
      {"tenants[].quota.inflight_bytes", "0",
       "bytes of queued or running saves/loads at most (0 = limits.tenant.inflight_bytes)", true},
  };
  return kKeys;
}

// The five quota keys, shared by limits.tenant and tenants[].quota.
struct QuotaC {
  static const std::vector<std::string>& keys() {
    static const std::vector<std::string> kKeys = {"clients", "regions", "region_bytes", "pinned_bytes",
                                                   "inflight_bytes"};
    return kKeys;
  }
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, TenantQuota& out) const {
    if (n.IsNull()) return Status::Ok();  // "quota:" with nothing under it: every default
    if (!n.IsMap()) return ctx.fail(n, key, shown(n) + " is not a mapping (clients, regions, region_bytes, ...)");
    TenantQuota q;
    std::set<std::string> seen;
    for (const auto& kv : n) {
      if (!kv.first.IsScalar()) return ctx.fail(kv.first, key, "a key must be a plain name");
      const std::string k = kv.first.Scalar();
      const std::string sub = std::string(key) + "." + k;
      if (!seen.insert(k).second) return ctx.fail(kv.first, sub, "duplicate key");
      const YAML::Node& v = kv.second;
      if (k == "clients") {
        KVFERRY_TRY((IntC<uint32_t>{0, 65536}.parse(ctx, sub, v, q.clients)));
      } else if (k == "regions") {
        KVFERRY_TRY((IntC<uint32_t>{0, 65536}.parse(ctx, sub, v, q.regions)));
      } else if (k == "region_bytes") {
        KVFERRY_TRY(SizeC{}.parse(ctx, sub, v, q.region_bytes));
      } else if (k == "pinned_bytes") {
        KVFERRY_TRY(SizeC{}.parse(ctx, sub, v, q.pinned_bytes));
      } else if (k == "inflight_bytes") {
        KVFERRY_TRY(SizeC{}.parse(ctx, sub, v, q.inflight_bytes));
      } else {
        std::vector<std::string> known;
        known.reserve(keys().size());
        for (const std::string& s : keys()) known.push_back(std::string(key) + "." + s);
        return ctx.fail(kv.first, "", "unknown key '" + sub + "'" + suggestion(sub, known));
      }
    }
    out = q;
    return Status::Ok();
  }
};

struct TenantsC {
  Status parse(const Ctx& ctx, std::string_view key, const YAML::Node& n, std::vector<TenantConfig>& out) const {
    if (!n.IsSequence()) return ctx.fail(n, key, shown(n) + " is not a list of tenants (or [])");
    std::vector<TenantConfig> tenants;
    std::map<std::string, size_t> names;
    static const std::vector<std::string> kSub = {"name", "uids", "gids", "quota"};
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node t = n[i];
      const std::string at = std::string(key) + "[" + std::to_string(i) + "]";
      if (!t.IsMap()) return ctx.fail(t, at, shown(t) + " is not a mapping (name, uids, gids, quota)");
      TenantConfig tc;
      std::set<std::string> seen;
      for (const auto& kv : t) {
        if (!kv.first.IsScalar()) return ctx.fail(kv.first, at, "a key must be a plain name");
        const std::string k = kv.first.Scalar();
        const std::string sub = at + "." + k;
        if (!seen.insert(k).second) return ctx.fail(kv.first, sub, "duplicate key");
        const YAML::Node& v = kv.second;
        if (k == "name") {
          KVFERRY_TRY(StrC{[](const std::string& s) { return check_name(s, 64); }}.parse(ctx, sub, v, tc.name));
        } else if (k == "uids") {
          KVFERRY_TRY(IdListC{}.parse(ctx, sub, v, tc.uids));
        } else if (k == "gids") {
          KVFERRY_TRY(IdListC{}.parse(ctx, sub, v, tc.gids));
        } else if (k == "quota") {
          KVFERRY_TRY(QuotaC{}.parse(ctx, sub, v, tc.quota));
        } else {
          std::vector<std::string> known;
          known.reserve(kSub.size());
          for (const std::string& s : kSub) known.push_back(at + "." + s);
          return ctx.fail(kv.first, "", "unknown key '" + sub + "'" + suggestion(sub, known));
        }
      }
      if (!seen.count("name")) return ctx.fail(t, at, "'name' is missing");
      if (auto [it, fresh] = names.emplace(tc.name, i); !fresh)
        return ctx.fail(
            t, at + ".name",
            "'" + tc.name + "' is already the name of " + std::string(key) + "[" + std::to_string(it->second) + "]");
      tenants.push_back(std::move(tc));
    }
    out = std::move(tenants);
    return Status::Ok();
  }
  std::string emit(const std::vector<TenantConfig>& v) const {
    if (v.empty()) return "[]";
    std::string s;
    for (const TenantConfig& t : v) {
      s += "\n  - name: " + quote(t.name);
      s += "\n    uids: " + IdListC{}.emit(t.uids);
      s += "\n    gids: " + IdListC{}.emit(t.gids);
      s += "\n    quota:";
      s += "\n      clients: " + std::to_string(t.quota.clients);
      s += "\n      regions: " + std::to_string(t.quota.regions);
      s += "\n      region_bytes: " + format_size(t.quota.region_bytes);
      s += "\n      pinned_bytes: " + format_size(t.quota.pinned_bytes);
      s += "\n      inflight_bytes: " + format_size(t.quota.inflight_bytes);
    }
    return s;
  }
};

// ---- the table ----

struct Field {
  std::string key;
  std::string doc;
  bool reloadable = false;
  std::function<Status(const Ctx&, const YAML::Node&, Config&)> parse;
  std::function<std::string(const Config&)> emit;  // text after "key:"; a block starts with '\n'
  std::function<bool(const Config&, const Config&)> same;
};

template <class Get, class Codec>
Field field(std::string key, Get get, Codec codec, bool reloadable, std::string doc) {
  Field f;
  f.key = key;
  f.doc = std::move(doc);
  f.reloadable = reloadable;
  f.parse = [key, get, codec](const Ctx& ctx, const YAML::Node& n, Config& c) {
    return codec.parse(ctx, key, n, get(c));
  };
  f.emit = [get, codec](const Config& c) { return codec.emit(get(const_cast<Config&>(c))); };
  f.same = [get](const Config& a, const Config& b) {
    return get(const_cast<Config&>(a)) == get(const_cast<Config&>(b));
  };
  return f;
}

// m is a member path and the expansion a lambda: neither can be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define KVF_MEMBER(m) \
  [](Config & c) -> auto& { return c.m; }
// NOLINTEND(bugprone-macro-parentheses)

constexpr bool kReload = true;
constexpr bool kRestart = false;

const std::vector<Field>& table() {
  static const std::vector<Field> kTable = [] {
    const EnumC<LogLevel> log_level{{{"trace", LogLevel::kTrace},
                                     {"debug", LogLevel::kDebug},
                                     {"info", LogLevel::kInfo},
                                     {"warn", LogLevel::kWarn},
                                     {"error", LogLevel::kError},
                                     {"off", LogLevel::kOff}}};
    const EnumC<Backend> backend{{{"auto", Backend::kAuto}, {"cuda", Backend::kCuda}, {"cpu", Backend::kCpu}}};
    const EnumC<Checksum> checksum{{{"xxh3", Checksum::kXxh3}, {"none", Checksum::kNone}}};
    const Check host_port_or_off = [](const std::string& s) { return check_host_port(s, true); };
    const Check host_port = [](const std::string& s) { return check_host_port(s, false); };
    const Check metrics_host_port = [](const std::string& s) { return check_host_port(s, true, true); };
    const Check group = [](const std::string& s) { return s.empty() ? "" : check_name(s, 32); };
    const Check abs_path_or_off = [](const std::string& s) {
      return s.empty() || s[0] == '/' ? std::string() : std::string("is not an absolute path (or \"\" for off)");
    };
    const Check transport = [](const std::string& s) {
      if (s.empty()) return std::string("is empty (expected a UCX_TLS value, e.g. tcp)");
      for (char c : s)
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ',' || c == '^'))
          return std::string("is not a UCX_TLS list (e.g. tcp or rc,sm)");
      return std::string();
    };
    const Check member_id = [](const std::string& s) {
      if (s.size() > 200) return std::string("is longer than 200 characters");
      for (char c : s)
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == ':'))
          return std::string("may hold only letters, digits and _ - . :");
      return std::string();
    };
    const Check url_or_off = [](const std::string& s) {
      if (s.empty()) return std::string();
      if (s.rfind("http://", 0) != 0) return std::string("is not an http://host:port URL (or \"\" for off)");
      return check_host_port(s.substr(7), false);
    };
    const Check etcd_prefix = [](const std::string& s) {
      return !s.empty() && s.front() == '/' && s.back() == '/' ? std::string()
                                                               : std::string("must start and end with '/'");
    };
    return std::vector<Field>{
        field("daemon.socket", KVF_MEMBER(daemon.socket), StrC{check_socket}, kRestart,
              "control socket path (clients: KVFERRY_SOCKET)"),
        field("daemon.socket_mode", KVF_MEMBER(daemon.socket_mode), ModeC{}, kRestart,
              "permission bits of the socket file, octal"),
        field("daemon.group", KVF_MEMBER(daemon.group), StrC{group}, kRestart,
              "group owning the socket (\"\" = the daemon's)"),
        field("daemon.allowed_uids", KVF_MEMBER(daemon.allowed_uids), IdListC{}, kReload,
              "peer uids allowed (both lists empty = the daemon's uid and root)"),
        field("daemon.allowed_gids", KVF_MEMBER(daemon.allowed_gids), IdListC{}, kReload, "peer gids allowed"),
        field("daemon.log_level", KVF_MEMBER(daemon.log_level), log_level, kReload,
              "trace | debug | info | warn | error | off"),
        field("daemon.metrics_listen", KVF_MEMBER(daemon.metrics_listen), StrC{metrics_host_port}, kRestart,
              "host:port of /metrics and /healthz (\"\" = off; port 0 picks a free one, logged)"),
        field("daemon.admin_uids", KVF_MEMBER(daemon.admin_uids), IdListC{}, kReload,
              "peer uids that see and manage every tenant, free of quotas ([] = none)"),
        field("daemon.admin_gids", KVF_MEMBER(daemon.admin_gids), IdListC{}, kReload,
              "peer gids (primary or supplementary) that do the same"),
        field("daemon.debug_read", KVF_MEMBER(daemon.debug_read), BoolC{}, kReload,
              "serve DebugRead: a client reads region bytes through the daemon (tests; off in production)"),
        field("device.backend", KVF_MEMBER(device.backend), backend, kRestart,
              "auto (CUDA when a GPU is usable, else CPU) | cuda | cpu"),
        field("device.gpu", KVF_MEMBER(device.gpu), IntC<int>{0, 1023}, kRestart, "CUDA device index"),
        field("device.mps", KVF_MEMBER(device.mps), BoolC{}, kRestart,
              "MPS runs: the daemon may launch SM kernels on the engines' GPU"),
        field("regions", KVF_MEMBER(regions), RegionsC{}, kRestart, "regions created at start-up"),
        field("tiers.host.capacity", KVF_MEMBER(host.capacity), SizeC{1 << 20}, kRestart,
              "bytes of the pinned host pool (>= 1MiB)"),
        field("tiers.host.numa_node", KVF_MEMBER(host.numa_node), IntC<int>{-1, 1023}, kRestart,
              "NUMA node of the host pool (-1 = no binding)"),
        field("tiers.host.high_watermark", KVF_MEMBER(host.high_watermark), FractionC{}, kReload,
              "start evicting above this fraction of capacity"),
        field("tiers.host.low_watermark", KVF_MEMBER(host.low_watermark), FractionC{}, kReload,
              "evict down to this fraction (< high_watermark)"),
        field("tiers.disk.path", KVF_MEMBER(disk.path), StrC{abs_path_or_off}, kRestart,
              "directory or block device of the disk tier (\"\" = off)"),
        field("tiers.disk.capacity", KVF_MEMBER(disk.capacity), SizeC{}, kRestart,
              "bytes of the disk tier (> 0 when path is set)"),
        field("tiers.disk.queue_depth", KVF_MEMBER(disk.queue_depth), IntC<uint32_t>{1, 4096}, kRestart,
              "io_uring queue depth"),
        field("tiers.disk.direct_io", KVF_MEMBER(disk.direct_io), BoolC{}, kRestart, "open with O_DIRECT"),
        field(
            "tiers.disk.durability", KVF_MEMBER(disk.durability),
            EnumC<DiskDurability>{
                {{"none", DiskDurability::kNone}, {"batch", DiskDurability::kBatch}, {"each", DiskDurability::kEach}}},
            kRestart, "none | batch (one fdatasync per batch) | each (one per block)"),
        field("tiers.disk.io_engine", KVF_MEMBER(disk.io_engine),
              EnumC<DiskIoEngine>{
                  {{"auto", DiskIoEngine::kAuto}, {"uring", DiskIoEngine::kUring}, {"posix", DiskIoEngine::kPosix}}},
              kRestart, "auto | uring | posix (the pread/pwrite pool)"),
        field("tiers.disk.write_through", KVF_MEMBER(disk.write_through), BoolC{}, kRestart,
              "saves also write to disk before they complete (else write-back on eviction)"),
        field("tiers.remote.listen", KVF_MEMBER(remote.listen), StrC{host_port_or_off}, kRestart,
              "host:port the remote tier listens on (\"\" = off)"),
        field("tiers.remote.peers", KVF_MEMBER(remote.peers), StrListC{host_port}, kRestart,
              "host:port of peer daemons"),
        field("tiers.remote.transport", KVF_MEMBER(remote.transport), StrC{transport}, kRestart,
              "UCX_TLS value for the remote tier"),
        field("tiers.remote.id", KVF_MEMBER(remote.id), StrC{member_id}, kRestart,
              "this daemon's member id under etcd (\"\" = the listen address; static peers use addresses)"),
        field("tiers.remote.etcd", KVF_MEMBER(remote.etcd), StrC{url_or_off}, kRestart,
              "etcd endpoint http://host:port for membership (\"\" = the static tiers.remote.peers)"),
        field("tiers.remote.prefix", KVF_MEMBER(remote.prefix), StrC{etcd_prefix}, kRestart,
              "the cluster's key prefix in etcd"),
        field("tiers.remote.ttl", KVF_MEMBER(remote.ttl),
              MillisC{std::chrono::milliseconds(2000), std::chrono::minutes(10)}, kRestart,
              "etcd lease TTL: a dead daemon leaves the cluster within it (whole seconds, >= 2s)"),
        field("tiers.remote.secret_file", KVF_MEMBER(remote.secret_file), StrC{abs_path_or_off}, kRestart,
              "file holding the cluster's shared key (\"\" = none: listen on loopback only)"),
        field("tiers.remote.replicas", KVF_MEMBER(remote.replicas), IntC<uint32_t>{1, 2}, kRestart,
              "owners per block (1 or 2)"),
        field("tiers.remote.timeout", KVF_MEMBER(remote.timeout),
              MillisC{std::chrono::milliseconds(10), std::chrono::minutes(10)}, kRestart,
              "deadline of one remote transfer batch"),
        field("tiers.remote.write", KVF_MEMBER(remote.write),
              EnumC<RemoteWrite>{{{"through", RemoteWrite::kThrough}, {"on_evict", RemoteWrite::kOnEvict}}}, kRestart,
              "through (a save also writes to the block's owner) | on_evict (when the host pool evicts it; "
              "needs tiers.disk.path off)"),
        field("tiers.remote.lookup_timeout", KVF_MEMBER(remote.lookup_timeout),
              MillisC{std::chrono::milliseconds(1), std::chrono::minutes(1)}, kRestart,
              "deadline of a remote lookup (an owner that does not answer by then is a miss)"),
        field("tiers.remote.local_transfer", KVF_MEMBER(remote.local_transfer), BoolC{}, kRestart,
              "a send into a region of a peer daemon on this host copies region to region (device to device "
              "for GPU regions) instead of through both host pools"),
        field("integrity.checksum", KVF_MEMBER(integrity.checksum), checksum, kRestart,
              "checksum of stored blocks: xxh3 | none"),
        field("integrity.verify_on_load", KVF_MEMBER(integrity.verify_on_load), BoolC{}, kReload,
              "verify every block loaded from a lower tier"),
        field("limits.max_clients", KVF_MEMBER(limits.max_clients), IntC<uint32_t>{1, 65536}, kReload,
              "connected engines at most (applies to new connections)"),
        field("limits.ring_entries", KVF_MEMBER(limits.ring_entries), IntC<uint32_t>{16, 65536, true}, kRestart,
              "slots per client submission/completion ring (power of two)"),
        field("limits.request_timeout", KVF_MEMBER(limits.request_timeout),
              MillisC{std::chrono::milliseconds(1), std::chrono::hours(24)}, kReload,
              "a request fails after this long"),
        field("limits.watchdog", KVF_MEMBER(limits.watchdog),
              MillisC{std::chrono::milliseconds(0), std::chrono::hours(1)}, kRestart,
              "watchdog interval (0s = WATCHDOG_USEC from systemd)"),
        field("limits.handshake_timeout", KVF_MEMBER(limits.handshake_timeout),
              MillisC{std::chrono::milliseconds(10), std::chrono::minutes(10)}, kReload,
              "a connection without a Hello is closed this long after accept (or its last status reply)"),
        field("limits.max_unauthenticated", KVF_MEMBER(limits.max_unauthenticated), IntC<uint32_t>{1, 65536}, kReload,
              "connections without a completed Hello at most; more are closed at once"),
        field("limits.send_timeout", KVF_MEMBER(limits.send_timeout),
              MillisC{std::chrono::milliseconds(10), std::chrono::minutes(10)}, kReload,
              "a client whose oldest queued control reply stays unsent this long is disconnected"),
        field("limits.tenant.clients", KVF_MEMBER(limits.tenant.clients), IntC<uint32_t>{0, 65536}, kReload,
              "default quota: connected clients per tenant (0 = no limit; checked at each Hello)"),
        field("limits.tenant.regions", KVF_MEMBER(limits.tenant.regions), IntC<uint32_t>{0, 65536}, kReload,
              "default quota: regions a tenant created or registered (0 = no limit)"),
        field("limits.tenant.region_bytes", KVF_MEMBER(limits.tenant.region_bytes), SizeC{}, kReload,
              "default quota: bytes of those regions (0 = no limit)"),
        field("limits.tenant.pinned_bytes", KVF_MEMBER(limits.tenant.pinned_bytes), SizeC{}, kReload,
              "default quota: bytes of a tenant's pinned blocks (0 = half of tiers.host.capacity; new clients)"),
        field("limits.tenant.inflight_bytes", KVF_MEMBER(limits.tenant.inflight_bytes), SizeC{}, kReload,
              "default quota: bytes of a tenant's queued or running saves/loads (0 = no limit; new clients)"),
        field("tenants", KVF_MEMBER(tenants), TenantsC{}, kReload,
              "tenants: who (uids, gids) may use which name, and its quotas ([] = one tenant per uid)"),
    };
  }();
  return kTable;
}

#undef KVF_MEMBER

// Every key a file may hold: the table's keys and the sections above them.
const std::vector<std::string>& known_keys() {
  static const std::vector<std::string> kKnown = [] {
    std::vector<std::string> v;
    for (const Field& f : table()) {
      for (size_t dot = f.key.find('.'); dot != std::string::npos; dot = f.key.find('.', dot + 1)) {
        const std::string sec = f.key.substr(0, dot);
        if (std::find(v.begin(), v.end(), sec) == v.end()) v.push_back(sec);
      }
      v.push_back(f.key);
    }
    return v;
  }();
  return kKnown;
}

bool is_section(const std::string& key) {
  for (const Field& f : table())
    if (f.key.size() > key.size() && f.key.compare(0, key.size(), key) == 0 && f.key[key.size()] == '.') return true;
  return false;
}

const Field* find_field(const std::string& key) {
  for (const Field& f : table())
    if (f.key == key) return &f;
  return nullptr;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" when a known key is close enough to be the intended one.
std::string suggestion(std::string_view key, const std::vector<std::string>& known) {
  if (key.size() > 256) return "";
  size_t best = SIZE_MAX;
  std::string_view pick;
  // A shortened key ("tiers.host.numa") means the one it begins.
  for (const std::string& k : known)
    if (k.size() > key.size() && k.compare(0, key.size(), key) == 0 && k.find('.', key.size()) == std::string::npos)
      return " (did you mean '" + k + "'?)";
  for (const std::string& k : known) {
    const size_t d = edit_distance(key, k);
    if (d < best) best = d, pick = k;
  }
  // Within a third of the key's last component (at least 2 edits): a typo, not a different key.
  const size_t dot = key.rfind('.');
  const size_t leaf = key.size() - (dot == std::string_view::npos ? 0 : dot + 1);
  if (pick.empty() || best > std::max<size_t>(2, leaf / 3)) return "";
  return " (did you mean '" + std::string(pick) + "'?)";
}

// YAML allows only printable characters (YAML 1.2 §5.1) in UTF-8. Checked before yaml-cpp sees the
// text: yaml-cpp 0.7 loops forever on some inputs holding a NUL byte.
Status check_characters(const Ctx& ctx, std::string_view s) {
  int line = 0;
  size_t col = 0;
  for (size_t i = 0; i < s.size(); ++col) {
    const auto c = static_cast<unsigned char>(s[i]);
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", c);
    if (c == '\n') {
      ++line, ++i;
      col = SIZE_MAX;  // the loop's ++col makes it 0
      continue;
    }
    if (c < 0x80) {
      if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f)
        return ctx.fail_at(line, "",
                           "control character " + std::string(hex) + " at column " + std::to_string(col + 1) +
                               " is not allowed in YAML");
      ++i;
      continue;
    }
    // A UTF-8 sequence: lead byte, continuation count, no overlong forms, no surrogates, <= U+10FFFF.
    const size_t n = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : 0;
    uint32_t cp = n == 3 ? c & 0x07u : n == 2 ? c & 0x0fu : c & 0x1fu;
    bool ok = n > 0 && c <= 0xf4;
    for (size_t k = 1; ok && k <= n; ++k) {
      if (i + k >= s.size() || (static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) {
        ok = false;
      } else {
        cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3fu);
      }
    }
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (ok && (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))) ok = false;
    if (!ok)
      return ctx.fail_at(line, "",
                         "invalid UTF-8 (byte " + std::string(hex) + ") at column " + std::to_string(col + 1));
    i += n + 1;
  }
  return Status::Ok();
}

// Records where documents start, and nothing else.
struct DocumentStarts : YAML::EventHandler {
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& m) override { starts.push_back(m); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// The text must hold at most one document. yaml-cpp 0.7 does not advance on some text (a ','
// at the very start: YAML::LoadAll loops forever, YAML::Load returns an empty document), which
// shows as a second document starting where the first did.
Status single_document(const Ctx& ctx, const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts h;
  while (h.starts.size() < 2 && parser.HandleNextDocument(h)) {
  }
  if (h.starts.size() < 2) return Status::Ok();
  if (h.starts[1].pos == h.starts[0].pos)
    return ctx.fail_at(h.starts[0].line, "",
                       "yaml: cannot parse the text from column " + std::to_string(h.starts[0].column + 1) + " on");
  return ctx.fail_at(h.starts[1].line, "", "holds more than one YAML document");
}

struct Loader {
  Ctx ctx;
  Config cfg;
  std::map<std::string, int> lines;  // key -> 0-based line where the file sets it
  YAML::Node doc;                    // the parsed text (cross_checks finds lines in it)

  Status walk(const YAML::Node& map, const std::string& prefix) {
    std::set<std::string> seen;
    for (const auto& kv : map) {
      if (!kv.first.IsScalar()) return ctx.fail(kv.first, prefix, "a key must be a plain name");
      const std::string& k = kv.first.Scalar();
      const std::string full = prefix.empty() ? k : prefix + "." + k;
      if (!seen.insert(k).second) return ctx.fail(kv.first, full, "duplicate key");
      if (const Field* f = find_field(full)) {
        lines[full] = kv.first.Mark().line;
        KVFERRY_TRY(f->parse(ctx, kv.second, cfg));
      } else if (is_section(full)) {
        if (kv.second.IsNull()) continue;  // "tiers:" with nothing under it: all defaults
        if (!kv.second.IsMap()) return ctx.fail(kv.second, full, shown(kv.second) + " is not a mapping of keys");
        KVFERRY_TRY(walk(kv.second, full));
      } else {
        return ctx.fail(kv.first, "", "unknown key '" + full + "'" + suggestion(full, known_keys()));
      }
    }
    return Status::Ok();
  }

  int line_of(const std::string& key, const std::string& other) const {
    if (auto it = lines.find(key); it != lines.end()) return it->second;
    if (auto it = lines.find(other); it != lines.end()) return it->second;
    return -1;
  }

  // Rules between keys, checked once every key has its value.
  Status cross_checks() const {
    const HostTierConfig& h = cfg.host;
    if (!(h.low_watermark < h.high_watermark)) {
      return ctx.fail_at(line_of("tiers.host.low_watermark", "tiers.host.high_watermark"), "tiers.host.low_watermark",
                         FractionC{}.emit(h.low_watermark) + " must be below tiers.host.high_watermark (" +
                             FractionC{}.emit(h.high_watermark) + ")");
    }
    if (!cfg.disk.path.empty() && cfg.disk.capacity == 0) {
      return ctx.fail_at(line_of("tiers.disk.capacity", "tiers.disk.path"), "tiers.disk.capacity",
                         "must be set (> 0) when tiers.disk.path is set");
    }
    if (cfg.daemon.metrics_listen == cfg.remote.listen && !cfg.remote.listen.empty()) {
      return ctx.fail_at(line_of("tiers.remote.listen", "daemon.metrics_listen"), "tiers.remote.listen",
                         "'" + cfg.remote.listen + "' is also daemon.metrics_listen");
    }
    const RemoteTierConfig& r = cfg.remote;
    if (r.ttl.count() % 1000 != 0)
      return ctx.fail_at(line_of("tiers.remote.ttl", "tiers.remote.ttl"), "tiers.remote.ttl",
                         "must be whole seconds (etcd leases count seconds)");
    for (size_t i = 0; i < cfg.regions.size(); ++i) {
      const std::string& t = cfg.regions[i].tenant;
      if (t.empty()) continue;
      bool known = false;
      for (const TenantConfig& tc : cfg.tenants) known = known || tc.name == t;
      if (known) continue;
      int line = line_of("regions", "regions");
      if (doc.IsMap() && doc["regions"].IsSequence() && i < doc["regions"].size() && doc["regions"][i].IsMap() &&
          doc["regions"][i]["tenant"])
        line = doc["regions"][i]["tenant"].Mark().line;
      return ctx.fail_at(line, "regions[" + std::to_string(i) + "].tenant",
                         "'" + t + "' is not the name of an entry of tenants");
    }
    return Status::Ok();
  }

  Result<Config> run(std::string_view text) {
    if (text.size() > kMaxFileBytes)
      return ctx.fail_at(-1, "", "is larger than " + std::to_string(kMaxFileBytes) + " bytes");
    KVFERRY_TRY(check_characters(ctx, text));
    try {
      const std::string s(text);
      KVFERRY_TRY(single_document(ctx, s));
      doc = YAML::Load(s);
    } catch (const YAML::Exception& e) {
      return ctx.fail_at(e.mark.line, "", "yaml: " + e.msg);
    } catch (const std::exception& e) {
      return ctx.fail_at(-1, "", std::string("yaml: ") + e.what());
    }
    try {
      if (!doc.IsNull()) {
        if (!doc.IsMap()) return ctx.fail(doc, "", "the top level is " + shown(doc) + ", not a mapping of keys");
        KVFERRY_TRY(walk(doc, ""));
      }
    } catch (const YAML::Exception& e) {
      return ctx.fail_at(e.mark.line, "", "yaml: " + e.msg);
    }
    try {
      KVFERRY_TRY(cross_checks());
    } catch (const YAML::Exception& e) {
      return ctx.fail_at(e.mark.line, "", "yaml: " + e.msg);
    }
    return cfg;
  }
};

std::vector<std::string> changes(const Config& a, const Config& b, bool reloadable) {
  std::vector<std::string> out;
  for (const Field& f : table())
    if (f.reloadable == reloadable && !f.same(a, b)) out.push_back(f.key);
  return out;
}

}  // namespace

const std::vector<KeyDoc>& schema() {
  static const std::vector<KeyDoc> kSchema = [] {
    std::vector<KeyDoc> v;
    const Config defaults;
    for (const Field& f : table()) {
      v.push_back({f.key, f.emit(defaults), f.doc, f.reloadable});
      if (f.key == "regions")
        for (const KeyDoc& k : region_keys()) v.push_back(k);
      if (f.key == "tenants")
        for (const KeyDoc& k : tenant_keys()) v.push_back(k);
    }
    return v;
  }();
  return kSchema;
}

Result<Config> load_string(std::string_view yaml, std::string_view origin) {
  Loader l{Ctx{std::string(origin)}, Config{}, {}, {}};
  return l.run(yaml);
}

Result<Config> load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Result<Config>(ErrorCode::kConfig, path + ": cannot read: " + std::strerror(errno));
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxFileBytes) break;
  }
  if (in.bad()) return Result<Config>(ErrorCode::kConfig, path + ": cannot read: " + std::strerror(errno));
  return load_string(text, path);
}

std::string to_yaml(const Config& c) {
  std::string out = "# kvferry effective configuration: every key, defaults included\n";
  std::vector<std::string> open;  // sections currently open
  for (const Field& f : table()) {
    std::vector<std::string> parts;
    for (size_t start = 0;;) {
      const size_t dot = f.key.find('.', start);
      parts.push_back(f.key.substr(start, dot - start));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common]) ++common;
    open.resize(common);
    if (common == 0 && !out.empty() && out.back() == '\n' && f.key != table().front().key) out += "\n";
    for (size_t i = common; i + 1 < parts.size(); ++i) {
      out += std::string(2 * i, ' ') + parts[i] + ":\n";
      open.push_back(parts[i]);
    }
    const std::string indent(2 * (parts.size() - 1), ' ');
    const std::string value = f.emit(c);
    if (!value.empty() && value[0] == '\n') {
      out += indent + parts.back() + ":  # " + f.doc + value + "\n";
    } else {
      out += indent + parts.back() + ": " + value + "  # " + f.doc + "\n";
    }
  }
  return out;
}

std::vector<std::string> non_reloadable_changes(const Config& a, const Config& b) { return changes(a, b, false); }
std::vector<std::string> reloadable_changes(const Config& a, const Config& b) { return changes(a, b, true); }

}  // namespace kvferry::config
