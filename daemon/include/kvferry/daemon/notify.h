#pragma once
// systemd notification (READY=1, WATCHDOG=1, STOPPING=1) through libsystemd when built with
// KVFERRY_WITH_SYSTEMD; otherwise a no-op that says so once. Silently off without NOTIFY_SOCKET.
#include <chrono>
#include <string_view>

namespace kvferry::daemon {

class Notifier {
 public:
  /// True when messages would reach a service manager (built with libsystemd and NOTIFY_SOCKET set).
  static bool active();
  /// Sends one state line, e.g. "READY=1". No-op when inactive.
  static void notify(std::string_view state);
  /// The watchdog interval systemd asked for (WATCHDOG_USEC), or `fallback` when unset/0 means off.
  static std::chrono::microseconds watchdog_interval(std::chrono::microseconds fallback);
};

}  // namespace kvferry::daemon
