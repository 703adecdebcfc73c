// depthkit cost: training FLOPs per token and memory traffic per branch (model/accounting.h).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/model/accounting.h"
#include "depthkit/cli/commands.h"
#include "depthkit/model/config_check.h"

namespace depthkit::cli {

void add_cost(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("cost", "training FLOPs per token and memory traffic of the residual pathway");
  auto a = std::make_shared<ConfigArgs>();
  add_config_options(cmd, *a, ConfigFile::required);
  cmd->add_flag("--json", a->json, "print JSON");
  cmd->callback([&action, a] {
    action = [a] {
      const Config cfg = load_config(a->config, a->sets);
      const CostReport c = training_cost(cfg.model, cfg.residual);
      if (a->json) {
        nlohmann::json terms = nlohmann::json::array();
        for (const auto& t : c.traffic) terms.push_back({{"operation", t.operation}, {"read_d", t.read}, {"write_d", t.write}});
        nlohmann::json j = {{"kind", c.kind}, {"d", c.d}, {"branches", c.branches}, {"blocks", c.blocks},
                            {"block_sublayers", c.block_sublayers}, {"streams", c.streams},
                            {"training_flops_per_token", {{"backbone", c.backbone_flops}, {"lm_head", c.lm_head_flops},
                                                          {"pathway", c.pathway_flops}}},
                            {"overhead_percent", c.overhead_percent},
                            {"traffic_per_token_per_branch", {{"total_d", c.traffic_d()},
                                                              {"total_bytes_fp32", c.traffic_d() * double(c.d) * 4},
                                                              {"terms", terms}}}};
        std::printf("%s\n", j.dump().c_str());
        return 0;
      }
      std::printf("%s: d = %lld, %lld branches, %lld blocks of S = %lld, m = %lld\n", c.kind.c_str(), (long long)c.d,
                  (long long)c.branches, (long long)c.blocks, (long long)c.block_sublayers, (long long)c.streams);
      std::printf("training FLOPs per token (3x forward, multiply-add = 2):\n");
      std::printf("  backbone  %14.4e  (LM head %.4e)\n", c.backbone_flops, c.lm_head_flops);
      std::printf("  pathway   %14.4e  overhead against the standard residual %.3f %%\n", c.pathway_flops,
                  c.overhead_percent);
      std::printf("memory traffic per token per branch, forward (MSAR Table 6 conventions):\n");
      std::printf("  %-44s %8s %8s\n", "operation", "read", "write");
      for (const auto& t : c.traffic) std::printf("  %-44s %7.3gd %7.3gd\n", t.operation.c_str(), t.read, t.write);
      std::printf("  %-44s %16.4gd  (%.0f bytes in float32)\n", "total", c.traffic_d(), c.traffic_d() * double(c.d) * 4);
      return 0;
    };
  });
}

}  // namespace depthkit::cli
