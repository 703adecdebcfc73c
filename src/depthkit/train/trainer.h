// The training loop: AdamW with warm-up + cosine (or WSD) schedule, gradient accumulation and
// clipping, periodic evaluation, metrics.jsonl, atomic checkpoints (periodic, final, and on
// SIGINT/SIGTERM), exact resume, and a stop with a clear message on a non-finite loss.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/dist/world.h"

namespace depthkit {

struct TrainOptions {
  Config config;
  std::filesystem::path run_dir;
  bool resume = false;
  int64_t stop_after = -1;  // stop (with a checkpoint) after this many steps, as if interrupted
  // This process's place in a job of many (torchrun's variables; default: a job of one).
  LaunchEnv launch;
};

struct TrainResult {
  int64_t step = 0;            // optimizer steps completed
  double last_loss = 0;        // training loss of the last step
  double val_loss = -1;        // final evaluation (-1: none)
  bool interrupted = false;    // stopped by a signal or stop_after
  bool complete = false;       // --resume of a run with no step left: nothing was run or written
  int signal = 0;              // the signal that stopped it, if any
  std::vector<double> losses;  // training loss of every step run in this call
};

// Trains as rank launch.rank of launch.world_size (docs/training.md, "Many processes"): every
// rank runs this with the same options; rank 0 alone owns the run directory (its lock, config,
// metrics, checkpoints, summary) and prints progress.
TrainResult train(const TrainOptions& opt);

// Checks, before a launcher (--nproc) starts `ranks` ranks, what every rank would otherwise find
// wrong alike (and each report): the backend, the device, the data, the memory, a fresh run into
// a directory with checkpoints, a run directory another run holds, and a resume's checkpoint
// against the job (seed, data position, global batch). Writes nothing.
void check_job_start(const TrainOptions& opt, int64_t ranks);

// Refuses a layout of `ranks` ranks the config cannot take (moe.expert_parallel not dividing them),
// in one line naming the keys.
void check_layout(const Config& cfg, int64_t ranks);

// The c10d backend train.backend names on train.device ("auto": nccl on cuda, gloo on cpu).
std::string process_group_backend(const TrainConfig& train);

// Checks the data directory's meta.json, when there is one, against the model (vocab_size).
void check_data_meta(const Config& cfg);

// The configuration of an existing run (its config.toml) with overrides applied.
Config load_run_config(const std::filesystem::path& run_dir, const std::vector<std::string>& overrides);

// Installs SIGINT/SIGTERM handlers that ask the loop to checkpoint and stop.
void install_stop_signals();

}  // namespace depthkit
