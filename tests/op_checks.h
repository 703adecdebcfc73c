// Shared checks of the fused-operator tests: seeded generators, a relative comparison that names
// what differs, and a central finite-difference gradient check in float64.
#pragma once
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "depthkit/util/error.h"

namespace depthkit::test {

inline at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// max |a − b| ≤ rtol · max(1, max |b|), with the shapes equal; two empty tensors (m = 1) agree.
inline ::testing::AssertionResult near(const at::Tensor& a, const at::Tensor& b, double rtol, const std::string& what) {
  if (a.defined() && a.numel() == 0 && (!b.defined() || b.numel() == 0)) return ::testing::AssertionSuccess();
  if (!a.defined() || !b.defined()) return ::testing::AssertionFailure() << what << ": undefined tensor";
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << what << ": shape " << a.sizes() << " vs " << b.sizes();
  const double scale = std::max(1.0, b.abs().max().item<double>());
  const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  if (err <= rtol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max |diff| " << err << " > " << rtol << " × " << scale;
}

// The intra-op thread count for a scope. The kernels split tokens across threads (each thread with
// its own partial sums of the gradients shared by all tokens) only when there are several.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~IntraOpThreads() { at::set_num_threads(saved_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int saved_;
};

using ScalarFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// The backward of the scalar f at `inputs` (float64) against central differences with step 1e-6.
inline void gradcheck(const ScalarFn& f, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_());
  f(leaves).backward();
  const double h = 1e-6;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor numeric = at::zeros_like(inputs[i]);
    for (int64_t j = 0; j < inputs[i].numel(); ++j) {
      auto plus = inputs, minus = inputs;
      plus[i] = inputs[i].clone();
      minus[i] = inputs[i].clone();
      plus[i].view(-1)[j] += h;
      minus[i].view(-1)[j] -= h;
      numeric.view(-1)[j] = (f(plus).item<double>() - f(minus).item<double>()) / (2 * h);
    }
    EXPECT_TRUE(near(leaves[i].grad(), numeric, 1e-7, cat("input ", i)));
  }
}

}  // namespace depthkit::test
