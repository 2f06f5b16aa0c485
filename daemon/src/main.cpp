// kvferryd: loads the config, wires signals and runs the daemon core in the foreground.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <string>

#include "kvferry/config/config.h"
#include "kvferry/daemon/daemon.h"

int main(int argc, char** argv) {
  using namespace kvferry;
  CLI::App app{"kvferryd: KV-cache offloading daemon; shares block-major KV regions with engines"};
  std::string config_path;
  std::string check_path;
  app.add_option("-c,--config", config_path, "YAML configuration file (absent = every default)");
  app.add_option("--check-config", check_path, "validate FILE, print the effective configuration and exit");
  std::string socket_override, metrics_override;
  bool metrics_set = false;
  app.add_option("--socket", socket_override, "serve on this control socket (overrides daemon.socket)");
  app.add_option("--metrics-listen", metrics_override,
                 "host:port of /metrics and /healthz (overrides daemon.metrics_listen; port 0 picks a free port, "
                 "logged at start; \"\" = off)")
      ->each([&](const std::string&) { metrics_set = true; });
  bool test_faults = false;
  app.add_flag("--enable-test-faults", test_faults,
               "serve the fault knob op that corrupts a stored block (integration tests only)");
  int test_copy_delay_ms = 0;
  app.add_option("--test-copy-delay-ms", test_copy_delay_ms,
                 "sleep this long before each copy sub-batch of a save or load (integration tests only)")
      ->check(CLI::Range(0, 60000));
  std::string test_disk_faults;
  app.add_option("--test-disk-faults", test_disk_faults,
                 "wrap the disk tier in a fault injector, e.g. errno=EIO,rate=1,writes_only (integration tests only)");
  app.set_version_flag("--version", std::string("kvferryd ") + daemon::version());
  CLI11_PARSE(app, argc, argv);

  if (!check_path.empty()) {
    auto cfg = config::load_file(check_path);
    if (!cfg.ok()) {
      std::fprintf(stderr, "kvferryd: %s\n", cfg.status().to_string().c_str());
      return 1;
    }
    std::fputs(config::to_yaml(*cfg).c_str(), stdout);
    return 0;
  }

  spdlog::set_default_logger(spdlog::stderr_color_mt("kvferryd"));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  auto load = [&]() -> Result<config::Config> {
    config::Config c;
    if (!config_path.empty()) {
      auto f = config::load_file(config_path);
      if (!f.ok()) return f.status();
      c = std::move(*f);
    }
    if (!socket_override.empty()) c.daemon.socket = socket_override;
    if (metrics_set) c.daemon.metrics_listen = metrics_override;
    return c;
  };
  auto cfg = load();
  if (!cfg.ok()) {
    spdlog::critical("{}", cfg.status().to_string());
    return 1;
  }
  daemon::apply_log_level(cfg->daemon.log_level);
  daemon::Daemon::Options dopts;
  dopts.test_faults = test_faults;
  dopts.test_copy_delay = std::chrono::milliseconds(test_copy_delay_ms);
  dopts.test_disk_faults = test_disk_faults;
  if (test_copy_delay_ms > 0)
    spdlog::warn("--test-copy-delay-ms {}: copies are slowed down on purpose", test_copy_delay_ms);
  auto d = daemon::Daemon::create(*cfg, dopts);
  if (!d.ok()) {
    spdlog::critical("{}", d.status().to_string());
    return 1;
  }
  (*d)->handle_signals(load);
  Status st = (*d)->run();
  if (!st.ok()) {
    spdlog::critical("{}", st.to_string());
    return 1;
  }
  return 0;
}
