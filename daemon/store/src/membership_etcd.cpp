#include <utility>  // before Asio (Boost 1.74 + C++20)

#include "kvferry/store/membership.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

namespace kvferry::store {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// ---- base64 (etcd's JSON gateway carries keys and values as base64 of bytes) ----

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string b64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8 | uint8_t(in[i + 2]);
    out += kB64[v >> 18 & 63];
    out += kB64[v >> 12 & 63];
    out += kB64[v >> 6 & 63];
    out += kB64[v & 63];
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    out += kB64[v >> 18 & 63];
    out += kB64[v >> 12 & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8;
    out += kB64[v >> 18 & 63];
    out += kB64[v >> 12 & 63];
    out += kB64[v >> 6 & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> b64_decode(std::string_view in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = val(c);
    if (v < 0) return std::nullopt;
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char(acc >> bits & 0xff);
    }
  }
  return out;
}

/// The end of a prefix range: the prefix with its last byte incremented (etcd's convention).
std::string prefix_end(std::string p) {
  while (!p.empty()) {
    if (uint8_t(p.back()) < 0xff) {
      p.back() = char(uint8_t(p.back()) + 1);
      return p;
    }
    p.pop_back();
  }
  return std::string(1, '\0');  // the whole key space
}

/// grpc-gateway writes int64 as JSON strings; accept numbers too.
int64_t jint(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (...) {
      return 0;
    }
  }
  if (it->is_number_integer()) return it->get<int64_t>();
  return 0;
}

struct Endpoint {
  std::string host;
  std::string port;
};

Result<Endpoint> parse_endpoint(std::string url) {
  constexpr std::string_view kHttp = "http://";
  if (url.rfind("https://", 0) == 0)
    return {ErrorCode::kUnsupported, "etcd endpoint " + url + ": TLS is not supported"};
  if (url.rfind(kHttp, 0) == 0) url.erase(0, kHttp.size());
  while (!url.empty() && url.back() == '/') url.pop_back();
  auto colon = url.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == url.size())
    return {ErrorCode::kInvalidArgument, "etcd endpoint '" + url + "' is not http://host:port"};
  return Endpoint{url.substr(0, colon), url.substr(colon + 1)};
}

/// Splits a byte stream into top-level JSON objects (grpc-gateway streams one object per message).
class JsonSplitter {
 public:
  template <class F>
  void feed(std::string_view bytes, F&& on_object) {
    for (char c : bytes) {
      if (depth_ == 0 && c != '{') continue;  // delimiters between objects
      cur_ += c;
      if (in_string_) {
        if (escape_)
          escape_ = false;
        else if (c == '\\')
          escape_ = true;
        else if (c == '"')
          in_string_ = false;
        continue;
      }
      if (c == '"')
        in_string_ = true;
      else if (c == '{')
        ++depth_;
      else if (c == '}' && --depth_ == 0) {
        on_object(cur_);
        cur_.clear();
      }
      if (cur_.size() > (64u << 20)) {  // a runaway message: drop it rather than grow without bound
        cur_.clear();
        depth_ = 0;
        in_string_ = escape_ = false;
      }
    }
  }

 private:
  std::string cur_;
  int depth_ = 0;
  bool in_string_ = false;
  bool escape_ = false;
};

