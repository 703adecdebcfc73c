#include "depthkit/eval/task_file.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <regex>

#include "depthkit/data/loader.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"
#include "depthkit/util/text.h"

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

// One code point of valid UTF-8 at `s[i]` (JSON text is valid UTF-8): its value, and i moves past it.
char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const int extra = b < 0x80 ? 0 : b < 0xE0 ? 1 : b < 0xF0 ? 2 : 3;
  char32_t c = extra == 0 ? b : extra == 1 ? (b & 0x1F) : extra == 2 ? (b & 0x0F) : (b & 0x07);
  ++i;
  for (int k = 0; k < extra && i < s.size(); ++k, ++i) c = (c << 6) | (static_cast<unsigned char>(s[i]) & 0x3F);
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

// Python's str.lower() and the title case str.capitalize() gives a first character, for code points
// up to U+017F (checked against CPython 3.11 over that whole range); beyond it, `c` itself.
void append_lower(std::string& out, char32_t c) {
  if ((c >= 0x41 && c <= 0x5A) || (c >= 0xC0 && c <= 0xDE && c != 0xD7)) return append_utf8(out, c + 32);
  if (c == 0x130) {  // İ lowercases to i and a combining dot above
    append_utf8(out, 0x69);
    return append_utf8(out, 0x307);
  }
  if (c == 0x178) return append_utf8(out, 0xFF);
  // Latin Extended-A's pairs: capital then small.
  if ((c >= 0x100 && c <= 0x137 && c % 2 == 0) || (c >= 0x139 && c <= 0x148 && c % 2 == 1) ||
      (c >= 0x14A && c <= 0x177 && c % 2 == 0) || (c >= 0x179 && c <= 0x17E && c % 2 == 1))
    return append_utf8(out, c + 1);
  append_utf8(out, c);
}

void append_title(std::string& out, char32_t c) {
  switch (c) {  // the special casings: ß → Ss, ŉ → ʼN, ſ → S, µ → Μ, ÿ → Ÿ, ı → I
    case 0xDF: out += "Ss"; return;
    case 0x149: append_utf8(out, 0x2BC); out += 'N'; return;
    case 0x17F: out += 'S'; return;
    case 0xB5: return append_utf8(out, 0x39C);
    case 0xFF: return append_utf8(out, 0x178);
    case 0x131: out += 'I'; return;
    default: break;
  }
  if ((c >= 0x61 && c <= 0x7A) || (c >= 0xE0 && c <= 0xFE && c != 0xF7)) return append_utf8(out, c - 32);
  if ((c >= 0x101 && c <= 0x137 && c % 2 == 1) || (c >= 0x13A && c <= 0x148 && c % 2 == 0) ||
      (c >= 0x14B && c <= 0x177 && c % 2 == 1) || (c >= 0x17A && c <= 0x17E && c % 2 == 0))
    return append_utf8(out, c - 1);
  append_utf8(out, c);
}

// Python's str.replace(from, to): every non-overlapping occurrence, left to right.
std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  for (size_t at; (at = s.find(from, pos)) != std::string_view::npos; pos = at + from.size()) {
    out.append(s.substr(pos, at - pos));
    out.append(to);
  }
  out.append(s.substr(pos));
  return out;
}

// HellaSwag-style. A line of the data set's own export (activity_label, ctx_a, ctx_b, endings,
// label) is read as lm-evaluation-harness's hellaswag task reads it, so that the two score the same
// text: context = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), each choice
// preprocess(ending). Other lines, {"ctx": ..., "endings": [...], "label": i} (or ctx_a/ctx_b
// without an activity_label), keep their text: context = ctx (or ctx_a + " " + ctx_b). Either way
// the endings continue the context after a space (the harness's target_delimiter).
TaskItem hellaswag_item(const json& j, const Where& at) {
  TaskItem item;
  const auto endings = string_array(j["endings"], "endings", at);
  const bool harness = j.contains("activity_label") && j.contains("ctx_a") && j.contains("ctx_b");
  if (harness) {
    item.context = hellaswag_preprocess(required_string(j, "activity_label", at) + ": " + required_string(j, "ctx_a", at) +
                                        " " + python_capitalize(required_string(j, "ctx_b", at)));
  } else if (j.contains("ctx")) {
    item.context = required_string(j, "ctx", at);
  } else {
    item.context = required_string(j, "ctx_a", at);
    const std::string b = j.contains("ctx_b") ? required_string(j, "ctx_b", at) : "";
    if (!b.empty()) item.context += " " + b;
  }
  for (const auto& e : endings) {
    const std::string ending = harness ? hellaswag_preprocess(e) : e;
    item.choices.push_back(" " + ending);
    item.choice_chars.push_back(utf8_length(ending));
  }
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
  for (const auto& t : text) {
    item.choices.push_back(" " + t);
    item.choice_chars.push_back(utf8_length(t));
  }
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
  for (const auto& c : item.choices) item.choice_chars.push_back(utf8_length(c));
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
    if (strip(answer).empty()) fail(at, ": key 'answers' holds a blank answer");
  item.target = j.contains("target") ? required_string(j, "target", at) : item.answers[0];
  return item;
}

