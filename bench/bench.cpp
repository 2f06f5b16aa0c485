#include "bench.h"

#include <cstdio>
#include <fstream>
#include <map>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace kvferry::bench {
namespace {

struct Suite {
  std::string help;
  SuiteFn fn;
  std::string options;  // the suite's own arguments, one per line ("" = none)
};

std::map<std::string, Suite>& registry() {
  static std::map<std::string, Suite> r;
  return r;
}

}  // namespace

double Row::ratio() const {
  if (limit <= 0 || value <= 0) return 0;
  return higher_is_better ? value / limit : limit / value;
}

SuiteRegistrar::SuiteRegistrar(const char* name, const char* help, SuiteFn fn, const char* options) {
  registry()[name] = Suite{help, std::move(fn), options};
}

int run_suite(const std::string& name, const Options& opts) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::fprintf(stderr, "kvferry-bench: suite '%s' is not built in\n", name.c_str());
    return 2;
  }
  return it->second.fn(opts);
}

std::string human_bytes(int64_t b) {
  if (b >= (1 << 30) && b % (1 << 30) == 0) return std::to_string(b >> 30) + "GiB";
  if (b >= (1 << 20) && b % (1 << 20) == 0) return std::to_string(b >> 20) + "MiB";
  if (b >= (1 << 10) && b % (1 << 10) == 0) return std::to_string(b >> 10) + "KiB";
  return std::to_string(b) + "B";
}

int Report::finish(const Options& opts) const {
  std::printf("\n== kvferry-bench %s ==\n", suite_.c_str());
  std::printf("%-44s %12s %-6s %12s %-26s %7s %7s\n", "case", "value", "unit", "limit", "limit is", "ratio", "target");
  for (const Row& r : rows_) {
    char target[16] = "-";
    if (r.target > 0) std::snprintf(target, sizeof target, "%.2f", r.target);
    std::printf("%-44s %12.3f %-6s %12.3f %-26s %7.3f %7s%s%s\n", r.name.c_str(), r.value, r.unit.c_str(), r.limit,
                r.limit_name.c_str(), r.ratio(), target, r.note.empty() ? "" : "  ", r.note.c_str());
  }
  for (const std::string& n : notes_) std::printf("note: %s\n", n.c_str());
  if (opts.json_path.empty()) return 0;
  std::ofstream out(opts.json_path);
  if (!out) {
    std::fprintf(stderr, "kvferry-bench: cannot write %s\n", opts.json_path.c_str());
    return 1;
  }
  // NaN and infinity (a figure that could not be measured) are written as null.
  nlohmann::ordered_json j = {
      {"suite", suite_}, {"rows", nlohmann::ordered_json::array()}, {"notes", nlohmann::ordered_json(notes_)}};
  for (const Row& r : rows_)
    j["rows"].push_back({{"name", r.name},
                         {"value", r.value},
                         {"unit", r.unit},
                         {"limit", r.limit},
                         {"limit_name", r.limit_name},
                         {"ratio", r.ratio()},
                         {"target", r.target},
                         {"note", r.note}});
  out << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
  std::printf("wrote %s\n", opts.json_path.c_str());
  return out.good() ? 0 : 1;
}

namespace {

int run(int argc, char** argv) {
  CLI::App app{"kvferry-bench: measures each kvferry capability against a limit measured in the same run"};
  std::string suite;
  Options opts;
  std::string suites_help = "suite to run:";
  for (const auto& [name, s] : registry()) suites_help += "\n  " + name + ": " + s.help;
  app.add_option("suite", suite, suites_help);
  bool list = false;
  app.add_flag("--list", list, "print the names of the built-in suites, one per line");
  app.add_option("--json", opts.json_path, "write the results as JSON to this file");
  app.add_flag("--quick", opts.quick, "fewer sizes and iterations (a smoke run)");
  app.add_option("--device", opts.device, "CUDA device index");
  app.add_flag("--mha", opts.mha, "decode: measure paged MHA/GQA decode instead of MLA");
  app.add_option("args", opts.args, "suite-specific arguments (after --; SUITE --help lists them)");
  // `kvferry-bench SUITE --help`: the common options, then the named suite's own.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    const auto it = registry().find(a);
    if (it == registry().end()) continue;
    std::string footer = "\n" + a + ": " + it->second.help + "\n";
    footer += it->second.options.empty()
                  ? "  (no options of its own)\n"
                  : "options of " + a + " (after --: kvferry-bench " + a + " -- OPTION...):\n" + it->second.options;
    app.footer(footer);
    break;
  }
  CLI11_PARSE(app, argc, argv);
  if (list) {
    for (const auto& [name, s] : registry()) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (suite.empty()) {
    std::fprintf(stderr, "kvferry-bench: name a suite (--list lists them; --help explains)\n");
    return 2;
  }
  auto it = registry().find(suite);
  if (it == registry().end()) {
    std::fprintf(stderr, "kvferry-bench: unknown suite '%s'; known suites:\n", suite.c_str());
    for (const auto& [name, s] : registry()) std::fprintf(stderr, "  %s: %s\n", name.c_str(), s.help.c_str());
    return 2;
  }
  return it->second.fn(opts);
}

}  // namespace
}  // namespace kvferry::bench

// A suite that throws (out of memory, a thread that cannot start) ends the run with its message.
int main(int argc, char** argv) {
  try {
    return kvferry::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvferry-bench: %s\n", e.what());
    return 1;
  }
}
