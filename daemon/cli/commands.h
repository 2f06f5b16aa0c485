#pragma once
// Subcommands of the `kvferry` CLI. Each adds itself to the app and runs when selected.
#include <CLI/CLI.hpp>
#include <functional>

namespace kvferry::cli {

/// Adds `kvferry layout`; sets *run to the function to call when it is selected.
void add_layout_command(CLI::App& app, std::function<int()>* run);

}  // namespace kvferry::cli
