#include "depthkit/eval/tasks.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/logsumexp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <regex>

#include "depthkit/data/loader.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/generate.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {

using nlohmann::json;

// Where a line's problems are reported: "FILE:LINE".
struct Where {
  const std::string& file;
  int64_t line;
};
std::ostream& operator<<(std::ostream& os, const Where& w) { return os << w.file << ":" << w.line; }

std::string required_string(const json& j, const char* key, const Where& at) {
  auto it = j.find(key);
  if (it == j.end()) fail(at, ": key '", key, "' is missing");
  if (!it->is_string()) fail(at, ": key '", key, "' must be a string, got ", json_excerpt(*it));
  return it->get<std::string>();
}

std::vector<std::string> string_array(const json& v, const std::string& key, const Where& at) {
  if (!v.is_array()) fail(at, ": key '", key, "' must be an array of strings, got ", json_excerpt(v));
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string())
      fail(at, ": key '", key, "' must be an array of strings; element ", i, " is ", json_excerpt(v[i]));
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// An integer given as a number or, as some exports write labels, a string of digits.
int64_t integer_label(const json& v, const std::string& key, const Where& at) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (!s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos) return std::stoll(s);
    if (s.empty()) fail(at, ": key '", key, "' is empty (an unlabelled split cannot be scored)");
  }
  fail(at, ": key '", key, "' must be an integer index, got ", json_excerpt(v));
}

void check_choices(const TaskItem& item, const Where& at) {
  if (item.choices.size() < 2) fail(at, ": needs at least 2 choices, got ", item.choices.size());
  for (size_t c = 0; c < item.choices.size(); ++c)
    if (item.choices[c].empty()) fail(at, ": choice ", c, " is empty (nothing to score)");
  if (item.gold < 0 || item.gold >= int64_t(item.choices.size()))
    fail(at, ": gold index ", item.gold, " is outside the ", item.choices.size(), " choices (0-based)");
}

// HellaSwag-style: {"ctx": ..., "endings": [...], "label": i} (or ctx_a/ctx_b instead of ctx).
// The endings continue the context after a space, as the data set's own sentences do.
TaskItem hellaswag_item(const json& j, const Where& at) {
  TaskItem item;
  if (j.contains("ctx")) {
    item.context = required_string(j, "ctx", at);
  } else {
    item.context = required_string(j, "ctx_a", at);
    const std::string b = j.contains("ctx_b") ? required_string(j, "ctx_b", at) : "";
    if (!b.empty()) item.context += " " + b;
  }
  for (const auto& e : string_array(j["endings"], "endings", at)) item.choices.push_back(" " + e);
  if (!j.contains("label")) fail(at, ": key 'label' is missing");
  item.gold = integer_label(j["label"], "label", at);
  return item;
}

// ARC-style: {"question": ..., "choices": {"text": [...], "label": ["A", ...]}, "answerKey": "B"}.
TaskItem arc_item(const json& j, const Where& at) {
  TaskItem item;
  item.context = "Question: " + required_string(j, "question", at) + "\nAnswer:";
  if (!j.contains("choices")) fail(at, ": key 'choices' is missing");
  const json& ch = j["choices"];
  if (!ch.is_object() || !ch.contains("text") || !ch.contains("label"))
    fail(at, ": key 'choices' must be an object with 'text' and 'label' arrays (ARC), got ", json_excerpt(ch));
  const auto text = string_array(ch["text"], "choices.text", at);
  const auto labels = string_array(ch["label"], "choices.label", at);
  if (text.size() != labels.size())
    fail(at, ": 'choices.text' has ", text.size(), " entries but 'choices.label' ", labels.size());
  for (const auto& t : text) item.choices.push_back(" " + t);
  const std::string key = required_string(j, "answerKey", at);
  auto it = std::find(labels.begin(), labels.end(), key);
  if (it == labels.end()) fail(at, ": answerKey \"", printable(key), "\" is not one of the choice labels");
  item.gold = it - labels.begin();
  return item;
}

