// kvferry: the command-line tool.
#include <cstdio>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "kvferry/version.h"

int main(int argc, char** argv) {
  CLI::App app{"kvferry: inspect KV cache layouts and talk to a running kvferryd"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvferry " KVFERRY_VERSION);
  std::function<int()> run;
  std::string socket_path = kvferry::cli::default_socket();
  app.add_option("--socket", socket_path,
                 "daemon control socket (default: $KVFERRY_SOCKET or /run/kvferry/kvferry.sock)");
  kvferry::cli::add_layout_command(app, &run);
  kvferry::cli::add_status_command(app, &run, &socket_path);
  kvferry::cli::add_store_commands(app, &run, &socket_path);
  kvferry::cli::add_top_command(app, &run, &socket_path);
  CLI11_PARSE(app, argc, argv);
  return run ? run() : 2;
}
