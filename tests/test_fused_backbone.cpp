// The backbone's fused operators (ops/backbone_ops.h) against their ATen compositions
// (reference::rms_norm, rope_qkv, swiglu, linear_cross_entropy): outputs and every gradient,
// float64 within 1e-10 and float32 within 1e-5 relative, bfloat16 within its rounding; finite
// differences in float64; thread-count independence; and the whole model with model.impl =
// "fused" against "reference".
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/rand.h>
#include <torch/csrc/autograd/autograd.h>

#include "depthkit/config/config.h"
#include "depthkit/model/layers.h"
#include "depthkit/model/transformer.h"
#include "depthkit/ops/backbone_ops.h"
#include "depthkit/ops/kernel_choice.h"
#include "depthkit/ops/reference/reference.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

namespace {

using Inputs = std::vector<at::Tensor>;

OutputsFn norm_of(decltype(&fused::rms_norm) f) {
  return [f](const Inputs& t) { return std::vector<at::Tensor>{f(t[0], t[1], 1e-5)}; };
}

void compare_norm(std::vector<int64_t> shape, at::ScalarType dtype, double rtol) {
  auto g = generator(uint64_t(shape.back()) * 7 + shape.size());
  const auto opt = at::TensorOptions().dtype(dtype);
  Inputs in = {at::randn(shape, g, opt) * 2.0, at::rand({shape.back()}, g, opt) + 0.5};
  compare(in, norm_of(fused::rms_norm), norm_of(reference::rms_norm), rtol, {"y"}, {"x", "weight"}, shape.back());
}

// RoPE tables as the model builds them (model/layers.cpp).
Rope tables(int64_t hd, int64_t max_len) { return Rope(hd, max_len, 10000.0, at::kCPU); }

OutputsFn rope_of(decltype(&fused::rope_qkv) f, const Rope& rope, int64_t H, int64_t KV, int64_t offset) {
  return [=, &rope](const Inputs& t) {
    auto [q, k, v] = f(t[0], rope.cos, rope.sin, H, KV, offset);
    return std::vector<at::Tensor>{q, k, v};
  };
}

void compare_rope(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t hd, int64_t offset, at::ScalarType dtype,
                  double rtol) {
  const Rope rope = tables(hd, T + offset + 3);
  auto g = generator(uint64_t(B * 1000 + T * 10 + offset));
  Inputs in = {at::randn({B, T, (H + 2 * KV) * hd}, g, at::TensorOptions().dtype(dtype))};
  compare(in, rope_of(fused::rope_qkv, rope, H, KV, offset), rope_of(reference::rope_qkv, rope, H, KV, offset), rtol,
          {"q", "k", "v"}, {"qkv"}, uint64_t(T));
}

OutputsFn swiglu_of(decltype(&fused::swiglu) f) {
  return [f](const Inputs& t) { return std::vector<at::Tensor>{f(t[0])}; };
}

void compare_swiglu(std::vector<int64_t> shape, at::ScalarType dtype, double rtol) {
  auto g = generator(uint64_t(shape.back()));
  // Gates spread over ±12, where the sigmoid saturates on both sides.
  Inputs in = {at::randn(shape, g, at::TensorOptions().dtype(dtype)) * 4.0};
  compare(in, swiglu_of(fused::swiglu), swiglu_of(reference::swiglu), rtol, {"out"}, {"gate_up"}, shape.size());
}

OutputsFn cross_entropy_of(decltype(&fused::linear_cross_entropy) f, const at::Tensor& targets) {
  return [f, targets](const Inputs& t) { return std::vector<at::Tensor>{f(t[0], t[1], targets)}; };
}

void compare_cross_entropy(int64_t N, int64_t V, int64_t d, at::ScalarType dtype, double rtol) {
  auto g = generator(uint64_t(N * 31 + V));
  const auto opt = at::TensorOptions().dtype(dtype);
  Inputs in = {at::randn({N, d}, g, opt), at::randn({V, d}, g, opt) * 0.5};
  const at::Tensor targets = at::randint(V, {N}, g, at::TensorOptions().dtype(at::kLong));
  compare(in, cross_entropy_of(fused::linear_cross_entropy, targets),
          cross_entropy_of(reference::linear_cross_entropy, targets), rtol, {"loss"}, {"hidden", "weight"}, 1);
}

}  // namespace

