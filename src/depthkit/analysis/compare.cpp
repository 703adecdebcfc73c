#include "depthkit/analysis/compare.h"

#include <ATen/core/Tensor.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <toml++/toml.h>

#include "depthkit/analysis/plots.h"
#include "depthkit/config/config.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/eval/tasks.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/hash.h"
#include "depthkit/util/process.h"

namespace depthkit {

namespace {

std::vector<std::string> string_list(const toml::node* n, const std::string& where) {
  std::vector<std::string> out;
  if (!n) return out;
  const toml::array* a = n->as_array();
  if (!a) fail(where, " must be an array of strings");
  for (const auto& e : *a) {
    if (!e.is_string()) fail(where, " must be an array of strings");
    out.push_back(std::string(*e.value<std::string>()));
  }
  return out;
}

void check_keys(const toml::table& t, const std::set<std::string>& allowed, const std::string& where) {
  for (const auto& [k, v] : t)
    if (!allowed.count(std::string(k.str()))) fail(where, ": unknown key '", k.str(), "'");
}

std::string run_label(const CompareRun& r, int64_t seed) { return cat(r.name, "-seed", seed); }

// The overrides that make run r with seed s from the base config.
std::vector<std::string> run_overrides(const CompareSpec& spec, const CompareRun& r, int64_t seed, int64_t data_seed) {
  std::vector<std::string> o = spec.set;
  o.push_back("residual.kind=\"" + r.kind + "\"");
  o.insert(o.end(), r.set.begin(), r.set.end());
  o.push_back(cat("train.seed=", seed));
  o.push_back(cat("train.data_seed=", data_seed));
  return o;
}

int64_t base_data_seed(const CompareSpec& spec) {
  const Config base = Config::load(spec.base, spec.set);
  return base.train.data_seed >= 0 ? base.train.data_seed : base.train.seed;
}

nlohmann::json spec_json(const CompareSpec& spec) {
  nlohmann::json runs = nlohmann::json::array();
  for (const auto& r : spec.runs) runs.push_back({{"name", r.name}, {"kind", r.kind}, {"set", r.set}});
  return {{"base", spec.base}, {"seeds", spec.seeds}, {"set", spec.set}, {"baseline", spec.baseline}, {"runs", runs}};
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? NAN : s / double(v.size());
}

double sample_std(const std::vector<double>& v) {
  if (v.size() < 2) return NAN;
  const double m = mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / double(v.size() - 1));
}

nlohmann::json number_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

// Training losses by step from metrics.jsonl.
// One metric of metrics.jsonl by step: "loss", or an MoE run's "lm_loss" or "balance".
std::map<int64_t, double> read_metric(const fs::path& metrics, const char* key) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains(key) && j.contains("step") && j[key].is_number())
      out[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return out;
}

// The mean over the logged steps in the last tenth of the run (at least the last one).
double tail_mean(const std::map<int64_t, double>& curve) {
  if (curve.empty()) return NAN;
  const int64_t from = curve.rbegin()->first - curve.rbegin()->first / 10;
  double sum = 0;
  int64_t n = 0;
  for (auto it = curve.lower_bound(from); it != curve.end(); ++it, ++n) sum += it->second;
  return sum / double(n);
}

// Adds the mean over seeds of each step every seed logged to a plotted series.
nlohmann::json mean_series(const std::string& label, const std::map<int64_t, std::vector<double>>& curve, size_t seeds,
                           const char* key) {
  nlohmann::json series = {{"label", label}, {"steps", nlohmann::json::array()}, {key, nlohmann::json::array()}};
  for (auto& [step, v] : curve) {
    if (v.size() != seeds) continue;  // a step every seed logged
    series["steps"].push_back(step);
    series[key].push_back(mean(v));
  }
  return series;
}

// A 64-bit FNV-1a hash of a file's bytes, in hex: a kept task result is reused only for the same file.
std::string content_hash(const fs::path& file) { return fingerprint(read_file(file)); }

