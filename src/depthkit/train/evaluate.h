// Held-out evaluation: mean next-token cross-entropy over fixed validation windows.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace depthkit {

class Transformer;

// The summed token losses and the token count of batches rank, rank + ranks, rank + 2·ranks, …
// (one rank's share of an evaluation split across ranks), without gradients. Batches are int64
// [b, T+1], moved to the model's device.
struct LossSum {
  double loss = 0;
  int64_t tokens = 0;
};
LossSum evaluate_share(Transformer& model, const std::vector<at::Tensor>& batches, int64_t rank, int64_t ranks);

// Token-weighted mean loss over all the batches.
double evaluate(Transformer& model, const std::vector<at::Tensor>& batches);

}  // namespace depthkit