// Native multiple choice: {"context": ..., "choices": [...], "gold": i}.
TaskItem native_choice_item(const json& j, const Where& at) {
  TaskItem item;
  item.context = required_string(j, "context", at);
  if (!j.contains("choices")) fail(at, ": key 'choices' is missing");
  item.choices = string_array(j["choices"], "choices", at);
  if (!j.contains("gold")) fail(at, ": key 'gold' is missing");
  if (!j["gold"].is_number_integer() || (j["gold"].is_number_unsigned() && j["gold"].get<uint64_t>() > uint64_t(INT64_MAX)))
    fail(at, ": key 'gold' must be an integer index, got ", json_excerpt(j["gold"]));
  item.gold = j["gold"].get<int64_t>();
  return item;
}

// Native generation: {"prompt": ..., "answers": [...] or "...", "target": ...}.
TaskItem native_generation_item(const json& j, const Where& at) {
  TaskItem item;
  item.prompt = required_string(j, "prompt", at);
  if (!j.contains("answers")) fail(at, ": key 'answers' is missing");
  item.answers = j["answers"].is_string() ? std::vector<std::string>{j["answers"].get<std::string>()}
                                          : string_array(j["answers"], "answers", at);
  if (item.answers.empty()) fail(at, ": key 'answers' is empty (no reference answer)");
  // An empty reference would match every output the regex fails on (extracted as "").
  for (const std::string& answer : item.answers)
    if (answer.find_first_not_of(" \t\r\n") == std::string::npos) fail(at, ": key 'answers' holds a blank answer");
  item.target = j.contains("target") ? required_string(j, "target", at) : item.answers[0];
  return item;
}

// Which of the schemas a line uses, from its keys.
std::pair<TaskItem, TaskType> parse_item(const json& j, const Where& at) {
  TaskItem item;
  TaskType type = TaskType::kChoice;
  if (j.contains("endings")) {
    item = hellaswag_item(j, at);
  } else if (j.contains("question") && j.contains("answerKey")) {
    item = arc_item(j, at);
  } else if (j.contains("context") || j.contains("gold")) {
    item = native_choice_item(j, at);
  } else if (j.contains("prompt") || j.contains("answers")) {
    item = native_generation_item(j, at);
    type = TaskType::kGeneration;
  } else {
    fail(at, ": not a task item: expected the keys context/choices/gold (multiple choice), prompt/answers "
         "(generation), ctx/endings/label (HellaSwag) or question/choices/answerKey (ARC)");
  }
  if (type == TaskType::kChoice) check_choices(item, at);
  if (j.contains("split")) {
    if (!j["split"].is_string()) fail(at, ": key 'split' must be a string, got ", json_excerpt(j["split"]));
    const std::string split = j["split"].get<std::string>();
    item.dev = split == "dev" || split == "train";
  }
  item.line = at.line;
  return {item, type};
}

void parse_header(const json& h, Task& task, const Where& at) {
  if (!h.is_object()) fail(at, ": key 'task' must be an object, got ", json_excerpt(h));
  static const std::vector<std::string> keys = {"name", "description", "seed", "shots", "separator",
                                                "stop", "regex", "max_new_tokens"};
  for (const auto& [k, v] : h.items())
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) fail(at, ": unknown key 'task.", printable(k), "'");
  auto integer = [&](const char* key, int64_t lo, int64_t hi) {
    const json& v = h[key];
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail(at, ": key 'task.", key, "' must be an integer in [", lo, ", ", hi, "], got ", json_excerpt(v));
    return v.get<int64_t>();
  };
  auto text = [&](const char* key) {
    if (!h[key].is_string()) fail(at, ": key 'task.", key, "' must be a string, got ", json_excerpt(h[key]));
    return h[key].get<std::string>();
  };
  if (h.contains("name")) {
    task.name = text("name");
    if (task.name.empty() || task.name != printable(task.name) || task.name.size() > 100)
      fail(at, ": key 'task.name' must be 1 to 100 printable characters");
  }
  if (h.contains("description")) text("description");
  if (h.contains("seed")) {
    const json& v = h["seed"];
    if (!v.is_number_unsigned()) fail(at, ": key 'task.seed' must be a non-negative integer, got ", json_excerpt(v));
    task.seed = v.get<uint64_t>();
  }
  if (h.contains("shots")) task.shots = integer("shots", 0, 1000);
  if (h.contains("separator")) task.separator = text("separator");
  if (h.contains("max_new_tokens")) task.max_new_tokens = integer("max_new_tokens", 1, 1 << 20);
  if (h.contains("stop")) {
    task.stop = string_array(h["stop"], "task.stop", at);
    for (const auto& s : task.stop)
      if (s.empty()) fail(at, ": key 'task.stop' holds an empty string (it would stop at once)");
  }
  if (h.contains("regex")) {
    task.regex = text("regex");
    try {
      std::regex check(task.regex);
    } catch (const std::regex_error& e) {
      fail(at, ": key 'task.regex': \"", printable(task.regex), "\" is not a valid ECMAScript regular expression (",
           e.what(), ")");
    }
  }
}

