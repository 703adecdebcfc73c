// The task-type table: one entry per type of downstream task (multiple choice, generation), holding
// everything that differs between the types, and the one place that knows it. Reading a task file
// (task_file.cpp) asks it which type a line is and how that type shows a few-shot example; scoring
// (task_scoring.cpp) asks it how to evaluate a task and how to report the result; compare
// (analysis/compare_report.cpp) asks it how to head and describe a task's column. Nothing else
// branches on the type.
//
// To add a type: its enumerator before kCount; its item reader in task_file.cpp (the keys that
// recognise its lines, the checks on them); its scorer in task_scoring.cpp; its entry in
// task_types.cpp. tests/test_tasks.cpp fails while any TaskType lacks a complete entry.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace depthkit {

class Transformer;
class Tokenizer;
struct Accuracy;
struct Task;
struct TaskItem;
struct TaskOptions;
struct TaskResult;

// kCount is no type: the number of types, so that a test can walk them all.
enum class TaskType { kChoice, kGeneration, kCount };

struct TaskTypeInfo {
  TaskType type = TaskType::kCount;
  const char* name = nullptr;       // in messages: "multiple-choice", "generation"
  const char* json_name = nullptr;  // a result's "type": "multiple_choice", "generation"

  // The primary metric (the summary line's and compare's): its key in a result's "accuracy", its
  // value in a TaskResult, how compare's table heads its column ("NAME <label>") and the note under
  // the table that says what it measures, given the task's entry of results.json's "tasks".
  const char* metric = nullptr;
  Accuracy TaskResult::*primary = nullptr;
  const char* metric_label = nullptr;
  std::string (*metric_note)(const nlohmann::json& task) = nullptr;

  // Reading: the item a line holds when its keys are one of this type's schemas, checked (a
  // malformed one throws "FILE:LINE: what is wrong"); nullopt when they are none of this type's.
  // Lines are offered to the types in table order, so the first type that recognises a line has it.
  std::optional<TaskItem> (*read_item)(const nlohmann::json& line, const std::string& file, int64_t line_no) = nullptr;
  // Few-shot: the text an item shows as an example (the task's separator follows it).
  std::string (*shot)(const TaskItem& item) = nullptr;

  // Scoring: sets r's accuracies, sequences, truncated, tokens, predictions and outputs for the
  // items task.items[scored[i]], with r.shots shots drawn with r.seed.
  void (*evaluate)(Transformer& model, const Tokenizer& tokenizer, const Task& task, const std::vector<size_t>& scored,
                   const TaskOptions& opt, TaskResult& r) = nullptr;
  // Reporting: a result's "accuracy" and "chance" keys (written into `j`), and its terminal text
  // after "NAME (FILE): N items, K-shot, " (ending in a newline).
  void (*write_json)(const TaskResult& r, nlohmann::json& j) = nullptr;
  std::string (*text)(const TaskResult& r) = nullptr;
};

// Every entry, in TaskType order.
const std::vector<TaskTypeInfo>& task_types();
// The entry of `type` (depthkit::Error for a type without one).
const TaskTypeInfo& task_type_info(TaskType type);
// The entry whose json_name is `json_name` (a result's "type"); nullptr when there is none.
const TaskTypeInfo* find_task_type(std::string_view json_name);

}  // namespace depthkit
