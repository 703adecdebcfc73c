// Loading a config for a model. Config::parse (config/config.h) checks every key's type and range
// and the keys' relations; the names some keys take are defined above it, here or below: a
// residual.kind is a pathway in the registry (pathways/registry.h), with its own constraints, and a
// moe.router is a router in the table (model/router.h). These functions pass those rules, so every
// program and test that builds a model loads its config through them.
#pragma once
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

// The rules of the registries: the kinds and routers they hold, and each kind's own checks.
const ConfigRules& model_config_rules();

Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
Config parse_config(const std::string& toml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

}  // namespace depthkit
