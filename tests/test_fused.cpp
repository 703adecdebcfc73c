// The fused depth-retrieval operators against their reference compositions (ops/reference/):
// forward and every gradient, float64 within 1e-10 and float32 within 1e-5 relative, on shapes
// including N = 1, P = 1 and odd d; a finite-difference gradient check in float64; bfloat16.
// And every fused operator's outputs and gradients bit for bit the same on 1, 2 and 3 threads, on
// the cases of operator_cases() (operator_cases.h), one per operator, which OperatorChecklist also runs.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>

#include "depthkit/model/layers.h"
#include "depthkit/ops/backbone_ops.h"
#include "depthkit/ops/cpu/depth_read_cpu.h"
#include "depthkit/ops/dar_ops.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/mhc_ops.h"
#include "depthkit/ops/msar_ops.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/registration.h"
#include "depthkit/ops/shared_source.h"
#include "helpers.h"
#include "op_checks.h"
#include "operator_cases.h"

namespace depthkit::test {

namespace {

struct Shape {
  int64_t M, N, P, d;
};
const Shape kShapes[] = {{1, 1, 1, 1}, {1, 1, 5, 7}, {3, 4, 1, 9}, {2, 5, 6, 7}, {4, 9, 33, 16}};

// Reference: reference::depth_read, each target's read composed of ATen ops (autograd gives the backward).
std::tuple<at::Tensor, at::Tensor> reference_read(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return reference::depth_read(q, k.unbind(0), v.unbind(0), kKeyNormEps);
}

void compare_read(const Shape& s, at::ScalarType dtype, double rtol) {
  const uint64_t seed = s.M * 100 + s.N * 10 + s.P;
  auto g = generator(seed);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> in = {at::randn({s.M, s.d}, g, opt) * 1.5, at::randn({s.N, s.P, s.d}, g, opt),
                                at::randn({s.N, s.P, s.d}, g, opt)};
  auto read = [](auto op) {  // the sources as the list the operators take
    return [op](const std::vector<at::Tensor>& t) {
      auto [out, lse] = op(t[0], t[1].unbind(0), t[2].unbind(0), kKeyNormEps);
      return std::vector<at::Tensor>{out, lse};
    };
  };
  compare(in, read(fused::depth_read), read(reference::depth_read), rtol, {"out", "log-partition"},
          {"queries", "keys", "values"}, seed);
}

// Fused: the read then the merge; reference: one softmax over all N + 1 candidates.
void compare_merge(int64_t N, int64_t P, int64_t d, at::ScalarType dtype, double rtol) {
  auto g = generator(P * 10 + d);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> in = {at::randn({d}, g, opt) * 1.5, at::randn({N, P, d}, g, opt),
                                at::randn({N, P, d}, g, opt), at::randn({P, d}, g, opt), at::randn({P, d}, g, opt)};
  auto fused_merge = [](const std::vector<at::Tensor>& t) {
    auto [out, lse] = fused::depth_read(t[0].unsqueeze(0), t[1].unbind(0), t[2].unbind(0), kKeyNormEps);
    return std::vector<at::Tensor>{fused::depth_merge(out[0], lse[0], t[0], t[3], t[4], kKeyNormEps)};
  };
  // The partial as the last source of the list (AttnRes's read): the same softmax.
  auto last_candidate = [](const std::vector<at::Tensor>& t) {
    std::vector<at::Tensor> keys = t[1].unbind(0), values = t[2].unbind(0);
    keys.push_back(t[3]);
    values.push_back(t[4]);
    return std::vector<at::Tensor>{std::get<0>(fused::depth_read(t[0].unsqueeze(0), keys, values, kKeyNormEps))[0]};
  };
  auto one_softmax = [](const std::vector<at::Tensor>& t) {
    return std::vector<at::Tensor>{
        depth_read(t[0], at::cat({t[1], t[3].unsqueeze(0)}), at::cat({t[2], t[4].unsqueeze(0)})).out};
  };
  const std::vector<std::string> names = {"query", "keys", "values", "key_part", "value_part"};
  compare(in, fused_merge, one_softmax, rtol, {"merged"}, names, P * 10 + d + 1);
  compare(in, last_candidate, one_softmax, rtol, {"merged"}, names, P * 10 + d + 2);
}

}  // namespace

TEST(FusedDepthRead, EqualsReferenceFloat64) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(cat("M ", s.M, " N ", s.N, " P ", s.P, " d ", s.d));
    compare_read(s, at::kDouble, 1e-10);
  }
}

