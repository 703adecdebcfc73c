// The fused MSAR operators (ops/msar_ops.h) against their reference compositions of ATen ops
// (reference::msar_read, reference::msar_fuse: expansion by conv1d, key_norm, depth_read,
// merge_partial, H_pre fusion; autograd gives the backward): forward and every gradient, float64 within 1e-10 and float32 within 1e-5 relative,
// on shapes with N = 1, T = 1, T below the largest kernel, odd d, B > 1 (the convolution must not
// leak across batch rows); a finite-difference gradient check in float64; bfloat16; memory that
// does not grow with m·N·T·d (a counting CPU allocator); the Msar pathway with impl = fused equal
// to impl = reference. (Their timing: `depthkit bench --ops`, bench/op_bench.cpp.)
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>

#include "depthkit/nn/parameters.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/msar_ops.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/pathways/pathway.h"
#include "depthkit/util/memory.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

namespace {

// The reference compositions: reference::msar_read and reference::msar_fuse (ops/reference/).
auto read_ref(const at::Tensor& q, const at::Tensor& x, const at::Tensor& conv) {
  return reference::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps);
}
at::Tensor fuse_ref(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& partial,
                    const at::Tensor& pconv, const at::Tensor& w, const at::Tensor& b, const at::Tensor& alpha) {
  return reference::msar_fuse(out, lse, q, partial, pconv, w, b, alpha, kKeyNormEps);
}

// ---- Cases -----------------------------------------------------------------------------------

struct Shape {
  int64_t m, N, B, T, d, K;
};
// N = 1; T = 1; T < K; odd d; B > 1; m = 1 (no conv streams); K = 1.
const Shape kShapes[] = {{1, 1, 1, 1, 1, 1}, {4, 1, 1, 1, 5, 3},  {4, 2, 3, 3, 7, 5},
                         {2, 3, 2, 6, 3, 1}, {3, 5, 3, 9, 8, 4},  {4, 3, 2, 17, 16, 12}};

std::string describe(const Shape& s) { return cat("m ", s.m, " N ", s.N, " B ", s.B, " T ", s.T, " d ", s.d, " K ", s.K); }

// Kernel lengths 1 … K across the m − 1 convolved streams (for m = 4, K = 12: 4, 8, 12, the
// paper's), or none (every one of the K taps is a parameter).
std::optional<std::vector<int64_t>> lengths_of(const Shape& s, bool with_lengths) {
  if (!with_lengths) return std::nullopt;
  std::vector<int64_t> lengths;
  for (int64_t r = 0; r < s.m - 1; ++r) lengths.push_back(1 + (s.K - 1) * (r + 1) / (s.m - 1));
  return lengths;
}
c10::OptionalIntArrayRef view(const std::optional<std::vector<int64_t>>& v) {
  return v ? c10::OptionalIntArrayRef(*v) : std::nullopt;
}

// With kernel lengths, the taps past them are padding: the fused op must neither read them nor give
// them a gradient, however they are set (here random, not zero; the reference masks them).
void expect_padding_without_gradient(const at::Tensor& conv_grad, const std::vector<int64_t>& lengths) {
  ASSERT_TRUE(conv_grad.defined());
  const int64_t K = conv_grad.size(-1);
  for (size_t r = 0; r < lengths.size(); ++r) {
    const at::Tensor padding = conv_grad.select(-3, int64_t(r)).narrow(-1, lengths[r], K - lengths[r]);
    EXPECT_TRUE(padding.numel() == 0 || padding.abs().max().item<double>() == 0.0) << "stream " << r + 1;
  }
}

