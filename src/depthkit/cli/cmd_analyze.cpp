// depthkit analyze: retrieval maps, CKA, rescue gain and gate asymmetry of a trained run
// (analysis/analyze.h).
#include <cstdio>
#include <sstream>

#include "depthkit/analysis/analyze.h"
#include "depthkit/cli/commands.h"

namespace depthkit::cli {

void add_analyze(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("analyze", "retrieval maps, CKA, rescue gain, gate asymmetry of a trained run");
  struct Args {
    AnalyzeOptions opt;
    std::string what, out;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--run-dir", a->opt.run_dir, "run directory")->required();
  cmd->add_option("--checkpoint", a->opt.checkpoint, "checkpoint name (default: latest)");
  cmd->add_option("--data", a->opt.data, "data directory (default: the run's data.dir)");
  cmd->add_option("--what", a->what, "comma-separated: maps,streams,cka,rescue,gates (default: all the pathway supports)");
  add_number(cmd, "--sequences", a->opt.sequences, 1, int64_t(1) << 20, "held-out sequences (default 4)");
  add_number(cmd, "--positions", a->opt.positions, 1, int64_t(1) << 24, "last positions of each sequence used (default 128)");
  cmd->add_option("--out", a->out, "output directory (default RUN_DIR/analysis)");
  cmd->add_flag("--json", a->json, "print the numbers as JSON");
  cmd->callback([&action, a] {
    action = [a] {
      AnalyzeOptions opt = a->opt;
      opt.out = a->out;
      std::stringstream ss(a->what);
      for (std::string w; std::getline(ss, w, ',');)
        if (!w.empty()) opt.what.push_back(w);
      const auto r = run_analyze(opt);
      if (a->json) {
        std::printf("%s\n", r.dump().c_str());
        return 0;
      }
      const std::string out = opt.out.empty() ? (opt.run_dir / "analysis").string() : opt.out.string();
      std::printf("%s, step %lld, %lld sequences x last %lld positions\n", r["kind"].get<std::string>().c_str(),
                  (long long)r["step"].get<int64_t>(), (long long)opt.sequences, (long long)opt.positions);
      for (const char* w : {"maps", "streams", "cka", "rescue", "gates"})
        if (r.contains(w)) std::printf("  %-7s %s/%s.png, %s.json\n", w, out.c_str(), w, w);
      if (r.contains("streams")) {  // per stream, the mean over the reads
        const auto& s = r["streams"];
        for (const char* key : {"shares", "key_rms", "gates"}) {
          std::printf("  streams: %-8s by stream, mean over reads:", key);
          const size_t m = s[key][0].size();
          for (size_t j = 0; j < m; ++j) {
            double sum = 0;
            for (const auto& read : s[key]) sum += read[j].get<double>();
            std::printf(" %.4g", sum / double(s[key].size()));
          }
          std::printf("\n");
        }
      }
      if (r.contains("rescue"))
        for (const auto& s : r["rescue"]["streams"]) {
          std::printf("  rescue gain, keep stream %lld, by layer:", (long long)s["stream"].get<int64_t>());
          for (double g : s["gain"]) std::printf(" %.3f", g);
          std::printf("\n");
        }
      if (r.contains("gates"))
        std::printf("  gates: mean |g| %.4f, Pearson r(g, d) %s\n", r["gates"]["mean_abs_g"].get<double>(),
                    r["gates"]["pearson"].is_null() ? "undefined" : std::to_string(r["gates"]["pearson"].get<double>()).c_str());
      return 0;
    };
  });
}

}  // namespace depthkit::cli
