// depthkit generate: text from a run's checkpoint, decoded incrementally (eval/generate.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/generate.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit::cli {

namespace {

struct GenerateArgs {
  std::string run_dir, checkpoint, data, prompt, prompt_file;
  int64_t max_new_tokens = 128;
  Sampling sampling;
  bool json = false;
};

// Prints the decoded continuation as it grows. A byte-fallback character arrives in several ids,
// and decoding its first bytes alone gives U+FFFD, so a trailing U+FFFD is held back until the
// character completes (or the text ends).
class TextStream {
 public:
  explicit TextStream(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  void add(int id) {
    ids_.push_back(id);
    emit(false);
  }
  void finish() { emit(true); }

 private:
  void emit(bool last) {
    std::string text = tokenizer_.decode(ids_);
    static const std::string replacement = "\xEF\xBF\xBD";
    if (!last && text.size() >= replacement.size() && text.compare(text.size() - 3, 3, replacement) == 0) return;
    // Decoding more ids appends to the text; should it ever change what was printed, what is
    // out stays out, and the text goes on from where the two agree.
    size_t common = 0;
    while (common < printed_.size() && common < text.size() && printed_[common] == text[common]) ++common;
    std::fwrite(text.data() + common, 1, text.size() - common, stdout);
    std::fflush(stdout);
    printed_ = std::move(text);
  }
  const Tokenizer& tokenizer_;
  std::vector<int> ids_;
  std::string printed_;
};

int run_generate(const GenerateArgs& a) {
  if (a.prompt.empty() == a.prompt_file.empty()) fail("generate: give exactly one of --prompt and --prompt-file");
  const std::string prompt = a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file, uintmax_t(16) << 20);
  if (prompt.empty()) fail(a.prompt_file.empty() ? std::string("--prompt") : a.prompt_file, ": the prompt is empty");
  RunModel run = load_run_model(a.run_dir, a.checkpoint);
  if (run.config.train.threads > 0) at::set_num_threads(int(run.config.train.threads));
  const auto tokenizer_owner = load_data_tokenizer(a.data.empty() ? run.config.data.dir : a.data, run.config.model.vocab_size);
  const Tokenizer& tokenizer = *tokenizer_owner;
  Transformer& model = *run.model;

  // The prompt starts a document: in training every document but the first follows the
  // end-of-document id, so the prompt does too.
  std::vector<int> ids = {tokenizer.eos_id()};
  for (int id : tokenizer.encode(prompt)) ids.push_back(id);
  if (int64_t(ids.size()) > run.config.model.seq_len)
    fail(a.prompt_file.empty() ? std::string("--prompt") : a.prompt_file, ": the prompt is ", ids.size(),
         " tokens (with the start-of-document id), more than the model's context, model.seq_len ",
         run.config.model.seq_len);
  TextStream stream(tokenizer);
  OnToken print;
  if (!a.json) print = [&stream](size_t, int id) { stream.add(id); return true; };
  const Generation g = generate(model, {ids}, a.max_new_tokens, a.sampling, tokenizer.eos_id(), print);
  std::vector<int> text_ids = g.tokens[0];
  if (!text_ids.empty() && text_ids.back() == tokenizer.eos_id()) text_ids.pop_back();
  const double prefill_rate = g.prefill_tokens / std::max(g.prefill_seconds, 1e-9);
  const double decode_rate = g.decode_tokens > 0 ? g.decode_tokens / std::max(g.decode_seconds, 1e-9) : 0.0;
  if (a.json) {
    nlohmann::json j = {{"checkpoint", run.checkpoint.string()},
                        {"step", run.step},
                        {"text", tokenizer.decode(text_ids)},
                        {"prompt_tokens", int64_t(ids.size())},
                        {"generated_tokens", int64_t(g.tokens[0].size())},
                        {"stopped", g.stopped[0]},
                        {"prefill_tokens", g.prefill_tokens},
                        {"prefill_seconds", g.prefill_seconds},
                        {"prefill_tokens_per_s", prefill_rate},
                        {"decode_tokens", g.decode_tokens},
                        {"decode_seconds", g.decode_seconds},
                        {"decode_tokens_per_s", decode_rate},
                        {"sampling",
                         {{"temperature", a.sampling.temperature},
                          {"top_k", a.sampling.top_k},
                          {"top_p", a.sampling.top_p},
                          {"seed", a.sampling.seed}}}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    stream.finish();
    std::fprintf(stderr, "\n%s (step %lld): prefill %lld tokens at %.1f tokens/s, decode %lld tokens at %.1f tokens/s; stopped: %s\n",
                 run.checkpoint.c_str(), (long long)run.step, (long long)g.prefill_tokens, prefill_rate,
                 (long long)g.decode_tokens, decode_rate, g.stopped[0].c_str());
  }
  return 0;
}

}  // namespace

void add_generate(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("generate", "write text from a checkpoint, decoding incrementally");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--run-dir", a->run_dir, "run directory")->required();
  cmd->add_option("--checkpoint", a->checkpoint, "checkpoint name, e.g. step_00000100 (default: latest)");
  cmd->add_option("--data", a->data, "prepared data directory holding the tokenizer (tokenizer.model or tokenizer.json; default: the run's data.dir)");
  cmd->add_option("--prompt", a->prompt, "the prompt text");
  cmd->add_option("--prompt-file", a->prompt_file, "a file whose whole text is the prompt");
  add_number(cmd, "--max-new-tokens", a->max_new_tokens, 0, INT64_MAX, "ids to generate at most (default 128)");
  add_number(cmd, "--temperature", a->sampling.temperature, 0.0, std::numeric_limits<double>::infinity(),
             "sampling temperature; 0 is greedy (default 1)");
  add_number(cmd, "--top-k", a->sampling.top_k, 0, INT64_MAX, "sample among the k most likely ids; 0: all (default 0)");
  add_number(cmd, "--top-p", a->sampling.top_p, 0.0, 1.0, "sample among the most likely ids of this much mass (default 1)",
             Bound::open);
  add_number(cmd, "--seed", a->sampling.seed, 0, UINT64_MAX, "the sampler's seed (default 0)");
  cmd->add_flag("--json", a->json, "print one JSON object (text, counts, tokens/s) instead of streaming the text");
  cmd->callback([&action, a] { action = [a] { return run_generate(*a); }; });
}

}  // namespace depthkit::cli
