// AdamW (decoupled weight decay, Loshchilov & Hutter) over a ParameterStore, with float32 state,
// written out so its state is plain named tensors for the safetensors checkpoint. Matches
// torch.optim.AdamW step for step.
//
// ZeRO stage 1 (Rajbhandari et al.; docs/training.md): the parameters laid end to end in
// registration order are cut into one contiguous range of elements per rank; each rank keeps the
// AdamW moments of its range only and updates those elements, then the ranks all-gather the
// updated parameters. AdamW is elementwise, so the sharded update equals the unsharded one
// exactly. One rank holds the whole range.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The elements [begin, end) of the concatenated parameters that rank `rank` of `ranks` owns:
// about ⌈total / ranks⌉ each, each boundary moved back to a multiple of 64 elements from the start
// of the parameter it falls in, so that every element is updated by the same code path as
// unsharded (ATen's elementwise kernels round a vectorised body and a scalar tail differently).
// Flat shard tensors are `chunk` (the largest share) long on every rank, zero past the share,
// so that ranks all-gather equal lengths.
struct ParameterShard {
  int64_t begin = 0, end = 0, chunk = 0;
  std::vector<int64_t> bounds;  // rank r owns [bounds[r], bounds[r + 1])
  static ParameterShard of(const std::vector<int64_t>& parameter_sizes, int64_t rank, int64_t ranks);
  // Every rank's flat shard laid end to end ([ranks · chunk], as all-gathered) → the [total]
  // elements in order.
  at::Tensor unpad(const at::Tensor& gathered) const;
};

class AdamW {
 public:
  // The shards of these parameters (their sizes in registration order).
  static std::vector<int64_t> sizes(const ParameterStore& params);
  // State and updates for the elements of `shard` (default: every element).
  AdamW(ParameterStore& params, const OptimConfig& cfg, std::optional<ParameterShard> shard = std::nullopt);
  void step(double lr);
  int64_t steps() const { return step_; }
  const ParameterShard& shard() const { return shard_; }
  int64_t total_elements() const { return total_; }
  // The bytes of the moments this rank keeps.
  int64_t state_bytes() const;

  // The shard's elements of the parameters, flat [chunk]; and every element from [total] values
  // (the all-gathered shards, unpadded): the parameters after the ZeRO-1 all-gather.
  at::Tensor shard_of_parameters() const;
  void set_parameters(const at::Tensor& all) const;
  // The shard's moments, flat [chunk] each.
  const at::Tensor& exp_avg() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const { return exp_avg_sq_; }

  // "exp_avg.<param>", "exp_avg_sq.<param>" and "step", for the checkpoint. Needs the moments of
  // every element: this optimizer's own (one rank), or every rank's, all-gathered and unpadded.
  NamedTensors state() const;
  NamedTensors state(const at::Tensor& exp_avg_all, const at::Tensor& exp_avg_sq_all) const;
  // Takes the shard's elements from a checkpoint's full state.
  void load_state(const std::map<std::string, at::Tensor>& tensors, const std::string& source);

 private:
  // A parameter's part of the shard: elements [offset, offset + length) of parameter `param`, at
  // `flat` in the shard.
  struct Slice {
    size_t param;
    int64_t offset, length, flat;
  };
  void fused_step(double lr);  // optim.impl = "fused"
  ParameterStore& params_;
  OptimConfig cfg_;
  ParameterShard shard_;
  int64_t total_ = 0;
  int64_t step_ = 0;
  std::vector<Slice> slices_;
  at::Tensor exp_avg_, exp_avg_sq_;
};

// Scales gradients so their global L2 norm is at most max_norm (max_norm 0: no clipping).
// Returns the norm before clipping.
double clip_grad_norm(ParameterStore& params, double max_norm);

}  // namespace depthkit
