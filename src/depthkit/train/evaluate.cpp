#include "depthkit/train/evaluate.h"

#include <ATen/core/grad_mode.h>

#include "depthkit/model/transformer.h"

namespace depthkit {

double evaluate(Transformer& model, const std::vector<at::Tensor>& batches) {
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (const auto& b : batches) {
    const int64_t tokens = b.size(0) * (b.size(1) - 1);
    sum += model.loss(b).item<double>() * double(tokens);
    n += tokens;
  }
  return n ? sum / double(n) : 0.0;
}

}  // namespace depthkit
