// depthkit train: train a model from a TOML config (or resume a run).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/dist/launch.h"
#include "depthkit/model/config_check.h"
#include "depthkit/train/trainer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit::cli {

namespace {

struct TrainArgs : ConfigArgs {
  std::string run_dir;
  bool resume = false;
  int64_t nproc = 0;        // > 0: launch this many local ranks (for users without torchrun)
  int64_t stop_after = -1;  // stop with a checkpoint after this step, as if interrupted
};

// This command line without its --nproc option: what each launched rank runs.
std::vector<std::string> rank_command_line() {
  std::vector<std::string> in = own_command_line(), out;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == "--nproc") {
      ++i;
      continue;
    }
    if (in[i].starts_with("--nproc=")) continue;
    out.push_back(in[i]);
  }
  return out;
}

int run_train(const TrainArgs& a) {
  TrainOptions opt;
  opt.resume = a.resume;
  if (a.resume) {
    if (a.run_dir.empty()) fail("train --resume needs --run-dir");
    if (!a.config.empty()) fail("train --resume uses the run's own config.toml; drop --config (use --set to change keys)");
    opt.run_dir = a.run_dir;
    opt.config = load_run_config(opt.run_dir, a.sets);
  } else {
    if (a.config.empty()) fail("train needs --config (or --resume --run-dir D)");
    opt.config = load_config(a.config, a.sets);
    opt.run_dir = a.run_dir.empty() ? fs::path("runs") / fs::path(a.config).stem() : fs::path(a.run_dir);
  }
  opt.stop_after = a.stop_after;
  opt.launch = LaunchEnv::from_environment();
  if (a.nproc > 0) {
    if (opt.launch.world_size > 1)
      fail("--nproc given inside a launched job (WORLD_SIZE is ", opt.launch.world_size, "): use one launcher");
    // What every rank would find wrong alike (and each report) is found here, once, before any
    // rank starts.
    check_job_start(opt, a.nproc);
    // The launcher waits for its ranks; a rank that fails is noticed by the others within
    // train.timeout_s, and any still running after that (and a margin) are ended.
    return launch_local_ranks(a.nproc, rank_command_line(), opt.config.train.timeout_s + 30);
  }
  install_stop_signals();
  TrainResult r = train(opt);
  if (r.interrupted) return 128 + (r.signal ? r.signal : 2);  // shell convention: 130 SIGINT, 143 SIGTERM
  if (opt.launch.rank != 0) return 0;  // rank 0 reports for the job
  if (r.complete) {
    const int64_t total = opt.config.total_steps(opt.launch.world_size);
    if (a.json)
      std::printf("%s\n", nlohmann::json({{"run_dir", opt.run_dir.string()}, {"step", r.step},
                                          {"total_steps", total}, {"complete", true}}).dump().c_str());
    std::fprintf(stderr, "%s: the run is complete (step %lld of %lld); nothing to train, nothing changed "
                 "(raise train.steps or train.tokens with --set to continue it)\n",
                 opt.run_dir.c_str(), (long long)r.step, (long long)total);
    return 0;
  }
  nlohmann::json j = {{"run_dir", opt.run_dir.string()}, {"step", r.step}, {"train_loss", r.last_loss},
                      {"val_loss", r.val_loss}, {"val_ppl", std::exp(r.val_loss)}};
  const fs::path meta = fs::path(opt.config.data.dir) / "meta.json";
  if (fs::is_regular_file(meta)) {  // checked by the trainer before it started
    auto m = nlohmann::json::parse(read_file(meta, 64u << 20), nullptr, false);
    if (m.is_object() && m.contains("unigram_entropy_nats") && m["unigram_entropy_nats"].is_number())
      j["unigram_entropy_nats"] = m["unigram_entropy_nats"];
  }
  if (a.json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("step %lld: train loss %.4f, validation loss %.4f nats/token (perplexity %.2f)",
                (long long)r.step, r.last_loss, r.val_loss, std::exp(r.val_loss));
    if (j.contains("unigram_entropy_nats"))
      std::printf("; unigram entropy of the corpus %.4f nats/token", j["unigram_entropy_nats"].get<double>());
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void add_train(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("train", "train a model");
  auto a = std::make_shared<TrainArgs>();
  add_config_options(cmd, *a, ConfigFile::optional);
  cmd->add_option("--run-dir", a->run_dir, "run directory (default runs/<config name>)");
  cmd->add_flag("--resume", a->resume, "continue from the run's latest checkpoint");
  cmd->add_flag("--json", a->json, "print the final summary as JSON");
  add_number(cmd, "--nproc", a->nproc, 1, 1024, "start this many ranks on this machine (c10d; or launch with torchrun)");
  add_number(cmd, "--stop-after", a->stop_after, 1, INT64_MAX, "stop with a checkpoint after this step, as if interrupted");
  cmd->callback([&action, a] { action = [a] { return run_train(*a); }; });
}

}  // namespace depthkit::cli