/// One POST to the gateway, on its own io_context, bounded by `timeout` from connect to the last
/// byte. `on_object` receives each JSON object of a streamed (chunked) reply and returns whether to
/// go on; a plain reply is handed over whole. stop() (any thread) ends run() early.
class GatewayCall {
 public:
  Status run(const Endpoint& ep, const std::string& path, const std::string& body, std::optional<milliseconds> timeout,
             milliseconds connect_timeout, const std::function<bool(json&)>& on_object) {
    net::ip::tcp::resolver resolver(ioc_);
    beast::tcp_stream stream(ioc_);
    http::request<http::string_body> req{http::verb::post, path, 11};
    req.set(http::field::host, ep.host + ":" + ep.port);
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    beast::flat_buffer buf;
    http::response_parser<http::string_body> parser;
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    JsonSplitter splitter;
    Status result(ErrorCode::kTimeout, "etcd " + path + ": no reply in time");
    bool finished = false;
    auto fail = [&](const char* what, const beast::error_code& ec) {
      if (finished) return;
      finished = true;
      ErrorCode code = ec == beast::error::timeout ? ErrorCode::kTimeout : ErrorCode::kUnavailable;
      result = Status(code, std::string("etcd ") + path + ": " + what + ": " + ec.message());
    };
    auto deliver = [&](const std::string& text) {
      if (finished) return;
      json j = json::parse(text, nullptr, false);
      if (j.is_discarded()) {
        finished = true;
        result = Status(ErrorCode::kProtocol, "etcd " + path + ": reply is not JSON");
        ioc_.stop();
        return;
      }
      if (!on_object(j)) {
        finished = true;
        result = Status::Ok();
        ioc_.stop();
      }
    };
    auto on_chunk = [&](std::uint64_t, beast::string_view data, beast::error_code&) -> std::size_t {
      splitter.feed(std::string_view(data.data(), data.size()), deliver);
      return data.size();
    };
    parser.on_chunk_body(on_chunk);  // Beast keeps a reference: on_chunk outlives the parse
    stream.expires_after(timeout ? *timeout : connect_timeout);
    resolver.async_resolve(ep.host, ep.port, [&](beast::error_code ec, net::ip::tcp::resolver::results_type rs) {
      if (ec) return fail("resolve", ec);
      stream.async_connect(rs, [&](beast::error_code ec, const net::ip::tcp::endpoint&) {
        if (ec) return fail("connect", ec);
        http::async_write(stream, req, [&](beast::error_code ec, std::size_t) {
          if (ec) return fail("write", ec);
          http::async_read_header(stream, buf, parser, [&](beast::error_code ec, std::size_t) {
            if (ec) return fail("reading the reply", ec);
            if (!timeout) stream.expires_never();  // a watch lives until stopped
            if (parser.get().result() != http::status::ok) {
              finished = true;
              result = Status(ErrorCode::kUnavailable,
                              "etcd " + path + ": HTTP " + std::to_string(parser.get().result_int()));
              return;
            }
            http::async_read(stream, buf, parser, [&](beast::error_code ec, std::size_t) {
              if (finished) return;
              if (ec) return fail("reading the reply", ec);
              if (!parser.chunked()) deliver(parser.get().body());
              if (!finished) {
                finished = true;
                result = parser.chunked() ? Status(ErrorCode::kUnavailable, "etcd " + path + ": stream ended")
                                          : Status::Ok();
              }
            });
          });
        });
      });
    });
    ioc_.run();
    if (!finished && stopped_.load()) return Status(ErrorCode::kCancelled, "etcd " + path + ": stopped");
    return result;
  }

  void stop() {
    stopped_ = true;
    ioc_.stop();
  }

 private:
  net::io_context ioc_;
  std::atomic<bool> stopped_{false};
};

/// A unary gateway call: the first (only) JSON object of the reply, or an error (an "error" reply
/// from the gateway becomes kUnavailable with its message).
Result<json> unary(const Endpoint& ep, const std::string& path, const json& body, milliseconds timeout) {
  GatewayCall call;
  json out;
  bool got = false;
  Status s = call.run(ep, path, body.dump(), timeout, timeout, [&](json& j) {
    out = std::move(j);
    got = true;
    return false;
  });
  if (!s.ok()) return s;
  if (!got) return Status(ErrorCode::kProtocol, "etcd " + path + ": empty reply");
  if (out.contains("error")) {
    return Status(ErrorCode::kUnavailable, "etcd " + path + ": " + out["error"].value("message", out.dump()));
  }
  if (out.contains("result") && out["result"].is_object()) out = out["result"];
  return out;
}

