// The task-type table (task_types.h): an entry per type, and the small pieces of each type that
// need no file of their own (its few-shot example, its JSON and text report, compare's note). The
// large ones live beside what they share: the item readers in task_file.cpp, the scorers in
// task_scoring.cpp.
#include "depthkit/eval/task_types.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/eval/task_file.h"
#include "depthkit/eval/task_scoring.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

using nlohmann::json;

json accuracy_json(const Accuracy& a) { return {{"value", a.value}, {"stderr", a.standard_error}}; }

// "  <what>  41.0 % ± 3.5<tail>", the label padded so that the numbers line up.
std::string accuracy_line(const char* what, const Accuracy& a, const std::string& tail = "") {
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %-46s %5.1f %% ± %.1f%s\n", what, 100 * a.value, 100 * a.standard_error,
                tail.c_str());
  return buf;
}

// Multiple choice: a shot is its context and its gold choice; the per-token mean is primary.

std::string choice_shot(const TaskItem& item) { return item.context + item.choices[size_t(item.gold)]; }

void choice_json(const TaskResult& r, json& j) {
  j["accuracy"] = {{"per_token", accuracy_json(r.per_token)}, {"total", accuracy_json(r.total)},
                   {"per_byte", accuracy_json(r.per_byte)}, {"acc_norm", accuracy_json(r.acc_norm)}};
  j["chance"] = r.chance;
  if (!r.per_item) return;
  // Every scored item, so that another scorer (lm-evaluation-harness) can be compared item by item.
  json items = json::array();
  for (const ChoiceItemScores& s : r.choice_items)
    items.push_back({{"line", s.line},
                     {"gold", s.gold},
                     {"logprobs", s.logprob},
                     {"tokens", s.tokens},
                     {"chosen", {{"total", s.total}, {"per_token", s.per_token}, {"per_byte", s.per_byte},
                                 {"acc_norm", s.acc_norm}}}});
  j["per_item"] = std::move(items);
}

std::string choice_text(const TaskResult& r) {
  char chance[64];
  std::snprintf(chance, sizeof chance, "   (chance %.1f %%)", 100 * r.chance);
  return cat(r.sequences, " candidates\n") +
         accuracy_line("accuracy by per-token mean log-likelihood:", r.per_token, chance) +
         accuracy_line("accuracy by total log-likelihood:", r.total, "   (lm-eval's acc)") +
         accuracy_line("accuracy by per-byte mean log-likelihood:", r.per_byte) +
         accuracy_line("accuracy by per-character mean log-likelihood:", r.acc_norm, "   (lm-eval's acc_norm)") +
         cat("  contexts cut from the left to fit: ", r.truncated, " of ", r.sequences, " candidates\n");
}

std::string choice_note(const json& task) {
  char chance[64];
  std::snprintf(chance, sizeof chance, "%.1f", 100 * task["chance"].get<double>());
  return cat("accuracy of the candidate with the highest mean log-likelihood per token (the lowest conditional "
             "perplexity), chance ", chance, " %");
}

// Generation: a shot is its prompt and its target; exact match is the only metric.

std::string generation_shot(const TaskItem& item) { return item.prompt + item.target; }

void generation_json(const TaskResult& r, json& j) {
  j["accuracy"] = {{"exact_match", accuracy_json(r.exact_match)}};
  j["chance"] = nullptr;  // no fixed set of answers to guess among
  if (!r.per_item) return;
  json items = json::array();
  for (size_t i = 0; i < r.outputs.size(); ++i)
    items.push_back({{"line", r.lines[i]}, {"output", r.outputs[i]}, {"right", r.predictions[i] != 0}});
  j["per_item"] = std::move(items);
}

std::string generation_text(const TaskResult& r) {
  return "greedy decoding\n" + accuracy_line("exact match:", r.exact_match) +
         cat("  prompts cut from the left to fit: ", r.truncated, " of ", r.sequences, "\n");
}

std::string generation_note(const json&) { return "exact match of the greedy answer"; }

}  // namespace

const std::vector<TaskTypeInfo>& task_types() {
  // In TaskType order; task_type_info and tests/test_tasks.cpp hold it to that.
  static const std::vector<TaskTypeInfo> table = {
      {.type = TaskType::kChoice,
       .name = "multiple-choice",
       .json_name = "multiple_choice",
       .metric = "per_token",
       .primary = &TaskResult::per_token,
       .metric_label = "acc. % (per-token LL)",
       .metric_note = choice_note,
       .read_item = read_choice_item,
       .shot = choice_shot,
       .evaluate = evaluate_choice_items,
       .write_json = choice_json,
       .text = choice_text},
      {.type = TaskType::kGeneration,
       .name = "generation",
       .json_name = "generation",
       .metric = "exact_match",
       .primary = &TaskResult::exact_match,
       .metric_label = "exact match %",
       .metric_note = generation_note,
       .read_item = read_generation_item,
       .shot = generation_shot,
       .evaluate = evaluate_generation_items,
       .write_json = generation_json,
       .text = generation_text},
  };
  return table;
}

const TaskTypeInfo& task_type_info(TaskType type) {
  const auto& table = task_types();
  const size_t i = size_t(type);
  if (i >= table.size() || table[i].type != type) fail("task type ", i, " has no entry in the task-type table");
  return table[i];
}

const TaskTypeInfo* find_task_type(std::string_view json_name) {
  for (const TaskTypeInfo& t : task_types())
    if (json_name == t.json_name) return &t;
  return nullptr;
}

}  // namespace depthkit