TEST(FusedDepthRead, EqualsReferenceFloat32) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(cat("M ", s.M, " N ", s.N, " P ", s.P, " d ", s.d));
    compare_read(s, at::kFloat, 1e-5);
  }
}

// The kernels' at::parallel_for runs on several threads (it is serial unless the kernel files are
// compiled with OpenMP), and a read split across threads (three, so the chunks are uneven) still
// equals the reference.
TEST(FusedKernels, RunOnSeveralThreads) {
  IntraOpThreads threads(3);
  EXPECT_EQ(cpu::kernel_threads(300), 3);
}

TEST(FusedDepthRead, SplitAcrossThreadsEqualsReference) {
  IntraOpThreads threads(3);
  compare_read({2, 3, 200, 24}, at::kDouble, 1e-10);
  compare_read({2, 3, 200, 24}, at::kFloat, 1e-5);
  compare_merge(3, 200, 24, at::kDouble, 1e-10);
  compare_merge(3, 200, 24, at::kFloat, 1e-5);
}

TEST(FusedDepthMerge, EqualsOneSoftmaxOverAllCandidates) {
  for (auto [N, P, d] : {std::tuple{1, 1, 1}, std::tuple{1, 4, 7}, std::tuple{5, 9, 16}}) {
    SCOPED_TRACE(cat("N ", N, " P ", P, " d ", d));
    compare_merge(N, P, d, at::kDouble, 1e-10);
    compare_merge(N, P, d, at::kFloat, 1e-5);
  }
}

// Values left undefined are the keys (AttnRes): one gradient, equal to the sum of both roles'.
TEST(FusedDepthRead, SharedValuesEqualReference) {
  for (auto dtype : {at::kDouble, at::kFloat}) {
    const double rtol = dtype == at::kDouble ? 1e-10 : 1e-5;
    auto g = generator(21);
    const auto opt = at::TensorOptions().dtype(dtype);
    at::Tensor q = (at::randn({2, 9}, g, opt) * 1.5).requires_grad_(), src = at::randn({4, 7, 9}, g, opt).requires_grad_();
    at::Tensor part = at::randn({7, 9}, g, opt).requires_grad_();
    at::Tensor q2 = q.detach().clone().requires_grad_(), src2 = src.detach().clone().requires_grad_(),
               part2 = part.detach().clone().requires_grad_();
    auto [out, lse] = fused::depth_read(q, src.unbind(0), {}, kKeyNormEps);
    at::Tensor h = fused::depth_merge(out[1], lse[1], q[1], part, at::Tensor(), kKeyNormEps);
    auto [ref_out, ref_lse] = reference_read(q2, src2, src2);
    at::Tensor ref_h = depth_read(q2[1], at::cat({src2, part2.unsqueeze(0)}), at::cat({src2, part2.unsqueeze(0)})).out;
    EXPECT_TRUE(near(out, ref_out, rtol, "out"));
    EXPECT_TRUE(near(h, ref_h, rtol, "merged"));
    at::Tensor w = at::randn(out.sizes(), g, opt), wh = at::randn(h.sizes(), g, opt);
    ((out * w).sum() + lse.sum() + (h * wh).sum()).backward();
    ((ref_out * w).sum() + ref_lse.sum() + (ref_h * wh).sum()).backward();
    EXPECT_TRUE(near(q.grad(), q2.grad(), rtol, "d queries"));
    EXPECT_TRUE(near(src.grad(), src2.grad(), rtol, "d sources"));
    EXPECT_TRUE(near(part.grad(), part2.grad(), rtol, "d partial"));
  }
}