void log_line(const EtcdMembershipOptions& opts, const std::string& line) {
  if (opts.log)
    opts.log(line);
  else
    std::fprintf(stderr, "kvferry membership: %s\n", line.c_str());
}

/// The view and its waiters, shared by both implementations.
class View {
 public:
  std::vector<MemberRecord> members() const {
    std::lock_guard lk(mu_);
    std::vector<MemberRecord> out;
    out.reserve(members_.size());
    for (auto& [id, m] : members_) out.push_back(m);
    return out;
  }
  bool wait_until(const std::function<bool(const std::vector<MemberRecord>&)>& pred, milliseconds timeout) const {
    std::unique_lock lk(mu_);
    auto snapshot = [&] {
      std::vector<MemberRecord> v;
      for (auto& [id, m] : members_) v.push_back(m);
      return v;
    };
    return cv_.wait_for(lk, timeout, [&] { return pred(snapshot()); });
  }
  /// Applies a PUT; returns the event to report, if any.
  std::optional<MembershipEvent> put(const MemberRecord& m) {
    std::lock_guard lk(mu_);
    auto it = members_.find(m.id);
    std::optional<MembershipEvent> ev;
    if (it == members_.end())
      ev = MembershipEvent{MembershipEventType::kJoined, m, ""};
    else if (!(it->second == m))
      ev = MembershipEvent{MembershipEventType::kUpdated, m, ""};
    members_[m.id] = m;
    cv_.notify_all();
    return ev;
  }
  std::optional<MembershipEvent> erase(const std::string& id) {
    std::lock_guard lk(mu_);
    auto it = members_.find(id);
    if (it == members_.end()) return std::nullopt;
    MembershipEvent ev{MembershipEventType::kLeft, it->second, ""};
    members_.erase(it);
    cv_.notify_all();
    return ev;
  }
  /// Replaces the view with a snapshot; returns the events that turn the old view into it.
  std::vector<MembershipEvent> replace(const std::map<std::string, MemberRecord>& snap) {
    std::vector<MembershipEvent> evs;
    std::lock_guard lk(mu_);
    for (auto& [id, m] : members_)
      if (!snap.count(id)) evs.push_back({MembershipEventType::kLeft, m, ""});
    for (auto& [id, m] : snap) {
      auto it = members_.find(id);
      if (it == members_.end())
        evs.push_back({MembershipEventType::kJoined, m, ""});
      else if (!(it->second == m))
        evs.push_back({MembershipEventType::kUpdated, m, ""});
    }
    members_ = snap;
    cv_.notify_all();
    return evs;
  }
  void notify() const {
    std::lock_guard lk(mu_);
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<std::string, MemberRecord> members_;
};

class EtcdMembership final : public Membership {
 public:
  EtcdMembership(EtcdMembershipOptions opts, Endpoint ep, MemberRecord self)
      : opts_(std::move(opts)), ep_(std::move(ep)), self_(std::move(self)), key_(opts_.prefix + self_.id) {}
  ~EtcdMembership() override { stop(); }
  EtcdMembership(const EtcdMembership&) = delete;
  EtcdMembership& operator=(const EtcdMembership&) = delete;

  Status start() override {
    if (thread_.joinable()) return Status(ErrorCode::kInvalidArgument, "membership already started");
    KVFERRY_TRY(join());
    set_health(Status::Ok());
    thread_ = std::thread([this] { session_loop(); });
    return Status::Ok();
  }

