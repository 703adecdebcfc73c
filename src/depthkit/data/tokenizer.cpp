#include "depthkit/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <atomic>
#include <cctype>
#include <fstream>
#include <thread>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include "depthkit/data/hf_tokenizer.h"
#include "depthkit/data/utf8.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

namespace {

// A tokenizer.json is a JSON object; a SentencePiece model is a binary protocol buffer.
bool looks_like_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char c = 0;
  while (in.get(c))
    if (!std::isspace(static_cast<unsigned char>(c))) return c == '{';
  return false;
}

}  // namespace

Tokenizer::Tokenizer(const std::string& path) : path_(path) {
  regular_file_size(path, uintmax_t(1) << 30);  // a FIFO would block the load, a directory fail obscurely
  if (looks_like_json(path)) {
    hf_ = std::make_unique<HfBpeTokenizer>(path);
    return;
  }
  sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
  auto status = sp_->Load(path);
  if (!status.ok()) fail(path, ": cannot load SentencePiece model: ", status.ToString());
  newline_id_ = sp_->PieceToId("<0x0A>");
  if (newline_id_ == sp_->unk_id())
    fail(path, ": tokenizer has no byte-fallback piece for '\\n' (train with byte_fallback)");
  if (sp_->eos_id() < 0) fail(path, ": tokenizer has no end-of-document (eos) piece");
  // SentencePiece writes a space as "▁" (identity normalisation, no dummy prefix). A merge could
  // join the two sides of a space that follows a non-space only into a piece holding "x▁": if no
  // piece does (split_by_whitespace, as data prepare trains), every such space is a boundary no
  // merge crosses, and a line's BPE is its words' BPE side by side.
  static std::atomic<uint64_t> instances{0};
  instance_ = ++instances;
  words_independent_ = true;
  const std::string space = "\xE2\x96\x81";
  for (int id = 0; id < sp_->GetPieceSize() && words_independent_; ++id) {
    if (sp_->IsByte(id) || sp_->IsControl(id) || sp_->IsUnknown(id)) continue;
    const std::string& piece = sp_->IdToPiece(id);
    for (size_t at = piece.find(space, 1); at != std::string::npos; at = piece.find(space, at + 1))
      if (piece.compare(at - 3, 3, space) != 0) words_independent_ = false;
  }
}

Tokenizer::~Tokenizer() = default;

