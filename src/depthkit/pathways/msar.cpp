#include "depthkit/pathways/msar.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/stack.h>

#include <algorithm>

#include "depthkit/model/parameters.h"
#include "depthkit/ops/depth_attention.h"
#include "depthkit/ops/msar_ops.h"

namespace depthkit {

namespace {
struct Sources final : PathwayState {
  std::vector<at::Tensor> expanded;  // reference: completed sources, already expanded: [m, B, T, d] each
  StackedHistory raw;                // fused: completed sources, single-stream [B, T, d] each
  StackedHistory taps;               // fused: their banks, [m − 1, d, K] each
  std::vector<int64_t> banks;        // the bank index of each completed source
  at::Tensor partial;                // the current block's sum; undefined at block start
  at::Tensor last_input;             // h_ℓ of the last read (for the final residual merge)
  at::Tensor last_output;            // f_ℓ(h_ℓ) of the last write
};
Sources& sources(PathwayState& s) { return static_cast<Sources&>(s); }
}  // namespace

Msar::Msar(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params)
    : schedule_{residual.block_sublayers, model.n_branches()}, m_(residual.streams), conv_(residual.conv),
      mean_fusion_(residual.fusion == "mean"), fused_(residual.impl == "fused"), d_(model.d_model),
      kernels_(residual.kernels), branch_(schedule_.branches + 1), bank_(schedule_.branches) {
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
  if (conv_)
    for (int64_t k = 0; k < schedule_.branches; ++k)
      for (int64_t r = 1; r < m_; ++r)
        bank_[k].push_back(params.add("residual.bank." + std::to_string(k) + ".conv" + std::to_string(r), "residual",
                                      {d, kernels_[r - 1]}, Init::Zeros));
}

at::Tensor Msar::expand(const at::Tensor& x, int64_t bank) const {
  std::vector<at::Tensor> out = {x};  // stream 0: the identity
  if (!conv_) {
    for (int64_t r = 1; r < m_; ++r) out.push_back(x);  // ablation: replicated sources
    return at::stack(out);
  }
  const int64_t T = x.size(1), d = x.size(2);
  at::Tensor channels = x.transpose(1, 2);  // [B, d, T]
  for (int64_t r = 1; r < m_; ++r) {
    const at::Tensor& c = bank_[bank][r - 1];  // [d, κ], c[:, δ] weighs x_{t−δ} (eq. 10)
    const int64_t k = c.size(1);
    // conv1d correlates: out_t = Σ_j w_j x_{t−(κ−1)+j} after κ−1 zeros on the left, so w_j = c_{κ−1−j}.
    at::Tensor padded = at::constant_pad_nd(channels, {k - 1, 0});
    at::Tensor y = at::conv1d(padded, c.flip({1}).unsqueeze(1), std::nullopt, at::IntArrayRef{1}, at::IntArrayRef{0},
                              at::IntArrayRef{1}, d);
    out.push_back(y.transpose(1, 2).narrow(1, 0, T));
  }
  return at::stack(out);
}

at::Tensor Msar::taps(int64_t bank) const {
  if (!conv_ || m_ == 1) return at::ones({m_ - 1, d_, 1}, branch_[1].queries.options());  // identity taps
  int64_t K = 0;
  for (int64_t k : kernels_) K = std::max(K, k);
  std::vector<at::Tensor> padded;
  for (const at::Tensor& c : bank_[bank]) padded.push_back(at::constant_pad_nd(c, {0, K - c.size(1)}));
  return at::stack(padded);
}

void Msar::append(PathwayState& state, const at::Tensor& source, int64_t bank) const {
  Sources& s = sources(state);
  s.banks.push_back(bank);
  if (fused_) {
    s.raw.push(source);
    s.taps.push(taps(bank));
  } else {
    s.expanded.push_back(expand(source, bank));
  }
}

std::unique_ptr<PathwayState> Msar::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<Sources>();
  append(*s, embedding, 0);  // bank 0: the embedding
  return s;
}

at::Tensor Msar::read(PathwayState& state, int64_t l) {
  Sources& s = sources(state);
  const Branch& b = branch_[l];
  const bool first_in_block = schedule_.opens(l);
  if (observer_) observe_read(state, l);
  if (fused_) {
    auto [out, lse] = fused::msar_read(b.queries, s.raw.stacked(), s.taps.stacked(), kKeyNormEps);
    std::optional<at::Tensor> part, part_taps, w, bias, alpha;
    if (!first_in_block) {
      part = s.partial;
      part_taps = taps(l - 1);  // bank ℓ−1
    }
    if (!mean_fusion_) {
      w = b.w_pre;
      bias = b.b_pre;
      alpha = b.alpha_pre;
    }
    s.last_input = fused::msar_fuse(out, lse, b.queries, part, part_taps, w, bias, alpha, kKeyNormEps);
    return s.last_input;
  }
  at::Tensor completed = at::stack(s.expanded, 1);  // [m, N, B, T, d]
  at::Tensor part = first_in_block ? at::Tensor() : expand(s.partial, l - 1);  // bank ℓ−1
  std::vector<at::Tensor> z;
  for (int64_t r = 0; r < m_; ++r) {  // per-stream depth attention (eq. 11–12, 17)
    at::Tensor q = b.queries[r];
    DepthRead hist = depth_read(q, completed[r], completed[r]);
    z.push_back(first_in_block ? hist.out : merge_partial(hist, q, part[r], part[r]));
  }
  at::Tensor Z = at::stack(z, -2);  // [B, T, m, d]
  if (mean_fusion_) {
    s.last_input = Z.mean(-2);
  } else {  // eq. 13–14
    at::Tensor flat = key_norm(Z.flatten(-2));
    at::Tensor pre = at::sigmoid(b.alpha_pre * at::linear(flat, b.w_pre) + b.b_pre);  // [B, T, m]
    s.last_input = (pre.unsqueeze(-1) * Z).sum(-2);
  }
  return s.last_input;
}

void Msar::observe_read(PathwayState& state, int64_t l) const {
  Sources& s = sources(state);
  std::vector<at::Tensor> expanded = s.expanded;
  if (fused_)
    for (size_t i = 0; i < s.raw.size(); ++i) expanded.push_back(expand(s.raw.entries()[i], s.banks[i]));
  at::Tensor completed = at::stack(expanded, 1);  // [m, N, B, T, d]
  at::Tensor part = schedule_.opens(l) ? at::Tensor() : expand(s.partial, l - 1);
  for (int64_t r = 0; r < m_; ++r)
    observer_->on_retrieval(l, r, depth_weights(branch_[l].queries[r], completed[r], part.defined() ? part[r] : part),
                            part.defined());
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

}  // namespace depthkit
