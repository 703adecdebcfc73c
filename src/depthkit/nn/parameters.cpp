#include "depthkit/nn/parameters.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include "depthkit/io/safetensors.h"
#include "depthkit/util/error.h"

namespace depthkit {

ParameterStore::ParameterStore(at::Device device, uint64_t seed, at::ScalarType dtype)
    : device_(device), dtype_(dtype), gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

at::Tensor ParameterStore::add(const std::string& name, const std::string& component,
                               at::IntArrayRef shape, Init init, double scale, Rows rows) {
  for (const auto& p : params_)
    if (p.name == name) fail("parameter '", name, "' registered twice");
  int64_t numel = 1;
  for (int64_t n : shape)
    if (n < 0 || __builtin_mul_overflow(numel, n, &numel)) fail("parameter '", name, "' has shape ", shape, ", too large");
  Building building(cat("parameter '", name, "' ", shape));
  at::Tensor t;
  if (device_.is_meta()) {
    t = at::empty(shape, at::TensorOptions().dtype(dtype_).device(at::kMeta));
  } else {
    t = at::empty(shape, at::kFloat);
    switch (init) {
      case Init::Normal: t.normal_(0.0, scale, gen_); break;
      case Init::Constant: t.fill_(scale); break;
      case Init::Identity: t.zero_().diagonal().fill_(1.0); break;
      case Init::Ones: t.fill_(1.0); break;
      case Init::Zeros: t.zero_(); break;
    }
    t = t.to(device_, dtype_);
  }
  if (rows.count >= 0) {
    if (shape.empty() || rows.first < 0 || rows.first + rows.count > shape[0])
      fail("parameter '", name, "': rows [", rows.first, ", ", rows.first + rows.count, ") of ", shape);
    t = t.narrow(0, rows.first, rows.count).clone();
  }
  t.set_requires_grad(true);
  params_.push_back({name, component, t, shape.size() >= 2, shape.vec(), rows.count >= 0 ? rows.first : 0});
  return t;
}

at::Tensor ParameterStore::get(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p.tensor;
  fail("no parameter named '", name, "'");
}

int64_t ParameterStore::count(const std::string& component) const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (component.empty() || p.component == component) n += p.tensor.numel();
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> ParameterStore::named() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : params_) out.emplace_back(p.name, p.tensor);
  return out;
}

void ParameterStore::load(const std::map<std::string, at::Tensor>& tensors, const std::string& source) {
  for (const auto& p : params_) {
    auto it = tensors.find(p.name);
    if (it == tensors.end()) fail(source, ": missing tensor '", p.name, "'");
    if (it->second.sizes() != at::IntArrayRef(p.full_shape))
      fail(source, ": tensor '", p.name, "' has shape ", it->second.sizes(), ", the model needs ", at::IntArrayRef(p.full_shape));
    if (it->second.scalar_type() != p.tensor.scalar_type())
      fail(source, ": tensor '", p.name, "' has dtype ", it->second.scalar_type(), ", the model needs ", p.tensor.scalar_type());
  }
  if (tensors.size() != params_.size()) {
    for (const auto& [name, t] : tensors) {
      bool known = std::any_of(params_.begin(), params_.end(), [&](auto& p) { return p.name == name; });
      if (!known) fail(source, ": unexpected tensor '", name, "' (not a parameter of this model)");
    }
  }
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    const at::Tensor& whole = tensors.at(p.name);
    p.tensor.copy_(p.is_slice() ? whole.narrow(0, p.first_row, p.tensor.size(0)) : whole);
  }
}

void ParameterStore::load(const SafetensorsReader& file, const std::vector<bool>& held) {
  const std::string& source = file.path();
  for (const auto& p : params_) {
    const std::optional<TensorSpec> spec = file.spec(p.name);
    if (!spec) fail(source, ": missing tensor '", p.name, "'");
    if (spec->shape != p.full_shape)
      fail(source, ": tensor '", p.name, "' has shape ", at::IntArrayRef(spec->shape), ", the model needs ",
           at::IntArrayRef(p.full_shape));
    if (spec->dtype != p.tensor.scalar_type())
      fail(source, ": tensor '", p.name, "' has dtype ", spec->dtype, ", the model needs ", p.tensor.scalar_type());
  }
  for (const TensorSpec& t : file.tensors())
    if (std::none_of(params_.begin(), params_.end(), [&](const Parameter& p) { return p.name == t.name; }))
      fail(source, ": unexpected tensor '", t.name, "' (not a parameter of this model)");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    if (held.empty() || held[i])
      p.tensor.copy_(file.read_elements(p.name, p.first_element(), p.tensor.numel()).view(p.tensor.sizes()));
  }
}

void ParameterStore::zero_grad() {
  for (auto& p : params_)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

}  // namespace depthkit