// Central finite differences in float64 against the hand-written backward (gradcheck).
TEST(FusedDepthRead, GradcheckFloat64) {
  auto g = generator(11);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({2, 5}, g, opt), k = at::randn({3, 4, 5}, g, opt), v = at::randn({3, 4, 5}, g, opt);
  at::Tensor kp = at::randn({4, 5}, g, opt), vp = at::randn({4, 5}, g, opt);
  at::Tensor w = at::randn({4, 5}, g, opt);
  std::vector<at::Tensor> inputs = {q, k, v, kp, vp};
  auto f = [&](const std::vector<at::Tensor>& in) {
    auto [out, lse] = fused::depth_read(in[0], in[1].unbind(0), in[2].unbind(0), kKeyNormEps);
    at::Tensor h = fused::depth_merge(out[1], lse[1], in[0][1], in[3], in[4], kKeyNormEps);
    auto [shared_out, shared_lse] = fused::depth_read(in[0], in[1].unbind(0), {}, kKeyNormEps);  // values = keys
    at::Tensor shared_h = fused::depth_merge(shared_out[0], shared_lse[0], in[0][0], in[3], at::Tensor(), kKeyNormEps);
    return (h * w).sum() + (out[0] * w).sum() + lse.sum() + (shared_h * w).sum() + (shared_out[1] * w).sum() +
           shared_lse.sum();
  };
  gradcheck(f, inputs);
}

TEST(FusedDepthRead, BFloat16WithinItsPrecision) {
  auto g = generator(12);
  at::Tensor q = at::randn({2, 64}, g), k = at::randn({6, 32, 64}, g), v = at::randn({6, 32, 64}, g);
  auto [out, lse] = fused::depth_read(q.to(at::kBFloat16), k.to(at::kBFloat16).unbind(0), v.to(at::kBFloat16).unbind(0),
                                      kKeyNormEps);
  auto [ref_out, ref_lse] = reference_read(q.to(at::kBFloat16).to(at::kFloat), k.to(at::kBFloat16).to(at::kFloat),
                                           v.to(at::kBFloat16).to(at::kFloat));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(near(out, ref_out, 1e-2, "bf16 out"));  // one bf16 rounding of the output: 2^-8
  EXPECT_TRUE(near(lse, ref_lse, 1e-5, "bf16 log-partition (float32)"));
}

TEST(FusedDepthRead, BadShapesAreClearErrors) {
  at::Tensor q = at::zeros({2, 4});
  const std::vector<at::Tensor> k = at::zeros({3, 5, 4}).unbind(0);
  expect_error([&] { fused::depth_read(q, k, at::zeros({3, 5, 3}).unbind(0), kKeyNormEps); },
               {"depth_read", "key/value 0", "[5, 3]"});
  expect_error([&] { fused::depth_read(q, k, at::zeros({2, 5, 4}).unbind(0), kKeyNormEps); },
               {"depth_read", "3 keys and 2 values"});
  expect_error([&] { fused::depth_read(at::zeros({2, 3}), k, k, kKeyNormEps); }, {"depth_read", "d = 3"});
  expect_error([&] { fused::depth_read(q, {}, {}, kKeyNormEps); }, {"depth_read", "at least one source"});
}

// ---- Shared sources (ops/shared_source.h) -----------------------------------------------------

