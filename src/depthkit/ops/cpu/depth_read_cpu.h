// CPU kernels of the fused depth read and merge (declared here, registered in ops/schema.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit::cpu {

// queries [M, d]; keys and values: lists of N sources [P, d] (values empty: they are the keys).
std::tuple<at::Tensor, at::Tensor> depth_read_forward(const at::Tensor& queries, at::TensorList keys,
                                                      at::TensorList values, double eps);
// Gradients of (out, ζ): returns the queries'; adds each key's into grad_keys and each value's
// into grad_values (none when the values are the keys, whose buffers then take both), [P, d] in
// the accumulation dtype (ops/shared_source.h). grad_out and grad_lse may be undefined (zero).
at::Tensor depth_read_backward(const OptTensor& grad_out, const OptTensor& grad_lse, const at::Tensor& queries,
                               at::TensorList keys, at::TensorList values, const at::Tensor& lse, double eps,
                               at::TensorList grad_keys, at::TensorList grad_values);

at::Tensor depth_merge_forward(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& query,
                               const at::Tensor& key_part, const OptTensor& value_part, double eps);
// Gradients of h → (out, ζ, query, key_part, value_part).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_merge_backward(
    const at::Tensor& grad, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& query,
    const at::Tensor& key_part, const OptTensor& value_part, double eps);

// How many threads an at::parallel_for over n items runs on inside the kernel files: the check that
// they are compiled with OpenMP, without which at::parallel_for runs every range on one thread.
int kernel_threads(int64_t n);

}  // namespace depthkit::cpu
