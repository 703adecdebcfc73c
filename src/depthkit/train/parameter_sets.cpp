#include "depthkit/train/parameter_sets.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "depthkit/model/transformer.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/util/error.h"

namespace depthkit {

ExpertGroups ExpertGroups::of(World& world, Group& data, const Config& cfg) {
  ExpertGroups g;
  const int64_t P = cfg.model.moe.expert_parallel, W = data.size(), r = data.rank();
  if (P == 1) return g;
  if (W % P != 0)
    fail("key 'moe.expert_parallel' (", P, ") must divide the number of ranks that hold the same layers (", W, ")");
  const std::vector<int64_t>& members = data.members();  // their ranks in the job
  std::vector<int64_t> split, replicas;
  for (int64_t i = 0; i < P; ++i) split.push_back(members[size_t(r / P * P + i)]);
  for (int64_t i = r % P; i < W; i += P) replicas.push_back(members[size_t(i)]);
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
  // Pipeline stages: the chunk whose backward makes these gradients, or StageParameters::
  // kEveryStage for the parameters every stage reads (over every rank; gradients summed after the
  // step's last backward, reduce_every_stage). 0 without stages.
  int64_t chunk = 0;
  bool every_stage() const { return chunk == StageParameters::kEveryStage; }
  int64_t slices = 1;  // P for the experts: each rank holds one slice of P
  std::optional<AdamW> optim;
  std::unique_ptr<GradientReducer> reducer;   // ZeRO ≤ 1
  std::unique_ptr<ShardedGradients> sharded;  // ZeRO-2
  int64_t bucket_bytes = 0;  // ZeRO's buckets: the reduce-scatters' and the all-gathers' size
  // ZeRO-3: the branch whose parameters these are (0: the rest, kept whole), and this rank's shard
  // of them, flat [chunk]: the only copy it keeps between uses, and what AdamW updates.
  int64_t branch = 0;
  at::Tensor owned;
  // The bytes of parameters this rank keeps between steps: its ZeRO-3 shard, or all of them.
  int64_t parameter_bytes() const {
    return branch > 0 ? owned.nbytes() : optim->total_elements() * int64_t(sizeof(float));
  }
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

void release_storage(const at::Tensor& t) {
  t.unsafeGetTensorImpl()->set_storage_keep_dtype(at::empty({0}, t.options()).storage());
}

void BranchShards::take(ParameterStore& store, int64_t branch, const std::vector<size_t>& members) {
  at::NoGradGuard no_grad;
  for (const bool experts : {false, true}) {
    std::vector<const Parameter*> part;
    std::vector<int64_t> sizes;
    for (size_t i : members)
      if (store.all()[i].is_slice() == experts) {
        part.push_back(&store.all()[i]);
        sizes.push_back(store.all()[i].tensor.numel());
      }
    if (part.empty()) continue;
    const Group& group = experts ? *experts_.replicas : data_;
    const ParameterShard shard = ParameterShard::of(sizes, group.rank(), group.size());
    at::Tensor owned = at::zeros({shard.chunk}, part.front()->tensor.options().requires_grad(false));
    int64_t start = 0;  // of the parameter in the branch's parameters laid flat
    for (const Parameter* p : part) {
      const int64_t n = p->tensor.numel();
      const int64_t lo = std::max(start, shard.begin), hi = std::min(start + n, shard.end);
      if (lo < hi) owned.narrow(0, lo - shard.begin, hi - lo).copy_(p->tensor.detach().view(-1).narrow(0, lo - start, hi - lo));
      release_storage(p->tensor);
      start += n;
    }
    owned_[{experts, branch}] = owned;
  }
}

at::Tensor BranchShards::owned(bool experts, int64_t branch) const {
  const auto it = owned_.find({experts, branch});
  if (it == owned_.end()) fail("BranchShards: nothing kept of branch ", branch, experts ? "'s experts" : "");
  return it->second;
}

// ZeRO-3's branches: each branch's sets (its replicated parameters; its experts' too under expert
// parallelism) all-gathered from their shards before it runs and freed after. As one branch is
// acquired, the gather of the next one (in forward the one after, in backward the one before) is
// started, to overlap its computation. Every rank runs the branches in the same order, so the
// gathers are issued alike.
class ParameterSets::Residency final : public BranchResidency {
 public:
  explicit Residency(std::vector<std::vector<Set*>> by_branch)
      : by_branch_(std::move(by_branch)), pending_(by_branch_.size()), resident_(by_branch_.size(), false) {}

  void acquire(int64_t l, bool backward) override {
    at::NoGradGuard no_grad;
    if (!resident_[size_t(l)]) {
      ++counts_.all;
      if (pending_[size_t(l)].empty())
        start(l);
      else
        ++counts_.prefetched;
      finish(l);
    }
    const int64_t next = backward ? l - 1 : l + 1;
    if (next >= 1 && next < int64_t(by_branch_.size()) && !resident_[size_t(next)] && pending_[size_t(next)].empty())
      start(next);
  }

  const Gathers& counts() const { return counts_; }

  void release(int64_t l, bool) override {
    for (Set* set : by_branch_[size_t(l)])
      for (const Parameter* p : set->optim->members()) release_storage(p->tensor);
    resident_[size_t(l)] = false;
  }

 private:
  struct Gather {
    Set* set;
    at::Tensor gathered;  // [group size · chunk]: every member's shard
    std::unique_ptr<PendingCollective> work;
  };

  void start(int64_t l) {
    for (Set* set : by_branch_[size_t(l)]) {
      at::Tensor out = at::empty({set->group->size() * set->owned.numel()}, set->owned.options());
      auto work = set->group->all_gather_into(set->owned, out);
      pending_[size_t(l)].push_back({set, out, std::move(work)});
    }
  }

  // The gathered shards laid into fresh tensors of the parameters' shapes, which the parameters
  // then take as their storage.
  void finish(int64_t l) {
    for (Gather& g : pending_[size_t(l)]) {
      g.work->wait();
      const ParameterShard& shard = g.set->optim->shard();
      int64_t start = 0;  // of the member in the set laid flat
      for (const Parameter* p : g.set->optim->members()) {
        const int64_t n = p->tensor.numel();
        at::Tensor full = at::empty(p->tensor.sizes(), p->tensor.options());
        for (size_t r = 0; r + 1 < shard.bounds.size(); ++r) {
          const int64_t lo = std::max(start, shard.bounds[r]), hi = std::min(start + n, shard.bounds[r + 1]);
          if (lo < hi)
            full.view(-1).narrow(0, lo - start, hi - lo).copy_(
                g.gathered.narrow(0, int64_t(r) * shard.chunk + lo - shard.bounds[r], hi - lo));
        }
        p->tensor.unsafeGetTensorImpl()->set_storage_keep_dtype(full.storage());
        start += n;
      }
    }
    pending_[size_t(l)].clear();
    resident_[size_t(l)] = true;
  }

  std::vector<std::vector<Set*>> by_branch_;  // [ℓ], ℓ = 1 … branches
  std::vector<std::vector<Gather>> pending_;   // [ℓ]: gathers started and not yet laid out
  std::vector<bool> resident_;                 // [ℓ]: its parameters whole
  Gathers counts_;
};

ParameterSets::ParameterSets(Transformer& model, const Config& cfg, World& world, Group& data, ExpertGroups& experts,
                             const BranchShards* shards, const StageParameters* stages)
    : model_(model), world_(world), data_(data), pipe_(stages ? stages->pipe : nullptr), params_(model.parameters()),
      zero_(cfg.train.zero) {
  ParameterStore& store = model.parameters();
  const auto& all = store.all();
  // The branch each parameter belongs to (ZeRO-3's units; 0: none).
  std::vector<int64_t> branch_of(all.size(), 0);
  if (zero_ >= 3 && !shards) fail("ParameterSets: ZeRO-3 needs the shards its model's branches left (BranchShards)");
  if (zero_ >= 3)
    for (int64_t l = 1; l <= model.config().n_branches(); ++l)
      for (size_t i : model.branch_members(l)) branch_of[i] = l;
  // Replicated and expert parameters, each cut by branch under ZeRO-3 and by chunk of layers under
  // pipeline stages: one set per (chunk, slice, branch); those every stage reads last.
  std::map<std::tuple<int64_t, bool, int64_t>, std::unique_ptr<Set>> by_key;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t chunk = stages ? stages->chunk.at(i) : 0;
    if (chunk == StageParameters::kNotHeld) continue;
    // Sorted last: the sets of a run without stages keep their order.
    const int64_t order = chunk == StageParameters::kEveryStage ? std::numeric_limits<int64_t>::max() : chunk;
    auto& set = by_key[{order, all[i].is_slice(), branch_of[i]}];
    if (!set) {
      set = std::make_unique<Set>();
      set->branch = branch_of[i];
      set->chunk = chunk;
      if (set->every_stage()) {
        if (all[i].is_slice()) fail("ParameterSets: expert slice '", all[i].name, "' cannot be read by every stage");
        set->group = &world.all();
      } else if (all[i].is_slice()) {
        expert_slices_ = cfg.model.moe.expert_parallel;
        expert_split_ = experts.split.get();
        expert_replicas_ = experts.replicas.get();
        set->group = experts.replicas.get();
        set->slices = expert_slices_;
      } else {
        set->group = &data;
      }
    }
    set->members.push_back(i);
  }
  for (auto& [key, set] : by_key) sets_.push_back(std::move(set));  // the replicated ones first
  const auto in_flight = std::make_shared<ReductionsInFlight>();  // ZeRO ≥ 2: bounded over every set
  std::vector<std::vector<Set*>> by_branch(size_t(model.config().n_branches() + 1));
  for (auto& set : sets_) {
    Group& g = *set->group;
    const bool shard = cfg.train.zero >= 1;
    set->optim.emplace(store, cfg.optim,
                       ParameterShard::of(AdamW::sizes(store, set->members), shard ? g.rank() : 0, shard ? g.size() : 1),
                       set->members);
    const std::vector<at::Tensor> tensors = set->tensors(store);
    set->bucket_bytes = bucket_bytes_for(tensors, cfg.train.bucket_bytes);
    // The parameters every stage reads are averaged by reduce_every_stage (their AdamW state sharded
    // as ZeRO-1 shards it).
    if (!set->every_stage()) {
      if (cfg.train.zero >= 2)
        set->sharded = std::make_unique<ShardedGradients>(set->optim->members(), set->optim->shard(), g,
                                                          set->bucket_bytes, in_flight);
      else
        set->reducer = g.gradient_reducer(tensors);
    }
    if (set->branch > 0) {
      set->owned = shards->owned(set->slices > 1, set->branch);
      if (set->owned.numel() != set->optim->shard().chunk)
        fail("ParameterSets: branch ", set->branch, "'s shard holds ", set->owned.numel(), " elements, its AdamW ",
             set->optim->shard().chunk);
      by_branch[size_t(set->branch)].push_back(set.get());
    }
  }
  if (zero_ >= 3) {
    residency_ = std::make_unique<Residency>(std::move(by_branch));
    model.set_branch_residency(residency_.get());
  }
}

ParameterSets::~ParameterSets() {
  if (residency_) model_.set_branch_residency(nullptr);
}

void ParameterSets::broadcast_parameters() {
  for (auto& set : sets_)
    for (at::Tensor t : set->branch > 0 ? std::vector<at::Tensor>{} : set->tensors(params_)) {
      at::Tensor data = t.detach();
      set->group->broadcast(data);
    }
}

void ParameterSets::load_parameters(const SafetensorsReader& file) {
  std::vector<bool> held(params_.all().size(), false);  // whole on this rank
  for (const auto& set : sets_)
    if (set->branch == 0)
      for (size_t i : set->members) held[i] = true;
  params_.load(file, held);  // checks every tensor; copies those held whole
  for (auto& set : sets_)
    if (set->branch > 0) set->optim->read_shard(file, "", set->owned);
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

void ParameterSets::begin_micro_step(bool last, int64_t chunk) {
  for (auto& set : sets_) {
    if (!set->reducer || (chunk != kAllChunks && set->chunk != chunk)) continue;
    set->reducer->begin_micro_step(last);
    if (last && set->group->size() > 1)  // the Reducer all-reduces every gradient of the set once
      set->group->count("all_reduce", set->optim->total_elements() * int64_t(sizeof(float)));
  }
}

void ParameterSets::before_backward(int64_t chunk) {
  for (auto& set : sets_)
    if (set->reducer && (chunk == kAllChunks || set->chunk == chunk)) set->reducer->before_backward();
}

void ParameterSets::after_backward(int64_t chunk) {
  for (auto& set : sets_)
    if (set->sharded && (chunk == kAllChunks || set->chunk == chunk)) set->sharded->finish_micro_step();
}

void ParameterSets::reduce_every_stage() {
  at::NoGradGuard no_grad;
  for (auto& set : sets_) {
    if (!set->every_stage()) continue;
    // A stage that never read a parameter has no gradient for it: zeros, laid flat with the rest.
    std::vector<at::Tensor> grads;
    for (at::Tensor t : set->tensors(params_)) {
      if (!t.grad().defined()) t.mutable_grad() = at::zeros_like(t);
      grads.push_back(t.grad().view(-1));
    }
    at::Tensor flat = at::cat(grads);
    world_.all().all_reduce_sum(flat);
    flat.div_(double(data_.size()));  // the sum over stages of each stage's mean over its ranks
    int64_t at = 0;
    for (at::Tensor& g : grads) {
      g.copy_(flat.narrow(0, at, g.numel()));
      at += g.numel();
    }
  }
}

std::map<std::string, int64_t> ParameterSets::traffic() const {
  std::map<std::string, int64_t> out;
  std::vector<const Group*> groups = {&data_, expert_split_, expert_replicas_, pipe_};
  if (&data_ != &world_.all()) groups.push_back(&world_.all());
  for (const Group* g : groups)
    if (g)
      for (const auto& [name, bytes] : g->traffic()) out[name] += bytes;
  return out;
}

double ParameterSets::clip(double max_norm) {
  reduce_every_stage();
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> gradients;
  // Σ g² on the device (read once): of what every rank of the data group holds whole, of what is
  // split over its ranks, and (pipeline stages) of what every rank holds.
  const at::TensorOptions on_device = at::TensorOptions(at::kDouble).device(params_.device());
  at::Tensor whole = at::zeros({}, on_device), split = at::zeros({}, on_device), everywhere = at::zeros({}, on_device);
  for (auto& set : sets_) {
    if (set->every_stage()) {
      for (at::Tensor t : set->tensors(params_)) {
        add_sum_of_squares(everywhere, t.grad());
        gradients.push_back(t.mutable_grad());
      }
      continue;
    }
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
  const at::Tensor sums = at::stack({whole, split, everywhere}).to(at::kCPU);
  at::Tensor split_sum = sums.narrow(0, 1, 1).clone();
  if (zero_ >= 2) data_.all_reduce_sum(split_sum);
  else if (expert_split_) expert_split_->all_reduce_sum(split_sum);
  // This stage's sum, then (pipeline stages) every stage's; what every stage holds counts once.
  at::Tensor stage_sum = split_sum + sums.narrow(0, 0, 1);
  if (pipe_) pipe_->all_reduce_sum(stage_sum);
  const double total = std::sqrt(stage_sum.data_ptr<double>()[0] + sums.data_ptr<double>()[2]);
  clip_to(total, max_norm, gradients);
  return total;
}

void ParameterSets::step(double lr) {
  for (auto& set : sets_) {
    set->optim->step(lr, set->sharded ? set->sharded->gradient() : at::Tensor(), set->owned);
    // ZeRO-3's branches are gathered when they next run.
    if (zero_ >= 1 && set->group->size() > 1 && set->branch == 0)
      all_gather_parameters(*set->optim, *set->group, set->bucket_bytes);
  }
}

TensorStream ParameterSets::model_stream(bool every_stage) {
  TensorStream out;
  // The parameters of this part, in the store's order; ZeRO-3: where each one's shards are (its
  // set, its place there).
  std::vector<size_t> part;
  std::vector<std::pair<const Set*, size_t>> sharded(params_.all().size(), {nullptr, 0});
  std::vector<bool> in_part(params_.all().size(), false);
  for (const auto& set : sets_)
    if (set->every_stage() == every_stage)
      for (size_t j = 0; j < set->members.size(); ++j) {
        in_part[set->members[j]] = true;
        if (set->branch > 0) sharded[set->members[j]] = {set.get(), j};
      }
  for (size_t i = 0; i < params_.all().size(); ++i)
    if (in_part[i]) {
      part.push_back(i);
      const Parameter& p = params_.all()[i];
      out.specs.push_back({p.name, p.tensor.scalar_type(), p.full_shape});
    }
  Group& group = every_stage ? world_.all() : data_;
  out.produce = [this, part, sharded, &group](const TensorStream::Sink& sink) {
    for (size_t i : part) {
      const Parameter& p = params_.all()[i];
      if (const auto& [set, j] = sharded[i]; set) {
        set->optim->relay_member(data_, set->slices, j, set->owned, sink);
      } else if (!p.is_slice()) {
        if (group.rank() == 0) sink(p.tensor.detach());
      } else {
        // Rows of slice q are held by the group's member q (its first P members split the experts).
        for (int64_t q = 0; q < expert_slices_; ++q) relay_to_root(data_, q, p.tensor.detach(), sink);
      }
    }
  };
  return out;
}

TensorStream ParameterSets::optimizer_stream(bool every_stage, bool with_step) {
  TensorStream out;
  std::vector<TensorStream> parts;
  for (auto& set : sets_)
    if (set->every_stage() == every_stage) {
      parts.push_back(set->optim->state_stream(every_stage ? world_.all() : data_, set->slices, with_step));
      with_step = false;  // once, with the first set
    }
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

ParameterSets::Gathers ParameterSets::gathers() const { return residency_ ? residency_->counts() : Gathers{}; }

int64_t ParameterSets::parameter_bytes() const {
  int64_t n = 0;
  for (const auto& set : sets_) n += set->parameter_bytes();
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
  // Per kind (replicated, experts): summed over its sets (one, or ZeRO-3's one per branch).
  struct Sums {
    int64_t held = 0, total = 0, state = 0, gradients = 0, bucket = 0, parameters = 0, sets = 0;
  };
  std::map<bool, Sums> kinds;
  for (const auto& set : sets_) {
    Sums& k = kinds[set->slices > 1];
    const AdamW& o = *set->optim;
    k.held += o.shard().end - o.shard().begin;
    k.total += o.total_elements();
    k.state += o.state_bytes();
    k.parameters += set->parameter_bytes();
    if (set->sharded) {
      k.gradients += set->sharded->shard_bytes();
      k.bucket = std::max(k.bucket, set->sharded->bucket_bytes());
    }
    ++k.sets;
  }
  std::string out;
  for (const auto& [experts, k] : kinds) {
    out += cat(out.empty() ? "" : "; ", kinds.size() > 1 ? (experts ? "experts: " : "replicated: ") : "",
               "AdamW state of ", k.held, " of ", k.total, " parameters per rank, ", k.state, " bytes");
    if (zero_ >= 2) out += cat(", gradients ", k.gradients, " bytes, buckets of up to ", k.bucket);
    if (zero_ >= 3) out += cat(", parameters ", k.parameters, " bytes between uses (", k.sets, " units)");
  }
  return out;
}

}  // namespace depthkit