// The items of a file; `dev_file`: every item joins the few-shot pool, and none need be scored.
Task parse_lines(const std::string& text, const std::string& file, bool dev_file) {
  Task task;
  task.file = file;
  task.name = std::filesystem::path(file).stem().string();
  size_t pos = 0;
  int64_t line_no = 0;
  int64_t first_item_line = 0;
  bool seen_header = false;
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) pos = 3;  // a UTF-8 byte-order mark
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const Where at{file, line_no};
    // JSON text holds no NUL byte; one here would end the parse early, and the rest of the line
    // (another item, say) would go unread.
    if (const size_t nul = line.find('\0'); nul != std::string::npos)
      fail(at, ": a NUL byte at byte ", nul + 1, " of the line (JSON text holds none)");
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      fail(at, ": not valid JSON (at byte ", e.byte, " of the line)");
    } catch (const json::exception&) {  // a number beyond double's range, for one
      fail(at, ": not valid JSON (a number out of range)");
    }
    if (!j.is_object()) fail(at, ": expected a JSON object, got ", json_excerpt(j));
    if (j.contains("task")) {
      if (first_item_line > 0 || dev_file || seen_header)
        fail(at, ": the header {\"task\": {...}} may only be the first line of the task file");
      seen_header = true;
      parse_header(j["task"], task, at);
      continue;
    }
    auto [item, type] = parse_item(j, at);
    if (first_item_line == 0) {
      task.type = type;
      first_item_line = line_no;
    } else if (type != task.type) {
      fail(at, ": a ", type == TaskType::kChoice ? "multiple-choice" : "generation", " item in a ",
           task.type == TaskType::kChoice ? "multiple-choice" : "generation", " task (one type per file; line ",
           first_item_line, " sets it)");
    }
    if (dev_file) item.dev = true;
    task.items.push_back(std::move(item));
  }
  if (task.items.empty()) fail(file, ": holds no task items");
  if (!dev_file && task.scored().empty())
    fail(file, ": every item is in the few-shot pool (\"split\": \"dev\" or \"train\"); nothing to score");
  return task;
}

// Whether dev item `d` is the scored item `s` under another line (the same text).
bool same_text(const TaskItem& d, const TaskItem& s) {
  return d.context == s.context && d.choices == s.choices && d.prompt == s.prompt;
}

