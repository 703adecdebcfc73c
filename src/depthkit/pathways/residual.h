// The standard Pre-Norm residual: h_{ℓ+1} = h_ℓ + f_ℓ(h_ℓ) (DAR eq. 1). No parameters.
#pragma once
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class StandardResidual final : public ResidualPathway {
 public:
  std::string kind() const override { return "residual"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  std::vector<at::Tensor> stream_states(PathwayState& state) override { return {finish(state)}; }
  void set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) override;
};

}  // namespace depthkit
