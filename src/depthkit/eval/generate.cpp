#include "depthkit/eval/generate.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int sample_next(const at::Tensor& logits, const Sampling& sampling, std::mt19937_64& rng) {
  const at::Tensor row = logits.to(at::kDouble).contiguous();
  const double* z = row.const_data_ptr<double>();
  const int64_t V = row.numel();
  if (sampling.temperature == 0) return int(std::max_element(z, z + V) - z);
  std::vector<int> ids(size_t(V), 0);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [z](int a, int b) { return z[a] > z[b]; });
  const size_t k = sampling.top_k > 0 ? size_t(std::min(sampling.top_k, V)) : size_t(V);
  std::vector<double> p(k);
  double total = 0;
  for (size_t i = 0; i < k; ++i) total += p[i] = std::exp((z[ids[i]] - z[ids[0]]) / sampling.temperature);
  size_t kept = 0;
  for (double mass = 0; kept < k && (kept == 0 || mass < sampling.top_p * total);) mass += p[kept++];
  total = std::accumulate(p.begin(), p.begin() + ptrdiff_t(kept), 0.0);
  // A uniform draw in [0, 1) from the generator's 53 high bits: the same on every platform.
  double u = double(rng() >> 11) * 0x1.0p-53 * total;
  for (size_t i = 0; i < kept; ++i)
    if ((u -= p[i]) < 0) return ids[i];
  return ids[kept - 1];
}

Generation generate(Transformer& model, const std::vector<std::vector<int>>& prompts, int64_t max_new_tokens,
                    const Sampling& sampling, int eos, const OnToken& on_token) {
  const ModelConfig& cfg = model.config();
  if (!(sampling.temperature >= 0) || !std::isfinite(sampling.temperature))
    fail("generate: temperature ", sampling.temperature, " is not a finite number ≥ 0");
  if (sampling.top_k < 0) fail("generate: top-k ", sampling.top_k, " is negative (0 keeps every id)");
  if (!(sampling.top_p > 0 && sampling.top_p <= 1)) fail("generate: top-p ", sampling.top_p, " is not in (0, 1]");
  if (max_new_tokens < 0) fail("generate: max new tokens ", max_new_tokens, " is negative");
  if (prompts.empty()) fail("generate: no prompts");
  const int64_t B = int64_t(prompts.size());
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t n = int64_t(prompts[i].size());
    if (n == 0) fail("generate: prompt ", i, " is empty; a prompt needs at least one token");
    if (n > cfg.seq_len) fail("generate: prompt ", i, " has ", n, " tokens, more than model.seq_len ", cfg.seq_len);
    for (int id : prompts[i])
      if (id < 0 || id >= cfg.vocab_size)
        fail("generate: prompt ", i, " holds token id ", id, ", outside the vocabulary 0 … ", cfg.vocab_size - 1);
    longest = std::max(longest, n);
  }
  at::NoGradGuard no_grad;
  Generation g;
  g.tokens.resize(size_t(B));
  g.stopped.assign(size_t(B), "limit");
  // One generator per sequence, seeded by (seed, index): a prompt's samples do not depend on
  // the other prompts of the batch or on when they finish.
  std::vector<std::mt19937_64> rng;
  for (int64_t b = 0; b < B; ++b) {
    std::seed_seq seq{uint32_t(sampling.seed), uint32_t(sampling.seed >> 32), uint32_t(b), uint32_t(uint64_t(b) >> 32)};
    rng.emplace_back(seq);
  }
  // Every generated id but the last is fed back, so a sequence holds at most its prompt and
  // max_new_tokens − 1 more positions.
  const int64_t fed = std::clamp<int64_t>(max_new_tokens - 1, 0, cfg.seq_len);
  DecodeState state = model.start_decoding(B, std::min<int64_t>(cfg.seq_len, longest + fed));
  const auto device = model.parameters().device();

  // Prefill: the prompts right-padded into one chunk; each row's next id comes from its last real position.
  std::vector<int64_t> counts(static_cast<size_t>(B), 0), padded(static_cast<size_t>(B * longest), 0);
  for (int64_t b = 0; b < B; ++b) {
    counts[size_t(b)] = int64_t(prompts[size_t(b)].size());
    std::copy(prompts[size_t(b)].begin(), prompts[size_t(b)].end(), padded.begin() + b * longest);
  }
  const auto ids = at::TensorOptions().dtype(at::kLong);
  auto t0 = Clock::now();
  at::Tensor h = model.extend(state, at::tensor(padded, ids).view({B, longest}).to(device), counts);
  std::vector<at::Tensor> last;
  for (int64_t b = 0; b < B; ++b) last.push_back(h[b][counts[size_t(b)] - 1]);
  at::Tensor logits = model.head(at::stack(last)).to(at::kCPU);
  g.prefill_tokens = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  g.prefill_seconds = seconds_since(t0);

  // Decode: every unfinished sequence takes its sampled id, then feeds it as its next position.
  std::vector<bool> active(size_t(B), max_new_tokens > 0);
  t0 = Clock::now();
  while (true) {
    std::vector<int64_t> feed(size_t(B), 0);
    for (int64_t b = 0; b < B; ++b) {
      if (!active[size_t(b)]) continue;
      const int id = sample_next(logits[b], sampling, rng[size_t(b)]);
      auto& out = g.tokens[size_t(b)];
      out.push_back(id);
      std::string& why = g.stopped[size_t(b)];
      if (id == eos) why = "eos";
      else if (on_token && !on_token(size_t(b), id)) why = "stop";
      else if (int64_t(out.size()) == max_new_tokens) why = "limit";
      else if (state.lengths[size_t(b)] == state.capacity) why = "context";
      else {
        feed[size_t(b)] = id;
        continue;
      }
      active[size_t(b)] = false;
    }
    counts.assign(size_t(B), 0);
    for (int64_t b = 0; b < B; ++b) counts[size_t(b)] = active[size_t(b)] ? 1 : 0;
    if (std::none_of(active.begin(), active.end(), [](bool a) { return a; })) break;
    h = model.extend(state, at::tensor(feed, ids).view({B, 1}).to(device), counts);
    logits = model.head(h.select(1, 0)).to(at::kCPU);
    g.decode_tokens += std::accumulate(counts.begin(), counts.end(), int64_t(0));
  }
  g.decode_seconds = seconds_since(t0);
  return g;
}

}  // namespace depthkit
