#include "depthkit/train/metrics_log.h"

#include <nlohmann/json.hpp>
#include <string>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

LoggedStep truncate_metrics(const fs::path& path, int64_t step) {
  LoggedStep logged;
  if (!fs::exists(path)) return logged;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    const bool has_step = !j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer();
    if (has_step && j["step"].get<int64_t>() > step) continue;
    kept += line + "\n";
    if (has_step && j["step"].get<int64_t>() == step) {
      if (j.contains("loss") && j["loss"].is_number()) logged.loss = j["loss"].get<double>();
      if (j.contains("val_loss") && j["val_loss"].is_number()) logged.val_loss = j["val_loss"].get<double>();
    }
  }
  write_file_atomic(path, kept);
  return logged;
}

MetricsLog::MetricsLog(const fs::path& path) : out_(path, std::ios::app) {
  if (!out_) fail(path.string(), ": cannot open for appending");
}

void MetricsLog::write(const nlohmann::json& j) {
  out_ << j.dump() << "\n";
  out_.flush();
}

}  // namespace depthkit
