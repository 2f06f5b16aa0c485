// libFuzzer target for the config loader: any input is either a Config or a kConfig error with
// a message (never a crash, a hang or an exception), and a Config survives to_yaml and back.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kvferry/config/config.h"

using kvferry::config::Config;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvferry::Result<Config> r = kvferry::config::load_string(text, "fuzz.yaml");
  if (!r.ok()) {
    if (r.status().code() != kvferry::ErrorCode::kConfig || r.status().message().empty()) {
      std::fprintf(stderr, "error without kConfig or a message: %s\n", r.status().to_string().c_str());
      std::abort();
    }
    return 0;
  }
  const std::string y = kvferry::config::to_yaml(*r);
  kvferry::Result<Config> back = kvferry::config::load_string(y, "to_yaml");
  if (!back.ok()) {
    std::fprintf(stderr, "to_yaml output does not load: %s\n%s\n", back.status().message().c_str(), y.c_str());
    std::abort();
  }
  if (!(*back == *r) || !kvferry::config::reloadable_changes(*r, *back).empty() ||
      !kvferry::config::non_reloadable_changes(*r, *back).empty()) {
    std::fprintf(stderr, "to_yaml round trip changed the config:\n%s\n", y.c_str());
    std::abort();
  }
  return 0;
}
