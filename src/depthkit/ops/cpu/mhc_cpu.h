// CPU kernels of the fused mHC operators (declared here, registered in ops/mhc_ops.cpp).
//
// Shapes: streams x [*, m, d], branch output f [*, d], n = m² + 2m logits per token; "wide" is
// float32 for float32 and bfloat16 inputs, float64 for float64 inputs.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit::cpu {

// Pre-mix: x [*, m, d], phi [n, md], bias [n], scale [3] → h [*, d] (dtype of x),
// h_post [*, m], res_logits [*, m, m], proj [*, n] (the normalised projection (x φᵀ)/rms(x), kept
// for the backward), all three wide.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_pre_forward(const at::Tensor& x, const at::Tensor& phi,
                                                                           const at::Tensor& bias,
                                                                           const at::Tensor& scale, double eps);
// Gradients of (h, h_post, res_logits) → (x, phi, bias, scale). Undefined gradients count as zero.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_pre_backward(
    const OptTensor& grad_h, const OptTensor& grad_h_post, const OptTensor& grad_res_logits,
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& bias, const at::Tensor& scale,
    const at::Tensor& proj, double eps);

// Sinkhorn–Knopp on exp(logits − max): logits [*, m, m] → H_res [*, m, m], wide.
at::Tensor mhc_sinkhorn_forward(const at::Tensor& logits, int64_t iters);
// Gradient of H_res → logits (dtype of logits), recomputing the iterations per token.
at::Tensor mhc_sinkhorn_backward(const at::Tensor& grad, const at::Tensor& logits, int64_t iters);

// Post + res merge: x [*, m, d], f [*, d], h_post [*, m], h_res [*, m, m] → x' [*, m, d].
at::Tensor mhc_merge_forward(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post,
                             const at::Tensor& h_res);
// Gradient of x' → (x, f, h_post, h_res), each in its input's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_merge_backward(const at::Tensor& grad,
                                                                              const at::Tensor& x, const at::Tensor& f,
                                                                              const at::Tensor& h_post,
                                                                              const at::Tensor& h_res);

}  // namespace depthkit::cpu
