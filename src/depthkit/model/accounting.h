// Cost accounting (`depthkit cost`): training FLOPs per token of the backbone and of the residual
// pathway, and the pathway's leading-order memory traffic per token per branch.
//
// FLOPs follow MSAR Appendix C: a multiply–add is 2 FLOPs and training is 3× the forward cost
// (no recomputation, no optimizer). The backbone counts the attention and feed-forward
// projections, causal attention over the average context (T + 1)/2, and the LM head; norms,
// RoPE and softmax are left out, as is usual. The pathway counts every operation its forward
// does per token (key norms, scores, value sums, merges, gates, convolutions, Sinkhorn), with
// the constants written next to each term in the kind's registry entry (pathways/registry.h, in
// the pathway's own .cpp file). The overhead is MSAR Table 5's
// ΔF / F_Vanilla: (pathway − the standard residual's adds) ÷ (backbone + those adds).
//
// Memory traffic follows MSAR Table 6 (forward pass, leading terms in units of d, parameter
// traffic and the branches' internal I/O excluded, phase-1 costs amortised over the S targets
// of a block, N = completed blocks): residual 3d, mHC (8m + 2)d, Block AttnRes (N/S + 5)d,
// Block MSAR (N/S + 4m + 5)d. DAR, AttnRes + SepV and AttnRes + mHC are not in the table; their
// rows are depthkit's count under the same conventions (docs/analysis.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/pathways/registry.h"  // TrafficTerm; each kind's cost terms live beside its code

namespace depthkit {

struct CostReport {
  std::string kind;
  int64_t d = 0, branches = 0, blocks = 0, block_sublayers = 0, streams = 0;
  // Training FLOPs per token (3× forward).
  double backbone_flops = 0;  // projections, causal attention, LM head
  double lm_head_flops = 0;   // the LM head's share of backbone_flops
  double pathway_flops = 0;   // this kind's pathway (for `residual`: its adds)
  double overhead_percent = 0;
  std::vector<TrafficTerm> traffic;
  double traffic_d() const;   // total read + write, in units of d
  // The pathway's memory traffic in one training step of `tokens` tokens, activations of
  // `element_bytes` bytes: traffic_d() · d bytes per token per branch, over every branch and token,
  // twice. The forward's terms alone are counted above (Table 6); the backward moves at least as
  // much, since each tensor the forward reads gets a gradient written and each it writes a
  // gradient read. A lower bound, then: no re-reads of saved inputs, no recomputation.
  double training_traffic_bytes(int64_t tokens, int64_t element_bytes) const;
};

CostReport training_cost(const ModelConfig& model, const ResidualConfig& residual);

}  // namespace depthkit
