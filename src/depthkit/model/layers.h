// The backbone's branches. Each branch f_ℓ includes its own input RMSNorm (DAR §2: "f_ℓ denotes
// the complete branch transformation, including its input normalization").
#pragma once
#include <ATen/core/Tensor.h>

#include <c10/core/DeviceType.h>

#include <string>
#include <tuple>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

class ParameterStore;

// Rotary position embedding (rotate-half pairing: dimension i pairs with i + head_dim/2).
struct Rope {
  at::Tensor cos, sin;  // [max_len, head_dim/2], float32
  Rope(int64_t head_dim, int64_t max_len, double theta, at::Device device);
};

// The backbone's memory-bound steps, each run by its fused operator (ops/backbone_ops.h) or its
// ATen composition (ops/reference/reference.h), chosen once from model.impl and the device (an
// operator without a kernel there runs its composition, ops/kernel_choice.h).
class BackboneOps {
 public:
  BackboneOps(const std::string& impl, c10::DeviceType device);
  // RMSNorm with weight (cast to x's dtype) over the last dimension.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) const;
  // qkv [B, T, (H + 2 KV) · hd] → q [B, T, H, hd], k, v [B, T, KV, hd]; q, k rotated from position offset.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const Rope& rope,
                                                          int64_t n_heads, int64_t n_kv_heads, int64_t offset) const;
  // gate_up [..., 2F] → silu(gate) ⊙ up.
  at::Tensor swiglu(const at::Tensor& gate_up) const;
  // Mean cross-entropy of hidden · weightᵀ against targets, in the accumulation dtype.
  at::Tensor cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) const;

 private:
  bool rms_norm_, rope_qkv_, swiglu_, cross_entropy_;
};

// One attention layer's keys and values while decoding, [B, KV, capacity, hd] each (position-major
// per head, as the attention reads them), in the compute dtype.
struct KvCache {
  at::Tensor keys, values;
};

// A chunk of positions continuing a batch of sequences being decoded (Transformer::extend): what
// every attention layer needs to place the chunk's keys and values and to read the cache.
struct DecodeChunk {
  std::vector<int64_t> lengths;  // positions each sequence held before the chunk
  std::vector<int64_t> counts;   // the real positions of each row of the chunk (padding follows)
  int64_t span = 0;              // positions the chunk's queries read: max_b lengths[b] + counts[b]
  at::Tensor mask;               // bool [B, 1, T, span]: query t of row b sees positions ≤ lengths[b] + t
  bool aligned = false;          // all lengths equal and every count = T: one RoPE call, one copy
};

// RMSNorm → grouped-query causal attention with RoPE → output projection. No biases. q, k and v
// are one product with the three matrices stacked (they stay three parameters).
struct Attention {
  at::Tensor norm, wq, wk, wv, wo;  // [d], [H·hd, d], [KV·hd, d], [KV·hd, d], [d, H·hd]
  int64_t n_heads, n_kv_heads, head_dim;
  double eps;
  BackboneOps ops;
  Attention(const ModelConfig& c, ParameterStore& params, const std::string& prefix);
  at::Tensor forward(const at::Tensor& h, const Rope& rope) const;  // [B, T, d] → [B, T, d]
  // The same for a chunk of positions continuing decoded sequences: the chunk's real keys and
  // values go into `cache`, and its queries read all of the sequence's cached positions.
  at::Tensor forward(const at::Tensor& h, const Rope& rope, KvCache& cache, const DecodeChunk& chunk) const;
};

// RMSNorm → SwiGLU: W_down (silu(W_gate x) ⊙ W_up x). No biases. Gate and up are one product with
// the two matrices stacked.
struct FeedForward {
  at::Tensor norm, w_gate, w_up, w_down;  // [d], [d_ff, d], [d_ff, d], [d, d_ff]
  double eps;
  BackboneOps ops;
  FeedForward(const ModelConfig& c, ParameterStore& params, const std::string& prefix);
  at::Tensor forward(const at::Tensor& h) const;
};

}  // namespace depthkit
