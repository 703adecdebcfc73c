#include "depthkit/ops/reference/depth_attention.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>

namespace depthkit {

at::Tensor key_norm(const at::Tensor& k, double eps) {
  return k * at::rsqrt(k.square().mean(-1, /*keepdim=*/true) + eps);
}

DepthRead depth_read(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double eps) {
  at::Tensor logits = at::matmul(key_norm(keys, eps), query);  // [N, ...]   (A.1)
  at::Tensor weights = at::softmax(logits, 0);                   // over sources (eq. 3)
  at::Tensor out = (weights.unsqueeze(-1) * values).sum(0);      // eq. 5
  return {out, at::logsumexp(logits, {0})};                      // ζ (A.5)
}

at::Tensor merge_partial(const DepthRead& history, const at::Tensor& query, const at::Tensor& key_part,
                         const at::Tensor& value_part, double eps) {
  at::Tensor a_part = at::matmul(key_norm(key_part, eps), query);           // (A.8)
  at::Tensor lambda = at::sigmoid(history.log_partition - a_part).unsqueeze(-1);  // (A.9)
  return lambda * history.out + (1.0 - lambda) * value_part;                // (A.10)
}

at::Tensor depth_weights(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& key_part, double eps) {
  at::Tensor all = key_part.defined() ? at::cat({keys, key_part.unsqueeze(0)}, 0) : keys;
  at::Tensor logits = at::matmul(key_norm(all.detach(), eps), query.detach());  // [N, ...]
  return at::softmax(logits, 0).movedim(0, -1);
}

}  // namespace depthkit
