// Loading a compare spec (analysis/compare.h): the TOML read and every key checked, every task
// file and every run's configuration loaded before anything trains.
#include "depthkit/analysis/compare_spec.h"

#include <set>
#include <toml++/toml.h>

#include "depthkit/config/config.h"
#include "depthkit/eval/task_file.h"
#include "depthkit/model/config_check.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

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

// One [[run]] table; `where` names it ("SPEC: run 2"), `names` holds the names of the runs before it.
CompareRun read_run(const toml::node& node, const std::string& where, std::set<std::string>& names) {
  const toml::table* t = node.as_table();
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
  return r;
}

}  // namespace

std::string compare_run_label(const CompareRun& r, int64_t seed) { return cat(r.name, "-seed", seed); }

std::vector<std::string> compare_run_overrides(const CompareSpec& spec, const CompareRun& r, int64_t seed,
                                               int64_t data_seed) {
  std::vector<std::string> o = spec.set;
  o.push_back("residual.kind=\"" + r.kind + "\"");
  o.insert(o.end(), r.set.begin(), r.set.end());
  o.push_back(cat("train.seed=", seed));
  o.push_back(cat("train.data_seed=", data_seed));
  return o;
}

int64_t compare_data_seed(const CompareSpec& spec) {
  const Config base = load_config(spec.base, spec.set);
  return base.train.data_seed >= 0 ? base.train.data_seed : base.train.seed;
}

nlohmann::json compare_spec_json(const CompareSpec& spec) {
  nlohmann::json runs = nlohmann::json::array();
  for (const auto& r : spec.runs) runs.push_back({{"name", r.name}, {"kind", r.kind}, {"set", r.set}});
  return {{"base", spec.base}, {"seeds", spec.seeds}, {"set", spec.set}, {"baseline", spec.baseline}, {"runs", runs}};
}

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
  if (spec.seeds.empty()) spec.seeds = {load_config(spec.base).train.seed};
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
  for (size_t i = 0; i < runs->size(); ++i) spec.runs.push_back(read_run((*runs)[i], cat(f, ": run ", i + 1), names));
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
  const int64_t data_seed = compare_data_seed(spec);
  for (const auto& r : spec.runs) {
    try {
      load_config(spec.base, compare_run_overrides(spec, r, spec.seeds[0], data_seed));
    } catch (const Error& e) {
      fail(f, ": run '", r.name, "': ", e.what());
    }
  }
  return spec;
}

}  // namespace depthkit
