#pragma once
// "host:port", as the config file and the daemon's listeners take it: one parser for all of them.
// Header-only (the standard library alone), so a module that validates nothing else can use it.
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvferry::config {

/// An address split into its parts.
struct HostPort {
  std::string host;  ///< as written, less the brackets of an IPv6 address ("[::1]:80" -> "::1")
  uint16_t port = 0;
};

/// What is wrong with a "host:port" text; each caller words it for its own key or flag.
enum class HostPortFault : uint8_t {
  kOk = 0,
  kNotHostPort,  ///< no colon, or nothing before the last one
  kBadPort,      ///< after the last colon: not decimal digits only (no sign, no space), or past 65535
};

/// Splits `s` at its last colon into `*out` (left alone unless kOk). Port 0 is a port here: a
/// caller that does not take it (it picks a free one) says so itself.
inline HostPortFault parse_host_port(std::string_view s, HostPort* out) {
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return HostPortFault::kNotHostPort;
  const std::string_view p = s.substr(colon + 1);
  uint32_t port = 0;
  const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port, 10);
  if (p.empty() || ec != std::errc() || end != p.data() + p.size() || port > 65535) return HostPortFault::kBadPort;
  std::string_view host = s.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  out->host = std::string(host);
  out->port = static_cast<uint16_t>(port);
  return HostPortFault::kOk;
}

}  // namespace kvferry::config
