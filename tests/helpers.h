// Shared test helpers: temporary directories, synthetic token shards, small configs.
#pragma once
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/data/shards.h"
#include "depthkit/model/config_check.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/util/error.h"

namespace depthkit::test {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("depthkit-test-" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str(const std::string& name = "") const { return (name.empty() ? path : path / name).string(); }
};

// Tokens with learnable structure (a noisy repeating pattern), so a model can fit them.
inline std::vector<uint32_t> pattern_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = rng() % 5 == 0 ? rng() % vocab : (i * 7 + i / 3) % vocab;
  return t;
}

// Writes train/val shards of pattern tokens to `dir`.
inline void write_pattern_data(const std::string& dir, int64_t vocab, int64_t train_tokens, int64_t val_tokens) {
  fs::create_directories(dir);
  write_shard(dir + "/train_000000.bin", pattern_tokens(train_tokens, vocab, 1), vocab);
  write_shard(dir + "/val_000000.bin", pattern_tokens(val_tokens, vocab, 2), vocab);
}

// A model small enough that a few steps take milliseconds.
inline Config small_config(const std::string& data_dir) {
  return parse_config(
      "[model]\nn_layers = 2\nd_model = 32\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\nvocab_size = 64\n"
      "seq_len = 16\n[data]\ndir = \"" + data_dir + "\"\n"
      "[train]\nmicro_batch = 4\nsteps = 8\neval_every = 4\neval_tokens = 256\ncheckpoint_every = 4\n"
      "log_every = 1\nthreads = 1\n[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\n",
      "small_config");
}

// Asserts that `fn` throws depthkit::Error whose message contains every part.
template <class Fn>
void expect_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected depthkit::Error containing '" << parts.front() << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

inline std::string source_dir() { return DEPTHKIT_SOURCE_DIR; }

// Lists of test variants, each a list of --set overrides, must reach every kind in the pathway
// registry: a kind added to the registry fails the tests whose lists do not name it yet.
inline void expect_every_kind(const std::vector<std::vector<std::string>>& variants, const std::string& list) {
  for (const auto& kind : pathway_kind_names()) {
    const std::string set = "residual.kind=" + kind;
    bool found = false;
    for (const auto& v : variants) found |= std::find(v.begin(), v.end(), set) != v.end();
    EXPECT_TRUE(found) << list << " has no variant of residual.kind " << kind;
  }
}

// A seeded CPU generator, so that every test draws the same numbers on every machine.
inline at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Every parameter of `params` redrawn from N(0, scale²), and the norms' weights from N(1, scale²)
// when `norms_near_one`: zeros and the initialisation's structure hide bugs.
inline void randomize(ParameterStore& params, uint64_t seed, double scale, bool norms_near_one = false) {
  auto g = gen(seed);
  at::NoGradGuard no_grad;
  for (const auto& p : params.all()) {
    auto r = at::randn(p.tensor.sizes(), g, at::kDouble).to(p.tensor.scalar_type()) * scale;
    p.tensor.copy_(norms_near_one && p.component == "norm" ? r + 1.0 : r);
  }
}

}  // namespace depthkit::test
