#include "depthkit/train/trainer.h"

#include <ATen/TensorOperators.h>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/dist/world.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/evaluate.h"
#include "depthkit/train/metrics_log.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/train/parameter_sets.h"
#include "depthkit/train/pipeline.h"
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
  return load_config(p.string(), overrides);
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

// ---- Opening or resuming a run ----

// Rank 0's hold on the run directory, from the job's start to its end: the lock, the checkpoint a
// resume starts from, and what the job has changed there, to put back should it fail before its
// first checkpoint (undo_start).
struct RunDirectory {
  explicit RunDirectory(const fs::path& run_dir)
      : dir(run_dir), config_path(run_dir / "config.toml"), metrics_path(run_dir / "metrics.jsonl") {}

  fs::path dir, config_path, metrics_path;
  bool created = false;  // this job made the directory
  std::optional<DirectoryLock> lock;
  std::optional<Checkpoint> checkpoint;  // a resume's: rank 0's choice, then every rank's copy
  bool complete = false;                 // a resume with no step left to train
  bool saved = false;                    // a checkpoint of this job is written
  bool diverged = false;                 // stopped on a non-finite loss: the directory stays as it is
  bool touched = false;                  // config.toml rewritten and metrics.jsonl cut back
  std::optional<std::string> old_config, old_metrics;  // as they were before the job
};

