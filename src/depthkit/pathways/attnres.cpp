#include "depthkit/pathways/attnres.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>

#include "depthkit/nn/parameters.h"
#include "depthkit/nn/precision.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/ops/shared_source.h"
#include "depthkit/pathways/registry.h"

namespace depthkit {

namespace {
struct History final : PathwayState {
  // The sources as the read takes them, a list of [B·T, d] (views of [B, T, d]): the embedding,
  // then the completed block summaries. Appending one copies nothing (depth_read, ops/fused.h);
  // each is a shared source, whose gradient the reads add into one buffer (ops/shared_source.h).
  std::vector<at::Tensor> completed;
  std::vector<at::Tensor> values;  // SepV: W_{v,r}·source, mapped once when appended; else empty
  at::Tensor partial;              // sum of the current block's outputs [B, T, d]; undefined at block start
  int64_t B = 0, T = 0, d = 0;
  std::unique_ptr<PathwayState> clone() const override { return std::make_unique<History>(*this); }
  std::vector<StateTensor> tensors() override {
    std::vector<StateTensor> out;
    for (auto* list : {&completed, &values})
      for (at::Tensor& t : *list) out.push_back({&t, true});
    out.push_back({&partial});
    return out;
  }
  at::Tensor flat(const at::Tensor& x) const { return x.reshape({B * T, d}); }
  at::Tensor source(const at::Tensor& x) const { return fused::shared_source(flat(x)); }
  at::Tensor stacked() const { return at::stack(completed).view({-1, B, T, d}); }  // for the observer
};
History& history(PathwayState& s) { return static_cast<History&>(s); }
}  // namespace

AttnRes::AttnRes(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params,
                 const std::string& prefix)
    : schedule_{residual.block_sublayers, model.n_branches(), residual.share_within_block},
      query_(schedule_.branches + 1), ops_(residual.impl, params.device().type(), {"depth_read"}) {
  // Branch 1 has one candidate and no query; a shared query is named after its owner branch.
  for (int64_t l = 2; l <= schedule_.branches; ++l) {
    const int64_t o = schedule_.owner(l);
    if (!query_[o].defined())
      query_[o] = params.add(prefix + ".query." + std::to_string(o), "residual", {model.d_model}, Init::Zeros);
    query_[l] = query_[o];
  }
  out_query_ = params.add(prefix + ".out_query", "residual", {model.d_model}, Init::Zeros);
  if (residual.kind == "attnres_sepv") {
    const int64_t d = model.d_model, n_sources = 1 + schedule_.blocks();
    for (int64_t r = 0; r < n_sources; ++r)  // identity maps: the model starts as AttnRes
      value_maps_.push_back(params.add(prefix + ".value_map." + std::to_string(r), "residual", {d, d}, Init::Identity));
  }
}

std::unique_ptr<PathwayState> AttnRes::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<History>();
  s->B = embedding.size(0), s->T = embedding.size(1), s->d = embedding.size(2);
  s->completed.push_back(s->source(embedding));
  if (!value_maps_.empty()) s->values.push_back(s->source(value(0, embedding)));
  return s;
}

at::Tensor AttnRes::value(size_t r, const at::Tensor& source) const {
  // eq. 4, or eq. 21 (SepV)
  return value_maps_.empty() ? source : at::linear(source, cast_like(value_maps_[r], source));
}

at::Tensor AttnRes::read_sources(const at::Tensor& q, at::TensorList keys, at::TensorList values, int64_t B,
                                 int64_t T) const {
  auto read = ops_.fused("depth_read") ? fused::depth_read : reference::depth_read;
  const at::Tensor query = cast_like(q, keys[0]);  // the operators take one dtype: the activations'
  return std::get<0>(read(query.unsqueeze(0), keys, values, kKeyNormEps))[0].view({B, T, -1});
}

at::Tensor AttnRes::read(PathwayState& state, int64_t l) {
  History& s = history(state);
  const bool first_in_block = schedule_.opens(l);
  const bool sepv = !value_maps_.empty();
  if (first_in_block && s.completed.size() == 1) {  // one candidate (branch 1): its weight is 1
    if (observer_) observer_->on_retrieval(l, 0, at::ones({s.B, s.T, 1}, s.completed[0].options()), false);
    return (sepv ? s.values[0] : s.completed[0]).view({s.B, s.T, s.d});
  }
  if (observer_) observer_->on_retrieval(l, 0, depth_weights(query_[l], s.stacked(), s.partial), s.partial.defined());
  if (first_in_block) return read_sources(query_[l], s.completed, s.values, s.B, s.T);  // eq. 9, i = 1: completed only
  // The block's partial is the last candidate of one softmax over N + 1 (eq. 9; the two-phase
  // form's online-softmax merge, A.6–A.10, computes the same), valued with the map of the source
  // index it will take.
  std::vector<at::Tensor> keys = s.completed, values = s.values;
  keys.push_back(s.flat(s.partial));
  if (sepv) values.push_back(s.flat(value(s.completed.size(), s.partial)));
  return read_sources(query_[l], keys, values, s.B, s.T);
}

