// depthkit forward: logits of a checkpoint for given token ids, as safetensors.
#include <ATen/core/grad_mode.h>

#include <cstdio>

#include "depthkit/cli/commands.h"
#include "depthkit/io/safetensors.h"
#include "depthkit/io/token_file.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

void add_forward(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("forward", "write the logits of a checkpoint for token ids");
  struct Args {
    std::string checkpoint, tokens, out;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--checkpoint", a->checkpoint, "checkpoint folder, or a run directory (its latest)")->required();
  cmd->add_option("--tokens", a->tokens, ".npy integer array [T] or [batch, T], or text: ids per line")->required();
  cmd->add_option("--out", a->out, "output .safetensors: 'logits', float32 [batch, T, vocab]")->required();
  cmd->callback([&action, a] {
    action = [a] {
      const fs::path dir = resolve_checkpoint(a->checkpoint);
      Checkpoint ck = load_checkpoint(dir, false);
      Config cfg = Config::parse(ck.state.config_toml, (dir / "state.json").string());
      at::Tensor tokens = read_token_file(a->tokens);
      const int64_t T = tokens.size(1), top = tokens.max().item<int64_t>();
      if (T > cfg.model.seq_len) fail(a->tokens, ": sequences of ", T, " tokens exceed model.seq_len ", cfg.model.seq_len);
      if (top >= cfg.model.vocab_size) fail(a->tokens, ": token id ", top, " is >= vocab_size ", cfg.model.vocab_size);
      Transformer model(cfg.model, cfg.residual, at::kCPU, 0);
      model.parameters().load(ck.model.tensors, (dir / "model.safetensors").string());
      at::NoGradGuard no_grad;
      at::Tensor logits = model.logits(tokens).to(at::kFloat);
      save_safetensors(a->out, {{"logits", logits}}, {{"checkpoint", dir.string()}, {"step", std::to_string(ck.state.step)}});
      std::printf("wrote %s: logits [%lld, %lld, %lld]\n", a->out.c_str(), (long long)logits.size(0),
                  (long long)logits.size(1), (long long)logits.size(2));
      return 0;
    };
  });
}

}  // namespace depthkit::cli
