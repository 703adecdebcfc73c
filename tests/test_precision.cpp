// Mixed precision (train.dtype = "bfloat16"; docs/design.md, "Precision") and the choice between a
// fused operator and its reference composition by device (ops/kernel_choice.h).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>

#include <cmath>

#include "depthkit/model/transformer.h"
#include "depthkit/ops/dar_ops.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/kernel_choice.h"
#include "depthkit/ops/mhc_ops.h"
#include "depthkit/ops/msar_ops.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "helpers.h"

namespace depthkit::test {

namespace {


// bfloat16 keeps 8 significant bits: one rounding changes a value by at most u = 2^-8 relative.
constexpr double kBf16Unit = 1.0 / 256.0;

// Every kind and form the precision tests run, each with both implementations.
std::vector<std::vector<std::string>> precision_kinds() {
  return {{"residual.kind=residual"},
          {"residual.kind=attnres", "residual.block_sublayers=1"},  // Full
          {"residual.kind=attnres", "residual.block_sublayers=3"},  // Block, a shorter last block
          {"residual.kind=attnres_sepv", "residual.block_sublayers=2"},
          {"residual.kind=dar", "residual.block_sublayers=2"},
          {"residual.kind=dar", "residual.block_sublayers=3"},
          {"residual.kind=msar", "residual.block_sublayers=1"},
          {"residual.kind=msar", "residual.block_sublayers=2"},
          {"residual.kind=mhc"},
          {"residual.kind=attnres_mhc", "residual.block_sublayers=2"}};
}

// The small test model with logits of order one (init_std 0.2 instead of 0.02, whose logits are so
// small that every loss is ln V whatever the precision), `sets` applied.
Config precision_config(std::vector<std::string> sets, const std::string& impl) {
  sets.push_back("residual.impl=" + impl);
  sets.push_back("model.init_std=0.2");
  return parse_config(small_config("unused").to_toml(), "small", sets);
}

// The pathway's parameters drawn at random (their zero initialisations hide what a precision
// changes), the same in every model built from `seed`; SepV's d × d value maps around the identity
// they start from (a map drawn with no identity, of gain up to ~3, amplifies the rounding of all
// that comes before it: gradient 1 − cos 9.5e-3 in bfloat16, against 1.8e-3 so).
void randomize_residual(Transformer& m, uint64_t seed) {
  auto g = gen(seed);
  at::NoGradGuard no_grad;
  for (const auto& p : m.parameters().all())
    if (p.component == "residual") {
      p.tensor.normal_(0.0, p.name.find("value_map") != std::string::npos ? 0.1 : 0.3, g);
      if (p.name.find("value_map") != std::string::npos) p.tensor.diagonal().add_(1.0);  // around their identity
    }
}

at::Tensor flat_grads(const Transformer& m) {
  std::vector<at::Tensor> g;
  for (const auto& p : m.parameters().all()) g.push_back(p.tensor.grad().reshape({-1}).to(at::kDouble));
  return at::cat(g);
}

}  // namespace

TEST(Precision, KindsReachEveryKind) { expect_every_kind(precision_kinds(), "precision_kinds()"); }

TEST(Precision, ComputeDtypeFollowsTrainDtype) {
  Config c = small_config("unused");
  EXPECT_EQ(c.train.dtype, "float32");
  EXPECT_EQ(compute_dtype_of(c.train), at::kFloat);
  c = parse_config(c.to_toml(), "small", {"train.dtype=bfloat16"});
  EXPECT_EQ(compute_dtype_of(c.train), at::kBFloat16);
  EXPECT_EQ(parse_config(c.to_toml(), "resolved").train.dtype, "bfloat16");
  expect_error([&] { parse_config(c.to_toml(), "small", {"train.dtype=float16"}); },
               {"train.dtype", "\"float32\", \"bfloat16\""});
  expect_error([&] { Transformer(c.model, c.residual, at::kCPU, 1, at::kFloat, at::kHalf); },
               {"float32, float64 or bfloat16"});
}

// A float32 model given float32 as its compute dtype runs exactly the float32 model: every cast
// is the identity, so loss and gradients are equal bit for bit.
TEST(Precision, Float32ComputeIsBitIdentical) {
  for (const auto& sets : precision_kinds()) {
    SCOPED_TRACE(sets.front() + (sets.size() > 1 ? " " + sets[1] : ""));
    Config c = precision_config(sets, "fused");
    Transformer plain(c.model, c.residual, at::kCPU, 3);
    Transformer explicit_f32(c.model, c.residual, at::kCPU, 3, at::kFloat, at::kFloat);
    randomize_residual(plain, 11);
    randomize_residual(explicit_f32, 11);
    at::Tensor batch = at::randint(c.model.vocab_size, {2, c.model.seq_len + 1}, gen(5));
    at::Tensor a = plain.loss(batch), b = explicit_f32.loss(batch);
    a.backward();
    b.backward();
    EXPECT_EQ(a.scalar_type(), at::kFloat);
    EXPECT_EQ(a.item<float>(), b.item<float>());
    EXPECT_TRUE(at::equal(flat_grads(plain), flat_grads(explicit_f32)));
  }
}

// bfloat16 compute on float32 parameters: the loss is float32, finite and close to the float32
// model's with the same parameters, and every parameter receives a float32 gradient that points
// where the float32 one does.
//
// Tolerance. The bfloat16 model rounds every branch output, the pathway's states and the logits to
// 8 significant bits (u = 2^-8 relative). The loss is a mean over 64 tokens of cross-entropies
// whose gradient in the logits has an L1 norm of at most 2 (softmax − one-hot), so logit errors
// of at most ε move a token's loss by at most 2ε; the logits of this model are of order one, and
// the errors of the roundings between the embedding and the head (2 layers: 4 branches, each with
// its norm, matrix products and the pathway's write, each rounding u relative) compound to a few
// u, and partly cancel over tokens. We allow 4u = 1.6 % of the loss; measured at most 0.13 %
// (printed). The gradients pass the same roundings twice (forward and backward) and sums that
// cancel: we allow 1 − cos < 0.01 between the two gradients (an error of up to 14 % of the
// gradient's norm, as 1 − cos ≈ ε²/2); measured at most 2e-3. (At this size, depth-softmax
// statistics taken in bfloat16 would stay within these bounds too: tried on the references, the
// loss moved by 0.21 % at most. What catches that is the next test, operator by operator.)
TEST(Precision, BFloat16LossAndGradientsTrackFloat32) {
  for (const auto& sets : precision_kinds()) {
    for (const char* impl : {"fused", "reference"}) {
      const std::string what = sets.front() + (sets.size() > 1 ? " " + sets[1] : "") + " " + impl;
      SCOPED_TRACE(what);
      Config c = precision_config(sets, impl);
      Transformer f32(c.model, c.residual, at::kCPU, 3);
      Transformer bf16(c.model, c.residual, at::kCPU, 3, at::kFloat, at::kBFloat16);
      randomize_residual(f32, 11);
      randomize_residual(bf16, 11);
      for (const auto& [name, t] : f32.parameters().named())
        ASSERT_TRUE(at::equal(t, bf16.parameters().get(name))) << name;
      at::Tensor batch = at::randint(c.model.vocab_size, {4, c.model.seq_len + 1}, gen(5));
      at::Tensor ref = f32.loss(batch), loss = bf16.loss(batch);
      ref.backward();
      loss.backward();
      ASSERT_EQ(loss.scalar_type(), at::kFloat);
      const double l = loss.item<double>(), r = ref.item<double>();
      ASSERT_TRUE(std::isfinite(l));
      EXPECT_LT(std::abs(l - r), 4 * kBf16Unit * r) << "bf16 " << l << ", float32 " << r;
      for (const auto& p : bf16.parameters().all()) {
        ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
        EXPECT_EQ(p.tensor.grad().scalar_type(), at::kFloat) << p.name;
        EXPECT_TRUE(p.tensor.grad().isfinite().all().item<bool>()) << p.name;
      }
      at::Tensor g = flat_grads(bf16), g_ref = flat_grads(f32);
      const double cos = (g * g_ref).sum().item<double>() / (g.norm().item<double>() * g_ref.norm().item<double>());
      EXPECT_GT(cos, 0.99);
      std::printf("%-44s loss float32 %.5f bf16 %.5f (%+.3f%%), gradient 1 - cos %.2e\n", what.c_str(), r, l,
                  100 * (l - r) / r, 1 - cos);
    }
  }
}

// The reference compositions keep their softmax statistics in float32 for bfloat16 inputs, as the
// fused kernels do: log-partitions, H_post and the H_res logits come out float32 and the stored
// outputs bfloat16, each equal to the fused operator's within one bfloat16 rounding (both compute
// in float32 from the same inputs; only summation order differs).
TEST(Precision, ReferenceCompositionsComputeInFloat32ForBFloat16) {
  auto g = gen(21);
  auto bf = [&](at::IntArrayRef shape, double scale = 1.0) {
    return (at::randn(shape, g) * scale).to(at::kBFloat16);
  };
  auto near = [](const at::Tensor& a, const at::Tensor& b, double rtol, const char* what) {
    ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
    const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
    const double scale = b.to(at::kDouble).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale) << what;
  };
  const int64_t N = 3, P = 40, d = 32;
  at::Tensor q = bf({2, d}), k = bf({N, P, d}), part = bf({P, d});
  auto [out, lse] = reference::depth_read(q, k.unbind(0), {}, kKeyNormEps);
  auto [f_out, f_lse] = fused::depth_read(q, k.unbind(0), {}, kKeyNormEps);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  near(out, f_out, 2 * kBf16Unit, "depth_read out");
  near(lse, f_lse, 1e-5, "depth_read log-partition");
  near(reference::depth_merge(out[0], lse[0], q[0], part, at::Tensor(), kKeyNormEps),
       fused::depth_merge(f_out[0], f_lse[0], q[0], part, at::Tensor(), kKeyNormEps), 2 * kBf16Unit, "depth_merge");

