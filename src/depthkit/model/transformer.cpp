#include "depthkit/model/transformer.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include <utility>

#include "depthkit/nn/precision.h"
#include "depthkit/ops/shared_source.h"
#include "depthkit/util/error.h"
#include "depthkit/util/memory.h"

namespace depthkit {

void Transformer::check_fits_in_memory(const ModelConfig& model, const ResidualConfig& residual,
                                       int64_t bytes_per_parameter, const std::string& what) {
  const int64_t n = Transformer(model, residual, at::kMeta, 0).count().total;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, bytes_per_parameter, &bytes) || bytes > physical_memory_bytes())
    fail(what, ": its ", n, " parameters need ", bytes, " bytes (", bytes_per_parameter, " per parameter), beyond this machine's ",
         physical_memory_bytes(), " bytes of memory; reduce model.vocab_size, model.d_model, model.d_ff or model.n_layers",
         model.moe.enabled() ? " (or moe.n_experts, moe.expert_d_ff)" : "");
}

at::ScalarType compute_dtype_of(const TrainConfig& train) {
  return train.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
}

Transformer::Transformer(const ModelConfig& model, const ResidualConfig& residual, at::Device device,
                         uint64_t seed, at::ScalarType dtype, std::optional<at::ScalarType> compute_dtype,
                         const ExpertPlacement& experts, const BranchBuilt& built)
    : cfg_(model), compute_(compute_dtype.value_or(dtype)), params_(device, seed, dtype), ops_(model.impl, device.type()) {
  // The dtypes the fused operators' kernels take (ops/cpu/kernel_math.h).
  if (compute_ != at::kFloat && compute_ != at::kDouble && compute_ != at::kBFloat16)
    fail("the model computes in float32, float64 or bfloat16, not ", compute_);
  // Experts forced onto the grouped product where it cannot run are refused before the first step.
  if (cfg_.moe.enabled() && cfg_.moe.expert_impl == "grouped" && !device.is_meta())
    if (const std::string why = MoeFeedForward::grouped_unsupported(device, compute_, cfg_.d_model, cfg_.moe.expert_d_ff);
        !why.empty())
      fail("building the model: key 'moe.expert_impl' is \"grouped\", but ", why, "; use \"auto\" or \"loop\"");
  // A model whose weights alone exceed the machine's memory is refused before anything is allocated
  // (unless `built` shards it as it is drawn: the trainer has counted the shards).
  if (!device.is_meta() && !built) check_fits_in_memory(model, residual, int64_t(c10::elementSize(dtype)), "building the model");
  const int64_t d = cfg_.d_model, V = cfg_.vocab_size;
  embedding_ = params_.add("embedding", "embedding", {V, d}, Init::Normal, cfg_.init_std);
  // Each branch's parameters, by their names' prefix (layers.i.attention, layers.i.feed_forward).
  branch_members_.resize(size_t(cfg_.n_branches() + 1));
  auto branch_built = [&](int64_t l) {
    const std::string prefix = cat("layers.", (l - 1) / 2, l % 2 == 1 ? ".attention." : ".feed_forward.");
    for (size_t i = 0; i < params_.all().size(); ++i)
      if (params_.all()[i].name.compare(0, prefix.size(), prefix) == 0) branch_members_[size_t(l)].push_back(i);
    if (built) built(params_, l, branch_members_[size_t(l)]);
  };
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    attention_.emplace_back(cfg_, params_, cat("layers.", i, ".attention"));
    branch_built(2 * i + 1);
    if (cfg_.moe.is_moe_layer(i)) {
      feed_forward_.emplace_back();
      moe_.emplace_back(std::in_place, cfg_, params_, cat("layers.", i, ".feed_forward"), experts);
    } else {
      feed_forward_.emplace_back(std::in_place, cfg_, params_, cat("layers.", i, ".feed_forward"));
      moe_.emplace_back();
    }
    branch_built(2 * i + 2);
  }
  stats_.resize(size_t(cfg_.n_layers));
  path_ = make_pathway(residual, cfg_, params_);
  final_norm_ = params_.add("final_norm", "norm", {d}, Init::Ones);
  lm_head_ = cfg_.tie_embeddings ? embedding_
                                 : params_.add("lm_head", "lm_head", {V, d}, Init::Normal, cfg_.init_std);
  if (!device.is_meta()) rope_ = std::make_unique<Rope>(cfg_.resolved_head_dim(), cfg_.seq_len, cfg_.rope_theta, device);
}

