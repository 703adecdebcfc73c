// A JSON value quoted in a one-line error message. nlohmann's dump() recurses once per level of
// nesting, so a hostile file of deeply nested arrays would overflow the stack: containers are
// described by their kind and size, scalars printed, long strings cut.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "depthkit/util/error.h"

namespace depthkit {

inline std::string json_excerpt(const nlohmann::json& v) {
  if (v.is_array()) return cat("an array of ", v.size());
  if (v.is_object()) return cat("an object of ", v.size(), " keys");
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    return cat('"', printable(s.substr(0, 40)), s.size() > 40 ? "...\"" : "\"");
  }
  return v.dump();
}

}  // namespace depthkit
