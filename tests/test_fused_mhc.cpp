// The fused mHC operators (ops/mhc_ops.h) against their reference compositions (ops/reference/):
// forward and every gradient, float64 within 1e-10 and float32 within 1e-5 relative, on shapes with
// m = 1, 2, 4, odd d, B·T = 1 and larger, with random parameters that make H_res far from uniform;
// a finite-difference gradient check in float64 for each op; bfloat16; the Mhc pathway with
// impl = fused against impl = reference. Their timing: `depthkit bench --ops` (bench/op_bench.cpp).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "depthkit/nn/parameters.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/mhc_ops.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/pathways/mhc.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

namespace {

struct Shape {
  int64_t m, B, T, d;
};
const Shape kShapes[] = {{1, 1, 1, 1}, {1, 2, 3, 7}, {2, 1, 1, 5}, {2, 3, 5, 9}, {3, 2, 9, 5},
                         {4, 1, 1, 7}, {4, 2, 7, 13}, {4, 3, 11, 33}};

// Random pre-mix inputs: φ with unit-variance projections, α = (pre, post, res) large enough that
// the logits spread over several units (H_res far from uniform), random bias.
std::vector<at::Tensor> pre_inputs(const Shape& s, at::ScalarType dtype, at::Generator& g) {
  const auto opt = at::TensorOptions().dtype(dtype);
  const int64_t n = s.m * s.m + 2 * s.m, md = s.m * s.d;
  at::Tensor x = at::randn({s.B, s.T, s.m, s.d}, g, opt) * 1.3 + 0.2;
  at::Tensor phi = at::randn({n, md}, g, opt) / std::sqrt(double(md));
  at::Tensor bias = at::randn({n}, g, opt) * 0.5;
  at::Tensor scale = at::tensor({1.7, -2.3, 3.1}, opt) * (1 + 0.1 * at::randn({3}, g, opt));
  return {x.requires_grad_(), phi.requires_grad_(), bias.requires_grad_(), scale.requires_grad_()};
}

void compare_pre(const Shape& s, at::ScalarType dtype, double rtol) {
  const uint64_t seed = s.m * 1000 + s.B * 100 + s.T * 10 + s.d;
  auto g = generator(seed);
  auto pre = [](auto op) {
    return [op](const std::vector<at::Tensor>& t) {
      auto [h, post, res] = op(t[0], t[1], t[2], t[3], kKeyNormEps);
      return std::vector<at::Tensor>{h, post, res};
    };
  };
  Compared c = compare(pre_inputs(s, dtype, g), pre(fused::mhc_pre), pre(reference::mhc_pre), rtol,
                       {"h", "H_post", "H_res logits"}, {"x", "phi", "bias", "scale"}, seed + 3);
  if (s.m > 1) {
    const at::Tensor& ref_res = c.reference[2];
    EXPECT_GT((ref_res.amax({-2, -1}) - ref_res.amin({-2, -1})).min().item<double>(), 1.0)
        << "the H_res logits must spread (non-trivial parameters)";
  }
}

void compare_sinkhorn(const Shape& s, at::ScalarType dtype, double rtol) {
  const uint64_t seed = s.m * 1000 + s.B * 100 + s.T * 10 + s.d + 1;
  auto g = generator(seed);
  const auto opt = at::TensorOptions().dtype(dtype);
  auto sinkhorn = [](auto op) {
    return [op](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{op(t[0], 20)}; };
  };
  Compared c = compare({at::randn({s.B, s.T, s.m, s.m}, g, opt) * 2.5}, sinkhorn(fused::mhc_sinkhorn),
                       sinkhorn(reference::mhc_sinkhorn), rtol, {"H_res"}, {"logits"}, seed + 3);
  if (s.m > 1) {  // far from uniform: on average the entries of a token's H_res spread over more than 0.3
    const at::Tensor& ref = c.reference[0];
    EXPECT_GT((ref.amax({-2, -1}) - ref.amin({-2, -1})).mean().item<double>(), 0.3) << "H_res near uniform";
  }
}

void compare_merge(const Shape& s, at::ScalarType dtype, double rtol) {
  const uint64_t seed = s.m * 1000 + s.B * 100 + s.T * 10 + s.d + 2;
  auto g = generator(seed);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> in = {at::randn({s.B, s.T, s.m, s.d}, g, opt), at::randn({s.B, s.T, s.d}, g, opt),
                                at::randn({s.B, s.T, s.m}, g, opt) + 1, at::randn({s.B, s.T, s.m, s.m}, g, opt)};
  auto merge = [](auto op) {
    return [op](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{op(t[0], t[1], t[2], t[3])}; };
  };
  compare(in, merge(fused::mhc_merge), merge(reference::mhc_merge), rtol, {"x'"}, {"x", "f", "H_post", "H_res"},
          seed + 3);
}

}  // namespace