// Rank 0, before anything is written: creates a fresh run's directory, takes its lock and, for a
// resume, loads the latest checkpoint under it and checks it against the job. Returns what
// failed, for the start-up that every rank takes part in to report.
std::exception_ptr open_run_directory(const TrainOptions& opt, const TokenDataset& train_data, int64_t ranks,
                                      RunDirectory& run) {
  try {
    if (run.dir.has_parent_path()) fs::create_directories(run.dir.parent_path());
    run.created = fs::create_directory(run.dir);  // true only for the call that made it
    run.lock.emplace(run.dir);
    if (opt.resume) {
      run.checkpoint = load_checkpoint(*find_checkpoint(run.dir), true);  // under the lock: the current latest
    } else if (holds_checkpoints(run.dir)) {
      fail(run.dir.string(), ": run directory already has checkpoints (pass --resume, or choose another --run-dir)");
    }
    if (run.checkpoint)
      run.complete = check_resume(opt, run.checkpoint->state, run.checkpoint->dir, train_data, ranks);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// A job that fails before its first checkpoint (bad input on any rank, a shard that changed, a
// rank that died) leaves no half-made run directory behind: rank 0 removes the one it created,
// while it holds the lock, or puts back the files it changed in an existing one. A run that
// diverges keeps its directory: its metrics show how.
void undo_start(RunDirectory& run) {
  if (!run.lock || run.saved || run.diverged) return;
  std::error_code ec;
  if (run.created) {
    fs::remove_all(run.dir, ec);
  } else if (run.touched) {  // a resumed run: config.toml and metrics.jsonl as they were
    if (run.old_config) write_file_atomic(run.config_path, *run.old_config);
    if (run.old_metrics) write_file_atomic(run.metrics_path, *run.old_metrics);
  }
}

// Weights, gradients and AdamW's two moments, float32, of the `local_ranks` ranks (of the job's
// `ranks`) that share this machine's memory, counted before a byte of them is allocated (on the
// meta device), each sharded as train.zero says over its stage's ranks (ZeRO-3 keeps the
// embedding, head and pathway whole); under pipeline stages, the stage that holds the most. Refused in
// one line when they exceed the machine's memory. On GPUs the state is the device's: the machine
// holds one parameter at a time while the model is built, and is not checked.
void check_training_fits(const Config& cfg, int64_t ranks, int64_t local_ranks) {
  if (cfg.train.device == "cuda") return;
  const Transformer meta(cfg.model, cfg.residual, at::kMeta, 0);
  const ParameterCounts c = meta.count();
  // Under pipeline stages, the stage holding the most (its layers, and the embedding or the head).
  const PipelineLayout layout = PipelineLayout::of(cfg);
  int64_t held = 0, whole = 0;  // whole: kept whole on every rank under ZeRO-3
  for (int64_t stage = 0; stage < layout.stages; ++stage) {
    const StageParameters sp = stage_parameters(meta.parameters(), layout, stage);
    int64_t n = 0, kept = 0;
    for (size_t i = 0; i < sp.chunk.size(); ++i) {
      if (sp.chunk[i] == StageParameters::kNotHeld) continue;
      const Parameter& p = meta.parameters().all()[i];
      n += p.tensor.numel();
      if (p.component == "embedding" || p.component == "lm_head" || p.component == "residual" || p.name == "final_norm")
        kept += p.tensor.numel();
    }
    if (n > held) held = n, whole = kept;
  }
  const double P = double(held), W = double(ranks / layout.stages), zero = double(cfg.train.zero);
  const double per_rank = 4 * (zero >= 3 ? double(whole) + (P - double(whole)) / W : P) + 4 * (zero >= 2 ? P / W : P) +
                          8 * (zero >= 1 ? P / W : P);
  const double bytes = per_rank * double(local_ranks);
  if (bytes > double(physical_memory_bytes()))
    fail("training the model: its ", c.total, " parameters need ", int64_t(std::min(bytes, 9e18)), " bytes on this machine (",
         "float32 weights, gradients and AdamW's two moments on its ", local_ranks, " rank", local_ranks > 1 ? "s" : "",
         ", train.zero = ", cfg.train.zero, "), beyond its ", physical_memory_bytes(),
         " bytes of memory; reduce model.vocab_size, model.d_model, model.d_ff or model.n_layers",
         cfg.model.moe.enabled() ? " (or moe.n_experts, moe.expert_d_ff)" : "",
         cfg.train.zero < 3 ? ", or shard more (train.zero)" : ", or put fewer ranks on each machine");
}

// What every rank trains from: the model and its optimizer, fresh or from the checkpoint.
struct StartState {
  // Pipeline stages: this rank's stage's ranks and its pipe (the ranks at its place in every stage).
  PipelineLayout layout;
  std::unique_ptr<Group> stage_group, pipe_group;
  Group* data = nullptr;  // the ranks that hold the same parameters: world.all(), or the stage's
  int64_t stage = 0;
  std::optional<StageParameters> stage_parameters;
  ExpertGroups experts;  // before the model: it holds this rank's experts only
  std::optional<Transformer> model;
  std::unique_ptr<ParameterSets> sets;  // the parameters' groups, optimizers, gradient reduction
  std::unique_ptr<Pipeline> pipeline;   // pipeline stages: this rank's part
  TrainerState st;
  int64_t memory_base = 0;  // tensor bytes before the model: the summary's peak counts from here
};

// Builds the model and optimizer on every rank, from the checkpoint of step `resume_step` that
// rank 0 chose (-1: a fresh run), and gives every rank rank 0's parameters.
void start_from(const TrainOptions& opt, World& world, at::Device device, int64_t resume_step,
                std::optional<Checkpoint>& ckpt, StartState& start) {
  const Config& cfg = opt.config;
  // Every rank forms its groups, whatever comes next: stage s is ranks s·D … s·D + D − 1.
  start.layout = PipelineLayout::of(cfg);
  start.data = &world.all();
  if (const int64_t K = start.layout.stages; K > 1) {
    const int64_t D = world.size() / K;
    start.stage = world.rank() / D;
    std::vector<int64_t> stage_ranks, pipe_ranks;
    for (int64_t j = 0; j < D; ++j) stage_ranks.push_back(start.stage * D + j);
    for (int64_t s = 0; s < K; ++s) pipe_ranks.push_back(s * D + world.rank() % D);
    start.stage_group = world.group("stage", stage_ranks);
    start.pipe_group = world.group("pipe", pipe_ranks);
    start.data = start.stage_group.get();
  }
  start.experts = ExpertGroups::of(world, *start.data, cfg);
  std::exception_ptr error;
  try {
    if (!world.root() && resume_step >= 0)
      ckpt = load_checkpoint(*find_checkpoint(opt.run_dir, checkpoint_name(resume_step)), true);
    check_training_fits(cfg, world.size(), opt.launch.local_world_size);
    TensorMemory::install();  // counts from here: the model, its optimizer state, every step
    start.memory_base = TensorMemory::current_bytes();
    TensorMemory::reset_peak();
    reset_device_peak(device);
    // ZeRO-3: each branch's parameters sharded as soon as they are drawn. Pipeline stages: the
    // branches of other stages' layers freed as soon as they are drawn (every rank draws every
    // parameter, so that each holds what one rank's model holds).
    const bool staged = start.layout.stages > 1;
    BranchShards shards(*start.data, start.experts);
    Transformer::BranchBuilt built;
    if (cfg.train.zero >= 3 || staged)
      built = [&shards, &start, &cfg, staged](ParameterStore& store, int64_t l, const std::vector<size_t>& members) {
        if (staged && start.layout.stage_of(start.layout.chunk_of_layer((l - 1) / 2)) != start.stage) {
          for (size_t i : members) release_storage(store.all()[i].tensor);
        } else if (cfg.train.zero >= 3) {
          shards.take(store, l, members);
        }
      };
    start.model.emplace(cfg.model, cfg.residual, device, uint64_t(cfg.train.seed), at::kFloat,
                        compute_dtype_of(cfg.train), start.experts.placement, built);
    start.model->set_recompute(cfg.train.recompute);
    if (staged) {
      start.stage_parameters = stage_parameters(start.model->parameters(), start.layout, start.stage);
      start.stage_parameters->pipe = start.pipe_group.get();
      for (size_t i = 0; i < start.stage_parameters->chunk.size(); ++i)  // the embedding or the head of another stage
        if (start.stage_parameters->chunk[i] == StageParameters::kNotHeld)
          release_storage(start.model->parameters().all()[i].tensor);
    }
    start.sets = std::make_unique<ParameterSets>(*start.model, cfg, world, *start.data, start.experts, &shards,
                                                 staged ? &*start.stage_parameters : nullptr);
    if (staged)
      start.pipeline = std::make_unique<Pipeline>(*start.model, *start.sets, start.layout, world, *start.pipe_group,
                                                  cfg.train.grad_accum);
    start.st.seed = cfg.train.seed;
    if (ckpt) {
      start.sets->load_parameters(*ckpt->weights);
      start.sets->load_optimizer(*ckpt->optimizer);  // this rank's shard of its slice only
      start.st = ckpt->state;
      restore_rng_state(start.st.rng_state, (ckpt->dir / "state.json").string());
    }
  } catch (...) {
    error = std::current_exception();
  }
  // Every rank loaded the same checkpoint (rank 0's choice, by name; its bytes the same).
  World::Facts loaded;
  if (ckpt && !error) loaded = {{"checkpoint (state.json)", fingerprint(read_file(ckpt->dir / "state.json", 64u << 20))}};
  world.agree(!error, "start-up", loaded);
  if (error) std::rethrow_exception(error);
  // Every rank starts from its set's first rank's parameters (they agree already: same seed, same
  // checkpoint).
  start.sets->broadcast_parameters();
}

// ---- The step loop ----

// One rank's training from its start state to the run's end or a stop: the steps, the
// evaluations and checkpoints between them, then the final evaluation and the summary.
class StepLoop {
 public:
  // Sets up the gradients' reduction and the data order, and (rank 0) rewrites the run's
  // config.toml and cuts its metrics.jsonl back to the starting step.
  StepLoop(const TrainOptions& opt, World& world, const StartInputs& inputs, RunDirectory& run, StartState& start,
           int64_t total);
  TrainResult run();

 private:
  // One optimizer step's figures, over all ranks.
  struct Step {
    double lr = 0, loss = 0, grad_norm = 0;
    bool logged = false;      // a step that metrics.jsonl records
    bool moe = false;         // with the MoE terms (logged steps of a MoE model)
    std::vector<double> moe_terms;  // lm_loss, aux_loss, balance, then each layer's expert load
    bool signalled = false;   // some rank was asked to stop
  };
  Step step();
  void log_step(const Step& s, double elapsed);

  // ---- Evaluation and checkpoints ----
  double evaluate_and_log(int64_t step);
  void checkpoint();
  TrainResult finish(TrainResult result, Progress& bar, std::chrono::steady_clock::time_point t0, double step_seconds);
  void write_summary(const TrainResult& result, std::chrono::steady_clock::time_point t0, double step_seconds);

  const TrainOptions& opt_;
  const Config& cfg_;
  World& world_;
  const StartInputs& inputs_;
  RunDirectory& run_;
  Transformer& model_;
  ParameterSets& sets_;
  TrainerState& st_;
  const int64_t memory_base_;
  const bool root_;
  // ranks_: the data-parallel ranks (the job's, over pipeline stages' K), data_rank_ this rank's
  // place among them.
  const int64_t ranks_, data_rank_, total_, global_batch_;
  Pipeline* pipeline_;  // pipeline stages: this rank's part (null: none)
  Group& data_;
  const int64_t stage_;
  BatchLoader loader_;
  LoggedStep logged_;  // what metrics.jsonl held for the starting step (rank 0)
  std::map<std::string, int64_t> step_traffic_;  // bytes rank 0 handed to each collective in the steps
  std::vector<int64_t> pipeline_sent_;           // per boundary, payload bytes per micro-batch (every pipe's mean)
  ParameterSets::Gathers step_gathers_;           // ZeRO-3's branch gathers in the steps
  std::optional<MetricsLog> metrics_;  // rank 0's
};

StepLoop::StepLoop(const TrainOptions& opt, World& world, const StartInputs& inputs, RunDirectory& run,
                   StartState& start, int64_t total)
    : opt_(opt),
      cfg_(opt.config),
      world_(world),
      inputs_(inputs),
      run_(run),
      model_(*start.model),
      sets_(*start.sets),
      st_(start.st),
      memory_base_(start.memory_base),
      root_(world.root()),
      ranks_(start.data->size()),
      data_rank_(start.data->rank()),
      total_(total),
      global_batch_(ranks_ * cfg_.train.grad_accum * cfg_.train.micro_batch),
      pipeline_(start.pipeline.get()),
      data_(*start.data),
      stage_(start.stage),
      loader_(inputs.train_data, cfg_.train.micro_batch, cfg_.model.seq_len,
              uint64_t(cfg_.train.data_seed >= 0 ? cfg_.train.data_seed : cfg_.train.seed), st_.data) {
  if (root_) {
    run_.touched = true;
    write_file_atomic(run_.config_path, cfg_.to_toml());
    logged_ = truncate_metrics(run_.metrics_path, st_.step);
    metrics_.emplace(run_.metrics_path);
  }
  if (Progress::enabled()) {
    std::fprintf(stderr, "run directory %s: %s, %lld steps of %lld tokens%s%s\n", run_.dir.c_str(),
                 cfg_.residual.kind.c_str(), (long long)total_, (long long)cfg_.tokens_per_step(ranks_),
                 world_.size() > 1 ? cat(" on ", world_.size(), " ranks (", process_group_backend(cfg_.train), ")").c_str() : "",
                 run_.checkpoint ? cat(", resuming at step ", st_.step).c_str() : "");
    if (pipeline_)
      std::fprintf(stderr, "pipeline: %lld stages%s of %lld rank%s, 1F1B over %lld micro-batches (bubble %.1f%%)\n",
                   (long long)cfg_.train.pipeline_stages,
                   cfg_.train.virtual_stages > 1 ? cat(" x ", cfg_.train.virtual_stages, " virtual").c_str() : "",
                   (long long)ranks_, ranks_ > 1 ? "s" : "", (long long)cfg_.train.grad_accum,
                   100 * pipeline_->schedule().bubble);
    if (cfg_.train.zero || cfg_.model.moe.expert_parallel > 1)
      std::fprintf(stderr, "ZeRO-%lld%s: %s\n", (long long)cfg_.train.zero,
                   cfg_.model.moe.expert_parallel > 1 ? cat(", experts over ", cfg_.model.moe.expert_parallel, " ranks").c_str() : "",
                   sets_.describe().c_str());
  }
}

TrainResult StepLoop::run() {
  TrainResult result;
  result.step = st_.step;
  Progress bar("train", total_, "tok");
  const int64_t tokens_per_step = cfg_.tokens_per_step(ranks_);
  const auto t0 = std::chrono::steady_clock::now();
  double last_val = -1;
  double step_seconds = 0;  // training steps only (not evaluations or checkpoints)
  while (st_.step < total_) {
    world_.set_step(st_.step);
    const auto step_start = std::chrono::steady_clock::now();
    std::map<std::string, int64_t> traffic = sets_.traffic();
    const ParameterSets::Gathers gathers = sets_.gathers();
    const Step s = step();
    for (const auto& [collective, bytes] : sets_.traffic()) step_traffic_[collective] += bytes - traffic[collective];
    step_gathers_.all += sets_.gathers().all - gathers.all;
    step_gathers_.prefetched += sets_.gathers().prefetched - gathers.prefetched;
    step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    ++st_.step;
    st_.tokens_seen += tokens_per_step;
    result.losses.push_back(s.loss);
    result.last_loss = s.loss;

    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s.logged) log_step(s, elapsed);
    char status[96];
    std::snprintf(status, sizeof status, "loss %.4f lr %.2e%s", s.loss, s.lr,
                  last_val >= 0 ? cat(" val ", std::round(last_val * 1e4) / 1e4).c_str() : "");
    bar.update(st_.step, double(st_.tokens_seen), status);

    if (cfg_.train.eval_every > 0 && st_.step % cfg_.train.eval_every == 0 && st_.step != total_)
      last_val = evaluate_and_log(st_.step);
    const bool stop = s.signalled || st_.step == opt_.stop_after;
    if (stop || st_.step == total_ || (cfg_.train.checkpoint_every > 0 && st_.step % cfg_.train.checkpoint_every == 0))
      checkpoint();
    if (stop && st_.step != total_) {
      bar.finish("interrupted");
      if (root_)
        std::fprintf(stderr, "stopped at step %lld; checkpoint saved, continue with --resume\n", (long long)st_.step);
      result.interrupted = true;
      result.signal = g_stop_signal.load() ? g_stop_signal.load() : (s.signalled ? SIGINT : 0);
      result.step = st_.step;
      return result;
    }
  }
  return finish(std::move(result), bar, t0, step_seconds);
}

// Forward and backward over the step's micro-batches, the loss and the stop request shared
// across ranks, the gradient clipped, the optimizer stepped.
StepLoop::Step StepLoop::step() {
  Step s;
  s.lr = learning_rate(cfg_.optim, st_.step, total_);
  model_.parameters().zero_grad();
  sets_.begin_step();
  double loss_sum = 0;
  s.logged = (st_.step + 1) % cfg_.train.log_every == 0 || st_.step + 1 == total_;
  // MoE (docs/design.md, "Mixture of experts"): the micro-steps' LM loss, auxiliary loss, mean
  // balance term and per-layer expert load (max over mean share), averaged for the log; read
  // (a device sync each) on the steps that are logged only.
  s.moe = cfg_.model.moe.enabled() && s.logged;
  std::vector<double>& moe_sum = s.moe_terms;
  const int64_t accum = cfg_.train.grad_accum;
  if (pipeline_) {
    // Every stage of a pipe loads its micro-batches (the first takes their inputs, the last their
    // targets); the schedule runs them through its chunks.
    std::vector<at::Tensor> batches;
    for (int64_t m = 0; m < accum; ++m) batches.push_back(loader_.next(data_rank_, ranks_).to(inputs_.device));
    try {
      loss_sum = pipeline_->train_step(batches, s.moe ? &moe_sum : nullptr);
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e) && !dynamic_cast<const Error*>(&e)) throw CollectiveError(one_line(e));
      throw;
    }
  }
  for (int64_t m = 0; m < (pipeline_ ? 0 : accum); ++m) {
    // Micro-step m of rank r is micro-batch m·ranks + r of the step's global order.
    const at::Tensor batch = loader_.next(data_rank_, ranks_).to(inputs_.device);
    sets_.begin_micro_step(m == accum - 1);
    at::Tensor loss = model_.loss(batch) / double(accum);
    sets_.before_backward();
    try {
      loss.backward();
      sets_.after_backward();
    } catch (const std::exception& e) {
      // The last micro-step's backward also averages the gradients across ranks (every
      // micro-step's, under ZeRO-2): a failure there that is not this rank's own (an
      // allocation) is the collective's.
      if (ranks_ > 1 && sets_.communicates_in_backward(m == accum - 1) && !is_out_of_memory(e) &&
          !dynamic_cast<const Error*>(&e))
        throw CollectiveError(one_line(e));
      throw;
    }
    loss_sum += loss.item<double>();
    if (s.moe) {
      const MoeTerms& t = model_.moe_terms();
      std::vector<double> v = {t.lm_loss.item<double>(), t.aux_loss.item<double>(), t.balance.item<double>()};
      for (double x : t.load_max_over_mean()) v.push_back(x);
      moe_sum.resize(v.size(), 0.0);
      for (size_t i = 0; i < v.size(); ++i) moe_sum[i] += v[i] / double(accum);
    }
  }
  // The step's loss over all ranks, and whether any rank was asked to stop (a signal reaches
  // the ranks at different steps; they stop together). Under pipeline stages each rank holds its
  // stage's part of its pipe's loss: the sum over every rank is the sum over the pipes.
  at::Tensor shared = at::empty({2 + int64_t(moe_sum.size())}, at::kDouble);
  shared.data_ptr<double>()[0] = loss_sum;
  shared.data_ptr<double>()[1] = g_stop_signal.load() != 0 ? 1.0 : 0.0;
  for (size_t i = 0; i < moe_sum.size(); ++i) shared.data_ptr<double>()[2 + i] = moe_sum[i];
  world_.all_reduce_sum(shared);
  s.loss = shared.data_ptr<double>()[0] / double(ranks_);
  for (size_t i = 0; i < moe_sum.size(); ++i) moe_sum[i] = shared.data_ptr<double>()[2 + i] / double(ranks_);
  s.signalled = shared.data_ptr<double>()[1] > 0;
  s.grad_norm = sets_.clip(cfg_.optim.grad_clip);
  if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) {
    run_.diverged = true;
    auto last = find_checkpoint(run_.dir);
    fail("non-finite ", std::isfinite(s.loss) ? "gradient norm" : "loss", " at step ", st_.step + 1, " (loss ", s.loss,
         ", grad norm ", s.grad_norm, "); stopping. Last good checkpoint: ", last ? last->string() : "none");
  }
  sets_.step(s.lr);
  return s;
}

