// Scoring a task (task_file.h) on a model, MSAR Appendix A's protocols: likelihood-based multiple
// choice (each candidate continuation scored by its conditional log-likelihood given the few-shot
// context) and generation with answer scoring (greedy decoding until a stop string, an
// answer-extraction regex, exact match). docs/tasks.md describes both.
//
//   score_continuations  log-likelihoods of continuations given contexts, batched and right-padded
//   evaluate_task        a task's scored items → accuracies with standard errors, by the scorer of
//                        its type (task_types.h): evaluate_choice_items or evaluate_generation_items
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "depthkit/eval/task_file.h"
#include "depthkit/eval/task_types.h"

namespace depthkit {

class Transformer;
class Tokenizer;

// One continuation to score given its context (token ids; the context at least one id).
struct Continuation {
  std::vector<int> context, continuation;
};
struct ContinuationScore {
  double logprob = 0;       // Σ_j log p(continuation_j | context, continuation_<j)
  int64_t tokens = 0;       // continuation tokens
  bool truncated = false;   // the context was cut from the left to fit the model's context
};
// The harness's split of a context and a continuation into token ids (lm-evaluation-harness 0.4.13,
// TemplateLM._encode_pair, and HFLM with its tokenizer adding a BOS): the context's trailing
// whitespace (Python's str.rstrip()) moves to the continuation; the context's ids are
// [eos] + encode(context without it), the continuation's the rest of [eos] + encode(context +
// continuation) after as many ids. So a continuation is tokenized as it reads after its context,
// not on its own. Empty when the whole text has no more ids than the context alone.
Continuation harness_split(const Tokenizer& tokenizer, const std::string& context, const std::string& continuation);

// Scores every request: context ++ continuation runs through the model as one causal sequence,
// several per forward (right-padded: a causal model's positions never see what follows them), at
// most `batch_tokens` positions per forward (0: a default sized to the vocabulary). When
// context + continuation − 1 exceeds model.seq_len the context loses tokens from its left, never
// the continuation; a continuation longer than seq_len is refused (depthkit::Error).
// `on_scored(i)` is called as request i is finished (longest first, not in request order).
std::vector<ContinuationScore> score_continuations(Transformer& model, const std::vector<Continuation>& requests,
                                                   int64_t batch_tokens = 0,
                                                   const std::function<void(size_t)>& on_scored = {});

// The mean of per-item scores and its standard error: the sample standard deviation (n − 1)
// over √n, 0 for fewer than 2 items.
struct Accuracy {
  double value = 0, standard_error = 0;
};
Accuracy mean_with_stderr(const std::vector<double>& scores);

// Generation: `text` up to the first occurrence of any stop string (all of it when none occurs).
std::string cut_at_stop(const std::string& text, const std::vector<std::string>& stop);
// The answer in a generated text: the regex's first capture group (its whole match when it has
// none), searched for anywhere in the text (ECMAScript syntax), "" when it does not match; the whole
// text when `regex` is empty; stripped of surrounding blanks either way.
std::string extract_answer(const std::string& text, const std::string& regex);

struct TaskOptions {
  int64_t shots = -1;             // -1: the task's own
  std::optional<uint64_t> seed;   // absent: the task's own
  int64_t limit = 0;              // score only the first `limit` scored items (0: all)
  int64_t batch_tokens = 0;       // score_continuations' budget (0: its default)
  int64_t generation_batch = 16;  // prompts decoded together
  bool progress = true;           // a progress bar on stderr
  bool per_item = false;          // the result's JSON lists every scored item (eval --per-item)
};

// Multiple choice, one scored item: each candidate's log-likelihood and tokens (as the harness's
// split gives them), and the candidate each accuracy chose.
struct ChoiceItemScores {
  int64_t line = 0, gold = 0;
  std::vector<double> logprob;
  std::vector<int64_t> tokens;
  int64_t total = 0, per_token = 0, per_byte = 0, acc_norm = 0;
};

struct TaskResult {
  std::string name, file;
  TaskType type = TaskType::kChoice;
  int64_t items = 0, shots = 0;
  uint64_t seed = 0;
  // Multiple choice: accuracy of the argmax by total log-likelihood (lm-evaluation-harness's acc),
  // by its mean per token (the lowest conditional perplexity), by its mean per UTF-8 byte of the
  // candidate, and by its mean per character of the choice (the harness's acc_norm:
  // TaskItem::characters); ties go to the first candidate. chance = the mean over items of
  // 1 / candidates.
  Accuracy total, per_token, per_byte, acc_norm;
  double chance = 0;
  // Generation: exact match of the extracted answer with any reference (both stripped).
  Accuracy exact_match;
  int64_t sequences = 0;   // candidates (multiple choice) or prompts (generation) run
  int64_t truncated = 0;   // of those, how many lost context tokens from the left to fit
  int64_t tokens = 0;      // positions run through the model (scored + prompt + generated)
  double seconds = 0;
  std::vector<int64_t> predictions;  // per scored item: the chosen candidate (per-token mean); generation: 1 if right
  std::vector<std::string> outputs;  // generation: per scored item, the decoded output cut at the stop string
  std::vector<int64_t> lines;        // per scored item, its line in the task file
  std::vector<ChoiceItemScores> choice_items;  // multiple choice: per scored item, its scores
  bool per_item = false;             // to_json lists every scored item ("per_item"; TaskOptions::per_item)

  // The accuracy compare and the summary line report, its type's primary metric (task_types.h):
  // per-token mean (multiple choice), exact match (generation).
  const Accuracy& primary() const;
  const char* primary_metric() const;
  nlohmann::json to_json() const;
  std::string to_text() const;  // a few lines for the terminal
};

// Scores the task's scored items (the first opt.limit of them) on the model, with `tokenizer`
// (whose ids the model was trained on). Throws, naming the file and line, on an item that cannot be
// scored (a candidate longer than the model's context, a prompt leaving no room to generate).
TaskResult evaluate_task(Transformer& model, const Tokenizer& tokenizer, const Task& task, const TaskOptions& opt);

// The scorers of the task-type table (task_types.h's evaluate), one per type; evaluate_task calls
// the task's. Multiple choice: every candidate of every item split by harness_split and scored by
// score_continuations, the argmax by total, per-token, per-byte and per-character log-likelihood. Generation: greedy decoding of each
// prompt, its answer extracted and matched against the references.
void evaluate_choice_items(Transformer& model, const Tokenizer& tokenizer, const Task& task,
                           const std::vector<size_t>& scored, const TaskOptions& opt, TaskResult& r);
void evaluate_generation_items(Transformer& model, const Tokenizer& tokenizer, const Task& task,
                               const std::vector<size_t>& scored, const TaskOptions& opt, TaskResult& r);

}  // namespace depthkit
