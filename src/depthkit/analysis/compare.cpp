// Running a comparison (analysis/compare.h): each run and seed trained in its own process, the
// tasks scored on every final checkpoint, then the report (compare_report.cpp).
#include "depthkit/analysis/compare.h"

#include <cctype>
#include <cstdio>
#include <memory>
#include <optional>

#include "depthkit/analysis/compare_report.h"
#include "depthkit/analysis/compare_spec.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/eval/task_file.h"
#include "depthkit/eval/task_scoring.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/hash.h"
#include "depthkit/util/process.h"

namespace depthkit {

namespace {

// Trains every run and seed that is not finished, each in its own process (`depthkit train`, so
// that peak memory is per run); one with a checkpoint continues from it.
void train_runs(const CompareSpec& spec, const fs::path& out, int64_t data_seed, const fs::path& executable) {
  const size_t total = spec.runs.size() * spec.seeds.size();
  size_t done = 0;
  for (const auto& r : spec.runs) {
    for (int64_t seed : spec.seeds) {
      ++done;
      const fs::path dir = out / "runs" / compare_run_label(r, seed);
      if (fs::exists(dir / "summary.json")) {
        std::fprintf(stderr, "compare [%zu/%zu] %s: finished earlier\n", done, total, compare_run_label(r, seed).c_str());
        continue;
      }
      std::vector<std::string> args = {"train", "--run-dir", dir.string()};
      if (find_checkpoint(dir)) {
        args.push_back("--resume");
      } else {
        args.insert(args.end(), {"--config", spec.base});
        for (const auto& o : compare_run_overrides(spec, r, seed, data_seed)) args.insert(args.end(), {"--set", o});
      }
      std::fprintf(stderr, "compare [%zu/%zu] %s (%s)%s\n", done, total, compare_run_label(r, seed).c_str(), r.kind.c_str(),
                   args.back() == "--resume" ? ": resuming" : "");
      args.insert(args.begin(), executable.string());
      const auto [rc, interrupted] = run_program(args);
      if (rc == 130 || rc == 143 || interrupted)
        fail("interrupted during ", compare_run_label(r, seed), "; its checkpoint is kept: continue with compare --resume --out ",
             out.string());
      if (rc != 0) fail("run ", compare_run_label(r, seed), " failed (exit status ", rc, "; its message is above)");
    }
  }
}

// A 64-bit FNV-1a hash of a file's bytes, in hex: a kept task result is reused only for the same file.
std::string content_hash(const fs::path& file) { return fingerprint(read_file(file)); }

// Scores each task on the final checkpoint of every run and seed, keeping each result in
// OUT/tasks/<run>-seed<s>.<k>.<task>.json (k: its place in the spec); returns, per task in the
// spec's order, its name and the results by run label.
CompareTaskScores score_tasks(const CompareSpec& spec, const fs::path& out) {
  CompareTaskScores scores;
  if (spec.tasks.empty()) return scores;
  std::vector<Task> tasks;
  std::vector<std::string> hashes;
  for (const auto& t : spec.tasks) {
    tasks.push_back(load_task(t));
    hashes.push_back(content_hash(t));
    scores.emplace_back(tasks.back().name, std::map<std::string, nlohmann::json>{});
  }
  fs::create_directories(out / "tasks");
  for (const auto& r : spec.runs)
    for (int64_t seed : spec.seeds) {
      const std::string label = compare_run_label(r, seed);
      const fs::path run_dir = out / "runs" / label;
      const auto checkpoint = find_checkpoint(run_dir);
      if (!checkpoint) fail(run_dir.string(), ": run has no checkpoint to score the tasks on");
      const int64_t step = load_checkpoint(*checkpoint, false).state.step;
      std::optional<RunModel> run;  // loaded once, when a task needs scoring
      std::unique_ptr<Tokenizer> tokenizer;
      for (size_t k = 0; k < tasks.size(); ++k) {
        std::string file_name = tasks[k].name;  // the name as a file name: other bytes become '_'
        for (char& c : file_name)
          if (!std::isalnum((unsigned char)c) && c != '.' && c != '_' && c != '-') c = '_';
        // The task's place in the spec keeps two names that map to one file name apart.
        const fs::path kept = out / "tasks" / (label + "." + std::to_string(k) + "." + file_name + ".json");
        if (fs::exists(kept)) {
          // Reused only when whole and of the same task file and checkpoint step; anything else
          // (a file cut short, edited by hand) is scored again.
          const auto j = nlohmann::json::parse(read_file(kept), nullptr, false);
          bool usable = false;
          try {
            usable = j.at("file_hash").get<std::string>() == hashes[k] && j.at("step").get<int64_t>() == step &&
                     j.at("accuracy").at(j.at("metric").get<std::string>()).at("value").is_number();
            for (const char* key : {"file", "type", "items", "shots", "chance"}) usable = usable && j.contains(key);
          } catch (const nlohmann::json::exception&) {
            usable = false;
          }
          if (usable) {
            scores[k].second[label] = j;
            continue;
          }
        }
        if (!run) {
          run.emplace(load_run_model(run_dir));
          tokenizer = load_data_tokenizer(run->config.data.dir, run->config.model.vocab_size);
        }
        std::fprintf(stderr, "compare: scoring %s on task %s\n", label.c_str(), tasks[k].name.c_str());
        nlohmann::json j = evaluate_task(*run->model, *tokenizer, tasks[k], TaskOptions{}).to_json();
        j["step"] = step;
        j["file_hash"] = hashes[k];
        write_file_atomic(kept, j.dump(2) + "\n");
        scores[k].second[label] = j;
      }
    }
  return scores;
}

}  // namespace

nlohmann::json run_compare(const CompareOptions& opt) {
  const CompareSpec& spec = opt.spec;
  const fs::path& out = opt.out;
  const fs::path saved = out / "spec.json";
  const nlohmann::json this_spec = compare_spec_json(spec);
  if (fs::exists(saved)) {
    if (!opt.resume)
      fail(out.string(), ": already holds a comparison (pass --resume to continue it, or choose another --out)");
    auto old = nlohmann::json::parse(read_file(saved), nullptr, false);
    if (old != this_spec)
      fail(out.string(), ": --resume with a different spec or --set than the comparison was started with (",
           saved.string(), "); choose another --out");
  }
  fs::create_directories(out / "runs");
  write_file_atomic(saved, this_spec.dump(2) + "\n");

  const int64_t data_seed = compare_data_seed(spec);
  train_runs(spec, out, data_seed, opt.executable);
  const CompareTaskScores task_scores = score_tasks(spec, out);
  return write_compare_report(spec, out, data_seed, task_scores);
}

}  // namespace depthkit
