// A trained run's checkpoint and tokenizer, loaded in one place for every command that uses a
// model after training: eval (validation loss, tasks), generate, compare's task columns, analyze
// and forward.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "depthkit/config/config.h"

namespace depthkit {

class Transformer;
class Tokenizer;

// The precision a loaded run computes in, decided here for every command that loads one.
//  - trained: the run's train.dtype, so that evaluation, generation and compare's task columns
//    reproduce the run's own numbers (a bfloat16 run is scored as it trained).
//  - float32: whatever it trained in. `analyze` measures the retrieval itself (weights, CKA,
//    rescue gain), where bfloat16's rounding would be a second difference between the kinds
//    compared; `forward` writes float32 logits for other tools to check against.
// Parameters are float32 in both (a bfloat16 run keeps float32 master weights).
enum class RunPrecision { trained, float32 };

// A checkpoint with its own configuration (from its state.json, checked like any config), its
// model on the CPU in `precision`, and the step it was saved at.
struct RunModel {
  std::filesystem::path checkpoint;
  int64_t step = 0;
  Config config;
  std::unique_ptr<Transformer> model;
  RunModel();
  RunModel(RunModel&&) noexcept;
  ~RunModel();
};
// The checkpoint named `checkpoint` of the run (its latest when empty).
RunModel load_run_model(const std::filesystem::path& run_dir, const std::string& checkpoint = "",
                        RunPrecision precision = RunPrecision::trained);
// The checkpoint folder `checkpoint_dir` itself.
RunModel load_checkpoint_model(const std::filesystem::path& checkpoint_dir, RunPrecision precision);

// The tokenizer of a prepared data directory (data_tokenizer_path: tokenizer.model or
// tokenizer.json), refused when its ids exceed the model's vocabulary.
std::unique_ptr<Tokenizer> load_data_tokenizer(const std::string& data_dir, int64_t vocab_size);

}  // namespace depthkit