TEST(FusedMhc, PreMixEqualsReference) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(cat("m ", s.m, " B ", s.B, " T ", s.T, " d ", s.d));
    compare_pre(s, at::kDouble, 1e-10);
    compare_pre(s, at::kFloat, 1e-5);
  }
}

TEST(FusedMhc, SinkhornEqualsReference) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(cat("m ", s.m, " B ", s.B, " T ", s.T));
    compare_sinkhorn(s, at::kDouble, 1e-10);
    compare_sinkhorn(s, at::kFloat, 1e-5);
  }
}

TEST(FusedMhc, MergeEqualsReference) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(cat("m ", s.m, " B ", s.B, " T ", s.T, " d ", s.d));
    compare_merge(s, at::kDouble, 1e-10);
    compare_merge(s, at::kFloat, 1e-5);
  }
}

TEST(FusedMhc, SplitAcrossThreadsEqualsReference) {
  IntraOpThreads threads(3);
  const Shape s{4, 7, 143, 24};
  for (auto [dtype, rtol] : {std::pair{at::kDouble, 1e-10}, std::pair{at::kFloat, 1e-5}}) {
    compare_pre(s, dtype, rtol);
    compare_sinkhorn(s, dtype, rtol);
    compare_merge(s, dtype, rtol);
  }
}

TEST(FusedMhc, PreMixGradcheckFloat64) {
  auto g = generator(31);
  auto in = pre_inputs({3, 2, 1, 3}, at::kDouble, g);
  for (auto& t : in) t = t.detach();
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor wh = at::randn({2, 1, 3}, g, opt), wp = at::randn({2, 1, 3}, g, opt), wr = at::randn({2, 1, 3, 3}, g, opt);
  gradcheck([&](const std::vector<at::Tensor>& v) {
    auto [h, post, res] = fused::mhc_pre(v[0], v[1], v[2], v[3], kKeyNormEps);
    return (h * wh).sum() + (post * wp).sum() + (res * wr).sum();
  }, in);
}

TEST(FusedMhc, SinkhornGradcheckFloat64) {
  auto g = generator(32);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  for (int64_t m : {1, 2, 4}) {
    SCOPED_TRACE(cat("m ", m));
    at::Tensor l = at::randn({3, m, m}, g, opt) * 2, w = at::randn({3, m, m}, g, opt);
    gradcheck([&](const std::vector<at::Tensor>& v) { return (fused::mhc_sinkhorn(v[0], 20) * w).sum(); }, {l});
  }
}

TEST(FusedMhc, MergeGradcheckFloat64) {
  auto g = generator(33);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  std::vector<at::Tensor> in = {at::randn({2, 3, 5}, g, opt), at::randn({2, 5}, g, opt), at::randn({2, 3}, g, opt),
                                at::randn({2, 3, 3}, g, opt)};
  at::Tensor w = at::randn({2, 3, 5}, g, opt);
  gradcheck([&](const std::vector<at::Tensor>& v) { return (fused::mhc_merge(v[0], v[1], v[2], v[3]) * w).sum(); }, in);
}

TEST(FusedMhc, BFloat16WithinItsPrecision) {
  auto g = generator(34);
  const Shape s{4, 2, 16, 64};
  auto in = pre_inputs(s, at::kFloat, g);
  std::vector<at::Tensor> bf, f32;  // bf16 inputs, and the same values in float32
  for (auto& t : in) {
    bf.push_back(t.detach().to(at::kBFloat16));
    f32.push_back(bf.back().to(at::kFloat));
  }
  auto [h, post, res] = fused::mhc_pre(bf[0], bf[1], bf[2], bf[3], kKeyNormEps);
  auto [ref_h, ref_post, ref_res] = reference::mhc_pre(f32[0], f32[1], f32[2], f32[3], kKeyNormEps);
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(res.scalar_type(), at::kFloat);
  EXPECT_TRUE(near(h, ref_h, 1e-2, "bf16 h"));        // one bf16 rounding of the output: 2^-8
  EXPECT_TRUE(near(post, ref_post, 1e-4, "bf16 H_post (float32)"));
  EXPECT_TRUE(near(res, ref_res, 1e-4, "bf16 H_res logits (float32)"));
  at::Tensor H = fused::mhc_sinkhorn(res, 20);
  at::Tensor ref_H = reference::mhc_sinkhorn(ref_res, 20);
  EXPECT_TRUE(near(H, ref_H, 1e-4, "bf16 H_res (float32)"));
  at::Tensor f = at::randn({s.B, s.T, s.d}, g).to(at::kBFloat16);
  at::Tensor out = fused::mhc_merge(bf[0], f, post, H);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(near(out, reference::mhc_merge(f32[0], f.to(at::kFloat), ref_post, ref_H), 2e-2, "bf16 x'"));
}

