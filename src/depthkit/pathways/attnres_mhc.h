// AttnRes + mHC (MSAR Table 2, row 4): both states are kept side by side, the AttnRes history of
// completed sources and mHC's m recurrent streams; each branch reads the sum of the two readouts
// and its output is written to both; the final hidden state is the sum of AttnRes's output read
// and mHC's stream sum. Parameters: those of both (names residual.attnres.*, residual.mhc.*).
#pragma once
#include "depthkit/pathways/attnres.h"
#include "depthkit/pathways/mhc.h"

namespace depthkit {

class AttnResMhc final : public ResidualPathway {
 public:
  AttnResMhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params);
  std::string kind() const override { return "attnres_mhc"; }
  std::unique_ptr<PathwayState> begin(const at::Tensor& embedding) override;
  at::Tensor read(PathwayState& state, int64_t branch) override;
  void write(PathwayState& state, int64_t branch, const at::Tensor& out) override;
  at::Tensor finish(PathwayState& state) override;
  StageState stage_out(PathwayState& state, int64_t branch) override;
  std::unique_ptr<PathwayState> stage_in(const StageState& in, int64_t branch, int64_t B, int64_t T) override;
  int64_t sources_after(int64_t branch) const override { return attnres_.sources_after(branch); }
  std::vector<at::Tensor> stream_states(PathwayState& state) override;  // mHC's m streams
  void set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) override;
  void set_observer(PathwayObserver* observer) override;
  std::map<std::string, bool> operators() const override;  // both pathways' (they share none)

 private:
  AttnRes attnres_;
  Mhc mhc_;
};

}  // namespace depthkit
