// DAR's fused operators: schemas, CPU kernels (ops/cpu/dar_cpu.cpp) and Autograd kernels whose
// backward is the hand-written backward operator.
//
//   depthkit::dar_read(Tensor queries, Tensor[] h0, Tensor[] h1, Tensor? p0, Tensor? p1, Tensor w_alpha,
//                      Tensor b_alpha, Tensor w_beta, Tensor b_beta, int[] key_stream,
//                      int[] value_stream, float eps) -> (Tensor h, Tensor beta, Tensor log_partition)
//   depthkit::dar_write(Tensor f, Tensor beta, Tensor? p0, Tensor? p1, Tensor? w_rho, Tensor? b_rho,
//                       float eps) -> (Tensor p0, Tensor p1)
//   and their *_backward operators. dar_read_backward adds the entries' gradients into the buffers
//   it is given (Tensor(a!)[], ops/shared_source.h) and returns the others, as a tuple: a mutating
//   operator's outputs must be single tensors for torch.compile's functionalization
//   (auto_functionalized) to take it. The gradients of absent inputs (p0, p1 at a block's start;
//   p0, p1, w_rho, b_rho in dar_write_backward) are undefined: None in Python.
#include "depthkit/ops/dar_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "depthkit/ops/cpu/dar_cpu.h"
#include "depthkit/ops/registration.h"
#include "depthkit/ops/shared_source.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ReadSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, at::TensorList, at::TensorList, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef, double);
using ReadBackOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ReadBackSig = ReadBackOut(const OptTensor&, const OptTensor&, const at::Tensor&, at::TensorList, at::TensorList,
                                const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                at::IntArrayRef, double, at::TensorList, at::TensorList);
using WriteSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                    const OptTensor&, const OptTensor&, const OptTensor&, double);
using WriteBackOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using WriteBackSig = WriteBackOut(const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                                  const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, double);


// ---- CPU: the kernels' gradient lists as the schemas' tuples, each output a tensor of its own ----

ReadBackOut dar_read_backward_cpu(const OptTensor& grad_h, const OptTensor& grad_beta, const at::Tensor& q,
                                  at::TensorList h0, at::TensorList h1, const OptTensor& p0, const OptTensor& p1,
                                  const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                                  const at::Tensor& bb, const at::Tensor& lse, at::IntArrayRef key,
                                  at::IntArrayRef value, double eps, at::TensorList grad_h0, at::TensorList grad_h1) {
  auto g = cpu::dar_read_backward(grad_h, grad_beta, q, h0, h1, p0, p1, wa, ba, wb, bb, lse, key, value, eps, grad_h0,
                                  grad_h1);
  own_storage({&g[0], &g[1], &g[2], &g[3], &g[4], &g[5], &g[6]});  // the token sums are views of one buffer
  return {g[0], g[1], g[2], g[3], g[4], g[5], g[6]};
}

WriteBackOut dar_write_backward_cpu(const OptTensor& grad0, const OptTensor& grad1, const at::Tensor& f,
                                    const at::Tensor& beta, const OptTensor& p0, const OptTensor& p1,
                                    const OptTensor& w_rho, const OptTensor& b_rho, double eps) {
  auto g = cpu::dar_write_backward(grad0, grad1, f, beta, p0, p1, w_rho, b_rho, eps);
  own_storage({&g[0], &g[1], &g[2], &g[3], &g[4], &g[5]});  // ∂w_ρ and ∂b_ρ are views of one buffer
  return {g[0], g[1], g[2], g[3], g[4], g[5]};
}


// ---- Autograd: forward through the dispatcher, backward = the hand-written backward op ----------

class DarReadFunction : public torch::autograd::Function<DarReadFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, at::TensorList h0, at::TensorList h1,
                               const OptTensor& p0, const OptTensor& p1, const at::Tensor& wa, const at::Tensor& ba,
                               const at::Tensor& wb, const at::Tensor& bb, at::IntArrayRef key, at::IntArrayRef value,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto read = op<ReadSig>("depthkit::dar_read");
    auto [h, beta, lse] = read.call(q, h0, h1, p0, p1, wa, ba, wb, bb, key, value, eps);
    // The inputs and ζ only: normalised keys, weights and the retrieved states are recomputed.
    variable_list saved = {q, unwrap(p0), unwrap(p1), wa, ba, wb, bb, lse};
    saved.insert(saved.end(), h0.begin(), h0.end());
    saved.insert(saved.end(), h1.begin(), h1.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["key"] = key.vec();
    ctx->saved_data["value"] = value.vec();
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({lse});
    return {h, beta, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<ReadBackSig>("depthkit::dar_read_backward");
    auto s = ctx->get_saved_variables();
    const int64_t N = (int64_t(s.size()) - 8) / 2;
    const at::TensorList h0 = at::TensorList(s).slice(8, N), h1 = at::TensorList(s).slice(8 + N, N);
    auto key = ctx->saved_data["key"].toIntVector(), value = ctx->saved_data["value"].toIntVector();
    // The entries' gradients go into buffers (ops/shared_source.h), the rest are returned:
    // [∂q, ∂p0, ∂p1, ∂W_α, ∂b_α, ∂W_β, ∂b_β] (cpu/dar_cpu.h).
    const SourceGradients gh = source_gradients(at::TensorList(s).slice(8, 2 * N), s[7].scalar_type());
    const at::TensorList buffers(gh.buffers);
    auto [gq, gp0, gp1, gwa, gba, gwb, gbb] =
        back.call(wrap(grads[0]), wrap(grads[1]), s[0], h0, h1, wrap(s[1]), wrap(s[2]), s[3], s[4], s[5], s[6], s[7],
                  key, value, ctx->saved_data["eps"].toDouble(), buffers.slice(0, N), buffers.slice(N, N));
    // One gradient per input of forward, in order (none for a shared entry: its buffer carries it).
    variable_list out = {gq};
    for (at::Tensor& t : gh.for_autograd(s[0].scalar_type())) out.push_back(std::move(t));
    out.insert(out.end(), {gp0, gp1, gwa, gba, gwb, gbb});
    out.insert(out.end(), 3, at::Tensor());  // key, value, eps
    return out;
  }
};

