// The one seam between the backbone and its residual pathway (docs/design.md, "The seam").
// The backbone drives every branch ℓ = 1 … L_b (attention and feed-forward alternate) as
//
//   state = path.begin(embedding)
//   for ℓ: h = path.read(state, ℓ); out = branch_ℓ(h); path.write(state, ℓ, out)
//   hidden = path.finish(state)          → final RMSNorm → LM head
//
// and never knows which pathway it runs. A pathway keeps whatever history it needs in its state.
#pragma once
#include <ATen/core/Tensor.h>

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

// What analysis sees of a pathway (docs/design.md, "The seam": an observer, so that analysis code
// does not reach into a pathway's internals). Every callback is optional; the tensors are
// detached, and an observer must not modify them.
class PathwayObserver {
 public:
  virtual ~PathwayObserver() = default;
  // The depth-attention weights of one stream of branch ℓ's read (ℓ = L_b + 1: the final readout),
  // [B, T, n]: the completed sources 0 … n − 1 (source 0 the embedding), then, when `with_partial`,
  // the current block's partial as the last column (so n − 1 completed sources).
  virtual void on_retrieval(int64_t branch, int64_t stream, const at::Tensor& weights, bool with_partial) {}
  // The write gates of branch ℓ, [B, T, streams] (DAR's β_ℓ, eq. 16).
  virtual void on_write_gates(int64_t branch, const at::Tensor& gates) {}
  // MSAR's m streams at branch ℓ's read, each [B, T, m]: the RMS of each stream's keys before
  // their normalisation (mean over the completed sources; eq. 10), its fusion gate H_pre[r]
  // (eq. 13; 1/m under mean fusion) and its share of the fused input,
  // ‖H_pre[r] z⁽ʳ⁾‖ / Σ_r′ ‖H_pre[r′] z⁽ʳ′⁾‖ (eq. 14).
  virtual void on_stream_fusion(int64_t branch, const at::Tensor& key_rms, const at::Tensor& gates,
                                const at::Tensor& shares) {}
};

// The block schedule shared by every block pathway (docs/design.md, "Pathways"; DAR eq. 8–9,
// MSAR eq. 15–16): branches ℓ = 1 … L_b in blocks of S, block b = 1 … blocks() holding branches
// (b−1)S + 1 … min(bS, L_b), so the last block may be shorter and no S is rejected for not dividing
// L_b. The first branch of a block reads the completed sources only; the branch that closes a block
// turns its partial into a completed source. S = 1 is the Full form (every branch its own block).
struct BlockSchedule {
  int64_t size;      // S, branches per block
  int64_t branches;  // L_b
  // residual.share_within_block: the attention branches of a block share one parameter set and
  // its feed-forward branches another (docs/design.md, "Parameters shared within a block").
  bool shared = false;

  // ℓ is the first branch of its block (no partial to merge).
  bool opens(int64_t l) const { return (l - 1) % size == 0; }
  // ℓ is the last branch of its block (its write completes a source).
  bool closes(int64_t l) const { return l % size == 0 || l == branches; }
  // The number of blocks, ⌈L_b / S⌉.
  int64_t blocks() const { return (branches + size - 1) / size; }
  // The completed sources after branch ℓ (the embedding and the blocks closed by then).
  int64_t sources_after(int64_t l) const { return 1 + (l == branches ? blocks() : l / size); }
  // The block b = 1 … blocks() that holds branch ℓ; at ℓ it has b completed sources before it
  // (the embedding and blocks 1 … b − 1).
  int64_t block_of(int64_t l) const { return (l - 1) / size + 1; }
  // The branch whose parameters ℓ uses: ℓ itself, or under `shared` the first branch of ℓ's block
  // of ℓ's type (branches alternate attention, feed-forward: odd ℓ attention).
  int64_t owner(int64_t l) const {
    if (!shared) return l;
    const int64_t first = (block_of(l) - 1) * size + 1;
    return (first - l) % 2 == 0 ? first : first + 1;
  }
};

// One tensor a pathway's state holds, and whether the pathway made it a shared source
// (fused::shared_source, ops/shared_source.h: its reads add its gradient into one buffer).
struct StateTensor {
  at::Tensor* tensor;
  bool shared_source = false;
};

// Per-forward state of a pathway (the residual stream, a depth history, several streams...).
struct PathwayState {
  virtual ~PathwayState() = default;
  // For recomputing a whole layer (train.recompute = "layer"; Transformer): a copy sharing the
  // tensors, and every tensor slot the state holds (each list's entries, undefined ones too) in a
  // fixed order, so that the backbone can hand a layer's state to a recomputed region as tensors
  // and lay the region's outputs back in.
  virtual std::unique_ptr<PathwayState> clone() const = 0;
  virtual std::vector<StateTensor> tensors() = 0;
  // The last branch that the backbone's current run of reads reaches: its last layer's, or a
  // recomputed layer's own (train.recompute = "layer"). Set by the backbone before it reads. A
  // pathway that makes several branches' reads at once (MSAR's phase 1 for a block) makes none
  // past it, so that no read is made for a later pipeline stage or held across a recomputed
  // region (where it would be one more tensor the region keeps).
  int64_t read_horizon = std::numeric_limits<int64_t>::max();
};

