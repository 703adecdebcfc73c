#include "depthkit/model/config_check.h"

#include "depthkit/model/router.h"
#include "depthkit/pathways/registry.h"

namespace depthkit {

const ConfigRules& model_config_rules() {
  static const ConfigRules rules{
      {{"residual.kind", pathway_kind_names()}, {"moe.router", moe_router_names()}},
      // The kind's own checks (its entry in pathways/registry.h; e.g. DAR with S = 1, MSAR's kernels).
      [](const Config& c, const std::string& where) {
        if (const PathwayKind& kind = pathway_kind(c.residual.kind); kind.validate) kind.validate(c.residual, where);
      }};
  return rules;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return Config::load(path, model_config_rules(), overrides);
}

Config parse_config(const std::string& toml_text, const std::string& source, const std::vector<std::string>& overrides) {
  return Config::parse(toml_text, source, model_config_rules(), overrides);
}

}  // namespace depthkit
