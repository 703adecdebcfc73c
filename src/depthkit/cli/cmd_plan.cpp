// depthkit plan: which layouts of a config fit a cluster, what each rank holds and sends, and the
// one to launch (train/plan.h; docs/training.md, "Planning a layout").
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/model/config_check.h"
#include "depthkit/train/plan.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

namespace {

// "80GiB", "80 GB", "81920MiB", "85899345920": bytes (binary units KiB…TiB, decimal kB…TB).
double parse_memory(const std::string& text) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    fail("--gpu-memory: '", text, "' is not a size (like 80GiB or 80GB)");
  }
  std::string unit = text.substr(end);
  unit.erase(0, unit.find_first_not_of(' '));
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},       {"B", 1},       {"KiB", 1024.0},  {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"kB", 1e3},   {"KB", 1e3},    {"MB", 1e6},      {"GB", 1e9},        {"TB", 1e12}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      if (!std::isfinite(value) || value <= 0) fail("--gpu-memory: '", text, "' must be a positive size");
      return value * scale;
    }
  fail("--gpu-memory: unknown unit '", unit, "' in '", text, "' (use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB)");
}

std::string gib(double bytes) {
  char out[32];
  std::snprintf(out, sizeof out, "%.1f", bytes / double(1ull << 30));
  return out;
}

std::string describe(const Layout& L) {
  std::string s = cat("D=", L.data);
  if (L.experts > 1) s += cat(" EP=", L.experts);
  if (L.stages > 1) s += cat(" PP=", L.stages);
  if (L.virtual_stages > 1) s += cat("x", L.virtual_stages);
  return s + cat(" ZeRO-", L.zero, " ", L.recompute, " mb=", L.micro_batch);
}

nlohmann::json to_json(const LayoutPlan& p) {
  const MemoryParts& m = p.memory;
  nlohmann::json layout = {{"data", p.layout.data},           {"expert_parallel", p.layout.experts},
                           {"pipeline_stages", p.layout.stages}, {"virtual_stages", p.layout.virtual_stages},
                           {"zero", p.layout.zero},            {"recompute", p.layout.recompute},
                           {"micro_batch", p.layout.micro_batch}, {"grad_accum", p.layout.grad_accum}};
  return {{"layout", layout},
          {"memory_bytes",
           {{"parameters", m.parameters}, {"gradients", m.gradients}, {"optimizer", m.optimizer},
            {"activations", m.activations}, {"depth_sources", m.sources}, {"moe_dispatch", m.dispatch},
            {"communication_buffers", m.communication}, {"total", m.total()}}},
          {"communication_bytes_per_step", p.communication},
          {"bubble", p.bubble},
          {"step_seconds_estimate", p.step_seconds},
          {"fits", p.fits}};
}

}  // namespace

void add_plan(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("plan", "the layouts of a config that fit a cluster, and the one to launch");
  struct Args : ConfigArgs {
    int64_t gpus = 8, nodes = 1;
    std::string memory = "80GiB";
    int64_t show = 12;
  };
  auto a = std::make_shared<Args>();
  add_config_options(cmd, *a, ConfigFile::required);
  add_number(cmd, "--gpus", a->gpus, 1, 1 << 20, "GPUs in all (one rank each)");
  add_number(cmd, "--nodes", a->nodes, 1, 1 << 16, "machines the GPUs are spread over (equally)");
  cmd->add_option("--gpu-memory", a->memory, "memory of one GPU, e.g. 80GiB (default) or 141GB");
  add_number(cmd, "--show", a->show, 1, 1 << 20, "layouts listed (the recommended one first)");
  cmd->add_flag("--json", a->json, "print JSON: every layout, fitting or not");
  cmd->callback([&action, a] {
    action = [a] {
      const Config cfg = load_config(a->config, a->sets);
      ClusterSpec cluster;
      cluster.gpus = a->gpus;
      cluster.nodes = a->nodes;
      cluster.gpu_memory = parse_memory(a->memory);
      const std::vector<LayoutPlan> plans = plan_layouts(cfg, cluster);
      const bool any = !plans.empty() && plans[0].fits;
      if (a->json) {
        nlohmann::json j = {{"config", a->config}, {"gpus", a->gpus}, {"nodes", a->nodes},
                            {"gpu_memory_bytes", cluster.gpu_memory}, {"global_batch", cfg.train.micro_batch * cfg.train.grad_accum},
                            {"assumptions", {{"flops_per_gpu", cluster.flops}, {"bandwidth_within_node", cluster.node_bandwidth},
                                             {"bandwidth_across_nodes", cluster.network_bandwidth}}}};
        j["layouts"] = nlohmann::json::array();
        for (const LayoutPlan& p : plans) j["layouts"].push_back(to_json(p));
        if (any) {
          j["recommended"] = to_json(plans[0]);
          j["torchrun"] = torchrun_command(plans[0].layout, cluster, a->config);
        }
        std::printf("%s\n", j.dump(2).c_str());
        return any ? 0 : 1;
      }
      std::printf("%s on %lld GPU%s of %s GiB (%lld node%s), %lld sequences of %lld tokens a step\n", a->config.c_str(),
                  (long long)a->gpus, a->gpus > 1 ? "s" : "", gib(cluster.gpu_memory).c_str(), (long long)a->nodes,
                  a->nodes > 1 ? "s" : "", (long long)(cfg.train.micro_batch * cfg.train.grad_accum),
                  (long long)cfg.model.seq_len);
      std::printf("%-38s %7s %6s %6s %6s %7s %7s %6s %6s %7s %6s %8s\n", "layout", "GiB", "param", "grad", "adam", "activ",
                  "sources", "moe", "comm", "bubble", "fits", "step s");
      int64_t shown = 0;
      for (const LayoutPlan& p : plans) {
        if (shown++ >= a->show) break;
        const MemoryParts& m = p.memory;
        std::printf("%-38s %7s %6s %6s %6s %7s %7s %6s %6s %6.1f%% %6s %8.2f\n", describe(p.layout).c_str(),
                    gib(m.total()).c_str(), gib(m.parameters).c_str(), gib(m.gradients).c_str(), gib(m.optimizer).c_str(),
                    gib(m.activations).c_str(), gib(m.sources).c_str(), gib(m.dispatch).c_str(), gib(m.communication).c_str(),
                    100 * p.bubble, p.fits ? "yes" : "no", p.step_seconds);
      }
      if (!any) {
        std::printf("no layout fits: the smallest needs %s GiB per GPU; add GPUs or memory\n",
                    gib(plans.empty() ? 0 : plans[0].memory.total()).c_str());
        return 1;
      }
      const LayoutPlan& best = plans[0];
      std::printf("\nrecommended: %s — the fastest estimate that fits (%s of %s GiB", describe(best.layout).c_str(),
                  gib(best.memory.total()).c_str(), gib(cluster.gpu_memory).c_str());
      for (const auto& [name, bytes] : best.communication) std::printf("; %s %s GiB/step", name.c_str(), gib(bytes).c_str());
      std::printf(")\n%s\n", torchrun_command(best.layout, cluster, a->config).c_str());
      return 0;
    };
  });
}

}  // namespace depthkit::cli
