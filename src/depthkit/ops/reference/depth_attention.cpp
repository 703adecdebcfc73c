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
  const auto acc = accumulation_dtype(keys);
  at::Tensor logits = at::matmul(key_norm(keys.to(acc), eps), query.to(acc));  // [N, ...]   (A.1)
  at::Tensor weights = at::softmax(logits, 0);                                   // over sources (eq. 3)
  at::Tensor out = (weights.unsqueeze(-1) * values.to(acc)).sum(0);              // eq. 5
  return {out.to(values.scalar_type()), at::logsumexp(logits, {0})};             // ζ (A.5)
}

at::Tensor merge_partial(const DepthRead& history, const at::Tensor& query, const at::Tensor& key_part,
                         const at::Tensor& value_part, double eps) {
  const auto acc = accumulation_dtype(value_part);
  at::Tensor a_part = at::matmul(key_norm(key_part.to(acc), eps), query.to(acc));             // (A.8)
  at::Tensor lambda = at::sigmoid(history.log_partition.to(acc) - a_part).unsqueeze(-1);      // (A.9)
  at::Tensor h = lambda * history.out.to(acc) + (1.0 - lambda) * value_part.to(acc);          // (A.10)
  return h.to(value_part.scalar_type());
}

at::Tensor depth_weights(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& key_part, double eps) {
  const auto acc = accumulation_dtype(keys);
  at::Tensor all = key_part.defined() ? at::cat({keys, key_part.unsqueeze(0)}, 0) : keys;
  at::Tensor logits = at::matmul(key_norm(all.detach().to(acc), eps), query.detach().to(acc));  // [N, ...]
  return at::softmax(logits, 0).movedim(0, -1);
}

}  // namespace depthkit
