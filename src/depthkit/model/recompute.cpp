#include "depthkit/model/recompute.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "depthkit/ops/shared_source.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The region itself, kept in the autograd context (freed with it, whether or not backward runs).
struct RegionHolder : torch::CustomClassHolder {
  Region region;
  RegionHooks hooks;
  std::vector<bool> needs;  // per input: whether it requires a gradient
};

class Recomputed : public torch::autograd::Function<Recomputed> {
 public:
  // Inputs and parameters are the function's tensor arguments, so that autograd sends their
  // gradients on: the parameters' to their accumulators, where the data-parallel reducer's hooks
  // wait. Saving a parameter (a leaf) keeps nothing alive that the model does not.
  static variable_list forward(AutogradContext* ctx, const Region& region, const RegionHooks& hooks,
                               at::TensorList inputs, at::TensorList parameters) {
    auto holder = c10::make_intrusive<RegionHolder>();
    holder->region = region;
    holder->hooks = hooks;
    for (const at::Tensor& x : inputs) holder->needs.push_back(x.requires_grad());
    ctx->saved_data["region"] = c10::IValue::make_capsule(holder);
    std::vector<at::Tensor> saved = inputs.vec();
    saved.insert(saved.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(saved);
    return run_between(hooks, /*backward=*/false, [&] { return region(inputs.vec()); });  // grad mode is off here
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto holder = c10::static_intrusive_pointer_cast<RegionHolder>(ctx->saved_data["region"].toCapsule());
    return run_between(holder->hooks, /*backward=*/true, [&] { return recompute(ctx, *holder, grad_outputs); });
  }

  // The whole of `run`, with the hooks before and after it.
  template <class Run>
  static variable_list run_between(const RegionHooks& hooks, bool backward, const Run& run) {
    if (hooks.before) hooks.before(backward);
    variable_list out = run();
    if (hooks.after) hooks.after(backward);
    return out;
  }

 private:
  static variable_list recompute(AutogradContext* ctx, const RegionHolder& holder, const variable_list& grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n_inputs = holder.needs.size();
    at::AutoGradMode grad_on(true);
    std::vector<at::Tensor> inputs;
    variable_list wrt;
    // An input that is a shared source of the enclosing graph: the region's reads add into its
    // accumulator, as they did without recomputation (ops/shared_source.h).
    fused::SourceStandIns stand_ins;
    for (size_t i = 0; i < n_inputs; ++i) {
      at::Tensor x = saved[i].detach();
      if (holder.needs[i]) {
        x.requires_grad_(true);
        wrt.push_back(x);
        stand_ins.add(x, saved[i]);
      }
      inputs.push_back(x);
    }
    wrt.insert(wrt.end(), saved.begin() + int64_t(n_inputs), saved.end());  // the parameters
    const variable_list outputs = holder.region(inputs);
    // The outputs that carry a gradient, with the gradients backward brought them.
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    const variable_list grads =
        roots.empty() ? variable_list(wrt.size())
                      : torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                              /*allow_unused=*/true);
    variable_list result{at::Tensor(), at::Tensor()};  // the region's and the hooks' slots
    size_t next = 0;
    for (size_t i = 0; i < n_inputs; ++i) result.push_back(holder.needs[i] ? grads[next++] : at::Tensor());
    while (next < grads.size()) result.push_back(grads[next++]);  // the parameters'
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> run_recomputed(const Region& region, const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& parameters, const RegionHooks& hooks) {
  if (!at::GradMode::is_enabled()) return Recomputed::run_between(hooks, false, [&] { return region(inputs); });
  return Recomputed::apply(region, hooks, at::TensorList(inputs), at::TensorList(parameters));
}

}  // namespace depthkit
