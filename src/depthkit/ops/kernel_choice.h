// Which implementation of each depthkit operator a pathway runs. residual.impl = "fused" asks for
// the fused operators, but a device has kernels for only some of them (every operator has a CPU
// kernel; ops/cuda/ registers CUDA kernels of depth_read and depth_merge only): an operator
// without a kernel on the model's device runs its reference composition (ops/reference/), which
// is made of ATen operators that run anywhere, and says so once per process on stderr. A run
// never fails for a missing kernel.
#pragma once
#include <c10/core/DeviceType.h>

#include <initializer_list>
#include <map>
#include <string>

namespace depthkit {

// Whether the dispatcher holds a kernel of the depthkit operator `op` (e.g. "dar_read") for
// `device`, and one of its backward operator ("dar_read_backward") where the schema declares one:
// training needs both.
bool has_fused_kernel(const char* op, c10::DeviceType device);

// The choice for each operator of one pathway, made once when the pathway is built.
class OperatorChoice {
 public:
  // impl: residual.impl ("fused" | "reference"); device: the model's (ParameterStore::device()).
  // With "fused", an operator of `ops` lacking a kernel on `device` runs its reference composition
  // and the first such operator of each name and device type prints one line on stderr, e.g.
  //   depthkit: dar_read has no CUDA kernel; running its reference composition (impl = "fused")
  // On the meta device (shapes only: such a model never runs) the references are chosen silently.
  OperatorChoice(const std::string& impl, c10::DeviceType device, std::initializer_list<const char*> ops);
  // Whether `op` runs fused; fails for an operator the pathway did not declare.
  bool fused(const std::string& op) const;
  // Every declared operator and whether it runs fused.
  const std::map<std::string, bool>& all() const { return fused_; }

 private:
  std::map<std::string, bool> fused_;
};

}  // namespace depthkit
