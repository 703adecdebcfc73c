// Incremental decoding (Transformer::start_decoding / extend, docs/design.md "Decoding") against the
// full forward, for every pathway and its variants, and generation (eval/generate.h) against a
// naive greedy loop over full forwards.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "depthkit/eval/generate.h"
#include "depthkit/model/transformer.h"
#include "helpers.h"

using namespace depthkit;
using namespace depthkit::test;

namespace {


// Every kind and the variants whose state differs: the block forms, DAR's routings, MSAR's
// streams, kernels, fusions and its ablation without convolutions, the hybrids, an MoE backbone,
// and the reference compositions.
std::vector<std::vector<std::string>> decoding_variants() {
  return {{"residual.kind=residual"},
          {"residual.kind=attnres", "residual.block_sublayers=1"},
          {"residual.kind=attnres", "residual.block_sublayers=3"},
          {"residual.kind=attnres", "residual.block_sublayers=3", "residual.impl=reference"},
          {"residual.kind=dar", "residual.block_sublayers=2", "residual.routing=cross"},
          {"residual.kind=dar", "residual.block_sublayers=3", "residual.routing=self"},
          {"residual.kind=dar", "residual.block_sublayers=2", "residual.routing=cross_value"},
          {"residual.kind=dar", "residual.block_sublayers=2", "residual.routing=fixed"},
          {"residual.kind=dar", "residual.block_sublayers=3", "residual.impl=reference"},
          {"residual.kind=msar", "residual.block_sublayers=1"},
          {"residual.kind=msar", "residual.block_sublayers=2"},
          {"residual.kind=msar", "residual.block_sublayers=4", "residual.fusion=mean"},
          {"residual.kind=msar", "residual.block_sublayers=2", "residual.conv=false"},
          {"residual.kind=msar", "residual.streams=1", "residual.kernels=[]"},
          {"residual.kind=msar", "residual.streams=2", "residual.kernels=[5]"},
          {"residual.kind=msar", "residual.streams=3", "residual.kernels=[3,9]"},
          {"residual.kind=msar", "residual.block_sublayers=2", "residual.impl=reference"},
          {"residual.kind=msar", "residual.block_sublayers=2", "moe.n_experts=4", "moe.top_k=2", "moe.expert_d_ff=16"},
          {"residual.kind=mhc", "residual.streams=4"},
          {"residual.kind=mhc", "residual.streams=2"},
          {"residual.kind=attnres_sepv", "residual.block_sublayers=2"},
          {"residual.kind=attnres_mhc", "residual.block_sublayers=2"},
          {"residual.kind=dar", "residual.block_sublayers=2", "moe.n_experts=4", "moe.top_k=2", "moe.expert_d_ff=16"}};
}

TEST(Decoding, VariantsReachEveryKind) { expect_every_kind(decoding_variants(), "decoding_variants()"); }

std::string label(const std::vector<std::string>& sets) {
  std::string s;
  for (const auto& x : sets) s.append(x).append(1, ' ');
  return s;
}

// A small model (4 branches, seq_len 32) with every parameter random, so that the pathways'
// queries, convolutions and gates all act.
struct Model {
  Config cfg;
  Transformer m;
  explicit Model(const std::vector<std::string>& sets, int64_t seq_len = 32)
      : cfg(parse_config(small_config("unused").to_toml(), "small", with_length(sets, seq_len))),
        m(cfg.model, cfg.residual, at::kCPU, 3) {
    auto g = gen(11);
    at::NoGradGuard no_grad;
    for (const auto& p : m.parameters().all())
      if (p.component == "residual") p.tensor.normal_(0.0, 0.5, g);
  }
  static std::vector<std::string> with_length(std::vector<std::string> sets, int64_t seq_len) {
    sets.push_back(depthkit::cat("model.seq_len=", seq_len));
    return sets;
  }
};

// max |a − b| / max |b|
double relative(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// The logits of `tokens` [B, T] run as a prefill of `split` positions, then one position at a time.
at::Tensor decoded_logits(Transformer& m, const at::Tensor& tokens, int64_t split) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  DecodeState state = m.start_decoding(B);
  std::vector<at::Tensor> parts{m.head(m.extend(state, tokens.narrow(1, 0, split), std::vector<int64_t>(B, split)))};
  for (int64_t t = split; t < T; ++t)
    parts.push_back(m.head(m.extend(state, tokens.narrow(1, t, 1), std::vector<int64_t>(B, 1))));
  EXPECT_EQ(state.lengths, std::vector<int64_t>(B, T));
  return at::cat(parts, 1);
}

}  // namespace

