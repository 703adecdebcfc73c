#include "depthkit/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>

#include <cctype>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/model/transformer.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"

namespace depthkit {

std::string capture_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor s = gen.get_state();
  static const char* hex = "0123456789abcdef";
  std::string out;
  const uint8_t* p = s.const_data_ptr<uint8_t>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    out.push_back(hex[p[i] >> 4]);
    out.push_back(hex[p[i] & 15]);
  }
  return out;
}

void restore_rng_state(const std::string& hex, const std::string& source) {
  if (hex.empty()) return;  // a checkpoint from `depthkit init`: the generator starts fresh
  static const size_t expected = capture_rng_state().size();
  if (hex.size() != expected)
    fail(source, ": field 'rng_state' has ", hex.size(), " hex digits, the CPU generator's state has ", expected);
  at::Tensor s = at::empty({int64_t(hex.size() / 2)}, at::kByte);
  uint8_t* p = s.mutable_data_ptr<uint8_t>();
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(source, ": key 'rng_state' is not a hex string");
  };
  for (size_t i = 0; i < hex.size() / 2; ++i) p[i] = uint8_t(nib(hex[2 * i]) << 4 | nib(hex[2 * i + 1]));
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(s);
  } catch (const c10::Error& e) {
    fail(source, ": field 'rng_state' is not a CPU generator state (", one_line(e), ")");
  }
}

void write_checkpoint_dir(const fs::path& dir, const Transformer& model, const NamedTensors& optimizer,
                          const TrainerState& st) {
  const NamedTensors weights = model.parameters().named();
  write_checkpoint_dir(dir, TensorStream::of(weights), TensorStream::of(optimizer), st, true);
}

void write_checkpoint_dir(const fs::path& dir, const TensorStream& model, const TensorStream& optimizer,
                          const TrainerState& st, bool writer) {
  const std::map<std::string, std::string> metadata = {{"format", "depthkit"}, {"step", std::to_string(st.step)}};
  if (!writer) {  // the producers only: they may be collectives rank 0 waits on
    save_safetensors("", model, false);
    save_safetensors("", optimizer, false);
    return;
  }
  std::optional<TemporaryDirectory> building;  // removed if anything below fails
  std::exception_ptr error;
  try {
    building.emplace(make_sibling_dir(dir, "tmp"));
  } catch (...) {
    error = std::current_exception();
  }
  if (error) {  // the other ranks still send their shards: take them, then say why
    save_safetensors("", model, false);
    save_safetensors("", optimizer, false);
    std::rethrow_exception(error);
  }
  const fs::path& tmp = building->path();
  save_safetensors((tmp / "model.safetensors").string(), model, true, metadata);
  save_safetensors((tmp / "optimizer.safetensors").string(), optimizer, true);
  nlohmann::json j = {{"step", st.step},
                      {"tokens_seen", st.tokens_seen},
                      {"data", {{"epoch", st.data.epoch}, {"index", st.data.index}}},
                      {"seed", st.seed},
                      {"global_batch", st.global_batch},
                      {"rng_state", st.rng_state},
                      {"config", st.config_toml}};
  write_file_atomic(tmp / "state.json", j.dump(2) + "\n");
  fsync_path(tmp);
  replace_directory(tmp, dir, is_checkpoint_file);  // the previous folder stays whole until the new one is in place
  building->release();
}

bool is_checkpoint_file(const std::string& name) {
  return name == "model.safetensors" || name == "optimizer.safetensors" || name == "state.json";
}

fs::path save_checkpoint(const fs::path& run_dir, const Transformer& model, const NamedTensors& optimizer,
                         const TrainerState& st, int64_t keep) {
  const NamedTensors weights = model.parameters().named();
  return save_checkpoint(run_dir, TensorStream::of(weights), TensorStream::of(optimizer), st, keep, true);
}

fs::path save_checkpoint(const fs::path& run_dir, const TensorStream& model, const TensorStream& optimizer,
                         const TrainerState& st, int64_t keep, bool writer) {
  const fs::path root = run_dir / "checkpoints";
  const std::string name = checkpoint_name(st.step);
  const fs::path final_dir = root / name;
  write_checkpoint_dir(final_dir, model, optimizer, st, writer);
  if (!writer) return final_dir;
  write_file_atomic(root / "latest", name + "\n");
  // Keep the `keep` checkpoints of highest step number; the one `latest` names is never removed.
  std::vector<std::pair<int64_t, fs::path>> all;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string entry = e.path().filename().string();
    auto step = checkpoint_step(entry);
    if (step && e.is_directory() && e.path() != final_dir) all.emplace_back(*step, e.path());
    // A folder a killed run was building ("step_N.tmp-XXXXXX", or the one it had just replaced):
    // the run's own.
    const size_t dot = entry.find('.');
    if (dot != std::string::npos && checkpoint_step(entry.substr(0, dot)) && e.is_directory() &&
        entry.compare(dot, 5, ".tmp-") == 0)
      fs::remove_all(e.path());
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = keep > 0 ? size_t(keep - 1) : 0; i < all.size(); ++i) fs::remove_all(all[i].second);
  return final_dir;
}

