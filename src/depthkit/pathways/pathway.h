// The one seam between the backbone and its residual pathway (DESIGN.md, "The one seam").
// The backbone drives every branch ℓ = 1 … L_b (attention and feed-forward alternate) as
//
//   state = path.begin(embedding)
//   for ℓ: h = path.read(state, ℓ); out = branch_ℓ(h); path.write(state, ℓ, out)
//   hidden = path.finish(state)          → final RMSNorm → LM head
//
// and never knows which pathway it runs. A pathway keeps whatever history it needs in its state.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

// Per-forward state of a pathway (the residual stream, a depth history, several streams...).
struct PathwayState {
  virtual ~PathwayState() = default;
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
  // Observer: the pathway's current per-stream states, [B, T, d] each (the residual stream; DAR's
  // newest completed entry [H⁰, H¹]; mHC's m streams). Empty where the pathway keeps no streams.
  virtual std::vector<at::Tensor> stream_states(PathwayState& state) { return {}; }
};

// Builds the pathway named by residual.kind, registering its parameters (component "residual").
std::unique_ptr<ResidualPathway> make_pathway(const ResidualConfig& residual, const ModelConfig& model,
                                              ParameterStore& params);

}  // namespace depthkit
