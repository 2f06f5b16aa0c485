// kvferry: the command-line tool.
#include <cstdio>
#include <functional>

#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvferry: inspect KV cache layouts and talk to a running kvferryd"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvferry 0.1.0");
  std::function<int()> run;
  kvferry::cli::add_layout_command(app, &run);
  CLI11_PARSE(app, argc, argv);
  return run ? run() : 2;
}