std::string checkpoint_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)step);
  return name;
}

std::optional<int64_t> checkpoint_step(const std::string& name) {
  if (!name.starts_with("step_") || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

bool holds_checkpoints(const fs::path& run_dir) {
  const fs::path root = run_dir / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return false;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    // A `step_N.tmp-XXXXXX` left by a checkpoint that never completed is not a checkpoint.
    if (n == "latest" || (checkpoint_step(n) && e.is_directory())) return true;
  }
  return false;
}

std::optional<fs::path> find_checkpoint(const fs::path& run_dir, const std::string& name) {
  const fs::path root = run_dir / "checkpoints";
  if (!name.empty()) {
    fs::path p = fs::is_directory(name) ? fs::path(name) : root / name;
    if (!fs::is_directory(p)) fail(p.string(), ": checkpoint not found");
    return p;
  }
  const fs::path latest_path = root / "latest";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(latest_path, ec))) return std::nullopt;
  std::string latest = read_file(latest_path, 4096);
  // One name and a line end (a CRLF or trailing blanks from an editor are forgiven).
  while (!latest.empty() && std::isspace(static_cast<unsigned char>(latest.back()))) latest.pop_back();
  if (!checkpoint_step(latest))
    fail(latest_path.string(), ": does not name a checkpoint (expected one line 'step_NNNNNNNN', got ",
         latest.size() > 40 ? cat(latest.size(), " bytes") : cat("'", printable(latest), "'"), ")");
  fs::path p = root / latest;
  if (!fs::is_directory(p)) fail(latest_path.string(), ": names missing checkpoint '", latest, "'");
  return p;
}

fs::path resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "state.json")) return path;
  if (fs::exists(fs::path(path) / "checkpoints" / "latest")) return *find_checkpoint(path);
  fail(path, ": not a checkpoint (no state.json) nor a run directory with checkpoints");
}

TrainerState load_trainer_state(const fs::path& dir) {
  TrainerState state;
  const fs::path state_path = dir / "state.json";
  const std::string where = state_path.string();
  const nlohmann::json j = nlohmann::json::parse(read_file(state_path, 64u << 20), nullptr, false);
  if (j.is_discarded()) fail(where, ": not valid JSON");
  if (!j.is_object()) fail(where, ": not a JSON object");
  auto field = [&](const nlohmann::json& parent, const char* key, const char* name) -> const nlohmann::json& {
    if (!parent.is_object() || !parent.contains(key)) fail(where, ": field '", name, "' is missing");
    return parent[key];
  };
  // Counters are non-negative integers: a negative step would run the schedule backwards.
  auto count = [&](const nlohmann::json& parent, const char* key, const char* name) -> int64_t {
    const nlohmann::json& v = field(parent, key, name);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        v.get<int64_t>() < 0)
      fail(where, ": field '", name, "' must be a non-negative integer, got ", json_excerpt(v));
    return v.get<int64_t>();
  };
  auto text = [&](const char* key) -> std::string {
    const nlohmann::json& v = field(j, key, key);
    if (!v.is_string()) fail(where, ": field '", key, "' must be a string, got a ", v.type_name());
    return v.get<std::string>();
  };
  state.step = count(j, "step", "step");
  state.tokens_seen = count(j, "tokens_seen", "tokens_seen");
  const nlohmann::json& data = field(j, "data", "data");
  state.data.epoch = count(data, "epoch", "data.epoch");
  state.data.index = count(data, "index", "data.index");
  state.seed = count(j, "seed", "seed");
  if (j.contains("global_batch")) state.global_batch = count(j, "global_batch", "global_batch");
  state.rng_state = text("rng_state");
  state.config_toml = text("config");
  if (!state.rng_state.empty()) {
    if (state.rng_state.find_first_not_of("0123456789abcdef") != std::string::npos)
      fail(where, ": field 'rng_state' is not a lower-case hex string");
    static const size_t expected = capture_rng_state().size();
    if (state.rng_state.size() != expected)
      fail(where, ": field 'rng_state' has ", state.rng_state.size(), " hex digits, the CPU generator's state has ", expected);
  }
  return state;
}

Checkpoint load_checkpoint(const fs::path& dir, bool load_optimizer) {
  Checkpoint c;
  c.dir = dir;
  c.state = load_trainer_state(dir);
  if (load_optimizer) {
    c.weights.emplace((dir / "model.safetensors").string());
    c.optimizer.emplace((dir / "optimizer.safetensors").string());
  } else {
    c.model = load_safetensors((dir / "model.safetensors").string());
  }
  return c;
}

}  // namespace depthkit
