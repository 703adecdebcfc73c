// `depthkit bench --ops`: each fused operator (bench_op_names) against its reference composition
// (ops/reference/), forward plus backward, at the tiny config's shapes and at the 0.1B shapes,
// timed interleaved in one process (medians over repeats); the fused read's achieved bandwidth
// against a plain copy measured in the same run; and MSAR's two operators against their FLOP
// floor, at a GEMM's rate measured in the same run (docs/benchmarks.md).
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

// A matrix product at a layer's shape, [rows, d] · [d, d] (the projections'), in the given dtype and
// device: the FLOP rate the machine's tuned kernels (the BLAS) reach, against which `bench --ops`
// rates an operator's FLOPs and `bench --kinds` a pathway's. Timed in the same rounds as what it
// is compared with, as PlainCopy.
struct GemmRate {
  at::Tensor a, b, out;
  GemmRate(int64_t rows, int64_t d, at::TensorOptions options);
  double time_ms();             // one product, between two synchronisations on a device
  double gflops(double ms) const;  // its 2·rows·d·d FLOPs ÷ ms
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
  // The fused forward + backward's FLOPs as its kernels run them (multiply-add = 2; a backward's
  // recomputation counted), where counted (MSAR's read and fuse; 0 for the others), and a GEMM's
  // rate at the shape in the same rounds (GemmRate): the FLOP floor is the time those FLOPs take
  // at that rate.
  double flops = 0, gemm_gflops = 0;
  double flop_floor_ms() const { return flops / (gemm_gflops * 1e9) * 1e3; }
  // The time to move `bytes` at copy speed; beside the FLOP floor, the op's floor is the two
  // added (the composition of `bench --kinds`' floor): an op that does not overlap its traffic
  // with its arithmetic can go no faster.
  double traffic_floor_ms() const { return bytes / (copy_gbs * 1e9) * 1e3; }
  double floor_ms() const { return flop_floor_ms() + traffic_floor_ms(); }
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