// Sequences longer than the largest kernel (12): a prefill, then every later position alone.
TEST(Decoding, PrefillThenStepsEqualTheFullForward) {
  for (const auto& sets : decoding_variants()) {
    SCOPED_TRACE(label(sets));
    Model mm(sets);
    auto g = gen(5);
    const at::Tensor tokens = at::randint(mm.cfg.model.vocab_size, {2, 28}, g);
    at::NoGradGuard no_grad;
    const at::Tensor full = mm.m.logits(tokens);
    for (int64_t split : {1, 13}) {
      const double r = relative(decoded_logits(mm.m, tokens, split), full);
      EXPECT_LT(r, 1e-5) << "prefill of " << split;
    }
  }
}

// A short sequence, its prompt split at every position.
TEST(Decoding, EverySplitOfAShortSequenceEqualsTheFullForward) {
  for (const auto& sets : decoding_variants()) {
    SCOPED_TRACE(label(sets));
    Model mm(sets);
    auto g = gen(6);
    const at::Tensor tokens = at::randint(mm.cfg.model.vocab_size, {1, 9}, g);
    at::NoGradGuard no_grad;
    const at::Tensor full = mm.m.logits(tokens);
    for (int64_t split = 1; split <= 9; ++split) EXPECT_LT(relative(decoded_logits(mm.m, tokens, split), full), 1e-5) << split;
  }
}

// Sequences of different lengths in one batch: one right-padded prefill, then steps in which some
// rows sit out (count 0); each row equals its own sequence's full forward.
TEST(Decoding, RaggedBatchesEqualEachSequencesFullForward) {
  for (const auto& sets : decoding_variants()) {
    SCOPED_TRACE(label(sets));
    Model mm(sets);
    auto g = gen(7);
    const std::vector<int64_t> prompt = {5, 17, 11}, total = {20, 24, 14};
    std::vector<at::Tensor> seqs;
    for (int64_t n : total) seqs.push_back(at::randint(mm.cfg.model.vocab_size, {1, n}, g));
    at::NoGradGuard no_grad;
    DecodeState state = mm.m.start_decoding(3);
    at::Tensor chunk = at::zeros({3, 17}, at::kLong);
    for (int64_t b = 0; b < 3; ++b) chunk[b].narrow(0, 0, prompt[b]).copy_(seqs[b][0].narrow(0, 0, prompt[b]));
    at::Tensor h = mm.m.extend(state, chunk, prompt);
    std::vector<std::vector<at::Tensor>> rows(3);
    for (int64_t b = 0; b < 3; ++b) rows[b].push_back(mm.m.head(h[b].narrow(0, 0, prompt[b])));
    for (int64_t step = 0;; ++step) {
      std::vector<int64_t> counts(3, 0);
      at::Tensor next = at::zeros({3, 1}, at::kLong);
      for (int64_t b = 0; b < 3; ++b) {
        const int64_t at_position = state.lengths[b];
        if (at_position == total[b] || (b == 1 && step % 3 == 1)) continue;  // row 1 sits out some steps
        counts[b] = 1;
        next[b][0] = seqs[b][0][at_position];
      }
      if (std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c == 0; })) {
        if (state.lengths == total) break;
        continue;
      }
      h = mm.m.extend(state, next, counts);
      for (int64_t b = 0; b < 3; ++b)
        if (counts[b]) rows[b].push_back(mm.m.head(h[b]));
    }
    for (int64_t b = 0; b < 3; ++b)
      EXPECT_LT(relative(at::cat(rows[b], 0), mm.m.logits(seqs[b])[0]), 1e-5) << "sequence " << b;
  }
}

// Chunks of several positions after a non-empty cache: a prefill, then a ragged chunk (7, 3 and
// no positions), then single positions, each row against its own full forward.
TEST(Decoding, RaggedChunksAfterACacheEqualTheFullForward) {
  for (const auto& sets : decoding_variants()) {
    SCOPED_TRACE(label(sets));
    Model mm(sets);
    auto g = gen(8);
    const at::Tensor seqs = at::randint(mm.cfg.model.vocab_size, {3, 20}, g);
    at::NoGradGuard no_grad;
    DecodeState state = mm.m.start_decoding(3);
    std::vector<std::vector<at::Tensor>> rows(3);
    auto run = [&](const std::vector<int64_t>& counts) {
      const int64_t T = *std::max_element(counts.begin(), counts.end());
      at::Tensor chunk = at::zeros({3, T}, at::kLong);
      for (int64_t b = 0; b < 3; ++b)
        chunk[b].narrow(0, 0, counts[b]).copy_(seqs[b].narrow(0, state.lengths[b], counts[b]));
      const at::Tensor logits = mm.m.head(mm.m.extend(state, chunk, counts));
      for (int64_t b = 0; b < 3; ++b) rows[b].push_back(logits[b].narrow(0, 0, counts[b]));
    };
    run({5, 5, 5});
    run({7, 3, 0});
    while (state.lengths != std::vector<int64_t>{20, 20, 20}) {
      std::vector<int64_t> counts;
      for (int64_t held : state.lengths) counts.push_back(std::min<int64_t>(20 - held, 2));
      run(counts);
    }
    const at::Tensor full = mm.m.logits(seqs);
    for (int64_t b = 0; b < 3; ++b) EXPECT_LT(relative(at::cat(rows[b], 0), full[b]), 1e-5) << "sequence " << b;
  }
}