  at::Tensor h1 = bf({N, P, d}), part1 = bf({P, d}), w = bf({2, 2 * d}, 0.2), b = bf({2}, 0.2);
  fused::DarRead r =
      reference::dar_read(q, k.unbind(0), h1.unbind(0), part, part1, w, b, w, b, {1, 0}, {0, 1}, kKeyNormEps);
  fused::DarRead f = fused::dar_read(q, k.unbind(0), h1.unbind(0), part, part1, w, b, w, b, {1, 0}, {0, 1}, kKeyNormEps);
  EXPECT_EQ(r.h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(r.beta.scalar_type(), at::kBFloat16);
  near(r.h, f.h, 2 * kBf16Unit, "dar_read h");
  near(r.beta, f.beta, 2 * kBf16Unit, "dar_read beta");
  at::Tensor w_rho = bf({1, 2 * d}, 0.2), b_rho = bf({1});
  auto [p0, p1] = reference::dar_write(r.h, r.beta, part, part1, w_rho, b_rho, kKeyNormEps);
  auto [f_p0, f_p1] = fused::dar_write(r.h, r.beta, part, part1, w_rho, b_rho, kKeyNormEps);
  EXPECT_EQ(p0.scalar_type(), at::kBFloat16);
  near(p0, f_p0, 2 * kBf16Unit, "dar_write P0");
  near(p1, f_p1, 2 * kBf16Unit, "dar_write P1");

  const int64_t m = 4, B = 2, T = 20;
  at::Tensor mq = bf({m, d}), src = bf({N, B, T, d}), taps = bf({N, m - 1, d, 5}, 0.3);
  auto [m_out, m_lse] = reference::msar_read(mq, src.unbind(0), taps.unbind(0), kKeyNormEps);
  auto [mf_out, mf_lse] = fused::msar_read(mq, src.unbind(0), taps.unbind(0), kKeyNormEps);
  EXPECT_EQ(m_out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(m_lse.scalar_type(), at::kFloat);
  near(m_out, mf_out, 2 * kBf16Unit, "msar_read out");
  near(m_lse, mf_lse, 1e-5, "msar_read log-partition");

  at::Tensor x = bf({B, T, m, d}), phi = bf({m * m + 2 * m, m * d}, 0.1), bias = bf({m * m + 2 * m}, 0.1),
             scale = bf({3}, 0.1);
  auto [h, post, res] = reference::mhc_pre(x, phi, bias, scale, kKeyNormEps);
  auto [f_h, f_post, f_res] = fused::mhc_pre(x, phi, bias, scale, kKeyNormEps);
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(post.scalar_type(), at::kFloat);
  EXPECT_EQ(res.scalar_type(), at::kFloat);
  near(post, f_post, 1e-5, "mhc_pre H_post");
  near(res, f_res, 1e-5, "mhc_pre H_res logits");
  at::Tensor H = reference::mhc_sinkhorn(res, 20);
  EXPECT_EQ(H.scalar_type(), at::kFloat);
  at::Tensor merged = reference::mhc_merge(x, h, post, H);
  EXPECT_EQ(merged.scalar_type(), at::kBFloat16);
  near(merged, fused::mhc_merge(x, h, post, H), 2 * kBf16Unit, "mhc_merge");
}

TEST(KernelChoice, TheDispatcherSaysWhichDeviceHasAKernel) {
  for (const char* op : {"depth_read", "depth_merge", "dar_read", "dar_write", "msar_read", "msar_fuse", "mhc_pre",
                         "mhc_sinkhorn", "mhc_merge"}) {
    EXPECT_TRUE(has_fused_kernel(op, c10::DeviceType::CPU)) << op;
    EXPECT_FALSE(has_fused_kernel(op, c10::DeviceType::Meta)) << op;
  }
  // ops/cuda/ has kernels of depth_read and depth_merge only, compiled with DEPTHKIT_CUDA.
  for (const char* op : {"dar_read", "dar_write", "msar_read", "msar_fuse", "mhc_pre", "mhc_sinkhorn", "mhc_merge"})
    EXPECT_FALSE(has_fused_kernel(op, c10::DeviceType::CUDA)) << op;
#ifdef DEPTHKIT_WITH_CUDA
  const bool cuda_kernels = true;
#else
  const bool cuda_kernels = false;
#endif
  EXPECT_EQ(has_fused_kernel("depth_read", c10::DeviceType::CUDA), cuda_kernels);
  EXPECT_EQ(has_fused_kernel("depth_merge", c10::DeviceType::CUDA), cuda_kernels);
  EXPECT_FALSE(has_fused_kernel("no_such_op", c10::DeviceType::CPU));
}

TEST(KernelChoice, AMissingKernelRunsTheReferenceAndSaysSoOnce) {
  EXPECT_TRUE(OperatorChoice("fused", c10::DeviceType::CPU, {"mhc_merge"}).fused("mhc_merge"));
  EXPECT_FALSE(OperatorChoice("reference", c10::DeviceType::CPU, {"mhc_merge"}).fused("mhc_merge"));
  ::testing::internal::CaptureStderr();
  OperatorChoice first("fused", c10::DeviceType::CUDA, {"mhc_merge", "mhc_sinkhorn"});
  OperatorChoice second("fused", c10::DeviceType::CUDA, {"mhc_merge"});
  OperatorChoice asked_for_reference("reference", c10::DeviceType::CUDA, {"msar_fuse"});
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(first.fused("mhc_merge"));
  EXPECT_FALSE(first.fused("mhc_sinkhorn"));
  EXPECT_FALSE(second.fused("mhc_merge"));
  const std::string line = "depthkit: mhc_merge has no CUDA kernel; running its reference composition (impl = \"fused\")\n";
  EXPECT_NE(said.find(line), std::string::npos) << said;
  EXPECT_EQ(said.find(line), said.rfind(line)) << "said twice: " << said;
  EXPECT_NE(said.find("mhc_sinkhorn has no CUDA kernel"), std::string::npos) << said;
  EXPECT_EQ(said.find("msar_fuse"), std::string::npos) << "impl = reference asks for no kernel: " << said;
  expect_error([&] { first.fused("dar_read"); }, {"dar_read", "not declared"});
}

// Each pathway asks per operator, for the model's device: on the CPU every operator runs fused;
// on a device without the kernels (the meta device, which has none) every one runs its
// reference composition, silently there because a meta model only counts shapes.
TEST(KernelChoice, PathwaysChooseByTheModelsDevice) {
  const std::map<std::string, std::vector<std::string>> expected = {
      {"residual", {}},
      {"attnres", {"depth_read"}},
      {"attnres_sepv", {"depth_read"}},
      {"dar", {"dar_read", "dar_write", "depth_read"}},
      {"msar", {"msar_block_read", "msar_fuse"}},
      {"mhc", {"mhc_merge", "mhc_pre", "mhc_sinkhorn"}},
      {"attnres_mhc", {"depth_read", "mhc_merge", "mhc_pre", "mhc_sinkhorn"}}};
  for (const auto& kind : pathway_kind_names()) EXPECT_TRUE(expected.count(kind)) << kind << " has no expected operators";
  for (const auto& [kind, ops] : expected) {
    SCOPED_TRACE(kind);
    Config c = parse_config(small_config("unused").to_toml(), "small", {"residual.kind=" + kind});
    Transformer cpu(c.model, c.residual, at::kCPU, 1);
    ::testing::internal::CaptureStderr();
    Transformer meta(c.model, c.residual, at::kMeta, 1);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    std::vector<std::string> names;
    for (const auto& [op, fused] : cpu.pathway().operators()) {
      names.push_back(op);
      EXPECT_TRUE(fused) << op << " on the CPU";
      EXPECT_FALSE(meta.pathway().operators().at(op)) << op << " on the meta device";
    }
    EXPECT_EQ(names, ops);
    c.residual.impl = "reference";
    for (const auto& [op, fused] : Transformer(c.model, c.residual, at::kCPU, 1).pathway().operators())
      EXPECT_FALSE(fused) << op << " with impl = reference";
  }
}

}  // namespace depthkit::test
