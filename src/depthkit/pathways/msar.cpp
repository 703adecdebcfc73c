#include "depthkit/pathways/msar.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/ops/msar_ops.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/shared_source.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {
// Decoding (docs/design.md, "Decoding"): per bank k = 0 … L_b − 1, the last K − 1 positions of the
// one tensor bank k expands in a forward (the embedding, or the state after branch k: a partial,
// or the completed source it becomes), [B, K − 1, d]; zeros before position 0, as the convolution's.
struct Tails final : PathwayCache {
  std::vector<at::Tensor> bank;
  // Each bank's taps as the operators take them (Msar::taps), made once: a cache belongs to the
  // weights it was started with, as its keys and values do. Not counted in bytes(): parameters.
  std::vector<at::Tensor> taps;
  int64_t bytes() const override {
    int64_t n = 0;
    for (const at::Tensor& t : bank) n += t.nbytes();
    return n;
  }
};

struct Sources final : PathwayState {
  // The completed sources, single-stream [B, T, d] each (expanded at each read), and their banks
  // [m − 1, d, K]: lists, never stacked (msar_ops.h).
  std::vector<at::Tensor> raw, taps;
  at::Tensor partial;     // the current block's sum; undefined at block start
  at::Tensor last_input;  // h_ℓ of the last read (for the final residual merge)
  at::Tensor last_output; // f_ℓ(h_ℓ) of the last write
  // Phase 1 of the current block's branches from `block_first` on, (out, ζ) each, made by the
  // first of them to read (msar_block_read: the sources are the same for every branch of a
  // block); slot i is branch block_first + i's, undefined once read. One slot per branch of a
  // block, so that the state's tensors keep their places (the recomputed layers, transformer.cpp).
  std::vector<at::Tensor> block_out, block_lse;
  int64_t block_first = 0;
  // Decoding: the cache this chunk continues, and each row's real positions. Every tensor a bank
  // expands then carries the bank's tail before its T positions (`reach` rows), so the operators
  // see each real position's whole window; they read the T positions only (their `context`).
  Tails* tails = nullptr;
  std::vector<int64_t> counts;
  int64_t reach = 0;
  std::unique_ptr<PathwayState> clone() const override { return std::make_unique<Sources>(*this); }
  std::vector<StateTensor> tensors() override {
    std::vector<StateTensor> out;
    for (at::Tensor& t : raw) out.push_back({&t, true});
    for (at::Tensor& t : taps) out.push_back({&t});
    for (at::Tensor* t : {&partial, &last_input, &last_output}) out.push_back({t});
    for (at::Tensor& t : block_out) out.push_back({&t});
    for (at::Tensor& t : block_lse) out.push_back({&t});
    return out;
  }
};
Sources& sources(PathwayState& s) { return static_cast<Sources&>(s); }
// A state without sources, with a slot per branch of a block.
std::unique_ptr<Sources> new_sources(const BlockSchedule& schedule) {
  auto s = std::make_unique<Sources>();
  s->block_out.resize(size_t(std::min(schedule.size, schedule.branches)));
  s->block_lse.resize(s->block_out.size());
  return s;
}

// x [B, T, d] with bank k's tail before it, [B, reach + T, d]; the tail becomes the last `reach`
// real positions of the result. Without a cache, x.
at::Tensor with_past(Sources& s, int64_t bank, const at::Tensor& x) {
  if (!s.tails) return x;
  at::Tensor& tail = s.tails->bank[size_t(bank)];
  at::Tensor extended = at::cat({tail, x}, 1);
  const int64_t T = x.size(1);
  bool full = true;
  for (int64_t c : s.counts) full = full && c == T;
  if (full) {
    tail = extended.narrow(1, T, s.reach).contiguous();
  } else {  // row b's real positions end at reach + counts[b]
    std::vector<at::Tensor> rows;
    for (size_t b = 0; b < s.counts.size(); ++b) rows.push_back(extended[int64_t(b)].narrow(0, s.counts[b], s.reach));
    tail = at::stack(rows);
  }
  return extended;
}
}  // namespace