TEST(Decoding, CacheHoldsKeysValuesAndMsarsTails) {
  for (const auto& [sets, tails] : std::vector<std::pair<std::vector<std::string>, int64_t>>{
           {{"residual.kind=dar"}, 0},
           {{"residual.kind=msar"}, 11},
           {{"residual.kind=msar", "residual.conv=false"}, 0}}) {
    Model mm(sets);
    const DecodeState state = mm.m.start_decoding(3, 20);
    const ModelConfig& c = mm.cfg.model;
    const int64_t kv = 2 * c.n_layers * 3 * c.n_kv_heads * 20 * c.resolved_head_dim() * 4;
    EXPECT_EQ(state.bytes(), kv + c.n_branches() * 3 * tails * c.d_model * 4) << label(sets);
    EXPECT_EQ(state.pathway != nullptr, tails > 0);
  }
}

TEST(Decoding, RefusesChunksBeyondTheCache) {
  Model mm({"residual.kind=msar"});
  at::NoGradGuard no_grad;
  DecodeState state = mm.m.start_decoding(2, 8);
  mm.m.extend(state, at::zeros({2, 6}, at::kLong), {6, 6});
  expect_error([&] { mm.m.extend(state, at::zeros({2, 3}, at::kLong), {3, 1}); },
               {"sequence 0 would hold 9 positions", "cache's 8"});
  expect_error([&] { mm.m.extend(state, at::zeros({3, 1}, at::kLong), {1, 1, 1}); }, {"continues 2 sequences"});
  expect_error([&] { mm.m.extend(state, at::zeros({2, 1}, at::kLong), {2, 1}); }, {"row 0", "counts 2"});
  expect_error([&] { mm.m.start_decoding(1, 33); }, {"model.seq_len 32"});
}

namespace {
// Greedy decoding by full forwards: the argmax of the last position's logits, appended.
std::vector<int> naive_greedy(Transformer& m, std::vector<int> seq, int64_t n) {
  std::vector<int> out;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor t = at::tensor(std::vector<int64_t>(seq.begin(), seq.end()), at::kLong).view({1, -1});
    const int id = int(m.logits(t)[0][-1].argmax().item<int64_t>());
    out.push_back(id);
    seq.push_back(id);
  }
  return out;
}
}  // namespace

TEST(Generate, GreedyEqualsArgmaxOverFullForwards) {
  for (const char* kind : {"residual.kind=msar", "residual.kind=dar", "residual.kind=mhc"}) {
    SCOPED_TRACE(kind);
    Model mm({kind});
    const std::vector<std::vector<int>> prompts = {{3, 1, 4, 1, 5}, {2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9}, {6}};
    at::NoGradGuard no_grad;
    Sampling greedy;
    greedy.temperature = 0;
    const Generation g = generate(mm.m, prompts, 12, greedy, -1);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(g.tokens[i], naive_greedy(mm.m, prompts[i], 12)) << "prompt " << i;
      EXPECT_EQ(g.stopped[i], "limit");
    }
    EXPECT_EQ(g.prefill_tokens, 19);
    EXPECT_EQ(g.decode_tokens, 3 * 11);
    Sampling top1;  // temperature 1, only the most likely id kept
    top1.top_k = 1;
    top1.seed = 9;
    EXPECT_EQ(generate(mm.m, prompts, 12, top1, -1).tokens, g.tokens);
    Sampling narrow;  // a nucleus of one id
    narrow.top_p = 1e-9;
    EXPECT_EQ(generate(mm.m, prompts, 12, narrow, -1).tokens, g.tokens);
  }
}

