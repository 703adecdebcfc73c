#include "depthkit/pathways/attnres_mhc.h"

#include <ATen/TensorOperators.h>

#include "depthkit/pathways/registry.h"
namespace depthkit {

namespace {
struct Both final : PathwayState {
  std::unique_ptr<PathwayState> attnres, mhc;
  std::unique_ptr<PathwayState> clone() const override {
    auto c = std::make_unique<Both>();
    c->attnres = attnres->clone();
    c->mhc = mhc->clone();
    return c;
  }
  std::vector<StateTensor> tensors() override {
    std::vector<StateTensor> out = attnres->tensors();
    for (const StateTensor& t : mhc->tensors()) out.push_back(t);
    return out;
  }
};
Both& both(PathwayState& s) { return static_cast<Both&>(s); }

ResidualConfig as(ResidualConfig c, const char* kind) {
  c.kind = kind;
  return c;
}
}  // namespace

AttnResMhc::AttnResMhc(const ResidualConfig& residual, const ModelConfig& model, ParameterStore& params)
    : attnres_(as(residual, "attnres"), model, params, "residual.attnres"),
      mhc_(as(residual, "mhc"), model, params, "residual.mhc") {}

std::unique_ptr<PathwayState> AttnResMhc::begin(const at::Tensor& embedding) {
  auto s = std::make_unique<Both>();
  s->attnres = attnres_.begin(embedding);
  s->mhc = mhc_.begin(embedding);
  return s;
}

at::Tensor AttnResMhc::read(PathwayState& state, int64_t l) {
  return attnres_.read(*both(state).attnres, l) + mhc_.read(*both(state).mhc, l);
}

void AttnResMhc::write(PathwayState& state, int64_t l, const at::Tensor& out) {
  attnres_.write(*both(state).attnres, l, out);
  mhc_.write(*both(state).mhc, l, out);
}

at::Tensor AttnResMhc::finish(PathwayState& state) {
  return attnres_.finish(*both(state).attnres) + mhc_.finish(*both(state).mhc);
}

// AttnRes's sources and partial, then mHC's streams as the last carried tensor.
StageState AttnResMhc::stage_out(PathwayState& state, int64_t l) {
  StageState out = attnres_.stage_out(*both(state).attnres, l);
  out.carried.push_back(mhc_.stage_out(*both(state).mhc, l).carried.at(0));
  return out;
}

std::unique_ptr<PathwayState> AttnResMhc::stage_in(const StageState& in, int64_t l, int64_t B, int64_t T) {
  StageState attnres = in;
  attnres.carried.pop_back();
  auto s = std::make_unique<Both>();
  s->attnres = attnres_.stage_in(attnres, l, B, T);
  s->mhc = mhc_.stage_in({{}, 1, {in.carried.back()}}, l, B, T);
  return s;
}


void AttnResMhc::set_observer(PathwayObserver* observer) {
  attnres_.set_observer(observer);  // the retrieval weights are AttnRes's
  mhc_.set_observer(observer);
}

std::map<std::string, bool> AttnResMhc::operators() const {
  std::map<std::string, bool> ops = attnres_.operators();
  ops.merge(mhc_.operators());
  return ops;
}

std::vector<at::Tensor> AttnResMhc::stream_states(PathwayState& state) { return mhc_.stream_states(*both(state).mhc); }

void AttnResMhc::set_stream_states(PathwayState& state, const std::vector<at::Tensor>& states) {
  check_stream_count(states, stream_states(state).size(), kind());
  mhc_.set_stream_states(*both(state).mhc, states);
}

// ---- Registry entry (registry.h) ----------------------------------------------------------------

PathwayKind attnres_mhc_pathway_kind() {
  PathwayKind k;
  k.name = "attnres_mhc";
  k.make = [](const ResidualConfig& r, const ModelConfig& m, ParameterStore& p) {
    return std::make_unique<AttnResMhc>(r, m, p);
  };
  k.analyses = {"maps", "cka", "rescue"};
  // Both pathways' terms, plus each branch's sum of the two reads and the final one.
  k.flops = [](const CostShape& s, const ResidualConfig& r) {
    return pathway_kind("attnres").flops(s, r) + pathway_kind("mhc").flops(s, r) + s.L * s.d + s.d;
  };
  k.traffic = [](const CostShape& s) {
    std::vector<TrafficTerm> rows = pathway_kind("attnres").traffic(s);
    for (TrafficTerm& t : pathway_kind("mhc").traffic(s)) rows.push_back(t);
    rows.push_back({"sum of the two reads", 2, 1});
    return rows;
  };
  return k;
}

}  // namespace depthkit
