// The decoder-only Pre-Norm Transformer (DAR paper's dense backbone): token embedding, per layer
// an attention branch and a feed-forward branch, each wrapped by the residual pathway through
// the seam of pathways/pathway.h, final RMSNorm, LM head (untied by default).
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/model/layers.h"
#include "depthkit/model/moe.h"
#include "depthkit/model/recompute.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

struct ParameterCounts {
  int64_t total = 0, non_vocab = 0, residual = 0;
  // Those one token uses: all but the routed experts it is not sent to (= total when dense).
  int64_t active = 0, active_non_vocab = 0;
  std::vector<std::pair<std::string, int64_t>> by_component;
};

// The auxiliary terms of the last forward pass of an MoE model (all undefined/empty when dense).
struct MoeTerms {
  at::Tensor lm_loss;   // the cross-entropy (loss() only), detached
  at::Tensor aux_loss;  // what loss() added: aux_loss_coef · Σ_ℓ balance_ℓ + z_loss_coef · Σ_ℓ z_ℓ, detached
  at::Tensor balance;   // mean over MoE layers of n_experts · Σ_e f_e · P_e (1.0: uniform), detached
  at::Tensor z_loss;    // mean over MoE layers of the router z-loss, detached
  std::vector<at::Tensor> load;  // per MoE layer: f_e over experts, float64 [n_experts]
  std::vector<int64_t> layers;   // the layer index of each entry of `load`
  // Per MoE layer, the busiest expert's share over the mean share: n_experts · max_e f_e (1.0: balanced).
  std::vector<double> load_max_over_mean() const;
};

// A batch of sequences being decoded (docs/design.md, "Decoding"): every attention layer's keys
// and values, and what the pathway carries between chunks (MSAR's convolution tails; nothing for
// the others, whose reads are per position).
struct DecodeState {
  std::vector<KvCache> layers;
  std::vector<int64_t> lengths;           // positions each sequence holds
  int64_t capacity = 0;                   // positions a sequence can hold (≤ model.seq_len)
  std::unique_ptr<PathwayCache> pathway;  // null where the pathway carries nothing
  int64_t bytes() const;                  // the caches' memory
};

// Where the branches' parameters live between uses (ZeRO-3, train/parameter_sets.h): told before
// branch ℓ runs (in forward; in backward before it runs again under recomputation) and after it
// is done with its parameters (in forward, after it ran; in backward, after its gradients).
class BranchResidency {
 public:
  virtual ~BranchResidency() = default;
  virtual void acquire(int64_t branch, bool backward) = 0;
  virtual void release(int64_t branch, bool backward) = 0;
};

// The compute dtype train.dtype names: float32, or bfloat16 (mixed precision).
at::ScalarType compute_dtype_of(const TrainConfig& train);

class Transformer {
 public:
  // device kMeta builds shapes only (for counting); seed fixes the initialisation. `dtype` is the
  // parameters' dtype (float32; float64 in the tests against the papers' equations);
  // `compute_dtype` the activations' (docs/design.md, "Precision"): absent, the parameters' dtype
  // (nothing is cast); bfloat16 runs the embedding output, every branch and the pathway's states
  // in bfloat16 with the parameters cast at each use, and returns logits and loss in `dtype`.
  // `experts`: which routed experts of each MoE layer this rank holds (expert parallelism); by
  // default all of them. `built`, when given, is told of each branch's parameters as soon as they
  // are drawn (ZeRO-3 keeps this rank's shard of them and frees them, so that no rank ever holds
  // the whole model).
  using BranchBuilt = std::function<void(ParameterStore& params, int64_t branch, const std::vector<size_t>& members)>;
  Transformer(const ModelConfig& model, const ResidualConfig& residual, at::Device device, uint64_t seed,
              at::ScalarType dtype = at::kFloat, std::optional<at::ScalarType> compute_dtype = std::nullopt,
              const ExpertPlacement& experts = {}, const BranchBuilt& built = {});

  // Called after branch ℓ's write with the pathway's state (analysis: states, interventions).
  using AfterBranch = std::function<void(int64_t branch, PathwayState& state)>;

  // int64 [B, T] → [B, T, V] in the parameters' dtype (float32 also when computing in bfloat16)
  at::Tensor logits(const at::Tensor& tokens, const AfterBranch& after_branch = {});
  // int64 [B, T] → the final-normalised hidden states [B, T, d] the LM head takes (compute dtype).
  at::Tensor hidden(const at::Tensor& tokens, const AfterBranch& after_branch = {});
  // The LM head: final-normalised hidden states [..., d] → logits [..., V] in the parameters' dtype.
  at::Tensor head(const at::Tensor& hidden) const;

  // Incremental decoding (docs/design.md, "Decoding"). start_decoding makes the empty state of
  // `batch` sequences holding up to `capacity` positions (0: model.seq_len). extend runs a chunk
  // int64 [B, T] continuing them: row b's first counts[b] ids are real (0 … T; padding follows,
  // and is ignored), at positions lengths[b] … lengths[b] + counts[b] − 1. It returns the chunk's
  // final-normalised hidden states [B, T, d] (head() makes logits; the padding's rows are
  // meaningless) and advances the state. Prefill + extend one position at a time equals hidden()
  // on the whole sequence. Runs without gradients. After a refusal or a failure inside extend the
  // state is not to be used further (its caches may be partly advanced).
  DecodeState start_decoding(int64_t batch, int64_t capacity = 0);
  at::Tensor extend(DecodeState& state, const at::Tensor& tokens, const std::vector<int64_t>& counts);

