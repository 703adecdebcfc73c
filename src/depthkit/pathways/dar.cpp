#include "depthkit/pathways/dar.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/stack.h>

#include <cmath>

#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/ops/dar_ops.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/shared_source.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

// Everything is kept flat, [B·T, d] (P = B·T rows), as the operators take it.
struct DualHistory final : PathwayState {
  std::vector<at::Tensor> h0, h1;  // completed entries H_r⁰, H_r¹: lists, never stacked (dar_ops.h)
  at::Tensor p0, p1;               // the block's partial P^{i−1}; undefined at block start
  at::Tensor beta;                 // β_ℓ of the last read, [B·T, 2], used by its write
  int64_t B = 0, T = 0, d = 0;
  std::unique_ptr<PathwayState> clone() const override { return std::make_unique<DualHistory>(*this); }
  std::vector<StateTensor> tensors() override {
    std::vector<StateTensor> out;
    for (auto* list : {&h0, &h1})
      for (at::Tensor& t : *list) out.push_back({&t, true});
    for (at::Tensor* t : {&p0, &p1, &beta}) out.push_back({t});
    return out;
  }
  at::Tensor flat(const at::Tensor& x) const { return x.reshape({B * T, d}); }
  // A new entry: flat, and a shared source, whose reads add its gradient into one buffer
  // (ops/shared_source.h).
  at::Tensor entry(const at::Tensor& x) const { return fused::shared_source(flat(x)); }
  at::Tensor shaped(const at::Tensor& x) const { return x.view({B, T, d}); }
  at::Tensor stacked(int stream) const { return at::stack(stream == 0 ? h0 : h1).view({-1, B, T, d}); }
};
DualHistory& dual(PathwayState& s) { return static_cast<DualHistory&>(s); }

// The (key, value) streams that output stream j reads under a routing rule (DAR eq. 22).
std::pair<int, int> route(const std::string& routing, int j) {
  if (routing == "self") return {j, j};             // DAR-SelfKV
  if (routing == "cross_value") return {j, 1 - j};  // DAR-CrossV
  if (routing == "fixed") return {0, 1};            // DAR-FixedKV
  return {1 - j, j};                                // DAR: cross-stream key, self-stream value (eq. 10)
}

}  // namespace

Dar::Dar(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params)
    : schedule_{residual.block_sublayers, model.n_branches(), residual.share_within_block}, routing_(residual.routing),
      ops_(residual.impl, params.device().type(), {"dar_read", "dar_write", "depth_read"}),
      branch_(schedule_.branches + 1) {
  const int64_t d = model.d_model;
  // Gate weights: logits of standard deviation kGateLogitStd on the unit-RMS input h̄ (2d features).
  const double gate_std = kGateLogitStd / std::sqrt(2.0 * double(d));
  // A branch's parameters are named after their owner: the branch itself, or the first branch of
  // its block and type when the block shares them (BlockSchedule::owner); owners come first.
  for (int64_t l = 1; l <= schedule_.branches; ++l) {
    const int64_t o = schedule_.owner(l);
    const std::string p = "residual." + std::to_string(o) + ".";
    Branch& b = branch_[o];
    if (o == l) {
      b.q0 = params.add(p + "q0", "residual", {d}, Init::Zeros);
      b.q1 = params.add(p + "q1", "residual", {d}, Init::Zeros);
      b.w_alpha = params.add(p + "alpha.weight", "residual", {2, 2 * d}, Init::Normal, gate_std);
      b.b_alpha = params.add(p + "alpha.bias", "residual", {2}, Init::Zeros);
      b.w_beta = params.add(p + "beta.weight", "residual", {2, 2 * d}, Init::Normal, gate_std);
      b.b_beta = params.add(p + "beta.bias", "residual", {2}, Init::Zeros);
    }
    // The transport gate exists where a partial state does: for a branch that does not open its
    // block (or, shared, for a set one of whose branches does not).
    if (!schedule_.opens(l) && !b.w_rho.defined()) {
      b.w_rho = params.add(p + "rho.weight", "residual", {1, 2 * d}, Init::Zeros);
      b.b_rho = params.add(p + "rho.bias", "residual", {1}, Init::Constant, kRhoBias);
    }
    branch_[l] = b;
  }
  out_q0_ = params.add("residual.out.q0", "residual", {d}, Init::Zeros);
  out_q1_ = params.add("residual.out.q1", "residual", {d}, Init::Zeros);
}

