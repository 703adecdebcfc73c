#include "depthkit/data/loader.h"

#include <ATen/ops/empty.h>

#include <sys/resource.h>

#include <filesystem>

#include "depthkit/util/error.h"

namespace depthkit {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

TokenDataset::TokenDataset(const std::string& dir, const std::string& split, int64_t vocab_size)
    : vocab_size_(vocab_size) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail(dir, ": data directory not found (run `depthkit data prepare`)");
  std::vector<std::string> paths;
  const std::string tag = split + "_";
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.size() > 4 && name.ends_with(".bin") &&
        name.find(tag) != std::string::npos)
      paths.push_back(e.path().string());
  }
  std::sort(paths.begin(), paths.end());
  if (paths.empty()) fail(dir, ": no ", split, " shards (*", tag, "*.bin)");
  // Every shard stays open for the run (pread): a corpus of a thousand shards needs more
  // descriptors than the usual soft limit of 1024, so take what the hard limit allows.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  for (const auto& p : paths) shards_.emplace_back(p);
}

int64_t TokenDataset::tokens() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s.size();
  return n;
}

int64_t TokenDataset::windows(int64_t seq_len) const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s.size() > seq_len ? (s.size() - 1) / seq_len : 0;
  return n;
}

void TokenDataset::read_window(int64_t w, int64_t seq_len, int64_t* dst) const {
  for (const auto& s : shards_) {
    int64_t n = s.size() > seq_len ? (s.size() - 1) / seq_len : 0;
    if (w >= n) {
      w -= n;
      continue;
    }
    const int64_t start = w * seq_len;
    // Read as uint32 into the int64 buffer's back half, then widen in place from the front.
    uint32_t* ids = reinterpret_cast<uint32_t*>(dst + seq_len + 1) - (seq_len + 1);
    s.read(start, seq_len + 1, ids);
    for (int64_t i = 0; i <= seq_len; ++i) {
      const uint32_t t = ids[i];
      if (t >= uint64_t(vocab_size_))
        fail(s.path(), ": token id ", t, " at position ", start + i, " is >= vocab_size ", vocab_size_);
      dst[i] = t;
    }
    return;
  }
  fail("window ", w, " out of range");
}

BatchLoader::BatchLoader(const TokenDataset& data, int64_t batch, int64_t seq_len, uint64_t seed,
                         LoaderPosition start)
    : data_(data), batch_(batch), seq_len_(seq_len), seed_(seed), pos_(start) {
  const int64_t w = data_.windows(seq_len_);
  if (w < batch_)
    fail(data_.shards().front().path(), ": the split has ", data_.tokens(), " tokens, ", w,
         " windows of ", seq_len_ + 1, " tokens; a batch needs ", batch_);
  if (pos_.index < 0 || pos_.index > w) fail("data position index ", pos_.index, " out of range [0, ", w, "]");
  shuffle_epoch();
}

void BatchLoader::shuffle_epoch() {
  const int64_t w = data_.windows(seq_len_);
  order_.resize(w);
  for (int64_t i = 0; i < w; ++i) order_[i] = i;
  uint64_t state = seed_ * 0x100000001b3ull ^ (uint64_t(pos_.epoch) + 0x51ed27ull);
  for (int64_t i = w - 1; i > 0; --i) {  // Fisher–Yates
    int64_t j = static_cast<int64_t>(splitmix64(state) % uint64_t(i + 1));
    std::swap(order_[i], order_[j]);
  }
}

at::Tensor BatchLoader::next(int64_t rank, int64_t ranks) {
  at::Tensor out = at::empty({batch_, seq_len_ + 1}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t k = 0; k < ranks * batch_; ++k) {
    if (pos_.index == int64_t(order_.size())) {
      ++pos_.epoch;
      pos_.index = 0;
      shuffle_epoch();
    }
    const int64_t window = order_[pos_.index++];
    if (k / batch_ == rank) data_.read_window(window, seq_len_, p + (k % batch_) * (seq_len_ + 1));
  }
  return out;
}

std::vector<at::Tensor> eval_batches(const TokenDataset& data, int64_t batch, int64_t seq_len,
                                     int64_t max_tokens) {
  const int64_t w = std::min(data.windows(seq_len), std::max<int64_t>(1, max_tokens / seq_len));
  if (w == 0)
    fail(data.shards().front().path(), ": validation split has fewer than ", seq_len + 1, " tokens");
  std::vector<at::Tensor> out;
  for (int64_t start = 0; start < w; start += batch) {
    int64_t b = std::min(batch, w - start);
    at::Tensor t = at::empty({b, seq_len + 1}, at::kLong);
    for (int64_t i = 0; i < b; ++i) data.read_window(start + i, seq_len, t.data_ptr<int64_t>() + i * (seq_len + 1));
    out.push_back(t);
  }
  return out;
}

}  // namespace depthkit
