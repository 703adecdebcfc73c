// Checkpoints: <run_dir>/checkpoints/step_NNNNNNNN/ with
//   model.safetensors      every parameter, by name
//   optimizer.safetensors  AdamW moments and step
//   state.json             step, tokens seen, data position, seed, RNG state, resolved config
// Each file is written atomically into a temporary folder that is renamed into place, then
// <run_dir>/checkpoints/latest is replaced atomically: a crash leaves the last good one intact.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "depthkit/data/loader.h"
#include "depthkit/io/safetensors.h"
#include "depthkit/train/optimizer.h"

namespace depthkit {

namespace fs = std::filesystem;
class Transformer;

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  int64_t tokens_seen = 0;
  LoaderPosition data;
  int64_t seed = 0;
  // Sequences per optimizer step over all ranks (ranks x grad_accum x micro_batch); 0 in
  // checkpoints from before it was recorded. A resume must keep it: it fixes the data order's
  // use and every step's gradient.
  int64_t global_batch = 0;
  std::string rng_state;  // hex of the default CPU generator's state
  std::string config_toml;
};

// `optimizer` is the full state (AdamW::state, or its state_stream), whichever ranks held it, so
// that a checkpoint does not depend on the layout of the job that wrote it. In a job of many ranks
// every rank calls the stream form (its producers may be collectives); rank 0, the `writer`,
// writes the files and prunes old checkpoints.
fs::path save_checkpoint(const fs::path& run_dir, const Transformer& model, const NamedTensors& optimizer,
                         const TrainerState& state, int64_t keep);
fs::path save_checkpoint(const fs::path& run_dir, const TensorStream& model, const TensorStream& optimizer,
                         const TrainerState& state, int64_t keep, bool writer);
// Writes one checkpoint folder `dir` atomically (built in a fresh "dir.tmp-XXXXXX", then renamed
// into place; an existing `dir` is replaced only once the new one is whole).
void write_checkpoint_dir(const fs::path& dir, const Transformer& model, const NamedTensors& optimizer,
                          const TrainerState& state);
void write_checkpoint_dir(const fs::path& dir, const TensorStream& model, const TensorStream& optimizer,
                          const TrainerState& state, bool writer);
// Whether `name` is one of the files a checkpoint folder holds (what init --force may replace).
bool is_checkpoint_file(const std::string& name);
// The step of a checkpoint folder's name "step_NNNNNNNN"; nullopt for any other name.
std::optional<int64_t> checkpoint_step(const std::string& name);
// The folder name of step's checkpoint, "step_NNNNNNNN".
std::string checkpoint_name(int64_t step);
// Whether run_dir/checkpoints holds any checkpoint folder or a `latest` file.
bool holds_checkpoints(const fs::path& run_dir);
// A checkpoint folder, or a run directory (its latest checkpoint).
fs::path resolve_checkpoint(const std::string& path);

// The checkpoint `name` (e.g. "step_00000100") or, when empty, the latest one; nullopt if none.
std::optional<fs::path> find_checkpoint(const fs::path& run_dir, const std::string& name = "");

struct Checkpoint {
  fs::path dir;
  TrainerState state;
  SafetensorsFile model;                     // the weights, whole (!load_optimizer: evaluation)
  // To train from (load_optimizer): the files' headers read and checked; each rank then reads
  // only what it holds (its experts' rows, its shard of the optimizer state).
  std::optional<SafetensorsReader> weights, optimizer;
};
Checkpoint load_checkpoint(const fs::path& dir, bool load_optimizer);
// A checkpoint's state.json alone (checked as load_checkpoint checks it), without its tensors.
TrainerState load_trainer_state(const fs::path& dir);

std::string capture_rng_state();
void restore_rng_state(const std::string& hex, const std::string& source);

}  // namespace depthkit
