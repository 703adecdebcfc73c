// Fused depth-retrieval operators, registered as torch operators (namespace `depthkit`, see
// ops/schema.cpp) with CPU kernels (ops/cpu/) and an Autograd kernel whose backward is written by
// hand. The same ops serve C++ (these functions) and Python (torch.ops.depthkit.*). They equal the
// reference compositions reference::depth_read and reference::depth_merge
// (ops/reference/reference.h), which the tests hold them to. Absent optional inputs are undefined
// tensors here and in every fused:: function.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace depthkit::fused {

// Completed-history read, all targets of a block at once (DAR eq. A.1–A.5):
//   queries [M, d], keys: N sources [P, d] (raw: normalised on the fly, once per source and token
//   for all M targets), values: N sources [P, d] or none (= the keys)
//   →  out [M, P, d], log_partition ζ [M, P].
// The sources are a list, not a stack (schema.cpp): a block's partial sum may simply be the last.
std::tuple<at::Tensor, at::Tensor> depth_read(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                                              double eps);

// Online-softmax merge of a completed read with the block's partial candidate (eq. A.6–A.10):
//   out [P, d], ζ [P], query [d], key_part [P, d] (raw), value_part [P, d] or undefined (= the key)
//   →  h [P, d].
at::Tensor depth_merge(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& query,
                       const at::Tensor& key_part, const at::Tensor& value_part, double eps);

}  // namespace depthkit::fused
