#include "depthkit/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <thread>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

Tokenizer::Tokenizer(const std::string& model_path)
    : path_(model_path), sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  regular_file_size(model_path, uintmax_t(1) << 30);  // a FIFO would block the load, a directory fail obscurely
  auto status = sp_->Load(model_path);
  if (!status.ok()) fail(model_path, ": cannot load SentencePiece model: ", status.ToString());
  newline_id_ = sp_->PieceToId("<0x0A>");
  if (newline_id_ == sp_->unk_id())
    fail(model_path, ": tokenizer has no byte-fallback piece for '\\n' (train with byte_fallback)");
  if (sp_->eos_id() < 0) fail(model_path, ": tokenizer has no end-of-document (eos) piece");
}

Tokenizer::~Tokenizer() = default;

std::vector<int> Tokenizer::encode(const std::string& text) const {
  std::vector<int> out, line_ids;
  size_t start = 0;
  while (start <= text.size()) {
    size_t nl = text.find('\n', start);
    size_t end = nl == std::string::npos ? text.size() : nl;
    if (end > start) {
      line_ids.clear();
      auto status = sp_->Encode(std::string_view(text).substr(start, end - start), &line_ids);
      if (!status.ok()) fail("tokenizer encode failed: ", status.ToString());
      out.insert(out.end(), line_ids.begin(), line_ids.end());
    }
    if (nl == std::string::npos) break;
    out.push_back(newline_id_);
    start = nl + 1;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string text;
  auto status = sp_->Decode(ids, &text);
  if (!status.ok()) fail("tokenizer decode failed: ", status.ToString());
  return text;
}

int Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int Tokenizer::eos_id() const { return sp_->eos_id(); }

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
