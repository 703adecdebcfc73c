// depthkit::Error: the one exception type for bad input and failed runs. Its message is one
// line that names the file, key or value at fault; the CLI prints it and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

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

// `text` with control characters escaped (\n, \r, \xNN): for bytes from a file quoted in a
// message, which must stay one line.
std::string printable(std::string_view text);

// Names what the program is building while it builds it, so that an allocation failure, caught at
// the command boundary, says in its one line what the memory was for:
//   Building building("the logits of 4 sequences");
class Building {
 public:
  explicit Building(std::string what);
  ~Building();
  Building(const Building&) = delete;
  Building& operator=(const Building&) = delete;
  // The innermost thing being built on this thread ("" when none).
  static std::string current();

 private:
  std::string what_;
  const Building* outer_;
};

// An allocation failure: std::bad_alloc, or LibTorch's "can't allocate memory".
bool is_out_of_memory(const std::exception& e);

// The one line the CLI prints for any exception: depthkit::Error as it is; an allocation failure
// (std::bad_alloc, or LibTorch's "can't allocate memory") as "out of memory while building ...";
// anything else cut to its first line. Control characters are escaped, so it stays one line.
std::string error_line(const std::exception& e);

}  // namespace depthkit
