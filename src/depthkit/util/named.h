// Tables whose entries each have a `name` (the pathway kinds, the MoE routers): their names in
// table order, and the entry of a name. Each table keeps its own one-line error for an unknown
// name, which names its config key.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace depthkit {

template <class Entry>
std::vector<std::string> names_of(const std::vector<Entry>& table) {
  std::vector<std::string> names;
  names.reserve(table.size());
  for (const Entry& e : table) names.push_back(e.name);
  return names;
}

// The entry named `name`; nullptr if there is none.
template <class Entry>
const Entry* find_named(const std::vector<Entry>& table, std::string_view name) {
  for (const Entry& e : table)
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace depthkit
