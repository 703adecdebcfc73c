#include "depthkit/eval/cloze.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "depthkit/data/loader.h"
#include "depthkit/data/shards.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/text.h"
#include "depthkit/util/fs.h"

namespace depthkit {

namespace {

namespace fs = std::filesystem;

// What a line must be to be a continuation (the answer or a distractor): prose rather than markup,
// a code fence or a heading underline. Stripped of surrounding blanks: 20 to 200 bytes, at least
// four words, at least half of its bytes letters (bytes ≥ 0x80, UTF-8, count as letters).
constexpr size_t kMinLineBytes = 20, kMaxLineBytes = 200, kMinWords = 4;
// A passage must hold at least this much text, so that there is something to read.
constexpr size_t kMinContextBytes = 100;
// Distractor draws per item: the first half ask for a length within a factor of 1.5 of the answer's
// (so that length alone does not give it away), the rest take any length.
constexpr int kDraws = 200;
static_assert(kClozeMinContextOption == int64_t(kMinContextBytes + kMaxLineBytes));

// A line's text without the blanks around it. A context's stretch may hold newlines, which count
// as text here: the cloze's choice of contexts depends on it, so it stays as it was built.
std::string_view strip_line(std::string_view s) { return strip(s, " \t\r"); }

bool qualifies(std::string_view line) {
  const std::string_view s = strip_line(line);
  if (s.size() < kMinLineBytes || s.size() > kMaxLineBytes) return false;
  size_t words = 0, letters = 0;
  bool in_word = false;
  for (unsigned char c : s) {
    const bool space = c == ' ' || c == '\t';
    words += !space && !in_word;
    in_word = !space;
    letters += std::isalpha(c) || c >= 0x80;
  }
  return words >= kMinWords && 2 * letters >= s.size();
}

struct Line {
  int64_t doc = 0, number = 0;  // number: 1-based within the document
  size_t begin = 0, end = 0;    // [begin, end) in the document's text, without the newline
};

uint64_t draw(uint64_t& state, size_t n) { return splitmix64(state) % uint64_t(n); }

template <class T>
void shuffle(std::vector<T>& v, uint64_t& state) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[draw(state, i)]);
}

// Whether `path` starts with the header make_cloze_task writes: what its --force may replace.
bool is_cloze_task_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string first(64 * 1024, '\0');
  in.read(first.data(), std::streamsize(first.size()));
  first.resize(size_t(in.gcount()));
  first = first.substr(0, first.find('\n'));
  const nlohmann::json j = nlohmann::json::parse(first, nullptr, false);
  if (!j.is_object() || !j.contains("task") || !j["task"].is_object()) return false;
  const nlohmann::json& d = j["task"].value("description", nlohmann::json());
  return d.is_string() && d.get<std::string>().starts_with("next-line cloze");
}

}  // namespace

std::vector<std::string> held_out_documents(const std::string& data_dir) {
  Tokenizer tok(data_tokenizer_path(data_dir));
  TokenDataset val(data_dir, "val", tok.vocab_size());
  std::vector<std::string> docs;
  std::vector<int> doc;
  for (const Shard& shard : val.shards()) {
    std::vector<uint32_t> ids(size_t(shard.size()));
    shard.read(0, shard.size(), ids.data());
    for (uint32_t id : ids) {
      if (id >= uint32_t(tok.vocab_size()))
        fail(shard.path(), ": token id ", id, " is outside the tokenizer's ", tok.vocab_size(), " ids");
      if (int(id) == tok.eos_id()) {
        docs.push_back(tok.decode(doc));
        doc.clear();
      } else {
        doc.push_back(int(id));
      }
    }
  }
  if (!doc.empty()) docs.push_back(tok.decode(doc));  // a last document without its end id
  return docs;
}

