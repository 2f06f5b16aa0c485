// `kvferry status`: version, uptime, regions and clients of a running daemon.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry::cli {
namespace {

int run_status(const std::string& socket_path, bool json) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, socket_path.c_str(), sizeof a.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    std::fprintf(stderr, "kvferry status: cannot connect to %s: %s\n", socket_path.c_str(), std::strerror(errno));
    ::close(fd);
    return 1;
  }
  UniqueFd sock(fd);
  if (Status st = proto::send_frame(fd, proto::encode_status_request()); !st.ok()) {
    std::fprintf(stderr, "kvferry status: %s\n", st.to_string().c_str());
    return 1;
  }
  auto f = proto::recv_frame(fd, 5000);
  if (!f.ok()) {
    std::fprintf(stderr, "kvferry status: %s\n", f.status().to_string().c_str());
    return 1;
  }
  if (f->header.type == static_cast<uint16_t>(proto::MsgType::kError)) {
    auto e = proto::decode_error(f->payload, f->header.field_mask);
    if (e.ok() && e->code == ErrorCode::kPermissionDenied)
      std::fprintf(stderr, "kvferry status: refused: %s\n", e->message.c_str());
    else
      std::fprintf(stderr, "kvferry status: the daemon answered with an error: %s: %s\n",
                   e.ok() ? std::string(error_code_name(e->code)).c_str() : "?", e.ok() ? e->message.c_str() : "");
    return 1;
  }
  auto s = proto::decode_status_reply(f->payload, f->header.field_mask);
  if (!s.ok()) {
    std::fprintf(stderr, "kvferry status: %s\n", s.status().to_string().c_str());
    return 1;
  }
  if (json) {
    nlohmann::ordered_json j = {{"version", s->version},
                                {"uptime_s", s->uptime_ms / 1000.0},
                                {"pid", s->pid},
                                {"backend", s->backend},
                                {"regions", nlohmann::ordered_json::array()},
                                {"clients", nlohmann::ordered_json::array()}};
    for (const auto& r : s->regions)
      j["regions"].push_back({{"id", r.desc.id},
                              {"name", r.desc.name},
                              {"layers", r.desc.spec.layers},
                              {"blocks", r.desc.spec.blocks},
                              {"block_size", r.desc.spec.block_size},
                              {"format", r.desc.spec.format.name()},
                              {"layout", r.desc.spec.layout == Layout::kBlockMajor ? "block_major" : "layer_major"},
                              {"bytes", r.desc.bytes},
                              {"backend", std::string(proto::backend_name(r.desc.backend))},
                              {"holders", r.holders},
                              {"from_config", r.from_config}});
    for (const auto& c : s->clients)
      j["clients"].push_back({{"id", c.id}, {"name", c.name}, {"pid", c.pid}, {"uid", c.uid}, {"ops", c.ops}});
    print_json(j);
    return 0;
  }
  std::printf("kvferryd %s, pid %u, up %.1f s, backend %s\n", s->version.c_str(), s->pid, s->uptime_ms / 1000.0,
              s->backend.c_str());
  std::printf("regions: %zu\n", s->regions.size());
  for (const auto& r : s->regions)
    std::printf(
        "  %u %-16s %lld x %lld blocks x %lld tokens of %s, %.1f MiB on %s, %u holder(s)%s\n", r.desc.id,
        r.desc.name.c_str(), static_cast<long long>(r.desc.spec.layers), static_cast<long long>(r.desc.spec.blocks),
        static_cast<long long>(r.desc.spec.block_size), r.desc.spec.format.name().c_str(), r.desc.bytes / 1048576.0,
        std::string(proto::backend_name(r.desc.backend)).c_str(), r.holders, r.from_config ? ", from config" : "");
  std::printf("clients: %zu\n", s->clients.size());
  for (const auto& c : s->clients)
    std::printf("  %u %-16s pid %u uid %u, %llu ops\n", c.id, c.name.c_str(), c.pid, c.uid,
                static_cast<unsigned long long>(c.ops));
  return 0;
}

struct StatusArgs {
  bool json = false;
};

}  // namespace

void print_json(const nlohmann::ordered_json& j) {
  const std::string text = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::printf("%s\n", text.c_str());
}

std::string default_socket() {
  const char* env = std::getenv("KVFERRY_SOCKET");
  return env && *env ? env : "/run/kvferry/kvferry.sock";
}

void add_status_command(CLI::App& app, std::function<int()>* run, const std::string* socket_path) {
  auto args = std::make_shared<StatusArgs>();  // the app and the run callback share it
  CLI::App* sub = app.add_subcommand("status", "version, uptime, regions and clients of a running kvferryd");
  sub->add_flag("--json", args->json, "print JSON");
  sub->callback(
      [args, run, socket_path] { *run = [args, socket_path] { return run_status(*socket_path, args->json); }; });
}

}  // namespace kvferry::cli