// A shared source's reads add into one buffer; a plain source, or the second place of a source in
// one call, gets a buffer of the read's own, which autograd then receives.
TEST(SharedSource, TheReadsOfASourceShareOneBuffer) {
  auto g = generator(13);
  const at::Tensor x = at::randn({4, 3}, g).to(at::kDouble).requires_grad_();
  const at::Tensor shared = fused::shared_source(x * 2), plain = x * 3;
  const SourceGradients first = source_gradients({shared, plain, shared}, at::kDouble);
  EXPECT_EQ(first.own, (std::vector<bool>{false, true, true}));
  const SourceGradients second = source_gradients({shared}, at::kDouble);
  EXPECT_FALSE(second.own[0]);
  EXPECT_EQ(second.buffers[0].data_ptr(), first.buffers[0].data_ptr());
  EXPECT_EQ(first.buffers[1].data_ptr() == first.buffers[2].data_ptr(), false);
  const auto handed = first.for_autograd(at::kDouble);
  EXPECT_FALSE(handed[0].defined());
  EXPECT_TRUE(handed[1].defined());
  const at::NoGradGuard no_grad;  // nothing recorded: the tensor itself
  EXPECT_TRUE(fused::shared_source(x).is_same(x));
}

// Every fused read of the history (depth_read with and without values, dar_read, msar_read,
// msar_block_read) gives
// the same gradients whether its sources are shared or plain, in float64: with a source twice in
// one read, the keys' list as the values', another consumer of a source, and a second backward
// over the same graph (retain_graph), after a partial one.
TEST(SharedSource, GradientsEqualAutogradsSums) {
  const int64_t B = 2, T = 5, d = 6, N = 3, P = B * T;
  auto g = generator(29);
  auto leaf = [&](at::IntArrayRef sizes) { return at::randn(sizes, g).to(at::kDouble).requires_grad_(); };
  std::vector<at::Tensor> leaves;
  for (int64_t i = 0; i < 2 * N; ++i) leaves.push_back(leaf({P, d}));
  const at::Tensor q = leaf({2, d}), conv = leaf({N, 1, d, 3}), gates_w = leaf({2, 2 * d}), gates_b = leaf({2});
  auto loss = [&](bool shared) {
    auto source = [&](const at::Tensor& t) { return shared ? fused::shared_source(t) : t; };
    std::vector<at::Tensor> h0, h1, streams;
    for (int64_t i = 0; i < N; ++i) {
      h0.push_back(source(leaves[i] * 1.5));
      h1.push_back(source(leaves[N + i] * 0.5));
      streams.push_back(source(leaves[i].view({B, T, d}) - 1));
    }
    at::Tensor total = (h0[0] * h0[0]).sum();  // a consumer that is no read
    total = total + std::get<0>(fused::depth_read(q, h0, {}, kKeyNormEps)).pow(2).sum();
    total = total + std::get<0>(fused::depth_read(q, h0, h1, kKeyNormEps)).sin().sum();
    total = total + std::get<0>(fused::depth_read(q, h1, h1, kKeyNormEps)).cos().sum();
    total = total + std::get<0>(fused::depth_read(q, {h0[1], h1[2], h0[1]}, {}, kKeyNormEps)).sum();
    fused::DarRead r = fused::dar_read(q, h0, h1, at::Tensor(), at::Tensor(), gates_w, gates_b, gates_w, gates_b,
                                       {1, 0}, {0, 1}, kKeyNormEps);
    total = total + r.h.pow(2).sum() + r.beta.sum();
    const std::vector<at::Tensor> banks = conv.unbind(0);
    total = total + std::get<0>(fused::msar_read(q, streams, banks, kKeyNormEps)).tanh().sum();
    auto [outs, lses] = fused::msar_block_read({q, q * 0.5}, streams, banks, kKeyNormEps);
    total = total + outs[0].sin().sum() + outs[1].cos().sum() + lses[1].sum();
    return total;
  };
  std::vector<at::Tensor> inputs = leaves;
  for (const at::Tensor& t : {q, conv, gates_w, gates_b}) inputs.push_back(t);
  const auto plain = torch::autograd::grad({loss(false)}, inputs);
  const at::Tensor shared_loss = loss(true);
  // A partial backward first (the query alone: the entries' nodes do not run), which must leave
  // no sum behind in them; then two full ones.
  const at::Tensor q_only = torch::autograd::grad({shared_loss}, {q}, {}, /*retain_graph=*/true)[0];
  EXPECT_TRUE(at::allclose(q_only, plain[2 * N], 1e-12, 1e-12));
  for (int pass = 0; pass < 2; ++pass) {
    const auto shared = torch::autograd::grad({shared_loss}, inputs, {}, /*retain_graph=*/pass == 0);
    for (size_t i = 0; i < inputs.size(); ++i)
      EXPECT_TRUE(at::allclose(shared[i], plain[i], 1e-12, 1e-12)) << "input " << i << ", backward " << pass;
  }
}

