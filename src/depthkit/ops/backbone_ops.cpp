// The backbone's fused operators: schemas, CPU kernels (ops/cpu/backbone_cpu.cpp; the linear
// cross-entropy's here, as it is GEMMs around a per-chunk softmax kernel) and Autograd kernels whose
// backward is the hand-written backward operator.
//
//   depthkit::rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor inv_rms)
//   depthkit::rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_heads, int n_kv_heads, int offset)
//       -> (Tensor q, Tensor k, Tensor v)
//   depthkit::swiglu(Tensor gate_up) -> Tensor
//   depthkit::linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets) -> Tensor
//   and their *_backward operators; linear_cross_entropy_backward(hidden, weight, targets) returns
//   (loss, ∂hidden, ∂weight) for a unit upstream gradient, in the accumulation dtype: it replaces
//   the forward when gradients are wanted, as both need each chunk's logits.
#include "depthkit/ops/backbone_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "depthkit/ops/cpu/backbone_cpu.h"
#include "depthkit/ops/registration.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using NormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
using NormBackSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&);
using RopeSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               int64_t, int64_t, int64_t);
using RopeBackSig = at::Tensor(const OptTensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
                               const at::Tensor&, int64_t, int64_t, int64_t);
using SwigluSig = at::Tensor(const at::Tensor&);
using SwigluBackSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using CrossEntropySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using CrossEntropyBackSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           const at::Tensor&);

// ---- The linear cross-entropy's kernel ----------------------------------------------------------

// Tokens per chunk: about this many bytes of logits, so that a chunk's logits stay in the cache
// between the GEMM that writes them, the softmax, and the two GEMMs of the gradient; but never
// fewer than kMinChunkTokens, since each chunk's products read W (and ∂W) whole, which at large
// vocabularies (65,536) would otherwise make them memory-bound.
constexpr int64_t kChunkLogitBytes = int64_t(8) << 20;
constexpr int64_t kMinChunkTokens = 256;

// Σ over tokens of −log softmax(hidden · weightᵀ)[target], and with `with_grad` the gradients of
// the mean: ∂logits = (softmax − onehot(target)) / N per chunk, ∂hidden = ∂logits · weight,
// ∂weight = Σ_chunks ∂logitsᵀ · hidden (the 1/N folded into the GEMMs' α). bfloat16 inputs are
// taken in float32 (the reference's logits, softmax and its gradient are float32 too).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_impl(const at::Tensor& hidden_in,
                                                                         const at::Tensor& weight_in,
                                                                         const at::Tensor& targets, bool with_grad) {
  if (hidden_in.dim() != 2 || weight_in.dim() != 2 || hidden_in.size(1) != weight_in.size(1))
    fail("linear_cross_entropy: expected hidden [N, d] and weight [V, d], got ", hidden_in.sizes(), " and ",
         weight_in.sizes());
  if (hidden_in.scalar_type() != weight_in.scalar_type())
    fail("linear_cross_entropy: hidden and weight must share a dtype");
  if (targets.dim() != 1 || targets.size(0) != hidden_in.size(0) || targets.scalar_type() != at::kLong)
    fail("linear_cross_entropy: expected int64 targets [", hidden_in.size(0), "], got ", targets.sizes());
  const int64_t N = hidden_in.size(0), V = weight_in.size(0), d = hidden_in.size(1);
  if (N == 0) fail("linear_cross_entropy: no tokens");
  const at::ScalarType acc = hidden_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor hidden = hidden_in.to(acc).contiguous(), weight = weight_in.to(acc).contiguous();
  const at::Tensor tgt = targets.contiguous();
  if (tgt.min().item<int64_t>() < 0 || tgt.max().item<int64_t>() >= V)
    fail("linear_cross_entropy: a target is outside the vocabulary [0, ", V, ")");
  const int64_t chunk =
      std::min(N, std::max(kMinChunkTokens, kChunkLogitBytes / (V * int64_t(c10::elementSize(acc)))));
  const double inv_n = 1.0 / double(N);
  at::Tensor logits = at::empty({chunk, V}, hidden.options());
  double total = 0;
  at::Tensor g_hidden, g_weight;
  if (with_grad) {
    g_hidden = at::empty({N, d}, hidden.options());
    g_weight = at::zeros({V, d}, hidden.options());
  }
  for (int64_t s = 0; s < N; s += chunk) {
    const int64_t n = std::min(chunk, N - s);
    const at::Tensor h = hidden.narrow(0, s, n);
    at::Tensor z = logits.narrow(0, 0, n);
    // The products run per fixed block of rows (cpu::addmm_in_row_blocks), so that the loss and
    // the gradients do not depend on the thread count; ∂weight's rows are the vocabulary's.
    cpu::addmm_in_row_blocks(z, h, weight.t(), 0.0, 1.0);
    // The chunk's loss, and with the gradient z becomes softmax − onehot(target) in place.
    total += cpu::cross_entropy_rows(z, tgt.narrow(0, s, n), with_grad);
    if (!with_grad) continue;
    cpu::addmm_in_row_blocks(g_hidden.narrow(0, s, n), z, weight, 0.0, inv_n);
    cpu::addmm_in_row_blocks(g_weight, z.t(), h, 1.0, inv_n);
  }
  // The gradients stay in the accumulation dtype: the backward scales them by the upstream
  // gradient first and rounds to the inputs' dtype once.
  return {at::scalar_tensor(total * inv_n, hidden.options()), g_hidden, g_weight};
}