// context: the sources' first positions are only windows (msar_ops.h); s.T counts all of them.
// queries > 1: msar_block_read of that many queries tensors (one block's branches) against the
// reference's read of each.
void compare_read(const Shape& s, at::ScalarType dtype, double rtol, bool with_lengths = false, int64_t context = 0,
                  int64_t queries = 1) {
  const uint64_t seed = s.m * 1000 + s.N * 100 + s.T * 10 + s.d + 11 * with_lengths + 13 * context + 17 * (queries - 1);
  auto g = generator(seed);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> in = {at::randn({queries, s.m, s.d}, g, opt) * 1.5, at::randn({s.N, s.B, s.T, s.d}, g, opt),
                                at::randn({s.N, s.m - 1, s.d, s.K}, g, opt) * 0.5};
  // A shorter kernel: zero-padded taps (skipped by the kernel where exact; their gradient is not zero).
  if (s.m > 1 && s.K > 2 && !with_lengths) in[2][0][0].narrow(-1, s.K - 2, 2).zero_();
  const auto lengths = lengths_of(s, with_lengths);
  auto read = [&lengths, context](auto op) {
    return [op, &lengths, context](const std::vector<at::Tensor>& t) {
      auto [out, lse] = op(t[0][0], t[1].unbind(0), t[2].unbind(0), kKeyNormEps, view(lengths), context);
      return std::vector<at::Tensor>{out, lse};
    };
  };
  auto block_read = [&lengths, context](auto op) {
    return [op, &lengths, context](const std::vector<at::Tensor>& t) {
      auto [outs, lses] = op(t[0].unbind(0), t[1].unbind(0), t[2].unbind(0), kKeyNormEps, view(lengths), context);
      outs.insert(outs.end(), lses.begin(), lses.end());
      return outs;
    };
  };
  std::vector<std::string> names = {"out", "log-partition"};
  if (queries > 1) {
    names.clear();
    for (const char* what : {"out ", "log-partition "})
      for (int64_t j = 0; j < queries; ++j) names.push_back(cat(what, j));
  }
  Compared c = queries == 1 ? compare(in, read(fused::msar_read), read(reference::msar_read), rtol, names,
                                      {"queries", "sources", "conv"}, seed + 5)
                            : compare(in, block_read(fused::msar_block_read), block_read(reference::msar_block_read),
                                      rtol, names, {"queries", "sources", "conv"}, seed + 5);
  if (lengths && s.m > 1) expect_padding_without_gradient(c.fused_inputs[2].grad(), *lengths);
}

// context: the partial's first positions are only its expansion's window; s.T counts the others.
void compare_fuse(const Shape& s, bool with_partial, bool hpre, at::ScalarType dtype, double rtol,
                  bool with_lengths = false, int64_t context = 0) {
  const uint64_t seed = s.m * 1000 + s.T * 10 + s.d + 7 * with_partial + 3 * hpre + 11 * with_lengths + 13 * context;
  auto g = generator(seed);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> in = {at::randn({s.m, s.B, s.T, s.d}, g, opt), at::randn({s.m, s.B, s.T}, g, opt),
                                at::randn({s.m, s.d}, g, opt) * 1.5, at::randn({s.B, context + s.T, s.d}, g, opt),
                                at::randn({s.m - 1, s.d, s.K}, g, opt) * 0.5, at::randn({s.m, s.m * s.d}, g, opt),
                                at::randn({s.m}, g, opt), at::randn({1}, g, opt) + 1.0};
  if (s.m > 1 && s.K > 2 && !with_lengths) in[4][0].narrow(-1, s.K - 2, 2).zero_();  // a zero-padded shorter kernel
  const auto lengths = lengths_of(s, with_lengths);
  auto fuse = [with_partial, hpre, &lengths, context](auto op) {
    return [=, &lengths](const std::vector<at::Tensor>& t) {
      auto given = [](const at::Tensor& x, bool on) { return on ? x : at::Tensor(); };
      return std::vector<at::Tensor>{op(t[0], t[1], t[2], given(t[3], with_partial), given(t[4], with_partial),
                                        given(t[5], hpre), given(t[6], hpre), given(t[7], hpre), kKeyNormEps,
                                        view(lengths), context)};
    };
  };
  // Absent inputs have no gradient; without a partial, ζ and the queries get none from this op
  // either (the reference does not use them), which is checked below.
  std::vector<size_t> unchecked;
  if (!with_partial) unchecked = {1, 2, 3, 4};
  if (!hpre) unchecked.insert(unchecked.end(), {5, 6, 7});
  Compared c = compare(in, fuse(fused::msar_fuse), fuse(reference::msar_fuse), rtol, {"h"},
                       {"out", "log-partition", "queries", "partial", "partial conv", "W_pre", "b_pre", "alpha_pre"},
                       seed + 5, unchecked);
  // Without a partial, ζ and the queries get no gradient from this op: the fused op returns zeros.
  for (size_t i : {1, 2})
    if (!with_partial) {
      const at::Tensor& grad = c.fused_inputs[i].grad();
      EXPECT_TRUE(!grad.defined() || grad.abs().max().item<double>() == 0.0);
    }
  if (lengths && with_partial && s.m > 1) expect_padding_without_gradient(c.fused_inputs[4].grad(), *lengths);
}

}  // namespace

