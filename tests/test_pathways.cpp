// Residual pathways against implementations written line by line from the papers' equations
// (float64, loops over branches, candidates and tokens): branch inputs, final hidden state and
// every gradient; the two-phase read; causality; training.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "depthkit/model/transformer.h"
#include "depthkit/ops/depth_attention.h"
#include "depthkit/train/trainer.h"
#include "depthkit/util/progress.h"
#include "helpers.h"

namespace depthkit::test {

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Relative closeness for float64 comparisons of two computations of the same equations.
::testing::AssertionResult close(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  if (!a.defined() || !b.defined()) return ::testing::AssertionFailure() << what << ": undefined tensor";
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << what << ": shape " << a.sizes() << " vs " << b.sizes();
  if (at::allclose(a, b, 1e-10, 1e-12)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max |diff| " << (a - b).abs().max().item<double>()
                                       << " (max |a| " << a.abs().max().item<double>() << ")";
}

// A synthetic branch, so the pathway is tested apart from attention and SwiGLU.
at::Tensor branch(const at::Tensor& h, const at::Tensor& W) { return 0.5 * at::tanh(at::matmul(h, W)); }

struct Trace {
  std::vector<at::Tensor> inputs;  // h_ℓ, ℓ = 1 … L_b
  at::Tensor hidden;               // what finish() hands to the final norm
};

// Runs a pathway module through the seam.
Trace drive(ResidualPathway& path, const at::Tensor& embedding, const std::vector<at::Tensor>& W) {
  Trace tr;
  auto state = path.begin(embedding);
  for (int64_t l = 1; l <= int64_t(W.size()); ++l) {
    tr.inputs.push_back(path.read(*state, l));
    path.write(*state, l, branch(tr.inputs.back(), W[l - 1]));
  }
  tr.hidden = path.finish(*state);
  return tr;
}

at::Tensor scalar_loss(const Trace& tr, uint64_t seed) {
  auto g = gen(seed);
  at::Tensor loss = (tr.hidden * at::randn(tr.hidden.sizes(), g, kF64)).sum();
  for (const auto& h : tr.inputs) loss = loss + (h * at::randn(h.sizes(), g, kF64)).sum();
  return loss;
}

// ---- The papers' equations, token by token --------------------------------------------------

// Norm_h(k) = k / sqrt(mean(k²) + ε): RMSNorm without weight (DAR eq. 2).
at::Tensor norm_h(const at::Tensor& k) { return k / at::sqrt((k * k).mean() + 1e-6); }

// h = Σ_r π_r v_r with π = softmax_r(q · Norm_h(k_r)) over the candidates (DAR eq. 2, 3, 5).
at::Tensor retrieve(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
  std::vector<at::Tensor> logits;
  for (const auto& k : keys) logits.push_back((q * norm_h(k)).sum());
  at::Tensor pi = at::softmax(at::stack(logits), 0);
  at::Tensor h = pi[0] * values[0];
  for (size_t r = 1; r < values.size(); ++r) h = h + pi[r] * values[r];
  return h;
}

// AttnRes (DAR eq. 4–5; Block form: MSAR §3.3 with S branches per block). queries[ℓ] for
// ℓ = 1 … L_b (ℓ = 1 has a single candidate, so its query does not matter).
Trace reference_attnres(const at::Tensor& e, const std::vector<at::Tensor>& W, const std::vector<at::Tensor>& queries,
                        const at::Tensor& out_query, int64_t S) {
  const int64_t B = e.size(0), T = e.size(1), L = W.size();
  std::vector<at::Tensor> sources = {e};  // v_0 = h_1, then completed blocks
  at::Tensor partial;
  Trace tr;
  for (int64_t l = 1; l <= L; ++l) {
    const int64_t i = (l - 1) % S + 1;  // position in the block
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<at::Tensor> cand;
        for (const auto& s : sources) cand.push_back(s[b][t]);
        if (i > 1) cand.push_back(partial[b][t]);  // eq. 9: the block's partial after its first branch
        rows.push_back(retrieve(queries[l], cand, cand));
      }
    at::Tensor h = at::stack(rows).view({B, T, -1});
    tr.inputs.push_back(h);
    at::Tensor out = branch(h, W[l - 1]);
    partial = i == 1 ? out : partial + out;
    if (i == S || l == L) sources.push_back(partial);  // block summary: the sum of its outputs
  }
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<at::Tensor> cand;
      for (const auto& s : sources) cand.push_back(s[b][t]);
      rows.push_back(retrieve(out_query, cand, cand));
    }
  tr.hidden = at::stack(rows).view({B, T, -1});
  return tr;
}

