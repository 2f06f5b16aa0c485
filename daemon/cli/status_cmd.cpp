// `kvferry status`: version, uptime, regions and clients of a running daemon.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "commands.h"
#include "kvferry/connector/wire_io.h"

namespace kvferry::cli {
namespace {

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
      continue;
    }
    o += c;
  }
  return o + "\"";
}

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
    std::printf("{\"version\":%s,\"uptime_s\":%.3f,\"pid\":%u,\"backend\":%s,\"regions\":[",
                json_str(s->version).c_str(), s->uptime_ms / 1000.0, s->pid, json_str(s->backend).c_str());
    for (size_t i = 0; i < s->regions.size(); ++i) {
      const auto& r = s->regions[i];
      std::printf(
          "%s{\"id\":%u,\"name\":%s,\"layers\":%lld,\"blocks\":%lld,\"block_size\":%lld,\"format\":%s,"
          "\"layout\":\"%s\",\"bytes\":%llu,\"backend\":\"%s\",\"holders\":%u,\"from_config\":%s}",
          i ? "," : "", r.desc.id, json_str(r.desc.name).c_str(), static_cast<long long>(r.desc.spec.layers),
          static_cast<long long>(r.desc.spec.blocks), static_cast<long long>(r.desc.spec.block_size),
          json_str(r.desc.spec.format.name()).c_str(),
          r.desc.spec.layout == Layout::kBlockMajor ? "block_major" : "layer_major",
          static_cast<unsigned long long>(r.desc.bytes), std::string(proto::backend_name(r.desc.backend)).c_str(),
          r.holders, r.from_config ? "true" : "false");
    }
    std::printf("],\"clients\":[");
    for (size_t i = 0; i < s->clients.size(); ++i) {
      const auto& c = s->clients[i];
      std::printf("%s{\"id\":%u,\"name\":%s,\"pid\":%u,\"uid\":%u,\"ops\":%llu}", i ? "," : "", c.id,
                  json_str(c.name).c_str(), c.pid, c.uid, static_cast<unsigned long long>(c.ops));
    }
    std::printf("]}\n");
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
