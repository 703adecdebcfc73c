#include "depthkit/train/parameter_sets.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>

#include "depthkit/model/transformer.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/util/error.h"

namespace depthkit {

ExpertGroups ExpertGroups::of(World& world, const Config& cfg) {
  ExpertGroups g;
  const int64_t P = cfg.model.moe.expert_parallel, W = world.size(), r = world.rank();
  if (P == 1) return g;
  if (W % P != 0)
    fail("key 'moe.expert_parallel' (", P, ") must divide the number of ranks (", W, ")");
  std::vector<int64_t> split, replicas;
  for (int64_t i = 0; i < P; ++i) split.push_back(r / P * P + i);
  for (int64_t i = r % P; i < W; i += P) replicas.push_back(i);
  g.split = world.group("experts", split);
  g.replicas = world.group("expert-replicas", replicas);
  const int64_t per_rank = cfg.model.moe.n_experts / P;
  g.placement = {(r % P) * per_rank, per_rank, g.split.get()};
  return g;
}

// One set: its parameters (indices into the store), the group that averages them, its AdamW, and
// what averages its gradients.
struct ParameterSets::Set {
  std::vector<size_t> members;
  Group* group = nullptr;
  int64_t slices = 1;  // P for the experts: each rank holds one slice of P
  std::optional<AdamW> optim;
  std::unique_ptr<GradientReducer> reducer;   // ZeRO ≤ 1
  std::unique_ptr<ShardedGradients> sharded;  // ZeRO-2
  int64_t bucket_bytes = 0;  // ZeRO's buckets: the reduce-scatters' and the all-gathers' size
  std::vector<at::Tensor> tensors(const ParameterStore& store) const {
    std::vector<at::Tensor> out;
    for (size_t i : members) out.push_back(store.all()[i].tensor);
    return out;
  }
};

namespace {

// ZeRO's buckets (a reduce-scatter's gradients, an all-gather's parameters): train.bucket_bytes,
// or a quarter of the set's gradients between 1 MiB and 25 MiB (DDP's first and default bucket):
// few messages for a small model (each costs a round-trip), DDP-sized ones for a large model, and
// never more than a few alive at once.
int64_t bucket_bytes_for(const std::vector<at::Tensor>& tensors, int64_t configured) {
  if (configured > 0) return configured;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.nbytes();
  return std::clamp<int64_t>(bytes / 4, int64_t(1) << 20, int64_t(25) << 20);
}

}  // namespace

ParameterSets::ParameterSets(Transformer& model, const Config& cfg, World& world, ExpertGroups& experts)
    : world_(world), params_(model.parameters()), zero_(cfg.train.zero) {
  ParameterStore& store = model.parameters();
  const auto& all = store.all();
  auto replicated = std::make_unique<Set>(), routed = std::make_unique<Set>();
  replicated->group = &world.all();
  for (size_t i = 0; i < all.size(); ++i) (all[i].is_slice() ? routed : replicated)->members.push_back(i);
  sets_.push_back(std::move(replicated));
  if (!routed->members.empty()) {
    expert_slices_ = cfg.model.moe.expert_parallel;
    expert_split_ = experts.split.get();
    expert_replicas_ = experts.replicas.get();
    routed->group = experts.replicas.get();
    routed->slices = expert_slices_;
    sets_.push_back(std::move(routed));
  }
  for (auto& set : sets_) {
    Group& g = *set->group;
    const bool shard = cfg.train.zero >= 1;
    set->optim.emplace(store, cfg.optim,
                       ParameterShard::of(AdamW::sizes(store, set->members), shard ? g.rank() : 0, shard ? g.size() : 1),
                       set->members);
    const std::vector<at::Tensor> tensors = set->tensors(store);
    set->bucket_bytes = bucket_bytes_for(tensors, cfg.train.bucket_bytes);
    if (cfg.train.zero >= 2)
      set->sharded = std::make_unique<ShardedGradients>(set->optim->members(), set->optim->shard(), g, set->bucket_bytes);
    else
      set->reducer = g.gradient_reducer(tensors);
  }
}

ParameterSets::~ParameterSets() = default;

void ParameterSets::broadcast_parameters() {
  for (auto& set : sets_)
    for (at::Tensor t : set->tensors(params_)) {
      at::Tensor data = t.detach();
      set->group->broadcast(data);
    }
}

void ParameterSets::load_optimizer(const SafetensorsReader& file) {
  const size_t expected = 2 * params_.all().size() + 1;
  if (file.tensors().size() != expected)
    fail(file.path(), ": holds ", file.tensors().size(), " optimizer tensors, this model needs ", expected);
  for (auto& set : sets_) set->optim->load_state(file);
}

void ParameterSets::begin_step() {
  for (auto& set : sets_)
    if (set->sharded) set->sharded->begin_step();
}

void ParameterSets::begin_micro_step(bool last) {
  for (auto& set : sets_) {
    if (!set->reducer) continue;
    set->reducer->begin_micro_step(last);
    if (last && set->group->size() > 1)  // the Reducer all-reduces every gradient of the set once
      set->group->count("all_reduce", set->optim->total_elements() * int64_t(sizeof(float)));
  }
}

void ParameterSets::before_backward() {
  for (auto& set : sets_)
    if (set->reducer) set->reducer->before_backward();
}

void ParameterSets::after_backward() {
  for (auto& set : sets_)
    if (set->sharded) set->sharded->finish_micro_step();
}

std::map<std::string, int64_t> ParameterSets::traffic() const {
  std::map<std::string, int64_t> out;
  for (const Group* g : {&world_.all(), expert_split_, expert_replicas_})
    if (g)
      for (const auto& [name, bytes] : g->traffic()) out[name] += bytes;
  return out;
}

double ParameterSets::clip(double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> gradients;
  // Σ g² on the device (read once): of what every rank holds whole, and of what is split over ranks.
  const at::TensorOptions on_device = at::TensorOptions(at::kDouble).device(params_.device());
  at::Tensor whole = at::zeros({}, on_device), split = at::zeros({}, on_device);
  for (auto& set : sets_) {
    // The mean over all W ranks. An expert's gradient on a rank already sums the contributions of
    // the P ranks that sent it tokens, and its group (the W / P ranks holding the same experts)
    // sums or averages the rest: 1 / (group size · P), or 1 / P after the reducer's mean. (Scaled
    // here, not by a hook on the parameters: recomputation's backward passes through those twice.)
    if (set->sharded) {
      at::Tensor& g = set->sharded->gradient();
      g.div_(double(set->group->size() * set->slices));
      add_sum_of_squares(split, g);  // every element in one rank's shard only
      gradients.push_back(g);
      continue;
    }
    for (at::Tensor t : set->tensors(params_)) {
      if (!t.grad().defined()) continue;
      if (set->slices > 1) t.mutable_grad().div_(double(set->slices));
      add_sum_of_squares(set->slices > 1 ? split : whole, t.grad());
      gradients.push_back(t.mutable_grad());
    }
  }
  // Shards add up over every rank; expert slices (whole on each replica) over the ranks that
  // split the experts; what every rank holds whole counts once.
  const at::Tensor sums = at::stack({whole, split}).to(at::kCPU);
  at::Tensor split_sum = sums.narrow(0, 1, 1).clone();
  if (zero_ >= 2) world_.all_reduce_sum(split_sum);
  else if (expert_split_) expert_split_->all_reduce_sum(split_sum);
  const double total = std::sqrt(sums.data_ptr<double>()[0] + split_sum.data_ptr<double>()[0]);
  clip_to(total, max_norm, gradients);
  return total;
}

void ParameterSets::step(double lr) {
  for (auto& set : sets_) {
    set->optim->step(lr, set->sharded ? set->sharded->gradient() : at::Tensor());
    if (zero_ >= 1 && set->group->size() > 1) all_gather_parameters(*set->optim, *set->group, set->bucket_bytes);
  }
}

TensorStream ParameterSets::model_stream() {
  TensorStream out;
  for (const auto& p : params_.all()) out.specs.push_back({p.name, p.tensor.scalar_type(), p.full_shape});
  out.produce = [this](const TensorStream::Sink& sink) {
    for (const auto& p : params_.all()) {
      if (!p.is_slice()) {
        if (world_.root()) sink(p.tensor.detach());
        continue;
      }
      // Rows of slice q are held by world rank q (the first block of ranks splits the experts).
      for (int64_t q = 0; q < expert_slices_; ++q) relay_to_root(world_, q, p.tensor.detach(), sink);
    }
  };
  return out;
}

TensorStream ParameterSets::optimizer_stream() {
  TensorStream out;
  std::vector<TensorStream> parts;
  for (size_t i = 0; i < sets_.size(); ++i)
    parts.push_back(sets_[i]->optim->state_stream(world_, sets_[i]->slices, /*with_step=*/i == 0));
  for (const TensorStream& part : parts) out.specs.insert(out.specs.end(), part.specs.begin(), part.specs.end());
  out.produce = [parts](const TensorStream::Sink& sink) {
    for (const TensorStream& part : parts) part.produce(sink);
  };
  return out;
}

int64_t ParameterSets::optimizer_state_bytes() const {
  int64_t n = 0;
  for (const auto& set : sets_) n += set->optim->state_bytes();
  return n;
}

int64_t ParameterSets::bucket_bytes() const {
  int64_t n = 0;
  for (const auto& set : sets_)
    if (set->sharded) n = std::max(n, set->sharded->bucket_bytes());
  return n;
}

int64_t ParameterSets::gradient_bytes() const {
  int64_t n = 0;
  for (const auto& set : sets_)
    n += set->sharded ? set->sharded->shard_bytes() : set->optim->total_elements() * int64_t(sizeof(float));
  return n;
}

std::string ParameterSets::describe() const {
  std::string out;
  for (const auto& set : sets_) {
    const AdamW& o = *set->optim;
    out += cat(out.empty() ? "" : "; ", sets_.size() > 1 ? (set->slices > 1 ? "experts: " : "replicated: ") : "",
               "AdamW state of ", o.shard().end - o.shard().begin, " of ", o.total_elements(), " parameters per rank, ",
               o.state_bytes(), " bytes");
    if (set->sharded)
      out += cat(", gradients ", set->sharded->shard_bytes(), " bytes, buckets of up to ", set->sharded->bucket_bytes());
  }
  return out;
}

}  // namespace depthkit
