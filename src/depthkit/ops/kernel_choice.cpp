#include "depthkit/ops/kernel_choice.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorOptions.h>

#include <cstdio>
#include <mutex>
#include <set>

#include "depthkit/util/error.h"

namespace depthkit {

bool has_fused_kernel(const char* op, c10::DeviceType device) {
  // The backend key of a dense tensor on `device` (CPU, CUDA, Meta, ...): the key a kernel
  // registered with TORCH_LIBRARY_IMPL(depthkit, <backend>, m) sits under.
  const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, at::kStrided, c10::Device(device));
  auto& dispatcher = c10::Dispatcher::singleton();
  const std::string name = std::string("depthkit::") + op;
  auto forward = dispatcher.findSchema({name, ""});
  if (!forward || !forward->hasKernelForDispatchKey(key)) return false;
  auto backward = dispatcher.findSchema({name + "_backward", ""});
  return !backward || backward->hasKernelForDispatchKey(key);
}

namespace {
// Says once per process and (operator, device type) that the reference composition runs.
void report_fallback(const std::string& op, c10::DeviceType device) {
  static std::mutex mutex;
  static std::set<std::pair<std::string, c10::DeviceType>> reported;
  std::lock_guard<std::mutex> lock(mutex);
  if (!reported.emplace(op, device).second) return;
  std::fprintf(stderr, "depthkit: %s has no %s kernel; running its reference composition (impl = \"fused\")\n",
               op.c_str(), c10::DeviceTypeName(device).c_str());
}
}  // namespace

OperatorChoice::OperatorChoice(const std::string& impl, c10::DeviceType device, std::initializer_list<const char*> ops) {
  for (const char* op : ops) {
    bool fused = impl == "fused" && has_fused_kernel(op, device);
    if (impl == "fused" && !fused && device != c10::DeviceType::Meta) report_fallback(op, device);
    fused_[op] = fused;
  }
}

bool OperatorChoice::fused(const std::string& op) const {
  auto it = fused_.find(op);
  if (it == fused_.end()) fail("internal: operator '", op, "' was not declared by its pathway");
  return it->second;
}

}  // namespace depthkit
