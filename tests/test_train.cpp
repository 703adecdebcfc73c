// Checkpoints, exact resume, non-finite stop, optimizer parity (safetensors itself: test_io.cpp).
#include <ATen/ops/equal.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "depthkit/io/safetensors.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/trainer.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"
#include "helpers.h"

namespace depthkit::test {

// Reads the training losses of metrics.jsonl by step.
std::map<int64_t, double> losses(const fs::path& run) {
  std::map<int64_t, double> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Progress::set_enabled(false);
    write_pattern_data(dir.str("data"), 64, 6000, 1000);
  }
  void TearDown() override { Progress::set_enabled(true); }
  TrainOptions options(const std::string& run) {
    TrainOptions o;
    o.config = small_config(dir.str("data"));
    o.run_dir = dir.str(run);
    return o;
  }
  TempDir dir;
};

TEST_F(TrainTest, CheckpointRoundTrip) {
  TrainOptions o = options("run");
  o.config.train.steps = 4;
  TrainResult r = train(o);
  EXPECT_EQ(r.step, 4);
  auto ck_dir = find_checkpoint(o.run_dir);
  ASSERT_TRUE(ck_dir);
  EXPECT_EQ(ck_dir->filename(), "step_00000004");
  Checkpoint ck = load_checkpoint(*ck_dir, true);
  EXPECT_EQ(ck.state.step, 4);
  EXPECT_EQ(ck.state.tokens_seen, 4 * 4 * 16);
  EXPECT_EQ(ck.state.data.index, 16);
  EXPECT_EQ(parse_config(ck.state.config_toml, "state").to_toml(), o.config.to_toml());
  Transformer m(o.config.model, o.config.residual, at::kCPU, 99);
  m.parameters().load(*ck.weights);
  for (auto& [name, t] : m.parameters().named()) EXPECT_TRUE(at::equal(t, ck.weights->read(name))) << name;
  EXPECT_EQ(ck.optimizer->read("step").item<int64_t>(), 4);
  // Loading into a model of another shape names the tensor and both shapes.
  Config other = o.config;
  other.model.d_model = 48;
  Transformer wrong(other.model, other.residual, at::kCPU, 0);
  expect_error([&] { wrong.parameters().load(*ck.weights); },
               {"model.safetensors", "'embedding'", "shape"});
}

// Trains `whole` in one go and `part` interrupted after step 3 then resumed; every loss, the
// validation loss, the weights and the optimizer state must be bit for bit the same.
void expect_exact_resume(TrainOptions whole, TrainOptions part) {
  TrainResult a = train(whole);
  ASSERT_EQ(a.losses.size(), 8u);
  part.stop_after = 3;  // interrupted between periodic checkpoints
  TrainResult b1 = train(part);
  EXPECT_TRUE(b1.interrupted);
  EXPECT_EQ(b1.step, 3);
  part.stop_after = -1;
  part.resume = true;
  TrainResult b2 = train(part);
  ASSERT_EQ(b2.losses.size(), 5u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b1.losses[i], a.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(b2.losses[i], a.losses[i + 3]) << "step " << i + 4;
  EXPECT_EQ(b2.val_loss, a.val_loss);
  EXPECT_EQ(losses(whole.run_dir), losses(part.run_dir));
  auto ca = load_checkpoint(*find_checkpoint(whole.run_dir), true);
  auto cb = load_checkpoint(*find_checkpoint(part.run_dir), true);
  for (const TensorSpec& t : ca.weights->tensors())
    EXPECT_TRUE(at::equal(ca.weights->read(t.name), cb.weights->read(t.name))) << t.name;
  for (const TensorSpec& t : ca.optimizer->tensors())
    EXPECT_TRUE(at::equal(ca.optimizer->read(t.name), cb.optimizer->read(t.name))) << t.name;
}

TEST_F(TrainTest, ResumeContinuesWithIdenticalLosses) { expect_exact_resume(options("whole"), options("parts")); }

// The same with a sparse-MoE backbone (its auxiliary loss in the optimised loss) and DAR.
TEST_F(TrainTest, MoeResumeContinuesWithIdenticalLosses) {
  TrainOptions whole = options("whole"), part = options("parts");
  for (TrainOptions* o : {&whole, &part}) {
    o->config.model.moe.n_experts = 4;
    o->config.model.moe.top_k = 2;
    o->config.model.moe.expert_d_ff = 16;
    o->config.model.moe.n_shared_experts = 1;
    o->config.model.moe.leading_dense_layers = 1;
    o->config.residual.kind = "dar";
  }
  expect_exact_resume(whole, part);
  std::map<int64_t, double> aux_a, aux_b;  // the logged auxiliary losses too
  for (auto [run, aux] : {std::pair{&whole, &aux_a}, std::pair{&part, &aux_b}}) {
    std::ifstream in(run->run_dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("aux_loss")) (*aux)[j["step"].get<int64_t>()] = j["aux_loss"].get<double>();
    }
  }
  EXPECT_FALSE(aux_a.empty());
  EXPECT_EQ(aux_a, aux_b);
}

TEST_F(TrainTest, FreshRunRefusesToOverwriteCheckpoints) {
  TrainOptions o = options("run");
  o.config.train.steps = 2;
  train(o);
  expect_error([&] { train(o); }, {"already has checkpoints", "--resume"});
}

TEST_F(TrainTest, NonFiniteLossStopsAndKeepsLastCheckpoint) {
  TrainOptions o = options("run");
  o.config.train.steps = 2;
  o.config.train.checkpoint_every = 1;
  train(o);
  // Poison the latest checkpoint's weights so the next step's loss is NaN.
  fs::path last = *find_checkpoint(o.run_dir);
  auto st = load_safetensors((last / "model.safetensors").string());
  st.tensors.at("final_norm").fill_(std::numeric_limits<float>::quiet_NaN());
  NamedTensors poisoned(st.tensors.begin(), st.tensors.end());
  save_safetensors((last / "model.safetensors").string(), poisoned);
  const std::string before = read_file(last / "model.safetensors");
  o.config.train.steps = 4;
  o.resume = true;
  expect_error([&] { train(o); }, {"non-finite loss at step 3", "step_00000002"});
  EXPECT_EQ(find_checkpoint(o.run_dir)->filename(), "step_00000002");
  EXPECT_FALSE(fs::exists(o.run_dir / "checkpoints" / "step_00000003"));
  EXPECT_EQ(read_file(last / "model.safetensors"), before);
}

TEST_F(TrainTest, GradientAccumulationMatchesTheLargerBatch) {
  // Two micro-batches of 2 read the same 4 windows as one batch of 4: the same step up to
  // float32 summation order.
  TrainOptions big = options("big"), acc = options("acc");
  big.config.train.steps = acc.config.train.steps = 4;
  acc.config.train.micro_batch = 2;
  acc.config.train.grad_accum = 2;
  TrainResult a = train(big), b = train(acc);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(b.losses[i], a.losses[i], 1e-5 * a.losses[i]) << i;
  EXPECT_NE(a.losses.front(), a.losses.back());
}

TEST_F(TrainTest, LossFallsOnLearnableData) {
  TrainOptions o = options("run");
  o.config.train.steps = 150;
  o.config.train.eval_every = 0;
  o.config.optim.lr = 1e-2;
  TrainResult r = train(o);
  EXPECT_NEAR(r.losses.front(), std::log(64.0), 0.2);  // uniform at initialisation
  EXPECT_LT(r.val_loss, std::log(64.0) - 1.0);
}

}  // namespace depthkit::test