  // int64 [B, T+1] → the loss training optimises, in the parameters' dtype: the mean next-token
  // cross-entropy, plus for an MoE backbone its auxiliary losses (moe_terms() has the parts).
  at::Tensor loss(const at::Tensor& batch);
  // The mean next-token cross-entropy alone (evaluation).
  at::Tensor lm_loss(const at::Tensor& batch);
  // The MoE terms of the last logits()/loss() call.
  const MoeTerms& moe_terms() const { return terms_; }
  ParameterStore& parameters() { return params_; }
  const ParameterStore& parameters() const { return params_; }
  const ModelConfig& config() const { return cfg_; }
  at::ScalarType compute_dtype() const { return compute_; }
  ResidualPathway& pathway() { return *path_; }
  ParameterCounts count() const;
  // The parameters a model of this configuration has, counted without allocating (on the meta
  // device), and a refusal, naming the bytes, when `bytes_per_parameter` of each (4 for the
  // weights; 16 to train: weights, gradients, two AdamW moments) exceed the machine's memory.
  static void check_fits_in_memory(const ModelConfig& model, const ResidualConfig& residual,
                                   int64_t bytes_per_parameter, const std::string& what);
  // A pipeline stage's part of the forward pass (train/pipeline.h): layers [first, last) over a
  // pathway state (begun on embed(), or taken up from the stage before by stage_in), their MoE
  // terms in moe_terms() (aux_loss undefined where the range has no MoE layer); and on the last
  // stage, the mean next-token cross-entropy of the final state against targets int64 [B, T].
  void run_stage(PathwayState& state, int64_t first, int64_t last);
  at::Tensor stage_lm_loss(PathwayState& state, const at::Tensor& targets);
  // The pieces of the forward pass, for analysis and tests that drive the seam themselves.
  at::Tensor embed(const at::Tensor& tokens) const;          // int64 [B, T] → [B, T, d], compute dtype
  at::Tensor branch(int64_t l, const at::Tensor& h) const;  // f_ℓ, ℓ = 1 … 2·n_layers
  // train.recompute (docs/training.md, "Recomputation"): "none" keeps every activation for
  // backward; "branch" keeps each branch's input only and runs the branch again in backward
  // (model/recompute.h); "layer" keeps only the pathway's state as a layer begins (its depth
  // sources, which later layers read anyway) and runs the whole layer again, the pathway's reads
  // and writes (depth keys, MSAR's expansions) with its two branches. Gradients bit-identical to
  // "none".
  void set_recompute(const std::string& mode);
  // The parameters f_ℓ reads (indices into parameters().all()), ℓ = 1 … 2·n_layers; every other
  // parameter (embedding, pathway, final norm, head) is read outside the branches.
  const std::vector<size_t>& branch_members(int64_t l) const { return branch_members_[size_t(l)]; }
  // Told around every branch's use of its parameters (null: they stay where they are). Needs
  // recomputation ("branch" or "layer"), so that backward runs each branch again between the two calls.
  void set_branch_residency(BranchResidency* residency);

 private:
  ModelConfig cfg_;
  at::ScalarType compute_;  // the activations' dtype
  ParameterStore params_;
  at::Tensor embedding_, final_norm_, lm_head_;
  BackboneOps ops_;  // the final norm's and the loss's
  std::vector<Attention> attention_;
  std::vector<std::optional<FeedForward>> feed_forward_;  // per layer: dense (absent in MoE layers)
  std::vector<std::optional<MoeFeedForward>> moe_;       // per layer: MoE (absent in dense layers)
  mutable std::vector<MoeStats> stats_;                  // per layer, the last branch() call's
  MoeTerms terms_;
  enum class Recompute { None, Branch, Layer } recompute_ = Recompute::None;
  std::vector<std::vector<size_t>> branch_members_;  // [ℓ]: the parameters f_ℓ reads
  BranchResidency* residency_ = nullptr;
  // f_ℓ under recomputation: the branch's output (and an MoE layer's statistics) as branch() gives them.
  at::Tensor recomputed_branch(int64_t l, const at::Tensor& h);
  // Layer i (branches 2i + 1, 2i + 2, with the pathway's reads and writes) under recomputation:
  // advances `state` as running them would.
  void recomputed_layer(int64_t i, PathwayState& state);
  // The recomputed region's hooks for branches first … last: each branch acquired from the
  // residency before (in backward from the last, so that its gather prefetches the one before),
  // released after. None without a residency.
  RegionHooks residency_hooks(int64_t first, int64_t last);
  // f_ℓ's output, an MoE branch's statistics into `stats`.
  at::Tensor branch_with_stats(int64_t l, const at::Tensor& h, MoeStats& stats);
  // The MoE terms of layers [first, last) (means over the model's MoE layers).
  void collect_terms(int64_t first, int64_t last);
  // Layers [first, last) over a begun pathway state (branches 2·first + 1 … 2·last).
  // The branches over a begun pathway state, then the final norm: hidden() and extend() (with
  // `decoding`, whose attention reads and fills the caches).
  struct Decoding {
    DecodeState& state;
    const DecodeChunk& chunk;
  };
  at::Tensor run(PathwayState& state, const AfterBranch& after_branch, const Decoding* decoding);
  void run_layers(PathwayState& state, int64_t first, int64_t last, const AfterBranch& after_branch,
                  const Decoding* decoding);
  std::unique_ptr<ResidualPathway> path_;
  std::unique_ptr<Rope> rope_;
};

}  // namespace depthkit
