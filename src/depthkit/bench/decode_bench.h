// Decoding speed (`depthkit bench --decode`): one sequence's next-position rate at context length
// T, with the caches (Transformer::extend) against recomputing the full forward of the T-position
// prefix for each new position (what a model without incremental decoding does).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

struct DecodeBenchRow {
  std::string kind;
  int64_t length = 0;            // T: the positions held when each timed position is decoded
  double cached_ms = 0;          // median ms of one position with the caches
  double recompute_ms = 0;       // median ms of the full forward over T positions
  int64_t cache_bytes = 0;       // the decoding state at T positions (K/V and the pathway's)
  double cached_tokens_per_s() const { return 1e3 / cached_ms; }
  double recompute_tokens_per_s() const { return 1e3 / recompute_ms; }
};

// For each kind (residual.kind overrides of `cfg`, random weights) and each length: `steps`
// positions decoded one at a time after a prefill, and `recompute_steps` (≤ steps) full forwards,
// timed alternately.
// model.seq_len is raised to the longest length where it is shorter.
std::vector<DecodeBenchRow> bench_decoding(const Config& cfg, const std::vector<std::string>& kinds,
                                           const std::vector<int64_t>& lengths, int64_t steps, int64_t recompute_steps);

}  // namespace depthkit
