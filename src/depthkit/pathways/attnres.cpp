#include "depthkit/pathways/attnres.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/stack.h>

#include "depthkit/model/parameters.h"
#include "depthkit/ops/depth_attention.h"
#include "depthkit/ops/fused.h"

namespace depthkit {

namespace {
struct History final : PathwayState {
  std::vector<at::Tensor> completed;  // [B, T, d] each: embedding, then completed block summaries
  at::Tensor partial;                 // sum of the current block's outputs; undefined at block start
};
History& history(PathwayState& s) { return static_cast<History&>(s); }
}  // namespace

AttnRes::AttnRes(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params,
                 const std::string& prefix)
    : block_(residual.block_sublayers), branches_(model.n_branches()), query_(branches_ + 1),
      fused_(residual.impl == "fused") {
  for (int64_t l = 2; l <= branches_; ++l)
    query_[l] = params.add(prefix + ".query." + std::to_string(l), "residual", {model.d_model}, Init::Zeros);
  out_query_ = params.add(prefix + ".out_query", "residual", {model.d_model}, Init::Zeros);
  if (residual.kind == "attnres_sepv") {
    const int64_t d = model.d_model, n_sources = 1 + (branches_ + block_ - 1) / block_;
    for (int64_t r = 0; r < n_sources; ++r)  // identity maps: the model starts as AttnRes
      value_maps_.push_back(params.add(prefix + ".value_map." + std::to_string(r), "residual", {d, d}, Init::Identity));
  }
}

std::unique_ptr<PathwayState> AttnRes::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<History>();
  s->completed.push_back(embedding);
  return s;
}

at::Tensor AttnRes::values(const std::vector<at::Tensor>& sources) const {
  if (value_maps_.empty()) return at::stack(sources);  // keys = values (eq. 4)
  std::vector<at::Tensor> mapped;
  for (size_t r = 0; r < sources.size(); ++r) mapped.push_back(at::linear(sources[r], value_maps_[r]));  // eq. 21
  return at::stack(mapped);
}

at::Tensor AttnRes::read_sources(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& vals,
                                 const at::Tensor& key_part, const at::Tensor& value_part) const {
  if (!fused_) {
    DepthRead hist = depth_read(q, keys, vals);
    return key_part.defined() ? merge_partial(hist, q, key_part, value_part) : hist.out;
  }
  const int64_t N = keys.size(0), B = keys.size(1), T = keys.size(2), d = keys.size(3);
  auto [out, lse] = fused::depth_read(q.unsqueeze(0), keys.reshape({N, B * T, d}), vals.reshape({N, B * T, d}),
                                      kKeyNormEps);
  at::Tensor h = key_part.defined() ? fused::depth_merge(out[0], lse[0], q, key_part.reshape({B * T, d}),
                                                         value_part.reshape({B * T, d}), kKeyNormEps)
                                    : out[0];
  return h.view({B, T, d});
}

at::Tensor AttnRes::read(PathwayState& state, int64_t l) {
  History& s = history(state);
  const bool first_in_block = (l - 1) % block_ == 0;
  if (first_in_block && s.completed.size() == 1)  // one candidate: its weight is 1
    return value_maps_.empty() ? s.completed[0] : at::linear(s.completed[0], value_maps_[0]);
  at::Tensor keys = at::stack(s.completed), vals = values(s.completed);
  if (first_in_block) return read_sources(query_[l], keys, vals, {}, {});  // eq. 9, i = 1: completed only
  const at::Tensor v_part =
      value_maps_.empty() ? s.partial : at::linear(s.partial, value_maps_[s.completed.size()]);
  return read_sources(query_[l], keys, vals, s.partial, v_part);
}

void AttnRes::write(PathwayState& state, int64_t l, const at::Tensor& out) {
  History& s = history(state);
  s.partial = (l - 1) % block_ == 0 ? out : s.partial + out;
  if (l % block_ == 0 || l == branches_) {  // block boundary (the last block may be shorter)
    s.completed.push_back(s.partial);
    s.partial = at::Tensor();
  }
}

at::Tensor AttnRes::finish(PathwayState& state) {
  const auto& completed = history(state).completed;
  return read_sources(out_query_, at::stack(completed), values(completed), {}, {});
}

}  // namespace depthkit
