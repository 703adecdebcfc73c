// Depth attention, the one primitive that AttnRes, DAR and MSAR are built from (docs/design.md,
// "Pathways"):
// per token, over N sources with raw keys K_r and values V_r and one pseudo-query q,
//
//   a_r = q · Norm_h(K_r)            Norm_h: RMSNorm without weight, eps 1e-6   (DAR eq. 2, A.1)
//   out = Σ_r softmax(a)_r V_r,  ζ = logsumexp_r a_r                           (eq. 3, 5, A.2–A.5)
//
// and the two-phase form: the completed sources are read first (`depth_read`), then the block's
// partial candidate is merged exactly by online softmax (`merge_partial`, eq. A.6–A.10).
// This file is a composition of ATen ops (autograd gives the backward): the primitive the
// references of the fused operators (reference.h) and the analyses' depth_weights are built on.
#pragma once
#include <ATen/core/Tensor.h>

namespace depthkit {

constexpr double kKeyNormEps = 1e-6;

// The dtype the fused kernels accumulate in and keep softmax statistics in (ops/cpu/kernel_math.h):
// float64 for float64 tensors, float32 for float32 and bfloat16. The reference compositions
// compute in it too and return their outputs in the inputs' dtype, as the kernels do: for a
// bfloat16 model the logits, max, log-partition ζ and softmax weights are float32, and only what
// a kernel stores (the retrieved state, a gate) is rounded to bfloat16 (docs/design.md,
// "Precision"). For float32 and float64 inputs every cast is a no-op.
inline at::ScalarType accumulation_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}
// `t` in accumulation_dtype(like); an undefined tensor (an absent optional input) stays undefined.
inline at::Tensor widen(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t.to(accumulation_dtype(like)) : t;
}

// Weightless RMSNorm over the last dimension.
at::Tensor key_norm(const at::Tensor& k, double eps = kKeyNormEps);

struct DepthRead {
  at::Tensor out;            // [..., d]: the retrieved state, in the values' dtype
  at::Tensor log_partition;  // [...]:    ζ = logsumexp_r a_r, in accumulation_dtype(keys)
};

// keys, values: [N, ..., d] stacked sources; query: [d]. Computed in accumulation_dtype(keys).
DepthRead depth_read(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                     double eps = kKeyNormEps);

// Adds one candidate (raw key, value: [..., d]) to a completed read: λ = σ(ζ − a_part),
// h = λ·out + (1 − λ)·v_part (DAR eq. A.9–A.10). Equal to one softmax over all candidates.
// Computed in accumulation_dtype(value_part); h in value_part's dtype.
at::Tensor merge_partial(const DepthRead& history, const at::Tensor& query, const at::Tensor& key_part,
                         const at::Tensor& value_part, double eps = kKeyNormEps);

// The softmax weights of one read, for analysis: keys [N, ..., d], key_part [..., d] or undefined
// → [..., N] (or [..., N + 1] with the partial's weight last), in accumulation_dtype(keys).
// Detached; no gradient.
at::Tensor depth_weights(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& key_part,
                         double eps = kKeyNormEps);

}  // namespace depthkit
