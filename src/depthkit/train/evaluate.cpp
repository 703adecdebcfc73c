#include "depthkit/train/evaluate.h"

#include <ATen/core/grad_mode.h>

#include "depthkit/model/transformer.h"

namespace depthkit {

LossSum evaluate_share(Transformer& model, const std::vector<at::Tensor>& batches, int64_t rank, int64_t ranks) {
  at::NoGradGuard no_grad;
  LossSum sum;
  for (size_t i = size_t(rank); i < batches.size(); i += size_t(ranks)) {
    const at::Tensor& b = batches[i];
    const int64_t tokens = b.size(0) * (b.size(1) - 1);
    sum.loss += model.lm_loss(b.to(model.parameters().device())).item<double>() * double(tokens);
    sum.tokens += tokens;
  }
  return sum;
}

double evaluate(Transformer& model, const std::vector<at::Tensor>& batches) {
  const LossSum sum = evaluate_share(model, batches, 0, 1);
  return sum.tokens ? sum.loss / double(sum.tokens) : 0.0;
}

}  // namespace depthkit
