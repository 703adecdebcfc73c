// `depthkit compare`: trains a list of pathway runs on one backbone, data order and token budget,
// evaluates them on the same held-out tokens, and writes results.json, a Markdown table like
// DAR Table 2 / MSAR Table 2, and the training-loss curves (DAR Fig. 2).
//
// A spec (TOML):
//   base = "configs/tiny.toml"        # the shared config, relative to the working directory
//   seeds = [42, 43]                   # each run once per seed (initialisation)
//   set = ["train.steps=300"]          # overrides for every run (optional)
//   baseline = "residual"              # the run the change in % refers to (optional; default:
//                                      # the first run of kind "residual")
//   smooth = 10                        # moving-average window of the curves, in logged points
//   tasks = ["data/pydoc-cloze.jsonl"] # downstream tasks (docs/tasks.md) each run's final
//                                      # checkpoint is scored on, with the task's own shots and seed
//   [[run]]
//   name = "dar-block"                 # [A-Za-z0-9._-]
//   kind = "dar"
//   set = ["residual.block_sublayers=2"]   # residual.* and model.* keys (e.g. model.d_ff to
//                                      # match parameters), not seq_len or vocab_size
//
// Every run trains in its own process (`depthkit train`, so peak memory is per run) into
// OUT/runs/<name>-seed<s>, with train.data_seed fixed to the base config's train.seed, so that all
// runs and seeds see the same batches in the same order. A run with summary.json is finished
// and is not trained again; one with a checkpoint continues from it (--resume).
// Tasks are scored in this process after training, each result kept in OUT/tasks/ and reused while
// the task file and the checkpoint's step are the same; they are not part of the spec a --resume
// must repeat, so tasks can be added to a finished comparison.
//
// The code: compare_spec.cpp loads and checks a spec, compare.cpp trains the runs and scores the
// tasks, compare_report.cpp writes results.json, the table and the curves.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace depthkit {

struct CompareRun {
  std::string name, kind;
  std::vector<std::string> set;
};

struct CompareSpec {
  std::filesystem::path file;
  std::string base;
  std::vector<int64_t> seeds;
  std::vector<std::string> set;
  std::string baseline;  // a run name
  int64_t smooth = 10;
  std::vector<CompareRun> runs;
  std::vector<std::string> tasks;  // task files, relative to the working directory
};

// Parses and checks a spec; `extra_sets` are appended to its `set`. Every run's configuration is
// loaded and validated here, before anything is trained. Throws with file and key on bad input.
CompareSpec load_compare_spec(const std::filesystem::path& file, const std::vector<std::string>& extra_sets);

struct CompareOptions {
  CompareSpec spec;
  std::filesystem::path out;
  bool resume = false;
  std::filesystem::path executable;  // the depthkit program that trains each run
};

// Trains what is not finished, then writes OUT/results.json, OUT/table.md, OUT/loss_curves.png.
// Returns results.json's content.
nlohmann::json run_compare(const CompareOptions& opt);

// The Markdown table of a results.json.
std::string compare_table(const nlohmann::json& results);

}  // namespace depthkit
