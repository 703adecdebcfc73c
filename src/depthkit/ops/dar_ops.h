// DAR's residual read and gated write (DAR eq. 9–17): the fused torch operators
// (depthkit::dar_read, depthkit::dar_write; ops/dar_ops.cpp, Appendix A.1) with hand-written
// backward passes. The reference compositions with the same signatures are reference::dar_read and
// reference::dar_write (ops/reference/reference.h); pathways/dar.cpp runs either.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <utility>

namespace depthkit::fused {

struct DarRead {
  at::Tensor h;              // [P, d]: the branch input α⁰ z⁰ + α¹ z¹ (eq. 15)
  at::Tensor beta;           // [P, 2]: β, for the write (eq. 14)
  at::Tensor log_partition;  // [2, P]: ζ of each stream's read (no gradient)
};

// Both streams' reads of the completed history h0, h1 (lists of N entries [P, d]: the sources are
// never stacked, ops/fused.h) and, when defined, the block's partial p0, p1 [P, d], with the gates:
// queries [2, d], w_alpha, w_beta [2, 2d], b_alpha, b_beta [2]. Output stream j takes keys from
// stream key_stream[j], values from value_stream[j].
DarRead dar_read(const at::Tensor& queries, at::TensorList h0, at::TensorList h1, const at::Tensor& p0,
                 const at::Tensor& p1, const at::Tensor& w_alpha, const at::Tensor& b_alpha, const at::Tensor& w_beta,
                 const at::Tensor& b_beta, const std::array<int64_t, 2>& key_stream,
                 const std::array<int64_t, 2>& value_stream, double eps);

// The gated write of the branch output f [P, d] with β [P, 2]: the new partial (P⁰, P¹). With the
// previous partial p0, p1 [P, d] defined, it is transported by M(ρ) first (w_rho [1, 2d], b_rho [1]).
std::pair<at::Tensor, at::Tensor> dar_write(const at::Tensor& f, const at::Tensor& beta, const at::Tensor& p0,
                                            const at::Tensor& p1, const at::Tensor& w_rho, const at::Tensor& b_rho,
                                            double eps);

}  // namespace depthkit::fused
