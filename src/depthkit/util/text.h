// Small text helpers shared by the file readers (task files, the cloze builder).
#pragma once
#include <string_view>

namespace depthkit {

// `s` without the leading and trailing characters in `blanks`.
inline std::string_view strip(std::string_view s, std::string_view blanks = " \t\r\n") {
  const size_t a = s.find_first_not_of(blanks);
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(blanks) - a + 1);
}

}  // namespace depthkit
