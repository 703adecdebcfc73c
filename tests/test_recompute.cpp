// train.recompute (model/recompute.h): each branch run again in backward gives gradients
// bit-identical to keeping its activations, for every pathway on the dense and the MoE backbone,
// in float32 and under bfloat16 compute; and it keeps fewer bytes alive at the loss.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>

#include <string>
#include <vector>

#include "depthkit/model/transformer.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/util/memory.h"
#include "helpers.h"

namespace depthkit::test {

namespace {

struct Variant {
  std::string kind;
  bool moe = false, shared = false, bf16 = false;
};

Config variant_config(const Variant& v) {
  Config c = small_config("unused");
  c.model.n_layers = 3;
  c.residual.kind = v.kind;
  c.residual.block_sublayers = 2;
  c.residual.share_within_block = v.shared;
  if (v.moe) {
    c.model.moe.n_experts = 4;
    c.model.moe.top_k = 2;
    c.model.moe.expert_d_ff = 16;
    c.model.moe.n_shared_experts = 1;
    c.model.moe.leading_dense_layers = 1;
  }
  return c;
}

// The loss and every parameter's gradient after one backward, with train.recompute = `mode`.
std::pair<at::Tensor, std::vector<at::Tensor>> loss_and_grads(Transformer& m, const at::Tensor& batch,
                                                              const std::string& mode) {
  m.set_recompute(mode);
  m.parameters().zero_grad();
  at::Tensor loss = m.loss(batch);
  loss.backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : m.parameters().all()) grads.push_back(p.tensor.grad().defined() ? p.tensor.grad().clone() : at::Tensor());
  return {loss.detach(), grads};
}

}  // namespace

TEST(Recompute, BranchGradientsBitIdenticalForEveryKind) {
  std::vector<Variant> variants;
  for (const std::string& kind : pathway_kind_names()) {
    variants.push_back({kind});
    variants.push_back({kind, /*moe=*/true});
  }
  variants.push_back({"attnres", false, /*shared=*/true});
  variants.push_back({"dar", true, false, /*bf16=*/true});
  variants.push_back({"msar", false, false, /*bf16=*/true});
  for (const Variant& v : variants) {
    SCOPED_TRACE(cat(v.kind, v.moe ? " moe" : " dense", v.shared ? " shared" : "", v.bf16 ? " bf16" : ""));
    const Config c = variant_config(v);
    Transformer m(c.model, c.residual, at::kCPU, 7, at::kFloat,
                  v.bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
    randomize(m.parameters(), 11, 0.1, /*norms_near_one=*/true);
    const at::Tensor batch = at::randint(c.model.vocab_size, {3, c.model.seq_len + 1}, gen(5), at::kLong);
    const auto [loss_kept, kept] = loss_and_grads(m, batch, "none");
    const auto [loss_again, again] = loss_and_grads(m, batch, "branch");
    EXPECT_TRUE(at::equal(loss_kept, loss_again)) << loss_kept.item<double>() << " vs " << loss_again.item<double>();
    const auto& params = m.parameters().all();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(kept[i].defined(), again[i].defined()) << params[i].name;
      if (kept[i].defined()) {
        EXPECT_TRUE(at::equal(kept[i], again[i])) << params[i].name;
      }
    }
    if (v.moe) {  // the MoE terms are the same too
      EXPECT_EQ(m.moe_terms().load.size(), 2u);
    }
  }
}

TEST(Recompute, BranchKeepsFewerBytesAtTheLoss) {
  Config c = variant_config({"dar"});
  c.model.seq_len = 64;
  Transformer m(c.model, c.residual, at::kCPU, 7);
  const at::Tensor batch = at::randint(c.model.vocab_size, {8, c.model.seq_len + 1}, gen(5), at::kLong);
  TensorMemory::install();
  auto kept_at_loss = [&](const std::string& mode) {
    m.set_recompute(mode);
    const int64_t before = TensorMemory::current_bytes();
    at::Tensor loss = m.loss(batch);
    const int64_t held = TensorMemory::current_bytes() - before;  // the graph's saved activations, and the loss
    loss.backward();
    return held;
  };
  const int64_t none = kept_at_loss("none"), branch = kept_at_loss("branch");
  EXPECT_LT(double(branch), 0.6 * double(none)) << "kept " << branch << " bytes with recomputation, " << none << " without";
}

TEST(Recompute, UnknownModeRefused) {
  const Config c = variant_config({"residual"});
  Transformer m(c.model, c.residual, at::kCPU, 7);
  expect_error([&] { m.set_recompute("everything"); }, {"train.recompute", "everything"});
  expect_error([&] { parse_config("[train]\nrecompute = \"layers\"\n", "x.toml"); }, {"train.recompute", "layers"});
}

}  // namespace depthkit::test
