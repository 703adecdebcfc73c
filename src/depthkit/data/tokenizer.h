// The tokenizer: SentencePiece BPE with byte fallback, trained by `depthkit data prepare`.
// Text is normalised by identity (no NFKC, whitespace kept), and encoded line by line with
// the newline as its byte piece, so decode(encode(text)) == text for any UTF-8 text.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace depthkit {

class Tokenizer {
 public:
  explicit Tokenizer(const std::string& model_path);
  ~Tokenizer();
  std::vector<int> encode(const std::string& text) const;
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int eos_id() const;  // the end-of-document token appended after each document
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  int newline_id_;
};

// Trains a BPE model with byte fallback on `texts` (each split into lines) and writes it to
// `model_path`. Deterministic for the same texts, vocabulary size and seed.
void train_tokenizer(const std::vector<std::string>& texts, int vocab_size, uint64_t seed,
                     const std::string& model_path);

}  // namespace depthkit