// Randomises every parameter of the pathway (zeros hide bugs).
void randomize(ParameterStore& params, uint64_t seed) {
  auto g = gen(seed);
  at::NoGradGuard no_grad;
  for (const auto& p : params.all()) p.tensor.normal_(0.0, 0.7, g);
}

}  // namespace

TEST(DepthAttention, TwoPhaseEqualsOneSoftmax) {
  auto g = gen(1);
  for (int64_t N : {1, 2, 5}) {
    at::Tensor q = at::randn({7}, g, kF64) * 2;
    at::Tensor K = at::randn({N, 3, 4, 7}, g, kF64), V = at::randn({N, 3, 4, 7}, g, kF64);
    at::Tensor kp = at::randn({3, 4, 7}, g, kF64), vp = at::randn({3, 4, 7}, g, kF64);
    DepthRead hist = depth_read(q, K, V);
    DepthRead all = depth_read(q, at::cat({K, kp.unsqueeze(0)}), at::cat({V, vp.unsqueeze(0)}));
    EXPECT_TRUE(close(merge_partial(hist, q, kp, vp), all.out, "merged read"));
    // ζ is the log-partition of the completed sources.
    at::Tensor logits = at::matmul(key_norm(K), q);
    EXPECT_TRUE(close(hist.log_partition, at::logsumexp(logits, {0}), "log-partition"));
  }
}

struct PathwayCase {
  int64_t n_layers, S, T;
};

TEST(AttnRes, EqualsTheEquations) {
  for (PathwayCase c : {PathwayCase{3, 1, 5}, PathwayCase{3, 2, 5}, PathwayCase{3, 4, 5}, PathwayCase{3, 6, 1},
                        PathwayCase{2, 8, 5}, PathwayCase{3, 4, 1}}) {
    SCOPED_TRACE(cat("n_layers ", c.n_layers, " S ", c.S, " T ", c.T));
    ModelConfig m;
    m.n_layers = c.n_layers;
    m.d_model = 6;
    ResidualConfig r;
    r.kind = "attnres";
    r.block_sublayers = c.S;
    ParameterStore params(at::kCPU, 3, at::kDouble);
    auto path = make_pathway(r, m, params);
    randomize(params, 4 + c.S);
    const int64_t L = m.n_branches();
    EXPECT_EQ(params.count("residual"), L * m.d_model);

    auto g = gen(5);
    at::Tensor e = at::randn({2, c.T, 6}, g, kF64).requires_grad_();
    std::vector<at::Tensor> W;
    for (int64_t l = 0; l < L; ++l) W.push_back((at::randn({6, 6}, g, kF64) * 0.6).requires_grad_());
    Trace mod = drive(*path, e, W);

    // The reference gets its own leaves with the same values.
    at::Tensor e2 = e.detach().clone().requires_grad_();
    std::vector<at::Tensor> W2, q2(L + 1);
    for (auto& w : W) W2.push_back(w.detach().clone().requires_grad_());
    q2[1] = at::zeros({6}, kF64);
    for (int64_t l = 2; l <= L; ++l) q2[l] = params.get(cat("residual.query.", l)).detach().clone().requires_grad_();
    at::Tensor out_q2 = params.get("residual.out_query").detach().clone().requires_grad_();
    Trace ref = reference_attnres(e2, W2, q2, out_q2, c.S);

    for (int64_t l = 0; l < L; ++l) EXPECT_TRUE(close(mod.inputs[l], ref.inputs[l], cat("h_", l + 1)));
    EXPECT_TRUE(close(mod.hidden, ref.hidden, "final hidden"));

    scalar_loss(mod, 9).backward();
    scalar_loss(ref, 9).backward();
    EXPECT_TRUE(close(e.grad(), e2.grad(), "d embedding"));
    for (int64_t l = 0; l < L; ++l) EXPECT_TRUE(close(W[l].grad(), W2[l].grad(), cat("d W_", l + 1)));
    for (int64_t l = 2; l <= L; ++l)
      EXPECT_TRUE(close(params.get(cat("residual.query.", l)).grad(), q2[l].grad(), cat("d q_", l)));
    EXPECT_TRUE(close(params.get("residual.out_query").grad(), out_q2.grad(), "d out_query"));
  }
}

