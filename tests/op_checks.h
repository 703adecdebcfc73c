// Shared checks of the fused-operator tests: seeded generators, a relative comparison that names
// what differs, the comparison of a fused operator with its reference (outputs and gradients),
// and a central finite-difference gradient check in float64.
#pragma once
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>

#include <algorithm>
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
using OutputsFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// What `compare` ran: each side's outputs and its leaf inputs (with their gradients), for the
// checks a caller adds.
struct Compared {
  std::vector<at::Tensor> fused, reference;                // outputs
  std::vector<at::Tensor> fused_inputs, reference_inputs;  // leaves
};

// A fused operator against its reference composition, the check every test_fused*.cpp makes: both
// run on leaf copies of `inputs` and return their outputs, which must agree (`near`, within rtol);
// then both are differentiated from the same random cotangents of the outputs (seeded by `seed`;
// 1 for a scalar output)
// and the gradient of every input must agree too, except those listed in `unchecked` (inputs an
// op does not use, which the caller checks itself). `output_names` and `input_names` name them in
// the messages ("d <input>" for a gradient).
inline Compared compare(const std::vector<at::Tensor>& inputs, const OutputsFn& fused, const OutputsFn& reference,
                        double rtol, const std::vector<std::string>& output_names,
                        const std::vector<std::string>& input_names, uint64_t seed,
                        const std::vector<size_t>& unchecked = {}) {
  Compared c;
  for (const auto& t : inputs) {
    c.fused_inputs.push_back(t.detach().clone().requires_grad_());
    c.reference_inputs.push_back(t.detach().clone().requires_grad_());
  }
  c.fused = fused(c.fused_inputs);
  c.reference = reference(c.reference_inputs);
  EXPECT_EQ(c.fused.size(), c.reference.size());
  auto g = generator(seed);
  at::Tensor fused_loss, reference_loss;
  for (size_t i = 0; i < c.fused.size() && i < c.reference.size(); ++i) {
    const std::string name = i < output_names.size() ? output_names[i] : cat("output ", i);
    EXPECT_TRUE(near(c.fused[i], c.reference[i], rtol, name));
    // The same cotangent for both sides, in the reference output's dtype; a scalar output (a loss)
    // is differentiated as it is.
    const auto opt = c.reference[i].options().requires_grad(false);
    const at::Tensor w = c.reference[i].dim() == 0 ? at::ones({}, opt) : at::randn(c.reference[i].sizes(), g, opt);
    const at::Tensor lf = (c.fused[i] * w).sum(), lr = (c.reference[i] * w).sum();
    fused_loss = fused_loss.defined() ? fused_loss + lf : lf;
    reference_loss = reference_loss.defined() ? reference_loss + lr : lr;
  }
  fused_loss.backward();
  reference_loss.backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (std::find(unchecked.begin(), unchecked.end(), i) != unchecked.end()) continue;
    const std::string name = "d " + (i < input_names.size() ? input_names[i] : cat("input ", i));
    EXPECT_TRUE(near(c.fused_inputs[i].grad(), c.reference_inputs[i].grad(), rtol, name));
  }
  return c;
}

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