// The step's line of metrics.jsonl (rank 0), after the step (st_.step counts it).
void StepLoop::log_step(const Step& s, double elapsed) {
  if (!metrics_) return;
  nlohmann::json j = {{"step", st_.step}, {"loss", s.loss}, {"lr", s.lr}, {"grad_norm", s.grad_norm},
                      {"tokens", st_.tokens_seen}, {"elapsed_s", elapsed}};
  if (s.moe) {  // "loss" is the optimised total: lm_loss + aux_loss
    j["lm_loss"] = s.moe_terms[0];
    j["aux_loss"] = s.moe_terms[1];
    j["balance"] = s.moe_terms[2];
    j["expert_load"] = std::vector<double>(s.moe_terms.begin() + 3, s.moe_terms.end());
  }
  metrics_->write(j);
}

// ---- Evaluation and checkpoints ----

// The validation loss over all ranks' shares of the windows, logged (rank 0) at `step`.
double StepLoop::evaluate_and_log(int64_t step) {
  // Window i is data rank i mod D's (its pipe's, under pipeline stages: the last stage counts it).
  // Every rank runs as many forwards, a rank short of windows running window 0 again uncounted:
  // with the parameters gathered (ZeRO-3) or the experts split, a forward is a collective.
  at::NoGradGuard no_grad;
  LossSum share;
  const std::vector<at::Tensor>& windows = inputs_.val_batches;
  const size_t rounds = (windows.size() + size_t(ranks_) - 1) / size_t(ranks_);
  const bool counts = !pipeline_ || stage_ == cfg_.train.pipeline_stages - 1;
  for (size_t k = 0; k < rounds; ++k) {
    const size_t i = k * size_t(ranks_) + size_t(data_rank_);
    const at::Tensor b = windows[i < windows.size() ? i : 0].to(inputs_.device);
    const int64_t tokens = b.size(0) * (b.size(1) - 1);
    const double loss = pipeline_ ? pipeline_->loss_sum(b) : model_.lm_loss(b).item<double>() * double(tokens);
    if (i >= windows.size() || !counts) continue;
    share.loss += loss;
    share.tokens += tokens;
  }
  at::Tensor sum = at::empty({2}, at::kDouble);
  sum.data_ptr<double>()[0] = share.loss;
  sum.data_ptr<double>()[1] = double(share.tokens);
  world_.all_reduce_sum(sum);
  const double v = sum.data_ptr<double>()[0] / sum.data_ptr<double>()[1];
  if (metrics_) metrics_->write({{"step", step}, {"val_loss", v}, {"val_ppl", std::exp(v)}});
  return v;
}

