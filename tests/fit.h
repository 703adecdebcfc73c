// Overfitting one batch: the shortest proof that a model learns (tests of the dense and MoE
// backbones).
#pragma once
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>

#include <functional>

#include "depthkit/model/transformer.h"
#include "depthkit/train/optimizer.h"

namespace depthkit::test {

// `steps` AdamW steps (lr 1e-2, gradients clipped at norm 1) on one fixed random batch of four
// sequences; after_step(step, loss) runs after each, with the step's optimised loss.
inline void fit_one_batch(Transformer& m, const Config& c, int steps, const std::function<void(int, double)>& after_step) {
  AdamW opt(m.parameters(), c.optim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  at::Tensor batch = at::randint(c.model.vocab_size, {4, c.model.seq_len + 1}, gen);
  for (int step = 0; step < steps; ++step) {
    m.parameters().zero_grad();
    at::Tensor loss = m.loss(batch);
    loss.backward();
    clip_grad_norm(m.parameters(), 1.0);
    opt.step(1e-2);
    after_step(step, loss.item<double>());
  }
}

}  // namespace depthkit::test
