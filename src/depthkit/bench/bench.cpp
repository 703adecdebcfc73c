#include "depthkit/bench/bench.h"

#include <ATen/TensorOperators.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "depthkit/model/accounting.h"
#include "depthkit/dist/world.h"
#include "depthkit/model/layers.h"
#include "depthkit/model/moe.h"
#include "depthkit/model/config_check.h"
#include "depthkit/model/transformer.h"
#include "depthkit/bench/op_bench.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/util/device.h"
#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"
#include "depthkit/util/memory.h"

namespace depthkit {

namespace {

// A kind's memory, counted in the same way on either device: the bytes it keeps between steps
// (parameters, optimizer state) plus the largest rise during one of its steps. The CPU's counter
// is TensorMemory (util/memory.h); a CUDA device's is its caching allocator (util/device.h).
struct MemoryCounter {
  at::Device device;
  int64_t current() const { return device.is_cpu() ? TensorMemory::current_bytes() : device_allocated_bytes(device); }
  int64_t peak() const { return device.is_cpu() ? TensorMemory::peak_bytes() : device_peak_bytes(device); }
  void reset_peak() const {
    if (device.is_cpu()) TensorMemory::reset_peak();
    else reset_device_peak(device);
  }
  bool available() const { return current() >= 0; }  // false: a build without DEPTHKIT_CUDA
};

// One model with its optimizer and token generator: a training step on random tokens.
struct Bench {
  Config cfg;
  at::Device device;
  Transformer model;
  AdamW optim;
  at::Generator gen;
  int64_t own_bytes = 0;   // tensor storage this kind keeps between steps (parameters, optimizer state)
  int64_t peak_bytes = 0;  // own_bytes + the largest step's transient tensors
  int64_t own_device_bytes = 0, peak_device_bytes = 0;  // the same on a CUDA device
  Bench(const Config& c, at::Device d)
      : cfg(c), device(d), model(c.model, c.residual, d, uint64_t(c.train.seed), at::kFloat, compute_dtype_of(c.train)), optim(model.parameters(), c.optim),
        gen(at::make_generator<at::CPUGeneratorImpl>(uint64_t(c.train.seed))) {}
  // A step, counting this kind's tensor memory (the other kinds' tensors do not change meanwhile).
  double measured_step() {
    const MemoryCounter cpu{at::kCPU}, dev{device};
    const bool on_device = !device.is_cpu() && dev.available();
    const int64_t start = cpu.current(), device_start = on_device ? dev.current() : 0;
    cpu.reset_peak();
    if (on_device) dev.reset_peak();
    const double s = step();
    peak_bytes = std::max(peak_bytes, own_bytes + cpu.peak() - start);
    own_bytes += cpu.current() - start;  // state allocated at the first step
    if (on_device) {
      peak_device_bytes = std::max(peak_device_bytes, own_device_bytes + dev.peak() - device_start);
      own_device_bytes += dev.current() - device_start;
    }
    return s;
  }
  double step() {
    // The tokens are drawn on the CPU, so that a seed gives the same batches on every device.
    std::vector<at::Tensor> batches;
    for (int64_t m = 0; m < cfg.train.grad_accum; ++m)
      batches.push_back(
          at::randint(cfg.model.vocab_size, {cfg.train.micro_batch, cfg.model.seq_len + 1}, gen).to(device));
    synchronize(device);  // the copies (and anything queued before) are not this step's time
    auto t0 = std::chrono::steady_clock::now();
    model.parameters().zero_grad();
    for (const auto& b : batches) (model.loss(b) / double(cfg.train.grad_accum)).backward();
    clip_grad_norm(model.parameters(), cfg.optim.grad_clip);
    optim.step(cfg.optim.lr);
    synchronize(device);  // CUDA returns before its kernels finish
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

void summarise(BenchResult& r, int64_t tokens_per_step) {
  r.median_step_s = median(r.step_s);
  r.tokens_per_step = tokens_per_step;
  r.tokens_per_s = double(tokens_per_step) / r.median_step_s;
  r.peak_rss_bytes = peak_rss_bytes();
}

// The dispatch of one MoE layer with c's widths and expert_impl (DispatchMemory, bench.h).
DispatchMemory measure_dispatch(const Config& c, at::Device device) {
  const MemoryCounter mem{device};
  const ModelConfig& m = c.model;
  const at::ScalarType compute = compute_dtype_of(c.train);
  ParameterStore params(device, uint64_t(c.train.seed), at::kFloat);
  MoeFeedForward layer(m, params, "moe");
  // The routed part alone: the shared experts run on every token beside the dispatch.
  layer.shared_gate = layer.shared_up = layer.shared_down = at::Tensor();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(c.train.seed));
  DispatchMemory r;
  // {peak, kept} of the dispatch over `batch` sequences: the forward's less what the norm and the
  // router hold (measured the same way, alone) while the dispatch runs, and after the forward.
  auto measure = [&](int64_t batch) {
    // The input requires grad, as the pathway's read does in training: the forward saves for backward.
    auto h = at::randn({batch, m.seq_len, m.d_model}, gen).to(device, compute).set_requires_grad(true);
    int64_t router_during = 0, router_after = 0;
    {
      const int64_t start = mem.current();
      auto x = layer.ops.rms_norm(h, layer.norm, layer.eps).reshape({-1, m.d_model});
      Routing routing = layer.route(x);
      router_during = mem.current() - start;
      // After the forward, only what backward saved of these stays: the scores (softmax_topk's are
      // its probabilities) and the chosen experts, the normalised input where the router's product
      // saved it (float32), the gathered scores where renormalising saved them. The rest is
      // released, sigmoid_topk's normalised probabilities too (the balance loss keeps their mean).
      routing.logits.reset();
      routing.probs.reset();
      routing.gates.reset();
      x.reset();
      router_after = mem.current() - start;
    }
    const int64_t start = mem.current();
    mem.reset_peak();
    auto y = layer.forward(h);
    synchronize(device);
    return std::pair<int64_t, int64_t>{mem.peak() - start - router_during, mem.current() - start - router_after};
  };
  r.expert_impl = layer.uses_grouped(at::empty({0, m.d_model}, at::TensorOptions(compute).device(device))) ? "grouped"
                                                                                                           : "loop";
  const int64_t B = c.train.micro_batch;
  r.tokens = B * m.seq_len;
  const auto [peak1, kept1] = measure(B);
  const auto [peak2, kept2] = measure(2 * B);
  r.peak_per_token = double(peak2 - peak1) / double(r.tokens);
  r.kept_per_token = double(kept2 - kept1) / double(r.tokens);
  r.fixed_bytes = peak1 - int64_t(std::llround(r.peak_per_token * double(r.tokens)));
  const int64_t b = int64_t(c10::elementSize(compute)), k = m.moe.top_k, d = m.d_model, f = m.moe.expert_d_ff;
  r.sorted_copy_per_token = k * d * b;
  // Kept: the sorted copies; gate, up, silu(gate) and their product; the experts' outputs; the
  // gate-weighted outputs (index_add's backward keeps its source, if only for its shape); the
  // sorted gates; the int64 order and token indices; the combined output. Peak: + the zeros
  // index_add adds into.
  r.analytic_kept_per_token = k * d * b + 4 * k * f * b + k * d * b + k * d * b + k * b + 2 * k * 8 + d * b;
  r.analytic_peak_per_token = r.analytic_kept_per_token + d * b;
  return r;
}

}  // namespace

std::vector<BenchResult> run_bench_variants(const Config& cfg, const std::vector<BenchVariant>& variants,
                                            int64_t steps, int64_t warmup, int64_t profile_steps) {
  if (variants.empty()) fail("bench: no variant to time");
  if (cfg.train.threads > 0) at::set_num_threads(int(cfg.train.threads));
  // One process is one GPU: LOCAL_RANK picks it, as for training (and means nothing on the CPU).
  const at::Device device =
      resolve_device(cfg.train.device, cfg.train.device == "cpu" ? 0 : LaunchEnv::from_environment().local_rank);
  TensorMemory::install();
  const MemoryCounter cpu{at::kCPU}, dev{device};
  const bool on_device = !device.is_cpu() && dev.available();
  // Every variant's configuration first: a bad override fails before any model is built.
  std::vector<Config> configs;
  for (const auto& v : variants) {
    const std::string source = cat("variant '", v.name, "'");
    try {
      configs.push_back(parse_config(cfg.to_toml(), source, v.overrides));
    } catch (const Error& e) {
      const std::string what = e.what();
      throw Error(what.rfind(source, 0) == 0 ? what : cat(source, ": ", what));
    }
  }
  std::vector<std::unique_ptr<Bench>> benches;
  for (const auto& c : configs) {
    const int64_t before = cpu.current(), device_before = on_device ? dev.current() : 0;
    benches.push_back(std::make_unique<Bench>(c, device));
    benches.back()->own_bytes = cpu.current() - before;
    if (on_device) benches.back()->own_device_bytes = dev.current() - device_before;
  }
  // The copy the pathways' traffic is rated against: one stream per branch of the first variant's
  // micro-batch in its compute dtype, the activations a pathway streams through in a step (tens of
  // MB at the 0.1B width: memory's speed, not the cache's, as for the pathways, whose reads
  // follow the branches' GEMMs). Allocated after the models, whose own memory is counted apart.
  const Config& c0 = configs[0];
  PlainCopy copy(at::ones({c0.model.n_branches(), c0.train.micro_batch * c0.model.seq_len, c0.model.d_model},
                          at::TensorOptions(compute_dtype_of(c0.train)).device(device)));
  copy.time_ms();  // the destination's pages are first touched here, not in a timed copy
  // The FLOP rate the pathways' FLOPs are rated against: a projection's product at the first
  // variant's micro-batch and width, in its compute dtype.
  GemmRate gemm(c0.train.micro_batch * c0.model.seq_len, c0.model.d_model,
                at::TensorOptions(compute_dtype_of(c0.train)).device(device));
  gemm.time_ms();
  std::vector<double> copy_ms, gemm_ms;
  std::vector<BenchResult> results(variants.size());
  for (int64_t i = 0; i < warmup + steps; ++i) {
    for (size_t k = 0; k < benches.size(); ++k) {
      const double s = benches[k]->measured_step();
      if (i >= warmup) results[k].step_s.push_back(s);
    }
    // In every round, so that it sees the steps' machine; three copies (a few ms each against a
    // step's hundreds), so that one preempted by another process does not make the median.
    for (int j = 0; j < 3; ++j) {
      const double c = copy.time_ms(), m = gemm.time_ms();
      if (i >= warmup) copy_ms.push_back(c), gemm_ms.push_back(m);
    }
  }
  // The GEMM's fastest timing: a rate the machine reaches (a floor is not raised by interference).
  const double copy_gbs = copy.gbs(median(copy_ms)),
               gemm_gflops = gemm.gflops(*std::min_element(gemm_ms.begin(), gemm_ms.end()));
  copy.src.reset();  // not kept through the dispatch measurement below
  copy.dst.reset();
  gemm.a.reset(), gemm.b.reset(), gemm.out.reset();
  for (size_t k = 0; k < variants.size() && profile_steps > 0; ++k) {
    OpProfile profile;
    profile.start();
    for (int64_t i = 0; i < profile_steps; ++i) benches[k]->step();
    profile.stop();
    results[k].profile_steps = profile_steps;
    results[k].profile = profile.rows();
  }
  for (size_t k = 0; k < variants.size(); ++k) {
    BenchResult& r = results[k];
    r.name = variants[k].name;
    r.kind = configs[k].residual.kind;
    r.overrides = variants[k].overrides;
    r.peak_tensor_bytes = benches[k]->peak_bytes;
    r.device = device.str();
    r.peak_device_bytes = on_device ? benches[k]->peak_device_bytes : -1;
    const ParameterCounts n = benches[k]->model.count();
    r.parameters = n.total;
    r.active_parameters = n.active;
    summarise(r, configs[k].tokens_per_step());
    const CostReport cost = training_cost(configs[k].model, configs[k].residual);
    r.traffic_bytes =
        cost.training_traffic_bytes(r.tokens_per_step, int64_t(c10::elementSize(compute_dtype_of(configs[k].train))));
    r.copy_gbs = copy_gbs;
    r.pathway_flops = cost.pathway_flops * double(r.tokens_per_step);
    r.gemm_gflops = gemm_gflops;
  }
  // After the timing, so that its allocations do not touch the steps.
  for (size_t k = 0; k < variants.size(); ++k)
    if (configs[k].model.moe.enabled() && (device.is_cpu() || on_device)) {
      results[k].dispatch = measure_dispatch(configs[k], device);
      results[k].has_dispatch = true;
    }
  return results;
}

std::vector<BenchResult> run_bench_kinds(const Config& cfg, const std::vector<std::string>& kinds, int64_t steps,
                                         int64_t warmup, int64_t profile_steps) {
  std::vector<BenchVariant> variants;
  for (const auto& kind : kinds) variants.push_back({kind, {"residual.kind=" + kind}});
  return run_bench_variants(cfg, variants, steps, warmup, profile_steps);
}

BenchResult run_bench(const Config& cfg, int64_t steps, int64_t warmup, int64_t profile_steps) {
  return run_bench_kinds(cfg, {cfg.residual.kind}, steps, warmup, profile_steps)[0];
}

}  // namespace depthkit