TEST(FusedMsarRead, EqualsReferenceFloat64) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    compare_read(s, at::kDouble, 1e-10);
  }
}

TEST(FusedMsarRead, EqualsReferenceFloat32) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    compare_read(s, at::kFloat, 1e-5);
  }
}

// A block's reads at once (msar_block_read, 3 branches): each equals the reference's read.
TEST(FusedMsarBlockRead, EqualsReferenceFloat64AndFloat32) {
  for (const Shape& s : kShapes)
    for (bool with_lengths : {false, true}) {
      SCOPED_TRACE(describe(s) + (with_lengths ? " with kernel lengths" : ""));
      compare_read(s, at::kDouble, 1e-10, with_lengths, 0, 3);
      compare_read(s, at::kFloat, 1e-5, with_lengths, 0, 3);
      if (s.T > 1) compare_read(s, at::kDouble, 1e-10, with_lengths, s.T - 1, 3);  // a decoding step's context
    }
}

// Batching the reads changes nothing but the order of the sums over the queries: each query's out,
// ζ and ∂q are those of its own msar_read, bit for bit; ∂x and ∂c, sums over the queries, agree to
// rounding.
TEST(FusedMsarBlockRead, EqualsOneReadPerQuery) {
  const Shape s{4, 3, 2, 37, 16, 12};
  auto g = generator(41);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({2, s.m, s.d}, g, opt) * 1.5, x = at::randn({s.N, s.B, s.T, s.d}, g, opt),
                   c = at::randn({s.N, s.m - 1, s.d, s.K}, g, opt) * 0.5;
  const std::vector<int64_t> lengths = {4, 8, 12};
  auto leaves = [&] {
    return std::vector<at::Tensor>{q.clone().requires_grad_(), x.clone().requires_grad_(), c.clone().requires_grad_()};
  };
  const std::vector<at::Tensor> batched = leaves(), single = leaves();
  auto [outs, lses] = fused::msar_block_read(batched[0].unbind(0), batched[1].unbind(0), batched[2].unbind(0),
                                             kKeyNormEps, lengths);
  std::vector<at::Tensor> one_outs, one_lses;
  for (int64_t j = 0; j < 2; ++j) {
    auto [o, l] = fused::msar_read(single[0][j], single[1].unbind(0), single[2].unbind(0), kKeyNormEps, lengths);
    one_outs.push_back(o);
    one_lses.push_back(l);
  }
  at::Tensor loss_b = at::zeros({}, opt), loss_s = at::zeros({}, opt);
  for (int64_t j = 0; j < 2; ++j) {
    EXPECT_TRUE(outs[j].equal(one_outs[j])) << "out " << j;
    EXPECT_TRUE(lses[j].equal(one_lses[j])) << "log-partition " << j;
    const at::Tensor w = at::randn(outs[j].sizes(), g, opt), v = at::randn(lses[j].sizes(), g, opt);
    loss_b = loss_b + (outs[j] * w).sum() + (lses[j] * v).sum();
    loss_s = loss_s + (one_outs[j] * w).sum() + (one_lses[j] * v).sum();
  }
  loss_b.backward();
  loss_s.backward();
  EXPECT_TRUE(batched[0].grad().equal(single[0].grad())) << "d queries";
  for (size_t i : {1, 2}) EXPECT_TRUE(near(batched[i].grad(), single[i].grad(), 1e-12, i == 1 ? "d sources" : "d conv"));
}

