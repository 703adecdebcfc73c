// CPU kernels of DAR's fused residual read and gated write (declared here, registered in
// ops/dar_ops.cpp; the math is in dar_cpu.cpp's header comment).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <vector>
#include <tuple>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit::cpu {

// Which stream gives the key and which the value of output stream j (DAR eq. 10, 22).
struct DarRouting {
  std::array<int64_t, 2> key, value;
};

// queries [2, d]; h0, h1 completed streams, N entries [P, d] each; p0, p1 [P, d] or undefined (block start);
// w_alpha, w_beta [2, 2d]; b_alpha, b_beta [2]  →  h [P, d], β [P, 2], ζ [2, P].
std::tuple<at::Tensor, at::Tensor, at::Tensor> dar_read_forward(
    const at::Tensor& queries, at::TensorList h0, at::TensorList h1, const OptTensor& p0,
    const OptTensor& p1, const at::Tensor& w_alpha, const at::Tensor& b_alpha, const at::Tensor& w_beta,
    const at::Tensor& b_beta, at::IntArrayRef key_stream, at::IntArrayRef value_stream, double eps);

// Gradients of (h, β) → [queries, p0, p1, w_alpha, b_alpha, w_beta, b_beta] (p0, p1's undefined
// when p0, p1 are), and those of the entries of h0 and h1 added into grad_h0 and grad_h1: one
// buffer per entry, [P, d] in the accumulation dtype (ops/shared_source.h). Either incoming
// gradient may be undefined (zero).
std::vector<at::Tensor> dar_read_backward(const OptTensor& grad_h, const OptTensor& grad_beta,
                                          const at::Tensor& queries, at::TensorList h0, at::TensorList h1,
                                          const OptTensor& p0, const OptTensor& p1, const at::Tensor& w_alpha,
                                          const at::Tensor& b_alpha, const at::Tensor& w_beta,
                                          const at::Tensor& b_beta, const at::Tensor& lse, at::IntArrayRef key_stream,
                                          at::IntArrayRef value_stream, double eps, at::TensorList grad_h0,
                                          at::TensorList grad_h1);

// f [P, d], β [P, 2]; p0, p1 [P, d] and w_rho [1, 2d], b_rho [1], or all undefined (first branch
// of a block)  →  the new partial (P⁰, P¹), [P, d] each.
std::tuple<at::Tensor, at::Tensor> dar_write_forward(const at::Tensor& f, const at::Tensor& beta,
                                                     const OptTensor& p0, const OptTensor& p1,
                                                     const OptTensor& w_rho, const OptTensor& b_rho,
                                                     double eps);

// Gradients of (P⁰, P¹) → (f, β, p0, p1, w_rho, b_rho); the last four undefined at block start.
std::vector<at::Tensor> dar_write_backward(const OptTensor& grad0, const OptTensor& grad1, const at::Tensor& f,
                                           const at::Tensor& beta, const OptTensor& p0, const OptTensor& p1,
                                           const OptTensor& w_rho, const OptTensor& b_rho, double eps);

}  // namespace depthkit::cpu
