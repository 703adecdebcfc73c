// Manifold-constrained Hyper-Connections, mHC (MSAR eq. 3–5; Xie et al.; docs/design.md, "mHC",
// settles the parameterisation, which DeepSeek's reference code and Megatron share).
//
// The state is m streams X = (x_1 … x_m), all starting as the embedding. For branch ℓ, from the
// flattened state x = [x_1; …; x_m] ∈ R^{md}:
//   logits = α ⊙ (x φ_ℓ) / rms(x) + b_ℓ,       φ_ℓ ∈ R^{md × (m² + 2m)}, α = (α_pre, α_post, α_res)
//   H_pre = σ(logits_pre) ∈ R^m,  H_post = 2σ(logits_post) ∈ R^m,
//   H_res = Sinkhorn–Knopp(exp(logits_res)) ∈ R^{m×m}   (rows then columns, `sinkhorn_iters` times,
//           in float32 or wider: columns sum to 1 exactly, rows approximately; docs/design.md)
//   h_ℓ = Σ_i H_pre[i] x_i                                     (eq. 4)
//   x'_j = H_post[j] f_ℓ(h_ℓ) + Σ_i H_res[i, j] x_i            (eq. 5)
// The final hidden state is the sum of the streams.
//
// Parameters per branch: md(m² + 2m) + (m² + 2m) + 3. Initialisation: φ normal(0, init_std),
// b = 0 (H_pre = ½, H_post = 1, H_res uniform), α = 0.01.
//
// residual.impl = "fused" runs the depthkit operators of ops/mhc_ops.h (hand-written backward);
// "reference" their ATen compositions with the same signatures (ops/reference/reference.h).
#pragma once
#include <vector>

#include "depthkit/ops/kernel_choice.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class Mhc final : public ResidualPathway {
 public:
  Mhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params,
      const std::string& prefix = "residual");
  std::string kind() const override { return "mhc"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  std::vector<at::Tensor> stream_states(PathwayState& state) override;  // the m streams
  void set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) override;
  std::map<std::string, bool> operators() const override { return ops_.all(); }
  // H_res of the last read, [B, T, m, m] (rows index the source stream i, columns the target j).
  static at::Tensor last_h_res(PathwayState& state);

  static constexpr double kGateScale = 0.01;

 private:
  struct Branch {
    at::Tensor phi;    // [m² + 2m, md] (applied as x φᵀ)
    at::Tensor bias;   // [m² + 2m]
    at::Tensor scale;  // [3]: α_pre, α_post, α_res
  };
  int64_t m_, iters_;
  OperatorChoice ops_;          // mhc_pre, mhc_sinkhorn, mhc_merge: fused (ops/mhc_ops.h) or reference
  std::vector<Branch> branch_;  // index ℓ
};

}  // namespace depthkit
