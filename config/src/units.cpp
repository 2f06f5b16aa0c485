// Sizes and durations with units: the text forms the config accepts and prints.
#include <array>
#include <cctype>
#include <string>

#include "kvferry/config/config.h"

namespace kvferry::config {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// "12.375" times `unit`, exactly, as an integer. False when malformed, not a whole number or
// past uint64.
bool scaled(std::string_view num, uint64_t unit, uint64_t* out) {
  const size_t dot = num.find('.');
  const std::string_view ip = num.substr(0, dot);
  const std::string_view fp = dot == std::string_view::npos ? std::string_view{} : num.substr(dot + 1);
  if (ip.empty() && fp.empty()) return false;
  if (dot != std::string_view::npos && fp.empty()) return false;  // "1." is a typo, not a number
  uint64_t whole = 0;
  for (char ch : ip) {
    if (ch < '0' || ch > '9') return false;
    if (__builtin_mul_overflow(whole, 10u, &whole) || __builtin_add_overflow(whole, uint64_t(ch - '0'), &whole))
      return false;
  }
  uint64_t total = 0;
  if (__builtin_mul_overflow(whole, unit, &total)) return false;
  if (fp.empty()) {
    *out = total;
    return true;
  }
  // frac / 10^k * unit must be an integer: keep numerator and denominator exact.
  if (fp.size() > 18) return false;
  uint64_t frac = 0, den = 1;
  for (char ch : fp) {
    if (ch < '0' || ch > '9') return false;
    frac = frac * 10 + uint64_t(ch - '0');
    den *= 10;
  }
  unsigned __int128 part = static_cast<unsigned __int128>(frac) * unit;
  if (part % den != 0) return false;
  part /= den;
  if (part > UINT64_MAX - total) return false;
  *out = total + static_cast<uint64_t>(part);
  return true;
}

// Splits "1.5GiB" into "1.5" and "GiB".
void split_number(std::string_view s, std::string_view* num, std::string_view* unit) {
  size_t i = 0;
  while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.')) ++i;
  *num = s.substr(0, i);
  *unit = trim(s.substr(i));
}

struct Unit {
  const char* name;
  uint64_t factor;
};

}  // namespace

Result<uint64_t> parse_size(std::string_view text) {
  const std::string_view s = trim(text);
  const auto bad = [&]() {
    return Result<uint64_t>(ErrorCode::kConfig, "'" + std::string(text) + "' is not a size (expected e.g. 64GiB)");
  };
  std::string_view num, unit;
  split_number(s, &num, &unit);
  if (num.empty()) return bad();
  static constexpr std::array<Unit, 18> kUnits{{{"", 1},
                                                {"b", 1},
                                                {"k", 1000},
                                                {"kb", 1000},
                                                {"ki", 1ull << 10},
                                                {"kib", 1ull << 10},
                                                {"m", 1000000},
                                                {"mb", 1000000},
                                                {"mi", 1ull << 20},
                                                {"mib", 1ull << 20},
                                                {"g", 1000000000},
                                                {"gb", 1000000000},
                                                {"gi", 1ull << 30},
                                                {"gib", 1ull << 30},
                                                {"t", 1000000000000},
                                                {"tb", 1000000000000},
                                                {"ti", 1ull << 40},
                                                {"tib", 1ull << 40}}};
  const std::string u = lower(unit);
  for (const Unit& k : kUnits) {
    if (u != k.name) continue;
    uint64_t v = 0;
    if (!scaled(num, k.factor, &v)) {
      return Result<uint64_t>(ErrorCode::kConfig,
                              "'" + std::string(text) + "' is not a whole number of bytes that fits in 64 bits");
    }
    return v;
  }
  return bad();
}

Result<std::chrono::nanoseconds> parse_duration(std::string_view text) {
  using R = Result<std::chrono::nanoseconds>;
  const std::string_view s = trim(text);
  const auto bad = [&]() {
    return R(ErrorCode::kConfig, "'" + std::string(text) + "' is not a duration (expected e.g. 500ms, 30s, 2m)");
  };
  std::string_view num, unit;
  split_number(s, &num, &unit);
  if (num.empty()) return bad();
  static constexpr std::array<Unit, 7> kUnits{{{"ns", 1},
                                               {"us", 1000},
                                               {"ms", 1000000},
                                               {"s", 1000000000},
                                               {"m", 60000000000},
                                               {"min", 60000000000},
                                               {"h", 3600000000000}}};
  if (unit.empty()) {
    if (num == "0") return std::chrono::nanoseconds{0};
    return bad();  // a bare number has no unit: 30 what?
  }
  for (const Unit& k : kUnits) {
    if (unit != k.name) continue;
    uint64_t v = 0;
    if (!scaled(num, k.factor, &v) || v > static_cast<uint64_t>(INT64_MAX))
      return R(ErrorCode::kConfig,
               "'" + std::string(text) + "' is not a whole number of nanoseconds that fits in 64 bits");
    return std::chrono::nanoseconds{static_cast<int64_t>(v)};
  }
  return bad();
}

std::string format_size(uint64_t bytes) {
  if (bytes == 0) return "0";
  static constexpr std::array<Unit, 4> kUnits{
      {{"TiB", 1ull << 40}, {"GiB", 1ull << 30}, {"MiB", 1ull << 20}, {"KiB", 1ull << 10}}};
  for (const Unit& k : kUnits)
    if (bytes % k.factor == 0) return std::to_string(bytes / k.factor) + k.name;
  return std::to_string(bytes);
}

std::string format_duration(std::chrono::nanoseconds d) {
  const int64_t ns = d.count();
  if (ns == 0) return "0s";
  static constexpr std::array<Unit, 6> kUnits{
      {{"h", 3600000000000}, {"m", 60000000000}, {"s", 1000000000}, {"ms", 1000000}, {"us", 1000}, {"ns", 1}}};
  for (const Unit& k : kUnits)
    if (ns % static_cast<int64_t>(k.factor) == 0) return std::to_string(ns / static_cast<int64_t>(k.factor)) + k.name;
  return std::to_string(ns) + "ns";
}

}  // namespace kvferry::config