void AttnRes::write(PathwayState& state, int64_t l, const at::Tensor& out) {
  History& s = history(state);
  s.partial = schedule_.opens(l) ? out : s.partial + out;
  if (schedule_.closes(l)) {  // block boundary (the last block may be shorter)
    if (!value_maps_.empty()) s.values.push_back(s.source(value(s.completed.size(), s.partial)));
    s.completed.push_back(s.source(s.partial));
    s.partial = at::Tensor();
  }
}

at::Tensor AttnRes::finish(PathwayState& state) {
  History& s = history(state);
  if (observer_) observer_->on_retrieval(schedule_.branches + 1, 0, depth_weights(out_query_, s.stacked(), {}), false);
  return read_sources(out_query_, s.completed, s.values, s.B, s.T);
}

StageState AttnRes::stage_out(PathwayState& state, int64_t) {
  History& s = history(state);
  const bool sepv = !value_maps_.empty();
  StageState out;
  out.width = sepv ? 2 : 1;  // SepV: each source's mapped value travels beside it
  for (size_t i = 0; i < s.completed.size(); ++i) {
    out.sources.push_back(s.completed[i]);
    if (sepv) out.sources.push_back(s.values[i]);
  }
  if (s.partial.defined()) out.carried.push_back(s.partial);
  return out;
}

std::unique_ptr<PathwayState> AttnRes::stage_in(const StageState& in, int64_t, int64_t B, int64_t T) {
  auto s = std::make_unique<History>();
  s->B = B, s->T = T, s->d = in.sources.at(0).size(-1);
  for (size_t i = 0; i < in.sources.size(); i += size_t(in.width)) {
    s->completed.push_back(s->source(in.sources[i]));
    if (in.width == 2) s->values.push_back(s->source(in.sources[i + 1]));
  }
  if (!in.carried.empty()) s->partial = in.carried[0];
  return s;
}

// ---- Registry entries (registry.h) --------------------------------------------------------------

namespace {

// AttnRes (eq. 9, two-phase): keys normalised once per append, per read scores and value sums
// over the completed sources, the partial's norm, score and merge, the block accumulation.
double attnres_flops(const CostShape& s, bool sepv) {
  using namespace cost;
  double f = (s.N + 1) * kNorm * s.d;                              // key norms, once per source
  if (sepv) f += (s.N + 1) * 2 * s.d * s.d;                        // value maps W_v,r (eq. 21)
  for (int64_t l = 2; l <= int64_t(s.L); ++l) {
    f += double(s.completed_before(l)) * (kScore + kValue) * s.d;  // phase 1
    if (!s.first_in_block(l)) {
      f += (kNorm + kScore + kMerge) * s.d + s.d;                  // phase 2, partial += f
      if (sepv) f += 2 * s.d * s.d;                                // the partial's value map
    }
  }
  return f + (s.N + 1) * (kScore + kValue) * s.d;                  // output query
}

PathwayKind attnres_kind(const char* name, bool sepv) {
  PathwayKind k;
  k.name = name;
  k.make = [](const ResidualConfig& r, const ModelConfig& m, ParameterStore& p) {
    return std::make_unique<AttnRes>(r, m, p);
  };
  k.analyses = {"maps"};
  k.flops = [sepv](const CostShape& s, const ResidualConfig&) { return attnres_flops(s, sepv); };
  return k;
}

}  // namespace

PathwayKind attnres_pathway_kind() {
  PathwayKind k = attnres_kind("attnres", false);
  k.traffic = [](const CostShape& s) {
    return std::vector<TrafficTerm>{{"phase 1 (amortised)", s.N / s.S, 1}, {"phase 2", 3, 1}};
  };
  return k;
}

PathwayKind attnres_sepv_pathway_kind() {
  PathwayKind k = attnres_kind("attnres_sepv", true);
  k.traffic = [](const CostShape& s) {  // values read apart from keys; each source and partial mapped
    return std::vector<TrafficTerm>{{"phase 1: keys and values (amortised)", 2 * s.N / s.S, 1},
                                    {"value map of completed sources (amortised)", 1 / s.S, 1 / s.S},
                                    {"value map of the partial", 1, 1},
                                    {"phase 2", 4, 1}};
  };
  return k;
}

}  // namespace depthkit