// A line's item and its type: the first type in the table whose schemas the line's keys match.
std::pair<TaskItem, TaskType> parse_item(const json& j, const Where& at) {
  for (const TaskTypeInfo& type : task_types()) {
    std::optional<TaskItem> item = type.read_item(j, at.file, at.line);
    if (!item) continue;
    if (j.contains("split")) {
      if (!j["split"].is_string()) fail(at, ": key 'split' must be a string, got ", json_excerpt(j["split"]));
      const std::string split = j["split"].get<std::string>();
      item->dev = split == "dev" || split == "train";
    }
    item->line = at.line;
    return {std::move(*item), type.type};
  }
  // Every schema the readers (below) recognise, by its keys.
  fail(at, ": not a task item: expected the keys context/choices/gold (multiple choice), prompt/answers "
       "(generation), ctx/endings/label (HellaSwag) or question/choices/answerKey (ARC)");
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
    if (strip(line, " \t").empty()) continue;
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
      fail(at, ": a ", task_type_info(type).name, " item in a ", task_type_info(task.type).name,
           " task (one type per file; line ",
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

}  // namespace

int64_t utf8_length(std::string_view s) {
  // Every code point has exactly one byte that is not a continuation byte (10xxxxxx).
  return std::count_if(s.begin(), s.end(), [](char b) { return (static_cast<unsigned char>(b) & 0xC0) != 0x80; });
}

bool python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

size_t trailing_python_space(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;  // the last code point's first byte
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t i = start;
    if (!python_space(next_code_point(s, i))) break;
    end = start;
  }
  return s.size() - end;
}

std::string python_capitalize(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const bool first = i == 0;
    const char32_t c = next_code_point(text, i);
    first ? append_title(out, c) : append_lower(out, c);
  }
  return out;
}

std::string hellaswag_preprocess(std::string_view text) {
  // text.strip()
  size_t begin = 0;
  for (size_t i = 0; i < text.size() && python_space(next_code_point(text, i));) begin = i;
  const std::string_view stripped = text.substr(begin, text.size() - begin - trailing_python_space(text.substr(begin)));
  // text.replace(" [title]", ". ")
  const std::string titled = replace_all(stripped, " [title]", ". ");
  // re.sub("\\[.*?\\]", "", text): from a '[', the shortest run to the next ']', which '.' keeps
  // on one line ('\n' ends the attempt, and the '[' stays).
  std::string unbracketed;
  for (size_t i = 0; i < titled.size(); ++i) {
    if (titled[i] == '[') {
      const size_t close = titled.find_first_of("]\n", i + 1);
      if (close != std::string::npos && titled[close] == ']') {
        i = close;
        continue;
      }
    }
    unbracketed += titled[i];
  }
  // text.replace("  ", " ")
  return replace_all(unbracketed, "  ", " ");
}

int64_t TaskItem::characters(size_t choice) const {
  return choice < choice_chars.size() ? choice_chars[choice] : utf8_length(choices.at(choice));
}

std::optional<TaskItem> read_choice_item(const json& line, const std::string& file, int64_t line_no) {
  const Where at{file, line_no};
  TaskItem item;
  if (line.contains("endings")) {
    item = hellaswag_item(line, at);
  } else if (line.contains("question") && line.contains("answerKey")) {
    item = arc_item(line, at);
  } else if (line.contains("context") || line.contains("gold")) {
    item = native_choice_item(line, at);
  } else {
    return std::nullopt;
  }
  check_choices(item, at);
  return item;
}

std::optional<TaskItem> read_generation_item(const json& line, const std::string& file, int64_t line_no) {
  if (!line.contains("prompt") && !line.contains("answers")) return std::nullopt;
  return native_generation_item(line, Where{file, line_no});
}

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
    fail(dev_file.string(), ": holds ", task_type_info(dev.type).name, " items but ", task.file, " is a ",
         task_type_info(task.type).name, " task");
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
  const auto shot = task_type_info(task.type).shot;
  std::string out;
  for (size_t s : shots) {
    out += shot(task.items[s]);
    out += task.separator;
  }
  return out;
}

}  // namespace depthkit
