#include "depthkit/util/error.h"

#include <new>
#include <utility>

namespace depthkit {

namespace {
thread_local const Building* g_building = nullptr;
thread_local std::string g_failed_building;  // what was being built when the last allocation failed
}  // namespace

std::string one_line(const std::exception& e) {
  std::string msg = e.what();
  // c10::Error appends "Exception raised from ..." and a backtrace after the first line.
  auto cut = msg.find('\n');
  if (cut != std::string::npos) msg.resize(cut);
  return msg;
}

Building::Building(std::string what) : what_(std::move(what)), outer_(g_building) { g_building = this; }

Building::~Building() {
  // Unwinding from a failed allocation: remember what failed for the message at the boundary.
  if (std::uncaught_exceptions() > 0 && g_failed_building.empty()) g_failed_building = what_;
  g_building = outer_;
}

std::string Building::current() { return g_building ? g_building->what_ : ""; }

bool is_out_of_memory(const std::exception& e) {
  return dynamic_cast<const std::bad_alloc*>(&e) != nullptr ||
         std::string_view(e.what()).find("can't allocate memory") != std::string_view::npos;
}

std::string error_line(const std::exception& e) {
  const std::string failed_building = std::exchange(g_failed_building, "");
  std::string msg;
  const std::string what = e.what();
  const bool out_of_memory = is_out_of_memory(e);
  if (dynamic_cast<const Error*>(&e)) {
    msg = what;
  } else if (out_of_memory) {
    const std::string building = !failed_building.empty() ? failed_building : Building::current();
    std::string detail = one_line(e);
    // LibTorch: "[enforce fail at alloc_cpu.cpp:N] ... DefaultCPUAllocator: can't allocate memory:
    // you tried to allocate N bytes. Error code 12 (...)": keep the part from the allocator on.
    if (auto at = detail.find("DefaultCPUAllocator"); at != std::string::npos) detail = detail.substr(at);
    if (dynamic_cast<const std::bad_alloc*>(&e)) detail = "std::bad_alloc";
    msg = cat("out of memory", building.empty() ? std::string() : " while building " + building, " (", detail, ")");
  } else {
    msg = one_line(e);
  }
  return printable(msg);
}

std::string printable(std::string_view text) {
  std::string out;
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += c == '\n' ? std::string("\\n") : c == '\r' ? std::string("\\r") : std::string("\\x") + hex[c >> 4] + hex[c & 15];
    } else {
      out.push_back(char(c));
    }
  }
  return out;
}

}  // namespace depthkit