at::Tensor linear_cross_entropy_cpu(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  return std::get<0>(linear_cross_entropy_impl(hidden, weight, targets, false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward_cpu(const at::Tensor& hidden,
                                                                                 const at::Tensor& weight,
                                                                                 const at::Tensor& targets) {
  return linear_cross_entropy_impl(hidden, weight, targets, true);
}

// ---- Autograd: forward through the dispatcher, backward = the hand-written backward op ----------

// The backward operators have no derivative of their own: a backward that would build a graph
// (create_graph, for a second derivative) is refused rather than silently constant.
void once_differentiable(const char* op) {
  if (at::GradMode::is_enabled()) fail(op, ": its backward is not differentiable (no second derivatives)");
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto norm = op<NormSig>("depthkit::rms_norm");
    auto [y, inv] = norm.call(x, w, eps);
    ctx->save_for_backward({x, w, inv});  // the scales, not the normalised rows
    ctx->mark_non_differentiable({inv});
    return {y, inv};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    once_differentiable("rms_norm");
    static auto back = op<NormBackSig>("depthkit::rms_norm_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gw] = back.call(grads[0], s[0], s[1], s[2]);
    return {gx, gw, at::Tensor()};
  }
};

class RopeQkvFunction : public torch::autograd::Function<RopeQkvFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t H, int64_t KV, int64_t offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto rope = op<RopeSig>("depthkit::rope_qkv");
    auto [q, k, v] = rope.call(qkv, cos, sin, H, KV, offset);
    ctx->save_for_backward({cos, sin});  // the backward is linear: no activation is kept
    ctx->saved_data["H"] = H;
    ctx->saved_data["KV"] = KV;
    ctx->saved_data["offset"] = offset;
    return {q, k, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    once_differentiable("rope_qkv");
    static auto back = op<RopeBackSig>("depthkit::rope_qkv_backward");
    auto s = ctx->get_saved_variables();
    return {back.call(wrap(grads[0]), wrap(grads[1]), wrap(grads[2]), s[0], s[1], ctx->saved_data["H"].toInt(),
                      ctx->saved_data["KV"].toInt(), ctx->saved_data["offset"].toInt()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto swiglu = op<SwigluSig>("depthkit::swiglu");
    ctx->save_for_backward({gate_up});
    return {swiglu.call(gate_up)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    once_differentiable("swiglu");
    static auto back = op<SwigluBackSig>("depthkit::swiglu_backward");
    return {back.call(grads[0], ctx->get_saved_variables()[0])};
  }
};

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& targets, bool with_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (!with_grad) {
      static auto loss = op<CrossEntropySig>("depthkit::linear_cross_entropy");
      return {loss.call(hidden, weight, targets)};
    }
    static auto loss_and_grads = op<CrossEntropyBackSig>("depthkit::linear_cross_entropy_backward");
    auto [loss, gh, gw] = loss_and_grads.call(hidden, weight, targets);
    ctx->save_for_backward({gh, gw});
    ctx->saved_data["hidden_dtype"] = hidden.scalar_type();
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    return {loss};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    once_differentiable("linear_cross_entropy");
    auto s = ctx->get_saved_variables();
    const at::Tensor& g = grads[0];  // a scalar in the accumulation dtype, as ∂h and ∂W are
    return {(s[0] * g).to(ctx->saved_data["hidden_dtype"].toScalarType()),
            (s[1] * g).to(ctx->saved_data["weight_dtype"].toScalarType()), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto r = RmsNormFunction::apply(x, w, eps);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_autograd(const at::Tensor& qkv, const at::Tensor& cos,
                                                                 const at::Tensor& sin, int64_t H, int64_t KV,
                                                                 int64_t offset) {
  auto r = RopeQkvFunction::apply(qkv, cos, sin, H, KV, offset);
  return {r[0], r[1], r[2]};
}

at::Tensor swiglu_autograd(const at::Tensor& gate_up) { return SwigluFunction::apply(gate_up)[0]; }

at::Tensor linear_cross_entropy_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  // Gradients are taken in the forward only when backward will want them.
  const bool with_grad = at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, with_grad)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthkit, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor inv_rms) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_heads, int n_kv_heads, int offset) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("rope_qkv_backward(Tensor? grad_q, Tensor? grad_k, Tensor? grad_v, Tensor cos, Tensor sin, int n_heads, "
        "int n_kv_heads, int offset) -> Tensor");
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor");
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets) -> Tensor");
  m.def("linear_cross_entropy_backward(Tensor hidden, Tensor weight, Tensor targets) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("rms_norm", &cpu::rms_norm_forward);
  m.impl("rms_norm_backward", &cpu::rms_norm_backward);
  m.impl("rope_qkv", &cpu::rope_qkv_forward);
  m.impl("rope_qkv_backward", &cpu::rope_qkv_backward);
  m.impl("swiglu", &cpu::swiglu_forward);
  m.impl("swiglu_backward", &cpu::swiglu_backward);
  m.impl("linear_cross_entropy", &linear_cross_entropy_cpu);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward_cpu);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("rope_qkv", &rope_qkv_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
}

namespace fused {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto norm = op<NormSig>("depthkit::rms_norm");
  return std::get<0>(norm.call(x, weight, eps));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                                        int64_t offset) {
  static auto rope = op<RopeSig>("depthkit::rope_qkv");
  return rope.call(qkv, cos, sin, n_heads, n_kv_heads, offset);
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  static auto swiglu = op<SwigluSig>("depthkit::swiglu");
  return swiglu.call(gate_up);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  static auto loss = op<CrossEntropySig>("depthkit::linear_cross_entropy");
  return loss.call(hidden, weight, targets);
}

}  // namespace fused

}  // namespace depthkit
