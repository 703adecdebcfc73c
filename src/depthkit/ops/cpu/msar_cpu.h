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
// context (0 … T − 1): the sources' first positions that are only the windows of the later ones
// (a decoding step's convolution tail, msar_ops.h); out and ζ cover the T − context after them.
//
// queries: S tensors [m, d], the reads of S branches of one block, which read the same sources
// (MSAR §3.4: phase 1 batches all targets of a block); sources: N raw single-stream [B, T, d],
// conv: their N banks [m−1, d, K]  →  per query out [m, B, T − context, d] and log_partition ζ
// [m, B, T − context] (float32; float64 for float64 inputs). Each expansion is computed once and
// read by every query.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_read_forward(at::TensorList queries,
                                                                               at::TensorList sources,
                                                                               at::TensorList conv, double eps,
                                                                               c10::OptionalIntArrayRef kernel_lengths,
                                                                               int64_t context);
// Gradients of every query's (out, ζ) → (the queries', stacked [S, m, d]; one per bank), and the sources' added into
// grad_sources: one buffer per source, [B, T, d] in the accumulation dtype (ops/shared_source.h).
// Any incoming gradient may be undefined (zero). No context: the autograd kernel pads a context's
// positions (msar_ops.cpp).
std::tuple<at::Tensor, std::vector<at::Tensor>> msar_read_backward(
    const std::vector<at::Tensor>& grad_out, const std::vector<at::Tensor>& grad_lse, at::TensorList queries,
    at::TensorList sources, at::TensorList conv, at::TensorList lse, double eps,
    c10::OptionalIntArrayRef kernel_lengths, at::TensorList grad_sources);

// out [m, B, T, d], ζ [m, B, T], queries [m, d]; optional (undefined = absent): partial
// [B, context + T, d] with partial_conv [m−1, d, K'] (both or neither), w_pre [m, m·d] with
// b_pre [m] and alpha_pre [1] (all three, or none: mean fusion)  →  h [B, T, d]. context (0
// without a partial): the partial's first positions that are only its expansion's window.
at::Tensor msar_fuse_forward(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& queries,
                             const OptTensor& partial, const OptTensor& partial_conv,
                             const OptTensor& w_pre, const OptTensor& b_pre, const OptTensor& alpha_pre,
                             double eps, c10::OptionalIntArrayRef kernel_lengths, int64_t context);
// Gradients of h → (out, ζ, queries, partial, partial_conv, w_pre, b_pre, alpha_pre); undefined for
// absent inputs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
msar_fuse_backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& queries,
                   const OptTensor& partial, const OptTensor& partial_conv, const OptTensor& w_pre,
                   const OptTensor& b_pre, const OptTensor& alpha_pre, double eps,
                   c10::OptionalIntArrayRef kernel_lengths);

}  // namespace depthkit::cpu