  void stop() override {
    {
      std::lock_guard lk(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    stop_watch();
    if (lease_ != 0) {
      auto r = unary(ep_, "/v3/lease/revoke", json{{"ID", std::to_string(lease_)}}, opts_.request_timeout);
      if (!r.ok()) log_line(opts_, "revoking lease " + std::to_string(lease_) + ": " + r.status().to_string());
      lease_ = 0;
    }
    set_health(Status(ErrorCode::kCancelled, "membership stopped"));
  }

  const MemberRecord& self() const override { return self_; }
  std::vector<MemberRecord> members() const override { return view_.members(); }
  Status health() const override {
    std::lock_guard lk(mu_);
    return health_;
  }
  bool wait_until(const std::function<bool(const std::vector<MemberRecord>&)>& pred,
                  milliseconds timeout) const override {
    return view_.wait_until(pred, timeout);
  }
  void set_listener(Listener listener) override { listener_ = std::move(listener); }

 private:
  void emit(const MembershipEvent& ev) {
    std::lock_guard lk(listener_mu_);
    if (listener_) listener_(ev);
  }

  void set_health(Status s) {
    {
      std::lock_guard lk(mu_);
      health_ = std::move(s);
    }
    view_.notify();
  }

  /// Grants a lease, publishes the record under it, reads the prefix and starts the watch from the
  /// revision of that read.
  Status join() {
    auto grant = unary(ep_, "/v3/lease/grant", json{{"TTL", opts_.ttl.count()}}, opts_.request_timeout);
    if (!grant.ok()) return grant.status().with_context("granting a lease");
    int64_t id = jint(*grant, "ID");
    if (id == 0) return Status(ErrorCode::kProtocol, "etcd granted no lease: " + grant->dump());
    lease_ = id;
    auto put =
        unary(ep_, "/v3/kv/put",
              json{{"key", b64_encode(key_)}, {"value", b64_encode(self_.to_json())}, {"lease", std::to_string(id)}},
              opts_.request_timeout);
    if (!put.ok()) return put.status().with_context("publishing " + key_);
    auto range = unary(ep_, "/v3/kv/range",
                       json{{"key", b64_encode(opts_.prefix)}, {"range_end", b64_encode(prefix_end(opts_.prefix))}},
                       opts_.request_timeout);
    if (!range.ok()) return range.status().with_context("reading " + opts_.prefix);
    int64_t rev = range->contains("header") ? jint((*range)["header"], "revision") : 0;
    std::map<std::string, MemberRecord> snap;
    if (range->contains("kvs")) {
      for (auto& kv : (*range)["kvs"]) {
        auto m = decode_kv(kv);
        if (m) snap[m->id] = std::move(*m);
      }
    }
    for (auto& ev : view_.replace(snap)) emit(ev);
    return start_watch(rev + 1);
  }

  std::optional<MemberRecord> decode_kv(const json& kv) {
    auto key = b64_decode(kv.value("key", ""));
    auto val = b64_decode(kv.value("value", ""));
    if (!key || !val || key->rfind(opts_.prefix, 0) != 0) return std::nullopt;
    auto m = MemberRecord::from_json(*val);
    if (!m.ok() || m->id != key->substr(opts_.prefix.size())) {
      log_line(opts_, "ignoring a malformed member record under " + *key);
      return std::nullopt;
    }
    return std::move(*m);
  }

  Status start_watch(int64_t from_rev) {
    stop_watch();
    watch_broken_ = false;
    watch_created_ = false;
    auto call = std::make_shared<GatewayCall>();
    watch_call_ = call;
    json req{{"create_request",
              {{"key", b64_encode(opts_.prefix)},
               {"range_end", b64_encode(prefix_end(opts_.prefix))},
               {"start_revision", std::to_string(from_rev)}}}};
    watch_thread_ = std::thread([this, call, body = req.dump()] {
      Status s = call->run(ep_, "/v3/watch", body, std::nullopt, opts_.request_timeout,
                           [this](json& j) { return on_watch(j); });
      {
        std::lock_guard lk(mu_);
        watch_broken_ = true;
        watch_reason_ = s.ok() ? "watch cancelled by etcd" : s.to_string();
      }
      cv_.notify_all();
    });
    // The watch counts once etcd confirms it; events from from_rev on are delivered either way.
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, opts_.request_timeout, [&] { return watch_created_ || watch_broken_; });
    if (!watch_created_) return Status(ErrorCode::kUnavailable, "etcd watch not created: " + watch_reason_);
    return Status::Ok();
  }

  void stop_watch() {
    if (auto c = watch_call_) c->stop();
    if (watch_thread_.joinable()) watch_thread_.join();
    watch_call_.reset();
  }

  bool on_watch(json& j) {
    if (j.contains("error")) {
      std::lock_guard lk(mu_);
      watch_reason_ = "etcd watch error: " + j["error"].value("message", j.dump());
      return false;
    }
    json& r = j.contains("result") ? j["result"] : j;
    if (r.value("created", false)) {
      std::lock_guard lk(mu_);
      watch_created_ = true;
      cv_.notify_all();
    }
    if (r.value("canceled", false) || jint(r, "compact_revision") != 0) {
      std::lock_guard lk(mu_);
      watch_reason_ = "etcd cancelled the watch: " + r.value("cancel_reason", std::string("compacted"));
      return false;
    }
    if (r.contains("events")) {
      for (auto& e : r["events"]) {
        if (!e.contains("kv")) continue;
        bool del = e.value("type", std::string("PUT")) == "DELETE";
        std::optional<MembershipEvent> ev;
        if (del) {
          auto key = b64_decode(e["kv"].value("key", ""));
          if (key && key->rfind(opts_.prefix, 0) == 0) ev = view_.erase(key->substr(opts_.prefix.size()));
        } else if (auto m = decode_kv(e["kv"])) {
          ev = view_.put(*m);
        }
        if (ev) emit(*ev);
      }
    }
    return true;
  }

  /// Keeps the lease alive every ttl/3 while the watch runs; on losing either, reports kLost and
  /// rejoins every retry_interval until it holds a lease again (kRestored) or stop() is called.
  void session_loop() {
    const milliseconds period = std::chrono::duration_cast<milliseconds>(opts_.ttl) / 3;
    const milliseconds retry = std::min(period, opts_.retry_interval);
    auto last_ok = Clock::now();
    auto next_at = last_ok + period;
    bool lost = false;
    while (true) {
      std::string reason;
      {
        std::unique_lock lk(mu_);
        cv_.wait_until(lk, next_at, [&] { return stopping_ || (!lost && watch_broken_); });
        if (stopping_) return;
        if (!lost && watch_broken_) reason = watch_reason_;
      }
      if (lost) {
        if (join().ok()) {
          lost = false;
          last_ok = Clock::now();
          next_at = last_ok + period;
          emit({MembershipEventType::kRestored, self_, ""});  // before health wakes waiters
          set_health(Status::Ok());
        } else {
          next_at = Clock::now() + opts_.retry_interval;
        }
        continue;
      }
      if (reason.empty()) {
        auto ka = unary(ep_, "/v3/lease/keepalive", json{{"ID", std::to_string(lease_)}}, opts_.request_timeout);
        if (ka.ok() && jint(*ka, "TTL") > 0) {
          last_ok = Clock::now();
          next_at = last_ok + period;
          continue;
        }
        if (ka.ok()) {
          reason = "lease " + std::to_string(lease_) + " expired";
        } else if (Clock::now() - last_ok >= opts_.ttl) {
          reason = "lease lost: " + ka.status().to_string();
        } else {
          next_at = Clock::now() + retry;
          continue;
        }
      }
      lost = true;
      stop_watch();
      lease_ = 0;
      log_line(opts_, "lost membership: " + reason);
      emit({MembershipEventType::kLost, self_, reason});
      set_health(Status(ErrorCode::kUnavailable, reason));
      next_at = Clock::now() + opts_.retry_interval;
    }
  }

  EtcdMembershipOptions opts_;
  Endpoint ep_;
  MemberRecord self_;
  std::string key_;
  View view_;
  std::mutex listener_mu_;
  Listener listener_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool watch_broken_ = false;
  bool watch_created_ = false;
  std::string watch_reason_;
  Status health_{ErrorCode::kUnavailable, "not started"};
  std::atomic<int64_t> lease_{0};
  std::shared_ptr<GatewayCall> watch_call_;
  std::thread watch_thread_;
  std::thread thread_;
};

class StaticMembership final : public Membership {
 public:
  StaticMembership(MemberRecord self, std::map<std::string, MemberRecord> all)
      : self_(std::move(self)), all_(std::move(all)) {}
  Status start() override {
    for (auto& ev : view_.replace(all_)) {
      if (listener_) listener_(ev);
    }
    return Status::Ok();
  }
  void stop() override { view_.notify(); }
  const MemberRecord& self() const override { return self_; }
  std::vector<MemberRecord> members() const override { return view_.members(); }
  Status health() const override { return Status::Ok(); }
  bool wait_until(const std::function<bool(const std::vector<MemberRecord>&)>& pred,
                  milliseconds timeout) const override {
    return view_.wait_until(pred, timeout);
  }
  void set_listener(Listener listener) override { listener_ = std::move(listener); }

