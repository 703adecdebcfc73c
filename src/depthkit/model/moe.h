// The sparse mixture-of-experts feed-forward branch (docs/design.md, "Mixture of experts"):
// RMSNorm → router (moe.router, an entry of the table in model/router.h; top-k, ties to the lower
// expert index) → dropless dispatch (the token copies sorted by expert, each expert's SwiGLU on
// its contiguous slice as one grouped matrix product) → the outputs scattered back weighted by the gates, plus the shared
// experts on every token. To the residual pathway it is f_ℓ like any other branch.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include "depthkit/config/config.h"
#include "depthkit/model/expert_parallel.h"
#include "depthkit/model/layers.h"
#include "depthkit/model/router.h"

namespace depthkit {

class ParameterStore;

// What one MoE forward leaves behind for the loss and the logs.
struct MoeStats {
  at::Tensor aux_loss;  // n_experts · Σ_e f_e · P_e, P_e the mean of Routing::probs (unscaled; 1.0 is uniform use), parameters' dtype
  at::Tensor z_loss;    // mean over tokens of logsumexp(router logits)² (unscaled), for every router
  at::Tensor load;      // [n_experts] float64 f_e: the share of the token–expert assignments of expert e (sums to 1)
};

struct MoeFeedForward {
  // [d], [E, d], [E, f, d] ×2, [E, d, f]; shared (absent when n_shared_experts = 0): [S·fs, d] ×2, [d, S·fs]
  at::Tensor norm, router, w_gate, w_up, w_down, shared_gate, shared_up, shared_down;
  MoeConfig moe;
  double eps;
  BackboneOps ops;  // the input norm's
  // Which experts this rank holds (all, unless moe.expert_parallel splits them): w_gate, w_up and
  // w_down then hold those experts' rows of the [E, ...] tensors named as on one rank.
  ExpertPlacement placement;
  MoeFeedForward(const ModelConfig& c, ParameterStore& params, const std::string& prefix,
                 const ExpertPlacement& placement = {});
  // [B, T, d] → [B, T, d]; `stats`, when given, receives the auxiliary terms of this call.
  at::Tensor forward(const at::Tensor& h, MoeStats* stats = nullptr) const;
  // The router named by moe.router (looked up on each call, so that the tests may set it) on
  // normalised inputs x [N, d], cast to the router weight's dtype: float32 under bfloat16 compute,
  // so that for every router the expert choice and the balancing statistics are not taken from
  // bfloat16-rounded logits.
  Routing route(const at::Tensor& x) const;
  // How the experts run: "grouped" (at::_grouped_mm) or "loop" (one at::mm per expert); "auto"
  // chooses grouped where it can run (grouped_experts_unsupported in config/config.h: float32 and
  // bfloat16 on the CPU, rows a multiple of 16 bytes), else the loop. From moe.expert_impl;
  // settable for the tests.
  std::string expert_impl = "auto";
  // Whether the forward on x takes the grouped product; "grouped" where it cannot run: an Error.
  bool uses_grouped(const at::Tensor& x) const;
  // Why the grouped product cannot run on activations of this device and dtype; "" when it can.
  static std::string grouped_unsupported(at::Device device, at::ScalarType dtype, int64_t d_model, int64_t expert_d_ff);
  // The held experts' SwiGLU on `rows` sorted by expert, counts[e] rows for held expert e.
  at::Tensor run_held_experts(const at::Tensor& rows, const at::Tensor& counts) const;
  // Parameters per routed expert (its three SwiGLU matrices).
  static int64_t expert_parameters(const ModelConfig& c) { return 3 * c.d_model * c.moe.expert_d_ff; }
};

}  // namespace depthkit
