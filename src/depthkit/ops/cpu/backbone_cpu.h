// CPU kernels of the backbone's fused operators (declared here, registered in ops/backbone_ops.cpp;
// the math is in backbone_cpu.cpp's header comment).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit::cpu {

// x [..., d], weight [d] → y [..., d], the scales 1/rms [rows] (accumulation dtype).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
// ∂y → (∂x, ∂weight); the scales are the forward's.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& inv_rms);

// qkv [B, T, (H + 2 KV) · hd]; cos, sin [max_len, hd / 2] float32 → q [B, T, H, hd], k, v [B, T, KV, hd]
// (q and k rotated for positions offset … offset + T − 1, v copied).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_forward(const at::Tensor& qkv, const at::Tensor& cos,
                                                                const at::Tensor& sin, int64_t n_heads,
                                                                int64_t n_kv_heads, int64_t offset);
// (∂q, ∂k, ∂v), each possibly undefined (zero) → ∂qkv [B, T, (H + 2 KV) · hd].
at::Tensor rope_qkv_backward(const OptTensor& grad_q, const OptTensor& grad_k, const OptTensor& grad_v,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                             int64_t offset);

// gate_up [..., 2F] → silu(gate) ⊙ up [..., F].
at::Tensor swiglu_forward(const at::Tensor& gate_up);
// ∂out [..., F] → ∂gate_up [..., 2F].
at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& gate_up);

// Logits z [n, V] (contiguous float32/float64), targets [n] (int64, in range) → Σ_rows
// −log softmax(z_row)[target] (in float64); with `gradient`, z is overwritten by
// softmax(z) − onehot(target), row by row (the gradient of that sum).
double cross_entropy_rows(const at::Tensor& z, const at::Tensor& targets, bool gradient);

// out [r, c] = β out + α a [r, k] b [k, c], one BLAS call per fixed block of out's rows
// (kernel_math.h, for_each_gemm_block), so that the result does not depend on the thread count.
// With β = 0, out's old contents are not read. (The linear cross-entropy's three products.)
void addmm_in_row_blocks(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double beta, double alpha);

}  // namespace depthkit::cpu