at::Tensor Transformer::branch(int64_t l, const at::Tensor& h) const {
  const int64_t layer = (l - 1) / 2;
  if (l % 2 == 1) return attention_[layer].forward(h, *rope_);
  if (moe_[layer]) return moe_[layer]->forward(h, &stats_[layer]);
  return feed_forward_[layer]->forward(h);
}

std::vector<double> MoeTerms::load_max_over_mean() const {
  std::vector<double> out;
  for (const auto& f : load) out.push_back(double(f.size(0)) * f.max().item<double>());
  return out;
}

void Transformer::collect_terms(int64_t first, int64_t last) {
  terms_ = MoeTerms{};
  if (!cfg_.moe.enabled()) return;
  at::Tensor balance, z;
  int64_t moe_layers = 0;  // in the whole model: a pipeline stage's means are its share of the model's
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    if (!moe_[i]) continue;
    ++moe_layers;
    if (i < first || i >= last) continue;
    const MoeStats& s = stats_[i];
    balance = balance.defined() ? balance + s.aux_loss : s.aux_loss;
    z = z.defined() ? z + s.z_loss : s.z_loss;
    terms_.load.push_back(s.load);
    terms_.layers.push_back(i);
  }
  if (terms_.layers.empty()) return;  // a stage without MoE layers
  const double n = double(moe_layers);
  // The optimised auxiliary loss sums the layers' terms (Switch, Megatron); the logged balance
  // and z-loss are their means over layers, so that 1.0 is uniform use at any depth.
  terms_.aux_loss = cfg_.moe.aux_loss_coef * balance + cfg_.moe.z_loss_coef * z;
  terms_.balance = (balance / n).detach();
  terms_.z_loss = (z / n).detach();
}

at::Tensor Transformer::embed(const at::Tensor& tokens) const {
  // The looked-up rows, not the table, are cast: the embedding's gradient stays a float32 scatter.
  return at::embedding(embedding_, tokens).to(compute_);
}

at::Tensor Transformer::hidden(const at::Tensor& tokens, const AfterBranch& after_branch) {
  if (!rope_) fail("model built on the meta device cannot run");
  if (tokens.size(1) > cfg_.seq_len)
    fail("sequence of ", tokens.size(1), " tokens exceeds model.seq_len ", cfg_.seq_len);
  auto state = path_->begin(embed(tokens));
  return run(*state, after_branch, nullptr);
}

void Transformer::set_recompute(const std::string& mode) {
  if (mode != "none" && mode != "branch" && mode != "layer")
    fail("key 'train.recompute' must be one of \"none\", \"branch\", \"layer\", got \"", mode, "\"");
  if (residency_ && mode == "none")
    fail("key 'train.recompute' must be \"branch\" or \"layer\" while the branches' parameters are sharded (train.zero = 3)");
  recompute_ = mode == "layer" ? Recompute::Layer : mode == "branch" ? Recompute::Branch : Recompute::None;
}

void Transformer::set_branch_residency(BranchResidency* residency) {
  if (residency && recompute_ == Recompute::None)
    fail("key 'train.zero' is 3, which needs key 'train.recompute' = \"branch\" or \"layer\": ZeRO-3 gathers a branch's "
         "parameters again in backward, where the branch runs again");
  residency_ = residency;
}

RegionHooks Transformer::residency_hooks(int64_t first, int64_t last) {
  RegionHooks hooks;
  if (!residency_) return hooks;
  hooks.before = [this, first, last](bool backward) {
    for (int64_t k = 0; k <= last - first; ++k) residency_->acquire(backward ? last - k : first + k, backward);
  };
  hooks.after = [this, first, last](bool backward) {
    for (int64_t l = first; l <= last; ++l) residency_->release(l, backward);
  };
  return hooks;
}

at::Tensor Transformer::branch_with_stats(int64_t l, const at::Tensor& h, MoeStats& stats) {
  const int64_t layer = (l - 1) / 2;
  if (l % 2 == 1 || !moe_[size_t(layer)]) return branch(l, h);
  return moe_[size_t(layer)]->forward(h, &stats);
}

