// Dual Attention Residuals (DAR paper eq. 6–18, routing variants eq. 22).
//
// History entries are two streams, H_r = [H_r⁰, H_r¹], starting with H_0 = [e, e] (eq. 6). Branch
// ℓ, the i-th of its block, reads the candidates C_ℓ = H_b (i = 1) or (H_b, P^{i−1}) (i > 1)
// (eq. 9) once per stream j with its own query q_ℓʲ: by default the key is the opposite stream,
// normalised, and the value is stream j itself (eq. 10–12). The two reads give
//   h̄ = Norm([h⁰; h¹]),  α = σ(h̄ W_α + b_α),  β = 2σ(h̄ W_β + b_β)        (eq. 13–14)
//   h_ℓ = α⁰ h⁰ + α¹ h¹                                                     (eq. 15)
// and the branch output is written to the block's partial state
//   P^i = β ⊗ f(h_ℓ)                    (i = 1)
//   P^i = M(ρ) P^{i−1} + β ⊗ f(h_ℓ)     (i > 1), ρ = σ(Norm([P⁰; P¹]) W_ρ + b_ρ),
//   M(ρ) = [[ρ, 1−ρ], [1−ρ, ρ]]                                             (eq. 16–17)
// appended as H_b = P^S at the block boundary (eq. 18; the last block may be shorter). Two output
// queries read the completed history the same way; h_out = h⁰_out + h¹_out.
//
// Initialisation (docs/design.md, "DAR"): queries 0 (uniform retrieval); W_α, W_β normal(0, 0.2/√(2d)), so
// their logits have standard deviation 0.2 at any width: small and random, to break the swap
// symmetry of the two streams (swapping them is otherwise a symmetry of the model and its gradients); W_ρ 0; b_α = b_β = 0 so that
// α ≈ (½, ½) and β ≈ (1, 1); b_ρ = 4 so that ρ ≈ 0.98 (transport near identity). DAR then starts
// close to AttnRes-Block.
#pragma once
#include <vector>

#include "depthkit/ops/kernel_choice.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class Dar final : public ResidualPathway {
 public:
  Dar(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params);
  std::string kind() const override { return "dar"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  int64_t sources_after(int64_t branch) const override { return schedule_.sources_after(branch); }
  std::vector<at::Tensor> stream_states(PathwayState& state) override;  // [P⁰, P¹] or newest [H⁰, H¹]
  void set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) override;
  std::map<std::string, bool> operators() const override { return ops_.all(); }

  static constexpr double kRhoBias = 4.0;
  static constexpr double kGateLogitStd = 0.2;

 private:
  struct Branch {
    at::Tensor q0, q1;                  // [d] per-stream queries
    at::Tensor w_alpha, b_alpha;        // [2, 2d], [2]
    at::Tensor w_beta, b_beta;          // [2, 2d], [2]
    at::Tensor w_rho, b_rho;            // [1, 2d], [1]; only for branches after the first of a block
  };
  // Reports both streams' retrieval weights of read ℓ (L_b + 1: the readout) to the observer.
  void observe_read(PathwayState& state, int64_t l, const at::Tensor& q0, const at::Tensor& q1) const;

  BlockSchedule schedule_;
  std::string routing_;
  OperatorChoice ops_;  // dar_read, dar_write, depth_read: fused (ops/dar_ops.h) or reference
  std::vector<Branch> branch_;  // [L_b + 1], index ℓ
  at::Tensor out_q0_, out_q1_;
};

}  // namespace depthkit
