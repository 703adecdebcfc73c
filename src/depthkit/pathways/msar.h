// Multi-Stream Attention Residuals (MSAR paper eq. 9–17, Appendix C).
//
// Sources are single-stream, as in AttnRes: the embedding b_0, then each completed block's sum
// of branch outputs (eq. 15; with S = 1 each branch output, Full MSAR). When a branch reads, each
// source is expanded into m streams by causal depthwise convolutions (eq. 9–10):
//   v⁽⁰⁾ = v,   v⁽ʳ⁾_t = Σ_{δ<κ_r} c_{r,δ} ⊙ v_{t−δ}   (zero before position 0), r = 1 … m−1,
// and each stream r is read by depth attention with its own pseudo-query, keys = values = the
// expanded sources (eq. 11–12, 17); the block's partial sum is merged for branches after the
// first of a block (two-phase form). The m retrieved states Z are fused (eq. 13–14):
//   H_pre = σ(α_pre · RMSNorm(flatten Z) W_pre + b_pre),   h_ℓ = Σ_r H_pre[r] z⁽ʳ⁾.
// The final hidden state is the residual merge of the last branch, h_L + f_L(h_L) (§3.2).
//
// Convolution banks (Appendix C): bank 0 expands the embedding; a completed block uses the bank
// of its last branch; the partial before branch ℓ uses bank ℓ−1. There are L_b banks (the last
// output is never expanded). Parameters per branch: m·d queries, m²d + m + 1 for the fusion, and
// d·Σκ for its bank: L_b[(m² + m + Σκ)d + m + 1] (eq. 20), L_b(44d + 5) for m = 4, κ = {4, 8, 12}.
//
// Ablations: conv = false (streams are replicas of the source, queries stay independent: no
// bank parameters); fusion = "mean" (h = mean_r z⁽ʳ⁾: no W_pre, b_pre, α_pre).
// The read runs as two operators (ops/msar_ops.h): msar_block_read over the raw completed sources
// and their banks, for all the branches of a block at its first (MSAR §3.4: phase 1 batches a
// block's targets; each branch's result waits in the state until it reads), and msar_fuse (partial
// merge + H_pre or mean fusion) per branch. The state keeps single-stream
// sources only, for both implementations: impl = "fused" expands them on the fly and never stores
// the expansions; impl = "reference" runs the ATen compositions with the same signatures
// (ops/reference/reference.h), which expand them at each read.
// Initialisation: queries 0, convolutions 0 (streams r ≥ 1 start empty), W_pre normal(0, init_std),
// b_pre 0, α_pre 0.01.
#pragma once
#include <vector>

#include "depthkit/ops/kernel_choice.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class Msar final : public ResidualPathway {
 public:
  Msar(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params);
  std::string kind() const override { return "msar"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  int64_t sources_after(int64_t branch) const override { return schedule_.sources_after(branch); }
  std::map<std::string, bool> operators() const override { return ops_.all(); }
  // Decoding: each bank's convolution reaches κ − 1 positions back, so the cache holds, per bank,
  // the last K − 1 positions of the tensor it expands (K the largest kernel); none without
  // convolutions (conv = false, or m = 1).
  std::unique_ptr<PathwayCache> start_cache(int64_t batch, const at::Tensor& like) const override;
  std::unique_ptr<PathwayState> resume(const at::Tensor& embedding, PathwayCache& cache,
                                       const std::vector<int64_t>& counts) override;

  static constexpr double kPreScale = 0.01;

  // Bank `bank` as the fused operators take it: [m − 1, d, K], taps zero-padded to the largest
  // kernel K; identity taps (ones, K = 1, constant) for conv = false.
  at::Tensor taps(int64_t bank) const;

 private:
  // Bank `bank`'s taps for this state: the decoding cache's, made once, or taps(bank).
  at::Tensor taps_of(PathwayState& state, int64_t bank) const;
  // Adds a completed source to the state, with its bank's taps.
  void append(PathwayState& state, const at::Tensor& source, int64_t bank) const;
  // Reports every stream's retrieval weights of read ℓ to the observer.
  void observe_read(PathwayState& state, int64_t l) const;

  struct Branch {
    at::Tensor queries;                   // [m, d]
    at::Tensor w_pre, b_pre, alpha_pre;   // [m, md], [m], [1] (fusion = "hpre")
  };
  BlockSchedule schedule_;
  int64_t m_;
  bool conv_, mean_fusion_;
  OperatorChoice ops_;  // msar_block_read, msar_fuse: fused (ops/msar_ops.h) or reference
  int64_t d_;
  std::vector<int64_t> kernels_;
  int64_t reach_;  // K − 1 with convolutions, else 0: how far back an expansion reads
  std::vector<Branch> branch_;                  // index ℓ
  std::vector<std::vector<at::Tensor>> bank_;   // bank_[k][r − 1]: [d, κ_r], k = 0 … L_b − 1
};

}  // namespace depthkit
