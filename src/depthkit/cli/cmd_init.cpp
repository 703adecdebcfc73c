// depthkit init: a freshly initialised checkpoint (step 0), without training.
#include <cstdio>

#include "depthkit/cli/commands.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit::cli {

void add_init(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("init", "write a freshly initialised checkpoint");
  struct Args : ConfigArgs {
    std::string out;
    bool force = false;
  };
  auto a = std::make_shared<Args>();
  add_config_options(cmd, *a, ConfigFile::required);
  cmd->add_option("--out", a->out, "checkpoint folder to write (model.safetensors, optimizer.safetensors, state.json)")
      ->required();
  cmd->add_flag("--force", a->force, "replace an existing folder");
  cmd->callback([&action, a] {
    action = [a] {
      Config cfg = load_config(a->config, a->sets);
      const fs::path out = output_directory(a->out, "--out");
      std::error_code ec;
      if (fs::exists(fs::symlink_status(out, ec))) {
        if (!fs::is_directory(out)) fail(out.string(), ": is ", path_kind(out), ", not a checkpoint folder");
        if (!a->force) fail(out.string(), ": already exists (pass --force to replace it)");
        check_only_owned(out, is_checkpoint_file,
                         "a checkpoint folder (model.safetensors, optimizer.safetensors, state.json)");
      }
      Transformer model(cfg.model, cfg.residual, at::kCPU, uint64_t(cfg.train.seed));
      AdamW opt(model.parameters(), cfg.optim);
      TrainerState st;
      st.seed = cfg.train.seed;
      st.config_toml = cfg.to_toml();
      write_checkpoint_dir(out, model, opt.state(), st);
      std::printf("wrote %s: %s, %lld parameters\n", a->out.c_str(), cfg.residual.kind.c_str(),
                  (long long)model.count().total);
      return 0;
    };
  });
}

}  // namespace depthkit::cli