void StepLoop::checkpoint() {
  st_.data = loader_.position();
  st_.rng_state = capture_rng_state();
  st_.config_toml = cfg_.to_toml();
  st_.global_batch = global_batch_;
  // Every rank takes part (the optimizer's shards travel to rank 0); rank 0 writes.
  if (pipeline_) {
    const int64_t K = cfg_.train.pipeline_stages;
    const TensorStream model = joined_stream(world_, data_, stage_, K, sets_.model_stream(true), sets_.model_stream(false));
    const TensorStream optimizer = joined_stream(world_, data_, stage_, K, sets_.optimizer_stream(true, true),
                                                 sets_.optimizer_stream(false, false));
    save_checkpoint(run_.dir, model, optimizer, st_, cfg_.train.keep_checkpoints, root_);
  } else {
    save_checkpoint(run_.dir, sets_.model_stream(), sets_.optimizer_stream(), st_, cfg_.train.keep_checkpoints, root_);
  }
  run_.saved = true;
}

// The run's end: the final evaluation and (rank 0) summary.json.
TrainResult StepLoop::finish(TrainResult result, Progress& bar, std::chrono::steady_clock::time_point t0,
                             double step_seconds) {
  // A run finished by --resume after dying past its final checkpoint reuses what it logged
  // (rank 0 read it; the others only need to take part in the evaluation when there is one).
  at::Tensor reuse = at::empty({1}, at::kLong);
  reuse.data_ptr<int64_t>()[0] = result.losses.empty() && logged_.val_loss ? 1 : 0;
  world_.broadcast(reuse);
  if (result.losses.empty() && logged_.loss) result.last_loss = *logged_.loss;
  result.val_loss = reuse.data_ptr<int64_t>()[0] ? logged_.val_loss.value_or(-1) : evaluate_and_log(st_.step);
  bar.finish(cat("loss ", result.last_loss, " val ", result.val_loss));
  if (pipeline_) {  // each boundary's sender, from every pipe
    const std::vector<int64_t> mine = pipeline_->sent_bytes();
    at::Tensor sent = at::empty({int64_t(mine.size())}, at::kLong);
    std::copy(mine.begin(), mine.end(), sent.data_ptr<int64_t>());
    world_.all_reduce_sum(sent);
    pipeline_sent_.clear();
    for (int64_t i = 0; i < sent.numel(); ++i) pipeline_sent_.push_back(sent.data_ptr<int64_t>()[i] / ranks_);
  }
  result.step = st_.step;
  if (root_) write_summary(result, t0, step_seconds);
  return result;
}