TEST(AttnRes, ZeroQueriesReadUniformly) {
  // At initialisation every query is zero: each read is the mean of its candidates.
  ModelConfig m;
  m.n_layers = 1;
  m.d_model = 4;
  ResidualConfig r;
  r.kind = "attnres";
  r.block_sublayers = 1;
  ParameterStore params(at::kCPU, 3, at::kDouble);
  auto path = make_pathway(r, m, params);
  auto g = gen(2);
  at::Tensor e = at::randn({1, 3, 4}, g, kF64), out = at::randn({1, 3, 4}, g, kF64);
  auto s = path->begin(e);
  EXPECT_TRUE(close(path->read(*s, 1), e, "h_1"));
  path->write(*s, 1, out);
  EXPECT_TRUE(close(path->read(*s, 2), (e + out) / 2, "h_2"));
}

// Parameter accounting: DAR Table A.3 and the figures.
TEST(AttnRes, ParameterCounts) {
  for (auto [name, expect] : {std::pair{"dense-0.1b", int64_t(98'345'600)}, std::pair{"dense-0.3b", int64_t(304'169'984)}}) {
    Config c = Config::load(source_dir() + "/configs/paper/" + name + ".toml", {"residual.kind=attnres", "residual.block_sublayers=1"});
    Transformer t(c.model, c.residual, at::kMeta, 0);
    EXPECT_EQ(t.count().non_vocab, expect) << name;
    EXPECT_EQ(t.count().residual, c.model.n_branches() * c.model.d_model) << name;
  }
}

std::vector<std::vector<std::string>> model_kinds() {
  return {{"residual.kind=residual"},
          {"residual.kind=attnres", "residual.block_sublayers=1"},
          {"residual.kind=attnres", "residual.block_sublayers=3"}};
}

TEST(Pathways, EveryKindIsCausal) {
  for (const auto& sets : model_kinds()) {
    SCOPED_TRACE(sets.front() + (sets.size() > 1 ? " " + sets[1] : ""));
    Config c = Config::parse(small_config("unused").to_toml(), "small", sets);
    Transformer m(c.model, c.residual, at::kCPU, 3);
    {
      auto g = gen(8);
      at::NoGradGuard no_grad;
      for (const auto& p : m.parameters().all())
        if (p.component == "residual") p.tensor.normal_(0.0, 1.0, g);
    }
    auto g = gen(5);
    at::Tensor tokens = at::randint(c.model.vocab_size, {2, c.model.seq_len}, g);
    at::NoGradGuard no_grad;
    at::Tensor base = m.logits(tokens);
    for (int64_t t : {int64_t(0), int64_t(6), c.model.seq_len - 2}) {
      at::Tensor changed = tokens.clone();
      changed.select(1, t + 1).add_(1).remainder_(c.model.vocab_size);
      at::Tensor out = m.logits(changed);
      EXPECT_TRUE(at::allclose(out.narrow(1, 0, t + 1), base.narrow(1, 0, t + 1), 0, 1e-6)) << "position " << t;
      EXPECT_FALSE(at::allclose(out.narrow(1, t + 1, 1), base.narrow(1, t + 1, 1), 0, 1e-6)) << "position " << t + 1;
    }
  }
}

TEST(Pathways, EveryKindTrains) {
  TempDir d;
  write_pattern_data(d.str("data"), 64, 6000, 1000);
  Progress::set_enabled(false);
  for (const auto& sets : model_kinds()) {
    SCOPED_TRACE(sets.front());
    TrainOptions o;
    o.config = Config::parse(small_config(d.str("data")).to_toml(), "small", sets);
    o.config.train.steps = 150;
    o.config.train.eval_every = 0;
    o.config.optim.lr = 1e-2;
    o.run_dir = d.path / ("run-" + std::to_string(std::hash<std::string>()(sets.back())));
    TrainResult r = train(o);
    EXPECT_NEAR(r.losses.front(), std::log(64.0), 0.2);
    EXPECT_LT(r.val_loss, std::log(64.0) - 1.0);
  }
  Progress::set_enabled(true);
}

}  // namespace depthkit::test
