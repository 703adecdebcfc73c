// The references of the backbone's fused operators (reference.h): the ATen compositions the model
// ran before they were fused, which model.impl = "reference" still runs.
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>

#include "depthkit/ops/reference/reference.h"

namespace depthkit::reference {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                                        int64_t offset) {
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (n_heads + 2 * n_kv_heads), half = hd / 2;
  // The tables at the positions, broadcast over the heads: [T, 1, hd / 2].
  const at::Tensor c = cos.narrow(0, offset, T).to(qkv.scalar_type()).unsqueeze(1);
  const at::Tensor s = sin.narrow(0, offset, T).to(qkv.scalar_type()).unsqueeze(1);
  auto heads = [&](int64_t first, int64_t count) {
    return qkv.narrow(2, first * hd, count * hd).view({B, T, count, hd});
  };
  auto rotate = [&](const at::Tensor& x) {  // rotate-half: dimension i pairs with i + hd / 2
    const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
    return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
  };
  return {rotate(heads(0, n_heads)), rotate(heads(n_heads, n_kv_heads)),
          heads(n_heads + n_kv_heads, n_kv_heads).contiguous()};
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  const int64_t F = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, F)) * gate_up.narrow(-1, F, F);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  // The logits' product in the inputs' dtype, the softmax in the accumulation dtype.
  const at::ScalarType acc = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::cross_entropy_loss(at::linear(hidden, weight).to(acc), targets);
}

}  // namespace depthkit::reference
