// train.recompute (model/recompute.h): each branch, or each layer with the pathway's reads and
// writes, run again in backward gives gradients bit-identical to keeping its activations, for
// every pathway on the dense and the MoE backbone, in float32 and under bfloat16 compute; and it
// keeps fewer bytes alive at the loss (a layer fewer than a branch).
//
// One exception, by construction: MSAR's convolution banks under "layer". Bank k is read by every
// later layer; recomputed by layer, a layer's reads' gradients for it are summed within the layer
// and those sums then across layers, where without recomputation autograd adds every read's
// gradient to one running sum. The same terms grouped otherwise: float32 rounding, held here to
// 4 units in the last place of the largest element. (The depth sources, read by every later layer
// too, keep their one running sum: the reads add into the source's accumulator,
// fused::SourceStandIns.)
// A second, for MSAR with blocks across layers (S = 4 here): without recomputation a block's
// reads are made at once for its 4 branches (msar_block_read), recomputed by layer two at a time
// (the layer's: PathwayState::read_horizon, so that no read is kept across a region), and one
// call sums its branches' ∂v before adding the source's and the banks' shares. The embedding (the
// one source block 1 reads) and bank 0 get the same terms grouped otherwise: held to 8 units in
// the last place of the largest element; everything else stays bit-identical.
#include <ATen/core/grad_mode.h>
#include <ATen/TensorOperators.h>
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
  bool moe = false, shared = false, bf16 = false, full = false;  // full: blocks of one branch (S = 1)
  bool wide = false;  // blocks of 4 branches, each across two layers (MSAR keeps a block's reads between them)
};

Config variant_config(const Variant& v) {
  Config c = small_config("unused");
  c.model.n_layers = 3;
  c.residual.kind = v.kind;
  c.residual.block_sublayers = v.full ? 1 : v.wide ? 4 : 2;
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

TEST(Recompute, GradientsBitIdenticalForEveryKindAndMode) {
  std::vector<Variant> variants;
  for (const std::string& kind : pathway_kind_names()) {
    variants.push_back({kind});
    variants.push_back({kind, /*moe=*/true});
  }
  variants.push_back({"attnres", false, /*shared=*/true});
  variants.push_back({"dar", true, false, /*bf16=*/true});
  variants.push_back({"msar", false, false, /*bf16=*/true});
  for (const char* kind : {"attnres", "dar", "msar"}) variants.push_back({kind, false, false, false, /*full=*/true});
  variants.push_back({"msar", false, false, false, false, /*wide=*/true});
  for (const Variant& v : variants) {
    SCOPED_TRACE(cat(v.kind, v.moe ? " moe" : " dense", v.shared ? " shared" : "", v.bf16 ? " bf16" : "", v.full ? " full" : "",
                     v.wide ? " S = 4" : ""));
    const Config c = variant_config(v);
    Transformer m(c.model, c.residual, at::kCPU, 7, at::kFloat,
                  v.bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
    randomize(m.parameters(), 11, 0.1, /*norms_near_one=*/true);
    const at::Tensor batch = at::randint(c.model.vocab_size, {3, c.model.seq_len + 1}, gen(5), at::kLong);
    const auto [loss_kept, kept] = loss_and_grads(m, batch, "none");
    const MoeTerms terms_kept = m.moe_terms();
    for (const std::string mode : {"branch", "layer"}) {
      SCOPED_TRACE(mode);
      const auto [loss_again, again] = loss_and_grads(m, batch, mode);
      EXPECT_TRUE(at::equal(loss_kept, loss_again)) << loss_kept.item<double>() << " vs " << loss_again.item<double>();
      const auto& params = m.parameters().all();
      for (size_t i = 0; i < params.size(); ++i) {
        ASSERT_EQ(kept[i].defined(), again[i].defined()) << params[i].name;
        if (!kept[i].defined()) continue;
        const double apart = ((kept[i] - again[i]).abs().max() / kept[i].abs().max()).item<double>();
        const bool bank = params[i].name.find(".bank.") != std::string::npos;
        if (v.kind == "msar" && mode == "layer" && v.wide && (bank || params[i].name == "embedding")) {
          EXPECT_LE(apart, 8 * 0x1p-24) << params[i].name;  // the second exception above
          continue;
        }
        if (v.kind == "msar" && mode == "layer" && bank) {
          EXPECT_LE(apart, 4 * 0x1p-24) << params[i].name;  // the first exception above
          continue;
        }
        EXPECT_TRUE(at::equal(kept[i], again[i])) << params[i].name << ": differs by up to " << apart << " of its largest";
      }
      if (v.moe) {  // the MoE terms are the same too
        const MoeTerms& t = m.moe_terms();
        ASSERT_EQ(t.load.size(), 2u);
        EXPECT_TRUE(at::equal(t.aux_loss, terms_kept.aux_loss) && at::equal(t.load[1], terms_kept.load[1]));
      }
    }
  }
}

TEST(Recompute, KeepsFewerBytesAtTheLoss) {
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
  const int64_t none = kept_at_loss("none"), branch = kept_at_loss("branch"), layer = kept_at_loss("layer");
  EXPECT_LT(double(branch), 0.6 * double(none)) << "kept " << branch << " bytes with recomputation, " << none << " without";
  EXPECT_LT(layer, branch) << "kept " << layer << " bytes recomputing layers, " << branch << " recomputing branches";
}

TEST(Recompute, UnknownModeRefused) {
  const Config c = variant_config({"residual"});
  Transformer m(c.model, c.residual, at::kCPU, 7);
  expect_error([&] { m.set_recompute("everything"); }, {"train.recompute", "everything"});
  expect_error([&] { parse_config("[train]\nrecompute = \"layers\"\n", "x.toml"); }, {"train.recompute", "layers"});
}

}  // namespace depthkit::test
