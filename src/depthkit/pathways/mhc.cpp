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

Mhc::Mhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params, const std::string& prefix)
    : m_(residual.streams), iters_(residual.sinkhorn_iters), branch_(model.n_branches() + 1) {
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
  const int64_t B = s.x.size(0), T = s.x.size(1), m = m_;
  // α ⊙ (x φ)/rms(x) + b, with α_pre, α_post, α_res spread over their m, m and m² logits.
  at::Tensor alpha = at::cat({b.scale.narrow(0, 0, 1).expand({m}), b.scale.narrow(0, 1, 1).expand({m}),
                              b.scale.narrow(0, 2, 1).expand({m * m})});
  at::Tensor logits = alpha * at::linear(key_norm(s.x.reshape({B, T, m * s.x.size(3)})), b.phi) + b.bias;
  at::Tensor pre = at::sigmoid(logits.narrow(-1, 0, m));            // H_pre
  s.h_post = 2.0 * at::sigmoid(logits.narrow(-1, m, m));             // H_post
  // H_res in float32 (or float64 when the model is): exp overflows late, the sums stay exact.
  at::Tensor res = logits.narrow(-1, 2 * m, m * m).reshape({B, T, m, m});
  const auto wide = res.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  res = res.to(wide);
  res = res - res.amax({-2, -1}, /*keepdim=*/true).detach();  // scale-free: Sinkhorn ignores it
  s.h_res = sinkhorn(at::exp(res), iters_).to(logits.scalar_type());
  return (pre.unsqueeze(-1) * s.x).sum(2);  // eq. 4: Σ_i H_pre[i] x_i
}

void Mhc::write(PathwayState& state, int64_t, const at::Tensor& out) {
  Streams& s = streams(state);
  // eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i
  s.x = s.h_post.unsqueeze(-1) * out.unsqueeze(2) + at::matmul(s.h_res.transpose(-1, -2), s.x);
}

at::Tensor Mhc::finish(PathwayState& state) { return streams(state).x.sum(2); }

std::vector<at::Tensor> Mhc::stream_states(PathwayState& state) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < m_; ++i) out.push_back(streams(state).x.select(2, i));
  return out;
}

at::Tensor Mhc::last_h_res(PathwayState& state) { return streams(state).h_res; }

}  // namespace depthkit
