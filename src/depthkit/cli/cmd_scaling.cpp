// depthkit scaling: shifted power-law fits and iso-loss compute speedups (analysis/scaling.h).
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "depthkit/analysis/plots.h"
#include "depthkit/analysis/scaling.h"
#include "depthkit/cli/commands.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit::cli {

void add_scaling(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("scaling", "fit L(C) = A C^-beta + E per method; iso-loss compute speedups");
  struct Args {
    std::string runs, baseline = "residual", plot;
    double irreducible = 0.72;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--runs", a->runs, "points: CSV (method,compute,loss) or JSON")->required();
  add_number(cmd, "--irreducible", a->irreducible, 0.0, std::numeric_limits<double>::infinity(),
             "the fixed irreducible loss E (default 0.72, MSAR §4.3)");
  cmd->add_option("--baseline", a->baseline, "the method speedups are measured against (default residual)");
  cmd->add_option("--plot", a->plot, "PNG of the fits (default: next to --runs, <name>.scaling.png)");
  cmd->add_flag("--json", a->json, "print JSON");
  cmd->callback([&action, a] {
    action = [a] {
      const fs::path runs(a->runs);
      const auto points = read_scaling_points(runs);
      const auto fits = fit_scaling(points, a->irreducible, a->baseline);
      nlohmann::json j = {{"irreducible", a->irreducible}, {"baseline", a->baseline}, {"fits", nlohmann::json::array()}};
      for (const auto& f : fits) {
        nlohmann::json observed = nlohmann::json::array();
        for (const auto& p : points)
          if (p.method == f.method) observed.push_back({{"compute", p.compute}, {"loss", p.loss}});
        j["fits"].push_back({{"method", f.method}, {"points", f.points}, {"A", f.A}, {"beta", f.beta}, {"r2", f.r2},
                             {"speedup", f.speedup}, {"speedups", f.speedups}, {"observed", observed}});
      }
      const fs::path png = a->plot.empty() ? runs.parent_path() / (runs.stem().string() + ".scaling.png") : fs::path(a->plot);
      const fs::path data = fs::path(png).replace_extension(".fits.json");  // the numbers behind the plot
      if (fs::absolute(data).lexically_normal() == fs::absolute(runs).lexically_normal())
        fail(data.string(), ": would overwrite --runs; choose another --plot");
      write_file_atomic(data, j.dump(1) + "\n");
      render_plot("scaling", data, png);
      j["plot"] = png.string();
      if (a->json) {
        std::printf("%s\n", j.dump().c_str());
        return 0;
      }
      std::printf("L(C) = A C^-beta + %g, fitted per method; speedup: %s's compute at the same loss / the method's\n",
                  a->irreducible, a->baseline.c_str());
      std::printf("%-16s %6s %12s %9s %7s %9s\n", "method", "points", "A", "beta", "R^2", "speedup");
      for (const auto& f : fits)
        std::printf("%-16s %6lld %12.5g %9.5f %7.4f %8.3fx\n", f.method.c_str(), (long long)f.points, f.A, f.beta, f.r2,
                    f.speedup);
      std::printf("plot: %s\n", png.c_str());
      return 0;
    };
  });
}

}  // namespace depthkit::cli
