// depthkit::Error: the one exception type for bad input and failed runs. Its message is one
// line that names the file, key or value at fault; the CLI prints it and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace depthkit {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Concatenates its arguments with operator<< (g++ 12 has no std::format).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

// Turns an exception from torch (multi-line, with a C++ backtrace) into one line.
std::string one_line(const std::exception& e);

}  // namespace depthkit
