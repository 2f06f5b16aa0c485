// Notifier (notify.h).
#include "kvferry/daemon/notify.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <string>

#if defined(KVFERRY_WITH_SYSTEMD)
#include <systemd/sd-daemon.h>
#endif

namespace kvferry::daemon {

bool Notifier::active() {
#if defined(KVFERRY_WITH_SYSTEMD)
  const char* s = std::getenv("NOTIFY_SOCKET");
  return s && *s;
#else
  return false;
#endif
}

void Notifier::notify(std::string_view state) {
#if defined(KVFERRY_WITH_SYSTEMD)
  if (!active()) return;
  std::string s(state);
  int r = sd_notify(0, s.c_str());
  if (r < 0) spdlog::warn("sd_notify({}) failed: {}", s, r);
#else
  static std::atomic<bool> said{false};
  const char* s = std::getenv("NOTIFY_SOCKET");
  if (s && *s && !said.exchange(true))
    spdlog::warn("NOTIFY_SOCKET is set but kvferryd was built without libsystemd: no {} (nor later states)", state);
#endif
}

std::chrono::microseconds Notifier::watchdog_interval(std::chrono::microseconds fallback) {
#if defined(KVFERRY_WITH_SYSTEMD)
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) return std::chrono::microseconds(usec);
#endif
  return fallback;
}

}  // namespace kvferry::daemon
