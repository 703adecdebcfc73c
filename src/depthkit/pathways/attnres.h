// Attention Residuals (DAR eq. 2–5; MSAR §3.1, §3.3), Full (block_sublayers S = 1) and Block.
//
// Sources: the token embedding (source 0), then one entry per completed block: with S = 1 each
// branch output (Full AttnRes, eq. 4), with S > 1 the sum of the block's branch outputs. Branch ℓ,
// the i-th of its block, reads the completed sources by depth attention with its own pseudo-query
// q_ℓ (keys = values = sources); for i > 1 the block's partial sum is one more candidate, the last
// of the same read: the sources are a list, so adding it copies nothing. (The two-phase form,
// which merges it into a read shared by the block by online softmax, depth_merge, computes the
// same.) The last block may be shorter. The final hidden state is read from all completed sources
// by a learned output query.
//
// Parameters: one query [d] per branch that has more than one candidate (every branch but the
// first, which can only see the embedding) and the output query: L_b · d. All start at zero
// (uniform retrieval).
//
// AttnRes + SepV (kind attnres_sepv, DAR eq. 21): source r's value is W_{v,r} v_r with its own
// d × d map (keys stay Norm_h(v_r)); the block partial uses the map of the source it becomes.
// 1 + ⌈L_b / S⌉ maps, initialised to the identity so the model starts as AttnRes.
#pragma once
#include <vector>

#include "depthkit/ops/kernel_choice.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class AttnRes final : public ResidualPathway {
 public:
  // prefix: parameter names (residual.query.ℓ, residual.out_query); the hybrid passes its own.
  AttnRes(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params,
          const std::string& prefix = "residual");
  std::string kind() const override { return value_maps_.empty() ? "attnres" : "attnres_sepv"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  int64_t sources_after(int64_t branch) const override { return schedule_.sources_after(branch); }
  std::map<std::string, bool> operators() const override { return ops_.all(); }

 private:
  BlockSchedule schedule_;
  std::vector<at::Tensor> query_;  // [L_b + 1]; query_[ℓ] for ℓ ≥ 2, query_[0], query_[1] unused
  at::Tensor out_query_;
  std::vector<at::Tensor> value_maps_;  // attnres_sepv: [d, d] per source index; empty otherwise
  OperatorChoice ops_;                  // depth_read: fused or reference
  at::Tensor value(size_t r, const at::Tensor& source) const;  // the value of source index r
  // One read of the sources [B·T, d] (values: none, the keys themselves; or one per key) → [B, T, d].
  at::Tensor read_sources(const at::Tensor& query, at::TensorList keys, at::TensorList values, int64_t B,
                          int64_t T) const;
};

}  // namespace depthkit