// The kernels' lengths given (the pathway passes them): the padding past them, set to random values
// here, is neither read nor given a gradient, by the fused kernels and the (masking) reference alike.
TEST(FusedMsar, KernelLengthsSkipThePadding) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    compare_read(s, at::kDouble, 1e-10, true);
    compare_read(s, at::kFloat, 1e-5, true);
    for (bool hpre : {false, true}) compare_fuse(s, true, hpre, at::kDouble, 1e-10, true);
  }
  // Zero padding with lengths equals zero padding without: the same outputs, and the same gradient
  // of every tap within the lengths.
  const Shape s{4, 3, 2, 17, 16, 12};
  auto g = generator(3);
  at::Tensor q = at::randn({s.m, s.d}, g, at::kDouble), x = at::randn({s.N, s.B, s.T, s.d}, g, at::kDouble);
  at::Tensor conv = at::randn({s.N, s.m - 1, s.d, s.K}, g, at::kDouble);
  const std::vector<int64_t> lengths = {4, 8, 12};
  for (int64_t r = 0; r < s.m - 1; ++r) conv.select(1, r).narrow(-1, lengths[r], s.K - lengths[r]).zero_();
  at::Tensor grads[2];
  for (int with : {0, 1}) {
    at::Tensor c = conv.clone().requires_grad_();
    auto [out, lse] = fused::msar_read(q, x.unbind(0), c.unbind(0), kKeyNormEps, with ? c10::OptionalIntArrayRef(lengths) : std::nullopt);
    (out.square().sum() + lse.sum()).backward();
    grads[with] = c.grad();
  }
  for (int64_t r = 0; r < s.m - 1; ++r)
    EXPECT_TRUE(near(grads[1].select(1, r).narrow(-1, 0, lengths[r]), grads[0].select(1, r).narrow(-1, 0, lengths[r]),
                     1e-12, "tap gradients within the lengths"));
  expect_error([&] { fused::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps, std::vector<int64_t>{4, 8}); },
               {"msar_read", "kernel_lengths", "m - 1 = 3"});
  expect_error([&] { fused::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps, std::vector<int64_t>{4, 13, 12}); },
               {"msar_read", "kernel_lengths[1] = 13", "K = 12"});
}

TEST(FusedMsarFuse, EqualsReferenceFloat64AndFloat32) {
  for (const Shape& s : kShapes)
    for (bool with_partial : {false, true})
      for (bool hpre : {false, true}) {
        SCOPED_TRACE(cat(describe(s), " partial ", with_partial, " hpre ", hpre));
        compare_fuse(s, with_partial, hpre, at::kDouble, 1e-10);
        compare_fuse(s, with_partial, hpre, at::kFloat, 1e-5);
      }
}

// A context (a decoding step's convolution tails, msar_ops.h): the positions after it are read
// with their whole windows and equal the reference, gradients included (the context's positions
// get theirs through the windows); and they equal the same positions of a read without context.
TEST(FusedMsar, ContextReadsOnlyThePositionsAfterIt) {
  for (const Shape& s : kShapes) {
    if (s.T < 2) continue;
    for (int64_t context : {int64_t(1), s.T - 1, std::min(s.K - 1, s.T - 1)}) {
      if (context < 1) continue;
      SCOPED_TRACE(cat(describe(s), " context ", context));
      compare_read(s, at::kDouble, 1e-10, true, context);
      compare_read(s, at::kFloat, 1e-5, false, context);
      Shape later = s;  // out, ζ and h cover the positions after the context
      later.T = s.T - context;
      for (bool hpre : {false, true}) {
        compare_fuse(later, true, hpre, at::kDouble, 1e-10, true, context);
        compare_fuse(later, true, hpre, at::kFloat, 1e-5, false, context);
      }
    }
  }
  const Shape s{4, 3, 2, 40, 16, 12};  // tiles after a context: one decoding chunk of 29 positions
  auto g = generator(5);
  at::Tensor q = at::randn({s.m, s.d}, g), x = at::randn({s.N, s.B, s.T, s.d}, g);
  at::Tensor conv = at::randn({s.N, s.m - 1, s.d, s.K}, g) * 0.5;
  const std::vector<int64_t> lengths = {4, 8, 12};
  const int64_t context = s.K - 1, later = s.T - context;
  auto [out, lse] = fused::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps, lengths);
  auto [c_out, c_lse] = fused::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps, lengths, context);
  EXPECT_TRUE(near(c_out, out.narrow(2, context, later), 1e-6, "out after the context"));
  EXPECT_TRUE(near(c_lse, lse.narrow(2, context, later), 1e-6, "ζ after the context"));
  at::Tensor w = at::randn({s.m, s.m * s.d}, g), b = at::randn({s.m}, g), a = at::ones({1});
  at::Tensor h = fused::msar_fuse(out, lse, q, x[0], conv[0], w, b, a, kKeyNormEps, lengths);
  at::Tensor c_h = fused::msar_fuse(c_out, c_lse, q, x[0], conv[0], w, b, a, kKeyNormEps, lengths, context);
  EXPECT_TRUE(near(c_h, h.narrow(1, context, later), 1e-6, "h after the context"));
  expect_error([&] { fused::msar_read(q, x.unbind(0), conv.unbind(0), kKeyNormEps, lengths, s.T); },
               {"msar_read", "context = 40", "T = 40"});
  expect_error([&] { fused::msar_fuse(c_out, c_lse, q, x[0], conv[0], w, b, a, kKeyNormEps, lengths, context + 1); },
               {"msar_fuse", "partial", "context = 12"});
  expect_error([&] { fused::msar_fuse(c_out, c_lse, q, at::Tensor(), at::Tensor(), w, b, a, kKeyNormEps, lengths, 2); },
               {"msar_fuse", "context = 2", "with a partial"});
}

