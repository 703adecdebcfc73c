// The fused mHC torch operators: schemas (a fragment of the `depthkit` library that ops/schema.cpp
// defines), CPU kernels (ops/cpu/mhc_cpu.cpp), Autograd kernels that route the backward to the
// hand-written backward operators, and the C++ wrappers of ops/mhc_ops.h. The wrappers live here so
// that linking the static library for them also links these registrations.
//
//   depthkit::mhc_pre(Tensor x, Tensor phi, Tensor bias, Tensor scale, float eps)
//       -> (Tensor h, Tensor h_post, Tensor res_logits, Tensor proj)
//     proj = (x φᵀ)/rms(x) [*, m² + 2m] is what the backward needs besides the inputs; it is not
//     differentiable.
//   depthkit::mhc_pre_backward(Tensor? grad_h, Tensor? grad_h_post, Tensor? grad_res_logits, Tensor x,
//       Tensor phi, Tensor bias, Tensor scale, Tensor proj, float eps) -> (Tensor, Tensor, Tensor, Tensor)
//   depthkit::mhc_sinkhorn(Tensor logits, int iters) -> Tensor
//   depthkit::mhc_sinkhorn_backward(Tensor grad, Tensor logits, int iters) -> Tensor
//   depthkit::mhc_merge(Tensor x, Tensor f, Tensor h_post, Tensor h_res) -> Tensor
//   depthkit::mhc_merge_backward(Tensor grad, Tensor x, Tensor f, Tensor h_post, Tensor h_res)
//       -> (Tensor, Tensor, Tensor, Tensor)
//
// Saved for the backward: the inputs, plus proj for the pre-mix (logit-sized). Sinkhorn keeps only
// its logits and recomputes the iterations per token in the backward kernel.
#include "depthkit/ops/mhc_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "depthkit/ops/cpu/mhc_cpu.h"
#include "depthkit/ops/registration.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using T = at::Tensor;

using PreSig = std::tuple<T, T, T, T>(const T&, const T&, const T&, const T&, double);
using PreBackSig = std::tuple<T, T, T, T>(const std::optional<T>&, const std::optional<T>&, const std::optional<T>&,
                                          const T&, const T&, const T&, const T&, const T&, double);
using SinkSig = T(const T&, int64_t);
using SinkBackSig = T(const T&, const T&, int64_t);
using MergeSig = T(const T&, const T&, const T&, const T&);
using MergeBackSig = std::tuple<T, T, T, T>(const T&, const T&, const T&, const T&, const T&);

// The CPU pre-mix backward, its outputs tensors of their own (∂b and ∂α are views of one buffer).
std::tuple<T, T, T, T> mhc_pre_backward_cpu(const std::optional<T>& gh, const std::optional<T>& gpost,
                                            const std::optional<T>& gres, const T& x, const T& phi, const T& bias,
                                            const T& scale, const T& proj, double eps) {
  auto [gx, gphi, gb, ga] = cpu::mhc_pre_backward(gh, gpost, gres, x, phi, bias, scale, proj, eps);
  own_storage({&gx, &gphi, &gb, &ga});
  return {gx, gphi, gb, ga};
}

class MhcPreFunction : public torch::autograd::Function<MhcPreFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const T& x, const T& phi, const T& bias, const T& scale,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto pre = op<PreSig>("depthkit::mhc_pre");
    auto [h, post, res, proj] = pre.call(x, phi, bias, scale, eps);
    ctx->save_for_backward({x, phi, bias, scale, proj});
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({proj});
    return {h, post, res, proj};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<PreBackSig>("depthkit::mhc_pre_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gphi, gb, ga] =
        back.call(grads[0], grads[1], grads[2], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["eps"].toDouble());
    return {gx, gphi, gb, ga, T()};
  }
};

class MhcSinkhornFunction : public torch::autograd::Function<MhcSinkhornFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const T& logits, int64_t iters) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto sink = op<SinkSig>("depthkit::mhc_sinkhorn");
    ctx->save_for_backward({logits});
    ctx->saved_data["iters"] = iters;
    return {sink.call(logits, iters)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<SinkBackSig>("depthkit::mhc_sinkhorn_backward");
    auto s = ctx->get_saved_variables();
    return {back.call(grads[0], s[0], ctx->saved_data["iters"].toInt()), T()};
  }
};

class MhcMergeFunction : public torch::autograd::Function<MhcMergeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const T& x, const T& f, const T& h_post, const T& h_res) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto merge = op<MergeSig>("depthkit::mhc_merge");
    ctx->save_for_backward({x, f, h_post, h_res});
    return {merge.call(x, f, h_post, h_res)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<MergeBackSig>("depthkit::mhc_merge_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gf, gp, gr] = back.call(grads[0], s[0], s[1], s[2], s[3]);
    return {gx, gf, gp, gr};
  }
};

std::tuple<T, T, T, T> mhc_pre_autograd(const T& x, const T& phi, const T& bias, const T& scale, double eps) {
  auto r = MhcPreFunction::apply(x, phi, bias, scale, eps);
  return {r[0], r[1], r[2], r[3]};
}
T mhc_sinkhorn_autograd(const T& logits, int64_t iters) { return MhcSinkhornFunction::apply(logits, iters)[0]; }
T mhc_merge_autograd(const T& x, const T& f, const T& h_post, const T& h_res) {
  return MhcMergeFunction::apply(x, f, h_post, h_res)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthkit, m) {
  m.def("mhc_pre(Tensor x, Tensor phi, Tensor bias, Tensor scale, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("mhc_pre_backward(Tensor? grad_h, Tensor? grad_h_post, Tensor? grad_res_logits, Tensor x, Tensor phi, "
        "Tensor bias, Tensor scale, Tensor proj, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("mhc_sinkhorn(Tensor logits, int iters) -> Tensor");
  m.def("mhc_sinkhorn_backward(Tensor grad, Tensor logits, int iters) -> Tensor");
  m.def("mhc_merge(Tensor x, Tensor f, Tensor h_post, Tensor h_res) -> Tensor");
  m.def("mhc_merge_backward(Tensor grad, Tensor x, Tensor f, Tensor h_post, Tensor h_res) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("mhc_pre", &cpu::mhc_pre_forward);
  m.impl("mhc_pre_backward", &mhc_pre_backward_cpu);
  m.impl("mhc_sinkhorn", &cpu::mhc_sinkhorn_forward);
  m.impl("mhc_sinkhorn_backward", &cpu::mhc_sinkhorn_backward);
  m.impl("mhc_merge", &cpu::mhc_merge_forward);
  m.impl("mhc_merge_backward", &cpu::mhc_merge_backward);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("mhc_pre", &mhc_pre_autograd);
  m.impl("mhc_sinkhorn", &mhc_sinkhorn_autograd);
  m.impl("mhc_merge", &mhc_merge_autograd);
}

namespace fused {

std::tuple<T, T, T> mhc_pre(const T& x, const T& phi, const T& bias, const T& scale, double eps) {
  static auto pre = op<PreSig>("depthkit::mhc_pre");
  auto [h, post, res, proj] = pre.call(x, phi, bias, scale, eps);
  return {h, post, res};
}

T mhc_sinkhorn(const T& logits, int64_t iters) {
  static auto sink = op<SinkSig>("depthkit::mhc_sinkhorn");
  return sink.call(logits, iters);
}

T mhc_merge(const T& x, const T& f, const T& h_post, const T& h_res) {
  static auto merge = op<MergeSig>("depthkit::mhc_merge");
  return merge.call(x, f, h_post, h_res);
}

}  // namespace fused

}  // namespace depthkit
