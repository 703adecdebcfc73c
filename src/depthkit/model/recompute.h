// Activation recomputation (train.recompute; docs/training.md, "Recomputation"): a region of the
// forward pass run without keeping its activations, and run again, with gradients, when backward
// reaches it. Megatron's and PyTorch's checkpointing do the same; depthkit's has no Python, so it
// is an autograd function of its own.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace depthkit {

// A region: activations in, activations out. It may read parameters (leaf tensors) besides its
// inputs; it must compute the same values each time it runs (no randomness, no state it changes).
using Region = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// What must happen around each run of a region (ZeRO-3: its parameters gathered before, freed
// after). `before` runs before the region (in forward; in backward, before it runs again) and
// `after` once it is done with its parameters (in forward, after the region; in backward, after
// its gradients are computed). `backward` says which pass it is. Either may be empty.
struct RegionHooks {
  std::function<void(bool backward)> before, after;
};

// Runs `region` on `inputs` keeping only the inputs for backward. Backward runs it again on the
// inputs, with gradients, and passes on the gradients of the inputs and of `parameters` (every
// parameter the region reads): the same operations on the same values, so the gradients are
// bit-identical to the region's own backward. Outputs that do not depend on anything that
// requires a gradient are returned as they are. Without gradient mode, the region simply runs
// (between the hooks).
std::vector<at::Tensor> run_recomputed(const Region& region, const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& parameters, const RegionHooks& hooks = {});

}  // namespace depthkit