void Transformer::recomputed_layer(int64_t i, PathwayState& state) {
  const int64_t first = 2 * i + 1;
  const bool moe = moe_[size_t(i)].has_value();
  // The region's inputs: the state's defined tensors as the layer begins; a copy of the state then,
  // from which backward runs the layer again.
  std::vector<size_t> in_slots;
  std::vector<at::Tensor> inputs;
  {
    const std::vector<StateTensor> all = state.tensors();
    for (size_t k = 0; k < all.size(); ++k)
      if (all[k].tensor->defined()) {
        in_slots.push_back(k);
        inputs.push_back(*all[k].tensor);
      }
  }
  std::shared_ptr<PathwayState> before = state.clone();
  // Its outputs: the slots the layer set (not the sources it only read, which stay the enclosing
  // graph's own tensors, so that later reads add into their accumulators as without
  // recomputation), found by the first run and kept for the next.
  auto out_slots = std::make_shared<std::vector<size_t>>();
  // Per output slot that the pathway made a shared source: the sum its later reads left
  // (fused::shared_source_deferred), which its own reads in this layer continue in backward.
  auto deferred = std::make_shared<std::vector<std::shared_ptr<fused::DeferredSum>>>();
  auto ran = std::make_shared<bool>(false);
  auto load = std::make_shared<at::Tensor>();  // the expert load: not differentiable, the forward run's is kept
  const Region region = [this, first, moe, &state, before, in_slots, out_slots, deferred, ran, load](
                            const std::vector<at::Tensor>& in) {
    // The first run (forward) advances the backbone's state itself; a later one (backward), a copy.
    std::unique_ptr<PathwayState> copy;
    PathwayState* st = &state;
    if (*ran) {
      copy = before->clone();
      st = copy.get();
    }
    st->read_horizon = first + 1;  // this layer's two branches
    {
      const std::vector<StateTensor> into = st->tensors();
      for (size_t k = 0; k < in_slots.size(); ++k) *into[in_slots[k]].tensor = in[k];
    }
    MoeStats stats;
    for (int64_t l = first; l <= first + 1; ++l) path_->write(*st, l, branch_with_stats(l, path_->read(*st, l), stats));
    const std::vector<StateTensor> after = st->tensors();
    if (!*ran)
      for (size_t k = 0; k < after.size(); ++k) {
        const at::Tensor& t = *after[k].tensor;
        const bool passed = std::any_of(in.begin(), in.end(), [&](const at::Tensor& x) { return x.is_same(t); });
        if (t.defined() && !passed) out_slots->push_back(k);
      }
    else
      for (size_t k = 0; k < out_slots->size(); ++k)
        if ((*deferred)[k]) fused::seed_accumulator(*after[(*out_slots)[k]].tensor, (*deferred)[k]->sum);
    *ran = true;
    std::vector<at::Tensor> out;
    for (size_t k : *out_slots) out.push_back(*after[k].tensor);
    if (moe) {  // the MoE branch's aux and z losses as outputs too
      out.push_back(stats.aux_loss);
      out.push_back(stats.z_loss);
      *load = stats.load;
    }
    return out;
  };
  std::vector<at::Tensor> parameters;
  for (int64_t l = first; l <= first + 1; ++l)
    for (size_t k : branch_members_[size_t(l)]) parameters.push_back(params_.all()[k].tensor);
  for (const auto& p : params_.all())
    if (p.component == "residual") parameters.push_back(p.tensor);
  const std::vector<at::Tensor> out = run_recomputed(region, inputs, parameters, residency_hooks(first, first + 1));
  // The outputs laid into the slots the forward run set, now differentiable; a shared source again
  // a shared source of the enclosing graph, whose sum the region's run in backward takes up.
  const std::vector<StateTensor> after = state.tensors();
  deferred->resize(out_slots->size());
  for (size_t k = 0; k < out_slots->size(); ++k) {
    const StateTensor& slot = after[(*out_slots)[k]];
    if (!slot.shared_source) {
      *slot.tensor = out[k];
      continue;
    }
    (*deferred)[k] = std::make_shared<fused::DeferredSum>();
    *slot.tensor = fused::shared_source_deferred(out[k], (*deferred)[k]);
  }
  if (moe) stats_[size_t(i)] = MoeStats{out[out_slots->size()], out[out_slots->size() + 1], *load};
}

