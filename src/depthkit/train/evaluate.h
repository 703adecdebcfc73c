// Held-out evaluation: mean next-token cross-entropy over fixed validation windows.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace depthkit {

class Transformer;

// Token-weighted mean loss over the batches (int64 [b, T+1] each), without gradients.
double evaluate(Transformer& model, const std::vector<at::Tensor>& batches);

}  // namespace depthkit
