// The backbone's fused operators (ops/backbone_ops.cpp): the memory-bound steps of the Transformer
// around the pathway, which eager ATen runs as several passes each (torch.compile's inductor
// fuses them), written as single-pass CPU kernels (ops/cpu/backbone_cpu.cpp) with hand-written
// backward operators, on the same schema pattern as the pathway operators. Their reference
// compositions, with the same signatures, are in ops/reference/reference.h; model.impl chooses
// (docs/design.md, "Backbone operators").
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace depthkit::fused {

// RMSNorm with weight over the last dimension: x [..., d], weight [d] → (x / √(mean x² + ε)) ⊙ weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The attention's fused projection qkv [B, T, (H + 2 KV) · hd] (q, then k, then v heads) split into
// q [B, T, H, hd] and k, v [B, T, KV, hd], q and k rotated by RoPE (rotate-half pairing) for
// positions offset … offset + T − 1 with the tables cos, sin [max_len, hd / 2] (float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                                        int64_t offset);

// SwiGLU's activation on the fused gate/up projection: gate_up [..., 2F] (gate first) → silu(gate) ⊙ up [..., F].
at::Tensor swiglu(const at::Tensor& gate_up);

// The mean cross-entropy of the logits hidden · weightᵀ against targets, computed a chunk of tokens
// at a time so that the [tokens, vocabulary] logits and their gradient never exist whole:
// hidden [N, d], weight [V, d] (one dtype), targets [N] int64 → a scalar in the accumulation dtype
// (float32 for float32 and bfloat16, float64 for float64). With gradients wanted, each chunk's
// gradients are taken while its logits are at hand, in the forward (the backward scales them).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets);

}  // namespace depthkit::fused
