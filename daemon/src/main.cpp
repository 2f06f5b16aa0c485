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
    if (config_path.empty()) return config::Config{};
    return config::load_file(config_path);
  };
  auto cfg = load();
  if (!cfg.ok()) {
    spdlog::critical("{}", cfg.status().to_string());
    return 1;
  }
  daemon::apply_log_level(cfg->daemon.log_level);
  auto d = daemon::Daemon::create(*cfg);
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
