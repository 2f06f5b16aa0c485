#pragma once
// Subcommands of the `kvferry` CLI. Each adds itself to the app and runs when selected.
#include <CLI/CLI.hpp>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace kvferry::cli {

/// Adds `kvferry layout`; sets *run to the function to call when it is selected.
void add_layout_command(CLI::App& app, std::function<int()>* run);

/// The socket path clients use when --socket is not given: $KVFERRY_SOCKET, else the default.
std::string default_socket();

/// Prints `j` on one line of stdout, compact: every --json output goes through this one writer.
/// Text that is not UTF-8 (a client's name is whatever the client sent) is printed as U+FFFD.
void print_json(const nlohmann::ordered_json& j);

/// Adds `kvferry status [--json]`, talking to the daemon at *socket_path (read when it runs).
void add_status_command(CLI::App& app, std::function<int()>* run, const std::string* socket_path);

/// Adds `kvferry stats`, `kvferry ls` and `kvferry evict` (each with --json).
void add_store_commands(CLI::App& app, std::function<int()>* run, const std::string* socket_path);

/// Adds `kvferry top [--once] [--interval S]`: a live per-tier and per-client view (q quits).
void add_top_command(CLI::App& app, std::function<int()>* run, const std::string* socket_path);

}  // namespace kvferry::cli
