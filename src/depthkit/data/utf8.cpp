#include "depthkit/data/utf8.h"

#include <cstring>

namespace depthkit {

bool valid_utf8(std::string_view s, size_t* bad_at) {
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    // ASCII runs, eight bytes at a time (most of any corpus).
    while (i + 8 <= s.size()) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const size_t n = utf8_step(s, i, bad);
    if (n == 0) {
      if (bad_at) *bad_at = i;
      return false;
    }
    i += n;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  if (valid_utf8(s)) return std::string(s);
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(s.size() + 16);
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    const size_t n = utf8_step(s, i, bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += kReplacement;
      i += bad;
    }
  }
  return out;
}

}  // namespace depthkit
