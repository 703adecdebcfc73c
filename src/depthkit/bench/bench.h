// `depthkit bench`: median wall time of a full training step (forward, backward, clipping,
// AdamW) on random tokens after warm-up, tokens/s, each kind's peak tensor memory
// (util/memory.h) and the process's peak resident memory. It runs on train.device
// (util/device.h): on CUDA each step is timed between two synchronisations and each kind's peak
// memory is the CUDA caching allocator's.
// With several pathway kinds, one model per kind is built and their steps are interleaved
// (kind 1, kind 2, …, kind 1, …) so that every kind sees the same machine conditions; the
// overhead of each kind is its median step time against the first kind's (docs/benchmarks.md).
// Variants generalise the kinds: each is a label and --set overrides on top of the config (a kind
// is the variant "residual.kind=K"), built into its own model and timed in the same round-robin,
// e.g. an MoE model's expert product grouped against a per-expert loop, against a dense model.
// For an MoE variant, the memory of one MoE layer's dispatch is measured as well (DispatchMemory).
// With profile_steps > 0, each kind then runs that many more steps (untimed) under an OpProfile
// (util/op_profile.h): where its step time goes, operator by operator.
// Each kind's pathway traffic is given in ms at the speed of a plain copy timed in the same
// rounds (BenchResult::traffic_ms): the least time its pathway can add to a step if it is bound
// by memory, to set beside the overhead measured.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/util/op_profile.h"

namespace depthkit {

// The memory of the dispatch of one MoE layer in a training forward, per token: from the tokens'
// sorted copies to the combined output (model/moe.cpp: the sorted copy [N·k, d], the experts'
// hidden activations, their outputs, the gate-weighted copies, the index tensors), without the
// norm and router before it (measured alone and subtracted) and without the shared experts.
// Measured with the tensor-memory counter on train.device, on one MoE layer with the variant's
// widths and expert_impl, at micro_batch and 2 · micro_batch sequences: the per-token figures
// are the differences ÷ the extra tokens, so per-call costs (bfloat16 copies of the experts'
// weights, the per-expert counts) drop out and are given apart as `fixed_bytes`.
struct DispatchMemory {
  std::string expert_impl;         // what ran: "grouped" or "loop"
  double peak_per_token = 0;       // the largest rise during the dispatch
  double kept_per_token = 0;       // what it leaves after the forward: saved for backward, and its output
  int64_t fixed_bytes = 0;         // the peak's part that does not grow with the tokens
  int64_t tokens = 0;              // N at the smaller measurement (micro_batch · seq_len)
  // The same from moe.cpp's forward, counted by hand (element size b of the compute dtype):
  int64_t sorted_copy_per_token = 0;   // top_k · d · b: the tokens' sorted copies alone
  int64_t analytic_kept_per_token = 0;  // sorted copy, 4 · top_k · expert_d_ff · b hidden (gate, up,
                                        // silu(gate), product), top_k · d · b expert outputs, as much
                                        // for their gate-weighted copies (index_add keeps its source),
                                        // top_k · b gates, 2 · top_k · 8 int64 indices, d · b output
  int64_t analytic_peak_per_token = 0;  // + the zeros d · b the weighted copies are added into
};

struct BenchResult {
  std::string name;  // the variant's label (the kind, with kinds)
  std::string kind;  // its residual.kind
  std::vector<std::string> overrides;  // the variant's --set overrides
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
  int64_t parameters = 0, active_parameters = 0;  // the model's (ParameterCounts::total, ::active)
  bool has_dispatch = false;  // an MoE variant (n_experts > 0) on a device whose memory is counted
  DispatchMemory dispatch;
  // The pathway's memory traffic per step, `depthkit cost`'s count (CostReport::
  // training_traffic_bytes, forward and backward, in the compute dtype), and the bandwidth of a
  // plain copy timed three times a round among the steps (PlainCopy, bench/op_bench.h; the same for
  // every variant): what the pathway's bytes take at the speed memory allows.
  double traffic_bytes = 0;
  double copy_gbs = 0;
  double traffic_ms() const { return traffic_bytes / (copy_gbs * 1e9) * 1e3; }
  // The pathway's FLOPs per step, `depthkit cost`'s count (CostReport::pathway_flops: 3× the
  // forward, multiply-add = 2, MSAR Appendix C), and the rate of a GEMM at the layer's shape timed
  // three times a round among the steps (GemmRate, bench/op_bench.h; the same for every variant):
  // what the pathway's FLOPs take at the rate the machine's tuned kernels reach.
  double pathway_flops = 0;
  double gemm_gflops = 0;
  double flop_ms() const { return pathway_flops / (gemm_gflops * 1e9) * 1e3; }
};

// A label and the "section.key=value" overrides that make it from the common config.
struct BenchVariant {
  std::string name;
  std::vector<std::string> overrides;
};

BenchResult run_bench(const Config& cfg, int64_t steps, int64_t warmup, int64_t profile_steps = 0);

// One result per variant (cfg with its overrides applied), interleaved round-robin.
std::vector<BenchResult> run_bench_variants(const Config& cfg, const std::vector<BenchVariant>& variants,
                                            int64_t steps, int64_t warmup, int64_t profile_steps = 0);

// One result per kind (residual.kind = each of `kinds`, everything else from cfg), interleaved.
std::vector<BenchResult> run_bench_kinds(const Config& cfg, const std::vector<std::string>& kinds, int64_t steps,
                                         int64_t warmup, int64_t profile_steps = 0);

}  // namespace depthkit
