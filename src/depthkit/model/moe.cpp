#include "depthkit/model/moe.h"

#include <ATen/TensorOperators.h>

#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "depthkit/model/layers.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/util/error.h"

namespace depthkit {

MoeFeedForward::MoeFeedForward(const ModelConfig& c, ParameterStore& p, const std::string& prefix,
                               const ExpertPlacement& placement_)
    : moe(c.moe), eps(c.norm_eps), ops(c.impl, p.device().type()), placement(placement_), expert_impl(c.moe.expert_impl) {
  moe_router(moe.router);  // an unknown name is refused here, before any parameter is made
  const int64_t d = c.d_model, E = moe.n_experts, f = moe.expert_d_ff;
  const double out_std = c.init_std / std::sqrt(2.0 * double(c.n_layers));
  norm = p.add(prefix + ".norm", "norm", {d}, Init::Ones);
  router = p.add(prefix + ".router", "router", {E, d}, Init::Normal, c.init_std);
  const Rows held = placement.split() ? Rows{placement.first, placement.count} : Rows{};
  w_gate = p.add(prefix + ".experts.w_gate", "experts", {E, f, d}, Init::Normal, c.init_std, held);
  w_up = p.add(prefix + ".experts.w_up", "experts", {E, f, d}, Init::Normal, c.init_std, held);
  w_down = p.add(prefix + ".experts.w_down", "experts", {E, d, f}, Init::Normal, out_std, held);
  if (moe.n_shared_experts > 0) {
    // The shared experts as one SwiGLU of width n_shared · shared_d_ff: SwiGLU acts on each hidden
    // unit separately, so this is exactly the sum of n_shared separate experts (DeepSeekMoE).
    const int64_t fs = moe.n_shared_experts * moe.resolved_shared_d_ff();
    shared_gate = p.add(prefix + ".shared.w_gate", "feed_forward", {fs, d}, Init::Normal, c.init_std);
    shared_up = p.add(prefix + ".shared.w_up", "feed_forward", {fs, d}, Init::Normal, c.init_std);
    shared_down = p.add(prefix + ".shared.w_down", "feed_forward", {d, fs}, Init::Normal, out_std);
  }
}

Routing MoeFeedForward::route(const at::Tensor& x) const {
  return moe_router(moe.router).route(x.to(router.scalar_type()), router, moe);
}

std::string MoeFeedForward::grouped_unsupported(at::Device device, at::ScalarType t, int64_t d_model,
                                                int64_t expert_d_ff) {
  const std::string dtype = t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16"
                          : t == at::kDouble ? "float64" : std::string(c10::toString(t));
  return grouped_experts_unsupported(c10::DeviceTypeName(device.type(), /*lower_case=*/true), dtype, d_model,
                                     expert_d_ff);
}

bool MoeFeedForward::uses_grouped(const at::Tensor& x) const {
  if (expert_impl == "loop") return false;
  if (expert_impl != "grouped" && expert_impl != "auto")
    fail("key 'moe.expert_impl' must be one of \"auto\", \"grouped\", \"loop\", got \"", expert_impl, "\"");
  const std::string why = grouped_unsupported(x.device(), x.scalar_type(), w_gate.size(2), w_gate.size(1));
  if (expert_impl == "grouped" && !why.empty())
    fail("key 'moe.expert_impl' is \"grouped\", but ", why, "; use \"auto\" or \"loop\"");
  return why.empty();
}

namespace {

// at::_grouped_mm's backward rejects an expanded (zero-stride) incoming gradient: make it dense.
at::Tensor contiguous_grad(at::Tensor t) {
  if (t.requires_grad()) t.register_hook([](const at::Tensor& g) { return g.contiguous(); });
  return t;
}

}  // namespace

at::Tensor MoeFeedForward::run_held_experts(const at::Tensor& xs, const at::Tensor& counts) const {
  const int64_t E = w_gate.size(0);  // the experts held here
  auto wg = cast_like(w_gate, xs), wu = cast_like(w_up, xs), wd = cast_like(w_down, xs);
  if (uses_grouped(xs)) {
    auto offs = at::cumsum(counts, 0).to(at::kInt);
    auto g = contiguous_grad(at::_grouped_mm(xs, wg.transpose(1, 2), offs));
    auto u = contiguous_grad(at::_grouped_mm(xs, wu.transpose(1, 2), offs));
    auto a = at::silu(g) * u;
    return contiguous_grad(at::_grouped_mm(a, wd.transpose(1, 2), offs));
  }
  auto c = counts.cpu();
  // The expert matrices split once: indexing w[e] per expert would give each expert's backward
  // a full-size [E, ...] zero gradient to sum; unbind's backward stacks them once.
  const auto wgs = wg.unbind(0), wus = wu.unbind(0), wds = wd.unbind(0);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = c.data_ptr<int64_t>()[e];
    if (n == 0) continue;
    auto xe = xs.narrow(0, start, n);
    auto a = at::silu(at::mm(xe, wgs[e].t())) * at::mm(xe, wus[e].t());
    parts.push_back(at::mm(a, wds[e].t()));
    start += n;
  }
  return parts.empty() ? xs.narrow(0, 0, 0) : at::cat(parts, 0);
}

at::Tensor MoeFeedForward::forward(const at::Tensor& h, MoeStats* stats) const {
  const int64_t d = h.size(-1), E = moe.n_experts, k = moe.top_k;
  auto x = ops.rms_norm(h, norm, eps).reshape({-1, d});
  const int64_t N = x.size(0);
  Routing r = route(x);

  // Dispatch: the N·k (token, expert) assignments sorted by expert (stable: by token within one).
  auto flat_expert = r.experts.reshape({-1});
  auto order = at::argsort(flat_expert, /*stable=*/true);
  auto token_of = at::floor_divide(order, k);
  auto counts = at::bincount(flat_expert, {}, E);
  auto xs = x.index_select(0, token_of);  // [N·k, d], the sorted copies
  const at::Tensor ys = run_experts_across_ranks(
      xs, counts, placement, [this](const at::Tensor& rows, const at::Tensor& n) { return run_held_experts(rows, n); });
  // Combine: each copy weighted by its gate, added back to its token.
  auto gate_sorted = r.gates.reshape({-1}).index_select(0, order).to(ys.scalar_type());
  auto y = at::zeros({N, d}, ys.options()).index_add(0, token_of, ys * gate_sorted.unsqueeze(1));
  if (shared_gate.defined()) {
    auto a = at::silu(at::linear(x, cast_like(shared_gate, x))) * at::linear(x, cast_like(shared_up, x));
    y = y + at::linear(a, cast_like(shared_down, a));
  }
  if (stats) {
    // Switch load balancing: f_e the share of assignments to expert e (not differentiable),
    // P_e the mean over tokens of the router's distribution (Routing::probs: the softmax for
    // softmax_topk, the normalised sigmoid scores for sigmoid_topk); n_experts · Σ f_e P_e is 1
    // at uniform use. The z-loss (ST-MoE) is taken on the logits whatever the router: it keeps
    // them small (ST-MoE's reason: round-off in the softmax's exponentials; a sigmoid's
    // saturation, where its gradient vanishes, likewise).
    auto f = counts.to(r.probs.scalar_type()) / double(N * k);
    stats->aux_loss = double(E) * (f * r.probs.mean(0)).sum();
    auto lse = at::logsumexp(r.logits, -1);
    stats->z_loss = (lse * lse).mean();
    stats->load = f.detach().to(at::kDouble);
  }
  return y.view(h.sizes());
}

}  // namespace depthkit