ClozeResult make_cloze_task(const ClozeOptions& opt) {
  if (opt.out.empty()) fail("data make-task: --out is required");
  if (opt.items < 1) fail("data make-task: --items must be at least 1, got ", opt.items);
  if (opt.dev_items < 0) fail("data make-task: --dev-items must be at least 0, got ", opt.dev_items);
  if (opt.choices < 2 || opt.choices > 26) fail("data make-task: --choices must be in [2, 26], got ", opt.choices);
  if (opt.context_bytes < kClozeMinContextOption)
    fail("data make-task: --context-bytes must be at least ", kClozeMinContextOption, ", got ", opt.context_bytes);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(opt.out, ec))) {
    if (!fs::is_regular_file(opt.out)) fail(opt.out, ": is ", path_kind(opt.out), ", not a task file");
    if (!opt.force) fail(opt.out, ": already exists (pass --force to replace it)");
    if (!is_cloze_task_file(opt.out))
      fail(opt.out, ": --force replaces only a task file data make-task wrote (its first line is the {\"task\": "
           "{\"description\": \"next-line cloze ...\"}} header), and this is not one (choose another --out)");
  }
  const std::vector<std::string> docs = held_out_documents(opt.data_dir);
  const int64_t n_docs = int64_t(docs.size());
  if (n_docs < 2)
    fail(opt.data_dir, ": the held-out split holds ", n_docs, " document", n_docs == 1 ? "" : "s",
         "; the cloze task needs at least 2 (distractors come from other documents)");
  uint64_t state = opt.seed ^ 0x6a09e667f3bcc909ull;

  // A fifth of the documents (at least one, never all) serve the dev items, so that no few-shot
  // example shows a passage of a document a scored item comes from.
  std::vector<int64_t> order(static_cast<size_t>(n_docs));
  for (int64_t d = 0; d < n_docs; ++d) order[size_t(d)] = d;
  shuffle(order, state);
  const int64_t n_dev_docs = opt.dev_items > 0 ? std::clamp<int64_t>(n_docs / 5, 1, n_docs - 1) : 0;
  std::vector<bool> dev_doc(static_cast<size_t>(n_docs), false);
  for (int64_t i = 0; i < n_dev_docs; ++i) dev_doc[size_t(order[size_t(i)])] = true;

  // Every qualifying line is a possible distractor; those with a passage before them in their
  // document are possible answers.
  std::vector<Line> pool, answers[2];  // answers[1]: from dev documents
  std::vector<std::unordered_set<std::string_view>> lines_of(static_cast<size_t>(n_docs));
  for (int64_t d = 0; d < n_docs; ++d) {
    const std::string& text = docs[size_t(d)];
    int64_t number = 0;
    for (size_t begin = 0; begin <= text.size();) {
      size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      const Line line{d, ++number, begin, end};
      const std::string_view s(text.data() + begin, end - begin);
      lines_of[size_t(d)].insert(strip_line(s));
      if (qualifies(s)) {
        pool.push_back(line);
        // The passage: the text before the line, at most context_bytes, from a line start on.
        const size_t from = begin > size_t(opt.context_bytes) ? text.find('\n', begin - size_t(opt.context_bytes)) + 1 : 0;
        if (begin - from >= kMinContextBytes && !strip_line(std::string_view(text).substr(from, begin - from)).empty())
          answers[dev_doc[size_t(d)]].push_back(line);
      }
      begin = end + 1;
    }
  }
  ClozeResult result;
  result.documents = n_docs;
  result.dev_documents = n_dev_docs;
  result.candidate_lines = int64_t(answers[0].size() + answers[1].size());
  auto text_of = [&](const Line& l) { return std::string_view(docs[size_t(l.doc)]).substr(l.begin, l.end - l.begin); };

  // An item from a candidate answer, or nothing when too few distractors qualify.
  using ordered_json = nlohmann::ordered_json;
  auto make_item = [&](const Line& gold, bool dev) -> std::optional<ordered_json> {
    std::vector<const Line*> distractors;
    const std::string_view answer = text_of(gold);
    for (int k = 0; k < kDraws && int64_t(distractors.size()) < opt.choices - 1; ++k) {
      const Line& p = pool[draw(state, pool.size())];
      const std::string_view t = text_of(p);
      if (p.doc == gold.doc || lines_of[size_t(gold.doc)].count(strip_line(t))) continue;  // it could be right
      if (std::any_of(distractors.begin(), distractors.end(), [&](const Line* q) { return strip_line(text_of(*q)) == strip_line(t); }))
        continue;
      if (k < kDraws / 2 && (3 * t.size() < 2 * answer.size() || 2 * t.size() > 3 * answer.size())) continue;
      distractors.push_back(&p);
    }
    if (int64_t(distractors.size()) < opt.choices - 1) return std::nullopt;
    const int64_t gold_index = int64_t(draw(state, size_t(opt.choices)));  // uniform over the positions
    std::vector<std::string> choices;
    for (const Line* p : distractors) choices.emplace_back(text_of(*p));
    choices.insert(choices.begin() + gold_index, std::string(answer));
    const std::string& text = docs[size_t(gold.doc)];
    const size_t from = gold.begin > size_t(opt.context_bytes) ? text.find('\n', gold.begin - size_t(opt.context_bytes)) + 1 : 0;
    ordered_json item;
    item["context"] = text.substr(from, gold.begin - from);
    item["choices"] = choices;
    item["gold"] = gold_index;
    item["split"] = dev ? "dev" : "test";
    item["source"] = {{"document", gold.doc}, {"line", gold.number}};
    return item;
  };
  // Each split's candidates in a seeded order, taken until the split is full: --limit on the
  // file's first items then scores a uniform sample.
  std::string body;
  for (int dev = 1; dev >= 0; --dev) {
    std::vector<Line>& candidates = answers[dev];
    shuffle(candidates, state);
    int64_t& made = dev ? result.dev_items : result.items;
    const int64_t want = dev ? opt.dev_items : opt.items;
    for (size_t i = 0; i < candidates.size() && made < want; ++i)
      if (auto item = make_item(candidates[i], dev)) {
        body += item->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
        ++made;
      }
  }
  if (result.items == 0)
    fail(opt.data_dir, ": no held-out line qualifies as a cloze answer (prose lines of ", kMinLineBytes, " to ",
         kMaxLineBytes, " bytes after a passage of ", kMinContextBytes, " bytes, with distractors from other documents)");
  // No name in the header: the task is named after its file (so the bytes do not depend on it).
  ordered_json header;
  header["task"]["description"] =
      cat("next-line cloze from the held-out documents of ", opt.data_dir, ": choose the line that follows the passage "
          "among ", opt.choices, " (depthkit data make-task --seed ", opt.seed, ")");
  header["task"]["seed"] = opt.seed;
  header["task"]["shots"] = 0;
  header["task"]["separator"] = "\n\n";
  const fs::path out(opt.out);
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  write_file_atomic(out, header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n" + body);
  return result;
}

}  // namespace depthkit
