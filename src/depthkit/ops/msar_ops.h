// Fused MSAR operators (MSAR eq. 9–17, §3.4, Appendix C Table 6), registered as torch operators
// in namespace `depthkit` (ops/msar_ops.cpp) with CPU kernels (ops/cpu/msar_cpu.cpp) and an
// Autograd kernel whose backward is a hand-written operator. Usable from C++ (these functions)
// and Python (torch.ops.depthkit.msar_read / msar_fuse). The expanded streams are computed in
// registers and thread-local buffers from the raw single-stream sources and are never stored,
// neither in the forward nor for the backward (which recomputes them).
//
// The pathway's read of branch ℓ is
//   (out, ζ) = msar_read(queries_ℓ, completed sources, their banks)           phase 1 (eq. 11–12)
//   h_ℓ      = msar_fuse(out, ζ, queries_ℓ, partial, bank ℓ−1, W_pre, b_pre, α_pre)
//                                                        phase 2 merge (eq. 17) + H_pre (eq. 13–14)
// and equals the reference compositions reference::msar_read and reference::msar_fuse
// (ops/reference/reference.h), which the tests hold it to.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <tuple>
#include <vector>

namespace depthkit::fused {

// Phase 1, per stream r and token: softmax over the N completed sources of the expanded keys =
// values v⁽ʳ⁾ (eq. 10; stream 0 is the identity), keys normalised by weightless RMSNorm.
//   queries [m, d], sources: a list of N raw [B, T, d] (never stacked, ops/fused.h), conv: their N
//   banks [m−1, d, K] (taps zero-padded to the largest kernel K; conv[n][r−1, :, δ] weighs x_{t−δ})
//   →  out [m, B, T, d], log_partition ζ [m, B, T] (float32; float64 for float64 inputs).
// For the conv = false ablation pass identity taps (ones, K = 1): every stream is the source.
// kernel_lengths (m − 1 entries in 1 … K), when given: stream r's kernel has kernel_lengths[r − 1]
// taps and the rest of its K are padding, neither read nor given a gradient (zero), so the
// kernels skip both (Appendix C: κ = {4, 8, 12} padded to 12). Absent: all K taps are parameters.
// context (0 … T − 1): the sources' first positions are only the convolution windows of the later
// ones, which alone are read: out [m, B, T − context, d], ζ [m, B, T − context]. A cached decoding
// step passes each source's last K − 1 positions before its new ones, and reads only the new.
std::tuple<at::Tensor, at::Tensor> msar_read(const at::Tensor& queries, at::TensorList sources, at::TensorList conv,
                                             double eps,
                                             c10::OptionalIntArrayRef kernel_lengths = std::nullopt,
                                             int64_t context = 0);

// msar_read for the S branches of one block, which read the same sources (MSAR §3.4: phase 1
// batches all targets of a block): queries, one [m, d] per branch  →  (out, log_partition) per
// branch, each as msar_read's. Each source's expansion is computed once for all S, in the forward
// and the backward.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read(
    at::TensorList queries, at::TensorList sources, at::TensorList conv, double eps,
    c10::OptionalIntArrayRef kernel_lengths = std::nullopt, int64_t context = 0);

// Phase 2 and fusion, per token: merges the block partial's expansion into each stream by
// online softmax (λ_r = σ(ζ_r − a_r), DAR eq. A.6–A.10), then fuses the m streams:
// h = Σ_r H_pre[r] z⁽ʳ⁾ with H_pre = σ(α_pre · RMSNorm(flatten Z) W_preᵀ + b_pre) (eq. 13–14),
// or h = mean_r z⁽ʳ⁾ when w_pre, b_pre, alpha_pre are absent (undefined tensors).
//   out [m, B, T, d], log_partition [m, B, T], queries [m, d];
//   partial [B, context + T, d] and partial_conv [m−1, d, K'] (absent at a block's first branch);
//   w_pre [m, m·d], b_pre [m], alpha_pre [1]   →  h [B, T, d]. kernel_lengths as for msar_read;
//   context as msar_read's, for the partial (0 without one).
at::Tensor msar_fuse(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& queries,
                     const at::Tensor& partial, const at::Tensor& partial_conv, const at::Tensor& w_pre,
                     const at::Tensor& b_pre, const at::Tensor& alpha_pre, double eps,
                     c10::OptionalIntArrayRef kernel_lengths = std::nullopt, int64_t context = 0);

}  // namespace depthkit::fused
