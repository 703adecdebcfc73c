// The reference compositions of the fused operators, one per operator, each with exactly the
// signature of its fused:: twin (ops/fused.h, ops/dar_ops.h, ops/msar_ops.h, ops/mhc_ops.h,
// ops/backbone_ops.h), so that a pathway (or the backbone, model/layers.h) switches with
// `fused ? fused::op : reference::op`. They are ATen compositions
// (autograd gives their backward) of the depth-attention primitive (depth_attention.h) and the
// papers' equations: what `residual.impl = "reference"` runs and what the tests hold the fused
// operators to (docs/design.md, "Fused operators"). An absent optional input is an undefined
// tensor, as in the fused:: API. Each computes in its kernel's accumulation dtype (float32 for
// bfloat16 inputs; depth_attention.h, accumulation_dtype) and returns the kernel's output dtypes.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "depthkit/ops/backbone_ops.h"
#include "depthkit/ops/dar_ops.h"

namespace depthkit::reference {

// ---- depth_read, depth_merge (ops/fused.h; DAR eq. A.1–A.10) -----------------------------------

// queries [M, d], keys: N sources [P, d], values: N sources [P, d] or none (= the keys) → out [M, P, d], ζ [M, P].
std::tuple<at::Tensor, at::Tensor> depth_read(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                                              double eps);
// out [P, d], ζ [P], query [d], key_part [P, d], value_part [P, d] or undefined (= the key) → h [P, d].
at::Tensor depth_merge(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& query,
                       const at::Tensor& key_part, const at::Tensor& value_part, double eps);

// ---- dar_read, dar_write (ops/dar_ops.h; DAR eq. 10–17) -----------------------------------------

// The same shapes as fused::dar_read; log_partition is left undefined (nothing reads it).
fused::DarRead dar_read(const at::Tensor& queries, at::TensorList h0, at::TensorList h1, const at::Tensor& p0,
                        const at::Tensor& p1, const at::Tensor& w_alpha, const at::Tensor& b_alpha,
                        const at::Tensor& w_beta, const at::Tensor& b_beta, const std::array<int64_t, 2>& key_stream,
                        const std::array<int64_t, 2>& value_stream, double eps);
std::pair<at::Tensor, at::Tensor> dar_write(const at::Tensor& f, const at::Tensor& beta, const at::Tensor& p0,
                                            const at::Tensor& p1, const at::Tensor& w_rho, const at::Tensor& b_rho,
                                            double eps);

// ---- msar_read, msar_fuse (ops/msar_ops.h; MSAR eq. 9–17) ---------------------------------------

// The m streams [m, B, T, d] of a source x [B, T, d] under a bank [m − 1, d, K] (eq. 9–10):
// stream 0 the identity, stream r the causal depthwise convolution Σ_δ c[r − 1, :, δ] ⊙ x_{t−δ},
// zero before position 0 (by grouped conv1d). Both MSAR references and the pathway's observer use it.
at::Tensor msar_expand(const at::Tensor& x, const at::Tensor& bank);
// queries [m, d], sources: N [B, T, d], conv: N [m − 1, d, K] → out [m, B, T − context, d],
// ζ [m, B, T − context]; kernel_lengths (the padding is masked to zero) and context as
// fused::msar_read takes them.
std::tuple<at::Tensor, at::Tensor> msar_read(const at::Tensor& queries, at::TensorList sources, at::TensorList conv,
                                             double eps,
                                             c10::OptionalIntArrayRef kernel_lengths = std::nullopt,
                                             int64_t context = 0);
// msar_read once per queries tensor (the S branches of a block), as fused::msar_block_read.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read(
    at::TensorList queries, at::TensorList sources, at::TensorList conv, double eps,
    c10::OptionalIntArrayRef kernel_lengths = std::nullopt, int64_t context = 0);
// out, ζ, queries as msar_read returns and takes them; partial [B, context + T, d] and
// partial_conv [m − 1, d, K'] or both undefined; w_pre [m, m·d], b_pre [m], alpha_pre [1] or all
// undefined (mean fusion) → h [B, T, d].
at::Tensor msar_fuse(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& queries,
                     const at::Tensor& partial, const at::Tensor& partial_conv, const at::Tensor& w_pre,
                     const at::Tensor& b_pre, const at::Tensor& alpha_pre, double eps,
                     c10::OptionalIntArrayRef kernel_lengths = std::nullopt, int64_t context = 0);
// msar_fuse's two steps, for the pathway's observer as well: the m streams after the partial's
// merge, Z [B, T, m, d] in the accumulation dtype (eq. 17; out itself at a block's first branch),
// and their H_pre gates [B, T, m] (eq. 13).
at::Tensor msar_merged_streams(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& queries,
                               const at::Tensor& partial, const at::Tensor& partial_conv, double eps,
                               c10::OptionalIntArrayRef kernel_lengths = std::nullopt, int64_t context = 0);
at::Tensor msar_fusion_gates(const at::Tensor& Z, const at::Tensor& w_pre, const at::Tensor& b_pre,
                             const at::Tensor& alpha_pre, double eps);

// ---- mhc_pre, mhc_sinkhorn, mhc_merge (ops/mhc_ops.h; MSAR eq. 3–5) -----------------------------

// x [*, m, d], φ [m² + 2m, md], bias [m² + 2m], scale [3] → (h [*, d], H_post [*, m], H_res logits [*, m, m]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_pre(const at::Tensor& x, const at::Tensor& phi,
                                                       const at::Tensor& bias, const at::Tensor& scale, double eps);
// H_res from its logits [*, m, m]: in float32 (float64 for float64), max subtracted, `iters` rounds
// of `sinkhorn`, returned in that dtype (as the fused operator).
at::Tensor mhc_sinkhorn(const at::Tensor& logits, int64_t iters);
// x [*, m, d], f [*, d], h_post [*, m], h_res [*, m, m] → x'_j = H_post[j] f + Σ_i H_res[i, j] x_i.
at::Tensor mhc_merge(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post, const at::Tensor& h_res);
// Sinkhorn–Knopp on a positive matrix [..., m, m]: `iters` rounds of row then column normalisation.
at::Tensor sinkhorn(const at::Tensor& positive, int64_t iters);

// ---- rms_norm, rope_qkv, swiglu, linear_cross_entropy (ops/backbone_ops.h) ----------------------

// at::rms_norm over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// q, k, v views of qkv, q and k rotated by the cat of the two rotated halves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                                        int64_t offset);
// at::silu(gate) * up.
at::Tensor swiglu(const at::Tensor& gate_up);
// at::cross_entropy_loss of the whole [N, V] logits (at::linear in the inputs' dtype, the loss in
// the accumulation dtype).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets);

}  // namespace depthkit::reference
