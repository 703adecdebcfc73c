#include "depthkit/pathways/mhc.h"

#include <ATen/ops/stack.h>

#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/ops/mhc_ops.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/pathways/registry.h"

namespace depthkit {

namespace {
struct Streams final : PathwayState {
  at::Tensor x;                    // [B, T, m, d]
  at::Tensor h_post, h_res;        // of the last read: [B, T, m], [B, T, m, m]
  std::unique_ptr<PathwayState> clone() const override { return std::make_unique<Streams>(*this); }
  std::vector<StateTensor> tensors() override { return {{&x}, {&h_post}, {&h_res}}; }
};
Streams& streams(PathwayState& s) { return static_cast<Streams&>(s); }
}  // namespace

Mhc::Mhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params, const std::string& prefix)
    : m_(residual.streams), iters_(residual.sinkhorn_iters),
      ops_(residual.impl, params.device().type(), {"mhc_pre", "mhc_sinkhorn", "mhc_merge"}),
      branch_(model.n_branches() + 1) {
  const int64_t d = model.d_model, n = m_ * m_ + 2 * m_;
  for (int64_t l = 1; l <= model.n_branches(); ++l) {
    const std::string p = prefix + "." + std::to_string(l) + ".";
    branch_[l].phi = params.add(p + "phi", "residual", {n, m_ * d}, Init::Normal, model.init_std);
    branch_[l].bias = params.add(p + "bias", "residual", {n}, Init::Zeros);
    branch_[l].scale = params.add(p + "scale", "residual", {3}, Init::Constant, kGateScale);
  }
}

std::unique_ptr<PathwayState> Mhc::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<Streams>();
  s->x = embedding.unsqueeze(2).expand({-1, -1, m_, -1});  // every stream starts as the embedding
  return s;
}

at::Tensor Mhc::read(PathwayState& state, int64_t l) {
  Streams& s = streams(state);
  const Branch& b = branch_[l];
  auto pre = ops_.fused("mhc_pre") ? fused::mhc_pre : reference::mhc_pre;
  auto sinkhorn = ops_.fused("mhc_sinkhorn") ? fused::mhc_sinkhorn : reference::mhc_sinkhorn;
  // The parameters in the streams' dtype; H_post and the H_res logits come out in float32 (or
  // float64) whatever it is, and Sinkhorn runs in float32 (docs/design.md, "Precision").
  auto [h, post, res_logits] =
      pre(s.x, cast_like(b.phi, s.x), cast_like(b.bias, s.x), cast_like(b.scale, s.x), kKeyNormEps);  // eq. 3–4
  s.h_post = post;
  s.h_res = sinkhorn(res_logits, iters_);
  return h;
}

void Mhc::write(PathwayState& state, int64_t, const at::Tensor& out) {
  Streams& s = streams(state);
  auto merge = ops_.fused("mhc_merge") ? fused::mhc_merge : reference::mhc_merge;
  s.x = merge(s.x, out, s.h_post, s.h_res);  // eq. 5
}

at::Tensor Mhc::finish(PathwayState& state) { return streams(state).x.sum(2); }

std::vector<at::Tensor> Mhc::stream_states(PathwayState& state) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < m_; ++i) out.push_back(streams(state).x.select(2, i));
  return out;
}

// The m streams travel whole (m·d per token): mHC has no single-stream summary to send instead.
StageState Mhc::stage_out(PathwayState& state, int64_t) { return {{}, 1, {streams(state).x.contiguous()}}; }

std::unique_ptr<PathwayState> Mhc::stage_in(const StageState& in, int64_t, int64_t, int64_t) {
  auto s = std::make_unique<Streams>();
  s->x = in.carried.at(0);
  return s;
}

void Mhc::set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) {
  check_stream_count(states, size_t(m_), kind());
  streams(state).x = at::stack(states, 2);
}

at::Tensor Mhc::last_h_res(PathwayState& state) { return streams(state).h_res; }

// ---- Registry entry (registry.h) ----------------------------------------------------------------

PathwayKind mhc_pathway_kind() {
  PathwayKind k;
  k.name = "mhc";
  k.make = [](const ResidualConfig& r, const ModelConfig& m, ParameterStore& p) { return std::make_unique<Mhc>(r, m, p); };
  k.analyses = {"cka", "rescue"};
  k.blocks = false;
  // eq. 3–5: the md × (m² + 2m) projection on the normalised state, Sinkhorn on m × m, the
  // pre-mix, post and res maps.
  k.flops = [](const CostShape& s, const ResidualConfig& r) {
    const double md = s.m * s.d, n = s.m * s.m + 2 * s.m;
    const double per_branch = cost::kNorm * md + 2 * md * n + s.m * s.m * (1 + 4 * double(r.sinkhorn_iters))  // exp, rows/cols
                              + 2 * md + md + 2 * s.m * md + md;  // H_pre x, H_post f, H_res x, + together
    return s.L * per_branch + md;                                 // sum of streams
  };
  k.traffic = [](const CostShape& s) {
    const double m = s.m;
    return std::vector<TrafficTerm>{{"compute mixing coefficients", m, 0},
                                    {"apply H_pre", m, 1},
                                    {"apply H_post", 1, m},
                                    {"apply H_res", m, m},
                                    {"residual merge", 2 * m, m}};
  };
  return k;
}

}  // namespace depthkit
