// The references of mhc_pre, mhc_sinkhorn and mhc_merge (reference.h): MSAR eq. 3–5 in the
// parameterisation docs/design.md ("mHC") settles, composed of ATen ops.
#include <ATen/TensorOperators.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sigmoid.h>

#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"

namespace depthkit::reference {

at::Tensor sinkhorn(const at::Tensor& positive, int64_t iters) {
  at::Tensor p = positive;
  for (int64_t k = 0; k < iters; ++k) {
    p = p / p.sum(-1, /*keepdim=*/true);  // rows
    p = p / p.sum(-2, /*keepdim=*/true);  // columns (normalised last: exact)
  }
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_pre(const at::Tensor& x, const at::Tensor& phi,
                                                       const at::Tensor& bias, const at::Tensor& scale, double eps) {
  const int64_t m = x.size(-2);
  // α ⊙ (x φ)/rms(x) + b, with α_pre, α_post, α_res spread over their m, m and m² logits.
  at::Tensor alpha = at::cat({scale.narrow(0, 0, 1).expand({m}), scale.narrow(0, 1, 1).expand({m}),
                              scale.narrow(0, 2, 1).expand({m * m})});
  at::Tensor logits = alpha * at::linear(key_norm(x.flatten(-2, -1), eps), phi) + bias;
  at::Tensor pre = at::sigmoid(logits.narrow(-1, 0, m));         // H_pre
  at::Tensor post = 2.0 * at::sigmoid(logits.narrow(-1, m, m));  // H_post
  std::vector<int64_t> res_shape(x.sizes().begin(), x.sizes().end() - 1);
  res_shape.push_back(m);
  at::Tensor res = logits.narrow(-1, 2 * m, m * m).reshape(res_shape);
  return {(pre.unsqueeze(-1) * x).sum(-2), post, res};  // eq. 4: Σ_i H_pre[i] x_i
}

at::Tensor mhc_sinkhorn(const at::Tensor& logits, int64_t iters) {
  // In float32 (or float64 when the model is): exp overflows late, the sums stay exact.
  const auto wide = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor res = logits.to(wide);
  res = res - res.amax({-2, -1}, /*keepdim=*/true).detach();  // scale-free: Sinkhorn ignores it
  return sinkhorn(at::exp(res), iters).to(logits.scalar_type());
}

at::Tensor mhc_merge(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post, const at::Tensor& h_res) {
  // eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i
  return h_post.unsqueeze(-1) * f.unsqueeze(-2) + at::matmul(h_res.transpose(-1, -2), x);
}

}  // namespace depthkit::reference
