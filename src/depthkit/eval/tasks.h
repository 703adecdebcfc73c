// Downstream evaluation (`depthkit eval --task`), MSAR Appendix A's protocols: likelihood-based
// multiple choice (each candidate continuation scored by its conditional log-likelihood given the
// few-shot context) and generation with answer scoring (greedy decoding until a stop string, an
// answer-extraction regex, exact match). docs/tasks.md defines the JSONL schema this file reads.
//
// The pieces, each usable on its own:
//   load_task            JSONL → Task (native, HellaSwag-style and ARC-style lines, detected per line)
//   few_shot_items       the dev items shown before a scored item (seeded, never the item itself)
//   score_continuations  log-likelihoods of continuations given contexts, batched and right-padded
//   evaluate_task        all of it over a task's scored items → accuracies with standard errors
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class Transformer;
class Tokenizer;

enum class TaskType { kChoice, kGeneration };

struct TaskItem {
  int64_t line = 0;  // 1-based line in its file (for messages)
  bool dev = false;  // in the few-shot pool ("split": "dev" or "train"), not scored
  // Multiple choice: the candidates continue `context`; choices[gold] is right.
  std::string context;
  std::vector<std::string> choices;
  int64_t gold = -1;
  // Generation: `prompt` is continued by greedy decoding; any of `answers` is right. `target` is
  // what the item shows as a few-shot example after its prompt (default: answers[0]).
  std::string prompt, target;
  std::vector<std::string> answers;
};

struct Task {
  std::string file;  // where it was read from (messages name it)
  std::string name;  // the header's "name", else the file's stem
  TaskType type = TaskType::kChoice;
  uint64_t seed = 1234;  // of the few-shot draws (the header's "seed")
  int64_t shots = 0;     // the header's "shots": the default of --shots
  std::string separator = "\n\n";  // between few-shot examples, and before the scored item
  // Generation only.
  std::vector<std::string> stop = {"\n"};  // decoding ends at the first of these (not part of the answer)
  std::string regex;                       // answer extraction ("" = the whole stripped output)
  int64_t max_new_tokens = 32;
  std::vector<TaskItem> items;  // every item, in file order (dev and scored)

  std::vector<size_t> scored() const;  // indices of the items that are scored, in file order
  std::vector<size_t> dev() const;     // indices of the few-shot pool, in file order
};

// Parses a task file: an optional header line {"task": {...}}, then one item per line (blank lines
// skipped). A malformed line throws depthkit::Error "FILE:LINE: what is wrong".
Task parse_task(const std::string& text, const std::string& file);
Task load_task(const std::filesystem::path& file);
// Adds the items of `dev_file` (a sibling file of the same type, e.g. an exported train split) to
// the few-shot pool of `task`, whatever their "split".
void add_dev_file(Task& task, const std::filesystem::path& dev_file);

// The k dev items shown before the scored item task.items[item], as indices into task.items: a
// seeded draw without replacement from the pool, the same for the same (seed, item) whatever else
// is scored, skipping any dev item whose text equals the scored item's (a data set that repeats an
// item across splits). Fails, naming the file, when the pool holds fewer than k such items.
std::vector<size_t> few_shot_items(const Task& task, size_t item, int64_t k, uint64_t seed);
// The text before a scored item's own context/prompt: each shot's context + gold choice (or
// prompt + target), each followed by the separator ("" when there are no shots).
std::string few_shot_prefix(const Task& task, const std::vector<size_t>& shots);

// One continuation to score given its context (token ids; the context at least one id).
struct Continuation {
  std::vector<int> context, continuation;
};
struct ContinuationScore {
  double logprob = 0;       // Σ_j log p(continuation_j | context, continuation_<j)
  int64_t tokens = 0;       // continuation tokens
  bool truncated = false;   // the context was cut from the left to fit the model's context
};
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
};

struct TaskResult {
  std::string name, file;
  TaskType type = TaskType::kChoice;
  int64_t items = 0, shots = 0;
  uint64_t seed = 0;
  // Multiple choice: accuracy of the argmax by total log-likelihood, by its mean per token (the
  // lowest conditional perplexity) and by its mean per UTF-8 byte of the candidate; ties go to the
  // first candidate. chance = the mean over items of 1 / candidates.
  Accuracy total, per_token, per_byte;
  double chance = 0;
  // Generation: exact match of the extracted answer with any reference (both stripped).
  Accuracy exact_match;
  int64_t sequences = 0;   // candidates (multiple choice) or prompts (generation) run
  int64_t truncated = 0;   // of those, how many lost context tokens from the left to fit
  int64_t tokens = 0;      // positions run through the model (scored + prompt + generated)
  double seconds = 0;
  std::vector<int64_t> predictions;  // per scored item: the chosen candidate (per-token mean); generation: 1 if right
  std::vector<std::string> outputs;  // generation: per scored item, the decoded output cut at the stop string

  // The accuracy compare and the summary line report: per-token mean (multiple choice), exact match (generation).
  const Accuracy& primary() const { return type == TaskType::kChoice ? per_token : exact_match; }
  const char* primary_metric() const { return type == TaskType::kChoice ? "per_token" : "exact_match"; }
  nlohmann::json to_json() const;
  std::string to_text() const;  // a few lines for the terminal
};

// Scores the task's scored items (the first opt.limit of them) on the model, with `tokenizer`
// (whose ids the model was trained on). Throws, naming the file and line, on an item that cannot be
// scored (a candidate longer than the model's context, a prompt leaving no room to generate).
TaskResult evaluate_task(Transformer& model, const Tokenizer& tokenizer, const Task& task, const TaskOptions& opt);

}  // namespace depthkit
