// The dense backbone: the DAR paper's parameter counts, causality, initialisation, and that it
// learns (overfits one batch).
#include <ATen/ops/cat.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>

#include "depthkit/model/transformer.h"
#include "depthkit/train/optimizer.h"
#include "fit.h"
#include "helpers.h"
#include "op_checks.h"

namespace depthkit::test {

struct PaperCount {
  const char* config;
  int64_t non_vocab;  // DAR Table A.3 (excl. vocabulary), exact
  int64_t d_model;
};

TEST(Model, PaperParameterCounts) {
  for (PaperCount p : {PaperCount{"dense-0.1b", 98'325'120, 640}, PaperCount{"dense-0.3b", 304'129'024, 1024},
                       PaperCount{"dense-0.5b", 491'572'480, 1280}, PaperCount{"dense-1b", 1'069'631'488, 2048}}) {
    Config c = load_config(source_dir() + "/configs/paper/" + p.config + ".toml");
    Transformer m(c.model, c.residual, at::kMeta, 0);
    ParameterCounts n = m.count();
    EXPECT_EQ(n.non_vocab, p.non_vocab) << p.config;
    EXPECT_EQ(n.residual, 0) << p.config;
    EXPECT_EQ(n.total, p.non_vocab + 2 * 65536 * p.d_model) << p.config;  // untied embedding + head
  }
}

Config tiny_model(bool tied = false) {
  Config c = small_config("unused");
  c.model.tie_embeddings = tied;
  return c;
}

TEST(Model, TiedEmbeddingsShareOneMatrix) {
  Config c = tiny_model(true);
  Transformer tied(c.model, c.residual, at::kCPU, 1);
  Transformer untied(tiny_model(false).model, c.residual, at::kCPU, 1);
  EXPECT_EQ(untied.count().total - tied.count().total, c.model.vocab_size * c.model.d_model);
  EXPECT_THROW(tied.parameters().get("lm_head"), Error);
}

TEST(Model, SeedFixesInitialisation) {
  Config c = tiny_model();
  Transformer a(c.model, c.residual, at::kCPU, 7), b(c.model, c.residual, at::kCPU, 7), x(c.model, c.residual, at::kCPU, 8);
  auto pa = a.parameters().named(), pb = b.parameters().named(), px = x.parameters().named();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
  EXPECT_FALSE(at::equal(a.parameters().get("embedding"), x.parameters().get("embedding")));
  // Output projections are scaled down by sqrt(2 · n_layers).
  double s_in = a.parameters().get("layers.0.attention.wq").std().item<double>();
  double s_out = a.parameters().get("layers.0.attention.wo").std().item<double>();
  EXPECT_NEAR(s_in, 0.02, 0.002);
  EXPECT_NEAR(s_out, 0.02 / 2.0, 0.001);
}

// Causality of the backbone with every pathway: Pathways.EveryKindIsCausal (test_pathways.cpp).

// ATen's fused AdamW kernel (optim.impl = "fused") against the per-parameter loop of elementwise
// ops (torch.optim.AdamW's formula), given the same gradients: the same parameters and moments
// after several steps, to float32 rounding (a wrong step count in the bias corrections would
// move the parameters by ~1e-3, a wrong weight decay by lr · wd · |p|).
TEST(Optimizer, FusedAdamWEqualsReference) {
  Config c = tiny_model();
  Transformer a(c.model, c.residual, at::kCPU, 4), b(c.model, c.residual, at::kCPU, 4);
  c.optim.impl = "fused";
  AdamW fused(a.parameters(), c.optim);
  c.optim.impl = "reference";
  AdamW loop(b.parameters(), c.optim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const auto& pa = a.parameters().all();
  const auto& pb = b.parameters().all();
  for (int step = 0; step < 4; ++step) {
    at::Tensor batch = at::randint(c.model.vocab_size, {2, c.model.seq_len + 1}, gen);
    a.parameters().zero_grad();
    a.loss(batch).backward();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].tensor.mutable_grad() = pa[i].tensor.grad().clone();
    fused.step(1e-2);
    loop.step(1e-2);
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(near(pa[i].tensor, pb[i].tensor, 1e-6, cat(pa[i].name, " step ", step)));
  }
  // The moments relative to their largest entry (they are far below 1).
  for (auto [x, y] : {std::pair{fused.exp_avg(), loop.exp_avg()}, std::pair{fused.exp_avg_sq(), loop.exp_avg_sq()}})
    EXPECT_LE((x - y).abs().max().item<double>(), 1e-6 * y.abs().max().item<double>());
  EXPECT_EQ(fused.steps(), 4);
}

// ZeRO-1's arithmetic in one process: optimizers over disjoint shards of the parameters, each
// updating its elements, give exactly the unsharded update, and their state, laid end to end,
// is the unsharded state under the same names.
TEST(Optimizer, ShardedAdamWEqualsUnsharded) {
  for (const char* impl : {"fused", "reference"}) {  // both updates (optim.impl)
    SCOPED_TRACE(impl);
    Config c = tiny_model();
    c.optim.impl = impl;
    Transformer whole(c.model, c.residual, at::kCPU, 4), split(c.model, c.residual, at::kCPU, 4);
    const int64_t n = whole.parameters().count(), ranks = 3;
    const std::vector<int64_t> sizes = AdamW::sizes(split.parameters());
    AdamW full(whole.parameters(), c.optim);
    std::vector<AdamW> shards;
    for (int64_t r = 0; r < ranks; ++r) shards.emplace_back(split.parameters(), c.optim, ParameterShard::of(sizes, r, ranks));
    // Shares of about n / ranks, each boundary 64 elements into its parameter at most from ideal.
    const ParameterShard& last = shards.back().shard();
    ASSERT_EQ(last.bounds.size(), size_t(ranks + 1));
    EXPECT_EQ(last.bounds.front(), 0);
    EXPECT_EQ(last.bounds.back(), n);
    for (int64_t r = 1; r < ranks; ++r) EXPECT_LE(std::abs(last.bounds[r] - r * ((n + ranks - 1) / ranks)), 64) << r;
    EXPECT_EQ(shards[0].state_bytes() * ranks, full.state_bytes() + (ranks * last.chunk - n) * 2 * 4);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    for (int step = 0; step < 3; ++step) {
      at::Tensor batch = at::randint(c.model.vocab_size, {2, c.model.seq_len + 1}, gen);
      for (Transformer* m : {&whole, &split}) {
        m->parameters().zero_grad();
        m->loss(batch).backward();
      }
      full.step(1e-2);
      std::vector<at::Tensor> pieces;
      for (AdamW& s : shards) {
        s.step(1e-2);
        pieces.push_back(s.shard_of_parameters());
      }
      // Each rank changed only its own elements; the all-gather puts everyone's together.
      shards[0].set_parameters(shards[0].shard().unpad(at::cat(pieces)));
      for (size_t i = 0; i < whole.parameters().all().size(); ++i)
        EXPECT_TRUE(at::equal(whole.parameters().all()[i].tensor, split.parameters().all()[i].tensor))
            << whole.parameters().all()[i].name << " step " << step;
    }
    std::vector<at::Tensor> m, v;
    for (AdamW& s : shards) m.push_back(s.exp_avg()), v.push_back(s.exp_avg_sq());
    const NamedTensors expected = full.state(),
                       gathered = shards[0].state(last.unpad(at::cat(m)), last.unpad(at::cat(v)));
    ASSERT_EQ(expected.size(), gathered.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(expected[i].first, gathered[i].first);
      EXPECT_TRUE(at::equal(expected[i].second, gathered[i].second)) << expected[i].first;
    }
    EXPECT_THROW(shards[1].state(), Error);  // a shard alone is not the optimizer's state
    // Loading the full state gives each shard its elements back.
    std::map<std::string, at::Tensor> saved(expected.begin(), expected.end());
    AdamW reloaded(split.parameters(), c.optim, ParameterShard::of(sizes, 1, ranks));
    reloaded.load_state(saved, "state");
    EXPECT_TRUE(at::equal(reloaded.exp_avg(), shards[1].exp_avg()));
    EXPECT_TRUE(at::equal(reloaded.exp_avg_sq(), shards[1].exp_avg_sq()));
    EXPECT_EQ(reloaded.steps(), 3);
  }
}

TEST(Model, OverfitsOneBatch) {
  Config c = tiny_model();
  c.optim.weight_decay = 0;
  Transformer m(c.model, c.residual, at::kCPU, 4);
  double first = 0, last = 0;
  fit_one_batch(m, c, 60, [&](int step, double loss) { (step == 0 ? first : last) = loss; });
  EXPECT_NEAR(first, std::log(double(c.model.vocab_size)), 0.3);  // uniform at initialisation
  EXPECT_LT(last, 0.25 * first);
}

}  // namespace depthkit::test
