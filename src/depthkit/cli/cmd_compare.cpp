// depthkit compare: train and compare pathway runs from a spec (analysis/compare.h).
#include <unistd.h>

#include <cstdio>

#include "depthkit/analysis/compare.h"
#include "depthkit/cli/commands.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/process.h"

namespace depthkit::cli {

void add_compare(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("compare", "train the runs of a spec on one backbone, data order and budget; tabulate");
  struct Args {
    std::string spec, out;
    std::vector<std::string> sets;
    bool resume = false, json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--spec", a->spec, "comparison spec (TOML; see specs/)")->required();
  cmd->add_option("--out", a->out, "output directory (default runs/compare/<spec name>)");
  add_set_option(cmd, a->sets)->description("override a config key for every run: section.key=value (repeatable)");
  cmd->add_flag("--resume", a->resume, "continue a comparison: finished runs are kept, interrupted ones resumed");
  cmd->add_flag("--json", a->json, "print results.json");
  cmd->callback([&action, a] {
    action = [a] {
      CompareOptions opt;
      opt.spec = load_compare_spec(a->spec, a->sets);
      opt.out = a->out.empty() ? fs::path("runs") / "compare" / fs::path(a->spec).stem() : fs::path(a->out);
      opt.resume = a->resume;
      opt.executable = depthkit_program();
      const auto results = run_compare(opt);
      if (a->json) std::printf("%s\n", results.dump().c_str());
      else std::printf("%s\nwritten: %s/{results.json,table.md,loss_curves.png%s}\n", compare_table(results).c_str(),
                       opt.out.c_str(), fs::exists(opt.out / "aux_curves.png") ? ",aux_curves.png" : "");
      return 0;
    };
  });
}

}  // namespace depthkit::cli
