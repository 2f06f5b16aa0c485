#pragma once
// Benchmark harness of kvferry-bench: suites register themselves, print a table in which every
// figure stands next to a limit measured in the same run (as a ratio), and write JSON.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvferry::bench {

/// Options every suite gets from the command line.
struct Options {
  std::string json_path;          ///< --json FILE ("" = no JSON)
  bool quick = false;             ///< --quick: fewer sizes and iterations (smoke runs, CI)
  int device = 0;                 ///< --device N
  bool mha = false;               ///< --mha: the decode suite measures paged MHA/GQA decode instead of MLA
  std::vector<std::string> args;  ///< suite-specific arguments, after `--` (`kvferry-bench SUITE --help` lists them)
};

/// One result row: a figure, the limit it is compared with (measured in the same run) and the
/// ratio figure / limit (or limit / figure for times: `higher_is_better` says which).
struct Row {
  std::string name;        ///< what was measured, e.g. "d2h batch 256KiB"
  double value = 0;        ///< the figure
  std::string unit;        ///< "GB/s", "us", "ops/s"
  double limit = 0;        ///< the limit measured in this run, same unit
  std::string limit_name;  ///< e.g. "pinned 1GiB copy"
  bool higher_is_better = true;
  double target = 0;  ///< target ratio, 0 = none
  std::string note;
  double ratio() const;
};

/// Collects rows, prints them as a table and writes {"suite":..., "rows":[...]} JSON.
class Report {
 public:
  explicit Report(std::string suite) : suite_(std::move(suite)) {}
  void add(Row r) { rows_.push_back(std::move(r)); }
  void note(std::string line) { notes_.push_back(std::move(line)); }
  const std::vector<Row>& rows() const { return rows_; }
  /// Prints the table to stdout and writes JSON when opts.json_path is set. Returns 0, or 1 when
  /// the JSON file could not be written.
  int finish(const Options& opts) const;

 private:
  std::string suite_;
  std::vector<Row> rows_;
  std::vector<std::string> notes_;
};

using SuiteFn = std::function<int(const Options&)>;

/// Registers a suite at static-initialisation time (suite sources are compiled into the binary).
/// `options` documents the suite's own arguments (Options::args), one "--flag  what it does" per
/// line; `kvferry-bench SUITE --help` prints them after the common options.
struct SuiteRegistrar {
  SuiteRegistrar(const char* name, const char* help, SuiteFn fn, const char* options = "");
};

/// Runs the registered suite `name` (so one suite can hand over to another, e.g. decode --mha
/// to decode-mha). Returns 2 when there is no such suite.
int run_suite(const std::string& name, const Options& opts);

/// Wall-clock seconds.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// "16KiB", "4MiB".
std::string human_bytes(int64_t b);

}  // namespace kvferry::bench

#define KVFERRY_BENCH_SUITE(name, help, fn) \
  static ::kvferry::bench::SuiteRegistrar kvferry_bench_reg_##fn(name, help, fn)

/// A suite with its own arguments (after `--`), documented in `options`.
#define KVFERRY_BENCH_SUITE_WITH_OPTIONS(name, help, fn, options) \
  static ::kvferry::bench::SuiteRegistrar kvferry_bench_reg_##fn(name, help, fn, options)