at::Tensor Transformer::recomputed_branch(int64_t l, const at::Tensor& h) {
  const int64_t layer = (l - 1) / 2;
  const bool moe = l % 2 == 0 && moe_[size_t(layer)];
  // The expert load is not differentiable: the forward run's is kept, outside the region.
  auto load = std::make_shared<at::Tensor>();
  const Region region = [this, l, moe, load](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    MoeStats s;
    const at::Tensor y = branch_with_stats(l, in[0], s);
    if (!moe) return {y};
    *load = s.load;
    return {y, s.aux_loss, s.z_loss};
  };
  std::vector<at::Tensor> parameters;
  for (size_t i : branch_members_[size_t(l)]) parameters.push_back(params_.all()[i].tensor);
  const std::vector<at::Tensor> out = run_recomputed(region, {h}, parameters, residency_hooks(l, l));
  if (moe) stats_[size_t(layer)] = MoeStats{out[1], out[2], *load};
  return out[0];
}

void Transformer::run_layers(PathwayState& state, int64_t first, int64_t last, const AfterBranch& after_branch,
                             const Decoding* decoding) {
  // Whole layers under layer recomputation (analysis, which looks between branches, and decoding
  // go branch by branch).
  const bool by_layer = recompute_ == Recompute::Layer && !after_branch && !decoding;
  state.read_horizon = 2 * last;
  for (int64_t l = 2 * first + 1; l <= 2 * last; ++l) {
    if (by_layer) {
      recomputed_layer((l - 1) / 2, state);
      ++l;
      continue;
    }
    auto h = path_->read(state, l);
    const int64_t layer = (l - 1) / 2;
    path_->write(state, l,
                 decoding && l % 2 == 1
                     ? attention_[layer].forward(h, *rope_, decoding->state.layers[layer], decoding->chunk)
                     : recompute_ != Recompute::None ? recomputed_branch(l, h) : branch(l, h));
    if (after_branch) after_branch(l, state);
  }
}

void Transformer::run_stage(PathwayState& state, int64_t first, int64_t last) {
  if (!rope_) fail("model built on the meta device cannot run");
  run_layers(state, first, last, {}, nullptr);
  collect_terms(first, last);
}

at::Tensor Transformer::stage_lm_loss(PathwayState& state, const at::Tensor& targets) {
  const at::Tensor h = ops_.rms_norm(path_->finish(state), final_norm_, cfg_.norm_eps).reshape({-1, cfg_.d_model});
  return ops_.cross_entropy(h, cast_like(lm_head_, h), targets.reshape({-1})).to(params_.dtype());
}

at::Tensor Transformer::run(PathwayState& state, const AfterBranch& after_branch, const Decoding* decoding) {
  run_layers(state, 0, cfg_.n_layers, after_branch, decoding);
  collect_terms(0, cfg_.n_layers);
  return ops_.rms_norm(path_->finish(state), final_norm_, cfg_.norm_eps);
}

at::Tensor Transformer::head(const at::Tensor& h) const {
  // The head's product runs in the compute dtype; the logits, and so the cross-entropy and its
  // log-softmax, are taken in the parameters' dtype (float32 under bfloat16 compute).
  return at::linear(h, cast_like(lm_head_, h)).to(params_.dtype());
}

at::Tensor Transformer::logits(const at::Tensor& tokens, const AfterBranch& after_branch) {
  return head(hidden(tokens, after_branch));
}

int64_t DecodeState::bytes() const {
  int64_t n = pathway ? pathway->bytes() : 0;
  for (const KvCache& c : layers) n += c.keys.nbytes() + c.values.nbytes();
  return n;
}

DecodeState Transformer::start_decoding(int64_t batch, int64_t capacity) {
  if (!rope_) fail("model built on the meta device cannot run");
  if (capacity == 0) capacity = cfg_.seq_len;
  if (batch < 1 || capacity < 1 || capacity > cfg_.seq_len)
    fail("decoding: ", batch, " sequences of up to ", capacity, " positions; want at least 1 of 1 … model.seq_len ",
         cfg_.seq_len);
  DecodeState state;
  state.capacity = capacity;
  state.lengths.assign(size_t(batch), 0);
  const auto options = embedding_.options().dtype(compute_);
  const int64_t kv = cfg_.n_kv_heads, hd = cfg_.resolved_head_dim();
  Building building(cat("the K/V caches of ", batch, " sequences of ", capacity, " positions (",
                        2 * cfg_.n_layers * batch * kv * capacity * hd * int64_t(c10::elementSize(compute_)), " bytes)"));
  for (int64_t i = 0; i < cfg_.n_layers; ++i)
    state.layers.push_back({at::zeros({batch, kv, capacity, hd}, options), at::zeros({batch, kv, capacity, hd}, options)});
  state.pathway = path_->start_cache(batch, at::zeros({0}, options));
  return state;
}