std::unique_ptr<PathwayState> Dar::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<DualHistory>();
  s->B = embedding.size(0), s->T = embedding.size(1), s->d = embedding.size(2);
  s->h0.push_back(s->entry(embedding));  // H_0 = [e, e], an entry of each stream
  s->h1.push_back(s->entry(embedding));
  return s;
}

at::Tensor Dar::read(PathwayState& state, int64_t l) {
  DualHistory& s = dual(state);
  const Branch& b = branch_[l];
  auto [k0, v0] = route(routing_, 0);
  auto [k1, v1] = route(routing_, 1);
  // eq. 10–15: both streams' reads (the partial the last candidate) and the gates.
  // The parameters in the activations' dtype: the operators take one dtype.
  auto read = ops_.fused("dar_read") ? fused::dar_read : reference::dar_read;
  auto in_dtype = [&](const at::Tensor& w) { return cast_like(w, s.h0[0]); };
  fused::DarRead r = read(in_dtype(at::stack({b.q0, b.q1})), s.h0, s.h1, s.p0, s.p1, in_dtype(b.w_alpha),
                          in_dtype(b.b_alpha), in_dtype(b.w_beta), in_dtype(b.b_beta), {k0, k1}, {v0, v1}, kKeyNormEps);
  s.beta = r.beta;
  if (observer_) {
    observe_read(state, l, b.q0, b.q1);
    observer_->on_write_gates(l, r.beta.detach().view({s.B, s.T, 2}));
  }
  return s.shaped(r.h);
}

void Dar::write(PathwayState& state, int64_t l, const at::Tensor& out) {
  DualHistory& s = dual(state);
  const Branch& b = branch_[l];
  // eq. 16–17: P^i = β ⊗ f(h) at block start, M(ρ) P^{i−1} + β ⊗ f(h) after.
  auto write = ops_.fused("dar_write") ? fused::dar_write : reference::dar_write;
  // A branch that opens its block has no transport (a shared set may still hold a gate).
  const bool transport = !schedule_.opens(l);
  std::tie(s.p0, s.p1) = write(s.flat(out), s.beta, s.p0, s.p1, transport ? cast_like(b.w_rho, out) : at::Tensor(),
                               transport ? cast_like(b.b_rho, out) : at::Tensor(), kKeyNormEps);
  if (schedule_.closes(l)) {  // H_b = P^S (eq. 18)
    s.h0.push_back(s.entry(s.p0));
    s.h1.push_back(s.entry(s.p1));
    s.p0 = s.p1 = at::Tensor();
  }
}

at::Tensor Dar::finish(PathwayState& state) {
  DualHistory& s = dual(state);
  if (observer_) observe_read(state, schedule_.branches + 1, out_q0_, out_q1_);
  const std::vector<at::Tensor>* completed[2] = {&s.h0, &s.h1};
  auto read = ops_.fused("depth_read") ? fused::depth_read : reference::depth_read;
  at::Tensor out;  // h_out = h⁰_out + h¹_out: two reads of the completed history
  for (int j = 0; j < 2; ++j) {
    auto [k, v] = route(routing_, j);
    const at::Tensor q = cast_like(j == 0 ? out_q0_ : out_q1_, s.h0[0]);
    at::Tensor o = std::get<0>(read(q.unsqueeze(0), *completed[k], *completed[v], kKeyNormEps))[0];
    out = j == 0 ? o : out + o;
  }
  return s.shaped(out);
}

StageState Dar::stage_out(PathwayState& state, int64_t) {
  DualHistory& s = dual(state);
  StageState out;
  out.width = 2;  // H_r⁰, H_r¹
  for (size_t i = 0; i < s.h0.size(); ++i) {
    out.sources.push_back(s.h0[i]);
    out.sources.push_back(s.h1[i]);
  }
  if (s.p0.defined()) out.carried = {s.p0, s.p1};  // the block's partial P⁰, P¹ (β is the next read's)
  return out;
}

