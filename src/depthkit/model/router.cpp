#include "depthkit/model/router.h"

#include <ATen/TensorOperators.h>

#include <ATen/ops/gather.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>

#include "depthkit/util/error.h"
#include "depthkit/util/named.h"

namespace depthkit {

namespace {

// The k experts of largest logit, by a stable descending sort: equal logits keep their index
// order, so a tie goes to the lower expert index, on every device and thread count.
at::Tensor top_k_by_logits(const at::Tensor& logits, int64_t k) {
  auto sorted = std::get<1>(at::sort(logits.detach(), /*stable=*/std::optional<bool>(true), /*dim=*/-1, /*descending=*/true));
  return sorted.narrow(-1, 0, k).contiguous();
}

// The gates: the selected scores, divided by their sum when moe.renormalize.
at::Tensor gates_of(const at::Tensor& scores, const at::Tensor& experts, const MoeConfig& moe) {
  auto g = scores.gather(-1, experts);
  return moe.renormalize ? g / g.sum(-1, /*keepdim=*/true) : g;
}

// Both routers cost the product W_r x, one multiply–add per weight; their softmax or sigmoid, the
// top-k and the normalisation are elementwise, left out as the accounting leaves out the softmax.
double router_product_flops(int64_t d_model, const MoeConfig& moe) { return 2 * double(d_model) * double(moe.n_experts); }

// Switch / GShard / DeepSeekMoE: p = softmax(W_r x) over all E experts, the k largest, gates p_e
// (renormalised: Mixtral's form). The balance loss's P_e is the mean of p_e (Switch eq. 4-6).
MoeRouter softmax_topk() {
  return {"softmax_topk",
          [](const at::Tensor& x, const at::Tensor& weight, const MoeConfig& moe) {
            Routing r;
            r.logits = at::linear(x, weight);
            r.probs = at::softmax(r.logits, -1);
            r.scores = r.probs;
            r.experts = top_k_by_logits(r.logits, moe.top_k);
            r.gates = gates_of(r.scores, r.experts, moe);
            return r;
          },
          router_product_flops};
}

// DeepSeek-V3 (arXiv:2412.19437, §2.1.2, eqs. 13-15): each expert's affinity s_e = σ(W_r x)_e on
// its own (no competition between experts), the k largest, gates the selected s_e divided by
// their sum (moe.renormalize; DeepSeek-V3 normalises). σ is strictly increasing, so the top-k of s
// are the top-k of the logits: they are ranked by the logits, which keep their order where s
// rounds to equal values (in float32, σ(l) rounds to 1 for l above about 17), and equal logits go
// to the lower index as in softmax_topk. Left out: DeepSeek-V3's per-expert bias added to s for the
// selection only (its auxiliary-loss-free balancing, eq. 16), its node-limited routing and its
// routed scaling factor.
// The balance loss: s is not a distribution, so P_e is the mean over tokens of the normalised
// s'_e = s_e / Σ_j s_j, as DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20)
// defines it; with f_e the share of assignments, E · Σ_e f_e P_e is that loss's Σ_i f_i P_i taken
// over the micro-batch's tokens rather than per sequence, and is 1 at uniform use as for softmax.
MoeRouter sigmoid_topk() {
  return {"sigmoid_topk",
          [](const at::Tensor& x, const at::Tensor& weight, const MoeConfig& moe) {
            Routing r;
            r.logits = at::linear(x, weight);
            r.scores = at::sigmoid(r.logits);
            r.probs = r.scores / r.scores.sum(-1, /*keepdim=*/true);
            r.experts = top_k_by_logits(r.logits, moe.top_k);
            r.gates = gates_of(r.scores, r.experts, moe);
            return r;
          },
          router_product_flops};
}

}  // namespace

const std::vector<MoeRouter>& moe_routers() {
  // The one list of routers: a new router adds its entry here (the first is the default).
  static const std::vector<MoeRouter> routers = {softmax_topk(), sigmoid_topk()};
  return routers;
}

std::vector<std::string> moe_router_names() { return names_of(moe_routers()); }

const MoeRouter* find_moe_router(const std::string& name) { return find_named(moe_routers(), name); }

const MoeRouter& moe_router(const std::string& name) {
  if (const MoeRouter* r = find_moe_router(name)) return *r;
  std::string names;
  for (const MoeRouter& r : moe_routers()) names += (names.empty() ? "\"" : ", \"") + r.name + "\"";
  fail("key 'moe.router' must be one of ", names, ", got \"", printable(name), "\"");
}

}  // namespace depthkit
