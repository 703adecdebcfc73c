// DAR's fused read and write operators (ops/dar_ops.h) against the reference compositions of
// ATen ops with the same signatures (ops/reference/dar.cpp, autograd for the backward): forward and
// every gradient in float64 (1e-10) and float32 (1e-5), every routing, with and without the
// partial; a finite-difference gradient check in float64. The whole pathway is compared with the
// equations in test_pathways.cpp (Dar.EqualsTheEquations runs both implementations).
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>

#include "depthkit/ops/dar_ops.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

namespace {

// Inputs of one read: q, h0, h1, [p0, p1], w_α, b_α, w_β, b_β.
struct ReadInputs {
  std::vector<at::Tensor> t;
  bool partial;
};

ReadInputs random_read(int64_t N, int64_t P, int64_t d, bool partial, at::ScalarType dtype, uint64_t seed) {
  auto g = generator(seed);
  const auto o = at::TensorOptions().dtype(dtype);
  ReadInputs in{{at::randn({2, d}, g, o) * 1.5, at::randn({N, P, d}, g, o), at::randn({N, P, d}, g, o)}, partial};
  if (partial) {
    in.t.push_back(at::randn({P, d}, g, o));
    in.t.push_back(at::randn({P, d}, g, o));
  }
  for (int k = 0; k < 2; ++k) {
    in.t.push_back(at::randn({2, 2 * d}, g, o) * 0.7);
    in.t.push_back(at::randn({2}, g, o));
  }
  return in;
}

std::pair<at::Tensor, at::Tensor> fused_read(const std::vector<at::Tensor>& t, bool partial, std::array<int64_t, 2> key,
                                             std::array<int64_t, 2> value) {
  const size_t w = partial ? 5 : 3;
  fused::DarRead r = fused::dar_read(t[0], t[1].unbind(0), t[2].unbind(0), partial ? t[3] : at::Tensor(),
                                     partial ? t[4] : at::Tensor(), t[w], t[w + 1], t[w + 2], t[w + 3], key, value,
                                     kKeyNormEps);
  return {r.h, r.beta};
}

// The reference in float64 whatever the inputs' dtype, rounded to it at the end: the exact answer
// to hold the fused kernel to. (The float32 composition of ATen ops rounds more than the fused
// kernel: at N 3, P 200, d 24 its largest error in β measured 1.6e-6 of the largest β, the fused
// kernel's 5e-7.)
std::pair<at::Tensor, at::Tensor> reference_read(const std::vector<at::Tensor>& t_, bool partial,
                                                 std::array<int64_t, 2> key, std::array<int64_t, 2> value) {
  std::vector<at::Tensor> t;
  for (const at::Tensor& x : t_) t.push_back(x.to(at::kDouble));
  const size_t w = partial ? 5 : 3;
  fused::DarRead r = reference::dar_read(t[0], t[1].unbind(0), t[2].unbind(0), partial ? t[3] : at::Tensor(),
                                         partial ? t[4] : at::Tensor(), t[w], t[w + 1], t[w + 2], t[w + 3], key, value,
                                         kKeyNormEps);
  return {r.h.to(t_[0].scalar_type()), r.beta.to(t_[0].scalar_type())};
}

using Fn = ScalarFn;

// A scalar loss as the outputs that `compare` (op_checks.h) takes.
OutputsFn outputs(const Fn& loss) {
  return [loss](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{loss(t)}; };
}

// A loss that weighs every output element differently, so every gradient path is exercised. It is
// summed in float64: a float32 sum of a few thousand weighted outputs rounds by more than 1e-5 of
// its (cancelling) total, which would compare the sums' rounding rather than the outputs.
at::Tensor weighted(const at::Tensor& x, uint64_t seed) {
  return (x.to(at::kDouble) * at::randn(x.sizes(), generator(seed), at::TensorOptions().dtype(at::kDouble))).sum();
}

const std::array<std::array<int64_t, 2>, 2> kRoutings[] = {
    {{{1, 0}, {0, 1}}},  // DAR: cross-stream key, self value
    {{{0, 1}, {0, 1}}},  // SelfKV
    {{{0, 1}, {1, 0}}},  // CrossV
    {{{0, 0}, {1, 1}}},  // FixedKV
};

void compare_read(int64_t N, int64_t P, int64_t d, bool partial, at::ScalarType dtype, double rtol) {
  for (const auto& routing : kRoutings) {
    const std::array<int64_t, 2> key = routing[0], value = routing[1];
    SCOPED_TRACE(cat("N ", N, " P ", P, " d ", d, " partial ", partial, " key ", key[0], key[1], " value ", value[0],
                     value[1]));
    ReadInputs in = random_read(N, P, d, partial, dtype, N * 100 + P * 10 + d);
    // h and β element by element, then every input's gradient under random cotangents of both.
    auto outputs_of = [&](auto read) {
      return [&, read](const std::vector<at::Tensor>& t) {
        auto [h, beta] = read(t, partial, key, value);
        return std::vector<at::Tensor>{h, beta};
      };
    };
    compare(in.t, outputs_of(fused_read), outputs_of(reference_read), rtol, {"h", "beta"}, {}, N + P + d);
  }
}

// eq. 16–17: the write, fused and from ATen ops.
std::vector<at::Tensor> random_write(int64_t P, int64_t d, bool transport, at::ScalarType dtype, uint64_t seed) {
  auto g = generator(seed);
  const auto o = at::TensorOptions().dtype(dtype);
  std::vector<at::Tensor> t = {at::randn({P, d}, g, o), at::rand({P, 2}, g, o) * 2};
  if (transport)
    for (auto shape : {std::vector<int64_t>{P, d}, {P, d}, {1, 2 * d}, {1}}) t.push_back(at::randn(shape, g, o));
  return t;
}

at::Tensor fused_write_loss(const std::vector<at::Tensor>& t) {
  const bool transport = t.size() > 2;
  auto [p0, p1] = fused::dar_write(t[0], t[1], transport ? t[2] : at::Tensor(), transport ? t[3] : at::Tensor(),
                                   transport ? t[4] : at::Tensor(), transport ? t[5] : at::Tensor(), kKeyNormEps);
  return weighted(p0, 3) + weighted(p1, 4);
}

at::Tensor reference_write_loss(const std::vector<at::Tensor>& t) {
  const bool transport = t.size() > 2;
  auto [p0, p1] = reference::dar_write(t[0], t[1], transport ? t[2] : at::Tensor(), transport ? t[3] : at::Tensor(),
                                       transport ? t[4] : at::Tensor(), transport ? t[5] : at::Tensor(), kKeyNormEps);
  return weighted(p0, 3) + weighted(p1, 4);
}

}  // namespace