std::string strip(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// The default positions per forward: the logits of a batch, [positions, vocabulary] floats, kept
// to 64 MiB (with as much again for the log-sum-exp's temporary).
int64_t default_batch_tokens(int64_t seq_len, int64_t vocab) {
  return std::max<int64_t>(seq_len, (int64_t(1) << 24) / std::max<int64_t>(1, vocab));
}

json accuracy_json(const Accuracy& a) { return {{"value", a.value}, {"stderr", a.standard_error}}; }

TaskResult evaluate_choice(Transformer& model, const Tokenizer& tok, const Task& task, const std::vector<size_t>& scored,
                           int64_t shots, uint64_t seed, const TaskOptions& opt, TaskResult r) {
  const int64_t T = model.config().seq_len;
  std::vector<Continuation> requests;
  std::vector<size_t> first_request(scored.size() + 1, 0);  // item i's candidates: [first[i], first[i+1])
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    // Every sequence starts with the end-of-document id: the model saw each training document
    // begin after one, so the context reads as the start of a document.
    std::vector<int> context = {tok.eos_id()};
    const auto ids = tok.encode(few_shot_prefix(task, few_shot_items(task, scored[i], shots, seed)) + item.context);
    context.insert(context.end(), ids.begin(), ids.end());
    first_request[i] = requests.size();
    for (size_t c = 0; c < item.choices.size(); ++c) {
      auto cont = tok.encode(item.choices[c]);
      if (int64_t(cont.size()) > T)
        fail(Where{task.file, item.line}, ": choice ", c, " is ", cont.size(),
             " tokens, more than the model's whole context (model.seq_len ", T, ") holds");
      requests.push_back({context, std::move(cont)});
    }
  }
  first_request[scored.size()] = requests.size();
  std::vector<size_t> owner(requests.size()), remaining(scored.size());
  for (size_t i = 0; i < scored.size(); ++i) {
    remaining[i] = first_request[i + 1] - first_request[i];
    for (size_t q = first_request[i]; q < first_request[i + 1]; ++q) owner[q] = i;
  }
  Progress bar("score " + task.name, int64_t(scored.size()), "items");
  int64_t items_done = 0;
  auto on_scored = [&](size_t q) {
    if (--remaining[owner[q]] == 0 && opt.progress) {
      ++items_done;
      bar.update(items_done, double(items_done));
    }
  };
  if (opt.progress) bar.update(0, 0);  // the rate and ETA count from here
  const auto scores = score_continuations(model, requests, opt.batch_tokens, on_scored);
  if (opt.progress) bar.finish();

  std::vector<double> right_total, right_token, right_byte;
  double chance = 0;
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    int64_t best_total = 0, best_token = 0, best_byte = 0;
    auto better = [](double a, double b) { return a > b; };  // ties keep the first candidate
    std::vector<double> total, token, byte;
    for (size_t c = 0; c < item.choices.size(); ++c) {
      const ContinuationScore& s = scores[first_request[i] + c];
      total.push_back(s.logprob);
      token.push_back(s.logprob / double(s.tokens));
      byte.push_back(s.logprob / double(item.choices[c].size()));
      if (better(total[c], total[best_total])) best_total = int64_t(c);
      if (better(token[c], token[best_token])) best_token = int64_t(c);
      if (better(byte[c], byte[best_byte])) best_byte = int64_t(c);
      r.truncated += s.truncated;
      // Positions run: the context as kept, the continuation, less its last id (never an input).
      r.tokens += std::min<int64_t>(int64_t(requests[first_request[i] + c].context.size()), T + 1 - s.tokens) +
                  s.tokens - 1;
    }
    right_total.push_back(best_total == item.gold);
    right_token.push_back(best_token == item.gold);
    right_byte.push_back(best_byte == item.gold);
    r.predictions.push_back(best_token);
    chance += 1.0 / double(item.choices.size());
  }
  r.sequences = int64_t(requests.size());
  r.total = mean_with_stderr(right_total);
  r.per_token = mean_with_stderr(right_token);
  r.per_byte = mean_with_stderr(right_byte);
  r.chance = chance / double(scored.size());
  return r;
}

// The position of the earliest stop string in `text`, npos when none occurs.
size_t find_stop(const std::string& text, const std::vector<std::string>& stop) {
  size_t at = std::string::npos;
  for (const auto& s : stop) at = std::min(at, text.find(s));
  return at;
}

