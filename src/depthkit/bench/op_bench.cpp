#include "depthkit/bench/op_bench.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "depthkit/model/layers.h"
#include "depthkit/ops/backbone_ops.h"
#include "depthkit/ops/dar_ops.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/mhc_ops.h"
#include "depthkit/ops/msar_ops.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/registration.h"
#include "depthkit/util/device.h"
#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"

namespace depthkit {

PlainCopy::PlainCopy(at::Tensor source) : src(std::move(source)), dst(at::empty_like(src)) {}

double PlainCopy::time_ms() {
  synchronize(src.device());  // what was queued before is not the copy's time
  const auto t0 = std::chrono::steady_clock::now();
  dst.copy_(src);
  synchronize(src.device());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double PlainCopy::gbs(double ms) const {
  return 2.0 * double(src.element_size()) * double(src.numel()) / (ms * 1e-3) / 1e9;  // read + write
}

GemmRate::GemmRate(int64_t rows, int64_t d, at::TensorOptions options)
    : a(at::randn({rows, d}, options)), b(at::randn({d, d}, options)), out(at::empty({rows, d}, options)) {}

double GemmRate::time_ms() {
  synchronize(a.device());
  const auto t0 = std::chrono::steady_clock::now();
  at::mm_out(out, a, b);
  synchronize(a.device());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double GemmRate::gflops(double ms) const {
  return 2.0 * double(a.size(0)) * double(a.size(1)) * double(b.size(1)) / (ms * 1e-3) / 1e9;
}

namespace {

struct Shape {
  std::string name;
  int64_t N, P, d;  // completed sources, tokens (batch · sequence), width
  int64_t T;        // sequence length (MSAR's convolutions and RoPE's positions run along it): P = B · T
  int64_t heads, kv_heads, head_dim, d_ff, vocab;  // the backbone's operators
  std::string label() const { return cat(name, ": N=", N, " P=", P, " d=", d); }
};

// One operator: a forward + backward of the fused op and of its reference composition, on the
// same inputs (leaves that require grad; their gradients are dropped before each run). Each
// returns the op's outputs, and the backward starts from fixed random cotangents of them, so that
// the time is the op's alone (a loss such as (out · w).sum() would add its own passes over the
// outputs, and their backward, to both sides).
struct Case {
  std::string op;
  std::vector<at::Tensor> leaves;
  std::function<std::vector<at::Tensor>()> fused, reference;  // the outputs
  std::vector<at::Tensor> cotangents;                           // one per output
  double bytes;                                                 // OpTiming::bytes
  // The work of the reference that fusion cannot remove, where there is some (mhc_pre and
  // linear_cross_entropy: their three matrix products, which the fused ops run in ATen as well);
  // timed with the others.
  std::function<void()> irreducible = nullptr;
  double flops = 0;  // OpTiming::flops, where counted
};

// The FLOPs of MSAR's fused operators, forward + backward, as cpu/msar_cpu.cpp runs them
// (multiply-add = 2; Σκ the kernels' lengths summed, the identity stream's none; per token):
// msar_read, per source: forward 2Σκ d (expansions) + m·6d (Σv², q·v, the value sum); backward
// 2Σκ d (the expansions again: they are never stored) + m·13d (Σv², q·v, g·v; ∂v = w g + β q − γ v;
// ∂q) + 4Σκ d (the two transposes, ∂x and ∂c). msar_block_read of S queries tensors: the
// expansions and the transposes once, the m-stream terms S times.
double msar_read_flops(int64_t m, int64_t kernel_sum, int64_t N, int64_t P, int64_t d, int64_t S = 1) {
  return double(N) * double(P) * double(d) * double(2 * kernel_sum + S * 6 * m + 2 * kernel_sum + S * 13 * m + 4 * kernel_sum);
}
// msar_fuse with the partial and H_pre: forward 2Σκ d (the partial's expansions) + m·11d (Σv²,
// q·v; z = λ out + (1 − λ) v; Σz²; h = Σ π z) + 2m²d (y = W_pre z); backward the merge and gates
// again (2Σκ d + m·11d + 2m²d, with g·z in place of h) + m·3d (∂z) + 4m²d (U W_pre, ∂W_pre) + m·11d
// (∂λ with ∂out, ∂v with ∂q) + 4Σκ d (the transposes).
double msar_fuse_flops(int64_t m, int64_t kernel_sum, int64_t P, int64_t d) {
  const int64_t forward = 2 * kernel_sum + 11 * m + 2 * m * m;
  const int64_t backward = 2 * kernel_sum + 11 * m + 2 * m * m + 3 * m + 4 * m * m + 11 * m + 4 * kernel_sum;
  return double(P) * double(d) * double(forward + backward);
}

template <class Fn>
double time_ms(Fn&& fn) {
  auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double run(const Case& c, const std::function<std::vector<at::Tensor>()>& op) {
  for (const auto& t : c.leaves) t.mutable_grad().reset();
  return time_ms([&] { torch::autograd::backward(op(), c.cotangents); });
}

// Every operator's case at shape s, in registration order. Long as a table is long (14 cases of
// about a dozen lines, each in its own scope and sharing only leaf, cotangent and F), not deep:
// a case is read and changed on its own, which one function per family would not make easier.
std::vector<Case> cases(const Shape& s, at::Generator& g) {
  using Outputs = std::vector<at::Tensor>;
  const int64_t N = s.N, P = s.P, d = s.d;
  auto leaf = [&](at::IntArrayRef shape, double scale = 1.0) { return (at::randn(shape, g) * scale).requires_grad_(); };
  auto cotangent = [&](at::IntArrayRef shape) { return at::randn(shape, g); };
  const double F = sizeof(float);  // float32 storage
  std::vector<Case> out;
  {  // AttnRes's completed read: keys = values = the sources, a list of N.
    at::Tensor q = leaf({d}, 0.5);
    std::vector<at::Tensor> src;
    for (int64_t n = 0; n < N; ++n) src.push_back(leaf({P, d}));
    std::vector<at::Tensor> inputs = {q};
    inputs.insert(inputs.end(), src.begin(), src.end());
    auto outputs = [=](auto read) {
      return [=] { return Outputs{std::get<0>(read(q.unsqueeze(0), src, {}, kKeyNormEps))[0]}; };
    };
    out.push_back({"depth_read", inputs, outputs(fused::depth_read), outputs(reference::depth_read),
                   {cotangent({P, d})},
                   // forward: sources in, out; backward: ∂out and sources in, ∂sources out
                   F * (3 * N + 2) * P * d});
  }
  {  // The merge of the block's partial (key = value = the partial sum).
    at::Tensor o = leaf({P, d}), lse = leaf({P}), q = leaf({d}, 0.5), part = leaf({P, d});
    auto outputs = [=](auto merge) {
      return [=] { return Outputs{merge(o, lse, q, part, at::Tensor(), kKeyNormEps)}; };
    };
    out.push_back({"depth_merge", {o, lse, q, part}, outputs(fused::depth_merge), outputs(reference::depth_merge),
                   {cotangent({P, d})},
                   // forward: out, partial in, h; backward: ∂h, out, partial in, ∂out, ∂partial
                   F * 8 * P * d});
  }
  {  // A history of N entries that each of N reads takes (AttnRes's later branches): the entries
     // through depthkit::shared_source, whose reads' backward operators add each entry's gradient
     // into one buffer, against the same entries left to autograd, which sums every read's gradient
     // of every entry.
    static const auto shared = op<at::Tensor(const at::Tensor&)>("depthkit::shared_source");
    at::Tensor q = leaf({N, d}, 0.5);
    std::vector<at::Tensor> src, cotangents;
    for (int64_t n = 0; n < N; ++n) src.push_back(leaf({P, d})), cotangents.push_back(cotangent({P, d}));
    std::vector<at::Tensor> inputs = {q};
    inputs.insert(inputs.end(), src.begin(), src.end());
    auto outputs = [=](bool share) {
      return [=] {
        std::vector<at::Tensor> entries;
        for (const at::Tensor& x : src) entries.push_back(share ? shared.call(x) : x);
        Outputs outs;
        for (int64_t r = 0; r < N; ++r)
          outs.push_back(std::get<0>(fused::depth_read(q[r].unsqueeze(0), entries, {}, kKeyNormEps))[0]);
        return outs;
      };
    };
    out.push_back({"shared_source", inputs, outputs(true), outputs(false), cotangents,
                   // N reads as depth_read's case counts one, and the entries' copies
                   F * N * (3 * N + 2) * P * d + F * 2 * N * P * d});
  }
  {  // DAR's read of both streams (lists of N entries) with the partial and the gates.
    std::vector<at::Tensor> t = {leaf({2, d}, 0.5), leaf({P, d}), leaf({P, d}),       leaf({2, 2 * d}, 0.05),
                                 leaf({2}),         leaf({2, 2 * d}, 0.05),          leaf({2})};
    std::vector<at::Tensor> h0, h1;
    for (int64_t n = 0; n < N; ++n) h0.push_back(leaf({P, d})), h1.push_back(leaf({P, d}));
    auto outputs = [=](auto read) {
      return [=] {
        fused::DarRead r = read(t[0], h0, h1, t[1], t[2], t[3], t[4], t[5], t[6], {1, 0}, {0, 1}, kKeyNormEps);
        return Outputs{r.h, r.beta};
      };
    };
    std::vector<at::Tensor> inputs = t;
    inputs.insert(inputs.end(), h0.begin(), h0.end());
    inputs.insert(inputs.end(), h1.begin(), h1.end());
    out.push_back({"dar_read", inputs, outputs(fused::dar_read), outputs(reference::dar_read),
                   {cotangent({P, d}), cotangent({P, 2})},
                   // forward: both streams' N + 1 candidates in, h; backward: ∂h, the candidates in,
                   // their gradients
                   F * (6 * N + 8) * P * d});
  }
  {  // DAR's gated write with the transport M(ρ).
    std::vector<at::Tensor> t = {leaf({P, d}), (at::rand({P, 2}, g) * 2).requires_grad_(), leaf({P, d}), leaf({P, d}),
                                 leaf({1, 2 * d}, 0.05), leaf({1})};
    auto outputs = [=](auto write) {
      return [=] {
        auto [p0, p1] = write(t[0], t[1], t[2], t[3], t[4], t[5], kKeyNormEps);
        return Outputs{p0, p1};
      };
    };
    out.push_back({"dar_write", t, outputs(fused::dar_write), outputs(reference::dar_write),
                   {cotangent({P, d}), cotangent({P, d})},
                   // forward: f, P⁰, P¹ in, P'⁰, P'¹; backward: ∂P'⁰, ∂P'¹, f, P⁰, P¹ in, ∂f, ∂P⁰, ∂P¹
                   F * 13 * P * d});
  }
  {  // MSAR (m = 4 streams, kernels κ = 4, 8, 12 zero-padded to K = 12 as the pathway passes them):
     // the read of the completed sources, expanded on the fly, and the partial's merge + H_pre fusion.
    const int64_t m = 4, K = 12, B = P / s.T, T = s.T;
    const std::vector<int64_t> lengths = {4, 8, 12};  // passed as the pathway does: the padding is skipped
    const int64_t kernel_sum = 4 + 8 + 12;
    auto bank = [&](int64_t n) {  // [n, m − 1, d, K]: taps past each kernel's length are zero
      at::Tensor c = at::randn({n, m - 1, d, K}, g) * 0.1;
      c.select(1, 0).narrow(-1, 4, K - 4).zero_();
      c.select(1, 1).narrow(-1, 8, K - 8).zero_();
      return c.requires_grad_();
    };
    // The sources and their banks as the lists the pathway passes.
    std::vector<at::Tensor> t = {leaf({m, d}, 0.5)}, sources, banks;
    for (int64_t n = 0; n < N; ++n) {
      sources.push_back(leaf({B, T, d}));
      banks.push_back(bank(1).squeeze(0).detach().requires_grad_());
    }
    t.insert(t.end(), sources.begin(), sources.end());
    t.insert(t.end(), banks.begin(), banks.end());
    auto read = [=](auto op) {
      return [=] {
        auto [o, lse] = op(t[0], sources, banks, kKeyNormEps, lengths, 0);
        return Outputs{o, lse};
      };
    };
    out.push_back({"msar_read", t, read(fused::msar_read), read(reference::msar_read),
                   {cotangent({m, B, T, d}), cotangent({m, B, T})},
                   // forward: sources in, the m streams' out; backward: ∂out, sources in, ∂sources
                   F * (3 * N + 2 * m) * P * d});
    out.back().flops = msar_read_flops(m, kernel_sum, N, P, d);
    // The reads of a block of S = 2 branches (configs' block_sublayers = 2) at once.
    std::vector<at::Tensor> tb = {leaf({m, d}, 0.5), leaf({m, d}, 0.5)};
    tb.insert(tb.end(), t.begin() + 1, t.end());
    auto block_read = [=](auto op) {
      return [=] {
        auto [o, lse] = op({tb[0], tb[1]}, sources, banks, kKeyNormEps, lengths, 0);
        return Outputs{o[0], o[1], lse[0], lse[1]};
      };
    };
    out.push_back({"msar_block_read", tb, block_read(fused::msar_block_read), block_read(reference::msar_block_read),
                   {cotangent({m, B, T, d}), cotangent({m, B, T, d}), cotangent({m, B, T}), cotangent({m, B, T})},
                   // forward: sources in, 2 × the m streams' out; backward: 2 × ∂out, sources in, ∂sources
                   F * (3 * N + 4 * m) * P * d});
    out.back().flops = msar_read_flops(m, kernel_sum, N, P, d, 2);
    std::vector<at::Tensor> u = {leaf({m, B, T, d}), leaf({m, B, T}), leaf({m, d}, 0.5), leaf({B, T, d}),
                                 bank(1).squeeze(0).detach().requires_grad_(), leaf({m, m * d}, 0.02), leaf({m}),
                                 leaf({1}, 0.5)};
    auto fuse = [=](auto op) {
      return [=] { return Outputs{op(u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], kKeyNormEps, lengths, 0)}; };
    };
    out.push_back({"msar_fuse", u, fuse(fused::msar_fuse), fuse(reference::msar_fuse), {cotangent({B, T, d})},
                   // forward: out (m streams), partial in, h; backward: ∂h, out, partial in, ∂out, ∂partial
                   F * (3 * m + 5) * P * d});
    out.back().flops = msar_fuse_flops(m, kernel_sum, P, d);
  }
  {  // mHC (m = 4 streams): the pre-mix, Sinkhorn–Knopp (20 rounds) and the post + res merge.
    const int64_t m = 4, n = m * m + 2 * m;
    std::vector<at::Tensor> t = {leaf({P, m, d}), leaf({n, m * d}, 0.02), leaf({n}), leaf({3}, 0.5)};
    auto pre = [=](auto op) {
      return [=] {
        auto [h, post, res] = op(t[0], t[1], t[2], t[3], kKeyNormEps);
        return Outputs{h, post, res};
      };
    };
    out.push_back({"mhc_pre", t, pre(fused::mhc_pre), pre(reference::mhc_pre),
                   {cotangent({P, d}), cotangent({P, m}), cotangent({P, m, m})},
                   // forward: x in, h; backward: ∂h, x in, ∂x (the n-wide logits are small)
                   F * (3 * m + 2) * P * d,
                   // u = x φᵀ, and its backward ∂x = ∂u φ and ∂φ = ∂uᵀ x
                   [X = t[0].detach().view({P, m * d}), phi = t[1].detach(), du = cotangent({P, n})] {
                     at::Tensor u = at::mm(X, phi.t()), dx = at::mm(du, phi), dphi = at::mm(du.t(), X);
                   }});
    at::Tensor logits = leaf({P, m, m});
    auto sinkhorn = [=](auto op) { return [=] { return Outputs{op(logits, 20)}; }; };
    out.push_back({"mhc_sinkhorn", {logits}, sinkhorn(fused::mhc_sinkhorn), sinkhorn(reference::mhc_sinkhorn),
                   {cotangent({P, m, m})},
                   F * 5 * P * m * m});  // forward: logits in, H out; backward: ∂H, logits in, ∂logits
    std::vector<at::Tensor> u = {leaf({P, m, d}), leaf({P, d}), leaf({P, m}), leaf({P, m, m})};
    auto merge = [=](auto op) { return [=] { return Outputs{op(u[0], u[1], u[2], u[3])}; }; };
    out.push_back({"mhc_merge", u, merge(fused::mhc_merge), merge(reference::mhc_merge), {cotangent({P, m, d})},
                   // forward: x, f in, x'; backward: ∂x', x, f in, ∂x, ∂f
                   F * (5 * m + 3) * P * d});
  }
  {  // The backbone's operators at the layer's widths: the RMSNorm before each sublayer, RoPE on
     // the fused q/k/v projection, SwiGLU on the fused gate/up projection, the LM head's loss.
    at::Tensor x = leaf({P, d}), w = (at::rand({d}, g) + 0.5).requires_grad_();
    auto norm = [=](auto op) { return [=] { return Outputs{op(x, w, 1e-5)}; }; };
    out.push_back({"rms_norm", {x, w}, norm(fused::rms_norm), norm(reference::rms_norm), {cotangent({P, d})},
                   F * 5 * P * d});  // forward: x in, y out; backward: ∂y, x in, ∂x out (r, w: a row each)
    const int64_t H = s.heads, KV = s.kv_heads, hd = s.head_dim, C = (H + 2 * KV) * hd, B = P / s.T;
    const Rope rope(hd, s.T, 10000.0, at::kCPU);
    at::Tensor qkv = leaf({B, s.T, C});
    auto rotate = [=, cos = rope.cos, sin = rope.sin](auto op) {
      return [=] {
        auto [q, k, v] = op(qkv, cos, sin, H, KV, 0);
        return Outputs{q, k, v};
      };
    };
    out.push_back({"rope_qkv", {qkv}, rotate(fused::rope_qkv), rotate(reference::rope_qkv),
                   {cotangent({B, s.T, H, hd}), cotangent({B, s.T, KV, hd}), cotangent({B, s.T, KV, hd})},
                   F * 4 * P * C});  // forward: qkv in, q, k, v out; backward: ∂q, ∂k, ∂v in, ∂qkv out
    at::Tensor gate_up = leaf({P, 2 * s.d_ff});
    auto swiglu = [=](auto op) { return [=] { return Outputs{op(gate_up)}; }; };
    out.push_back({"swiglu", {gate_up}, swiglu(fused::swiglu), swiglu(reference::swiglu), {cotangent({P, s.d_ff})},
                   // forward: gate_up in, out; backward: ∂out, gate_up in, ∂gate_up out
                   F * 8 * P * s.d_ff});
    const int64_t V = s.vocab;
    at::Tensor hidden = leaf({P, d}), head = leaf({V, d}, 0.05);
    const at::Tensor targets = at::randint(V, {P}, g, at::TensorOptions().dtype(at::kLong));
    auto loss = [=](auto op) { return [=] { return Outputs{op(hidden, head, targets)}; }; };
    out.push_back({"linear_cross_entropy", {hidden, head}, loss(fused::linear_cross_entropy),
                   loss(reference::linear_cross_entropy), {cotangent({})},
                   F * 2 * (P + V) * d,  // forward: hidden, W in; backward: ∂hidden, ∂W out
                   // the logits' product and the two of the gradient, which both run
                   [h = hidden.detach(), W = head.detach(), dz = cotangent({P, V})] {
                     at::Tensor z = at::mm(h, W.t()), dh = at::mm(dz, W), dw = at::mm(dz.t(), h);
                   }});
  }
  return out;
}

// The fused completed read's forward against a plain copy of its sources, interleaved.
ReadBandwidth bandwidth(const Shape& s, at::Generator& g, int64_t repeats) {
  at::Tensor q = at::randn({1, s.d}, g), src = at::randn({s.N, s.P, s.d});
  const std::vector<at::Tensor> sources = src.unbind(0);  // the list the read takes, in one block for the copy
  PlainCopy copy(src);
  std::vector<double> read_ms, copy_ms;
  for (int64_t i = 0; i <= repeats; ++i) {
    const double r = time_ms([&] { fused::depth_read(q, sources, {}, kKeyNormEps); });
    const double c = copy.time_ms();
    if (i > 0) {  // the first is a warm-up
      read_ms.push_back(r);
      copy_ms.push_back(c);
    }
  }
  ReadBandwidth b;
  b.shape = s.label();
  const double elem = double(src.element_size());
  b.bytes = elem * (double(s.N) * s.P * s.d + double(s.P) * s.d) + 4.0 * s.P;  // sources, output, ζ
  b.fused_ms = median(read_ms);
  b.copy_gbs = copy.gbs(median(copy_ms));
  return b;
}

}  // namespace

std::vector<std::string> bench_op_names() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(0);
  std::vector<std::string> names;
  for (const Case& c : cases({"names", 1, 2, 2, 2, 1, 1, 2, 1, 2}, g)) names.push_back(c.op);  // the least shape
  return names;
}

OpBenchReport bench_ops(const std::string& shapes, int64_t repeats) {
  std::vector<Shape> all;
  // configs/tiny.toml, its last block; configs/paper/dense-0.1b.toml at T = 4096, but with
  // configs/bench/wide.toml's vocabulary (4,096): at the 0.1B model's 65,536 the linear
  // cross-entropy's reference alone takes seconds a repeat on a CPU.
  if (shapes == "tiny" || shapes == "all") all.push_back({"tiny", 5, 16 * 256, 128, 256, 4, 2, 32, 384, 4096});
  if (shapes == "0.1b" || shapes == "all") all.push_back({"0.1b", 9, 4096, 640, 4096, 10, 5, 64, 2560, 4096});
  if (all.empty()) fail("bench --ops: shapes must be tiny, 0.1b or all, got \"", shapes, "\"");
  auto g = at::make_generator<at::CPUGeneratorImpl>(0);
  OpBenchReport report;
  for (const Shape& s : all) {
    GemmRate gemm(s.P, s.d, at::TensorOptions(at::kFloat));  // the FLOP floor's rate, at the layer's shape
    for (const Case& c : cases(s, g)) {
      std::vector<double> fused_ms, reference_ms, irreducible_ms, gemm_ms;
      for (int64_t i = 0; i <= repeats; ++i) {  // interleaved; the first round is a warm-up
        const double f = run(c, c.fused), r = run(c, c.reference);
        const double k = c.irreducible ? time_ms(c.irreducible) : 0.0;
        const double m = c.flops > 0 ? gemm.time_ms() : 0.0;
        if (i > 0) {
          fused_ms.push_back(f);
          reference_ms.push_back(r);
          irreducible_ms.push_back(k);
          gemm_ms.push_back(m);
        }
      }
      report.ops.push_back({c.op, s.label(), median(reference_ms), median(fused_ms), c.bytes, median(irreducible_ms)});
      if (c.flops > 0) {
        report.ops.back().flops = c.flops;
        // the fastest of the rounds: a rate the machine reaches (a slower round is another
        // process's interference, not the floor)
        report.ops.back().gemm_gflops = gemm.gflops(*std::min_element(gemm_ms.begin(), gemm_ms.end()));
      }
    }
    report.bandwidth.push_back(bandwidth(s, g, repeats));
    for (OpTiming& o : report.ops)
      if (o.shape == s.label()) o.copy_gbs = report.bandwidth.back().copy_gbs;
  }
  return report;
}

}  // namespace depthkit
