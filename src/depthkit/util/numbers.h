// Numbers from text, in one place: command-line options (cli/options.cpp) and torchrun's
// environment variables (dist/world.cpp) are parsed here. The whole string must be the number
// (no blanks, no sign on an unsigned value, nothing after it), within its range; a refusal is one
// line that names what was given, "<what>='<text>' must be an integer in [lo, hi]".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace depthkit {

int64_t parse_int(std::string_view text, int64_t lo, int64_t hi, const std::string& what);
uint64_t parse_uint(std::string_view text, uint64_t lo, uint64_t hi, const std::string& what);
// Whether a real range includes its end: [0, 1] or (0, 1).
enum class Bound { closed, open };
// A finite decimal number ("0.7", "1e-3"); never nan, inf or a value past double's range.
double parse_real(std::string_view text, double lo, double hi, const std::string& what, Bound lo_bound = Bound::closed,
                  Bound hi_bound = Bound::closed);

// A number as a person reads it: an integral value as an integer (4194305, not 4.1943e+06), any
// other as the shortest text that reads back as the same double.
std::string number_text(double x);

// "in [lo, hi]" (or "(lo, hi)" for open bounds), or ">= lo" / "> lo" when hi is the largest value
// the type holds.
std::string range_text(double lo, double hi, double type_max, Bound lo_bound = Bound::closed,
                       Bound hi_bound = Bound::closed);
std::string range_text(int64_t lo, int64_t hi);
std::string range_text(uint64_t lo, uint64_t hi);

// The median of timings (the benches report medians over repeats); an even count takes the mean
// of the middle two. Fails on an empty list.
double median(std::vector<double> values);

}  // namespace depthkit
