// Analysis and accounting: MSAR Table 6's traffic, FLOPs against the model's own parameters,
// scaling fits on points with known A and β, linear CKA against its Gram-matrix form, and the
// pathway observer and interventions that `depthkit analyze` relies on.
#include <ATen/ops/allclose.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/linalg_qr.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <map>

#include "depthkit/model/accounting.h"
#include "depthkit/analysis/analyze.h"
#include "depthkit/analysis/scaling.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/model/transformer.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/pathways/msar.h"
#include "depthkit/pathways/pathway.h"
#include "depthkit/util/fs.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

namespace {

CostReport cost_of(const std::string& kind, int64_t n_layers, int64_t S, int64_t m, int64_t d = 64) {
  ModelConfig model;
  model.n_layers = n_layers;
  model.d_model = d;
  ResidualConfig r;
  r.kind = kind;
  r.block_sublayers = S;
  r.streams = m;
  return training_cost(model, r);
}

}  // namespace

// Parameter counts of the pathways against the papers' tables and equations.
namespace {

int64_t residual_params(const std::string& config, const std::vector<std::string>& sets) {
  Config c = parse_config(read_file(config), config, sets);
  return Transformer(c.model, c.residual, at::kMeta, 0).count().residual;
}

int64_t non_vocab(const std::string& config, const std::vector<std::string>& sets) {
  Config c = parse_config(read_file(config), config, sets);
  return Transformer(c.model, c.residual, at::kMeta, 0).count().non_vocab;
}

}  // namespace

