// Expert parallelism (moe.expert_parallel = P; docs/design.md, "Expert parallelism"): the routed
// experts of every MoE layer split over the P ranks of an expert-parallel group, a contiguous
// range each; every rank routes its own tokens, sends each token copy to the rank holding its
// expert (all-to-all), runs its experts on what arrives, and sends the outputs back (all-to-all
// again), where they are weighted by their gates and added to their tokens as on one rank.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace depthkit {

class Group;

// Which experts this rank holds: [first, first + count) of n_experts, and the group of the P
// ranks that hold them all, in expert order. The default (no group) holds every expert.
struct ExpertPlacement {
  int64_t first = 0, count = -1;  // count −1: every expert
  Group* group = nullptr;
  bool split() const { return count >= 0; }
};

// Runs `experts` (rows sorted by local expert, rows per local expert → outputs, one row each) on
// the token copies `rows` [n, d], sorted by global expert with `counts` [n_experts] of them per
// expert, wherever their experts are: returns each copy's output, in the order of `rows`.
// Differentiable: the all-to-alls' backward is the all-to-all the other way.
using LocalExperts = std::function<at::Tensor(const at::Tensor& rows, const at::Tensor& counts)>;
at::Tensor run_experts_across_ranks(const at::Tensor& rows, const at::Tensor& counts, const ExpertPlacement& placement,
                                    const LocalExperts& experts);

}  // namespace depthkit
