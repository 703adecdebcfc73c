#include "depthkit/pathways/pathway.h"

#include <ATen/ops/stack.h>

#include "depthkit/pathways/attnres.h"
#include "depthkit/pathways/attnres_mhc.h"
#include "depthkit/pathways/dar.h"
#include "depthkit/pathways/mhc.h"
#include "depthkit/pathways/msar.h"
#include "depthkit/pathways/residual.h"
#include "depthkit/util/error.h"

namespace depthkit {

void ResidualPathway::set_stream_states(PathwayState&, const std::vector<at::Tensor>&) {
  fail("residual.kind \"", kind(), "\": the pathway keeps no streams to replace");
}

void StackedHistory::push(at::Tensor entry) {
  entries_.push_back(std::move(entry));
  stacked_ = at::Tensor();
}

void StackedHistory::replace_last(at::Tensor entry) {
  entries_.back() = std::move(entry);
  stacked_ = at::Tensor();
}

const at::Tensor& StackedHistory::stacked() {
  if (!stacked_.defined()) stacked_ = at::stack(entries_);
  return stacked_;
}

void check_stream_count(const std::vector<at::Tensor>& states, size_t expected, const std::string& kind) {
  if (states.size() != expected)
    fail("residual.kind \"", kind, "\": ", states.size(), " stream states given, the pathway keeps ", expected);
}

std::unique_ptr<ResidualPathway> make_pathway(const ResidualConfig& residual, const ModelConfig& model,
                                              ParameterStore& params) {
  if (residual.kind == "residual") return std::make_unique<StandardResidual>();
  if (residual.kind == "attnres" || residual.kind == "attnres_sepv")
    return std::make_unique<AttnRes>(residual, model, params);
  if (residual.kind == "dar") return std::make_unique<Dar>(residual, model, params);
  if (residual.kind == "msar") return std::make_unique<Msar>(residual, model, params);
  if (residual.kind == "mhc") return std::make_unique<Mhc>(residual, model, params);
  if (residual.kind == "attnres_mhc") return std::make_unique<AttnResMhc>(residual, model, params);
  fail("residual.kind: unknown pathway \"", residual.kind, "\"");
}

}  // namespace depthkit
