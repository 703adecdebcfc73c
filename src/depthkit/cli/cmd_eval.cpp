// depthkit eval: validation loss and perplexity of a run's checkpoint; with --task, its accuracy
// on a downstream task (eval/tasks.h, docs/tasks.md).
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/data/loader.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/eval/tasks.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/evaluate.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

namespace {
struct EvalArgs {
  std::string run_dir, data, checkpoint;
  int64_t tokens = 0;
  bool json = false;
  // --task
  std::string task, dev;
  int64_t shots = -1, limit = 0;
  uint64_t seed = 0;
  bool has_seed = false, per_item = false;
};

int run_eval_task(const EvalArgs& a) {
  // The task file first: a malformed line is reported before the model is loaded.
  Task task = load_task(a.task);
  if (!a.dev.empty()) add_dev_file(task, a.dev);
  RunModel run = load_run_model(a.run_dir, a.checkpoint);
  if (run.config.train.threads > 0) at::set_num_threads(int(run.config.train.threads));
  const std::string data_dir = a.data.empty() ? run.config.data.dir : a.data;
  const auto tokenizer = load_data_tokenizer(data_dir, run.config.model.vocab_size);
  TaskOptions opt;
  opt.shots = a.shots;
  opt.limit = a.limit;
  opt.per_item = a.per_item;
  if (a.has_seed) opt.seed = a.seed;
  const TaskResult r = evaluate_task(*run.model, *tokenizer, task, opt);
  nlohmann::json j = r.to_json();
  j["checkpoint"] = run.checkpoint.string();
  j["step"] = run.step;
  // A generated output (--per-item) may end inside a UTF-8 sequence the decoder cut: replaced, not
  // an exception from the dump.
  if (a.json) std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  else std::printf("%s (step %lld) on %s", run.checkpoint.c_str(), (long long)run.step, r.to_text().c_str());
  return 0;
}

int run_eval(const EvalArgs& a) {
  RunModel run = load_run_model(a.run_dir, a.checkpoint);
  const Config& cfg = run.config;
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  const std::string data_dir = a.data.empty() ? cfg.data.dir : a.data;
  TokenDataset val(data_dir, "val", cfg.model.vocab_size);
  const int64_t tokens = a.tokens > 0 ? a.tokens : cfg.train.eval_tokens;
  auto batches = eval_batches(val, cfg.train.micro_batch, cfg.model.seq_len, tokens);
  int64_t n = 0;
  for (auto& b : batches) n += b.size(0) * (b.size(1) - 1);
  const double loss = evaluate(*run.model, batches);
  nlohmann::json j = {{"checkpoint", run.checkpoint.string()}, {"step", run.step}, {"data", data_dir},
                      {"tokens", n}, {"val_loss", loss}, {"val_ppl", std::exp(loss)}};
  if (a.json) std::printf("%s\n", j.dump().c_str());
  else
    std::printf("%s (step %lld): validation loss %.4f, perplexity %.2f over %lld tokens of %s\n",
                run.checkpoint.c_str(), (long long)run.step, loss, std::exp(loss), (long long)n, data_dir.c_str());
  return 0;
}
}  // namespace

void add_eval(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("eval", "evaluate a checkpoint on held-out tokens, or on a task (--task)");
  auto a = std::make_shared<EvalArgs>();
  cmd->add_option("--run-dir", a->run_dir, "run directory")->required();
  cmd->add_option("--data", a->data, "data directory (default: the run's data.dir)");
  cmd->add_option("--checkpoint", a->checkpoint, "checkpoint name, e.g. step_00000100 (default: latest)");
  auto* tokens = add_number(cmd, "--tokens", a->tokens, 1, INT64_MAX, "validation tokens (default: train.eval_tokens)");
  auto* task = cmd->add_option("--task", a->task, "score a task file (JSONL, docs/tasks.md) instead of validation loss");
  tokens->excludes(task);
  cmd->add_option("--dev", a->dev, "a task file whose items join the few-shot pool")->needs(task);
  add_number(cmd, "--shots", a->shots, 0, 1000, "few-shot examples before each item (default: the task's)")->needs(task);
  add_number(cmd, "--limit", a->limit, 1, INT64_MAX, "score only the first N items")->needs(task);
  auto* seed = add_number(cmd, "--seed", a->seed, 0, UINT64_MAX, "seed of the few-shot draws (default: the task's)")->needs(task);
  auto* json_flag = cmd->add_flag("--json", a->json, "print JSON");
  cmd->add_flag("--per-item", a->per_item, "with --json: every scored item's scores and choices (\"per_item\")")
      ->needs(task)
      ->needs(json_flag);
  cmd->callback([&action, a, seed] {
    a->has_seed = seed->count() > 0;
    action = [a] { return a->task.empty() ? run_eval(*a) : run_eval_task(*a); };
  });
}

}  // namespace depthkit::cli
