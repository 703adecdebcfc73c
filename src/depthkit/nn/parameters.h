// ParameterStore: every trainable tensor of a model, by name, with the component it belongs to
// (for `depthkit params`), whether weight decay applies, and a seeded initialiser. On the meta
// device it records shapes only, so the 1B configs can be counted without allocating them.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace depthkit {

class SafetensorsReader;

enum class Init { Normal, Ones, Zeros, Constant, Identity };  // Identity: square matrices

struct Parameter {
  std::string name;
  std::string component;  // embedding | attention | feed_forward | norm | lm_head | residual
  at::Tensor tensor;
  bool decay;  // AdamW weight decay: matrices only
  // A slice (expert parallelism): `tensor` holds rows [first_row, first_row + tensor.size(0)) of
  // the tensor `name` of shape full_shape, as checkpoints hold it. Whole: full_shape is the
  // tensor's own and first_row 0.
  std::vector<int64_t> full_shape;
  int64_t first_row = 0;
  bool is_slice() const { return full_shape != tensor.sizes().vec(); }
  // Where `tensor`'s first element lies in the whole tensor, laid flat.
  int64_t first_element() const { return tensor.dim() ? first_row * (tensor.numel() / std::max<int64_t>(1, tensor.size(0))) : 0; }
};

// Rows [first, first + count) of a parameter's dim 0 (ParameterStore::add).
struct Rows {
  int64_t first = 0, count = -1;  // count −1: every row
};

class ParameterStore {
 public:
  // dtype: float32 for training; float64 for the tests that compare against the papers' equations.
  ParameterStore(at::Device device, uint64_t seed, at::ScalarType dtype = at::kFloat);
  // Creates, initialises (drawn in float32 on the CPU generator, then cast) and registers a parameter.
  // `scale`: the standard deviation for Init::Normal, the value for Init::Constant. With `rows`,
  // the whole tensor is drawn (the generator advances as for the whole) and those rows kept: a
  // model split over ranks starts from the slices of one model.
  at::Tensor add(const std::string& name, const std::string& component, at::IntArrayRef shape,
                 Init init, double scale = 0.0, Rows rows = {});
  const std::vector<Parameter>& all() const { return params_; }
  at::Tensor get(const std::string& name) const;
  int64_t count(const std::string& component = "") const;
  std::vector<std::pair<std::string, at::Tensor>> named() const;
  // Copies tensors in by name (a slice takes its rows); names, shapes and dtypes must match
  // exactly. `source` names the file.
  void load(const std::map<std::string, at::Tensor>& tensors, const std::string& source);
  // The same from a file, reading each parameter's own elements only (a slice's rows). Every
  // tensor is checked; with `held` (per parameter), only those marked are copied in (ZeRO-3 reads
  // the others into its shards).
  void load(const SafetensorsReader& file, const std::vector<bool>& held = {});
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