std::unique_ptr<PathwayState> Dar::stage_in(const StageState& in, int64_t, int64_t B, int64_t T) {
  auto s = std::make_unique<DualHistory>();
  s->B = B, s->T = T, s->d = in.sources.at(0).size(-1);
  for (size_t i = 0; i + 1 < in.sources.size(); i += 2) {
    s->h0.push_back(s->entry(in.sources[i]));
    s->h1.push_back(s->entry(in.sources[i + 1]));
  }
  if (!in.carried.empty()) {
    s->p0 = in.carried.at(0);
    s->p1 = in.carried.at(1);
  }
  return s;
}

std::vector<at::Tensor> Dar::stream_states(PathwayState& state) {
  DualHistory& s = dual(state);
  if (s.p0.defined()) return {s.shaped(s.p0), s.shaped(s.p1)};
  return {s.shaped(s.h0.back()), s.shaped(s.h1.back())};
}

void Dar::set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) {
  check_stream_count(states, 2, kind());
  DualHistory& s = dual(state);
  if (s.p0.defined()) {
    s.p0 = s.flat(states[0]);
    s.p1 = s.flat(states[1]);
  } else {  // at a block boundary: the entry the following reads take as the newest source
    s.h0.back() = s.entry(states[0]);
    s.h1.back() = s.entry(states[1]);
  }
}

void Dar::observe_read(PathwayState& state, int64_t l, const at::Tensor& q0, const at::Tensor& q1) const {
  DualHistory& s = dual(state);
  const at::Tensor completed[2] = {s.stacked(0), s.stacked(1)};
  const at::Tensor partial[2] = {s.p0.defined() ? s.shaped(s.p0) : s.p0, s.p1.defined() ? s.shaped(s.p1) : s.p1};
  for (int j = 0; j < 2; ++j) {
    const int k = route(routing_, j).first;  // the weights depend on the keys only
    observer_->on_retrieval(l, j, depth_weights(j == 0 ? q0 : q1, completed[k], partial[k]), s.p0.defined());
  }
}

// ---- Registry entry (registry.h) ----------------------------------------------------------------

PathwayKind dar_pathway_kind() {
  PathwayKind k;
  k.name = "dar";
  k.make = [](const ResidualConfig& r, const ModelConfig& m, ParameterStore& p) { return std::make_unique<Dar>(r, m, p); };
  k.validate = [](const ResidualConfig& r, const std::string& where) {
    if (r.block_sublayers == 1)
      fail(where, ": key 'residual.block_sublayers' = 1 is degenerate for DAR: a one-branch block stores "
           "beta (x) f(h), two collinear streams (DAR eq. 19-20); use 2 (Full DAR, one layer) or more");
  };
  k.analyses = {"maps", "cka", "rescue", "gates"};
  k.streams = 2;
  // eq. 10–18: both streams read, gates α, β on Norm([h⁰; h¹]), the gated write with M(ρ).
  k.flops = [](const CostShape& s, const ResidualConfig&) {
    using namespace cost;
    double f = (s.N + 1) * 2 * kNorm * s.d;  // both streams' key norms, once per entry
    for (int64_t l = 1; l <= int64_t(s.L); ++l) {
      f += 2 * double(s.completed_before(l)) * (kScore + kValue) * s.d;
      f += 2 * kNorm * s.d + 2 * (2 * 2 * s.d) + 3 * s.d;  // Norm([h⁰;h¹]), α and β (2×2d each), α⁰h⁰ + α¹h¹
      f += 2 * s.d;                                        // β ⊗ f
      if (!s.first_in_block(l))
        f += 2 * (kNorm + kScore + kMerge) * s.d            // the partials
             + 2 * kNorm * s.d + 2 * 2 * s.d                // ρ = σ(Norm([P⁰;P¹]) W_ρ + b_ρ)
             + 2 * 3 * s.d + 2 * s.d;                       // M(ρ) P, + β ⊗ f
    }
    return f + 2 * (s.N + 1) * (kScore + kValue) * s.d + s.d;  // two output reads, h⁰ + h¹
  };
  // Both streams' sources once; the merge reads two outputs and two partials.
  k.traffic = [](const CostShape& s) {
    return std::vector<TrafficTerm>{{"phase 1: both streams (amortised)", 2 * s.N / s.S, 2},
                                    {"phase 2: merge and alpha gate", 4, 1},
                                    {"gated write with transport", 3, 2}};
  };
  return k;
}

}  // namespace depthkit
