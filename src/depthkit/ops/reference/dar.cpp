// The references of dar_read and dar_write (reference.h): DAR eq. 10–17 composed of the
// depth-attention primitive and ATen ops.
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/stack.h>

#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"

namespace depthkit::reference {

namespace {
// Norm([x⁰; x¹]): weightless RMSNorm over the concatenated 2d features (eq. 13, 16).
at::Tensor joint_norm(const at::Tensor& x0, const at::Tensor& x1, double eps) {
  return key_norm(at::cat({x0, x1}, -1), eps);
}
}  // namespace

fused::DarRead dar_read(const at::Tensor& queries_, at::TensorList h0_list, at::TensorList h1_list,
                        const at::Tensor& p0_, const at::Tensor& p1_, const at::Tensor& w_alpha_,
                        const at::Tensor& b_alpha_, const at::Tensor& w_beta_, const at::Tensor& b_beta_,
                        const std::array<int64_t, 2>& key_stream, const std::array<int64_t, 2>& value_stream,
                        double eps) {
  // As the fused kernel: the reads, gates and mix in the accumulation dtype; h and β stored in the
  // streams' dtype.
  const at::Tensor h0_ = at::stack(h0_list), h1_ = at::stack(h1_list);
  const at::Tensor queries = widen(queries_, h0_), h0 = widen(h0_, h0_), h1 = widen(h1_, h0_), p0 = widen(p0_, h0_),
                   p1 = widen(p1_, h0_), w_alpha = widen(w_alpha_, h0_), b_alpha = widen(b_alpha_, h0_),
                   w_beta = widen(w_beta_, h0_), b_beta = widen(b_beta_, h0_);
  const at::Tensor* completed[2] = {&h0, &h1};
  const at::Tensor* partial[2] = {&p0, &p1};
  at::Tensor z[2];
  for (int j = 0; j < 2; ++j) {  // eq. 11–12 in the two-phase form (A.1–A.10)
    const int64_t k = key_stream[j], v = value_stream[j];
    at::Tensor q = queries[j];
    DepthRead hist = depthkit::depth_read(q, *completed[k], *completed[v], eps);
    z[j] = p0.defined() ? merge_partial(hist, q, *partial[k], *partial[v], eps) : hist.out;
  }
  at::Tensor hbar = joint_norm(z[0], z[1], eps);                            // eq. 13
  at::Tensor alpha = at::sigmoid(at::linear(hbar, w_alpha, b_alpha));       // eq. 14
  at::Tensor beta = 2.0 * at::sigmoid(at::linear(hbar, w_beta, b_beta));
  at::Tensor h = alpha.select(-1, 0).unsqueeze(-1) * z[0] + alpha.select(-1, 1).unsqueeze(-1) * z[1];  // eq. 15
  return {h.to(h0_.scalar_type()), beta.to(h0_.scalar_type()), at::Tensor()};
}

std::pair<at::Tensor, at::Tensor> dar_write(const at::Tensor& f_, const at::Tensor& beta_, const at::Tensor& p0_,
                                            const at::Tensor& p1_, const at::Tensor& w_rho_, const at::Tensor& b_rho_,
                                            double eps) {
  // As the fused kernel: computed in the accumulation dtype, the new partial stored in f's dtype.
  const auto st = f_.scalar_type();
  const at::Tensor f = widen(f_, f_), beta = widen(beta_, f_), p0 = widen(p0_, f_), p1 = widen(p1_, f_),
                   w_rho = widen(w_rho_, f_), b_rho = widen(b_rho_, f_);
  at::Tensor w0 = beta.select(-1, 0).unsqueeze(-1) * f;  // β ⊗ f(h) (eq. 7)
  at::Tensor w1 = beta.select(-1, 1).unsqueeze(-1) * f;
  if (!p0.defined()) return {w0.to(st), w1.to(st)};  // eq. 17, i = 1
  at::Tensor rho = at::sigmoid(at::linear(joint_norm(p0, p1, eps), w_rho, b_rho));  // eq. 16
  return {(rho * p0 + (1.0 - rho) * p1 + w0).to(st), ((1.0 - rho) * p0 + rho * p1 + w1).to(st)};  // eq. 17
}

}  // namespace depthkit::reference
