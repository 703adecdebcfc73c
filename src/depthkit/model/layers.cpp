#include "depthkit/model/layers.h"

#include <ATen/TensorOperators.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/ops/backbone_ops.h"
#include "depthkit/ops/kernel_choice.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/util/error.h"

namespace depthkit {

BackboneOps::BackboneOps(const std::string& impl, c10::DeviceType device) {
  const OperatorChoice choice(impl, device, {"rms_norm", "rope_qkv", "swiglu", "linear_cross_entropy"});
  rms_norm_ = choice.fused("rms_norm");
  rope_qkv_ = choice.fused("rope_qkv");
  swiglu_ = choice.fused("swiglu");
  cross_entropy_ = choice.fused("linear_cross_entropy");
}

at::Tensor BackboneOps::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) const {
  return (rms_norm_ ? fused::rms_norm : reference::rms_norm)(x, cast_like(weight, x), eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> BackboneOps::rope_qkv(const at::Tensor& qkv, const Rope& rope,
                                                                     int64_t n_heads, int64_t n_kv_heads,
                                                                     int64_t offset) const {
  return (rope_qkv_ ? fused::rope_qkv : reference::rope_qkv)(qkv, rope.cos, rope.sin, n_heads, n_kv_heads, offset);
}

at::Tensor BackboneOps::swiglu(const at::Tensor& gate_up) const {
  return (swiglu_ ? fused::swiglu : reference::swiglu)(gate_up);
}

at::Tensor BackboneOps::cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& targets) const {
  return (cross_entropy_ ? fused::linear_cross_entropy : reference::linear_cross_entropy)(hidden, weight, targets);
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

Attention::Attention(const ModelConfig& c, ParameterStore& p, const std::string& prefix)
    : n_heads(c.n_heads),
      n_kv_heads(c.n_kv_heads),
      head_dim(c.resolved_head_dim()),
      eps(c.norm_eps),
      ops(c.impl, p.device().type()) {
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
  auto x = ops.rms_norm(h, norm, eps);
  // One product for q, k and v: x is read once, and the backward's ∂x is one product too.
  auto qkv = at::linear(x, cast_like(at::cat({wq, wk, wv}), x));
  auto [q, k, v] = ops.rope_qkv(qkv, rope, n_heads, n_kv_heads, 0);  // [B, T, heads, hd]
  auto o = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0,
                                            /*is_causal=*/true, std::nullopt, /*enable_gqa=*/n_kv_heads != n_heads);
  return at::linear(o.transpose(1, 2).reshape({B, T, n_heads * head_dim}), cast_like(wo, o));
}

at::Tensor Attention::forward(const at::Tensor& h, const Rope& rope, KvCache& cache, const DecodeChunk& chunk) const {
  const int64_t B = h.size(0), T = h.size(1);
  auto x = ops.rms_norm(h, norm, eps);
  auto qkv = at::linear(x, cast_like(at::cat({wq, wk, wv}), x));
  at::Tensor q;
  if (chunk.aligned) {
    auto [q_all, k, v] = ops.rope_qkv(qkv, rope, n_heads, n_kv_heads, chunk.lengths[0]);
    q = q_all;
    cache.keys.narrow(2, chunk.lengths[0], T).copy_(k.transpose(1, 2));
    cache.values.narrow(2, chunk.lengths[0], T).copy_(v.transpose(1, 2));
  } else {
    // Rows at different positions: each row's real positions rotated from its own offset; the
    // padding's queries stay zero, and its keys never enter the cache.
    q = at::zeros({B, T, n_heads, head_dim}, qkv.options());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = chunk.counts[size_t(b)], at_position = chunk.lengths[size_t(b)];
      if (n == 0) continue;
      auto [qb, kb, vb] = ops.rope_qkv(qkv.narrow(0, b, 1).narrow(1, 0, n), rope, n_heads, n_kv_heads, at_position);
      q.narrow(0, b, 1).narrow(1, 0, n).copy_(qb);
      cache.keys.narrow(0, b, 1).narrow(2, at_position, n).copy_(kb.transpose(1, 2));
      cache.values.narrow(0, b, 1).narrow(2, at_position, n).copy_(vb.transpose(1, 2));
    }
  }
  auto o = at::scaled_dot_product_attention(q.transpose(1, 2), cache.keys.narrow(2, 0, chunk.span),
                                            cache.values.narrow(2, 0, chunk.span), chunk.mask, 0.0,
                                            /*is_causal=*/false, std::nullopt, /*enable_gqa=*/n_kv_heads != n_heads);
  return at::linear(o.transpose(1, 2).reshape({B, T, n_heads * head_dim}), cast_like(wo, o));
}

FeedForward::FeedForward(const ModelConfig& c, ParameterStore& p, const std::string& prefix)
    : eps(c.norm_eps), ops(c.impl, p.device().type()) {
  const int64_t d = c.d_model, f = c.d_ff;
  norm = p.add(prefix + ".norm", "norm", {d}, Init::Ones);
  w_gate = p.add(prefix + ".w_gate", "feed_forward", {f, d}, Init::Normal, c.init_std);
  w_up = p.add(prefix + ".w_up", "feed_forward", {f, d}, Init::Normal, c.init_std);
  w_down = p.add(prefix + ".w_down", "feed_forward", {d, f}, Init::Normal,
                 c.init_std / std::sqrt(2.0 * double(c.n_layers)));
}

at::Tensor FeedForward::forward(const at::Tensor& h) const {
  auto x = ops.rms_norm(h, norm, eps);
  auto gated = ops.swiglu(at::linear(x, cast_like(at::cat({w_gate, w_up}), x)));
  return at::linear(gated, cast_like(w_down, gated));
}

}  // namespace depthkit
