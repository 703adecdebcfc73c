#include "depthkit/pathways/attnres.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/stack.h>

#include "depthkit/model/parameters.h"
#include "depthkit/ops/depth_attention.h"

namespace depthkit {

namespace {
struct History final : PathwayState {
  std::vector<at::Tensor> completed;  // [B, T, d] each: embedding, then completed block summaries
  at::Tensor partial;                 // sum of the current block's outputs; undefined at block start
};
History& history(PathwayState& s) { return static_cast<History&>(s); }
}  // namespace

AttnRes::AttnRes(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params)
    : block_(residual.block_sublayers), branches_(model.n_branches()), query_(branches_ + 1) {
  for (int64_t l = 2; l <= branches_; ++l)
    query_[l] = params.add("residual.query." + std::to_string(l), "residual", {model.d_model}, Init::Zeros);
  out_query_ = params.add("residual.out_query", "residual", {model.d_model}, Init::Zeros);
}

std::unique_ptr<PathwayState> AttnRes::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<History>();
  s->completed.push_back(embedding);
  return s;
}

at::Tensor AttnRes::read(PathwayState& state, int64_t l) {
  History& s = history(state);
  const bool first_in_block = (l - 1) % block_ == 0;
  if (first_in_block && s.completed.size() == 1) return s.completed[0];  // one candidate: weight 1
  at::Tensor sources = at::stack(s.completed);  // keys = values (eq. 4)
  DepthRead hist = depth_read(query_[l], sources, sources);
  if (first_in_block) return hist.out;  // eq. 9, i = 1: completed sources only
  return merge_partial(hist, query_[l], s.partial, s.partial);
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
  at::Tensor sources = at::stack(history(state).completed);
  return depth_read(out_query_, sources, sources).out;
}

}  // namespace depthkit