 private:
  MemberRecord self_;
  std::map<std::string, MemberRecord> all_;
  View view_;
  Listener listener_;
};

}  // namespace

std::string MemberRecord::to_json() const {
  json j{{"id", id},
         {"incarnation", std::to_string(incarnation)},
         {"address", address},
         {"pool_bytes", std::to_string(pool_bytes)},
         {"slot_align", std::to_string(slot_align)},
         {"formats", formats}};
  return j.dump();
}

Result<MemberRecord> MemberRecord::from_json(std::string_view text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status(ErrorCode::kProtocol, "member record is not a JSON object");
  MemberRecord m;
  auto str = [&](const char* k) -> std::string {
    auto it = j.find(k);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto u64 = [&](const char* k) -> uint64_t {
    try {
      return std::stoull(str(k));
    } catch (...) {
      return 0;
    }
  };
  m.id = str("id");
  if (m.id.empty()) return Status(ErrorCode::kProtocol, "member record without an id");
  m.incarnation = u64("incarnation");
  m.address = str("address");
  m.pool_bytes = u64("pool_bytes");
  m.slot_align = u64("slot_align");
  if (auto it = j.find("formats"); it != j.end() && it->is_array()) {
    for (auto& f : *it)
      if (f.is_string()) m.formats.push_back(f.get<std::string>());
  }
  return m;
}

Result<std::unique_ptr<Membership>> make_etcd_membership(const EtcdMembershipOptions& opts, MemberRecord self) {
  if (self.id.empty() || self.id.find('/') != std::string::npos)
    return Status(ErrorCode::kInvalidArgument, "member id '" + self.id + "' must be non-empty and contain no '/'");
  if (opts.ttl.count() < 2) return Status(ErrorCode::kInvalidArgument, "lease TTL must be at least 2 s");
  KVFERRY_ASSIGN_OR_RETURN(Endpoint ep, parse_endpoint(opts.endpoint));
  if (self.incarnation == 0) {
    self.incarnation = uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
  }
  return std::unique_ptr<Membership>(std::make_unique<EtcdMembership>(opts, std::move(ep), std::move(self)));
}

Result<std::unique_ptr<Membership>> make_static_membership(MemberRecord self, std::vector<MemberRecord> peers) {
  std::map<std::string, MemberRecord> all;
  if (self.id.empty()) return Status(ErrorCode::kInvalidArgument, "member id must be non-empty");
  all[self.id] = self;
  for (auto& p : peers) {
    if (p.id.empty()) return Status(ErrorCode::kInvalidArgument, "a static peer has no id");
    if (!all.emplace(p.id, p).second) return Status(ErrorCode::kInvalidArgument, "duplicate member id '" + p.id + "'");
  }
  return std::unique_ptr<Membership>(std::make_unique<StaticMembership>(std::move(self), std::move(all)));
}

}  // namespace kvferry::store