// Throughput of the job and peak memory of this process (after a resume: of the resumed part only).
void StepLoop::write_summary(const TrainResult& result, std::chrono::steady_clock::time_point t0,
                             double step_seconds) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens_here = double(int64_t(result.losses.size()) * cfg_.tokens_per_step(ranks_));
  int64_t val_tokens = 0;
  for (const at::Tensor& b : inputs_.val_batches) val_tokens += b.size(0) * (b.size(1) - 1);
  nlohmann::json summary = {{"step", st_.step},
                            {"tokens_seen", st_.tokens_seen},
                            {"train_seconds", seconds},
                            {"train_loss", result.last_loss},
                            {"val_loss", result.val_loss},
                            {"val_tokens", val_tokens},
                            {"val_ppl", std::exp(result.val_loss)},
                            {"device", cfg_.train.device},
                            {"dtype", cfg_.train.dtype},
                            {"world_size", world_.size()},
                            {"pipeline_stages", cfg_.train.pipeline_stages},
                            {"virtual_stages", cfg_.train.virtual_stages},
                            {"global_batch", global_batch_},
                            {"zero", cfg_.train.zero},
                            {"optimizer_state_bytes_per_rank", sets_.optimizer_state_bytes()},
                            {"gradient_bytes_per_rank", sets_.gradient_bytes()},
                            {"parameter_bytes_per_rank", sets_.parameter_bytes()},
                            {"gradient_bucket_bytes", sets_.bucket_bytes()},
                            {"expert_parallel", cfg_.model.moe.expert_parallel},
                            {"recompute", cfg_.train.recompute}};
  if (step_seconds > 0) {  // measured only when this process trained (not when it only finished)
    summary["tokens_per_s"] = tokens_here / step_seconds;
    summary["peak_tensor_bytes"] = TensorMemory::peak_bytes() - memory_base_;  // CPU tensors
    if (!inputs_.device.is_cpu()) summary["peak_device_bytes"] = device_peak_bytes(inputs_.device);  // max_memory_allocated
    summary["peak_rss_bytes"] = peak_rss_bytes();
    nlohmann::json traffic = nlohmann::json::object();  // rank 0's, per step, by collective
    for (const auto& [collective, bytes] : step_traffic_)
      traffic[collective] = bytes / std::max<int64_t>(1, int64_t(result.losses.size()));
    summary["communication_bytes_per_step"] = traffic;
    if (pipeline_) {  // the schedule's bubble, and the bytes sent forward over each boundary per micro-batch
      summary["pipeline_bubble"] = pipeline_->schedule().bubble;
      summary["pipeline_sent_bytes_per_micro_batch"] = pipeline_sent_;
    }
    if (cfg_.train.zero >= 3) {  // per step: the branches gathered, and those whose gather was started ahead
      const double steps = double(std::max<size_t>(1, result.losses.size()));
      summary["parameter_gathers_per_step"] = {{"all", double(step_gathers_.all) / steps},
                                               {"prefetched", double(step_gathers_.prefetched) / steps}};
    }
  }
  write_file_atomic(run_.dir / "summary.json", summary.dump(2) + "\n");
}