TEST(FusedDar, ReadEqualsReference) {
  for (auto [N, P, d] : {std::tuple{1, 1, 1}, std::tuple{1, 4, 7}, std::tuple{3, 5, 9}, std::tuple{6, 17, 16}})
    for (bool partial : {false, true}) {
      compare_read(N, P, d, partial, at::kDouble, 1e-10);
      compare_read(N, P, d, partial, at::kFloat, 1e-5);
    }
}

TEST(FusedDar, WriteEqualsReference) {
  for (auto [P, d] : {std::tuple{1, 1}, std::tuple{5, 7}, std::tuple{33, 16}})
    for (bool transport : {false, true}) {
      SCOPED_TRACE(cat("P ", P, " d ", d, " transport ", transport));
      compare(random_write(P, d, transport, at::kDouble, P + d), outputs(fused_write_loss),
              outputs(reference_write_loss), 1e-10, {"loss"}, {}, 1);
      compare(random_write(P, d, transport, at::kFloat, P + d), outputs(fused_write_loss),
              outputs(reference_write_loss), 1e-5, {"loss"}, {}, 1);
    }
}

TEST(FusedDar, SplitAcrossThreadsEqualsReference) {
  IntraOpThreads threads(3);
  for (bool partial : {false, true}) {
    compare_read(3, 200, 24, partial, at::kDouble, 1e-10);
    compare_read(3, 200, 24, partial, at::kFloat, 1e-5);
  }
  for (bool transport : {false, true}) {
    compare(random_write(200, 24, transport, at::kDouble, 5), outputs(fused_write_loss),
            outputs(reference_write_loss), 1e-10, {"loss"}, {}, 1);
    compare(random_write(200, 24, transport, at::kFloat, 5), outputs(fused_write_loss),
            outputs(reference_write_loss), 1e-5, {"loss"}, {}, 1);
  }
}

TEST(FusedDar, GradcheckFloat64) {
  for (bool partial : {false, true}) {
    ReadInputs in = random_read(3, 4, 5, partial, at::kDouble, 7);
    gradcheck(
        [&](const std::vector<at::Tensor>& t) {
          auto [h, beta] = fused_read(t, partial, {1, 0}, {0, 1});
          return weighted(h, 5) + weighted(beta, 6);
        },
        in.t);
    gradcheck(fused_write_loss, random_write(4, 5, partial, at::kDouble, 8));
  }
}

TEST(FusedDar, BFloat16WithinItsPrecision) {
  ReadInputs in = random_read(5, 32, 64, true, at::kFloat, 9);
  std::vector<at::Tensor> bf, back;
  for (const auto& x : in.t) {
    bf.push_back(x.to(at::kBFloat16));
    back.push_back(bf.back().to(at::kFloat));
  }
  auto [h, beta] = fused_read(bf, true, {1, 0}, {0, 1});
  auto [ref_h, ref_beta] = reference_read(back, true, {1, 0}, {0, 1});
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(near(h, ref_h, 2e-2, "bf16 h"));  // bf16 output rounding
  EXPECT_TRUE(near(beta, ref_beta, 2e-2, "bf16 beta"));
}

TEST(FusedDar, BadShapesAreClearErrors) {
  ReadInputs in = random_read(2, 3, 4, true, at::kFloat, 10);
  auto t = in.t;
  const std::vector<at::Tensor> h0 = t[1].unbind(0), h1 = t[2].unbind(0);
  expect_error([&] { fused::dar_read(t[0], h0, t[2].narrow(0, 0, 1).unbind(0), t[3], t[4], t[5], t[6], t[7], t[8],
                                     {1, 0}, {0, 1}, kKeyNormEps); },
               {"dar_read", "h0, h1 of N >= 1 entries each, got 2 and 1"});
  expect_error([&] { fused::dar_read(t[0], h0, t[2].narrow(-1, 0, 3).unbind(0), t[3], t[4], t[5], t[6], t[7], t[8],
                                     {1, 0}, {0, 1}, kKeyNormEps); },
               {"dar_read", "completed entry 0", "[3, 3]"});
  expect_error([&] { fused::dar_read(t[0], h0, h1, t[3], at::Tensor(), t[5], t[6], t[7], t[8], {1, 0}, {0, 1},
                                     kKeyNormEps); },
               {"dar_read", "both partial streams"});
  expect_error([&] { fused::dar_read(t[0], h0, h1, t[3], t[4], t[5], t[6], t[7], t[8], {1, 2}, {0, 1},
                                     kKeyNormEps); },
               {"dar_read", "0 or 1, got 2"});
}

}  // namespace depthkit::test