at::Tensor Transformer::extend(DecodeState& state, const at::Tensor& tokens, const std::vector<int64_t>& counts) {
  const int64_t B = int64_t(state.lengths.size());
  if (tokens.dim() != 2 || tokens.size(0) != B || tokens.size(1) < 1 || int64_t(counts.size()) != B)
    fail("decoding: a chunk of ", tokens.sizes(), " tokens with ", counts.size(), " counts continues ", B,
         " sequences; want [", B, ", T ≥ 1] and ", B, " counts");
  const int64_t T = tokens.size(1);
  DecodeChunk chunk;
  chunk.lengths = state.lengths;
  chunk.counts = counts;
  chunk.aligned = true;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = counts[size_t(b)], held = state.lengths[size_t(b)];
    if (n < 0 || n > T) fail("decoding: row ", b, " of a chunk of ", T, " positions counts ", n, " real ones");
    if (held + n > state.capacity)
      fail("decoding: sequence ", b, " would hold ", held + n, " positions, beyond its cache's ", state.capacity,
           " (model.seq_len ", cfg_.seq_len, ")");
    chunk.span = std::max(chunk.span, held + n);
    chunk.aligned = chunk.aligned && n == T && held == state.lengths[0];
  }
  if (chunk.span == 0) fail("decoding: a chunk with no real positions in any row of sequences holding none");
  if (residency_) fail("decoding: the model's branch parameters are sharded (train.zero = 3); decode from a checkpoint");
  at::NoGradGuard no_grad;
  // Query t of row b, at position lengths[b] + t, sees the cached positions up to its own.
  const auto index = at::TensorOptions().dtype(at::kLong).device(tokens.device());
  const at::Tensor query_position =
      at::tensor(state.lengths, index).view({B, 1, 1, 1}) + at::arange(T, index).view({1, 1, T, 1});
  chunk.mask = at::arange(chunk.span, index).view({1, 1, 1, chunk.span}) <= query_position;
  const at::Tensor embedded = embed(tokens);
  auto path_state = state.pathway ? path_->resume(embedded, *state.pathway, counts) : path_->begin(embedded);
  const Decoding decoding{state, chunk};
  at::Tensor h = run(*path_state, {}, &decoding);
  for (int64_t b = 0; b < B; ++b) state.lengths[size_t(b)] += counts[size_t(b)];
  return h;
}

at::Tensor Transformer::lm_loss(const at::Tensor& batch) {
  const int64_t T = batch.size(1) - 1;
  auto h = hidden(batch.narrow(1, 0, T)).reshape({-1, cfg_.d_model});
  // The head and the cross-entropy as one operator (the fused one never holds the [tokens,
  // vocabulary] logits), the loss in the accumulation dtype, returned in the parameters'.
  return ops_.cross_entropy(h, cast_like(lm_head_, h), batch.narrow(1, 1, T).reshape({-1})).to(params_.dtype());
}

at::Tensor Transformer::loss(const at::Tensor& batch) {
  auto lm = lm_loss(batch);
  if (!terms_.aux_loss.defined()) return lm;
  terms_.lm_loss = lm.detach();
  auto aux = terms_.aux_loss.to(lm.scalar_type());
  terms_.aux_loss = aux.detach();
  return lm + aux;
}

ParameterCounts Transformer::count() const {
  ParameterCounts c;
  c.total = params_.count();
  c.residual = params_.count("residual");
  const int64_t vocab = params_.count("embedding") + params_.count("lm_head");
  c.non_vocab = c.total - vocab;
  for (const char* comp : {"embedding", "attention", "feed_forward", "norm", "residual", "lm_head"})
    c.by_component.emplace_back(comp, params_.count(comp));
  if (cfg_.moe.enabled())
    for (const char* comp : {"router", "experts"}) c.by_component.emplace_back(comp, params_.count(comp));
  // A token uses top_k of the n_experts routed experts of each MoE layer.
  int64_t unused = 0;
  for (const auto& m : moe_)
    if (m) unused += (cfg_.moe.n_experts - cfg_.moe.top_k) * MoeFeedForward::expert_parameters(cfg_);
  c.active = c.total - unused;
  c.active_non_vocab = c.non_vocab - unused;
  return c;
}

}  // namespace depthkit
