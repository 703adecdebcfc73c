// depthkit params: parameter counts by component (built on the meta device: nothing allocated).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"

namespace depthkit::cli {

void add_params(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("params", "count parameters by component");
  auto a = std::make_shared<ConfigArgs>();
  add_config_options(cmd, *a, ConfigFile::required);
  cmd->add_flag("--json", a->json, "print JSON");
  cmd->callback([&action, a] {
    action = [a] {
      Config cfg = load_config(a->config, a->sets);
      Transformer model(cfg.model, cfg.residual, at::kMeta, 0);
      ParameterCounts c = model.count();
      if (a->json) {
        nlohmann::json j = {{"total", c.total}, {"non_vocab", c.non_vocab}, {"residual", c.residual},
                            {"active", c.active}, {"active_non_vocab", c.active_non_vocab},
                            {"kind", cfg.residual.kind}};
        for (auto& [name, n] : c.by_component) j["components"][name] = n;
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-16s %16s\n", "component", "parameters");
        for (auto& [name, n] : c.by_component) std::printf("%-16s %16lld\n", name.c_str(), (long long)n);
        std::printf("%-16s %16lld\n%-16s %16lld\n", "non_vocab", (long long)c.non_vocab, "total",
                    (long long)c.total);
        if (cfg.model.moe.enabled())
          std::printf("%-16s %16lld\n%-16s %16lld\n", "active_non_vocab", (long long)c.active_non_vocab, "active",
                      (long long)c.active);
      }
      return 0;
    };
  });
}

}  // namespace depthkit::cli
