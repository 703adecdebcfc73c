// `depthkit bench`: median wall time of a full training step (forward, backward, clipping,
// AdamW) on random tokens after warm-up, tokens/s, and the process's peak resident memory.
#pragma once
#include <cstdint>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

struct BenchResult {
  double median_step_s = 0;
  double tokens_per_s = 0;
  int64_t tokens_per_step = 0;
  int64_t peak_rss_bytes = 0;
  std::vector<double> step_s;
};

BenchResult run_bench(const Config& cfg, int64_t steps, int64_t warmup);

}  // namespace depthkit