Msar::Msar(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params)
    : schedule_{residual.block_sublayers, model.n_branches(), false}, m_(residual.streams), conv_(residual.conv),
      mean_fusion_(residual.fusion == "mean"),
      ops_(residual.impl, params.device().type(), {"msar_block_read", "msar_fuse"}), d_(model.d_model),
      kernels_(residual.kernels), reach_(0), branch_(schedule_.branches + 1), bank_(schedule_.branches) {
  if (conv_ && m_ > 1) reach_ = *std::max_element(kernels_.begin(), kernels_.end()) - 1;
  const int64_t d = model.d_model;
  for (int64_t l = 1; l <= schedule_.branches; ++l) {
    const std::string p = "residual." + std::to_string(l) + ".";
    Branch& b = branch_[l];
    b.queries = params.add(p + "queries", "residual", {m_, d}, Init::Zeros);
    if (!mean_fusion_) {
      b.w_pre = params.add(p + "pre.weight", "residual", {m_, m_ * d}, Init::Normal, model.init_std);
      b.b_pre = params.add(p + "pre.bias", "residual", {m_}, Init::Zeros);
      b.alpha_pre = params.add(p + "pre.scale", "residual", {1}, Init::Constant, kPreScale);
    }
  }
  // The taps at step 0 (residual.conv_init): zeros as the paper; the options start every stream
  // r ≥ 1 non-empty (docs/design.md, "MSAR's first hundred steps").
  auto tap_init = [&](int64_t kappa) -> std::pair<Init, double> {
    if (residual.conv_init == "average") return {Init::Constant, 1.0 / double(kappa)};
    if (residual.conv_init == "normal") return {Init::Normal, model.init_std};
    return {Init::Zeros, 0.0};
  };
  if (conv_)
    for (int64_t k = 0; k < schedule_.branches; ++k)
      for (int64_t r = 1; r < m_; ++r) {
        const auto [init, scale] = tap_init(kernels_[r - 1]);
        bank_[k].push_back(params.add("residual.bank." + std::to_string(k) + ".conv" + std::to_string(r), "residual",
                                      {d, kernels_[r - 1]}, init, scale));
      }
}

at::Tensor Msar::taps(int64_t bank) const {
  if (!conv_ || m_ == 1) return at::ones({m_ - 1, d_, 1}, branch_[1].queries.options());  // identity taps
  int64_t K = 0;
  for (int64_t k : kernels_) K = std::max(K, k);
  std::vector<at::Tensor> padded;
  for (const at::Tensor& c : bank_[bank]) padded.push_back(at::constant_pad_nd(c, {0, K - c.size(1)}));
  return at::stack(padded);
}

at::Tensor Msar::taps_of(PathwayState& state, int64_t bank) const {
  Sources& s = sources(state);
  return s.tails ? s.tails->taps[size_t(bank)] : taps(bank);
}

void Msar::append(PathwayState& state, const at::Tensor& source, int64_t bank) const {
  Sources& s = sources(state);
  s.raw.push_back(fused::shared_source(with_past(s, bank, source)));  // its reads add its gradient into one buffer
  s.taps.push_back(taps_of(state, bank));
}

std::unique_ptr<PathwayState> Msar::begin(const at::Tensor& embedding) {
  auto s = new_sources(schedule_);
  append(*s, embedding, 0);  // bank 0: the embedding
  return s;
}

std::unique_ptr<PathwayCache> Msar::start_cache(int64_t batch, const at::Tensor& like) const {
  if (reach_ == 0) return nullptr;
  auto tails = std::make_unique<Tails>();
  for (int64_t k = 0; k < schedule_.branches; ++k) {
    tails->bank.push_back(at::zeros({batch, reach_, d_}, like.options()));
    tails->taps.push_back(cast_like(taps(k), like));  // in the activations' dtype, as read() casts them
  }
  return tails;
}

std::unique_ptr<PathwayState> Msar::resume(const at::Tensor& embedding, PathwayCache& cache,
                                           const std::vector<int64_t>& counts) {
  auto s = new_sources(schedule_);
  s->tails = &static_cast<Tails&>(cache);
  s->counts = counts;
  s->reach = reach_;
  append(*s, embedding, 0);
  return s;
}

