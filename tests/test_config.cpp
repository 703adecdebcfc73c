// Config loading, validation messages, --set overrides, and the learning-rate schedules.
#include <cmath>

#include <set>
#include <sstream>

#include "depthkit/model/config_check.h"
#include "depthkit/model/router.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/train/schedule.h"
#include "depthkit/util/fs.h"
#include "helpers.h"

namespace depthkit::test {

// Config's own checks, without the registries' names and checks (model/config_check.h).
const ConfigRules kNoRules{};

TEST(Config, LoadsEveryShippedConfig) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(source_dir() + "/configs")) {
    if (e.path().extension() != ".toml") continue;
    Config c = load_config(e.path().string());
    EXPECT_GT(c.total_steps(), 0) << e.path();
    ++n;
  }
  EXPECT_GE(n, 6);
}

TEST(Config, WideBenchPresetHasTheDense01bLayer) {
  // configs/bench/wide.toml is `bench --kinds` at the 0.1B width (issue 18): dense-0.1b's layer,
  // the widths `bench --ops 0.1b` times the operators at, in 4 layers of T 512 × batch 4.
  const Config w = load_config(source_dir() + "/configs/bench/wide.toml");
  const Config p = load_config(source_dir() + "/configs/paper/dense-0.1b.toml");
  EXPECT_EQ(w.model.d_model, p.model.d_model);
  EXPECT_EQ(w.model.n_heads, p.model.n_heads);
  EXPECT_EQ(w.model.n_kv_heads, p.model.n_kv_heads);
  EXPECT_EQ(w.model.resolved_head_dim(), p.model.resolved_head_dim());
  EXPECT_EQ(w.model.d_ff, p.model.d_ff);
  EXPECT_EQ(w.model.d_model, 640);
  EXPECT_EQ(w.model.n_layers, 4);
  EXPECT_EQ(w.model.seq_len, 512);
  EXPECT_EQ(w.train.micro_batch, 4);
  EXPECT_EQ(w.model.vocab_size, 4096);
}

TEST(Config, UnknownKeyIsNamed) {
  expect_error([] { Config::parse("[model]\nn_layer = 3\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"x.toml", "unknown key 'model.n_layer'"});
  expect_error([] { Config::parse("[modle]\nn_layers = 3\n", "x.toml", kNoRules); }, {"x.toml", "unknown section '[modle]'"});
}

TEST(Config, WrongTypeIsNamed) {
  expect_error([] { Config::parse("[model]\nn_layers = \"4\"\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"x.toml", "'model.n_layers'", "must be an integer", "string \"4\""});
  expect_error([] { Config::parse("[model]\ntie_embeddings = 1\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"'model.tie_embeddings'", "true or false"});
  expect_error([] { Config::parse("[optim]\nlr = \"fast\"\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"'optim.lr'", "must be a number"});
}

TEST(Config, OutOfRangeIsNamed) {
  expect_error([] { Config::parse("[model]\nn_layers = 0\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"'model.n_layers'", "got 0"});
  expect_error([] { Config::parse("[optim]\nschedule = \"linear\"\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"'optim.schedule'", "\"cosine\", \"wsd\"", "\"linear\""});
  expect_error([] { Config::parse("[model]\nn_heads = 4\nn_kv_heads = 3\n[train]\nsteps=1\n", "x.toml", kNoRules); },
               {"'model.n_kv_heads'"});
  expect_error([] { Config::parse("[train]\nsteps = 0\n", "x.toml", kNoRules); }, {"'train.steps'"});
}

TEST(Config, SyntaxErrorNamesFileAndLine) {
  expect_error([] { Config::parse("[model\nn_layers = 3\n", "broken.toml", kNoRules); }, {"broken.toml:1", "syntax"});
}

TEST(Config, SetOverrides) {
  const std::string base = "[train]\nsteps = 10\n";
  Config c = Config::parse(base, "x.toml", kNoRules, {"model.n_layers=28", "optim.lr=1e-3", "train.device=cpu",
                                            "model.tie_embeddings=true", "optim.schedule=\"wsd\""});
  EXPECT_EQ(c.model.n_layers, 28);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.optim.schedule, "wsd");
  expect_error([&] { Config::parse(base, "x.toml", kNoRules, {"model.nope=1"}); }, {"--set model.nope=1", "unknown key 'model.nope'"});
  expect_error([&] { Config::parse(base, "x.toml", kNoRules, {"model.n_layers=abc"}); }, {"'model.n_layers'", "must be an integer"});
  expect_error([&] { Config::parse(base, "x.toml", kNoRules, {"n_layers"}); }, {"--set n_layers", "section.key=value"});
}

TEST(Config, ResolvedTomlRoundTrips) {
  Config c = load_config(source_dir() + "/configs/tiny.toml", {"model.head_dim=64", "optim.eps=1e-15"});
  Config d = parse_config(c.to_toml(), "resolved");
  EXPECT_EQ(c.to_toml(), d.to_toml());
  EXPECT_EQ(d.model.head_dim, 64);
  EXPECT_DOUBLE_EQ(d.optim.eps, 1e-15);
}

TEST(Config, InvalidPathwayCombinationsNameTheKey) {
  const std::string base = "[train]\nsteps = 1\n";
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=msar", "residual.kernels=[4, 0, 12]"}); },
               {"'residual.kernels'", "got 0"});
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=msar", "residual.streams=3"}); },
               {"'residual.kernels'", "needs 2"});
  expect_error([&] { parse_config(base, "x.toml", {"residual.streams=0"}); }, {"'residual.streams'", "got 0"});
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=msar", "residual.kernels=\"4,8\""}); },
               {"'residual.kernels'", "array of integers"});
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=mhc", "residual.sinkhorn_iters=0"}); },
               {"'residual.sinkhorn_iters'"});
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=msar", "residual.fusion=\"max\""}); },
               {"'residual.fusion'", "\"hpre\", \"mean\""});
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=msar", "residual.conv_init=\"ones\""}); },
               {"'residual.conv_init'", "\"zeros\", \"average\", \"normal\""});
  expect_error([&] { parse_config(base, "x.toml", {"residual.impl=\"eager\""}); },
               {"'residual.impl'", "\"reference\", \"fused\""});
  Config ok = parse_config(base, "x.toml", {"residual.kind=msar", "residual.streams=3", "residual.kernels=[2, 5]"});
  EXPECT_EQ(ok.residual.kernels, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(parse_config(ok.to_toml(), "resolved").residual.kernels, ok.residual.kernels);
}