TEST(Accounting, MhcMatchesDarTableA3) {
  // DAR Table A.3: mHC (m = 4) 100.292M and 308.062M non-vocabulary parameters.
  const std::string dir = source_dir() + "/configs/paper/";
  EXPECT_EQ((non_vocab(dir + "dense-0.1b.toml", {"residual.kind=mhc"}) + 500) / 1000, 100'292);
  EXPECT_EQ((non_vocab(dir + "dense-0.3b.toml", {"residual.kind=mhc"}) + 500) / 1000, 308'062);
  // Per branch: md(m² + 2m) + m² + 2m + 3.
  const int64_t m = 4, d = 640, L = 32;
  EXPECT_EQ(residual_params(dir + "dense-0.1b.toml", {"residual.kind=mhc"}), L * (m * d * (m * m + 2 * m) + m * m + 2 * m + 3));
  EXPECT_EQ(residual_params(dir + "dense-0.1b.toml", {"residual.kind=mhc", "residual.streams=2"}),
            L * (2 * d * 8 + 8 + 3));
}

TEST(Accounting, MsarMatchesEquation20) {
  // MSAR eq. 20 with m = 4, κ = {4, 8, 12}: L_b(44d + 5), at the 18B and 28B backbones' depth and width.
  const std::string cfg = source_dir() + "/configs/paper/dense-0.1b.toml";
  EXPECT_EQ(residual_params(cfg, {"residual.kind=msar", "residual.block_sublayers=8", "model.n_layers=28",
                                  "model.d_model=2112", "model.n_heads=16", "model.n_kv_heads=8", "model.head_dim=128"}),
            5'204'248);
  EXPECT_EQ(residual_params(cfg, {"residual.kind=msar", "residual.block_sublayers=8", "model.n_layers=32",
                                  "model.d_model=2560", "model.n_heads=20", "model.n_kv_heads=10", "model.head_dim=128"}),
            7'209'280);
  // Ablations: no convolution banks; mean fusion has no W_pre, b_pre, α_pre.
  const int64_t d = 640, L = 32;
  EXPECT_EQ(residual_params(cfg, {"residual.kind=msar", "residual.conv=false"}), L * ((16 + 4) * d + 5));
  EXPECT_EQ(residual_params(cfg, {"residual.kind=msar", "residual.fusion=\"mean\""}), L * ((4 + 24) * d));
}

TEST(Accounting, SepVAddsOneMapPerSource) {
  const std::string cfg = source_dir() + "/configs/paper/dense-0.1b.toml";
  const int64_t d = 640, L = 32;
  EXPECT_EQ(residual_params(cfg, {"residual.kind=attnres_sepv", "residual.block_sublayers=4"}), L * d + (1 + 8) * d * d);
  EXPECT_EQ(residual_params(cfg, {"residual.kind=attnres_mhc", "residual.block_sublayers=4"}),
            L * d + residual_params(cfg, {"residual.kind=mhc"}));
}

TEST(Accounting, TrafficMatchesMsarTable6) {
  // N = 8 blocks of S = 16 branches (64 layers), m = 4: the Typical column of MSAR Table 6.
  EXPECT_DOUBLE_EQ(cost_of("residual", 64, 16, 4).traffic_d(), 3.0);
  EXPECT_DOUBLE_EQ(cost_of("mhc", 64, 16, 4).traffic_d(), 34.0);
  EXPECT_DOUBLE_EQ(cost_of("attnres", 64, 16, 4).traffic_d(), 5.5);
  EXPECT_DOUBLE_EQ(cost_of("msar", 64, 16, 4).traffic_d(), 21.5);
  // The symbolic forms: (8m + 2)d, (N/S + 5)d, (N/S + 4m + 5)d; DAR by the same conventions.
  EXPECT_DOUBLE_EQ(cost_of("mhc", 8, 2, 2).traffic_d(), 18.0);
  EXPECT_DOUBLE_EQ(cost_of("attnres", 8, 2, 4).traffic_d(), 8.0 / 2 + 5);
  EXPECT_DOUBLE_EQ(cost_of("msar", 8, 4, 3).traffic_d(), 4.0 / 4 + 12 + 5);
  EXPECT_DOUBLE_EQ(cost_of("dar", 64, 16, 4).traffic_d(), 2 * 0.5 + 12);
  EXPECT_EQ(cost_of("dar", 64, 16, 4).streams, 2);
}

TEST(Accounting, TrainingTrafficIsTheForwardsTwiceOverEveryBranchAndToken) {
  // `bench --kinds`'s traffic bound: the per-token, per-branch forward figure × d × bytes ×
  // branches × tokens, doubled for the backward. Residual at d 64, 4 layers (8 branches), 1,000
  // tokens in float32: 2 · 3 · 64 · 4 · 8 · 1000 bytes.
  EXPECT_DOUBLE_EQ(cost_of("residual", 4, 2, 4).training_traffic_bytes(1000, 4), 2.0 * 3 * 64 * 4 * 8 * 1000);
  const CostReport msar = cost_of("msar", 4, 2, 4, 640);
  EXPECT_DOUBLE_EQ(msar.training_traffic_bytes(2048, 2), 2 * msar.traffic_d() * 640 * 2 * 8 * 2048);
  EXPECT_GT(msar.training_traffic_bytes(1, 4), cost_of("residual", 4, 2, 4, 640).training_traffic_bytes(1, 4));
}

// A small backbone for the FLOP counts: 3 layers, d 48, 6/2 heads (head dim 8), d_ff 100,
// vocabulary 300, 31 positions.
ModelConfig accounting_backbone() {
  ModelConfig model;
  model.n_layers = 3;
  model.d_model = 48;
  model.n_heads = 6;
  model.n_kv_heads = 2;
  model.d_ff = 100;
  model.vocab_size = 300;
  model.seq_len = 31;
  return model;
}

TEST(Accounting, BackboneFlopsAreSixTimesTheMatrixParametersPlusAttention) {
  // Independent check: 2 FLOPs per parameter and token forward, 3× for training.
  ModelConfig model = accounting_backbone();
  ResidualConfig r;
  Transformer meta(model, r, at::kMeta, 0);
  int64_t matrices = 0;
  for (const auto& [component, n] : meta.count().by_component)
    if (component == "attention" || component == "feed_forward" || component == "lm_head") matrices += n;
  const double hd = 8, causal_context = (31 + 1) / 2.0;
  const double attention = 3.0 * 3 * (2 * 2 * 6 * hd * causal_context);  // QKᵀ and A·V per layer
  const CostReport c = training_cost(model, r);
  EXPECT_DOUBLE_EQ(c.backbone_flops, 6.0 * double(matrices) + attention);
  EXPECT_DOUBLE_EQ(c.lm_head_flops, 6.0 * 48 * 300);
  EXPECT_DOUBLE_EQ(c.pathway_flops, 3.0 * 6 * 48);  // the residual's adds
  EXPECT_DOUBLE_EQ(c.overhead_percent, 0.0);
}

// An MoE backbone: 6 × the matrix parameters a token uses (the k routed experts of E it reaches,
// the shared experts, the router, the leading dense layer) + attention + the gate-weighted sums.
TEST(Accounting, MoeBackboneCountsTheActiveExperts) {
  ModelConfig model = accounting_backbone();
  model.moe.n_experts = 8;
  model.moe.top_k = 3;
  model.moe.expert_d_ff = 20;
  model.moe.n_shared_experts = 2;
  model.moe.shared_d_ff = 12;
  model.moe.leading_dense_layers = 1;
  ResidualConfig r;
  const ParameterCounts n = Transformer(model, r, at::kMeta, 0).count();
  double matrices = 0;
  for (const auto& [component, count] : n.by_component) {
    if (component == "attention" || component == "feed_forward" || component == "router" || component == "lm_head")
      matrices += double(count);
    if (component == "experts") matrices += double(count) * 3 / 8;  // k of E experts per token
  }
  const double attention = 3.0 * 3 * (2 * 2 * 6 * 8 * (31 + 1) / 2.0);
  const double combine = 3.0 * 2 * (2 * 3 * 48);  // 2 MoE layers, k weighted d-vectors each
  EXPECT_DOUBLE_EQ(training_cost(model, r).backbone_flops, 6.0 * matrices + attention + combine);
}

TEST(Accounting, AttnResFlopsCountedByHand) {
  // 2 layers (4 branches), S = 2, d = 10: key norms 3·3d; branch 2 reads the embedding and its
  // partial (4d + 8d + d); branches 3, 4 read two sources (8d each) and branch 4 its partial
  // (8d + d); the output query reads three (12d): 590 forward, 1770 training.
  const CostReport c = cost_of("attnres", 2, 2, 1, 10);
  EXPECT_DOUBLE_EQ(c.pathway_flops, 1770.0);
  EXPECT_GT(c.overhead_percent, 0.0);
  // More depth retrieval costs more: per branch, MSAR with 4 streams > DAR > AttnRes.
  EXPECT_GT(cost_of("msar", 4, 2, 4).pathway_flops, cost_of("dar", 4, 2, 4).pathway_flops);
  EXPECT_GT(cost_of("dar", 4, 2, 4).pathway_flops, cost_of("attnres", 4, 2, 4).pathway_flops);
}

TEST(Scaling, RecoversKnownPowerLaws) {
  const double E = 0.72;
  std::vector<ScalingPoint> pts;
  const double A_base = 9.0, A_fast = 7.5, beta = 0.08, A_steep = 30.0, beta_steep = 0.11;
  for (double c : {1e18, 4e18, 2e19, 1e20}) {
    pts.push_back({"residual", c, A_base * std::pow(c, -beta) + E});
    pts.push_back({"fast", c * 1.3, A_fast * std::pow(c * 1.3, -beta) + E});
    pts.push_back({"steep", c, A_steep * std::pow(c, -beta_steep) + E});
  }
  const auto fits = fit_scaling(pts, E, "residual");
  ASSERT_EQ(fits.size(), 3u);
  EXPECT_EQ(fits[0].method, "residual");
  EXPECT_NEAR(fits[0].A / A_base, 1.0, 1e-9);
  EXPECT_NEAR(fits[0].beta, beta, 1e-12);
  EXPECT_NEAR(fits[0].speedup, 1.0, 1e-9);
  EXPECT_NEAR(fits[0].r2, 1.0, 1e-12);
  // Same exponent: the baseline needs (A_base / A_fast)^(1/β) times the compute at every loss.
  EXPECT_NEAR(fits[1].A / A_fast, 1.0, 1e-9);
  EXPECT_NEAR(fits[1].speedup, std::pow(A_base / A_fast, 1.0 / beta), 1e-6);
  EXPECT_EQ(fits[1].points, 4);
  EXPECT_NEAR(fits[2].beta, beta_steep, 1e-12);
  EXPECT_NEAR(fits[2].A / A_steep, 1.0, 1e-9);
  for (size_t i = 0; i < 4; ++i) {  // per point: the baseline's compute at that loss over its own
    const double loss = pts[3 * i + 2].loss, c = pts[3 * i + 2].compute;
    EXPECT_NEAR(fits[2].speedups[i], std::pow(A_base / (loss - E), 1 / beta) / c, 1e-6 * fits[2].speedups[i]);
  }
}

TEST(Scaling, BadPointsAreNamed) {
  const std::vector<ScalingPoint> below = {{"residual", 1e18, 3.0}, {"residual", 1e19, 0.7}};
  expect_error([&] { fit_scaling(below, 0.72, "residual"); }, {"residual", "0.7", "irreducible"});
  const std::vector<ScalingPoint> one = {{"residual", 1e18, 3.0}, {"residual", 1e18, 2.9}};
  expect_error([&] { fit_scaling(one, 0.72, "residual"); }, {"residual", "two or more distinct"});
  const std::vector<ScalingPoint> ok = {{"mhc", 1e18, 3.0}, {"mhc", 1e19, 2.9}};
  expect_error([&] { fit_scaling(ok, 0.72, "residual"); }, {"baseline", "residual"});
}

TEST(Scaling, ReadsCsvAndJson) {
  TempDir dir;
  write_file_atomic(dir.path / "p.csv", "loss,method,compute\n3.0,residual,1e18\n2.5, residual ,1e19\n");
  auto pts = read_scaling_points(dir.path / "p.csv");
  ASSERT_EQ(pts.size(), 2u);
  EXPECT_EQ(pts[1].method, "residual");
  EXPECT_DOUBLE_EQ(pts[1].compute, 1e19);
  EXPECT_DOUBLE_EQ(pts[1].loss, 2.5);
  write_file_atomic(dir.path / "q.json", R"({"points": [{"method": "a", "compute": 2, "loss": 1.5}]})");
  EXPECT_EQ(read_scaling_points(dir.path / "q.json")[0].method, "a");
  write_file_atomic(dir.path / "bad.csv", "method,compute,loss\nresidual,lots,3\n");
  expect_error([&] { read_scaling_points(dir.path / "bad.csv"); }, {"bad.csv", "line 2", "lots", "not a number"});
  write_file_atomic(dir.path / "nohead.csv", "method,flops,loss\n");
  expect_error([&] { read_scaling_points(dir.path / "nohead.csv"); }, {"nohead.csv", "compute"});
}

TEST(Cka, EqualsTheGramMatrixForm) {
  auto g = generator(3);
  const int64_t n = 40;
  at::Tensor x = at::randn({n, 7}, g, at::kDouble), y = at::randn({n, 5}, g, at::kDouble) + 0.5 * x.narrow(1, 0, 5);
  // HSIC form (Kornblith et al. eq. 4) with loops: K = XXᵀ, L = YYᵀ, H = I − 11ᵀ/n.
  auto hsic = [&](const at::Tensor& a, const at::Tensor& b) {
    at::Tensor K = at::matmul(a, a.t()), L = at::matmul(b, b.t());
    std::vector<double> kc(n * n), lc(n * n);
    std::vector<double> rk(n), rl(n);
    double ak = 0, al = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        rk[i] += K[i][j].item<double>() / n;
        rl[i] += L[i][j].item<double>() / n;
      }
    for (int64_t i = 0; i < n; ++i) {
      ak += rk[i] / n;
      al += rl[i] / n;
    }
    double s = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        s += (K[i][j].item<double>() - rk[i] - rk[j] + ak) * (L[i][j].item<double>() - rl[i] - rl[j] + al);
    return s;
  };
  const double expected = hsic(x, y) / std::sqrt(hsic(x, x) * hsic(y, y));
  EXPECT_NEAR(linear_cka(x, y), expected, 1e-12);
  EXPECT_NEAR(linear_cka(x, x), 1.0, 1e-12);
  // Invariant to an orthogonal map and isotropic scaling, not to an arbitrary linear map.
  at::Tensor q = std::get<0>(at::linalg_qr(at::randn({7, 7}, g, at::kDouble)));
  EXPECT_NEAR(linear_cka(x, 3.0 * at::matmul(x, q)), 1.0, 1e-12);
  EXPECT_LT(linear_cka(x, at::randn({n, 7}, g, at::kDouble)), 0.6);
  expect_error([&] { linear_cka(x, y.narrow(0, 0, 10)); }, {"linear_cka", "same n"});
}

namespace {

// Records what the observer hook reports.
struct Recorder final : PathwayObserver {
  std::map<std::pair<int64_t, int64_t>, at::Tensor> weights;
  std::map<int64_t, at::Tensor> gates;
  std::map<int64_t, bool> partial;
  void on_retrieval(int64_t l, int64_t j, const at::Tensor& w, bool with_partial) override {
    weights[{l, j}] = w;
    partial[l] = with_partial;
  }
  void on_write_gates(int64_t l, const at::Tensor& g) override { gates[l] = g; }
  struct Streams {
    at::Tensor key_rms, gates, shares;
  };
  std::map<int64_t, Streams> streams;
  void on_stream_fusion(int64_t l, const at::Tensor& key_rms, const at::Tensor& g, const at::Tensor& shares) override {
    streams[l] = {key_rms, g, shares};
  }
};

struct Driven {
  std::vector<at::Tensor> inputs, outputs;  // h_ℓ and f_ℓ(h_ℓ), index ℓ − 1
  at::Tensor embedding;
  std::shared_ptr<ResidualPathway> path;
};

// Builds pathway r (float64, d = 6) with random parameters and drives it through n_layers layers
// with stand-in branches f_ℓ(h) = tanh(h W_ℓ), reporting to `obs`.
Driven drive(const ResidualConfig& r, int64_t n_layers, PathwayObserver* obs, uint64_t seed) {
  ModelConfig m;
  m.n_layers = n_layers;
  m.d_model = 6;
  ParameterStore params(at::kCPU, 1, at::kDouble);
  std::shared_ptr<ResidualPathway> path = make_pathway(r, m, params);
  auto g = generator(seed);
  {
    at::NoGradGuard no_grad;
    for (const auto& p : params.all()) p.tensor.normal_(0.0, 0.7, g);
  }
  Driven d;
  d.path = path;
  const int64_t B = 2, T = 5, D = m.d_model;
  d.embedding = at::randn({B, T, D}, g, at::kDouble);
  path->set_observer(obs);
  auto state = path->begin(d.embedding);
  for (int64_t l = 1; l <= m.n_branches(); ++l) {
    at::Tensor h = path->read(*state, l);
    at::Tensor f = at::tanh(at::matmul(h, at::randn({D, D}, g, at::kDouble) * 0.5));
    d.inputs.push_back(h);
    d.outputs.push_back(f);
    path->write(*state, l, f);
  }
  path->finish(*state);
  return d;
}

// The candidates each read ℓ saw under blocks of S branches, written from the branch outputs: the
// embedding, the completed block sums, then the current block's partial (`with_partial`). The last
// block becomes a source when `append_last` (AttnRes's output query reads it; MSAR merges it).
struct Read {
  std::vector<at::Tensor> sources;
  bool with_partial;
};
std::vector<Read> block_reads(const Driven& d, int64_t S, bool append_last, std::vector<at::Tensor>* completed_out) {
  const int64_t L = int64_t(d.outputs.size());
  std::vector<at::Tensor> completed = {d.embedding};
  at::Tensor partial;
  std::vector<Read> reads;
  for (int64_t l = 1; l <= L; ++l) {
    reads.push_back({completed, partial.defined()});
    if (partial.defined()) reads.back().sources.push_back(partial);
    partial = (l - 1) % S == 0 ? d.outputs[l - 1] : partial + d.outputs[l - 1];
    if (l % S == 0 || l == L) {
      if (l < L || append_last) completed.push_back(partial);
      partial = at::Tensor();
    }
  }
  if (completed_out) *completed_out = completed;
  return reads;
}

// Σ_c w_c · source_c for weights [B, T, n] over n sources.
at::Tensor weighted(const at::Tensor& w, const std::vector<at::Tensor>& sources) {
  return (w.movedim(-1, 0).unsqueeze(-1) * at::stack(sources)).sum(0);
}

}  // namespace

TEST(Observer, AttnResWeightsAreTheOnesItReadsWith) {
  for (int64_t S : {1, 2, 4}) {
    ResidualConfig r;
    r.kind = "attnres";
    r.block_sublayers = S;
    Recorder rec;
    Driven d = drive(r, 3, &rec, 7 + S);
    std::vector<at::Tensor> completed;
    const auto reads = block_reads(d, S, true, &completed);
    const int64_t L = int64_t(reads.size());
    // h_ℓ = Σ_c w_c · source_c over [embedding, completed block sums…, partial].
    for (int64_t l = 1; l <= L; ++l) {
      const Read& read = reads[l - 1];
      const at::Tensor w = rec.weights.at({l, 0});
      ASSERT_EQ(w.size(-1), int64_t(read.sources.size())) << "S " << S << " branch " << l;
      EXPECT_EQ(rec.partial.at(l), read.with_partial);
      EXPECT_TRUE(near(weighted(w, read.sources), d.inputs[l - 1], 1e-12, cat("S ", S, " branch ", l)));
    }
    EXPECT_EQ(rec.weights.at({L + 1, 0}).size(-1), int64_t(completed.size()));  // the output query
  }
}

TEST(Observer, MsarWeightsAreTheOnesItReadsWith) {
  // Without the convolutions every stream reads the same sources with its own query, and mean
  // fusion averages the streams: h_ℓ = (1/m) Σ_r Σ_c w_rc · source_c.
  for (const char* impl : {"reference", "fused"}) {
    ResidualConfig r;
    r.kind = "msar";
    r.block_sublayers = 2;
    r.streams = 3;
    r.conv = false;
    r.fusion = "mean";
    r.impl = impl;
    Recorder rec;
    Driven d = drive(r, 3, &rec, 11);
    const auto reads = block_reads(d, 2, false, nullptr);
    for (int64_t l = 1; l <= int64_t(reads.size()); ++l) {
      at::Tensor h = at::zeros_like(d.embedding);
      for (int64_t j = 0; j < 3; ++j) h = h + weighted(rec.weights.at({l, j}), reads[l - 1].sources) / 3.0;
      EXPECT_TRUE(near(h, d.inputs[l - 1], 1e-10, cat(impl, " branch ", l)));
    }
  }
}

// MSAR's streams (analyze --what streams): stream 0's key RMS is the mean RMS of the completed
// sources; at the first read (the embedding alone, weight 1 in every stream) the fused input is
// Σ_r H_pre[r] z⁽ʳ⁾ with z⁽ʳ⁾ the embedding's expansion, which fixes the gates and the shares.
TEST(Observer, MsarReportsItsStreams) {
  for (const char* fusion : {"hpre", "mean"}) {
    SCOPED_TRACE(fusion);
    ResidualConfig r;
    r.kind = "msar";
    r.block_sublayers = 2;
    r.streams = 3;
    r.kernels = {2, 4};
    r.fusion = fusion;
    Recorder rec;
    Driven d = drive(r, 3, &rec, 13);
    const auto reads = block_reads(d, 2, false, nullptr);
    auto rms = [](const at::Tensor& x) { return x.square().mean(-1).sqrt(); };
    for (int64_t l = 1; l <= int64_t(reads.size()); ++l) {
      const auto& s = rec.streams.at(l);
      const Read& read = reads[l - 1];
      const size_t completed = read.sources.size() - (read.with_partial ? 1 : 0);
      at::Tensor mean_rms = at::zeros_like(s.key_rms.select(-1, 0));
      for (size_t c = 0; c < completed; ++c) mean_rms = mean_rms + rms(read.sources[c]) / double(completed);
      EXPECT_TRUE(near(s.key_rms.select(-1, 0), mean_rms, 1e-12, cat("stream 0 key RMS, read ", l)));
      EXPECT_TRUE(near(s.shares.sum(-1), at::ones_like(mean_rms), 1e-12, cat("shares, read ", l)));
      if (std::string(fusion) == "mean") {
        EXPECT_TRUE(near(s.gates, at::full_like(s.gates, 1.0 / 3), 1e-15, "1/m"));
      }
    }
    const auto& first = rec.streams.at(1);
    const at::Tensor z = reference::msar_expand(d.embedding, dynamic_cast<Msar&>(*d.path).taps(0));  // [m, B, T, d]
    const at::Tensor parts = first.gates.permute({2, 0, 1}).unsqueeze(-1) * z;
    EXPECT_TRUE(near(parts.sum(0), d.inputs[0], 1e-12, "h_1 = Σ_r H_pre[r] z_r"));
    const at::Tensor norms = parts.square().sum(-1).sqrt().permute({1, 2, 0});
    EXPECT_TRUE(near(first.shares, norms / norms.sum(-1, true), 1e-12, "shares of h_1"));
    EXPECT_TRUE(near(first.key_rms, rms(z).permute({1, 2, 0}), 1e-12, "key RMS of the embedding's streams"));
  }
}

TEST(Observer, DarReportsBothStreamsAndItsWriteGates) {
  ResidualConfig r;
  r.kind = "dar";
  r.block_sublayers = 4;
  Recorder rec;
  drive(r, 4, &rec, 5);  // 8 branches
  for (int64_t l = 1; l <= 8 + 1; ++l)
    for (int64_t j = 0; j < 2; ++j) {
      const at::Tensor w = rec.weights.at({l, j});
      const int64_t completed = 1 + (l - 1) / 4;  // the readout (ℓ = 9) reads all three entries
      EXPECT_EQ(w.size(-1), completed + ((l - 1) % 4 != 0 && l <= 8 ? 1 : 0)) << l;
      EXPECT_TRUE(near(w.sum(-1), at::ones_like(w.sum(-1)), 1e-12, cat("weights sum to 1, branch ", l)));
    }
  EXPECT_FALSE(at::allclose(rec.weights.at({6, 0}), rec.weights.at({6, 1})));  // two queries, two key streams
  for (int64_t l = 1; l <= 8; ++l) {
    const at::Tensor beta = rec.gates.at(l);  // β = 2σ(·) ∈ (0, 2)
    EXPECT_EQ(beta.size(-1), 2);
    EXPECT_TRUE(beta.gt(0).all().item<bool>() && beta.lt(2).all().item<bool>());
  }
}

TEST(Interventions, ReplaceTheStreamsTheNextBranchesRead) {
  for (const char* kind : {"dar", "mhc", "attnres_mhc", "residual"}) {
    ResidualConfig r;
    r.kind = kind;
    r.block_sublayers = 4;  // DAR: layer 1's MLP state is a partial, layer 2's a completed entry
    r.streams = 3;
    ModelConfig m;
    m.n_layers = 3;
    m.d_model = 6;
    ParameterStore params(at::kCPU, 1, at::kDouble);
    auto path = make_pathway(r, m, params);
    auto g = generator(2);
    {
      at::NoGradGuard no_grad;
      for (const auto& p : params.all()) p.tensor.normal_(0.0, 0.7, g);
    }
    const at::Tensor e = at::randn({2, 4, 6}, g, at::kDouble);
    const at::Tensor W = at::randn({6, 6}, g, at::kDouble) * 0.5;
    for (int64_t layer : {1, 2}) {
      // mode 0: no intervention; 1: the same states put back; 2: every stream zeroed.
      auto run = [&](int mode, size_t* n_streams) {
        auto s = path->begin(e);
        for (int64_t l = 1; l <= m.n_branches(); ++l) {
          path->write(*s, l, at::tanh(at::matmul(path->read(*s, l), W)));
          if (l != 2 * layer || mode == 0) continue;
          auto states = path->stream_states(*s);
          *n_streams = states.size();
          if (mode == 2)
            for (auto& x : states) x = at::zeros_like(x);
          path->set_stream_states(*s, states);
        }
        return path->finish(*s);
      };
      size_t n = 0;
      const at::Tensor clean = run(0, &n), same = run(1, &n), zeroed = run(2, &n);
      EXPECT_EQ(n, std::string(kind) == "dar" ? 2u : std::string(kind) == "residual" ? 1u : 3u) << kind;
      EXPECT_TRUE(near(same, clean, 1e-14, cat(kind, ": states put back, layer ", layer)));
      EXPECT_GT((zeroed - clean).abs().max().item<double>(), 1e-3) << kind << " layer " << layer;
    }
    expect_error([&] { path->set_stream_states(*path->begin(e), {e, e, e, e, e}); }, {kind, "5 stream states"});
  }
}

}  // namespace depthkit::test
