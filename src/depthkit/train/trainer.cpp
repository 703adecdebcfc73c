#include "depthkit/train/trainer.h"

#include <ATen/TensorOperators.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/dist/world.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/evaluate.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/train/schedule.h"
#include "depthkit/util/device.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/hash.h"
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
  require_directory(run_dir, "a run directory");
  const fs::path p = run_dir / "config.toml";
  if (!fs::exists(p)) fail(p.string(), ": not found (is '", run_dir.string(), "' a run directory?)");
  return Config::load(p.string(), overrides);
}

std::string process_group_backend(const TrainConfig& train) {
  if (train.backend == "auto") return train.device == "cuda" ? "nccl" : "gloo";
  if (train.backend == "nccl" && train.device != "cuda")
    fail("train.backend = \"nccl\" needs train.device = \"cuda\" (NCCL moves CUDA tensors only); use \"gloo\" or \"auto\"");
  return train.backend;
}

namespace {

// What a job starts from that can be found wrong without a lock and without writing: a fresh run
// into a directory with checkpoints, a resume without one, the device, the data (meta.json, the
// shards, the evaluation windows' ids against the vocabulary).
struct StartInputs {
  at::Device device;
  TokenDataset train_data, val_data;
  std::vector<at::Tensor> val_batches;
};

StartInputs open_start_inputs(const TrainOptions& opt, int64_t local_rank) {
  const Config& cfg = opt.config;
  if (!opt.resume && holds_checkpoints(opt.run_dir))  // checked again under the run directory's lock
    fail(opt.run_dir.string(), ": run directory already has checkpoints (pass --resume, or choose another --run-dir)");
  // The model's device: the CPU, or this rank's GPU (LOCAL_RANK) for train.device = "cuda".
  const at::Device device = resolve_device(cfg.train.device, local_rank);
  check_data_meta(cfg);
  TokenDataset train_data(cfg.data.dir, "train", cfg.model.vocab_size);
  TokenDataset val_data(cfg.data.dir, "val", cfg.model.vocab_size);
  auto val_batches = eval_batches(val_data, cfg.train.micro_batch, cfg.model.seq_len, cfg.train.eval_tokens);
  if (opt.resume && !find_checkpoint(opt.run_dir))
    fail(opt.run_dir.string(), ": --resume given but the run has no checkpoint");
  return {device, std::move(train_data), std::move(val_data), std::move(val_batches)};
}

// A resumed run's checkpoint against the job that resumes it: the seed, the data position, and the
// global batch (ranks x grad_accum x micro_batch), which fixes every step's gradient. Returns
// whether the run is already complete (nothing to train).
bool check_resume(const TrainOptions& opt, const TrainerState& state, const fs::path& checkpoint_dir,
                  const TokenDataset& train_data, int64_t ranks) {
  const Config& cfg = opt.config;
  const std::string state_path = (checkpoint_dir / "state.json").string();
  if (state.seed != cfg.train.seed)
    fail(opt.run_dir.string(), ": train.seed ", cfg.train.seed, " differs from the checkpoint's seed ", state.seed);
  if (state.data.index > train_data.windows(cfg.model.seq_len))
    fail(state_path, ": field 'data.index' (", state.data.index, ") exceeds the ", train_data.windows(cfg.model.seq_len),
         " windows of the training split");
  // Nothing left to train: report it and leave every file of the run as it is. (Without a
  // summary of this step the run died between its final checkpoint and its summary: that
  // is finished by the run.)
  const bool complete = state.step >= cfg.total_steps(ranks) && summary_step(opt.run_dir) == state.step;
  const int64_t global_batch = ranks * cfg.train.grad_accum * cfg.train.micro_batch;
  if (!complete && state.global_batch != 0 && state.global_batch != global_batch) {
    const int64_t per_rank = ranks * cfg.train.micro_batch;
    fail(state_path, ": the run was trained with a global batch of ", state.global_batch, " sequences a step; ", ranks,
         " ranks x train.grad_accum ", cfg.train.grad_accum, " x train.micro_batch ", cfg.train.micro_batch, " make ",
         global_batch,
         state.global_batch % per_rank == 0 ? cat(" (resume it with --set train.grad_accum=", state.global_batch / per_rank, ")")
                                            : std::string(" (keep the product of the three)"));
  }
  return complete;
}

// What every rank must start from alike, beyond the config: the data (meta.json and each shard's
// name and token count; data.dir itself may differ between machines) and, when resuming, the
// checkpoint (its state.json).
World::Facts data_facts(const Config& cfg, const TokenDataset& train_data, const TokenDataset& val_data) {
  std::string listing;
  const fs::path meta = fs::path(cfg.data.dir) / "meta.json";
  if (fs::is_regular_file(meta)) listing = read_file(meta, 64u << 20);
  for (const TokenDataset* split : {&train_data, &val_data})
    for (const Shard& s : split->shards()) listing += cat("\n", fs::path(s.path()).filename().string(), " ", s.size());
  return {{"data (meta.json, shard names and sizes)", fingerprint(listing)}};
}

// The resolved config, key by key, as every rank must have it: all but data.dir (the data is
// compared by content, and may sit elsewhere on another machine) and train.threads (a rank's own
// share of its machine).
World::Facts config_facts(const Config& cfg) {
  World::Facts facts;
  for (auto& [key, value] : cfg.values())
    if (key != "data.dir" && key != "train.threads") facts.emplace_back(key, value);
  return facts;
}

// One rank's part of the job (all of it in a job of one).
TrainResult train_rank(const TrainOptions& opt, World& world) {
  Config cfg = opt.config;
  const fs::path& run_dir = opt.run_dir;
  const bool root = world.root();
  const int64_t ranks = world.size();
  if (!root) Progress::set_enabled(false);  // rank 0 speaks for the job
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  // Open and check everything that can fail on bad input before anything is written. Every rank
  // checks for itself (each reads the same files), so each fails alike.
  const int64_t total = cfg.total_steps(ranks);
  const int64_t T = cfg.model.seq_len;
  const int64_t global_batch = ranks * cfg.train.grad_accum * cfg.train.micro_batch;
  StartInputs inputs = open_start_inputs(opt, opt.launch.local_rank);
  const at::Device device = inputs.device;
  const TokenDataset& train_data = inputs.train_data;
  const auto& val_batches = inputs.val_batches;

  // One process at a time owns a run directory (its lock): rank 0. A fresh run creates it.
  std::error_code ec;
  bool created = false;
  std::optional<DirectoryLock> lock;
  std::optional<Checkpoint> ckpt;
  bool complete = false;
  std::exception_ptr error;
  if (root) {
    try {
      if (run_dir.has_parent_path()) fs::create_directories(run_dir.parent_path());
      created = fs::create_directory(run_dir);  // true only for the call that made it
      lock.emplace(run_dir);
      if (opt.resume) {
        ckpt = load_checkpoint(*find_checkpoint(run_dir), true);  // under the lock: the current latest
      } else if (holds_checkpoints(run_dir)) {
        fail(run_dir.string(), ": run directory already has checkpoints (pass --resume, or choose another --run-dir)");
      }
      if (ckpt) complete = check_resume(opt, ckpt->state, ckpt->dir, train_data, ranks);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // From here on, a job that fails before its first checkpoint (bad input on any rank, a shard
  // that changed, a rank that died) leaves no half-made run directory behind: rank 0 removes the
  // one it created, while it holds the lock, or puts back the files it changed in an existing
  // one. A run that diverges keeps its directory: its metrics show how.
  bool saved = false, diverged = false, touched = false;
  const fs::path config_path = run_dir / "config.toml", metrics_path = run_dir / "metrics.jsonl";
  std::optional<std::string> old_config, old_metrics;
  if (lock && !error) {
    if (fs::exists(config_path)) old_config = read_file(config_path);
    if (fs::exists(metrics_path)) old_metrics = read_file(metrics_path);
  }
  try {
    world.agree(!error, "start-up", error ? World::Facts{} : data_facts(cfg, train_data, inputs.val_data));
    if (error) std::rethrow_exception(error);
    // Every rank resumes from the checkpoint rank 0 chose under the lock.
    at::Tensor chosen = at::empty({2}, at::kLong);
    chosen.data_ptr<int64_t>()[0] = ckpt ? ckpt->state.step : -1;
    chosen.data_ptr<int64_t>()[1] = complete;
    world.broadcast(chosen);
    const int64_t resume_step = chosen.data_ptr<int64_t>()[0];
    if (chosen.data_ptr<int64_t>()[1]) {
      TrainResult done;
      done.step = resume_step;
      done.complete = true;
      return done;
    }

    std::optional<Transformer> model_slot;
    std::optional<AdamW> optim_slot;
    TrainerState st;
    int64_t memory_base = 0;
    try {
      if (!root && resume_step >= 0) ckpt = load_checkpoint(*find_checkpoint(run_dir, checkpoint_name(resume_step)), true);
      // Weights, gradients and two AdamW moments, all float32, before a byte of them is allocated.
      Transformer::check_fits_in_memory(cfg.model, cfg.residual, 16, "training the model");
      TensorMemory::install();  // counts from here: the model, its optimizer state, every step
      memory_base = TensorMemory::current_bytes();
      TensorMemory::reset_peak();
      reset_device_peak(device);
      model_slot.emplace(cfg.model, cfg.residual, device, uint64_t(cfg.train.seed), at::kFloat, compute_dtype_of(cfg.train));
      const std::vector<int64_t> sizes = AdamW::sizes(model_slot->parameters());
      optim_slot.emplace(model_slot->parameters(), cfg.optim,
                         ParameterShard::of(sizes, cfg.train.zero ? world.rank() : 0, cfg.train.zero ? ranks : 1));
      st.seed = cfg.train.seed;
      if (ckpt) {
        model_slot->parameters().load(ckpt->model.tensors, (ckpt->dir / "model.safetensors").string());
        optim_slot->load_state(ckpt->optimizer.tensors, (ckpt->dir / "optimizer.safetensors").string());
        st = ckpt->state;
        restore_rng_state(st.rng_state, (ckpt->dir / "state.json").string());
      }
    } catch (...) {
      error = std::current_exception();
    }
    // Every rank loaded the same checkpoint (rank 0's choice, by name; its bytes the same).
    World::Facts loaded;
    if (ckpt && !error) loaded = {{"checkpoint (state.json)", fingerprint(read_file(ckpt->dir / "state.json", 64u << 20))}};
    world.agree(!error, "start-up", loaded);
    if (error) std::rethrow_exception(error);
    Transformer& model = *model_slot;
    AdamW& optim = *optim_slot;
    // Every rank starts from rank 0's parameters (they agree already: same seed, same checkpoint).
    for (const auto& p : model.parameters().all()) {
      at::Tensor data = p.tensor.detach();
      world.broadcast(data);
    }
    std::vector<at::Tensor> param_tensors;
    for (const auto& p : model.parameters().all()) param_tensors.push_back(p.tensor);
    const std::unique_ptr<GradientReducer> reducer = world.gradient_reducer(param_tensors);
    const bool sharded = cfg.train.zero && ranks > 1;

    const int64_t data_seed = cfg.train.data_seed >= 0 ? cfg.train.data_seed : cfg.train.seed;
    BatchLoader loader(train_data, cfg.train.micro_batch, T, uint64_t(data_seed), st.data);
    LoggedStep logged;
    std::optional<MetricsLog> metrics;
    if (root) {
      touched = true;
      write_file_atomic(config_path, cfg.to_toml());
      logged = truncate_metrics(metrics_path, st.step);
      metrics.emplace(metrics_path);
    }
    if (Progress::enabled()) {
      std::fprintf(stderr, "run directory %s: %s, %lld steps of %lld tokens%s%s\n", run_dir.c_str(),
                   cfg.residual.kind.c_str(), (long long)total, (long long)cfg.tokens_per_step(ranks),
                   ranks > 1 ? cat(" on ", ranks, " ranks (", process_group_backend(cfg.train), ")").c_str() : "",
                   ckpt ? cat(", resuming at step ", st.step).c_str() : "");
      if (cfg.train.zero)
        std::fprintf(stderr, "ZeRO-1: AdamW state of %lld of %lld parameters per rank, %lld bytes\n",
                     (long long)(optim.shard().end - optim.shard().begin), (long long)optim.total_elements(),
                     (long long)optim.state_bytes());
    }
    auto log = [&](const nlohmann::json& j) {
      if (metrics) metrics->write(j);
    };

    // The optimizer's full state for a checkpoint: gathered from every rank's shard under ZeRO-1.
    auto optimizer_state = [&]() {
      if (!sharded) return optim.state();
      const ParameterShard& shard = optim.shard();
      return optim.state(shard.unpad(world.all_gather(optim.exp_avg())), shard.unpad(world.all_gather(optim.exp_avg_sq())));
    };
    auto checkpoint = [&]() {
      st.data = loader.position();
      st.rng_state = capture_rng_state();
      st.config_toml = cfg.to_toml();
      st.global_batch = global_batch;
      const NamedTensors optimizer = optimizer_state();  // collective: every rank takes part
      if (root) save_checkpoint(run_dir, model, optimizer, st, cfg.train.keep_checkpoints);
      saved = true;
    };
    auto run_eval = [&](int64_t step) {
      const LossSum share = evaluate_share(model, val_batches, world.rank(), ranks);
      at::Tensor sum = at::empty({2}, at::kDouble);
      sum.data_ptr<double>()[0] = share.loss;
      sum.data_ptr<double>()[1] = double(share.tokens);
      world.all_reduce_sum(sum);
      const double v = sum.data_ptr<double>()[0] / sum.data_ptr<double>()[1];
      log({{"step", step}, {"val_loss", v}, {"val_ppl", std::exp(v)}});
      return v;
    };

    TrainResult result;
    result.step = st.step;
    Progress bar("train", total, "tok");
    const int64_t tokens_per_step = cfg.tokens_per_step(ranks);
    const auto t0 = std::chrono::steady_clock::now();
    double last_val = -1;
    double step_seconds = 0;  // training steps only (not evaluations or checkpoints)
    while (st.step < total) {
      world.set_step(st.step);
      const auto step_start = std::chrono::steady_clock::now();
      const double lr = learning_rate(cfg.optim, st.step, total);
      model.parameters().zero_grad();
      double loss_sum = 0;
      const bool log_step = (st.step + 1) % cfg.train.log_every == 0 || st.step + 1 == total;
      // MoE (docs/design.md, "Mixture of experts"): the micro-steps' LM loss, auxiliary loss, mean
      // balance term and per-layer expert load (max over mean share), averaged for the log; read
      // (a device sync each) on the steps that are logged only.
      const bool moe = cfg.model.moe.enabled() && log_step;
      std::vector<double> moe_sum;
      for (int64_t m = 0; m < cfg.train.grad_accum; ++m) {
        // Micro-step m of rank r is micro-batch m·ranks + r of the step's global order.
        const at::Tensor batch = loader.next(world.rank(), ranks).to(device);
        reducer->begin_micro_step(m == cfg.train.grad_accum - 1);
        at::Tensor loss = model.loss(batch) / double(cfg.train.grad_accum);
        reducer->before_backward();
        try {
          loss.backward();
        } catch (const std::exception& e) {
          // The last micro-step's backward also averages the gradients across ranks: a failure
          // there that is not this rank's own (an allocation) is the collective's.
          if (ranks > 1 && m == cfg.train.grad_accum - 1 && !is_out_of_memory(e) && !dynamic_cast<const Error*>(&e))
            throw CollectiveError(one_line(e));
          throw;
        }
        loss_sum += loss.item<double>();
        if (moe) {
          const MoeTerms& t = model.moe_terms();
          std::vector<double> v = {t.lm_loss.item<double>(), t.aux_loss.item<double>(), t.balance.item<double>()};
          for (double x : t.load_max_over_mean()) v.push_back(x);
          moe_sum.resize(v.size(), 0.0);
          for (size_t i = 0; i < v.size(); ++i) moe_sum[i] += v[i] / double(cfg.train.grad_accum);
        }
      }
      // The step's loss over all ranks, and whether any rank was asked to stop (a signal reaches
      // the ranks at different steps; they stop together).
      at::Tensor shared = at::empty({2 + int64_t(moe_sum.size())}, at::kDouble);
      shared.data_ptr<double>()[0] = loss_sum;
      shared.data_ptr<double>()[1] = g_stop_signal.load() != 0 ? 1.0 : 0.0;
      for (size_t i = 0; i < moe_sum.size(); ++i) shared.data_ptr<double>()[2 + i] = moe_sum[i];
      world.all_reduce_sum(shared);
      loss_sum = shared.data_ptr<double>()[0] / double(ranks);
      for (size_t i = 0; i < moe_sum.size(); ++i) moe_sum[i] = shared.data_ptr<double>()[2 + i] / double(ranks);
      const bool signalled = shared.data_ptr<double>()[1] > 0;
      const double gnorm = clip_grad_norm(model.parameters(), cfg.optim.grad_clip);
      if (!std::isfinite(loss_sum) || !std::isfinite(gnorm)) {
        diverged = true;
        auto last = find_checkpoint(run_dir);
        fail("non-finite ", std::isfinite(loss_sum) ? "gradient norm" : "loss", " at step ", st.step + 1,
             " (loss ", loss_sum, ", grad norm ", gnorm, "); stopping. Last good checkpoint: ",
             last ? last->string() : "none");
      }
      optim.step(lr);
      if (sharded) optim.set_parameters(optim.shard().unpad(world.all_gather(optim.shard_of_parameters())));  // ZeRO-1
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      ++st.step;
      st.tokens_seen += tokens_per_step;
      result.losses.push_back(loss_sum);
      result.last_loss = loss_sum;

      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (log_step) {
        nlohmann::json j = {{"step", st.step}, {"loss", loss_sum}, {"lr", lr}, {"grad_norm", gnorm},
                            {"tokens", st.tokens_seen}, {"elapsed_s", elapsed}};
        if (moe) {  // "loss" is the optimised total: lm_loss + aux_loss
          j["lm_loss"] = moe_sum[0];
          j["aux_loss"] = moe_sum[1];
          j["balance"] = moe_sum[2];
          j["expert_load"] = std::vector<double>(moe_sum.begin() + 3, moe_sum.end());
        }
        log(j);
      }
      char status[96];
      std::snprintf(status, sizeof status, "loss %.4f lr %.2e%s", loss_sum, lr,
                    last_val >= 0 ? cat(" val ", std::round(last_val * 1e4) / 1e4).c_str() : "");
      bar.update(st.step, double(st.tokens_seen), status);

      if (cfg.train.eval_every > 0 && st.step % cfg.train.eval_every == 0 && st.step != total)
        last_val = run_eval(st.step);
      const bool stop = signalled || st.step == opt.stop_after;
      if (stop || st.step == total ||
          (cfg.train.checkpoint_every > 0 && st.step % cfg.train.checkpoint_every == 0))
        checkpoint();
      if (stop && st.step != total) {
        bar.finish("interrupted");
        if (root)
          std::fprintf(stderr, "stopped at step %lld; checkpoint saved, continue with --resume\n", (long long)st.step);
        result.interrupted = true;
        result.signal = g_stop_signal.load() ? g_stop_signal.load() : (signalled ? SIGINT : 0);
        result.step = st.step;
        return result;
      }
    }
    // A run finished by --resume after dying past its final checkpoint reuses what it logged
    // (rank 0 read it; the others only need to take part in the evaluation when there is one).
    at::Tensor reuse = at::empty({1}, at::kLong);
    reuse.data_ptr<int64_t>()[0] = result.losses.empty() && logged.val_loss ? 1 : 0;
    world.broadcast(reuse);
    if (result.losses.empty() && logged.loss) result.last_loss = *logged.loss;
    result.val_loss = reuse.data_ptr<int64_t>()[0] ? logged.val_loss.value_or(-1) : run_eval(st.step);
    bar.finish(cat("loss ", result.last_loss, " val ", result.val_loss));
    result.step = st.step;
    if (!root) return result;
    // Throughput of the job and peak memory of this process (after a resume: of the resumed part only).
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
                              {"val_ppl", std::exp(result.val_loss)},
                              {"device", cfg.train.device},
                              {"dtype", cfg.train.dtype},
                              {"world_size", ranks},
                              {"global_batch", global_batch},
                              {"zero", cfg.train.zero},
                              {"optimizer_state_bytes_per_rank", optim.state_bytes()}};
    if (step_seconds > 0) {  // measured only when this process trained (not when it only finished)
      summary["tokens_per_s"] = tokens_here / step_seconds;
      summary["peak_tensor_bytes"] = TensorMemory::peak_bytes() - memory_base;  // CPU tensors
      if (!device.is_cpu()) summary["peak_device_bytes"] = device_peak_bytes(device);  // max_memory_allocated
      summary["peak_rss_bytes"] = peak_rss_bytes();
    }
    write_file_atomic(run_dir / "summary.json", summary.dump(2) + "\n");
    return result;
  } catch (...) {
    if (lock && !saved && !diverged) {
      if (created) {
        fs::remove_all(run_dir, ec);
      } else if (touched) {  // a resumed run: config.toml and metrics.jsonl as they were
        if (old_config) write_file_atomic(config_path, *old_config);
        if (old_metrics) write_file_atomic(metrics_path, *old_metrics);
      }
    }
    throw;
  }
}

}  // namespace

void check_job_start(const TrainOptions& opt, int64_t ranks) {
  process_group_backend(opt.config.train);
  // Every rank is local: the last one needs the most GPUs.
  const StartInputs inputs = open_start_inputs(opt, ranks - 1);
  Transformer::check_fits_in_memory(opt.config.model, opt.config.residual, 16, "training the model");
  if (fs::is_directory(opt.run_dir)) DirectoryLock probe(opt.run_dir);  // taken and let go: is it free?
  if (opt.resume) {
    const fs::path dir = *find_checkpoint(opt.run_dir);
    check_resume(opt, load_trainer_state(dir), dir, inputs.train_data, ranks);
  }
}

TrainResult train(const TrainOptions& opt) {
  const LaunchEnv& launch = opt.launch;
  if (launch.world_size == 1) {
    World one;
    return train_rank(opt, one);
  }
  World world(launch, process_group_backend(opt.config.train), opt.config.train.timeout_s, config_facts(opt.config));
  try {
    return train_rank(opt, world);
  } catch (...) {
    world.fail_job(std::current_exception());
  }
}

}  // namespace depthkit
