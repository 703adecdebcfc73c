#include "depthkit/eval/run_model.h"

#include "depthkit/data/tokenizer.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

RunModel::RunModel() = default;
RunModel::RunModel(RunModel&&) noexcept = default;
RunModel::~RunModel() = default;

RunModel load_checkpoint_model(const std::filesystem::path& checkpoint_dir, RunPrecision precision) {
  Checkpoint ck = load_checkpoint(checkpoint_dir, false);
  RunModel r;
  r.checkpoint = checkpoint_dir;
  r.step = ck.state.step;
  r.config = parse_config(ck.state.config_toml, (checkpoint_dir / "state.json").string());
  const at::ScalarType compute = precision == RunPrecision::trained ? compute_dtype_of(r.config.train) : at::kFloat;
  r.model = std::make_unique<Transformer>(r.config.model, r.config.residual, at::kCPU, 0, at::kFloat, compute);
  r.model->parameters().load(ck.model.tensors, (checkpoint_dir / "model.safetensors").string());
  return r;
}

RunModel load_run_model(const std::filesystem::path& run_dir, const std::string& checkpoint, RunPrecision precision) {
  require_directory(run_dir, "a run directory");
  auto dir = find_checkpoint(run_dir, checkpoint);
  if (!dir) fail(run_dir.string(), ": run has no checkpoint", checkpoint.empty() ? "" : " named " + checkpoint);
  return load_checkpoint_model(*dir, precision);
}

std::unique_ptr<Tokenizer> load_data_tokenizer(const std::string& data_dir, int64_t vocab_size) {
  const std::string path = data_tokenizer_path(data_dir);
  auto tok = std::make_unique<Tokenizer>(path);
  if (tok->vocab_size() > vocab_size)
    fail(path, ": tokenizer has ", tok->vocab_size(), " ids, more than the model's model.vocab_size ", vocab_size);
  return tok;
}

}  // namespace depthkit
