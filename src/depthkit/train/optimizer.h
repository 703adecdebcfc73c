// AdamW (decoupled weight decay, Loshchilov & Hutter) over a ParameterStore, with float32 state,
// written out so its state is plain named tensors for the safetensors checkpoint. Matches
// torch.optim.AdamW step for step.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

class AdamW {
 public:
  AdamW(ParameterStore& params, const OptimConfig& cfg);
  void step(double lr);
  int64_t steps() const { return step_; }
  // "exp_avg.<param>", "exp_avg_sq.<param>" and "step".
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::map<std::string, at::Tensor>& tensors, const std::string& source);

 private:
  ParameterStore& params_;
  OptimConfig cfg_;
  int64_t step_ = 0;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
};

// Scales gradients so their global L2 norm is at most max_norm (max_norm 0: no clipping).
// Returns the norm before clipping.
double clip_grad_norm(ParameterStore& params, double max_norm);

}  // namespace depthkit
