// `depthkit analyze`: what a trained pathway learned, on held-out sequences (DAR §Analysis,
// MSAR Appendix D). Sequences are `sequences` validation windows of model.seq_len tokens, spread
// evenly over the split; every statistic uses their last `positions` tokens (the papers: four
// sequences, the last 128 positions).
//
//   maps    token-averaged depth-attention weights, target layer × source, per stream, for the
//           pre-attention and pre-MLP reads; columns are the embedding and blocks 1 … N, the
//           partial of the target's own block sits in its block's column; unavailable cells are
//           blank (DAR Fig. 3 and A.3, MSAR Fig. 4). AttnRes, DAR, MSAR, AttnRes + mHC.
//   streams MSAR's m streams at each read ℓ, token-averaged: the RMS of each stream's keys before
//           their normalisation (mean over the sources; against √ε of the key norm), its H_pre
//           fusion gate, and its share ‖H_pre[r] z⁽ʳ⁾‖ / Σ_r′ ‖H_pre[r′] z⁽ʳ′⁾‖ of the fused
//           input (eq. 10, 13–14; docs/design.md, "MSAR's first hundred steps"). MSAR.
//   cka     linear CKA (Kornblith et al. 2019) between the post-MLP states of every pair of
//           streams at every pair of layers (DAR Fig. 5). DAR, mHC, AttnRes + mHC.
//   rescue  R_ℓ,j = 1 − KL(p_clean ‖ p_keep-j) / max(KL(p_clean ‖ p_zero-all), 1e−12), where after
//           layer ℓ's MLP update every stream but j (or all) is zeroed and the rest of the model
//           runs unchanged (DAR Fig. 6). DAR, mHC, AttnRes + mHC.
//   gates   g_ℓ = E[β¹_ℓ − β⁰_ℓ] of the MLP write gates, d_ℓ = R_ℓ,1 − R_ℓ,0, their Pearson r
//           and the mean |g_ℓ| (DAR Fig. A.4). DAR.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace depthkit {

struct AnalyzeOptions {
  std::filesystem::path run_dir;
  std::string checkpoint;       // default: the latest
  std::string data;             // default: the run's data.dir
  std::vector<std::string> what;  // empty: every analysis the pathway supports
  int64_t sequences = 4;
  int64_t positions = 128;
  std::filesystem::path out;    // default: RUN_DIR/analysis
};

// Writes OUT/<what>.json and OUT/<what>.png for each analysis and returns all numbers.
nlohmann::json run_analyze(const AnalyzeOptions& opt);

// Linear CKA of two representations of the same n examples, X [n, p], Y [n, q] (any float
// dtype; computed in float64): ‖Yᶜᵀ Xᶜ‖²_F / (‖Xᶜᵀ Xᶜ‖_F ‖Yᶜᵀ Yᶜ‖_F) with column-centred Xᶜ, Yᶜ.
double linear_cka(const at::Tensor& x, const at::Tensor& y);

// The analyses a pathway kind supports, in the order they run.
std::vector<std::string> supported_analyses(const std::string& kind);

}  // namespace depthkit