TaskResult evaluate_generation(Transformer& model, const Tokenizer& tok, const Task& task,
                               const std::vector<size_t>& scored, int64_t shots, uint64_t seed, const TaskOptions& opt,
                               TaskResult r) {
  const int64_t T = model.config().seq_len;
  // The prompt keeps room for the whole answer: at most seq_len − max_new_tokens ids.
  const int64_t room = T - task.max_new_tokens;
  if (room < 1)
    fail(task.file, ": task.max_new_tokens ", task.max_new_tokens, " leaves no room for a prompt in the model's context (model.seq_len ",
         T, ")");
  std::vector<std::vector<int>> prompts;
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    std::vector<int> ids = {tok.eos_id()};
    const auto text = tok.encode(few_shot_prefix(task, few_shot_items(task, scored[i], shots, seed)) + item.prompt);
    ids.insert(ids.end(), text.begin(), text.end());
    if (int64_t(ids.size()) > room) {  // cut from the left: the prompt's end is what the answer continues
      ids.erase(ids.begin(), ids.end() - room);
      ++r.truncated;
    }
    prompts.push_back(std::move(ids));
  }
  Progress bar("generate " + task.name, int64_t(scored.size()), "items");
  if (opt.progress) bar.update(0, 0);
  const Sampling greedy{.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 0};
  const int64_t per_batch = std::max<int64_t>(1, opt.generation_batch);
  std::vector<double> right;
  for (size_t start = 0; start < prompts.size(); start += size_t(per_batch)) {
    const size_t n = std::min(prompts.size() - start, size_t(per_batch));
    const std::vector<std::vector<int>> batch(prompts.begin() + int64_t(start), prompts.begin() + int64_t(start + n));
    std::vector<std::vector<int>> generated(n);
    // A sequence ends as soon as its decoded text holds a stop string.
    auto on_token = [&](size_t s, int id) {  // never called with the end-of-document id
      generated[s].push_back(id);
      return find_stop(tok.decode(generated[s]), task.stop) == std::string::npos;
    };
    const Generation g = generate(model, batch, task.max_new_tokens, greedy, tok.eos_id(), on_token);
    r.tokens += g.prefill_tokens + g.decode_tokens;
    for (size_t s = 0; s < n; ++s) {
      std::vector<int> ids = g.tokens[s];
      if (!ids.empty() && ids.back() == tok.eos_id()) ids.pop_back();
      const std::string text = cut_at_stop(tok.decode(ids), task.stop);
      const std::string answer = extract_answer(text, task.regex);
      const auto& refs = task.items[scored[start + s]].answers;
      const bool ok = std::any_of(refs.begin(), refs.end(), [&](const std::string& a) { return strip(a) == answer; });
      right.push_back(ok);
      r.predictions.push_back(ok);
      r.outputs.push_back(text);
    }
    if (opt.progress) bar.update(int64_t(start + n), double(start + n));
  }
  if (opt.progress) bar.finish();
  r.sequences = int64_t(prompts.size());
  r.exact_match = mean_with_stderr(right);
  return r;
}

}  // namespace

std::vector<size_t> Task::scored() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < items.size(); ++i)
    if (!items[i].dev) out.push_back(i);
  return out;
}

std::vector<size_t> Task::dev() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].dev) out.push_back(i);
  return out;
}

Task parse_task(const std::string& text, const std::string& file) { return parse_lines(text, file, false); }

Task load_task(const std::filesystem::path& file) {
  if (!std::filesystem::exists(file)) fail(file.string(), ": task file not found");
  return parse_task(read_file(file), file.string());
}

void add_dev_file(Task& task, const std::filesystem::path& dev_file) {
  if (!std::filesystem::exists(dev_file)) fail(dev_file.string(), ": dev file not found");
  Task dev = parse_lines(read_file(dev_file), dev_file.string(), true);
  if (dev.type != task.type)
    fail(dev_file.string(), ": holds ", dev.type == TaskType::kChoice ? "multiple-choice" : "generation",
         " items but ", task.file, " is a ", task.type == TaskType::kChoice ? "multiple-choice" : "generation", " task");
  task.items.insert(task.items.end(), dev.items.begin(), dev.items.end());
}

std::vector<size_t> few_shot_items(const Task& task, size_t item_index, int64_t k, uint64_t seed) {
  if (k <= 0) return {};
  if (item_index >= task.items.size()) fail(task.file, ": no item ", item_index);
  const TaskItem& item = task.items[item_index];
  std::vector<size_t> pool;
  for (size_t d : task.dev())
    if (!same_text(task.items[d], item)) pool.push_back(d);
  if (int64_t(pool.size()) < k)
    fail(task.file, ": ", k, " shots (--shots, or the header's \"shots\") need ", k, " few-shot items but its dev split (\"split\": \"dev\" or \"train\", "
         "or --dev FILE) holds ", pool.size(), pool.size() == task.dev().size() ? "" : " other than the item scored",
         " (line ", item.line, ")");
  // A partial Fisher–Yates shuffle on a stream of its own per item: an item's shots do not depend
  // on which other items are scored (--limit).
  uint64_t state = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t(item_index) + 1));
  for (int64_t i = 0; i < k; ++i) {
    const uint64_t j = uint64_t(i) + splitmix64(state) % uint64_t(pool.size() - size_t(i));
    std::swap(pool[size_t(i)], pool[j]);
  }
  pool.resize(size_t(k));
  return pool;
}

