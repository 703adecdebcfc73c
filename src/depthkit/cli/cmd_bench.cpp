// depthkit bench: median training-step time, tokens/s and peak memory.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/train/bench.h"

namespace depthkit::cli {

void add_bench(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("bench", "time training steps on random tokens");
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    int64_t steps = 20, warmup = 3;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--config", a->config, "TOML config")->required();
  add_set_option(cmd, a->sets);
  cmd->add_option("--steps", a->steps, "timed steps")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  cmd->add_option("--warmup", a->warmup, "untimed warm-up steps")->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  cmd->add_flag("--json", a->json, "print JSON");
  cmd->callback([&action, a] {
    action = [a] {
      Config cfg = Config::load(a->config, a->sets);
      BenchResult r = run_bench(cfg, a->steps, a->warmup);
      if (a->json) {
        nlohmann::json j = {{"kind", cfg.residual.kind},         {"median_step_s", r.median_step_s},
                            {"tokens_per_s", r.tokens_per_s},   {"tokens_per_step", r.tokens_per_step},
                            {"peak_rss_bytes", r.peak_rss_bytes}, {"step_s", r.step_s}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%s: median step %.2f ms, %.0f tokens/s, peak RSS %.1f MiB (%lld steps after %lld warm-up)\n",
                    cfg.residual.kind.c_str(), r.median_step_s * 1e3, r.tokens_per_s,
                    double(r.peak_rss_bytes) / (1 << 20), (long long)a->steps, (long long)a->warmup);
      }
      return 0;
    };
  });
}

}  // namespace depthkit::cli
