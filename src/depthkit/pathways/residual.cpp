#include "depthkit/pathways/residual.h"

#include <ATen/TensorOperators.h>

#include "depthkit/util/error.h"
#include "depthkit/pathways/registry.h"

namespace depthkit {

namespace {
struct Stream final : PathwayState {
  at::Tensor h;  // [B, T, d]
  std::unique_ptr<PathwayState> clone() const override { return std::make_unique<Stream>(*this); }
  std::vector<StateTensor> tensors() override { return {{&h}}; }
};
Stream& stream(PathwayState& s) { return static_cast<Stream&>(s); }
}  // namespace

std::unique_ptr<PathwayState> StandardResidual::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<Stream>();
  s->h = embedding;
  return s;
}

at::Tensor StandardResidual::read(PathwayState& state, int64_t) { return stream(state).h; }

void StandardResidual::write(PathwayState& state, int64_t, const at::Tensor& out) {
  stream(state).h = stream(state).h + out;
}

at::Tensor StandardResidual::finish(PathwayState& state) { return stream(state).h; }

StageState StandardResidual::stage_out(PathwayState& state, int64_t) { return {{}, 1, {stream(state).h}}; }

std::unique_ptr<PathwayState> StandardResidual::stage_in(const StageState& in, int64_t, int64_t, int64_t) {
  auto s = std::make_unique<Stream>();
  s->h = in.carried.at(0);
  return s;
}

void StandardResidual::set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) {
  check_stream_count(states, 1, kind());
  stream(state).h = states[0];
}

// ---- Registry entry (registry.h) ----------------------------------------------------------------

PathwayKind residual_pathway_kind() {
  PathwayKind k;
  k.name = "residual";
  k.make = [](const ResidualConfig&, const ModelConfig&, ParameterStore&) { return std::make_unique<StandardResidual>(); };
  k.analyses = {};  // no depth attention, no streams to compare
  k.blocks = false;
  k.flops = [](const CostShape& s, const ResidualConfig&) { return s.L * s.d; };  // h + f(h) per branch
  k.traffic = [](const CostShape&) { return std::vector<TrafficTerm>{{"residual merge", 2, 1}}; };
  return k;
}

}  // namespace depthkit
