// Batches of token windows read from token shards (pread, see shards.h).
// A split (train or val) is every `*{split}_*.bin` shard in a directory, in name order. Each
// shard is cut into non-overlapping windows of T+1 tokens (input and shifted target), never
// crossing a shard boundary. Training visits the windows of each epoch in a permutation fixed by
// (seed, epoch); the position (epoch, index) is all a checkpoint needs to resume exactly.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/data/shards.h"

namespace depthkit {

class TokenDataset {
 public:
  // Opens the split's shards; ids are checked against vocab_size as windows are read.
  TokenDataset(const std::string& dir, const std::string& split, int64_t vocab_size);
  int64_t tokens() const;
  int64_t windows(int64_t seq_len) const;
  // Copies window w (of length seq_len + 1) into dst; throws on an id >= vocab_size.
  void read_window(int64_t w, int64_t seq_len, int64_t* dst) const;
  const std::vector<Shard>& shards() const { return shards_; }

 private:
  std::vector<Shard> shards_;
  int64_t vocab_size_;
};

struct LoaderPosition {
  int64_t epoch = 0;
  int64_t index = 0;  // windows consumed in this epoch
};

class BatchLoader {
 public:
  BatchLoader(const TokenDataset& data, int64_t batch, int64_t seq_len, uint64_t seed,
              LoaderPosition start = {});
  // int64 [batch, seq_len + 1]: of the next `ranks` micro-batches in the global order, the
  // `rank`-th (docs/training.md, "Many processes"). Every rank passes over the same windows and
  // reads its own, so N ranks with accumulation A read exactly what one rank with accumulation
  // N·A reads, and the position is the same on every rank (a checkpoint resumes on any number).
  at::Tensor next(int64_t rank = 0, int64_t ranks = 1);
  LoaderPosition position() const { return pos_; }

 private:
  void shuffle_epoch();
  const TokenDataset& data_;
  int64_t batch_, seq_len_;
  uint64_t seed_;
  LoaderPosition pos_;
  std::vector<int64_t> order_;
};

// The first `max_tokens` of a split as consecutive windows, in batches (for evaluation).
std::vector<at::Tensor> eval_batches(const TokenDataset& data, int64_t batch, int64_t seq_len,
                                     int64_t max_tokens);

// A stable 64-bit mix (splitmix64): the project's one source of seeded, portable randomness.
uint64_t splitmix64(uint64_t& state);

}  // namespace depthkit
