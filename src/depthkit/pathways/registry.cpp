#include "depthkit/pathways/registry.h"

#include "depthkit/util/error.h"
#include "depthkit/util/named.h"

namespace depthkit {

const std::vector<PathwayKind>& pathway_kinds() {
  // The one list of kinds: a new pathway adds its entry here (and defines it in its own file).
  static const std::vector<PathwayKind> kinds = {
      residual_pathway_kind(), attnres_pathway_kind(),      dar_pathway_kind(),        msar_pathway_kind(),
      mhc_pathway_kind(),      attnres_sepv_pathway_kind(), attnres_mhc_pathway_kind(),
  };
  return kinds;
}

std::vector<std::string> pathway_kind_names() { return names_of(pathway_kinds()); }

const PathwayKind* find_pathway_kind(const std::string& name) { return find_named(pathway_kinds(), name); }

const PathwayKind& pathway_kind(const std::string& name) {
  if (const PathwayKind* k = find_pathway_kind(name)) return *k;
  fail("residual.kind: unknown pathway \"", name, "\"");
}

std::unique_ptr<ResidualPathway> make_pathway(const ResidualConfig& residual, const ModelConfig& model,
                                              ParameterStore& params) {
  return pathway_kind(residual.kind).make(residual, model, params);
}

}  // namespace depthkit
