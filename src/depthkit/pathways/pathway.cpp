#include "depthkit/pathways/pathway.h"

#include "depthkit/pathways/attnres.h"
#include "depthkit/pathways/dar.h"
#include "depthkit/pathways/residual.h"
#include "depthkit/util/error.h"

namespace depthkit {

std::unique_ptr<ResidualPathway> make_pathway(const ResidualConfig& residual, const ModelConfig& model,
                                              ParameterStore& params) {
  if (residual.kind == "residual") return std::make_unique<StandardResidual>();
  if (residual.kind == "attnres") return std::make_unique<AttnRes>(residual, model, params);
  if (residual.kind == "dar") return std::make_unique<Dar>(residual, model, params);
  fail("residual.kind: unknown pathway \"", residual.kind, "\"");
}

}  // namespace depthkit