// What crosses a pipeline stage boundary (docs/design.md, "Pipeline stages"): the state after a
// layer, as the next stage takes it up. `sources` are the depth sources completed so far, `width`
// tensors each, source by source (AttnRes's summary; with SepV its mapped value too; DAR's pair
// H⁰, H¹), which a stage that already holds them (the same rank's earlier virtual stage of the
// micro-batch) does not receive again; `carried` is the rest that later branches read: a block's
// partial (absent at a block boundary), the residual stream, mHC's m streams. Never a tensor the
// receiver can make itself (MSAR's expansions and taps, DAR's gate of the last read).
struct StageState {
  std::vector<at::Tensor> sources;
  int64_t width = 1;
  std::vector<at::Tensor> carried;
};

// What a pathway carries from one chunk of positions to the next while decoding (docs/design.md,
// "Decoding"): only MSAR's, whose causal convolutions reach back across chunks.
struct PathwayCache {
  virtual ~PathwayCache() = default;
  virtual int64_t bytes() const = 0;
};

class ResidualPathway {
 public:
  virtual ~ResidualPathway() = default;
  virtual std::string kind() const = 0;
  // embedding: [B, T, d], the token embedding (source 0 of the depth pathways).
  virtual std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) = 0;
  // The input h_ℓ of branch ℓ (1-based), [B, T, d].
  virtual at::Tensor read(PathwayState& state, int64_t branch) = 0;
  // Takes the output f_ℓ(h_ℓ) of branch ℓ, [B, T, d].
  virtual void write(PathwayState& state, int64_t branch, const at::Tensor& out) = 0;
  // The hidden state handed to the final RMSNorm, [B, T, d].
  virtual at::Tensor finish(PathwayState& state) = 0;

  // Decoding: the backbone runs a batch of sequences in chunks of positions (a prompt, then one
  // position at a time). A pathway whose reads at a position use only that position's states (every
  // pathway but MSAR) carries nothing between chunks: begin() on a chunk is exact, and it returns
  // no cache. Otherwise start_cache() makes what B sequences carry, empty (nothing before position 0).
  virtual std::unique_ptr<PathwayCache> start_cache(int64_t batch, const at::Tensor& like) const { return nullptr; }
  // begin() for a chunk [B, T, d] continuing the sequences of `cache`, whose row b holds counts[b]
  // real positions (then padding, which never reaches the cache); updates the cache.
  virtual std::unique_ptr<PathwayState> resume(const at::Tensor& embedding, PathwayCache& cache,
                                               const std::vector<int64_t>& counts);
  // The pathway's current per-stream states after the last write, [B, T, d] each (the residual
  // stream; DAR's two streams: the block's partial [P⁰, P¹], or the newest completed entry
  // [H⁰, H¹] at a block boundary; mHC's m streams). Empty where the pathway keeps no streams.
  virtual std::vector<at::Tensor> stream_states(PathwayState& state) { return {}; }
  // Intervention (the rescue-gain analysis): replaces the states stream_states() returns, so that
  // the following branches read the replacement. Throws where the pathway keeps no streams.
  virtual void set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states);

  // Pipeline stages (train/pipeline.h): the state after branch ℓ as it crosses to the next stage,
  // and the state a stage continues from after branch ℓ, made from it (each tensor a leaf of the
  // receiving stage's graph; sources appended as begin() and write() append them). B, T: the
  // micro-batch's sequences and positions. The default: the pathway cannot cross a boundary.
  virtual StageState stage_out(PathwayState& state, int64_t branch);
  virtual std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T);
  // The depth sources the state holds after branch ℓ (0 … L_b; 0 = right after begin()): what a
  // stage of the micro-batch that ran branches up to ℓ already holds. 0 for a pathway without any.
  virtual int64_t sources_after(int64_t branch) const { return 0; }

  // The depthkit operators the pathway runs, each with whether it runs fused (true) or as its
  // reference composition (false): residual.impl, and with "fused" whether the model's device has
  // the operator's kernel (ops/kernel_choice.h). Empty for a pathway without operators.
  virtual std::map<std::string, bool> operators() const { return {}; }

  // Reports retrieval weights and gates to `observer` (nullptr: none) on the following forwards.
  // Observing costs an extra reference computation of the weights; training never observes.
  virtual void set_observer(PathwayObserver* observer) { observer_ = observer; }

 protected:
  PathwayObserver* observer_ = nullptr;
};

// Throws unless `states` holds `expected` tensors (for set_stream_states of pathway `kind`).
void check_stream_count(const std::vector<at::Tensor>& states, size_t expected, const std::string& kind);

// Builds the pathway named by residual.kind, registering its parameters (component "residual"):
// the factory of its entry in the pathway registry (pathways/registry.h, registry.cpp).
std::unique_ptr<ResidualPathway> make_pathway(const ResidualConfig& residual, const ModelConfig& model,
                                              ParameterStore& params);

}  // namespace depthkit
