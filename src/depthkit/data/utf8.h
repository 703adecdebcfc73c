// UTF-8 as Unicode defines it well formed (Table 3-7: no overlong forms, no surrogates, nothing
// above U+10FFFF), for the corpus reader's check and the tokenizers' decoding.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace depthkit {

// Length of the valid UTF-8 sequence at s[i], or 0 with `bad` set to the length of the maximal
// invalid subpart there (at least 1): the Unicode "best practice" Python's decoder follows.
inline size_t utf8_step(std::string_view s, size_t i, size_t& bad) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // the range allowed for the second byte
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) need = 2, lo = 0xA0;
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
  else if (c == 0xED) need = 2, hi = 0x9F;  // no surrogates
  else if (c == 0xF0) need = 3, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else if (c == 0xF4) need = 3, hi = 0x8F;  // nothing above U+10FFFF
  else {
    bad = 1;  // 80..C1, F5..FF never start a sequence
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      bad = size_t(k);
      return 0;
    }
    const unsigned char x = b(i + k);
    const bool ok = k == 1 ? (x >= lo && x <= hi) : (x >= 0x80 && x <= 0xBF);
    if (!ok) {
      bad = size_t(k);
      return 0;
    }
  }
  return size_t(need) + 1;
}

// Code point of the valid UTF-8 sequence at s[i] of length n (utf8_step's).
inline uint32_t utf8_code(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return uint32_t(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (n == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

// Whether `s` is well-formed UTF-8; if not, `bad_at` is the offset of the first bad sequence.
bool valid_utf8(std::string_view s, size_t* bad_at = nullptr);

// `s` with each maximal invalid subpart replaced by U+FFFD, exactly as Python's
// bytes.decode('utf-8', 'replace'); valid input is returned unchanged.
std::string utf8_lossy(std::string_view s);

}  // namespace depthkit