std::string few_shot_prefix(const Task& task, const std::vector<size_t>& shots) {
  std::string out;
  for (size_t s : shots) {
    const TaskItem& item = task.items[s];
    out += task.type == TaskType::kChoice ? item.context + item.choices[size_t(item.gold)] : item.prompt + item.target;
    out += task.separator;
  }
  return out;
}

std::vector<ContinuationScore> score_continuations(Transformer& model, const std::vector<Continuation>& requests,
                                                   int64_t batch_tokens, const std::function<void(size_t)>& on_scored) {
  const int64_t T = model.config().seq_len, V = model.config().vocab_size;
  if (batch_tokens <= 0) batch_tokens = default_batch_tokens(T, V);
  std::vector<ContinuationScore> out(requests.size());
  // What each request runs: the context's last `keep` ids, then the continuation; the model reads
  // all but the last id and predicts from position keep − 1 on.
  std::vector<int64_t> keep(requests.size()), length(requests.size());
  for (size_t q = 0; q < requests.size(); ++q) {
    const auto& r = requests[q];
    const int64_t n_ctx = int64_t(r.context.size()), n_cont = int64_t(r.continuation.size());
    if (n_ctx < 1 || n_cont < 1) fail("score_continuations: request ", q, " has an empty context or continuation");
    if (n_cont > T)
      fail("score_continuations: request ", q, "'s continuation of ", n_cont, " tokens exceeds model.seq_len ", T);
    for (const auto* ids : {&r.context, &r.continuation})
      for (int id : *ids)
        if (id < 0 || id >= V) fail("score_continuations: token id ", id, " is outside the vocabulary of ", V);
    keep[q] = std::min(n_ctx, T + 1 - n_cont);
    out[q].truncated = keep[q] < n_ctx;
    out[q].tokens = n_cont;
    length[q] = keep[q] + n_cont - 1;
  }
  // Longest first, so that a batch's rows are about as long as its first (little padding).
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return length[a] > length[b]; });

  at::NoGradGuard no_grad;
  const at::Device device = model.parameters().device();
  for (size_t start = 0; start < order.size();) {
    const int64_t L = length[order[start]];
    const size_t rows = std::min(order.size() - start, size_t(std::max<int64_t>(1, batch_tokens / L)));
    // Right-padded with id 0: a padded position is after every real one of its row, and the
    // causal model lets no position see later ones, so padding changes no scored logit.
    at::Tensor input = at::empty({int64_t(rows), L}, at::kLong), target = at::empty({int64_t(rows), L}, at::kLong);
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* tg = target.data_ptr<int64_t>();
    std::fill(in, in + rows * size_t(L), 0);
    std::fill(tg, tg + rows * size_t(L), 0);
    for (size_t k = 0; k < rows; ++k) {
      const auto& r = requests[order[start + k]];
      std::vector<int64_t> ids(r.context.end() - keep[order[start + k]], r.context.end());
      ids.insert(ids.end(), r.continuation.begin(), r.continuation.end());
      for (int64_t t = 0; t + 1 < int64_t(ids.size()); ++t) {
        in[int64_t(k) * L + t] = ids[size_t(t)];
        tg[int64_t(k) * L + t] = ids[size_t(t) + 1];
      }
    }
    Building building(cat("the logits of ", rows, " sequences of ", L, " tokens"));
    const at::Tensor logits = model.logits(input.to(device));  // [rows, L, V]
    const at::Tensor picked = logits.gather(-1, target.to(device).unsqueeze(-1)).squeeze(-1);
    const at::Tensor logprob = (picked - at::logsumexp(logits, {-1})).to(at::kDouble).cpu().contiguous();
    const double* lp = logprob.data_ptr<double>();
    for (size_t k = 0; k < rows; ++k) {
      const size_t q = order[start + k];
      double sum = 0;
      for (int64_t t = keep[q] - 1; t < length[q]; ++t) sum += lp[int64_t(k) * L + t];
      out[q].logprob = sum;
      if (on_scored) on_scored(q);
    }
    start += rows;
  }
  return out;
}