// Scores each task on the final checkpoint of every run and seed, keeping each result in
// OUT/tasks/<run>-seed<s>.<k>.<task>.json (k: its place in the spec); returns, per task in the
// spec's order, its name and the results by run label.
using TaskScores = std::vector<std::pair<std::string, std::map<std::string, nlohmann::json>>>;
TaskScores score_tasks(const CompareSpec& spec, const fs::path& out) {
  TaskScores scores;
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
      const std::string label = run_label(r, seed);
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

CompareSpec load_compare_spec(const fs::path& file, const std::vector<std::string>& extra_sets) {
  if (!fs::exists(file)) fail(file.string(), ": not found");
  toml::table root;
  try {
    root = toml::parse(read_file(file, 16u << 20), file.string());
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    fail(file.string(), ":", b.line, ":", b.column, ": TOML syntax error: ", e.description());
  }
  const std::string f = file.string();
  check_keys(root, {"base", "seeds", "set", "baseline", "smooth", "run", "tasks"}, f);
  CompareSpec spec;
  spec.file = file;
  auto base = root["base"].value<std::string>();
  if (!base) fail(f, ": key 'base' (the shared config file) is missing or not a string");
  spec.base = *base;
  if (!fs::exists(spec.base)) fail(f, ": key 'base': config file '", spec.base, "' not found");
  if (const toml::array* seeds = root["seeds"].as_array()) {
    for (const auto& s : *seeds) {
      auto v = s.value_exact<int64_t>();
      if (!v || *v < 0) fail(f, ": key 'seeds' must be an array of non-negative integers");
      spec.seeds.push_back(*v);
    }
  } else if (root.contains("seeds")) {
    fail(f, ": key 'seeds' must be an array of non-negative integers");
  }
  if (spec.seeds.empty()) spec.seeds = {Config::load(spec.base).train.seed};
  if (std::set<int64_t>(spec.seeds.begin(), spec.seeds.end()).size() != spec.seeds.size())
    fail(f, ": key 'seeds' repeats a seed");
  spec.set = string_list(root.get("set"), f + ": key 'set'");
  spec.set.insert(spec.set.end(), extra_sets.begin(), extra_sets.end());
  if (root.contains("smooth")) {
    auto v = root["smooth"].value_exact<int64_t>();
    if (!v || *v < 1) fail(f, ": key 'smooth' must be a positive integer");
    spec.smooth = *v;
  }
  const toml::array* runs = root["run"].as_array();
  if (!runs || runs->empty()) fail(f, ": no [[run]] entries");
  std::set<std::string> names;
  for (size_t i = 0; i < runs->size(); ++i) {
    const std::string where = cat(f, ": run ", i + 1);
    const toml::table* t = (*runs)[i].as_table();
    if (!t) fail(where, ": must be a table ([[run]])");
    check_keys(*t, {"name", "kind", "set"}, where);
    CompareRun r;
    auto kind = (*t)["kind"].value<std::string>();
    if (!kind) fail(where, ": key 'kind' is missing or not a string");
    r.kind = *kind;
    r.name = (*t)["name"].value<std::string>().value_or(r.kind);
    if (r.name.empty() || r.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos)
      fail(where, ": name '", r.name, "' must be non-empty and use only letters, digits, '.', '_' and '-'");
    if (!names.insert(r.name).second) fail(where, ": name '", r.name, "' is used twice");
    r.set = string_list(t->get("set"), where + ": key 'set'");
    for (const auto& s : r.set) {  // what every run must share: data, order, budget, optimiser
      const std::string key = s.substr(0, s.find('='));
      const bool shared = key == "residual.kind" || key == "model.seq_len" || key == "model.vocab_size" ||
                          (key.rfind("residual.", 0) != 0 && key.rfind("model.", 0) != 0);
      if (shared)
        fail(where, ": override '", s, "': a run may set residual.* and model.* keys only (not residual.kind, "
             "model.seq_len or model.vocab_size), so that every run shares the data, its order, the token budget and "
             "the optimiser; put other overrides in the top-level 'set'");
    }
    spec.runs.push_back(r);
  }
  if (auto b = root["baseline"].value<std::string>()) {
    if (!names.count(*b)) fail(f, ": key 'baseline': no run named '", *b, "'");
    spec.baseline = *b;
  } else {
    for (const auto& r : spec.runs)
      if (r.kind == "residual" && spec.baseline.empty()) spec.baseline = r.name;
  }
  // Every task must load before anything trains, under a name of its own (the table's column).
  spec.tasks = string_list(root.get("tasks"), f + ": key 'tasks'");
  std::set<std::string> task_names;
  for (const auto& t : spec.tasks) {
    Task task;
    try {
      task = load_task(t);
    } catch (const Error& e) {
      fail(f, ": key 'tasks': ", e.what());
    }
    if (!task_names.insert(task.name).second)
      fail(f, ": key 'tasks': two tasks are named '", task.name, "' (", t, "); give one a \"name\" in its header");
  }
  // Every run's configuration must load before anything trains.
  const int64_t data_seed = base_data_seed(spec);
  for (const auto& r : spec.runs) {
    try {
      Config::load(spec.base, run_overrides(spec, r, spec.seeds[0], data_seed));
    } catch (const Error& e) {
      fail(f, ": run '", r.name, "': ", e.what());
    }
  }
  return spec;
}

nlohmann::json run_compare(const CompareOptions& opt) {
  const CompareSpec& spec = opt.spec;
  const fs::path& out = opt.out;
  const fs::path saved = out / "spec.json";
  const nlohmann::json this_spec = spec_json(spec);
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

  const int64_t data_seed = base_data_seed(spec);
  const size_t total = spec.runs.size() * spec.seeds.size();
  size_t done = 0;
  for (const auto& r : spec.runs) {
    for (int64_t seed : spec.seeds) {
      ++done;
      const fs::path dir = out / "runs" / run_label(r, seed);
      if (fs::exists(dir / "summary.json")) {
        std::fprintf(stderr, "compare [%zu/%zu] %s: finished earlier\n", done, total, run_label(r, seed).c_str());
        continue;
      }
      std::vector<std::string> args = {"train", "--run-dir", dir.string()};
      if (find_checkpoint(dir)) {
        args.push_back("--resume");
      } else {
        args.insert(args.end(), {"--config", spec.base});
        for (const auto& o : run_overrides(spec, r, seed, data_seed)) args.insert(args.end(), {"--set", o});
      }
      std::fprintf(stderr, "compare [%zu/%zu] %s (%s)%s\n", done, total, run_label(r, seed).c_str(), r.kind.c_str(),
                   args.back() == "--resume" ? ": resuming" : "");
      args.insert(args.begin(), opt.executable.string());
      const auto [rc, interrupted] = run_program(args);
      if (rc == 130 || rc == 143 || interrupted)
        fail("interrupted during ", run_label(r, seed), "; its checkpoint is kept: continue with compare --resume --out ",
             out.string());
      if (rc != 0) fail("run ", run_label(r, seed), " failed (exit status ", rc, "; its message is above)");
    }
  }

  const auto task_scores = score_tasks(spec, out);

  // Collect.
  nlohmann::json runs = nlohmann::json::array();
  nlohmann::json curves = {{"title", "training loss: " + spec.file.stem().string()},
                           {"window", spec.smooth},
                           {"xlabel", "step"},
                           {"series", nlohmann::json::array()}};
  // MoE backbones: the router's balancing term per run (DAR Fig. A.2; 1.0 = uniform use).
  nlohmann::json aux_curves = {{"title", "router balance (n_experts · Σ f·P, mean over MoE layers): " +
                                             spec.file.stem().string()},
                               {"window", spec.smooth},
                               {"xlabel", "step"},
                               {"ylabel", "auxiliary balance loss"},
                               {"reference", {{"y", 1.0}, {"label", "uniform use"}}},
                               {"series", nlohmann::json::array()}};
  double baseline_loss = NAN, total_seconds = 0;
  int64_t tokens_per_run = 0, eval_tokens = 0;
  for (const auto& r : spec.runs) {
    std::vector<double> losses, rates, peaks, rss;
    nlohmann::json seeds = nlohmann::json::array();
    std::map<int64_t, std::vector<double>> curve, balance_curve;
    std::vector<double> balances;
    Config cfg;
    for (int64_t seed : spec.seeds) {
      const fs::path dir = out / "runs" / run_label(r, seed);
      auto s = nlohmann::json::parse(read_file(dir / "summary.json"), nullptr, false);
      if (s.is_discarded() || !s.contains("val_loss")) fail((dir / "summary.json").string(), ": not a run summary");
      cfg = Config::load((dir / "config.toml").string());
      losses.push_back(s["val_loss"].get<double>());
      rates.push_back(s.value("tokens_per_s", 0.0));
      peaks.push_back(double(s.value("peak_tensor_bytes", int64_t(0))));
      rss.push_back(double(s.value("peak_rss_bytes", int64_t(0))));
      total_seconds += s.value("train_seconds", 0.0);
      tokens_per_run = s.value("tokens_seen", int64_t(0));
      eval_tokens = s.value("val_tokens", cfg.train.eval_tokens);
      seeds.push_back({{"seed", seed}, {"run_dir", dir.string()}, {"val_loss", s["val_loss"]},
                       {"tokens_per_s", s.value("tokens_per_s", 0.0)},
                       {"peak_tensor_bytes", s.value("peak_tensor_bytes", 0)}, {"peak_rss_bytes", s.value("peak_rss_bytes", 0)},
                       {"train_seconds", s.value("train_seconds", 0.0)}});
      // The LM loss: an MoE run's "loss" also holds its auxiliary terms (docs/training.md).
      auto lm = read_metric(dir / "metrics.jsonl", "lm_loss");
      for (auto [step, loss] : lm.empty() ? read_metric(dir / "metrics.jsonl", "loss") : lm) curve[step].push_back(loss);
      const auto balance = read_metric(dir / "metrics.jsonl", "balance");
      for (auto [step, b] : balance) balance_curve[step].push_back(b);
      if (!balance.empty()) balances.push_back(tail_mean(balance));
    }
    Transformer meta(cfg.model, cfg.residual, at::kMeta, 0);
    const ParameterCounts pc = meta.count();
    nlohmann::json j = {{"name", r.name}, {"kind", r.kind}, {"set", r.set},
                        {"parameters", {{"total", pc.total}, {"non_vocab", pc.non_vocab}, {"residual", pc.residual}}},
                        {"seeds", seeds}, {"val_loss_mean", mean(losses)}, {"val_loss_std", number_or_null(sample_std(losses))},
                        {"tokens_per_s", mean(rates)}, {"peak_tensor_bytes", int64_t(mean(peaks))},
                        {"peak_rss_bytes", int64_t(mean(rss))}};
    if (balances.size() == spec.seeds.size()) {
      j["router_balance"] = mean(balances);  // the last tenth of the run, mean over seeds
      aux_curves["series"].push_back(mean_series(r.name, balance_curve, spec.seeds.size(), "loss"));
    }
    // Each task's accuracy (its primary metric) per seed, then its mean and spread over seeds.
    for (const auto& [task, by_run] : task_scores) {
      std::vector<double> acc;
      for (size_t k = 0; k < spec.seeds.size(); ++k) {
        const auto& t = by_run.at(run_label(r, spec.seeds[k]));
        acc.push_back(t["accuracy"][t["metric"].get<std::string>()]["value"].get<double>());
        j["seeds"][k]["tasks"][task] = acc.back();
      }
      j["tasks"][task] = {{"accuracy_mean", mean(acc)}, {"accuracy_std", number_or_null(sample_std(acc))}};
    }
    if (r.name == spec.baseline) baseline_loss = mean(losses);
    runs.push_back(j);
    curves["series"].push_back(mean_series(r.name, curve, spec.seeds.size(), "loss"));
  }
  for (auto& j : runs)
    j["delta_percent"] = number_or_null(100 * (j["val_loss_mean"].get<double>() - baseline_loss) / baseline_loss);

  nlohmann::json results = {{"spec", spec.file.string()}, {"base", spec.base}, {"set", spec.set},
                            {"seeds", spec.seeds}, {"data_seed", data_seed}, {"baseline", spec.baseline},
                            {"tokens_per_run", tokens_per_run}, {"eval_tokens", eval_tokens},
                            {"train_seconds_total", total_seconds}, {"runs", runs}};
  // What each task column holds: the metric, the items, the shots, chance.
  results["tasks"] = nlohmann::json::array();
  for (const auto& [task, by_run] : task_scores) {
    const auto& any = by_run.begin()->second;
    results["tasks"].push_back({{"name", task}, {"file", any["file"]}, {"type", any["type"]}, {"metric", any["metric"]},
                                {"items", any["items"]}, {"shots", any["shots"]}, {"chance", any["chance"]}});
  }
  write_file_atomic(out / "table.md", compare_table(results));
  write_file_atomic(out / "loss_curves.json", curves.dump() + "\n");
  render_plot("curves", out / "loss_curves.json", out / "loss_curves.png");
  if (!aux_curves["series"].empty()) {
    write_file_atomic(out / "aux_curves.json", aux_curves.dump() + "\n");
    render_plot("curves", out / "aux_curves.json", out / "aux_curves.png");
  }
  write_file_atomic(out / "results.json", results.dump(2) + "\n");
  return results;
}

std::string compare_table(const nlohmann::json& results) {
  auto group = [](int64_t n) {
    std::string s = std::to_string(n), out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (i && (s.size() - i) % 3 == 0) out += ',';
      out += s[i];
    }
    return out;
  };
  char buf[128];
  bool moe = false;  // a column for the router's balance when some run has an MoE backbone
  for (const auto& r : results["runs"]) moe = moe || r.contains("router_balance");
  // A column per downstream task (MSAR Table 1): accuracy in %, by the metric its header names.
  const nlohmann::json tasks = results.value("tasks", nlohmann::json::array());
  std::string task_header, task_rule;
  for (const auto& task : tasks) {
    task_header += cat(" ", task["name"].get<std::string>(),
                       task["metric"] == "per_token" ? " acc. % (per-token LL)" : " exact match %", " |");
    task_rule += "---|";
  }
  std::string t = cat("| run | kind | parameters (residual) | validation loss | Δ vs ",
                      results["baseline"].get<std::string>().empty() ? "—" : results["baseline"].get<std::string>(),
                      " |", task_header, " tokens/s | peak memory |", moe ? " router balance |" : "",
                      "\n|---|---|---|---|---|", task_rule, "---|---|", moe ? "---|" : "", "\n");
  const size_t n_seeds = results["seeds"].size();
  for (const auto& r : results["runs"]) {
    const auto& p = r["parameters"];
    std::string loss;
    if (r["val_loss_std"].is_null()) {
      std::snprintf(buf, sizeof buf, "%.4f", r["val_loss_mean"].get<double>());
    } else {
      std::snprintf(buf, sizeof buf, "%.4f ± %.4f", r["val_loss_mean"].get<double>(), r["val_loss_std"].get<double>());
    }
    loss = buf;
    std::string delta = "—";
    if (!r["delta_percent"].is_null()) {
      std::snprintf(buf, sizeof buf, "%+.2f %%", r["delta_percent"].get<double>());
      delta = buf;
    }
    std::string accuracies;
    for (const auto& task : tasks) {
      const auto& a = r["tasks"][task["name"].get<std::string>()];
      if (a["accuracy_std"].is_null())
        std::snprintf(buf, sizeof buf, " %.1f |", 100 * a["accuracy_mean"].get<double>());
      else
        std::snprintf(buf, sizeof buf, " %.1f ± %.1f |", 100 * a["accuracy_mean"].get<double>(),
                      100 * a["accuracy_std"].get<double>());
      accuracies += buf;
    }
    std::snprintf(buf, sizeof buf, "%.0f | %.0f MiB", r["tokens_per_s"].get<double>(),
                  double(r["peak_tensor_bytes"].get<int64_t>()) / (1 << 20));
    t += cat("| ", r["name"].get<std::string>(), " | ", r["kind"].get<std::string>(), " | ",
             group(p["total"].get<int64_t>()), " (", group(p["residual"].get<int64_t>()), ") | ", loss, " | ", delta,
             " |", accuracies, " ", buf, " |");
    if (moe) {
      std::snprintf(buf, sizeof buf, " %.4f |", r.value("router_balance", NAN));
      t += r.contains("router_balance") ? std::string(buf) : " — |";
    }
    t += "\n";
  }
  std::snprintf(buf, sizeof buf, "%.1f", results["train_seconds_total"].get<double>() / 60);
  t += cat("\nValidation loss: mean ± sample standard deviation over ", n_seeds, " seed", n_seeds == 1 ? "" : "s", " (",
           results["eval_tokens"].get<int64_t>(), " held-out tokens, the same for every run); ",
           results["tokens_per_run"].get<int64_t>(), " training tokens per run in the same order; tokens/s over the "
           "training steps and peak tensor memory (parameters, optimizer state, activations) of each run, averaged "
           "over seeds; ", buf,
           " min of training in all.\n");
  for (const auto& task : tasks) {
    const bool choice = task["type"] == "multiple_choice";
    std::snprintf(buf, sizeof buf, "%.1f", choice ? 100 * task["chance"].get<double>() : 0.0);
    t += cat(task["name"].get<std::string>(), " (", task["file"].get<std::string>(), ", ", task["items"].get<int64_t>(),
             " items, ", task["shots"].get<int64_t>(), "-shot): ",
             choice ? "accuracy of the candidate with the highest mean log-likelihood per token (the lowest "
                      "conditional perplexity), chance " + std::string(buf) + " %"
                    : std::string("exact match of the greedy answer"),
             "; mean ± sample standard deviation over seeds, of each seed's final checkpoint.\n");
  }
  if (moe)
    t += "Router balance: the auxiliary load-balancing term n_experts · Σ_e f_e · P_e, mean over MoE layers, averaged "
         "over the logged steps of the last tenth of training (1.0 = uniform use; DAR Fig. A.2); its curves are in "
         "aux_curves.png.\n";
  return t;
}

}  // namespace depthkit
