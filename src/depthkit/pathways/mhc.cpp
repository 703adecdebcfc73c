#include "depthkit/pathways/mhc.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/stack.h>

#include "depthkit/model/parameters.h"
#include "depthkit/ops/depth_attention.h"
#include "depthkit/ops/mhc_ops.h"

namespace depthkit {

namespace {
struct Streams final : PathwayState {
  at::Tensor x;                    // [B, T, m, d]
  at::Tensor h_post, h_res;        // of the last read: [B, T, m], [B, T, m, m]
};
Streams& streams(PathwayState& s) { return static_cast<Streams&>(s); }
}  // namespace

at::Tensor sinkhorn(const at::Tensor& positive, int64_t iters) {
  at::Tensor p = positive;
  for (int64_t k = 0; k < iters; ++k) {
    p = p / p.sum(-1, /*keepdim=*/true);  // rows
    p = p / p.sum(-2, /*keepdim=*/true);  // columns (normalised last: exact)
  }
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_pre_reference(const at::Tensor& x, const at::Tensor& phi,
                                                                 const at::Tensor& bias, const at::Tensor& scale) {
  const int64_t m = x.size(-2);
  // α ⊙ (x φ)/rms(x) + b, with α_pre, α_post, α_res spread over their m, m and m² logits.
  at::Tensor alpha = at::cat({scale.narrow(0, 0, 1).expand({m}), scale.narrow(0, 1, 1).expand({m}),
                              scale.narrow(0, 2, 1).expand({m * m})});
  at::Tensor logits = alpha * at::linear(key_norm(x.flatten(-2, -1)), phi) + bias;
  at::Tensor pre = at::sigmoid(logits.narrow(-1, 0, m));      // H_pre
  at::Tensor post = 2.0 * at::sigmoid(logits.narrow(-1, m, m));  // H_post
  std::vector<int64_t> res_shape(x.sizes().begin(), x.sizes().end() - 1);
  res_shape.push_back(m);
  at::Tensor res = logits.narrow(-1, 2 * m, m * m).reshape(res_shape);
  return {(pre.unsqueeze(-1) * x).sum(-2), post, res};  // eq. 4: Σ_i H_pre[i] x_i
}

at::Tensor mhc_sinkhorn_reference(const at::Tensor& res_logits, int64_t iters) {
  // In float32 (or float64 when the model is): exp overflows late, the sums stay exact.
  const auto wide = res_logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor res = res_logits.to(wide);
  res = res - res.amax({-2, -1}, /*keepdim=*/true).detach();  // scale-free: Sinkhorn ignores it
  return sinkhorn(at::exp(res), iters).to(res_logits.scalar_type());
}

at::Tensor mhc_merge_reference(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post,
                               const at::Tensor& h_res) {
  // eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i
  return h_post.unsqueeze(-1) * f.unsqueeze(-2) + at::matmul(h_res.transpose(-1, -2), x);
}

Mhc::Mhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params, const std::string& prefix)
    : m_(residual.streams), iters_(residual.sinkhorn_iters), fused_(residual.impl == "fused"),
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
  if (fused_) {
    auto [h, post, res_logits] = fused::mhc_pre(s.x, b.phi, b.bias, b.scale, kKeyNormEps);
    s.h_post = post;
    s.h_res = fused::mhc_sinkhorn(res_logits, iters_);
    return h;
  }
  auto [h, post, res_logits] = mhc_pre_reference(s.x, b.phi, b.bias, b.scale);
  s.h_post = post;
  s.h_res = mhc_sinkhorn_reference(res_logits, iters_);
  return h;
}

void Mhc::write(PathwayState& state, int64_t, const at::Tensor& out) {
  Streams& s = streams(state);
  s.x = fused_ ? fused::mhc_merge(s.x, out, s.h_post, s.h_res) : mhc_merge_reference(s.x, out, s.h_post, s.h_res);
}

at::Tensor Mhc::finish(PathwayState& state) { return streams(state).x.sum(2); }

std::vector<at::Tensor> Mhc::stream_states(PathwayState& state) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < m_; ++i) out.push_back(streams(state).x.select(2, i));
  return out;
}

void Mhc::set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) {
  check_stream_count(states, size_t(m_), kind());
  streams(state).x = at::stack(states, 2);
}

at::Tensor Mhc::last_h_res(PathwayState& state) { return streams(state).h_res; }

}  // namespace depthkit