TEST(FusedMsar, SplitAcrossThreadsEqualsReference) {
  IntraOpThreads threads(3);
  const Shape s{4, 3, 7, 143, 24, 5};
  for (auto [dtype, rtol] : {std::pair{at::kDouble, 1e-10}, std::pair{at::kFloat, 1e-5}}) {
    compare_read(s, dtype, rtol);
    compare_read(s, dtype, rtol, true, 0, 2);
    for (bool with_partial : {false, true}) compare_fuse(s, with_partial, true, dtype, rtol);
  }
}

// The two ops chained equal one softmax per stream over all N + 1 candidates (eq. 17), fused.
TEST(FusedMsar, ReadThenFuseEqualsOneSoftmaxOverAllCandidates) {
  const Shape s{4, 3, 2, 7, 9, 5};
  auto g = generator(21);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({s.m, s.d}, g, opt), x = at::randn({s.N + 1, s.B, s.T, s.d}, g, opt);
  at::Tensor conv = at::randn({s.N + 1, s.m - 1, s.d, s.K}, g, opt);
  auto [out, lse] = fused::msar_read(q, x.narrow(0, 0, s.N).unbind(0), conv.narrow(0, 0, s.N).unbind(0), kKeyNormEps);
  at::Tensor h = fused::msar_fuse(out, lse, q, x[s.N], conv[s.N], at::Tensor(), at::Tensor(), at::Tensor(), kKeyNormEps);
  auto [all, all_lse] = read_ref(q, x, conv);
  EXPECT_TRUE(near(h, all.mean(0), 1e-10, "merged read vs one softmax"));
}

// Central finite differences in float64 against the hand-written backward of both ops chained.
TEST(FusedMsar, GradcheckFloat64) {
  auto g = generator(11);
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  const int64_t m = 3, N = 2, B = 2, T = 4, d = 3, K = 3;
  std::vector<at::Tensor> inputs = {at::randn({m, d}, g, opt),         at::randn({N, B, T, d}, g, opt),
                                    at::randn({N, m - 1, d, K}, g, opt), at::randn({B, T, d}, g, opt),
                                    at::randn({m - 1, d, K}, g, opt),    at::randn({m, m * d}, g, opt),
                                    at::randn({m}, g, opt),              at::randn({1}, g, opt)};
  at::Tensor w = at::randn({B, T, d}, g, opt), w2 = at::randn({m, B, T, d}, g, opt);
  auto f = [&](const std::vector<at::Tensor>& in) {
    auto [out, lse] = fused::msar_read(in[0], in[1].unbind(0), in[2].unbind(0), kKeyNormEps);
    at::Tensor h = fused::msar_fuse(out, lse, in[0], in[3], in[4], in[5], in[6], in[7], kKeyNormEps);
    return (h * w).sum() + (out * w2).sum() + lse.sum();
  };
  gradcheck(f, inputs);
}

TEST(FusedMsar, BFloat16WithinItsPrecision) {
  auto g = generator(12);
  at::Tensor q = at::randn({4, 64}, g), x = at::randn({3, 2, 16, 64}, g), c = at::randn({3, 3, 64, 12}, g) * 0.3;
  auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  auto back = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); };
  auto [out, lse] = fused::msar_read(bf(q), bf(x).unbind(0), bf(c).unbind(0), kKeyNormEps);
  auto [ref_out, ref_lse] = read_ref(back(q), back(x), back(c));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  EXPECT_TRUE(near(out, ref_out, 1e-2, "bf16 out"));  // one bf16 rounding of the output: 2^-8
  EXPECT_TRUE(near(lse, ref_lse, 1e-5, "bf16 log-partition (float32)"));
  at::Tensor h = fused::msar_fuse(out, lse, bf(q), bf(x[0]), bf(c[0]), at::Tensor(), at::Tensor(), at::Tensor(),
                                  kKeyNormEps);
  at::Tensor ref_h = fuse_ref(out.to(at::kFloat), lse, back(q), back(x[0]), back(c[0]), {}, {}, {});
  EXPECT_TRUE(near(h, ref_h, 1e-2, "bf16 h"));
}

