// `depthkit bench --ops`: each fused operator (bench_op_names) against its reference composition
// (ops/reference/), forward plus backward, at the tiny config's shapes and at the 0.1B shapes,
// timed interleaved in one process (medians over repeats); and the fused read's achieved
// bandwidth against a plain copy measured in the same run (docs/benchmarks.md).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace depthkit {

// A plain copy of a tensor into another of its shape (at::Tensor::copy_): the speed memory
// allows, against which `bench --ops` rates the fused operators and `bench --kinds` the
// pathways' traffic (bench/bench.h). Timed in the same rounds as what it is compared with, so
// that both see the same machine.
struct PlainCopy {
  at::Tensor src, dst;
  explicit PlainCopy(at::Tensor source);
  double time_ms();  // one copy, between two synchronisations on a device
  double gbs(double ms) const;  // the bytes read and written ÷ ms
};

struct OpTiming {
  std::string op;     // e.g. "depth_read"
  std::string shape;  // e.g. "tiny: N=5 P=4096 d=128"
  double reference_ms = 0, fused_ms = 0;  // medians, forward + backward
  // What the fused forward + backward must move at the least: each input and output of the
  // forward, and each input and gradient of the backward, once (storage types).
  double bytes = 0;
  // The median time of what both must do and fusion cannot remove (mhc_pre, linear_cross_entropy:
  // three GEMMs), or 0.
  double irreducible_ms = 0;
  double copy_gbs = 0;  // a plain copy at this shape, same run (ReadBandwidth)
  double speedup() const { return reference_ms / fused_ms; }
  double gbs() const { return bytes / (fused_ms * 1e-3) / 1e9; }
  // The speedup of an op that moved `bytes` at copy speed (plus the irreducible work): the most
  // fusion can give where the op is bound by memory.
  double copy_bound_speedup() const {
    return reference_ms / (irreducible_ms + bytes / (copy_gbs * 1e9) * 1e3);
  }
};

struct ReadBandwidth {
  std::string shape;
  double bytes = 0;        // what the fused forward read must move: sources once, output once
  double fused_ms = 0;     // median forward time
  double copy_gbs = 0;     // a plain copy of the sources (at::Tensor::copy_), same run
  double gbs() const { return bytes / (fused_ms * 1e-3) / 1e9; }
};

struct OpBenchReport {
  std::vector<OpTiming> ops;
  std::vector<ReadBandwidth> bandwidth;
};

// shapes: "tiny", "0.1b" or "all"; repeats: timed repetitions of each (after one warm-up).
OpBenchReport bench_ops(const std::string& shapes, int64_t repeats);

// The operators bench_ops times, one case each, in its order ("depth_read", …): what
// tests/test_operator_checklist.cpp holds to the registered operators.
std::vector<std::string> bench_op_names();

}  // namespace depthkit