at::Tensor Msar::read(PathwayState& state, int64_t l) {
  Sources& s = sources(state);
  const Branch& b = branch_[l];
  if (observer_ && !s.tails) observe_read(state, l);  // not while decoding
  auto block_read = ops_.fused("msar_block_read") ? fused::msar_block_read : reference::msar_block_read;
  auto fuse = ops_.fused("msar_fuse") ? fused::msar_fuse : reference::msar_fuse;
  // The parameters in the activations' dtype: the operators take one dtype.
  auto in_dtype = [&](const at::Tensor& w) { return cast_like(w, s.raw[0]); };
  const at::Tensor queries = in_dtype(b.queries);
  // The kernels' lengths: their taps past it are padding (Msar::taps), which the operators skip.
  const c10::OptionalIntArrayRef lengths = conv_ && m_ > 1 ? c10::OptionalIntArrayRef(kernels_) : std::nullopt;
  // Phase 1 over the completed sources, expanded by their banks (eq. 10–12), for this branch and
  // the rest of its block at once (their sources are the same): made by the block's first read
  // (or the first after a pipeline stage boundary or a recomputed layer's, PathwayState's
  // read_horizon), taken by each branch.
  const size_t slot = size_t(l - s.block_first);
  if (s.block_first == 0 || l < s.block_first || slot >= s.block_out.size() || !s.block_out[slot].defined()) {
    // (Up to the block's last branch, or to the backbone's horizon where that comes first.)
    const int64_t last = std::max(l, std::min({schedule_.block_of(l) * schedule_.size, schedule_.branches,
                                               state.read_horizon}));
    std::vector<at::Tensor> queries_of, banks;
    for (int64_t k = l; k <= last; ++k) queries_of.push_back(k == l ? queries : in_dtype(branch_[k].queries));
    for (const at::Tensor& c : s.taps) banks.push_back(in_dtype(c));
    // While decoding, every expanded tensor carries its bank's tail first (with_past): a context
    // of `reach` positions, which feeds the new positions' windows and is not read itself.
    auto [outs, lses] = block_read(queries_of, s.raw, banks, kKeyNormEps, lengths, s.reach);
    s.block_first = l;
    for (size_t k = 0; k < outs.size(); ++k) {
      s.block_out[k] = outs[k];
      s.block_lse[k] = lses[k];
    }
  }
  const size_t taken = size_t(l - s.block_first);
  const at::Tensor out = std::exchange(s.block_out[taken], at::Tensor());
  const at::Tensor lse = std::exchange(s.block_lse[taken], at::Tensor());
  // Phase 2: the partial expanded by bank ℓ−1 (absent at a block's first branch), then the
  // H_pre fusion (eq. 13–14) or the mean.
  const bool with_partial = !schedule_.opens(l);
  s.last_input = fuse(out, lse, queries, with_partial ? with_past(s, l - 1, s.partial) : at::Tensor(),
                      with_partial ? in_dtype(taps_of(s, l - 1)) : at::Tensor(), in_dtype(b.w_pre), in_dtype(b.b_pre),
                      in_dtype(b.alpha_pre), kKeyNormEps, lengths, with_partial ? s.reach : 0);
  return s.last_input;
}

void Msar::observe_read(PathwayState& state, int64_t l) const {
  Sources& s = sources(state);
  const Branch& b = branch_[l];
  std::vector<at::Tensor> expanded;
  for (size_t i = 0; i < s.raw.size(); ++i)
    expanded.push_back(reference::msar_expand(s.raw[i], s.taps[i]));
  at::Tensor completed = at::stack(expanded, 1);  // [m, N, B, T, d]
  at::Tensor part = schedule_.opens(l) ? at::Tensor() : reference::msar_expand(s.partial, taps(l - 1));
  for (int64_t r = 0; r < m_; ++r)
    observer_->on_retrieval(l, r, depth_weights(b.queries[r], completed[r], part.defined() ? part[r] : part),
                            part.defined());
  // The streams' keys before normalisation, gates and shares (the read again, by the references).
  const at::Tensor key_rms = completed.square().mean(-1).sqrt().mean(1).permute({1, 2, 0});  // [B, T, m]
  const c10::OptionalIntArrayRef lengths = conv_ && m_ > 1 ? c10::OptionalIntArrayRef(kernels_) : std::nullopt;
  auto [out, lse] = reference::msar_read(b.queries, s.raw, s.taps, kKeyNormEps, lengths);
  const at::Tensor Z = reference::msar_merged_streams(out, lse, b.queries, part.defined() ? s.partial : at::Tensor(),
                                                      part.defined() ? taps(l - 1) : at::Tensor(), kKeyNormEps,
                                                      lengths);  // [B, T, m, d]
  const at::Tensor gates = mean_fusion_ ? at::full_like(key_rms, 1.0 / double(m_))
                                        : reference::msar_fusion_gates(Z, b.w_pre, b.b_pre, b.alpha_pre, kKeyNormEps);
  const at::Tensor norms = (gates.unsqueeze(-1) * Z).square().sum(-1).sqrt();  // [B, T, m]
  observer_->on_stream_fusion(l, key_rms, gates, norms / norms.sum(-1, true).clamp_min(1e-30));
}

