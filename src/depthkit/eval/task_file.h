// Task files: the JSONL schema docs/tasks.md defines. A file holds an optional header line
// {"task": {...}} and one item per line, each in the native multiple-choice or generation schema or
// a mapped one (HellaSwag-style, ARC-style), detected per line by its keys; a file holds one type.
//
//   parse_task / load_task   JSONL → Task, every line checked ("FILE:LINE: what is wrong")
//   add_dev_file             another file's items join the few-shot pool
//   few_shot_items           the dev items shown before a scored item (seeded, never the item itself)
//   few_shot_prefix          their text, as the scored item's context or prompt follows it
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "depthkit/eval/task_types.h"

namespace depthkit {

struct TaskItem {
  int64_t line = 0;  // 1-based line in its file (for messages)
  bool dev = false;  // in the few-shot pool ("split": "dev" or "train"), not scored
  // Multiple choice: the candidates continue `context`; choices[gold] is right.
  std::string context;
  std::vector<std::string> choices;
  int64_t gold = -1;
  // Per choice, its length in characters (Unicode code points, Python's len) as lm-evaluation-
  // harness's doc_to_choice gives it: acc_norm divides by it. A mapped schema's choice is the
  // ending or answer text, without the " " that joins it to the context (the harness's
  // target_delimiter); a native choice is the candidate as written. Empty (items built in code):
  // the length of choices[c] itself.
  std::vector<int64_t> choice_chars;
  // Generation: `prompt` is continued by greedy decoding; any of `answers` is right. `target` is
  // what the item shows as a few-shot example after its prompt (default: answers[0]).
  std::string prompt, target;
  std::vector<std::string> answers;

  int64_t characters(size_t choice) const;  // choice_chars[choice], or the length of choices[choice]
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
// The text before a scored item's own context/prompt: each shot as its type shows it (context +
// gold choice, or prompt + target), each followed by the separator ("" when there are no shots).
std::string few_shot_prefix(const Task& task, const std::vector<size_t>& shots);

// Python's str semantics, where lm-evaluation-harness's results depend on them (the text is UTF-8).
// utf8_length: code points, Python's len(). python_space: str.isspace() of one code point.
// trailing_python_space: the bytes of `s`'s trailing characters that str.rstrip() removes.
int64_t utf8_length(std::string_view s);
bool python_space(char32_t c);
size_t trailing_python_space(std::string_view s);
// lm-evaluation-harness's hellaswag task (tasks/hellaswag/utils.py, lm-eval 0.4.13): its
// preprocess(text), and Python's str.capitalize() (the first character title-cased, the rest
// lowercased) for characters up to U+017F (ASCII, Latin-1, Latin Extended-A); others are kept.
std::string hellaswag_preprocess(std::string_view text);
std::string python_capitalize(std::string_view text);

// The item readers of the task-type table (task_types.h's read_item), one per type.
// Multiple choice: HellaSwag-style (key "endings"; with activity_label, ctx_a and ctx_b, as the
// harness's hellaswag task builds it), ARC-style ("question" and "answerKey"), native ("context" or
// "gold"); at least 2 non-empty choices and a gold index among them.
std::optional<TaskItem> read_choice_item(const nlohmann::json& line, const std::string& file, int64_t line_no);
// Generation: native ("prompt" or "answers"); at least one reference answer, none blank.
std::optional<TaskItem> read_generation_item(const nlohmann::json& line, const std::string& file, int64_t line_no);

}  // namespace depthkit
