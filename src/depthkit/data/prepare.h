// `depthkit data prepare`: documents → tokenizer → train/val token shards + meta.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace depthkit {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files (one document each) or directories (every file below)
  std::string out_dir;
  int vocab_size = 4096;
  double val_fraction = 0.05;
  uint64_t seed = 42;
  std::string tokenizer;  // existing SentencePiece model; empty: train one
  int64_t shard_tokens = 100'000'000;
  bool force = false;
};

struct PrepareResult {
  int64_t train_tokens = 0, val_tokens = 0, train_docs = 0, val_docs = 0;
  int vocab_size = 0;
  double unigram_entropy_nats = 0;  // H of the train split's token frequencies
};

PrepareResult prepare_data(const PrepareOptions& opt);

}  // namespace depthkit