void Msar::write(PathwayState& state, int64_t l, const at::Tensor& out) {
  Sources& s = sources(state);
  s.last_output = out;
  s.partial = schedule_.opens(l) ? out : s.partial + out;  // eq. 16
  if (schedule_.closes(l)) {  // eq. 15: block complete
    if (l < schedule_.branches) append(s, s.partial, l);  // bank of its last branch
    s.partial = at::Tensor();
  }
}

at::Tensor Msar::finish(PathwayState& state) {
  Sources& s = sources(state);
  return s.last_input + s.last_output;  // residual merge of the last branch
}

StageState Msar::stage_out(PathwayState& state, int64_t) {
  Sources& s = sources(state);
  if (s.tails) fail("residual.kind \"msar\": a decoding state cannot cross a pipeline stage boundary");
  // Single-stream sources only (MSAR §3.4): each stage expands them by their banks itself.
  StageState out;
  out.sources = s.raw;
  if (s.partial.defined()) out.carried.push_back(s.partial);
  return out;
}

std::unique_ptr<PathwayState> Msar::stage_in(const StageState& in, int64_t, int64_t, int64_t) {
  auto s = new_sources(schedule_);
  // Source i ≥ 1 is block i's sum, appended by its last branch i·S with that branch's bank.
  for (size_t i = 0; i < in.sources.size(); ++i)
    append(*s, in.sources[i], i == 0 ? 0 : std::min(int64_t(i) * schedule_.size, schedule_.branches));
  if (!in.carried.empty()) s->partial = in.carried[0];
  return s;
}

// ---- Registry entry (registry.h) ----------------------------------------------------------------

PathwayKind msar_pathway_kind() {
  PathwayKind k;
  k.name = "msar";
  k.make = [](const ResidualConfig& r, const ModelConfig& m, ParameterStore& p) { return std::make_unique<Msar>(r, m, p); };
  k.validate = [](const ResidualConfig& r, const std::string& where) {
    if (r.conv && int64_t(r.kernels.size()) != r.streams - 1)
      fail(where, ": key 'residual.kernels' has ", r.kernels.size(), " kernel sizes; MSAR with residual.streams = ",
           r.streams, " needs ", r.streams - 1, " (stream 0 is the identity)");
  };
  k.analyses = {"maps", "streams"};
  // eq. 10–17: causal depthwise expansion of each source (once, N appends; the last output is
  // merged, not expanded) and of each partial, per-stream reads, H_pre fusion.
  k.flops = [](const CostShape& s, const ResidualConfig& r) {
    using namespace cost;
    const double conv = r.conv ? 2 * s.d * double(std::accumulate(r.kernels.begin(), r.kernels.end(), int64_t(0))) : 0;
    double f = s.N * (conv + s.m * kNorm * s.d);
    for (int64_t l = 1; l <= int64_t(s.L); ++l) {
      f += s.m * double(s.completed_before(l)) * (kScore + kValue) * s.d;
      if (!s.first_in_block(l)) f += conv + s.m * (kNorm + kScore + kMerge) * s.d + s.d;
      f += r.fusion == "mean" ? s.m * s.d
                              : kNorm * s.m * s.d + 2 * s.m * s.d * s.m + 2 * s.m * s.d;  // Norm, W_pre, Σ H_pre Z
    }
    return f + s.d;  // h_L + f_L(h_L)
  };
  k.traffic = [](const CostShape& s) {
    const double NS = s.N / s.S, m = s.m;
    return std::vector<TrafficTerm>{{"phase 1: logits (amortised)", NS / 2, 0},
                                    {"phase 1: values (amortised)", NS / 2, m},
                                    {"phase 2: partial update and scoring", 2, 1},
                                    {"phase 2: merge and H_pre gate", m + 1, m},
                                    {"stream aggregation", m, 1}};
  };
  return k;
}

}  // namespace depthkit