// Config::parse knows no kind or router: those names are the registries', given by the layer that
// owns them (model/config_check.h), so that config stays below the pathways.
TEST(Config, NamesFromAboveAreCheckedByTheirOwners) {
  const std::string base = "[train]\nsteps = 1\n";
  EXPECT_EQ(Config::parse(base, "x.toml", kNoRules, {"residual.kind=nope"}).residual.kind, "nope");
  EXPECT_EQ(Config::parse(base, "x.toml", kNoRules, {"moe.router=nope"}).model.moe.router, "nope");
  expect_error([&] { parse_config(base, "x.toml", {"residual.kind=nope"}); },
               {"--set residual.kind=nope", "'residual.kind'", "\"dar\"", "got \"nope\""});
  expect_error([&] { parse_config("[moe]\nrouter = \"nope\"\n" + base, "x.toml"); },
               {"x.toml", "'moe.router'", "\"softmax_topk\"", "got \"nope\""});
  // Every kind and router the registries hold is accepted.
  for (const auto& kind : pathway_kind_names()) EXPECT_EQ(parse_config(base, "x.toml", {"residual.kind=" + kind}).residual.kind, kind);
  for (const auto& router : moe_router_names())
    EXPECT_EQ(parse_config(base, "x.toml", {"moe.router=" + router}).model.moe.router, router);
}

// Config::keys is the one list of keys: values() and to_toml() follow it, and every key has a row
// in docs/training.md's table (a key added without its documentation fails here), and every row
// names a declared key.
TEST(Config, KeysAreDeclaredOnceAndDocumented) {
  const std::vector<ConfigKey> keys = Config::keys();
  const auto values = Config().values();
  ASSERT_EQ(keys.size(), values.size());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(keys[i].path(), values[i].first);
  std::set<std::string> documented;
  std::istringstream doc(read_file(source_dir() + "/docs/training.md"));
  for (std::string line; std::getline(doc, line);) {
    if (!line.starts_with("| `")) continue;
    const std::string cell = line.substr(2, line.find(" |", 2) - 2);  // the row's first cell
    std::string section;
    for (size_t a = cell.find('`'); a != std::string::npos; a = cell.find('`', cell.find('`', a + 1) + 1)) {
      const std::string name = cell.substr(a + 1, cell.find('`', a + 1) - a - 1);
      const size_t dot = name.find('.');
      if (dot != std::string::npos) section = name.substr(0, dot);
      if (!section.empty()) documented.insert(dot != std::string::npos ? name : section + "." + name);
    }
  }
  std::set<std::string> declared, sections;
  for (const auto& k : keys) declared.insert(k.path()), sections.insert(k.section);
  for (const auto& k : declared) EXPECT_TRUE(documented.count(k)) << k << " has no row in docs/training.md's key table";
  for (const auto& k : documented)
    if (sections.count(k.substr(0, k.find('.'))) && !declared.count(k))
      ADD_FAILURE() << k << " is in docs/training.md's key table but is not a declared key";
}

TEST(Schedule, WarmupThenCosineToMinimum) {
  OptimConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0, 100), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9, 100), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10, 100), 1.0);
  EXPECT_NEAR(learning_rate(o, 99, 100), 0.1, 1e-12);
  EXPECT_NEAR(learning_rate(o, 10 + 89 / 2.0, 100), 0.55, 0.02);
  for (int s = 11; s < 100; ++s) EXPECT_LE(learning_rate(o, s, 100), learning_rate(o, s - 1, 100));
}

TEST(Schedule, WarmupStableExponentialDecay) {
  OptimConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  o.schedule = "wsd";
  o.decay_fraction = 0.2;
  EXPECT_DOUBLE_EQ(learning_rate(o, 50, 100), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 79, 100), 1.0);
  EXPECT_NEAR(learning_rate(o, 89, 100), std::pow(0.1, 0.5), 1e-12);
  EXPECT_NEAR(learning_rate(o, 99, 100), 0.1, 1e-12);
}

}  // namespace depthkit::test
