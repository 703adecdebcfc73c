// The backbone's branches. Each branch f_ℓ includes its own input RMSNorm (DAR §2: "f_ℓ denotes
// the complete branch transformation, including its input normalization").
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

// Rotary position embedding (rotate-half pairing: dimension i pairs with i + head_dim/2).
struct Rope {
  at::Tensor cos, sin;  // [max_len, head_dim/2], float32
  Rope(int64_t head_dim, int64_t max_len, double theta, at::Device device);
  // x: [B, H, T, head_dim]; positions offset … offset+T-1.
  at::Tensor apply(const at::Tensor& x, int64_t offset = 0) const;
};

// RMSNorm → grouped-query causal attention with RoPE → output projection. No biases.
struct Attention {
  at::Tensor norm, wq, wk, wv, wo;  // [d], [H·hd, d], [KV·hd, d], [KV·hd, d], [d, H·hd]
  int64_t n_heads, n_kv_heads, head_dim;
  double eps;
  Attention(const ModelConfig& c, ParameterStore& params, const std::string& prefix);
  at::Tensor forward(const at::Tensor& h, const Rope& rope) const;  // [B, T, d] → [B, T, d]
};

// RMSNorm → SwiGLU: W_down (silu(W_gate x) ⊙ W_up x). No biases.
struct FeedForward {
  at::Tensor norm, w_gate, w_up, w_down;  // [d], [d_ff, d], [d_ff, d], [d, d_ff]
  double eps;
  FeedForward(const ModelConfig& c, ParameterStore& params, const std::string& prefix);
  at::Tensor forward(const at::Tensor& h) const;
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace depthkit