TEST(FusedBackbone, RmsNormEqualsReference) {
  for (auto shape : std::vector<std::vector<int64_t>>{{1, 1}, {3, 7}, {2, 5, 33}, {130, 64}}) {
    compare_norm(shape, at::kDouble, 1e-10);
    compare_norm(shape, at::kFloat, 1e-5);
  }
  compare_norm({70, 48}, at::kBFloat16, 2e-2);
}

TEST(FusedBackbone, RopeQkvEqualsReference) {
  compare_rope(1, 1, 1, 1, 2, 0, at::kDouble, 1e-10);
  compare_rope(2, 5, 4, 2, 8, 0, at::kDouble, 1e-10);
  compare_rope(3, 7, 2, 2, 6, 4, at::kDouble, 1e-10);  // an offset, as decoding takes
  compare_rope(2, 33, 10, 5, 64, 0, at::kFloat, 1e-5);
  compare_rope(2, 9, 4, 1, 16, 3, at::kBFloat16, 2e-2);
}

TEST(FusedBackbone, SwigluEqualsReference) {
  for (auto shape : std::vector<std::vector<int64_t>>{{1, 2}, {3, 14}, {2, 5, 70}, {129, 96}}) {
    compare_swiglu(shape, at::kDouble, 1e-10);
    compare_swiglu(shape, at::kFloat, 1e-5);
  }
  compare_swiglu({40, 64}, at::kBFloat16, 2e-2);
}

TEST(FusedBackbone, LinearCrossEntropyEqualsReference) {
  compare_cross_entropy(1, 2, 1, at::kDouble, 1e-10);
  compare_cross_entropy(37, 11, 5, at::kDouble, 1e-10);
  // Several chunks (8 MiB of logits each: 256 tokens of 4096 float64 logits) and a short last one.
  compare_cross_entropy(600, 4096, 8, at::kDouble, 1e-10);
  compare_cross_entropy(1500, 3000, 16, at::kFloat, 1e-5);
  compare_cross_entropy(300, 500, 32, at::kBFloat16, 2e-2);
}

TEST(FusedBackbone, LinearCrossEntropyWithoutGradientsIsTheSameLoss) {
  auto g = generator(5);
  const at::Tensor h = at::randn({700, 12}, g, at::kDouble), w = at::randn({3100, 12}, g, at::kDouble);
  const at::Tensor t = at::randint(3100, {700}, g, at::TensorOptions().dtype(at::kLong));
  const at::Tensor with = fused::linear_cross_entropy(h.clone().requires_grad_(), w, t);
  const at::Tensor without = fused::linear_cross_entropy(h, w, t);
  EXPECT_TRUE(near(without, with.detach(), 1e-14, "loss"));
  EXPECT_TRUE(near(without, reference::linear_cross_entropy(h, w, t), 1e-12, "loss vs reference"));
}

TEST(FusedBackbone, FiniteDifferences) {
  auto g = generator(11);
  const auto d64 = at::TensorOptions().dtype(at::kDouble);
  gradcheck([](const Inputs& t) { return (fused::rms_norm(t[0], t[1], 1e-5) * t[2]).sum(); },
            {at::randn({3, 5}, g, d64), at::rand({5}, g, d64) + 0.5, at::randn({3, 5}, g, d64)});
  const Rope rope = tables(4, 8);
  gradcheck([&](const Inputs& t) {
    auto [q, k, v] = fused::rope_qkv(t[0], rope.cos, rope.sin, 2, 1, 2);
    return (q * t[1]).sum() + (k * k).sum() + (v * v * v).sum();
  }, {at::randn({1, 3, 16}, g, d64), at::randn({1, 3, 2, 4}, g, d64)});
  gradcheck([](const Inputs& t) { return (fused::swiglu(t[0]) * t[1]).sum(); },
            {at::randn({3, 8}, g, d64) * 3.0, at::randn({3, 4}, g, d64)});
  const at::Tensor targets = at::randint(6, {4}, g, at::TensorOptions().dtype(at::kLong));
  gradcheck([&](const Inputs& t) { return fused::linear_cross_entropy(t[0], t[1], targets) * 3.0; },
            {at::randn({4, 3}, g, d64), at::randn({6, 3}, g, d64)});
}

