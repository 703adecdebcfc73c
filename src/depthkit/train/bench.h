// `depthkit bench`: median wall time of a full training step (forward, backward, clipping,
// AdamW) on random tokens after warm-up, tokens/s, each kind's peak tensor memory
// (util/memory.h) and the process's peak resident memory. It runs on train.device
// (util/device.h): on CUDA each step is timed between two synchronisations and each kind's peak
// memory is the CUDA caching allocator's.
// With several pathway kinds, one model per kind is built and their steps are interleaved
// (kind 1, kind 2, …, kind 1, …) so that every kind sees the same machine conditions; the
// overhead of each kind is its median step time against the first kind's (docs/benchmarks.md).
// With profile_steps > 0, each kind then runs that many more steps (untimed) under an OpProfile
// (util/op_profile.h): where its step time goes, operator by operator.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/util/op_profile.h"

namespace depthkit {

struct BenchResult {
  std::string kind;
  double median_step_s = 0;
  double tokens_per_s = 0;
  int64_t tokens_per_step = 0;
  int64_t peak_rss_bytes = 0;     // of the whole process (all kinds together when interleaved)
  int64_t peak_tensor_bytes = 0;  // this kind's own CPU tensors: parameters, optimizer state, a step's peak
  std::string device;             // where it ran: "cpu", "cuda:0", …
  // On CUDA, this kind's own device memory counted the same way from the caching allocator
  // (max_memory_allocated); -1 on the CPU, or in a build without DEPTHKIT_CUDA.
  int64_t peak_device_bytes = -1;
  std::vector<double> step_s;
  int64_t profile_steps = 0;
  std::vector<OpProfile::Row> profile;  // summed over profile_steps steps, largest self time first
};

BenchResult run_bench(const Config& cfg, int64_t steps, int64_t warmup, int64_t profile_steps = 0);

// One result per kind (residual.kind = each of `kinds`, everything else from cfg), interleaved.
std::vector<BenchResult> run_bench_kinds(const Config& cfg, const std::vector<std::string>& kinds, int64_t steps,
                                         int64_t warmup, int64_t profile_steps = 0);

}  // namespace depthkit
