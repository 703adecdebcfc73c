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

std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_pre(const at::Tensor& x_, const at::Tensor& phi_,
                                                       const at::Tensor& bias_, const at::Tensor& scale_, double eps) {
  // As the fused kernel: in the accumulation dtype, h stored in x's dtype, H_post and the H_res
  // logits kept in the accumulation dtype (float32 for a bfloat16 x).
  const at::Tensor x = widen(x_, x_), phi = widen(phi_, x_), bias = widen(bias_, x_), scale = widen(scale_, x_);
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
  return {(pre.unsqueeze(-1) * x).sum(-2).to(x_.scalar_type()), post, res};  // eq. 4: Σ_i H_pre[i] x_i
}

at::Tensor mhc_sinkhorn(const at::Tensor& logits, int64_t iters) {
  // In float32 (or float64 when the model is): exp overflows late, the sums stay exact. Returned
  // in that dtype, as the fused kernel returns it.
  at::Tensor res = widen(logits, logits);
  res = res - res.amax({-2, -1}, /*keepdim=*/true).detach();  // scale-free: Sinkhorn ignores it
  return sinkhorn(at::exp(res), iters);
}

at::Tensor mhc_merge(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post, const at::Tensor& h_res) {
  // eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i, in the accumulation dtype as the fused kernel
  // (H_post and H_res are float32 for a bfloat16 x), stored in x's dtype.
  at::Tensor out = widen(h_post, x).unsqueeze(-1) * widen(f, x).unsqueeze(-2) +
                   at::matmul(widen(h_res, x).transpose(-1, -2), widen(x, x));
  return out.to(x.scalar_type());
}

}  // namespace depthkit::reference
