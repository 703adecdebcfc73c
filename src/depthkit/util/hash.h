// A 64-bit FNV-1a hash in hex: a fingerprint of bytes, to notice that two copies differ (task files
// against the scores kept for them, ranks' data and checkpoints), not a defence against forgery.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace depthkit {

inline std::string fingerprint(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h);
  return hex;
}

}  // namespace depthkit
