#include "depthkit/util/numbers.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "depthkit/util/error.h"

namespace depthkit {

namespace {

[[noreturn]] void refuse(std::string_view text, const std::string& what, const std::string& want) {
  fail(what, "='", printable(text), "' must be ", want);
}

// Integers: optional '-', then digits, and nothing else. std::from_chars would stop at the first
// byte that is not a digit and (for an unsigned type) read "-1" as nothing; the checks around it
// make the whole string count.
template <class T>
T parse_integer(std::string_view text, T lo, T hi, const std::string& what) {
  const std::string want = "an integer " + range_text(lo, hi);
  const bool negative = !text.empty() && text[0] == '-';
  const std::string_view digits = negative ? text.substr(1) : text;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) refuse(text, what, want);
  if (negative && std::is_unsigned_v<T>) refuse(text, what, want);
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < lo || value > hi) refuse(text, what, want);
  return value;
}

}  // namespace

std::string range_text(int64_t lo, int64_t hi) {
  return hi == std::numeric_limits<int64_t>::max() ? cat(">= ", lo) : cat("in [", lo, ", ", hi, "]");
}

std::string range_text(uint64_t lo, uint64_t hi) {
  return hi == std::numeric_limits<uint64_t>::max() ? cat(">= ", lo) : cat("in [", lo, ", ", hi, "]");
}

std::string range_text(double lo, double hi, double type_max, Bound lo_bound, Bound hi_bound) {
  const bool lo_open = lo_bound == Bound::open;
  if (hi >= type_max) return cat(lo_open ? "> " : ">= ", number_text(lo));
  return cat("in ", lo_open ? "(" : "[", number_text(lo), ", ", number_text(hi), hi_bound == Bound::open ? ")" : "]");
}

int64_t parse_int(std::string_view text, int64_t lo, int64_t hi, const std::string& what) {
  return parse_integer<int64_t>(text, lo, hi, what);
}

uint64_t parse_uint(std::string_view text, uint64_t lo, uint64_t hi, const std::string& what) {
  return parse_integer<uint64_t>(text, lo, hi, what);
}

double parse_real(std::string_view text, double lo, double hi, const std::string& what, Bound lo_bound,
                  Bound hi_bound) {
  const std::string want =
      "a finite number " + range_text(lo, hi, std::numeric_limits<double>::infinity(), lo_bound, hi_bound);
  // from_chars takes "inf", "nan" and hex digits after a leading digit run only in their own
  // formats; a leading '+' or blank it refuses, as it should.
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool below = lo_bound == Bound::open ? value <= lo : value < lo;
  const bool above = hi_bound == Bound::open ? value >= hi : value > hi;
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value) || below || above)
    refuse(text, what, want);
  return value;
}

std::string number_text(double x) {
  if (std::isfinite(x) && x == std::trunc(x) && std::fabs(x) < 9.2e18) return std::to_string(int64_t(x));
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  return ec == std::errc() ? std::string(buf, end) : cat(x);
}

double median(std::vector<double> v) {
  if (v.empty()) fail("median of no values");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace depthkit
