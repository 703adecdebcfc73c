#include "depthkit/train/optimizer.h"

#include <ATen/TensorOperators.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>

#include "depthkit/model/parameters.h"
#include "depthkit/util/error.h"

namespace depthkit {

AdamW::AdamW(ParameterStore& params, const OptimConfig& cfg) : params_(params), cfg_(cfg) {
  for (const auto& p : params_.all()) {
    Building building(cat("the AdamW moments of '", p.name, "' ", p.tensor.sizes()));
    exp_avg_.push_back(at::zeros_like(p.tensor).detach());
    exp_avg_sq_.push_back(at::zeros_like(p.tensor).detach());
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(step_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, double(step_));
  const auto& ps = params_.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    at::Tensor p = ps[i].tensor;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (ps[i].decay && cfg_.weight_decay > 0) p.mul_(1.0 - lr * cfg_.weight_decay);
    exp_avg_[i].lerp_(g, 1.0 - cfg_.beta1);
    exp_avg_sq_[i].mul_(cfg_.beta2).addcmul_(g, g, 1.0 - cfg_.beta2);
    at::Tensor denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    p.addcdiv_(exp_avg_[i], denom, -lr / bc1);
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& ps = params_.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    out.emplace_back("exp_avg." + ps[i].name, exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + ps[i].name, exp_avg_sq_[i]);
  }
  out.emplace_back("step", at::scalar_tensor(step_, at::kLong));
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, const std::string& source) {
  auto get = [&](const std::string& name, const at::Tensor& like) {
    auto it = tensors.find(name);
    if (it == tensors.end()) fail(source, ": missing optimizer tensor '", name, "'");
    if (it->second.sizes() != like.sizes() || it->second.scalar_type() != like.scalar_type())
      fail(source, ": optimizer tensor '", name, "' has shape ", it->second.sizes(), ", expected ", like.sizes());
    return it->second;
  };
  const auto& ps = params_.all();
  if (tensors.size() != 2 * ps.size() + 1)
    fail(source, ": holds ", tensors.size(), " optimizer tensors, this model needs ", 2 * ps.size() + 1);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < ps.size(); ++i) {
    exp_avg_[i].copy_(get("exp_avg." + ps[i].name, exp_avg_[i]));
    exp_avg_sq_[i].copy_(get("exp_avg_sq." + ps[i].name, exp_avg_sq_[i]));
  }
  step_ = get("step", at::scalar_tensor(0, at::kLong)).item<int64_t>();
}

double clip_grad_norm(ParameterStore& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params.all())
    if (p.tensor.grad().defined()) norms.push_back(p.tensor.grad().norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  if (max_norm > 0 && std::isfinite(total)) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0)
      for (const auto& p : params.all())
        if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(coef);
  }
  return total;
}

}  // namespace depthkit
