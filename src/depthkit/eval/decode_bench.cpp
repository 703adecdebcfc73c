#include "depthkit/eval/decode_bench.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randint.h>

#include <algorithm>
#include <chrono>

#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

std::vector<DecodeBenchRow> bench_decoding(const Config& cfg, const std::vector<std::string>& kinds,
                                           const std::vector<int64_t>& lengths, int64_t steps, int64_t recompute_steps) {
  if (lengths.empty()) fail("bench --decode: no lengths");
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  for (int64_t T : lengths)
    if (T <= steps) fail("bench --decode: length ", T, " leaves no prefill before its ", steps, " timed positions");
  at::NoGradGuard no_grad;
  std::vector<DecodeBenchRow> rows;
  Progress progress("decode", int64_t(kinds.size() * lengths.size()), "runs");
  for (const std::string& kind : kinds) {
    Config c = Config::parse(cfg.to_toml(), "bench --decode",
                             {"residual.kind=" + kind, "model.seq_len=" + std::to_string(std::max(longest, cfg.model.seq_len))});
    Transformer model(c.model, c.residual, at::kCPU, c.train.seed, at::kFloat, compute_dtype_of(c.train));
    auto g = at::make_generator<at::CPUGeneratorImpl>(c.train.seed);
    for (int64_t T : lengths) {
      const at::Tensor tokens = at::randint(c.model.vocab_size, {1, T}, g);
      DecodeBenchRow row;
      row.kind = kind;
      row.length = T;
      // Cached: prefill T − steps positions, then time each of the last `steps` alone.
      DecodeState state = model.start_decoding(1, T);
      model.extend(state, tokens.narrow(1, 0, T - steps), {T - steps});
      std::vector<double> cached, recomputed;
      for (int64_t t = T - steps; t < T; ++t) {
        const auto t0 = Clock::now();
        model.head(model.extend(state, tokens.narrow(1, t, 1), {1}).select(1, 0));
        cached.push_back(ms_since(t0));
      }
      row.cache_bytes = state.bytes();
      // Recomputed: the whole prefix's forward for one new position (its last logits alone).
      for (int64_t i = 0; i < recompute_steps; ++i) {
        const auto t0 = Clock::now();
        model.head(model.hidden(tokens).select(1, T - 1));
        recomputed.push_back(ms_since(t0));
      }
      row.cached_ms = median(cached);
      row.recompute_ms = median(recomputed);
      rows.push_back(row);
      progress.update(int64_t(rows.size()), double(rows.size()), kind + " T " + std::to_string(T));
    }
  }
  progress.finish();
  return rows;
}

}  // namespace depthkit
