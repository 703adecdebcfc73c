// `depthkit data prepare`: a corpus (JSONL, parquet, text; data/corpus.h) → tokenizer → train/val
// llm.c token shards + meta.json, as a stream: memory does not grow with the corpus.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace depthkit {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, directories, glob patterns (data/corpus.h)
  std::string out_dir;
  std::string text_key = "text";  // the JSONL field / parquet column holding the document
  int vocab_size = 4096;
  double val_fraction = 0.05;
  uint64_t seed = 42;
  // An existing tokenizer (a SentencePiece tokenizer.model or a Hugging Face tokenizer.json);
  // empty: train a SentencePiece BPE on a sample of the training documents.
  std::string tokenizer;
  int64_t tokenizer_sample_bytes = int64_t(64) << 20;
  int64_t shard_tokens = 100'000'000;
  int threads = 0;  // tokenizing threads; 0: every core. The output is the same for every count.
  bool skip_bad = false;  // count malformed records and go on, instead of failing at the first
  bool force = false;
};

struct PrepareResult {
  int64_t train_tokens = 0, val_tokens = 0, train_docs = 0, val_docs = 0;
  int64_t bad_records = 0;  // malformed records skipped (--skip-bad)
  int64_t bytes = 0;        // of the documents' text
  int vocab_size = 0;
  double unigram_entropy_nats = 0;  // H of the train split's token frequencies
  double seconds = 0;               // tokenizing and writing (the pass over the corpus)
};

PrepareResult prepare_data(const PrepareOptions& opt);

// The split of a document: a seeded hash of its file's key (data/corpus.h) and row, so that adding
// files never moves another document to the other split.
uint64_t document_hash(uint64_t seed, const std::string& key, int64_t row);
bool is_validation_document(uint64_t seed, const std::string& key, int64_t row, double val_fraction);

}  // namespace depthkit