// The weight's gradient sums over rows in fixed blocks (kernel_math.h): the same bits on any
// number of threads.
TEST(FusedBackbone, RmsNormGradientIndependentOfThreads) {
  auto g = generator(3);
  const at::Tensor x = at::randn({1001, 40}, g), w = at::rand({40}, g), dy = at::randn({1001, 40}, g);
  std::vector<at::Tensor> grads;
  for (int threads : {1, 2, 3}) {
    IntraOpThreads scope(threads);
    at::Tensor wl = w.clone().requires_grad_(), xl = x.clone().requires_grad_();
    (fused::rms_norm(xl, wl, 1e-5) * dy).sum().backward();
    grads.push_back(at::cat({xl.grad().reshape(-1), wl.grad()}));
  }
  EXPECT_TRUE(grads[0].equal(grads[1]));
  EXPECT_TRUE(grads[0].equal(grads[2]));
}

TEST(FusedBackbone, BadInputsAreRefused) {
  const at::Tensor h = at::randn({4, 3}), w = at::randn({5, 3});
  expect_error([&] { fused::linear_cross_entropy(h, w, at::full({4}, 5, at::kLong)); },
               {"linear_cross_entropy", "outside the vocabulary"});
  expect_error([&] { fused::rms_norm(h, at::ones({4}), 1e-5); }, {"rms_norm", "does not match"});
  expect_error([&] { fused::swiglu(at::randn({2, 3})); }, {"swiglu", "2F"});
  expect_error([&] { fused::swiglu(at::randn({2, 0})); }, {"swiglu", "empty"});
  expect_error([&] { fused::rms_norm(at::randn({2, 0}), at::ones({0}), 1e-5); }, {"rms_norm", "empty"});
  const Rope rope = tables(4, 4);
  expect_error([&] { fused::rope_qkv(at::randn({1, 5, 16}), rope.cos, rope.sin, 2, 1, 0); },
               {"rope_qkv", "exceed"});
}

// The backward operators have no derivative: a second derivative is refused, not silently zero.
TEST(FusedBackbone, SecondDerivativesAreRefused) {
  auto g = generator(4);
  const at::Tensor x = at::randn({3, 8}, g).requires_grad_(), w = at::rand({8}, g);
  const at::Tensor y = fused::swiglu(fused::rms_norm(x, w, 1e-5)).sum();
  expect_error([&] { torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               {"swiglu", "not differentiable"});
}

// The whole model: model.impl = "fused" and "reference" give the same loss and the same gradient
// of every parameter (float64: the same function to rounding), dense and MoE.
TEST(FusedBackbone, ModelEqualsReferenceComposition) {
  for (const char* extra : {"", "[moe]\nn_experts = 4\ntop_k = 2\nexpert_d_ff = 16\n"}) {
    Config cfg = parse_config(std::string("[model]\nn_layers = 2\nd_model = 16\nn_heads = 4\nn_kv_heads = 2\n"
                                           "d_ff = 24\nvocab_size = 50\nseq_len = 9\n[train]\nsteps = 1\n") + extra, "test");
    auto g = generator(9);
    const at::Tensor batch = at::randint(50, {3, 10}, g, at::TensorOptions().dtype(at::kLong));
    std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> runs;
    for (const char* impl : {"fused", "reference"}) {
      cfg.model.impl = impl;
      Transformer model(cfg.model, cfg.residual, at::kCPU, 7, at::kDouble);
      at::Tensor loss = model.loss(batch);
      loss.backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : model.parameters().all()) grads.push_back(p.tensor.grad());
      runs.emplace_back(loss.detach(), grads);
    }
    // The fused run did run the operators (a missing kernel would run the compositions twice).
    for (const char* op : {"rms_norm", "rope_qkv", "swiglu", "linear_cross_entropy"})
      EXPECT_TRUE(has_fused_kernel(op, c10::DeviceType::CPU)) << op;
    EXPECT_TRUE(near(runs[0].first, runs[1].first, 1e-12, "loss"));
    for (size_t i = 0; i < runs[0].second.size(); ++i)
      EXPECT_TRUE(near(runs[0].second[i], runs[1].second[i], 1e-10, cat("gradient ", i)));
  }
}

}  // namespace depthkit::test
