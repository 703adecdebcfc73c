// A trained run's checkpoint and tokenizer, loaded once for the commands that use a model after
// training: eval (validation loss, tasks), generate, and compare's task columns.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "depthkit/config/config.h"

namespace depthkit {

class Transformer;
class Tokenizer;

// The checkpoint `checkpoint` of the run (its latest when empty), with the checkpoint's own
// configuration, computing in the precision the run trained in (train.dtype), so that an
// evaluation reproduces the run's own. On the CPU.
struct RunModel {
  std::filesystem::path checkpoint;
  int64_t step = 0;
  Config config;
  std::unique_ptr<Transformer> model;
  RunModel();
  RunModel(RunModel&&) noexcept;
  ~RunModel();
};
RunModel load_run_model(const std::filesystem::path& run_dir, const std::string& checkpoint = "");

// The tokenizer of a prepared data directory (DIR/tokenizer.model), refused when its ids exceed
// the model's vocabulary.
std::unique_ptr<Tokenizer> load_data_tokenizer(const std::string& data_dir, int64_t vocab_size);

}  // namespace depthkit