// ---- Thread count ----------------------------------------------------------------------------

namespace {

using Op = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// The outputs of `op` on leaf copies of `inputs` and, from fixed random cotangents of them, the
// gradient of every input, with `threads` intra-op threads.
std::vector<at::Tensor> outputs_and_gradients(const Op& op, const std::vector<at::Tensor>& inputs, int threads) {
  IntraOpThreads scope(threads);
  std::vector<at::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_());
  std::vector<at::Tensor> outs = op(leaves), cotangents;
  auto g = generator(99);
  for (const auto& o : outs) cotangents.push_back(at::randn(o.sizes(), g, o.options()));
  torch::autograd::backward(outs, cotangents);
  std::vector<at::Tensor> result;
  for (const auto& o : outs) result.push_back(o.detach());
  for (const auto& l : leaves) result.push_back(l.grad());
  return result;
}

// Runs `op` on 1, 2 and 3 threads: outputs and gradients must be equal bit for bit. (Token-summed
// gradients are added per fixed block of tokens, never per thread: kernel_math.h, causal_window.h.)
void expect_thread_independent(const char* name, const Op& op, const std::vector<at::Tensor>& inputs) {
  SCOPED_TRACE(name);
  const std::vector<at::Tensor> one = outputs_and_gradients(op, inputs, 1);
  for (int threads : {2, 3}) {
    const std::vector<at::Tensor> many = outputs_and_gradients(op, inputs, threads);
    ASSERT_EQ(one.size(), many.size());
    for (size_t i = 0; i < one.size(); ++i) {
      ASSERT_TRUE(one[i].defined() && many[i].defined()) << "tensor " << i;
      EXPECT_TRUE(at::equal(one[i], many[i])) << "tensor " << i << " (outputs first, then the inputs' gradients) differs "
                                              << "between 1 and " << threads << " threads: max |diff| "
                                              << (one[i] - many[i]).abs().max().item<double>();
    }
  }
}

}  // namespace

