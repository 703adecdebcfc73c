// depthkit forward: logits of a checkpoint for given token ids, as safetensors.
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "depthkit/cli/commands.h"
#include "depthkit/io/safetensors.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/io/token_file.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

namespace {

// Logits are computed a chunk of sequences at a time (about this many bytes of logits each) and
// streamed to the output file, so memory stays bounded however many sequences the file holds; the
// output's size is checked against the file system's free space before any work.
constexpr int64_t kChunkLogitBytes = int64_t(64) << 20;

int run_forward(const std::string& checkpoint, const std::string& tokens_path, const std::string& out) {
  if (fs::is_directory(out)) fail(out, ": is a directory, expected a .safetensors file path to write");
  const RunModel run = load_checkpoint_model(resolve_checkpoint(checkpoint), RunPrecision::float32);
  const Config& cfg = run.config;
  at::Tensor tokens = read_token_file(tokens_path);
  const int64_t B = tokens.size(0), T = tokens.size(1), V = cfg.model.vocab_size;
  const int64_t top = tokens.max().item<int64_t>();
  if (T > cfg.model.seq_len) fail(tokens_path, ": sequences of ", T, " tokens exceed model.seq_len ", cfg.model.seq_len);
  if (top >= V) fail(tokens_path, ": token id ", top, " is >= vocab_size ", V);
  Transformer& model = *run.model;

  // The output must fit the file system it goes to (checked before anything is created there).
  fs::path out_dir = fs::absolute(out).parent_path();
  while (!fs::exists(out_dir) && out_dir.has_parent_path() && out_dir != out_dir.parent_path()) out_dir = out_dir.parent_path();
  const uintmax_t free_bytes = fs::space(out_dir).available;
  uint64_t logit_bytes = 4;
  for (int64_t n : {B, T, V}) __builtin_mul_overflow(logit_bytes, uint64_t(n), &logit_bytes);
  if (logit_bytes > free_bytes)
    fail(out, ": the logits of ", B, " x ", T, " tokens over ", V, " ids need ", logit_bytes, " bytes, and ",
         out_dir.string(), " has ", free_bytes, " free");
  SafetensorsStreamWriter writer(out, "logits", at::kFloat, {B, T, V},
                                 {{"checkpoint", run.checkpoint.string()}, {"step", std::to_string(run.step)}});
  const int64_t rows = std::max<int64_t>(1, kChunkLogitBytes / (T * V * 4));
  at::NoGradGuard no_grad;
  for (int64_t r = 0; r < B; r += rows) {
    const int64_t n = std::min(rows, B - r);
    Building building(cat("the logits of sequences ", r, "..", r + n - 1, " (", n * T * V * 4, " bytes)"));
    writer.append(model.logits(tokens.narrow(0, r, n)).to(at::kFloat));
  }
  writer.commit();
  std::printf("wrote %s: logits [%lld, %lld, %lld]\n", out.c_str(), (long long)B, (long long)T, (long long)V);
  return 0;
}

}  // namespace

void add_forward(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("forward", "write the logits of a checkpoint for token ids");
  struct Args {
    std::string checkpoint, tokens, out;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--checkpoint", a->checkpoint, "checkpoint folder, or a run directory (its latest)")->required();
  cmd->add_option("--tokens", a->tokens, ".npy integer array [T] or [batch, T], or text: ids per line")->required();
  cmd->add_option("--out", a->out, "output .safetensors: 'logits', float32 [batch, T, vocab]")->required();
  cmd->callback([&action, a] { action = [a] { return run_forward(a->checkpoint, a->tokens, a->out); }; });
}

}  // namespace depthkit::cli