// One rank's part of the job (all of it in a job of one): opening or resuming the run, then the
// step loop.
TrainResult train_rank(const TrainOptions& opt, World& world) {
  const Config& cfg = opt.config;
  const bool root = world.root();
  const int64_t ranks = world.size() / cfg.train.pipeline_stages;  // data-parallel
  if (!root) Progress::set_enabled(false);  // rank 0 speaks for the job
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  // Open and check everything that can fail on bad input before anything is written. Every rank
  // checks for itself (each reads the same files), so each fails alike.
  const int64_t total = cfg.total_steps(ranks);
  const StartInputs inputs = open_start_inputs(opt, opt.launch.local_rank);

  // One process at a time owns a run directory (its lock): rank 0. A fresh run creates it.
  RunDirectory run(opt.run_dir);
  std::exception_ptr error;
  if (root) error = open_run_directory(opt, inputs.train_data, ranks, run);
  // From here on, a job that fails before its first checkpoint puts the directory back
  // (undo_start): what it will change is read first.
  if (run.lock && !error) {
    if (fs::exists(run.config_path)) run.old_config = read_file(run.config_path);
    if (fs::exists(run.metrics_path)) run.old_metrics = read_file(run.metrics_path);
  }
  try {
    world.agree(!error, "start-up", error ? World::Facts{} : data_facts(cfg, inputs.train_data, inputs.val_data));
    if (error) std::rethrow_exception(error);
    // Every rank resumes from the checkpoint rank 0 chose under the lock.
    at::Tensor chosen = at::empty({2}, at::kLong);
    chosen.data_ptr<int64_t>()[0] = run.checkpoint ? run.checkpoint->state.step : -1;
    chosen.data_ptr<int64_t>()[1] = run.complete;
    world.broadcast(chosen);
    const int64_t resume_step = chosen.data_ptr<int64_t>()[0];
    if (chosen.data_ptr<int64_t>()[1]) {
      TrainResult done;
      done.step = resume_step;
      done.complete = true;
      return done;
    }
    StartState start;
    start_from(opt, world, inputs.device, resume_step, run.checkpoint, start);
    StepLoop loop(opt, world, inputs, run, start, total);
    return loop.run();
  } catch (...) {
    undo_start(run);
    throw;
  }
}

}  // namespace

