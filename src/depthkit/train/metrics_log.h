// A run's metrics.jsonl: one JSON object per line, appended as the run goes (training steps,
// evaluations), and cut back to a checkpoint's step when a run resumes from it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json_fwd.hpp>
#include <optional>

namespace depthkit {

// What metrics.jsonl already holds for one step.
struct LoggedStep {
  std::optional<double> loss, val_loss;
};

// Drops the lines of steps after `step` (left by a run that died after its last checkpoint) and
// returns what is logged for `step` itself. A missing file is left missing.
LoggedStep truncate_metrics(const std::filesystem::path& path, int64_t step);

// metrics.jsonl opened for appending; each line is flushed as it is written, so that a run that
// dies leaves every line before it whole.
class MetricsLog {
 public:
  explicit MetricsLog(const std::filesystem::path& path);
  void write(const nlohmann::json& j);

 private:
  std::ofstream out_;
};

}  // namespace depthkit
