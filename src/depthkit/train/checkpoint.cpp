#include "depthkit/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/model/transformer.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

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
  if (hex.empty()) return;
  if (hex.size() % 2) fail(source, ": key 'rng_state' is not a hex string");
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
  gen.set_state(s);
}

void write_checkpoint_dir(const fs::path& dir, const Transformer& model, const AdamW& opt, const TrainerState& st) {
  const fs::path tmp = dir.string() + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  save_safetensors((tmp / "model.safetensors").string(), model.parameters().named(),
                   {{"format", "depthkit"}, {"step", std::to_string(st.step)}});
  save_safetensors((tmp / "optimizer.safetensors").string(), opt.state());
  nlohmann::json j = {{"step", st.step},
                      {"tokens_seen", st.tokens_seen},
                      {"data", {{"epoch", st.data.epoch}, {"index", st.data.index}}},
                      {"seed", st.seed},
                      {"rng_state", st.rng_state},
                      {"config", st.config_toml}};
  write_file_atomic(tmp / "state.json", j.dump(2) + "\n");
  fsync_path(tmp);
  if (fs::exists(dir)) fs::remove_all(dir);
  rename_durable(tmp, dir);
}

fs::path save_checkpoint(const fs::path& run_dir, const Transformer& model, const AdamW& opt,
                         const TrainerState& st, int64_t keep) {
  const fs::path root = run_dir / "checkpoints";
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)st.step);
  const fs::path final_dir = root / name;
  write_checkpoint_dir(final_dir, model, opt, st);
  write_file_atomic(root / "latest", std::string(name) + "\n");
  // Keep the newest `keep` checkpoints.
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string n = e.path().filename().string();
    if (e.is_directory() && n.starts_with("step_") && !n.ends_with(".tmp")) all.push_back(e.path());
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i]);
  return final_dir;
}

std::optional<fs::path> find_checkpoint(const fs::path& run_dir, const std::string& name) {
  const fs::path root = run_dir / "checkpoints";
  if (!name.empty()) {
    fs::path p = fs::is_directory(name) ? fs::path(name) : root / name;
    if (!fs::is_directory(p)) fail(p.string(), ": checkpoint not found");
    return p;
  }
  if (!fs::exists(root / "latest")) return std::nullopt;
  std::string latest = read_file(root / "latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  fs::path p = root / latest;
  if (!fs::is_directory(p)) fail((root / "latest").string(), ": names missing checkpoint '", latest, "'");
  return p;
}

fs::path resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "state.json")) return path;
  if (fs::exists(fs::path(path) / "checkpoints" / "latest")) return *find_checkpoint(path);
  fail(path, ": not a checkpoint (no state.json) nor a run directory with checkpoints");
}

Checkpoint load_checkpoint(const fs::path& dir, bool load_optimizer) {
  Checkpoint c;
  c.dir = dir;
  const fs::path state_path = dir / "state.json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(state_path));
    c.state.step = j.at("step").get<int64_t>();
    c.state.tokens_seen = j.at("tokens_seen").get<int64_t>();
    c.state.data.epoch = j.at("data").at("epoch").get<int64_t>();
    c.state.data.index = j.at("data").at("index").get<int64_t>();
    c.state.seed = j.at("seed").get<int64_t>();
    c.state.rng_state = j.at("rng_state").get<std::string>();
    c.state.config_toml = j.at("config").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    fail(state_path.string(), ": malformed trainer state (", e.what(), ")");
  }
  c.model = load_safetensors((dir / "model.safetensors").string());
  if (load_optimizer) c.optimizer = load_safetensors((dir / "optimizer.safetensors").string());
  return c;
}

}  // namespace depthkit