std::string cut_at_stop(const std::string& text, const std::vector<std::string>& stop) {
  return text.substr(0, find_stop(text, stop));
}

std::string extract_answer(const std::string& text, const std::string& regex) {
  if (regex.empty()) return strip(text);
  const std::regex re(regex);  // checked when the task was read
  std::smatch m;
  if (!std::regex_search(text, m, re)) return "";
  return strip(m.size() > 1 && m[1].matched ? m[1].str() : m[0].str());
}

Accuracy mean_with_stderr(const std::vector<double>& scores) {
  Accuracy a;
  const double n = double(scores.size());
  if (scores.empty()) return a;
  for (double s : scores) a.value += s;
  a.value /= n;
  if (scores.size() < 2) return a;
  double ss = 0;
  for (double s : scores) ss += (s - a.value) * (s - a.value);
  a.standard_error = std::sqrt(ss / (n - 1) / n);
  return a;
}

TaskResult evaluate_task(Transformer& model, const Tokenizer& tokenizer, const Task& task, const TaskOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  TaskResult r;
  r.name = task.name;
  r.file = task.file;
  r.type = task.type;
  r.shots = opt.shots >= 0 ? opt.shots : task.shots;
  r.seed = opt.seed.value_or(task.seed);
  if (tokenizer.vocab_size() > model.config().vocab_size)
    fail(tokenizer.path(), ": tokenizer has ", tokenizer.vocab_size(), " ids, more than the model's model.vocab_size ",
         model.config().vocab_size);
  auto scored = task.scored();
  if (opt.limit > 0 && int64_t(scored.size()) > opt.limit) scored.resize(size_t(opt.limit));
  r.items = int64_t(scored.size());
  r = task.type == TaskType::kChoice ? evaluate_choice(model, tokenizer, task, scored, r.shots, r.seed, opt, r)
                                     : evaluate_generation(model, tokenizer, task, scored, r.shots, r.seed, opt, r);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

json TaskResult::to_json() const {
  json j = {{"task", name},   {"file", file},         {"items", items},     {"shots", shots},
            {"seed", seed},   {"sequences", sequences}, {"truncated", truncated}, {"tokens", tokens},
            {"seconds", seconds}, {"metric", primary_metric()}};
  if (type == TaskType::kChoice) {
    j["type"] = "multiple_choice";
    j["accuracy"] = {{"per_token", accuracy_json(per_token)}, {"total", accuracy_json(total)},
                     {"per_byte", accuracy_json(per_byte)}};
    j["chance"] = chance;
  } else {
    j["type"] = "generation";
    j["accuracy"] = {{"exact_match", accuracy_json(exact_match)}};
    j["chance"] = nullptr;
  }
  return j;
}

std::string TaskResult::to_text() const {
  char buf[160];
  auto pct = [&](const char* what, const Accuracy& a, const std::string& tail = "") {
    std::snprintf(buf, sizeof buf, "  %-46s %5.1f %% ± %.1f%s\n", what, 100 * a.value, 100 * a.standard_error,
                  tail.c_str());
    return std::string(buf);
  };
  std::string t = cat(name, " (", file, "): ", items, " items, ", shots, "-shot, ");
  if (type == TaskType::kChoice) {
    std::snprintf(buf, sizeof buf, "   (chance %.1f %%)", 100 * chance);
    t += cat(sequences, " candidates\n");
    t += pct("accuracy by per-token mean log-likelihood:", per_token, buf);
    t += pct("accuracy by total log-likelihood:", total);
    t += pct("accuracy by per-byte mean log-likelihood:", per_byte);
    t += cat("  contexts cut from the left to fit: ", truncated, " of ", sequences, " candidates\n");
  } else {
    t += "greedy decoding\n";
    t += pct("exact match:", exact_match);
    t += cat("  prompts cut from the left to fit: ", truncated, " of ", sequences, "\n");
  }
  std::snprintf(buf, sizeof buf, "  %s tokens in %.1f s\n", format_count(double(tokens)).c_str(), seconds);
  return t + buf;
}

}  // namespace depthkit
