// Fused mHC operators (MSAR eq. 3–5), registered as torch operators in namespace `depthkit`
// (ops/mhc_ops.cpp) with CPU kernels (ops/cpu/mhc_cpu.cpp) and Autograd kernels whose backward is
// written by hand. The same ops serve C++ (these functions) and Python (torch.ops.depthkit.*). They
// equal the reference compositions reference::mhc_pre, reference::mhc_sinkhorn and
// reference::mhc_merge (ops/reference/reference.h), which tests/test_fused_mhc.cpp holds them to.
//
//   depthkit::mhc_pre(Tensor x, Tensor phi, Tensor bias, Tensor scale, float eps)
//       -> (Tensor h, Tensor h_post, Tensor res_logits, Tensor proj)
//   depthkit::mhc_sinkhorn(Tensor logits, int iters) -> Tensor
//   depthkit::mhc_merge(Tensor x, Tensor f, Tensor h_post, Tensor h_res) -> Tensor
//   and their *_backward operators.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace depthkit::fused {

// Pre-mix (eq. 3–4): streams x [*, m, d], φ [m² + 2m, md], bias [m² + 2m], scale α [3] →
//   h = Σ_i σ(l_pre)[i] x_i [*, d] (dtype of x), H_post = 2σ(l_post) [*, m], H_res logits
//   [*, m, m], with l = α ⊙ (x φᵀ)/rms(x) + b (rms over the md entries, epsilon eps). H_post and
//   the logits are float32 (float64 for float64 x).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_pre(const at::Tensor& x, const at::Tensor& phi,
                                                       const at::Tensor& bias, const at::Tensor& scale, double eps);

// H_res = Sinkhorn–Knopp(exp(logits − max)) [*, m, m]: `iters` rounds of rows then columns, in
// float32 (float64 for float64 logits).
at::Tensor mhc_sinkhorn(const at::Tensor& logits, int64_t iters);

// Post + res merge (eq. 5): x'_j = H_post[j] f + Σ_i H_res[i, j] x_i, x [*, m, d], f [*, d],
// h_post [*, m], h_res [*, m, m] → x' [*, m, d] (dtype of x).
at::Tensor mhc_merge(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post, const at::Tensor& h_res);

}  // namespace depthkit::fused
