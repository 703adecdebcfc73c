#include "depthkit/train/trainer.h"

#include <ATen/TensorOperators.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/evaluate.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/train/schedule.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"
#include "depthkit/util/memory.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {

std::atomic<int> g_stop_signal{0};
void on_signal(int sig) { g_stop_signal.store(sig); }

// What metrics.jsonl already holds for the checkpoint's step.
struct LoggedStep {
  std::optional<double> loss, val_loss;
};

// Drops metrics of steps after `step` (left by a run that died after its last checkpoint) and
// returns what is logged for `step` itself.
LoggedStep truncate_metrics(const fs::path& path, int64_t step) {
  LoggedStep logged;
  if (!fs::exists(path)) return logged;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    const bool has_step = !j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer();
    if (has_step && j["step"].get<int64_t>() > step) continue;
    kept += line + "\n";
    if (has_step && j["step"].get<int64_t>() == step) {
      if (j.contains("loss") && j["loss"].is_number()) logged.loss = j["loss"].get<double>();
      if (j.contains("val_loss") && j["val_loss"].is_number()) logged.val_loss = j["val_loss"].get<double>();
    }
  }
  write_file_atomic(path, kept);
  return logged;
}

class MetricsLog {
 public:
  explicit MetricsLog(const fs::path& path) : out_(path, std::ios::app) {
    if (!out_) fail(path.string(), ": cannot open for appending");
  }
  void write(const nlohmann::json& j) {
    out_ << j.dump() << "\n";
    out_.flush();
  }

 private:
  std::ofstream out_;
};

}  // namespace

void install_stop_signals() {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
}

namespace {

// The step of the run's summary.json, or -1 when there is none (or it is unreadable).
int64_t summary_step(const fs::path& run_dir) {
  const fs::path path = run_dir / "summary.json";
  if (!fs::is_regular_file(path)) return -1;
  const nlohmann::json j = nlohmann::json::parse(read_file(path, 64u << 20), nullptr, false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<int64_t>() : -1;
}

}  // namespace

void check_data_meta(const Config& cfg) {
  const fs::path meta_path = fs::path(cfg.data.dir) / "meta.json";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(meta_path, ec))) return;  // shards from elsewhere carry none
  const nlohmann::json meta = nlohmann::json::parse(read_file(meta_path, 64u << 20), nullptr, false);
  if (meta.is_discarded()) fail(meta_path.string(), ": not valid JSON");
  if (!meta.is_object()) fail(meta_path.string(), ": not a JSON object");
  if (!meta.contains("vocab_size")) return;
  const nlohmann::json& v = meta["vocab_size"];
  if (!v.is_number_unsigned() || v.get<uint64_t>() > uint64_t(INT64_MAX))
    fail(meta_path.string(), ": field 'vocab_size' must be a non-negative integer, got ", json_excerpt(v));
  if (v.get<int64_t>() > cfg.model.vocab_size)
    fail(meta_path.string(), ": vocab_size ", v.get<int64_t>(), " exceeds model.vocab_size ", cfg.model.vocab_size);
}

Config load_run_config(const fs::path& run_dir, const std::vector<std::string>& overrides) {
  const fs::path p = run_dir / "config.toml";
  if (!fs::exists(p)) fail(p.string(), ": not found (is '", run_dir.string(), "' a run directory?)");
  return Config::load(p.string(), overrides);
}

