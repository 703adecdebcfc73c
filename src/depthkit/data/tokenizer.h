// The tokenizer of a prepared corpus, one of two kinds, told apart by the file's content:
//  - SentencePiece BPE with byte fallback (`tokenizer.model`), trained by `depthkit data prepare`.
//    Text is normalised by identity (no NFKC, whitespace kept) and encoded line by line with the
//    newline as its byte piece, so decode(encode(text)) == text for any UTF-8 text.
//  - A Hugging Face byte-level BPE (`tokenizer.json`: GPT-2, Llama-3 and their kind), run in C++
//    by HfBpeTokenizer, equal token for token to the `tokenizers` package.
// encode treats every string as text: a special token's string in a document is text, never a
// control id (llm.c's encode_ordinary); documents are separated by eos_id() where data prepare
// writes them. encode and decode are const and may run on several threads at once.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace depthkit {

class HfBpeTokenizer;

class Tokenizer {
 public:
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  // recognise_special (tokenizer.json only): added special tokens written in the text are split out
  // as their ids, as `tokenizers` does by default (HfBpeTokenizer::encode).
  std::vector<int> encode(std::string_view text, bool recognise_special = false) const;
  // UTF-8 text; bytes that do not form characters (a sequence cut inside one) read as U+FFFD.
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int eos_id() const;  // the end-of-document token appended after each document
  const std::string& path() const { return path_; }
  // meta.json's "tokenizer_type" and the name data prepare stores the tokenizer under.
  const char* type() const;
  const char* file_name() const;

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::unique_ptr<HfBpeTokenizer> hf_;
  int newline_id_ = -1;
  // SentencePiece: whether no piece holds a space after a non-space, so that merges never cross
  // such a space and a line's ids are its words' ids concatenated (cached per thread).
  bool words_independent_ = false;
  uint64_t instance_ = 0;  // tells the per-thread word caches of two tokenizers apart
  void encode_line(std::string_view line, std::vector<int>& out) const;
};

// The tokenizer file of a prepared data directory: the one meta.json names, else tokenizer.json or
// tokenizer.model, whichever is there (llm.c's shards come with no meta.json: put the tokenizer.json
// they were made with beside them). Fails naming the directory when there is none, or both.
std::string data_tokenizer_path(const std::string& data_dir);

// Trains a SentencePiece BPE model with byte fallback on `texts` (each split into lines) and writes
// it to `model_path`. Deterministic for the same texts, vocabulary size and seed.
void train_tokenizer(const std::vector<std::string>& texts, int vocab_size, uint64_t seed,
                     const std::string& model_path);

}  // namespace depthkit
