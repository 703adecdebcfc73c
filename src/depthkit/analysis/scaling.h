// Scaling-law fits (`depthkit scaling`, MSAR §4.3 and Appendix B). For each method, with the
// irreducible loss E fixed, L(C) = A·C^(−β) + E is fitted by ordinary least squares of
// log(L − E) on log C. The iso-loss compute speedup of a method is, averaged over its observed
// points, the baseline's fitted compute at the observed loss, (A_b / (L − E))^(1/β_b), divided by
// the method's compute at that point. Both are unchanged by normalising C or by the logarithms'
// base (the paper regresses log₂(L − E) on log₁₀ C).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace depthkit {

struct ScalingPoint {
  std::string method;
  double compute = 0;  // training FLOPs (any fixed unit)
  double loss = 0;
};

struct ScalingFit {
  std::string method;
  int64_t points = 0;
  double A = 0, beta = 0;
  double r2 = 0;                  // of the log-space regression
  double speedup = 0;             // mean iso-loss compute speedup against the baseline
  std::vector<double> speedups;   // per observed point, in the order given
};

// CSV with a header naming the columns method, compute, loss (any order, other columns ignored),
// or JSON: [{"method": …, "compute": …, "loss": …}, …] or {"points": [...]}.
std::vector<ScalingPoint> read_scaling_points(const std::filesystem::path& file);

// One fit per method, in order of first appearance; throws (naming the method and point) when a
// loss is not above E, a compute is not positive, a method has fewer than two distinct computes,
// or the baseline is missing.
std::vector<ScalingFit> fit_scaling(const std::vector<ScalingPoint>& points, double irreducible,
                                    const std::string& baseline);

}  // namespace depthkit