void check_job_start(const TrainOptions& opt, int64_t world_size) {
  process_group_backend(opt.config.train);
  check_layout(opt.config, world_size);
  const int64_t ranks = world_size / opt.config.train.pipeline_stages;  // data-parallel
  // Every rank is local: the last one needs the most GPUs.
  const StartInputs inputs = open_start_inputs(opt, world_size - 1);
  check_training_fits(opt.config, world_size, world_size);
  if (fs::is_directory(opt.run_dir)) DirectoryLock probe(opt.run_dir);  // taken and let go: is it free?
  if (opt.resume) {
    const fs::path dir = *find_checkpoint(opt.run_dir);
    check_resume(opt, load_trainer_state(dir), dir, inputs.train_data, ranks);
  }
}

void check_layout(const Config& cfg, int64_t ranks) {
  const int64_t P = cfg.model.moe.expert_parallel;
  if (cfg.train.pipeline_stages > 1) return check_pipeline_layout(cfg, ranks);
  if (ranks % P != 0)
    fail("key 'moe.expert_parallel' (", P, ") must divide the number of ranks (", ranks, "): the experts are split over ",
         P, " ranks at a time");
}

TrainResult train(const TrainOptions& opt) {
  const LaunchEnv& launch = opt.launch;
  check_layout(opt.config, launch.world_size);  // every rank finds it alike, before the group forms
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
