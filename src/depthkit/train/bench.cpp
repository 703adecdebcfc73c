#include "depthkit/train/bench.h"

#include <ATen/TensorOperators.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <sys/resource.h>

#include <chrono>

#include "depthkit/model/transformer.h"
#include "depthkit/train/optimizer.h"

namespace depthkit {

BenchResult run_bench(const Config& cfg, int64_t steps, int64_t warmup) {
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  Transformer model(cfg.model, cfg.residual, at::kCPU, uint64_t(cfg.train.seed));
  AdamW optim(model.parameters(), cfg.optim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(cfg.train.seed));
  BenchResult r;
  r.tokens_per_step = cfg.tokens_per_step();
  for (int64_t i = 0; i < warmup + steps; ++i) {
    std::vector<at::Tensor> batches;
    for (int64_t m = 0; m < cfg.train.grad_accum; ++m)
      batches.push_back(at::randint(cfg.model.vocab_size, {cfg.train.micro_batch, cfg.model.seq_len + 1}, gen));
    auto t0 = std::chrono::steady_clock::now();
    model.parameters().zero_grad();
    for (const auto& b : batches) (model.loss(b) / double(cfg.train.grad_accum)).backward();
    clip_grad_norm(model.parameters(), cfg.optim.grad_clip);
    optim.step(cfg.optim.lr);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) r.step_s.push_back(s);
  }
  std::vector<double> sorted = r.step_s;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  r.median_step_s = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  r.tokens_per_s = double(r.tokens_per_step) / r.median_step_s;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  r.peak_rss_bytes = int64_t(ru.ru_maxrss) * 1024;
  return r;
}

}  // namespace depthkit
