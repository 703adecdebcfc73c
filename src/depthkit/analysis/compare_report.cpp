// The report of a comparison (compare_report.h): results.json from the runs' summaries and
// metrics, the Markdown table (compare_table), and the loss and router-balance curves.
#include "depthkit/analysis/compare_report.h"

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "depthkit/analysis/compare_spec.h"
#include "depthkit/analysis/plots.h"
#include "depthkit/config/config.h"
#include "depthkit/eval/task_types.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

namespace {

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

// What the table's note says of all runs, gathered as the runs are read.
struct Totals {
  double train_seconds = 0;
  int64_t tokens_per_run = 0, eval_tokens = 0;
};

// One run's entry of results.json's "runs", over its seeds (no "delta_percent" yet); adds the
// run's mean training-loss curve to `loss_curves` and, for an MoE backbone, its router-balance
// curve to `aux_curves`.
nlohmann::json run_result(const CompareSpec& spec, const CompareRun& r, const fs::path& out,
                          const CompareTaskScores& task_scores, Totals& totals, nlohmann::json& loss_curves,
                          nlohmann::json& aux_curves) {
  std::vector<double> losses, rates, peaks, rss;
  nlohmann::json seeds = nlohmann::json::array();
  std::map<int64_t, std::vector<double>> curve, balance_curve;
  std::vector<double> balances;
  Config cfg;
  for (int64_t seed : spec.seeds) {
    const fs::path dir = out / "runs" / compare_run_label(r, seed);
    auto s = nlohmann::json::parse(read_file(dir / "summary.json"), nullptr, false);
    if (s.is_discarded() || !s.contains("val_loss")) fail((dir / "summary.json").string(), ": not a run summary");
    cfg = load_config((dir / "config.toml").string());
    losses.push_back(s["val_loss"].get<double>());
    rates.push_back(s.value("tokens_per_s", 0.0));
    peaks.push_back(double(s.value("peak_tensor_bytes", int64_t(0))));
    rss.push_back(double(s.value("peak_rss_bytes", int64_t(0))));
    totals.train_seconds += s.value("train_seconds", 0.0);
    totals.tokens_per_run = s.value("tokens_seen", int64_t(0));
    totals.eval_tokens = s.value("val_tokens", cfg.train.eval_tokens);
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
      const auto& t = by_run.at(compare_run_label(r, spec.seeds[k]));
      acc.push_back(t["accuracy"][t["metric"].get<std::string>()]["value"].get<double>());
      j["seeds"][k]["tasks"][task] = acc.back();
    }
    j["tasks"][task] = {{"accuracy_mean", mean(acc)}, {"accuracy_std", number_or_null(sample_std(acc))}};
  }
  loss_curves["series"].push_back(mean_series(r.name, curve, spec.seeds.size(), "loss"));
  return j;
}

}  // namespace

nlohmann::json write_compare_report(const CompareSpec& spec, const fs::path& out, int64_t data_seed,
                                    const CompareTaskScores& task_scores) {
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
  nlohmann::json runs = nlohmann::json::array();
  Totals totals;
  double baseline_loss = NAN;
  for (const auto& r : spec.runs) {
    runs.push_back(run_result(spec, r, out, task_scores, totals, curves, aux_curves));
    if (r.name == spec.baseline) baseline_loss = runs.back()["val_loss_mean"].get<double>();
  }
  for (auto& j : runs)
    j["delta_percent"] = number_or_null(100 * (j["val_loss_mean"].get<double>() - baseline_loss) / baseline_loss);

  nlohmann::json results = {{"spec", spec.file.string()}, {"base", spec.base}, {"set", spec.set},
                            {"seeds", spec.seeds}, {"data_seed", data_seed}, {"baseline", spec.baseline},
                            {"tokens_per_run", totals.tokens_per_run}, {"eval_tokens", totals.eval_tokens},
                            {"train_seconds_total", totals.train_seconds}, {"runs", runs}};
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
  std::vector<const TaskTypeInfo*> types;  // each task's entry of the task-type table
  std::string task_header, task_rule;
  for (const auto& task : tasks) {
    const std::string type = task["type"].get<std::string>();
    types.push_back(find_task_type(type));
    if (!types.back()) fail("results: task '", task["name"].get<std::string>(), "' has an unknown type '", type, "'");
    task_header += cat(" ", task["name"].get<std::string>(), " ", types.back()->metric_label, " |");
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
  for (size_t k = 0; k < tasks.size(); ++k) {
    const auto& task = tasks[k];
    t += cat(task["name"].get<std::string>(), " (", task["file"].get<std::string>(), ", ", task["items"].get<int64_t>(),
             " items, ", task["shots"].get<int64_t>(), "-shot): ", types[k]->metric_note(task),
             "; mean ± sample standard deviation over seeds, of each seed's final checkpoint.\n");
  }
  if (moe)
    t += "Router balance: the auxiliary load-balancing term n_experts · Σ_e f_e · P_e, mean over MoE layers, averaged "
         "over the logged steps of the last tenth of training (1.0 = uniform use; DAR Fig. A.2); its curves are in "
         "aux_curves.png.\n";
  return t;
}

}  // namespace depthkit
