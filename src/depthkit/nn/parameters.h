// ParameterStore: every trainable tensor of a model, by name, with the component it belongs to
// (for `depthkit params`), whether weight decay applies, and a seeded initialiser. On the meta
// device it records shapes only, so the 1B configs can be counted without allocating them.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

namespace depthkit {

enum class Init { Normal, Ones, Zeros, Constant, Identity };  // Identity: square matrices

struct Parameter {
  std::string name;
  std::string component;  // embedding | attention | feed_forward | norm | lm_head | residual
  at::Tensor tensor;
  bool decay;  // AdamW weight decay: matrices only
};

class ParameterStore {
 public:
  // dtype: float32 for training; float64 for the tests that compare against the papers' equations.
  ParameterStore(at::Device device, uint64_t seed, at::ScalarType dtype = at::kFloat);
  // Creates, initialises (drawn in float32 on the CPU generator, then cast) and registers a parameter.
  // `scale`: the standard deviation for Init::Normal, the value for Init::Constant.
  at::Tensor add(const std::string& name, const std::string& component, at::IntArrayRef shape,
                 Init init, double scale = 0.0);
  const std::vector<Parameter>& all() const { return params_; }
  at::Tensor get(const std::string& name) const;
  int64_t count(const std::string& component = "") const;
  std::vector<std::pair<std::string, at::Tensor>> named() const;
  // Copies tensors in by name; names, shapes and dtypes must match exactly. `source` names the file.
  void load(const std::map<std::string, at::Tensor>& tensors, const std::string& source);
  void zero_grad();
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  at::Device device_;
  at::ScalarType dtype_;
  at::Generator gen_;
  std::vector<Parameter> params_;
};

}  // namespace depthkit
