// Mixed precision (docs/design.md, "Precision"): parameters keep their own dtype (float32 in
// training) and every use casts them to the dtype of the activation they meet, so that with
// train.dtype = "bfloat16" the matrix products, attention and branch activations run in bfloat16
// while autograd brings float32 gradients back to the float32 parameters through the cast. When
// the dtypes are equal (float32 or float64 models) the cast returns the parameter itself: no copy,
// no autograd node, bit-identical results.
#pragma once
#include <ATen/core/Tensor.h>

namespace depthkit {

// `weight` in the dtype of `activation` (undefined stays undefined: absent optional inputs). The
// same tensor, without an operator call, when the dtypes already agree (`to` would return it too):
// the pathways cast their parameters at every read, many times per decoded position.
inline at::Tensor cast_like(const at::Tensor& weight, const at::Tensor& activation) {
  if (!weight.defined() || weight.scalar_type() == activation.scalar_type()) return weight;
  return weight.to(activation.scalar_type());
}

}  // namespace depthkit
