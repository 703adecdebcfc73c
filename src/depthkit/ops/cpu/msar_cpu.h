// CPU kernels of the fused MSAR read and merge-fuse (declared here, registered in ops/msar_ops.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <tuple>
#include <vector>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit::cpu {

// kernel_lengths (optional, m − 1 entries in 1 … K): each convolved stream's kernel length; the
// taps after it are padding, neither read nor given a gradient (zero). Absent: all K taps.
//
// queries [m, d], sources: N raw single-stream [B, T, d], conv: their N banks [m−1, d, K]
//   →  out [m, B, T, d], log_partition ζ [m, B, T] (float32; float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> msar_read_forward(const at::Tensor& queries, at::TensorList sources,
                                                     at::TensorList conv, double eps,
                                                     c10::OptionalIntArrayRef kernel_lengths);
// Gradients of (out, ζ) → (queries, one per bank), and the sources' added into grad_sources: one
// buffer per source, [B, T, d] in the accumulation dtype (ops/shared_source.h). Either incoming
// gradient may be undefined (zero).
std::tuple<at::Tensor, std::vector<at::Tensor>> msar_read_backward(
    const OptTensor& grad_out, const OptTensor& grad_lse, const at::Tensor& queries, at::TensorList sources,
    at::TensorList conv, const at::Tensor& lse, double eps, c10::OptionalIntArrayRef kernel_lengths,
    at::TensorList grad_sources);

// out [m, B, T, d], ζ [m, B, T], queries [m, d]; optional (undefined = absent): partial [B, T, d]
// with partial_conv [m−1, d, K'] (both or neither), w_pre [m, m·d] with b_pre [m] and
// alpha_pre [1] (all three, or none: mean fusion)  →  h [B, T, d].
at::Tensor msar_fuse_forward(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& queries,
                             const OptTensor& partial, const OptTensor& partial_conv,
                             const OptTensor& w_pre, const OptTensor& b_pre, const OptTensor& alpha_pre,
                             double eps, c10::OptionalIntArrayRef kernel_lengths);
// Gradients of h → (out, ζ, queries, partial, partial_conv, w_pre, b_pre, alpha_pre); undefined for
// absent inputs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
msar_fuse_backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& queries,
                   const OptTensor& partial, const OptTensor& partial_conv, const OptTensor& w_pre,
                   const OptTensor& b_pre, const OptTensor& alpha_pre, double eps,
                   c10::OptionalIntArrayRef kernel_lengths);

}  // namespace depthkit::cpu