namespace {

void sp_encode(const sentencepiece::SentencePieceProcessor& sp, std::string_view text, std::vector<int>& out) {
  thread_local std::vector<int> ids;
  ids.clear();
  auto status = sp.Encode(text, &ids);
  if (!status.ok()) fail("tokenizer encode failed: ", status.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

// A thread's ids of the first kMaxWords words it has encoded, for one tokenizer at a time; full, it
// keeps them (the words a corpus shows first are its most frequent; emptying it would cost a warm-up
// each time it fills), as `tokenizers`' cache does. The output never depends on it.
struct WordCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int>> ids;
  static constexpr size_t kMaxWords = size_t(1) << 18, kMaxWordBytes = 64;
};

}  // namespace

void Tokenizer::encode_line(std::string_view line, std::vector<int>& out) const {
  if (!words_independent_) return sp_encode(*sp_, line, out);
  thread_local WordCache cache;
  if (cache.owner != instance_) {
    cache.ids.clear();
    cache.owner = instance_;
  }
  thread_local std::string key;
  // Words: cut before each space that follows a non-space ("  foo bar" → "  foo", " bar").
  for (size_t start = 0; start < line.size();) {
    size_t end = start;
    while (end < line.size() && line[end] == ' ') ++end;
    while (end < line.size() && line[end] != ' ') ++end;
    const std::string_view word = line.substr(start, end - start);
    start = end;
    if (word.size() > WordCache::kMaxWordBytes) {
      sp_encode(*sp_, word, out);
      continue;
    }
    key.assign(word);
    if (auto it = cache.ids.find(key); it != cache.ids.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      continue;
    }
    const size_t from = out.size();
    sp_encode(*sp_, word, out);
    if (cache.ids.size() < WordCache::kMaxWords) cache.ids.emplace(key, std::vector<int>(out.begin() + from, out.end()));
  }
}

std::vector<int> Tokenizer::encode(std::string_view text, bool recognise_special) const {
  if (hf_) return hf_->encode(text, recognise_special);
  std::vector<int> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t nl = text.find('\n', start);
    size_t end = nl == std::string::npos ? text.size() : nl;
    if (end > start) encode_line(text.substr(start, end - start), out);
    if (nl == std::string::npos) break;
    out.push_back(newline_id_);
    start = nl + 1;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  // Valid UTF-8, as SentencePiece's decode and `tokenizers`' give it: a byte-level token sequence
  // may stop inside a character (U+FFFD, which generate's stream holds back until it completes).
  if (hf_) return utf8_lossy(hf_->decode(ids));
  std::string text;
  auto status = sp_->Decode(ids, &text);
  if (!status.ok()) fail("tokenizer decode failed: ", status.ToString());
  return text;
}

int Tokenizer::vocab_size() const { return hf_ ? hf_->vocab_size() : sp_->GetPieceSize(); }
int Tokenizer::eos_id() const { return hf_ ? hf_->eos_id() : sp_->eos_id(); }
const char* Tokenizer::type() const { return hf_ ? "hf-byte-level-bpe" : "sentencepiece-bpe-byte-fallback"; }
const char* Tokenizer::file_name() const { return hf_ ? "tokenizer.json" : "tokenizer.model"; }

std::string data_tokenizer_path(const std::string& data_dir) {
  const fs::path dir(data_dir);
  const fs::path meta = dir / "meta.json";
  if (fs::is_regular_file(meta)) {
    const auto j = nlohmann::json::parse(read_file(meta, 64u << 20), nullptr, false);
    if (j.is_object() && j.contains("tokenizer") && j["tokenizer"].is_string()) {
      const std::string name = j["tokenizer"].get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
        fail(meta.string(), ": \"tokenizer\" must name a file beside it, got \"", printable(name), "\"");
      const fs::path path = dir / name;
      if (!fs::exists(path)) fail(path.string(), ": not found (", meta.string(), " names it as the tokenizer)");
      return path.string();
    }
  }
  const fs::path json = dir / "tokenizer.json", model = dir / "tokenizer.model";
  const bool has_json = fs::exists(json), has_model = fs::exists(model);
  if (has_json && has_model)
    fail(data_dir, ": holds both tokenizer.json and tokenizer.model, and no meta.json says which the shards were made "
         "with (remove one)");
  if (has_json) return json.string();
  if (has_model) return model.string();
  fail(model.string(), ": not found, nor tokenizer.json (text is tokenized with the tokenizer of the data the model "
       "was trained on: a `depthkit data prepare` output, or shards with the tokenizer.json they were made with; pass --data DIR)");
}

namespace {

// Feeds the lines of every text to the trainer without writing a temporary corpus.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& texts) : texts_(texts) { advance(); }
  bool done() const override { return doc_ >= texts_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (doc_ < texts_.size()) {
      const std::string& t = texts_[doc_];
      if (pos_ > t.size()) {
        ++doc_;
        pos_ = 0;
        continue;
      }
      size_t nl = t.find('\n', pos_);
      size_t end = nl == std::string::npos ? t.size() : nl;
      line_.assign(t, pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<std::string>& texts_;
  size_t doc_ = 0, pos_ = 0;
  std::string line_;
};

}  // namespace

void train_tokenizer(const std::vector<std::string>& texts, int vocab_size, uint64_t seed,
                     const std::string& model_path) {
  if (vocab_size < 300) fail("--vocab-size ", vocab_size, " is too small: byte fallback needs 256 ids plus merges (use >= 300)");
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(seed));
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"max_sentence_length", "16384"},
      {"unk_id", "0"},
      {"eos_id", "1"},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"eos_piece", "<|endoftext|>"},
      {"hard_vocab_limit", "false"},
      {"num_threads", std::to_string(threads)},
      // Errors come back in the status; a vocabulary the corpus cannot fill is reported by data
      // prepare in its own line (meta.json's vocab_size_requested).
      {"minloglevel", "2"},
  };
  LineIterator lines(texts);
  std::string proto;
  auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &proto);
  if (!status.ok()) {
    // "Vocabulary size is smaller than required_chars. 300 vs 388.": the pieces the corpus needs
    // before any merge (its characters, the 256 byte-fallback pieces, the special ids).
    const std::string why = status.ToString();
    long long asked = 0, needed = 0;
    if (const size_t at = why.find("smaller than required_chars. ");
        at != std::string::npos && std::sscanf(why.c_str() + at + 29, "%lld vs %lld", &asked, &needed) == 2)
      fail("--vocab-size ", vocab_size, " is too small for these documents: their characters, the 256 byte-fallback "
           "pieces and the special ids need at least ", needed, " (use --vocab-size ", needed, " or more)");
    fail("tokenizer training failed: ", printable(why));
  }
  write_file_atomic(model_path, proto);
}

}  // namespace depthkit
