#include "depthkit/model/layers.h"

#include <ATen/TensorOperators.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>

#include <cmath>

#include "depthkit/model/parameters.h"
#include "depthkit/model/precision.h"
#include "depthkit/util/error.h"

namespace depthkit {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x, {x.size(-1)}, cast_like(weight, x), eps);
}

Rope::Rope(int64_t head_dim, int64_t max_len, double theta, at::Device device) {
  // θ_i = theta^(-2i/hd), computed in float64 then stored in float32.
  Building building(cat("the RoPE tables of model.seq_len ", max_len, " (", max_len * head_dim * 8, " bytes in float64)"));
  auto i = at::arange(head_dim / 2, at::kDouble);
  auto inv_freq = at::exp(i * (-2.0 * std::log(theta) / double(head_dim)));
  auto angles = at::outer(at::arange(max_len, at::kDouble), inv_freq);
  cos = angles.cos().to(at::kFloat).to(device);
  sin = angles.sin().to(at::kFloat).to(device);
}

at::Tensor Rope::apply(const at::Tensor& x, int64_t offset) const {
  const int64_t T = x.size(2), half = x.size(3) / 2;
  auto c = cos.narrow(0, offset, T).to(x.scalar_type());
  auto s = sin.narrow(0, offset, T).to(x.scalar_type());
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
}

Attention::Attention(const ModelConfig& c, ParameterStore& p, const std::string& prefix)
    : n_heads(c.n_heads), n_kv_heads(c.n_kv_heads), head_dim(c.resolved_head_dim()), eps(c.norm_eps) {
  const int64_t d = c.d_model, q = n_heads * head_dim, kv = n_kv_heads * head_dim;
  // Output projections start smaller by 1/sqrt(2·n_layers) so the residual sum's variance
  // does not grow with depth (GPT-2 / Megatron convention).
  const double out_std = c.init_std / std::sqrt(2.0 * double(c.n_layers));
  norm = p.add(prefix + ".norm", "norm", {d}, Init::Ones);
  wq = p.add(prefix + ".wq", "attention", {q, d}, Init::Normal, c.init_std);
  wk = p.add(prefix + ".wk", "attention", {kv, d}, Init::Normal, c.init_std);
  wv = p.add(prefix + ".wv", "attention", {kv, d}, Init::Normal, c.init_std);
  wo = p.add(prefix + ".wo", "attention", {d, q}, Init::Normal, out_std);
}

at::Tensor Attention::forward(const at::Tensor& h, const Rope& rope) const {
  const int64_t B = h.size(0), T = h.size(1);
  auto x = rms_norm(h, norm, eps);
  auto q = at::linear(x, cast_like(wq, x)).view({B, T, n_heads, head_dim}).transpose(1, 2);
  auto k = at::linear(x, cast_like(wk, x)).view({B, T, n_kv_heads, head_dim}).transpose(1, 2);
  auto v = at::linear(x, cast_like(wv, x)).view({B, T, n_kv_heads, head_dim}).transpose(1, 2);
  q = rope.apply(q);
  k = rope.apply(k);
  auto o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                            /*enable_gqa=*/n_kv_heads != n_heads);
  return at::linear(o.transpose(1, 2).reshape({B, T, n_heads * head_dim}), cast_like(wo, o));
}

FeedForward::FeedForward(const ModelConfig& c, ParameterStore& p, const std::string& prefix)
    : eps(c.norm_eps) {
  const int64_t d = c.d_model, f = c.d_ff;
  norm = p.add(prefix + ".norm", "norm", {d}, Init::Ones);
  w_gate = p.add(prefix + ".w_gate", "feed_forward", {f, d}, Init::Normal, c.init_std);
  w_up = p.add(prefix + ".w_up", "feed_forward", {f, d}, Init::Normal, c.init_std);
  w_down = p.add(prefix + ".w_down", "feed_forward", {d, f}, Init::Normal,
                 c.init_std / std::sqrt(2.0 * double(c.n_layers)));
}

at::Tensor FeedForward::forward(const at::Tensor& h) const {
  auto x = rms_norm(h, norm, eps);
  auto gated = at::silu(at::linear(x, cast_like(w_gate, x))) * at::linear(x, cast_like(w_up, x));
  return at::linear(gated, cast_like(w_down, gated));
}

}  // namespace depthkit