class DarWriteFunction : public torch::autograd::Function<DarWriteFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& f, const at::Tensor& beta, const OptTensor& p0,
                               const OptTensor& p1, const OptTensor& w_rho, const OptTensor& b_rho, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto write = op<WriteSig>("depthkit::dar_write");
    auto [o0, o1] = write.call(f, beta, p0, p1, w_rho, b_rho, eps);
    ctx->save_for_backward({f, beta, unwrap(p0), unwrap(p1), unwrap(w_rho), unwrap(b_rho)});
    ctx->saved_data["eps"] = eps;
    return {o0, o1};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<WriteBackSig>("depthkit::dar_write_backward");
    auto s = ctx->get_saved_variables();
    auto [gf, gbeta, gp0, gp1, gw, gb] = back.call(wrap(grads[0]), wrap(grads[1]), s[0], s[1], wrap(s[2]), wrap(s[3]),
                                                   wrap(s[4]), wrap(s[5]), ctx->saved_data["eps"].toDouble());
    return {gf, gbeta, gp0, gp1, gw, gb, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> dar_read_autograd(const at::Tensor& q, at::TensorList h0,
                                                                 at::TensorList h1, const OptTensor& p0,
                                                                 const OptTensor& p1, const at::Tensor& wa,
                                                                 const at::Tensor& ba, const at::Tensor& wb,
                                                                 const at::Tensor& bb, at::IntArrayRef key,
                                                                 at::IntArrayRef value, double eps) {
  auto r = DarReadFunction::apply(q, h0, h1, p0, p1, wa, ba, wb, bb, key, value, eps);
  return {r[0], r[1], r[2]};
}

std::tuple<at::Tensor, at::Tensor> dar_write_autograd(const at::Tensor& f, const at::Tensor& beta,
                                                      const OptTensor& p0, const OptTensor& p1,
                                                      const OptTensor& w_rho, const OptTensor& b_rho, double eps) {
  auto r = DarWriteFunction::apply(f, beta, p0, p1, w_rho, b_rho, eps);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthkit, m) {
  m.def("dar_read(Tensor queries, Tensor[] h0, Tensor[] h1, Tensor? p0, Tensor? p1, Tensor w_alpha, Tensor b_alpha, "
        "Tensor w_beta, Tensor b_beta, int[] key_stream, int[] value_stream, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("dar_read_backward(Tensor? grad_h, Tensor? grad_beta, Tensor queries, Tensor[] h0, Tensor[] h1, Tensor? p0, "
        "Tensor? p1, Tensor w_alpha, Tensor b_alpha, Tensor w_beta, Tensor b_beta, Tensor log_partition, "
        "int[] key_stream, int[] value_stream, float eps, Tensor(a!)[] grad_h0, Tensor(b!)[] grad_h1) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("dar_write(Tensor f, Tensor beta, Tensor? p0, Tensor? p1, Tensor? w_rho, Tensor? b_rho, float eps) "
        "-> (Tensor, Tensor)");
  m.def("dar_write_backward(Tensor? grad0, Tensor? grad1, Tensor f, Tensor beta, Tensor? p0, Tensor? p1, "
        "Tensor? w_rho, Tensor? b_rho, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("dar_read", &cpu::dar_read_forward);
  m.impl("dar_read_backward", &dar_read_backward_cpu);
  m.impl("dar_write", &cpu::dar_write_forward);
  m.impl("dar_write_backward", &dar_write_backward_cpu);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("dar_read", &dar_read_autograd);
  m.impl("dar_write", &dar_write_autograd);
}

namespace fused {

DarRead dar_read(const at::Tensor& queries, at::TensorList h0, at::TensorList h1, const at::Tensor& p0,
                 const at::Tensor& p1, const at::Tensor& w_alpha, const at::Tensor& b_alpha, const at::Tensor& w_beta,
                 const at::Tensor& b_beta, const std::array<int64_t, 2>& key_stream,
                 const std::array<int64_t, 2>& value_stream, double eps) {
  static auto read = op<ReadSig>("depthkit::dar_read");
  auto [h, beta, lse] = read.call(queries, h0, h1, wrap(p0), wrap(p1), w_alpha, b_alpha, w_beta, b_beta, key_stream,
                                  value_stream, eps);
  return {h, beta, lse};
}

std::pair<at::Tensor, at::Tensor> dar_write(const at::Tensor& f, const at::Tensor& beta, const at::Tensor& p0,
                                            const at::Tensor& p1, const at::Tensor& w_rho, const at::Tensor& b_rho,
                                            double eps) {
  static auto write = op<WriteSig>("depthkit::dar_write");
  auto [o0, o1] = write.call(f, beta, wrap(p0), wrap(p1), wrap(w_rho), wrap(b_rho), eps);
  return {o0, o1};
}

}  // namespace fused

}  // namespace depthkit