TEST(FusedMsar, BadShapesAreClearErrors) {
  at::Tensor q = at::zeros({3, 4}), x = at::zeros({2, 1, 5, 4});
  expect_error([&] { fused::msar_read(q, x.unbind(0), at::zeros({2, 1, 4, 3}).unbind(0), kKeyNormEps); }, {"msar_read", "conv"});
  expect_error([&] { fused::msar_read(at::zeros({3, 5}), x.unbind(0), at::zeros({2, 2, 5, 3}).unbind(0), kKeyNormEps); },
               {"msar_read", "d = 5"});
  at::Tensor out = at::zeros({3, 1, 5, 4}), lse = at::zeros({3, 1, 5});
  expect_error([&] { fused::msar_fuse(out, lse, q, x[0], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), 1e-6); },
               {"msar_fuse", "together"});
}

// ---- Memory ----------------------------------------------------------------------------------

namespace {

struct MemoryUse {
  int64_t forward_peak, kept, backward_peak;  // bytes beyond the inputs (and the incoming gradient)
};

// Forward of read + fuse (with a partial and H_pre), what stays alive for the backward, and the
// backward's peak, for the fused ops or the reference composition.
MemoryUse measure(bool fused_impl, int64_t m, int64_t N, int64_t B, int64_t T, int64_t d, int64_t K) {
  auto g = generator(3);
  std::vector<at::Tensor> in = {at::randn({m, d}, g),          at::randn({N, B, T, d}, g), at::randn({N, m - 1, d, K}, g),
                                at::randn({B, T, d}, g),       at::randn({m - 1, d, K}, g), at::randn({m, m * d}, g),
                                at::randn({m}, g),             at::randn({1}, g)};
  for (auto& t : in) t.requires_grad_();
  // The sources and banks as the pathway holds them: a list of leaves (each gradient its own).
  std::vector<at::Tensor> sources, banks;
  for (int64_t n = 0; n < N; ++n) {
    sources.push_back(in[1][n].detach().clone().requires_grad_());
    banks.push_back(in[2][n].detach().clone().requires_grad_());
  }
  at::Tensor w = at::randn({B, T, d}, g);
  using A = TensorMemory;  // counts CPU tensor storage (src/depthkit/util/memory.h)
  A::install();
  MemoryUse use{};
  {
    const int64_t base = A::current_bytes();
    A::reset_peak();
    at::Tensor h;
    if (fused_impl) {
      auto [out, lse] = fused::msar_read(in[0], sources, banks, kKeyNormEps);
      h = fused::msar_fuse(out, lse, in[0], in[3], in[4], in[5], in[6], in[7], kKeyNormEps);
    } else {
      auto [out, lse] = read_ref(in[0], in[1], in[2]);
      h = fuse_ref(out, lse, in[0], in[3], in[4], in[5], in[6], in[7]);
    }
    at::Tensor loss = (h * w).sum();
    use.forward_peak = A::peak_bytes() - base;
    use.kept = A::current_bytes() - base;
    A::reset_peak();
    loss.backward();
    use.backward_peak = A::peak_bytes() - base;
  }
  return use;
}

}  // namespace

// The fused ops never hold the expanded streams: their forward peak and what they keep for the
// backward are the outputs (m·B·T·d for phase 1, B·T·d for h) whatever N and the kernel sizes;
// the backward peak adds the gradients (m·B·T·d for ∂out, N·B·T·d for ∂sources) and per-thread
// parameter sums, never m·N·B·T·d. The reference composition holds the expansions, ≥ m·N·B·T·d.
TEST(FusedMsar, MemoryDoesNotGrowWithStreamsTimesSources) {
  const int64_t m = 4, B = 2, T = 512, d = 32, K = 12, unit = B * T * d * int64_t(sizeof(float));
  const int64_t threads = at::get_num_threads();
  for (int64_t N : {2, 8, 16}) {
    SCOPED_TRACE(cat("N ", N));
    MemoryUse f = measure(true, m, N, B, T, d, K), r = measure(false, m, N, B, T, d, K);
    const int64_t params = (threads + 1) * ((N + 1) * (m - 1) * K * d + m * d + m * m * d + m + 1) * 4;
    const int64_t slack = 64 * 1024 + params;
    std::printf("  N %2lld: fused forward peak %6.2f units, kept %6.2f, backward peak %6.2f | reference %7.2f, %7.2f, "
                "%7.2f (unit = B·T·d floats; m·N = %lld)\n",
                (long long)N, double(f.forward_peak) / unit, double(f.kept) / unit, double(f.backward_peak) / unit,
                double(r.forward_peak) / unit, double(r.kept) / unit, double(r.backward_peak) / unit,
                (long long)(m * N));
    EXPECT_LE(f.forward_peak, (m + 3) * unit + slack);        // out, ζ, h, h·w
    EXPECT_LE(f.kept, (m + 2) * unit + slack);                // out, ζ, h
    EXPECT_LE(f.backward_peak, (2 * m + N + 6) * unit + slack);  // + ∂h, ∂out, ∂ζ, ∂partial, ∂sources
    EXPECT_GE(r.forward_peak, m * N * unit);                           // the expansions
    EXPECT_GE(r.kept, m * N * unit);
  }
}

