#include "depthkit/pathways/pathway.h"

#include "depthkit/pathways/attnres.h"
#include "depthkit/pathways/attnres_mhc.h"
#include "depthkit/pathways/dar.h"
#include "depthkit/pathways/mhc.h"
#include "depthkit/pathways/msar.h"
#include "depthkit/pathways/residual.h"
#include "depthkit/util/error.h"

namespace depthkit {

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