TEST(FusedMhc, BadShapesAreClearErrors) {
  at::Tensor x = at::zeros({2, 3, 4}), f = at::zeros({2, 4});
  expect_error([&] { fused::mhc_pre(x, at::zeros({15, 11}), at::zeros({15}), at::zeros({3}), 1e-6); },
               {"mhc_pre", "phi"});
  expect_error([&] { fused::mhc_pre(x, at::zeros({15, 12}), at::zeros({15}), at::zeros({2}), 1e-6); },
               {"mhc_pre", "scale"});
  expect_error([&] { fused::mhc_sinkhorn(at::zeros({2, 3, 4}), 20); }, {"mhc_sinkhorn", "[*, m, m]"});
  expect_error([&] { fused::mhc_merge(x, at::zeros({2, 5}), at::zeros({2, 3}), at::zeros({2, 3, 3})); },
               {"mhc_merge", "f must be"});
  expect_error([&] { fused::mhc_merge(x, f, at::zeros({2, 3}), at::zeros({2, 3, 2})); }, {"mhc_merge", "h_res"});
}

// The whole pathway: impl = fused equals impl = reference (every branch input, the final hidden
// state, the gradients of the embedding, the branches and every mHC parameter), random parameters.
TEST(FusedMhc, PathwayEqualsReference) {
  for (auto dtype : {at::kDouble, at::kFloat})
    for (int64_t m : {1, 2, 4}) {
      SCOPED_TRACE(cat("dtype ", dtype, " m ", m));
      const double rtol = dtype == at::kDouble ? 1e-10 : 1e-5;
      ModelConfig model;
      model.n_layers = 2;
      model.d_model = 7;
      const int64_t L = model.n_branches(), d = model.d_model;
      ResidualConfig r;
      r.kind = "mhc";
      r.streams = m;
      ParameterStore ps_ref(at::kCPU, 3, dtype), ps_fused(at::kCPU, 3, dtype);
      r.impl = "reference";
      auto ref = make_pathway(r, model, ps_ref);
      r.impl = "fused";
      auto fus = make_pathway(r, model, ps_fused);
      {
        auto g = generator(41);
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < ps_ref.all().size(); ++i) {
          ps_ref.all()[i].tensor.normal_(0.0, 0.7, g);
          ps_fused.all()[i].tensor.copy_(ps_ref.all()[i].tensor);
        }
      }
      auto g = generator(42);
      const auto opt = at::TensorOptions().dtype(dtype);
      at::Tensor e = at::randn({2, 5, d}, g, opt);
      std::vector<at::Tensor> W;
      for (int64_t l = 0; l < L; ++l) W.push_back(at::randn({d, d}, g, opt) * 0.6);
      auto run = [&](ResidualPathway& path, std::vector<at::Tensor>& inputs, at::Tensor& emb, std::vector<at::Tensor>& Ws) {
        emb = e.clone().requires_grad_();
        for (auto& w : W) Ws.push_back(w.clone().requires_grad_());
        auto state = path.begin(emb);
        for (int64_t l = 1; l <= L; ++l) {
          at::Tensor h = path.read(*state, l);
          inputs.push_back(h);
          path.write(*state, l, 0.5 * at::tanh(at::matmul(h, Ws[l - 1])));
        }
        return path.finish(*state);
      };
      std::vector<at::Tensor> in_ref, in_fus, W_ref, W_fus;
      at::Tensor e_ref, e_fus;
      at::Tensor hid_ref = run(*ref, in_ref, e_ref, W_ref), hid_fus = run(*fus, in_fus, e_fus, W_fus);
      for (int64_t l = 0; l < L; ++l) EXPECT_TRUE(near(in_fus[l], in_ref[l], rtol, cat("h_", l + 1)));
      EXPECT_TRUE(near(hid_fus, hid_ref, rtol, "final hidden"));
      at::Tensor w = at::randn(hid_ref.sizes(), g, opt);
      (hid_ref * w).sum().backward();
      (hid_fus * w).sum().backward();
      EXPECT_TRUE(near(e_fus.grad(), e_ref.grad(), rtol, "d embedding"));
      for (int64_t l = 0; l < L; ++l) EXPECT_TRUE(near(W_fus[l].grad(), W_ref[l].grad(), rtol, cat("d W_", l + 1)));
      for (size_t i = 0; i < ps_ref.all().size(); ++i)
        EXPECT_TRUE(near(ps_fused.all()[i].tensor.grad(), ps_ref.all()[i].tensor.grad(), rtol,
                         "d " + ps_ref.all()[i].name));
    }
}

TEST(FusedMhc, ConfigAcceptsFusedForMhcKinds) {
  const std::string base = small_config("unused").to_toml();
  for (const char* kind : {"residual.kind=mhc", "residual.kind=attnres_mhc"})
    EXPECT_EQ(parse_config(base, "x.toml", {kind, "residual.impl=fused"}).residual.impl, "fused") << kind;
}

}  // namespace depthkit::test