// ---- The pathway -----------------------------------------------------------------------------

namespace {

struct PathRun {
  std::vector<at::Tensor> inputs;
  at::Tensor hidden;
  std::map<std::string, at::Tensor> grads;
  at::Tensor grad_embedding;
};

PathRun drive_msar(const ResidualConfig& r, const ModelConfig& model, at::ScalarType dtype, int64_t B, int64_t T) {
  ParameterStore params(at::kCPU, 3, dtype);
  auto path = make_pathway(r, model, params);
  {
    auto g = generator(8);
    at::NoGradGuard no_grad;
    for (const auto& p : params.all()) p.tensor.copy_(at::randn(p.tensor.sizes(), g).to(dtype) * 0.5);
  }
  auto g = generator(9);
  const auto opt = at::TensorOptions().dtype(dtype);
  at::Tensor e = at::randn({B, T, model.d_model}, g, opt).requires_grad_();
  PathRun run;
  auto state = path->begin(e);
  at::Tensor loss = at::zeros({}, opt);
  for (int64_t l = 1; l <= model.n_branches(); ++l) {
    at::Tensor h = path->read(*state, l);
    run.inputs.push_back(h);
    at::Tensor W = at::randn({model.d_model, model.d_model}, g, opt) * 0.4;
    path->write(*state, l, 0.5 * at::tanh(at::linear(h, W)));
    loss = loss + (h * at::randn(h.sizes(), g, opt)).sum();
  }
  run.hidden = path->finish(*state);
  loss = loss + (run.hidden * at::randn(run.hidden.sizes(), g, opt)).sum();
  loss.backward();
  for (const auto& p : params.all()) run.grads[p.name] = p.tensor.grad().defined() ? p.tensor.grad() : at::zeros_like(p.tensor);
  run.grad_embedding = e.grad();
  return run;
}

}  // namespace

TEST(FusedMsar, PathwayEqualsReference) {
  ModelConfig model;
  model.n_layers = 3;
  model.d_model = 7;
  for (int64_t S : {1, 2})
    for (bool conv : {true, false})
      for (const char* fusion : {"hpre", "mean"})
        for (auto [dtype, rtol] : {std::pair{at::kDouble, 1e-10}, std::pair{at::kFloat, 1e-5}}) {
          SCOPED_TRACE(cat("S ", S, " conv ", conv, " ", fusion, " ", dtype));
          ResidualConfig r;
          r.kind = "msar";
          r.block_sublayers = S;
          r.conv = conv;
          r.fusion = fusion;
          r.kernels = {2, 3, 6};  // T = 5 < 6
          PathRun ref = drive_msar(r, model, dtype, 2, 5);
          r.impl = "fused";
          PathRun fus = drive_msar(r, model, dtype, 2, 5);
          for (size_t l = 0; l < ref.inputs.size(); ++l)
            EXPECT_TRUE(near(fus.inputs[l], ref.inputs[l], rtol, cat("h_", l + 1)));
          EXPECT_TRUE(near(fus.hidden, ref.hidden, rtol, "final hidden"));
          EXPECT_TRUE(near(fus.grad_embedding, ref.grad_embedding, rtol, "d embedding"));
          EXPECT_EQ(fus.grads.size(), ref.grads.size());
          for (const auto& [name, grad] : ref.grads) EXPECT_TRUE(near(fus.grads.at(name), grad, rtol, "d " + name));
        }
}

}  // namespace depthkit::test