TrainResult train(const TrainOptions& opt) {
  Config cfg = opt.config;
  const fs::path& run_dir = opt.run_dir;
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  // Open and check everything that can fail on bad input before anything is written.
  const int64_t total = cfg.total_steps();
  const int64_t T = cfg.model.seq_len;
  if (!opt.resume && holds_checkpoints(run_dir))  // checked again under the run directory's lock
    fail(run_dir.string(), ": run directory already has checkpoints (pass --resume, or choose another --run-dir)");
  check_data_meta(cfg);
  TokenDataset train_data(cfg.data.dir, "train", cfg.model.vocab_size);
  TokenDataset val_data(cfg.data.dir, "val", cfg.model.vocab_size);
  auto val_batches = eval_batches(val_data, cfg.train.micro_batch, T, cfg.train.eval_tokens);

  // One process at a time owns a run directory (its lock). A fresh run creates it; when this call
  // fails on bad input before its first checkpoint, a directory it created is removed (while it
  // still holds the lock), and in an existing one the files it changed are put back.
  if (opt.resume && !find_checkpoint(run_dir))
    fail(run_dir.string(), ": --resume given but the run has no checkpoint");
  std::error_code ec;
  if (run_dir.has_parent_path()) fs::create_directories(run_dir.parent_path());
  const bool created = fs::create_directory(run_dir);  // true only for the call that made it
  std::optional<DirectoryLock> lock;
  std::optional<Checkpoint> ckpt;
  std::optional<Transformer> model_slot;
  std::optional<AdamW> optim_slot;
  TrainerState st;
  int64_t memory_base = 0;
  try {
    lock.emplace(run_dir);
    if (opt.resume) {
      ckpt = load_checkpoint(*find_checkpoint(run_dir), true);  // under the lock: the current latest
    } else if (holds_checkpoints(run_dir)) {
      fail(run_dir.string(), ": run directory already has checkpoints (pass --resume, or choose another --run-dir)");
    }
    if (ckpt) {
      const std::string state_path = (ckpt->dir / "state.json").string();
      if (ckpt->state.seed != cfg.train.seed)
        fail(run_dir.string(), ": train.seed ", cfg.train.seed, " differs from the checkpoint's seed ", ckpt->state.seed);
      if (ckpt->state.data.index > train_data.windows(T))
        fail(state_path, ": field 'data.index' (", ckpt->state.data.index, ") exceeds the ",
             train_data.windows(T), " windows of the training split");
      if (ckpt->state.step >= total && summary_step(run_dir) == ckpt->state.step) {
        // Nothing left to train: report it and leave every file of the run as it is. (Without a
        // summary of this step the run died between its final checkpoint and its summary: that
        // is finished below.)
        TrainResult done;
        done.step = ckpt->state.step;
        done.complete = true;
        return done;
      }
    }
    // Weights, gradients and two AdamW moments, all float32, before a byte of them is allocated.
    Transformer::check_fits_in_memory(cfg.model, cfg.residual, 16, "training the model");
    TensorMemory::install();  // counts from here: the model, its optimizer state, every step
    memory_base = TensorMemory::current_bytes();
    TensorMemory::reset_peak();
    model_slot.emplace(cfg.model, cfg.residual, at::kCPU, uint64_t(cfg.train.seed), at::kFloat, compute_dtype_of(cfg.train));
    optim_slot.emplace(model_slot->parameters(), cfg.optim);
    st.seed = cfg.train.seed;
    if (ckpt) {
      model_slot->parameters().load(ckpt->model.tensors, (ckpt->dir / "model.safetensors").string());
      optim_slot->load_state(ckpt->optimizer.tensors, (ckpt->dir / "optimizer.safetensors").string());
      st = ckpt->state;
      restore_rng_state(st.rng_state, (ckpt->dir / "state.json").string());
    }
  } catch (...) {
    if (created && lock) fs::remove_all(run_dir, ec);
    throw;
  }
  Transformer& model = *model_slot;
  AdamW& optim = *optim_slot;
  // A fresh run that fails on bad input before its first checkpoint (a token id past the
  // vocabulary in a window, a shard that changed) leaves no half-made run directory behind. A run
  // that diverges keeps its directory: its metrics show how.
  bool saved = false, diverged = false;
  const fs::path config_path = run_dir / "config.toml", metrics_path = run_dir / "metrics.jsonl";
  std::optional<std::string> old_config, old_metrics;
  if (fs::exists(config_path)) old_config = read_file(config_path);
  if (fs::exists(metrics_path)) old_metrics = read_file(metrics_path);
  try {
    const int64_t data_seed = cfg.train.data_seed >= 0 ? cfg.train.data_seed : cfg.train.seed;
    BatchLoader loader(train_data, cfg.train.micro_batch, T, uint64_t(data_seed), st.data);
    write_file_atomic(config_path, cfg.to_toml());
    const LoggedStep logged = truncate_metrics(metrics_path, st.step);
    if (Progress::enabled())
      std::fprintf(stderr, "run directory %s: %s, %lld steps of %lld tokens%s\n", run_dir.c_str(),
                   cfg.residual.kind.c_str(), (long long)total, (long long)cfg.tokens_per_step(),
                   ckpt ? cat(", resuming at step ", st.step).c_str() : "");
    MetricsLog metrics(metrics_path);

    auto checkpoint = [&]() {
      st.data = loader.position();
      st.rng_state = capture_rng_state();
      st.config_toml = cfg.to_toml();
      fs::path dir = save_checkpoint(run_dir, model, optim, st, cfg.train.keep_checkpoints);
      saved = true;
      return dir;
    };
    auto run_eval = [&](int64_t step) {
      double v = evaluate(model, val_batches);
      metrics.write({{"step", step}, {"val_loss", v}, {"val_ppl", std::exp(v)}});
      return v;
    };

    TrainResult result;
    result.step = st.step;
    Progress bar("train", total, "tok");
    const int64_t tokens_per_step = cfg.tokens_per_step();
    const auto t0 = std::chrono::steady_clock::now();
    double last_val = -1;
    double step_seconds = 0;  // training steps only (not evaluations or checkpoints)
    while (st.step < total) {
      const auto step_start = std::chrono::steady_clock::now();
      const double lr = learning_rate(cfg.optim, st.step, total);
      model.parameters().zero_grad();
      double loss_sum = 0;
      for (int64_t m = 0; m < cfg.train.grad_accum; ++m) {
        at::Tensor loss = model.loss(loader.next()) / double(cfg.train.grad_accum);
        loss.backward();
        loss_sum += loss.item<double>();
      }
      const double gnorm = clip_grad_norm(model.parameters(), cfg.optim.grad_clip);
      if (!std::isfinite(loss_sum) || !std::isfinite(gnorm)) {
        diverged = true;
        auto last = find_checkpoint(run_dir);
        fail("non-finite ", std::isfinite(loss_sum) ? "gradient norm" : "loss", " at step ", st.step + 1,
             " (loss ", loss_sum, ", grad norm ", gnorm, "); stopping. Last good checkpoint: ",
             last ? last->string() : "none");
      }
      optim.step(lr);
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      ++st.step;
      st.tokens_seen += tokens_per_step;
      result.losses.push_back(loss_sum);
      result.last_loss = loss_sum;

      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (st.step % cfg.train.log_every == 0 || st.step == total)
        metrics.write({{"step", st.step}, {"loss", loss_sum}, {"lr", lr}, {"grad_norm", gnorm},
                       {"tokens", st.tokens_seen}, {"elapsed_s", elapsed}});
      char status[96];
      std::snprintf(status, sizeof status, "loss %.4f lr %.2e%s", loss_sum, lr,
                    last_val >= 0 ? cat(" val ", std::round(last_val * 1e4) / 1e4).c_str() : "");
      bar.update(st.step, double(st.tokens_seen), status);

      if (cfg.train.eval_every > 0 && st.step % cfg.train.eval_every == 0 && st.step != total)
        last_val = run_eval(st.step);
      const bool stop = g_stop_signal.load() != 0 || st.step == opt.stop_after;
      if (stop || st.step == total ||
          (cfg.train.checkpoint_every > 0 && st.step % cfg.train.checkpoint_every == 0))
        checkpoint();
      if (stop && st.step != total) {
        bar.finish("interrupted");
        std::fprintf(stderr, "stopped at step %lld; checkpoint saved, continue with --resume\n", (long long)st.step);
        result.interrupted = true;
        result.signal = g_stop_signal.load();
        result.step = st.step;
        return result;
      }
    }
    // A run finished by --resume after dying past its final checkpoint reuses what it logged.
    if (result.losses.empty() && logged.loss) result.last_loss = *logged.loss;
    result.val_loss = result.losses.empty() && logged.val_loss ? *logged.val_loss : run_eval(st.step);
    bar.finish(cat("loss ", result.last_loss, " val ", result.val_loss));
    result.step = st.step;
    // Throughput and peak memory of this process (after a resume: of the resumed part only).
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tokens_here = double(int64_t(result.losses.size()) * tokens_per_step);
    int64_t val_tokens = 0;
    for (const at::Tensor& b : val_batches) val_tokens += b.size(0) * (b.size(1) - 1);
    nlohmann::json summary = {{"step", st.step},
                              {"tokens_seen", st.tokens_seen},
                              {"train_seconds", seconds},
                              {"train_loss", result.last_loss},
                              {"val_loss", result.val_loss},
                              {"val_tokens", val_tokens},
                              {"val_ppl", std::exp(result.val_loss)}};
    if (step_seconds > 0) {  // measured only when this process trained (not when it only finished)
      summary["tokens_per_s"] = tokens_here / step_seconds;
      summary["peak_tensor_bytes"] = TensorMemory::peak_bytes() - memory_base;
      summary["peak_rss_bytes"] = peak_rss_bytes();
    }
    write_file_atomic(run_dir / "summary.json", summary.dump(2) + "\n");
    return result;
  } catch (...) {
    if (!saved && !diverged) {
      if (created) {
        fs::remove_all(run_dir, ec);
      } else {  // a resumed run: config.toml and metrics.jsonl as they were
        if (old_config) write_file_atomic(config_path, *old_config);
        if (old_metrics) write_file_atomic(metrics_path, *old_metrics);
      }
    }
    throw;
  }
}

}  // namespace depthkit
