#include "depthkit/model/accounting.h"

#include "depthkit/model/router.h"
#include "depthkit/pathways/registry.h"

namespace depthkit {

double CostReport::traffic_d() const {
  double t = 0;
  for (const TrafficTerm& term : traffic) t += term.read + term.write;
  return t;
}

double CostReport::training_traffic_bytes(int64_t tokens, int64_t element_bytes) const {
  return 2 * traffic_d() * double(d) * double(element_bytes) * double(branches) * double(tokens);
}

CostReport training_cost(const ModelConfig& model, const ResidualConfig& residual) {
  CostReport c;
  c.kind = residual.kind;
  c.d = model.d_model;
  c.branches = model.n_branches();
  const PathwayKind& kind = pathway_kind(residual.kind);  // its cost terms (pathways/registry.h)
  c.block_sublayers = kind.blocks ? residual.block_sublayers : 1;
  const BlockSchedule schedule{c.block_sublayers, c.branches, false};
  c.blocks = schedule.blocks();
  c.streams = kind.streams > 0 ? kind.streams : residual.streams;
  const CostShape s{double(c.d), double(c.branches), double(c.block_sublayers), double(c.blocks), double(c.streams),
                    schedule};

  // Backbone, forward, per token.
  const double d = double(c.d), hd = double(model.resolved_head_dim());
  const double H = double(model.n_heads), KV = double(model.n_kv_heads), T = double(model.seq_len);
  const double projections = 2 * d * H * hd + 2 * 2 * d * KV * hd + 2 * H * hd * d;  // Q; K, V; O
  const double attention = 2 * 2 * H * hd * (T + 1) / 2;                             // QKᵀ and A·V, causal
  const double ffn = 2 * 3 * d * double(model.d_ff);                                  // SwiGLU
  double ffn_layers = double(model.n_layers) * ffn;
  if (const MoeConfig& e = model.moe; e.enabled()) {
    // An MoE layer per token: the router (its cost terms in the router table, model/router.h; the
    // product W_r x for the routers there), the SwiGLUs of the k experts the token reaches and of
    // the shared experts, and the gate-weighted sum of the k outputs.
    const double moe_ffn = moe_router(e.router).flops(model.d_model, e) +
                           2 * 3 * d * double(e.top_k * e.expert_d_ff + e.n_shared_experts * e.resolved_shared_d_ff()) +
                           2 * double(e.top_k) * d;
    ffn_layers = double(e.leading_dense_layers) * ffn + double(model.n_layers - e.leading_dense_layers) * moe_ffn;
  }
  const double head = 2 * d * double(model.vocab_size);
  c.backbone_flops = 3 * (double(model.n_layers) * (projections + attention) + ffn_layers + head);
  c.lm_head_flops = 3 * head;

  const double residual_adds = s.L * d;  // the standard residual's h + f(h)
  const double f = kind.flops(s, residual);
  c.pathway_flops = 3 * f;
  c.overhead_percent = 100 * (f - residual_adds) / (c.backbone_flops / 3 + residual_adds);
  // Memory traffic per token per branch, in units of d (MSAR Table 6 and its conventions).
  c.traffic = kind.traffic(s);
  return c;
}

}  // namespace depthkit