// One case per fused operator (operator_cases.h): shapes large enough that every kernel splits its
// tokens across the threads (≥ 2 blocks of summed tokens; MSAR: ≥ 2 groups of tiles; the linear
// cross-entropy: two chunks of tokens). Each fused side returns the differentiable outputs only.
std::vector<OperatorCase> operator_cases() {
  auto g = generator(31);
  const int64_t N = 4, B = 3, T = 200, P = B * T, d = 40, m = 4, K = 5;
  auto randn = [&](at::IntArrayRef shape, double scale = 1.0) { return at::randn(shape, g) * scale; };
  using Inputs = std::vector<at::Tensor>;
  std::vector<OperatorCase> cases;
  {
    auto read = [](auto op) {
      return [op](const Inputs& t) {
        auto [out, lse] = op(t[0], t[1].unbind(0), t[2].unbind(0), kKeyNormEps);
        return Inputs{out, lse};
      };
    };
    cases.push_back({"depth_read", read(fused::depth_read), read(reference::depth_read),
                     {randn({2, d}), randn({N, P, d}), randn({N, P, d})}});
  }
  {
    auto merge = [](auto op) {
      return [op](const Inputs& t) { return Inputs{op(t[0], t[1], t[2], t[3], t[4], kKeyNormEps)}; };
    };
    cases.push_back({"depth_merge", merge(fused::depth_merge), merge(reference::depth_merge),
                     {randn({P, d}), randn({P}), randn({d}), randn({P, d}), randn({P, d})}});
  }
  {  // A history entry that two reads take, once as key and value, once as key beside another
     // value: through depthkit::shared_source their backward operators add its gradient into one
     // buffer; the reference reads the entry itself and autograd sums.
    static const auto shared = op<at::Tensor(const at::Tensor&)>("depthkit::shared_source");
    auto reads = [](auto entry) {
      return [entry](const Inputs& t) {
        const at::Tensor e = entry(t[1]);
        auto [a, lse_a] = fused::depth_read(t[0], {e, t[2]}, {}, kKeyNormEps);
        auto [b, lse_b] = fused::depth_read(t[0], {t[2], e}, {e, t[2]}, kKeyNormEps);
        return Inputs{a, b};
      };
    };
    cases.push_back({"shared_source", reads([](const at::Tensor& x) { return shared.call(x); }),
                     reads([](const at::Tensor& x) { return x; }), {randn({2, d}), randn({P, d}), randn({P, d})}});
  }
  {
    auto read = [](auto op) {
      return [op](const Inputs& t) {
        fused::DarRead r = op(t[0], t[1].unbind(0), t[2].unbind(0), t[3], t[4], t[5], t[6], t[7], t[8], {1, 0},
                              {0, 1}, kKeyNormEps);
        return Inputs{r.h, r.beta};  // ζ: no gradient (and the reference leaves it undefined)
      };
    };
    cases.push_back({"dar_read", read(fused::dar_read), read(reference::dar_read),
                     {randn({2, d}), randn({N, P, d}), randn({N, P, d}), randn({P, d}), randn({P, d}),
                      randn({2, 2 * d}, 0.1), randn({2}), randn({2, 2 * d}, 0.1), randn({2})}});
  }
  {
    auto write = [](auto op) {
      return [op](const Inputs& t) {
        auto [p0, p1] = op(t[0], t[1], t[2], t[3], t[4], t[5], kKeyNormEps);
        return Inputs{p0, p1};
      };
    };
    cases.push_back({"dar_write", write(fused::dar_write), write(reference::dar_write),
                     {randn({P, d}), at::rand({P, 2}, g) * 2, randn({P, d}), randn({P, d}), randn({1, 2 * d}, 0.1),
                      randn({1})}});
  }
  {
    auto read = [](auto op) {
      return [op](const Inputs& t) {
        auto [out, lse] = op(t[0], t[1].unbind(0), t[2].unbind(0), kKeyNormEps, std::nullopt, 0);
        return Inputs{out, lse};
      };
    };
    cases.push_back({"msar_read", read(fused::msar_read), read(reference::msar_read),
                     {randn({m, d}), randn({N, B, T, d}), randn({N, m - 1, d, K}, 0.5)}});
  }
  {
    auto fuse = [](auto op) {
      return [op](const Inputs& t) {
        return Inputs{op(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], kKeyNormEps, std::nullopt, 0)};
      };
    };
    cases.push_back({"msar_fuse", fuse(fused::msar_fuse), fuse(reference::msar_fuse),
                     {randn({m, B, T, d}), randn({m, B, T}), randn({m, d}), randn({B, T, d}), randn({m - 1, d, K}, 0.5),
                      randn({m, m * d}, 0.05), randn({m}), randn({1})}});
  }
  {
    auto pre = [](auto op) {
      return [op](const Inputs& t) {
        auto [h, post, res] = op(t[0], t[1], t[2], t[3], kKeyNormEps);
        return Inputs{h, post, res};
      };
    };
    cases.push_back({"mhc_pre", pre(fused::mhc_pre), pre(reference::mhc_pre),
                     {randn({P, m, d}), randn({m * m + 2 * m, m * d}, 0.05), randn({m * m + 2 * m}), randn({3}, 0.5)}});
  }
  {
    auto sinkhorn = [](auto op) { return [op](const Inputs& t) { return Inputs{op(t[0], 20)}; }; };
    cases.push_back({"mhc_sinkhorn", sinkhorn(fused::mhc_sinkhorn), sinkhorn(reference::mhc_sinkhorn),
                     {randn({P, m, m})}});
  }
  {
    auto merge = [](auto op) { return [op](const Inputs& t) { return Inputs{op(t[0], t[1], t[2], t[3])}; }; };
    cases.push_back({"mhc_merge", merge(fused::mhc_merge), merge(reference::mhc_merge),
                     {randn({P, m, d}), randn({P, d}), randn({P, m}), randn({P, m, m})}});
  }
  {  // [B, T, d] rows: the weight's gradient sums over all of them in fixed blocks of rows.
    auto norm = [](auto op) { return [op](const Inputs& t) { return Inputs{op(t[0], t[1], 1e-5)}; }; };
    cases.push_back({"rms_norm", norm(fused::rms_norm), norm(reference::rms_norm),
                     {randn({B, T, d}, 2.0), at::rand({d}, g) + 0.5}});
  }
  {  // Grouped-query heads, at an offset into the tables (as decoding reads them).
    const int64_t H = 4, KV = 2, hd = 8, offset = 3;
    const Rope rope(hd, T + offset, 10000.0, at::kCPU);
    auto rotate = [&rope](auto op) {
      return [op, cos = rope.cos, sin = rope.sin](const Inputs& t) {
        auto [q, k, v] = op(t[0], cos, sin, H, KV, offset);
        return Inputs{q, k, v};
      };
    };
    cases.push_back({"rope_qkv", rotate(fused::rope_qkv), rotate(reference::rope_qkv),
                     {randn({B, T, (H + 2 * KV) * hd})}});
  }
  {
    auto swiglu = [](auto op) { return [op](const Inputs& t) { return Inputs{op(t[0])}; }; };
    cases.push_back({"swiglu", swiglu(fused::swiglu), swiglu(reference::swiglu), {randn({B, T, 96}, 4.0)}});
  }
  {  // V = 4,000: two chunks of tokens in float32 (8 MiB of logits each, ops/backbone_ops.cpp).
    const int64_t V = 4000;
    const at::Tensor targets = at::randint(V, {P}, g, at::TensorOptions().dtype(at::kLong));
    auto loss = [&targets](auto op) {
      return [op, targets](const Inputs& t) { return Inputs{op(t[0], t[1], targets)}; };
    };
    cases.push_back({"linear_cross_entropy", loss(fused::linear_cross_entropy), loss(reference::linear_cross_entropy),
                     {randn({P, d}), randn({V, d}, 0.5)}});
  }
  // (Last: a case added before another changes that one's random inputs.)
  {
    auto read = [](auto op) {
      return [op](const Inputs& t) {
        auto [outs, lses] = op(t[0].unbind(0), t[1].unbind(0), t[2].unbind(0), kKeyNormEps, std::nullopt, 0);
        outs.insert(outs.end(), lses.begin(), lses.end());
        return outs;
      };
    };
    cases.push_back({"msar_block_read", read(fused::msar_block_read), read(reference::msar_block_read),
                     {randn({2, m, d}), randn({N, B, T, d}), randn({N, m - 1, d, K}, 0.5)}});
  }
  return cases;
}

// Every fused operator gives the same outputs and gradients, bit for bit, on 1, 2 and 3 threads
// (so a run's numbers do not depend on train.threads).
TEST(FusedKernels, GradientsDoNotDependOnTheThreadCount) {
  for (const OperatorCase& c : operator_cases()) expect_thread_independent(c.op.c_str(), c.fused, c.inputs);
}

}  // namespace depthkit::test
