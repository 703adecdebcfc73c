#include "depthkit/bench/decode_bench.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randint.h>

#include <algorithm>
#include <chrono>

#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
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
    Config c = parse_config(cfg.to_toml(), "bench --decode",
                             {"residual.kind=" + kind, "model.seq_len=" + std::to_string(std::max(longest, cfg.model.seq_len))});
    Transformer model(c.model, c.residual, at::kCPU, c.train.seed, at::kFloat, compute_dtype_of(c.train));
    auto g = at::make_generator<at::CPUGeneratorImpl>(c.train.seed);
    for (int64_t T : lengths) {
      const at::Tensor tokens = at::randint(c.model.vocab_size, {1, T}, g);
      DecodeBenchRow row;
      row.kind = kind;
      row.length = T;
      // Prefill T − steps positions.
      DecodeState state = model.start_decoding(1, T);
      model.extend(state, tokens.narrow(1, 0, T - steps), {T - steps});
      // Alternately, so that both see the machine alike: one position with the caches (the last
      // `steps` positions, each alone), then, while any are left, the whole prefix's forward for
      // one new position (its last logits alone).
      std::vector<double> cached, recomputed;
      for (int64_t t = T - steps; t < T; ++t) {
        auto t0 = Clock::now();
        model.head(model.extend(state, tokens.narrow(1, t, 1), {1}).select(1, 0));
        cached.push_back(ms_since(t0));
        if (int64_t(recomputed.size()) == recompute_steps) continue;
        t0 = Clock::now();
        model.head(model.hidden(tokens).select(1, T - 1));
        recomputed.push_back(ms_since(t0));
      }
      row.cache_bytes = state.bytes();
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