// Which ids a draw can give: the top-k, then the smallest nucleus of mass ≥ top-p, ties ranked
// to the lower id.
TEST(Generate, SamplingDrawsOnlyFromTheTopKAndTheNucleus) {
  // p ∝ exp(logit): ids 1 and 3 tie at the top (0.418 each), then 0 (0.154), then 2 and 4 (0.008).
  const at::Tensor logits = at::tensor(std::vector<double>{1.0, 2.0, -2.0, 2.0, -2.0}, at::kDouble);
  auto support = [&](const Sampling& s) {
    std::mt19937_64 rng(s.seed);
    std::set<int> seen;
    for (int i = 0; i < 4000; ++i) seen.insert(sample_next(logits, s, rng));
    return seen;
  };
  Sampling s;
  EXPECT_EQ(support(s), (std::set<int>{0, 1, 2, 3, 4}));
  s.top_k = 1;
  EXPECT_EQ(support(s), std::set<int>{1});  // the tie goes to the lower id
  s.top_k = 3;
  EXPECT_EQ(support(s), (std::set<int>{0, 1, 3}));
  s.top_k = 0;
  s.top_p = 0.5;  // id 1 alone holds 0.42 of the mass: the nucleus needs id 3 too
  EXPECT_EQ(support(s), (std::set<int>{1, 3}));
  s.top_p = 0.4;
  EXPECT_EQ(support(s), std::set<int>{1});
  Sampling greedy;
  greedy.temperature = 0;
  std::mt19937_64 rng(0);
  EXPECT_EQ(sample_next(logits, greedy, rng), 1);
  // A low temperature sharpens: ids 1 and 3 about equally, the others (almost) never.
  Sampling cold;
  cold.temperature = 0.05;
  std::mt19937_64 r2(5);
  int ones = 0;
  for (int i = 0; i < 2000; ++i) ones += sample_next(logits, cold, r2) == 1;
  EXPECT_NEAR(ones / 2000.0, 0.5, 0.05);
}

TEST(Generate, SamplingIsReproducibleForASeed) {
  Model mm({"residual.kind=msar"});
  at::NoGradGuard no_grad;
  Sampling s;
  s.temperature = 1.5;
  s.top_k = 40;
  s.top_p = 0.95;
  s.seed = 1;
  const std::vector<std::vector<int>> prompts = {{1, 2, 3}, {4, 5}};
  const Generation a = generate(mm.m, prompts, 20, s, -1), b = generate(mm.m, prompts, 20, s, -1);
  EXPECT_EQ(a.tokens, b.tokens);
  s.seed = 2;
  EXPECT_NE(generate(mm.m, prompts, 20, s, -1).tokens, a.tokens);
  for (const auto& t : a.tokens)
    for (int id : t) EXPECT_TRUE(id >= 0 && id < mm.cfg.model.vocab_size);
}

TEST(Generate, StopsAtEndOfDocumentStopsAndTheContext) {
  Model mm({"residual.kind=attnres"}, 16);
  at::NoGradGuard no_grad;
  Sampling greedy;
  greedy.temperature = 0;
  const std::vector<int> prompt = {3, 1, 4};
  const std::vector<int> free_run = generate(mm.m, {prompt}, 8, greedy, -1).tokens[0];
  // The end-of-document id ends the sequence where it first appears, and is kept.
  const Generation e = generate(mm.m, {prompt}, 8, greedy, free_run[2]);
  const size_t first = size_t(std::find(free_run.begin(), free_run.end(), free_run[2]) - free_run.begin());
  EXPECT_EQ(e.tokens[0], std::vector<int>(free_run.begin(), free_run.begin() + first + 1));
  EXPECT_EQ(e.stopped[0], "eos");
  // on_token can end a sequence.
  int seen = 0;
  const Generation s = generate(mm.m, {prompt}, 8, greedy, -1, [&](size_t, int) { return ++seen < 3; });
  EXPECT_EQ(s.tokens[0].size(), 3u);
  EXPECT_EQ(s.stopped[0], "stop");
  // 13 prompt ids in a context of 16: 4 ids fit (the last one is never fed back).
  const Generation c = generate(mm.m, {std::vector<int>(13, 2)}, 10, greedy, -1);
  EXPECT_EQ(c.tokens[0].size(), 4u);
  EXPECT_EQ(c.stopped[0], "context");
  expect_error([&] { generate(mm.m, {std::vector<int>(17, 2)}, 1, greedy, -1); }, {"prompt 0 has 17 tokens", "16"});
  expect_error([&] { generate(mm.m, {{}}, 1, greedy, -1); }, {"prompt 0 is empty"});
  expect_error([&] { generate(mm.m, {{64}}, 1, greedy, -1); }, {"token id 64"});
  Sampling bad;
  bad.top_p = 0;
  expect_error([&] { generate(mm.m, {prompt}, 1, bad, -1); }, {"top-p 0"});
}
