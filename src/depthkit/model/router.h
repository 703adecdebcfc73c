// The MoE router table (docs/design.md, "Mixture of experts"): one entry per moe.router name, with
// its route function and its cost terms. The MoE layer (model/moe.h) dispatches through it, config
// loading takes the names from it (model/config_check.h), and the accounting asks it for the
// router's FLOPs (model/accounting.h). A new router adds its entry to moe_routers() (router.cpp),
// its reference to tests/test_moe.cpp (a test fails until it does) and its equations to the docs.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

// What a router decides for N tokens over E experts.
struct Routing {
  at::Tensor logits;   // [N, E] W_r x, in the router weight's dtype (float32 under bfloat16 compute)
  at::Tensor scores;   // [N, E] the per-expert scores the gates are taken from (the router's own)
  at::Tensor probs;    // [N, E] each token's distribution over the experts (rows sum to 1): its mean
                       // over tokens is P_e of the balance loss (MoeStats::aux_loss)
  at::Tensor experts;  // [N, k] int64, in decreasing logit order, ties to the lower expert index
  at::Tensor gates;    // [N, k] the selected scores, divided by their sum when moe.renormalize
};

struct MoeRouter {
  std::string name;  // moe.router
  // The routing of normalised inputs x [N, d], already in the router weight's dtype (the layer
  // casts them: model/moe.h), by the router weight W_r [E, d], with moe.top_k and moe.renormalize.
  std::function<Routing(const at::Tensor& x, const at::Tensor& weight, const MoeConfig& moe)> route;
  // Forward FLOPs per token of the router in one MoE layer (model/accounting.h: a multiply–add is
  // 2, training is 3× this; elementwise work such as a softmax is left out there, as here).
  std::function<double(int64_t d_model, const MoeConfig& moe)> flops;
};

// Every router, in a fixed order (router.cpp); the first is moe.router's default.
const std::vector<MoeRouter>& moe_routers();
std::vector<std::string> moe_router_names();
// The entry of `name`; nullptr if there is none.
const MoeRouter* find_moe_router(const std::string& name);
// The entry of `name`; fails with a one-line error naming the key 'moe.router' if there is none.
const MoeRouter& moe_router(const std::string& name);

}  // namespace depthkit
