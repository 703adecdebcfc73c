// How the ranks of a job share the model's parameters (docs/training.md, "Many processes",
// "Expert parallelism", "Sharded state"). The parameters fall into sets, each averaged over its
// own data-parallel group: without expert parallelism one set, over every rank; with
// moe.expert_parallel = P, the replicated parameters over every rank and the routed experts
// (each rank holding a slice of P) over the W / P ranks that hold the same slice. Each set has
// its AdamW (its state sharded over its group under ZeRO ≥ 1), and its gradients are averaged
// by c10d's Reducer (ZeRO ≤ 1) or reduce-scattered into shards (ZeRO ≥ 2). Under ZeRO-3 each
// set is cut further, one set per branch (its parameters sharded between uses: gathered just
// before the branch runs, in forward and again in backward, and freed after; the next branch's
// gathered meanwhile) and one for the rest (the embedding, the pathway's own parameters, the
// final norm and the head, used across the whole pass, kept whole as under ZeRO-2).
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/dist/world.h"
#include "depthkit/io/safetensors.h"
#include "depthkit/model/expert_parallel.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/train/sharded_gradients.h"

namespace depthkit {

class Transformer;

// Frees a parameter's memory and keeps the tensor itself (its shape, its autograd identity, every
// module's handle on it): only its storage is swapped for an empty one (as FSDP resizes a storage
// to 0). ZeRO-3 frees a branch between uses and gives it a fresh storage when gathered; pipeline
// stages free the parameters another stage holds. Nothing may read a freed parameter.
void release_storage(const at::Tensor& t);

// Expert parallelism's groups (docs/design.md, "Expert parallelism"): the P consecutive ranks
// that split the experts between them, and the ranks P apart that hold the same experts. Made
// before the model, whose expert tensors they size.
struct ExpertGroups {
  std::unique_ptr<Group> split, replicas;
  ExpertPlacement placement;  // every expert when P = 1
  // Within `data`, the ranks that hold the same parameters (every rank; under pipeline stages, a
  // stage's): its P consecutive members split the experts.
  static ExpertGroups of(World& world, Group& data, const Config& cfg);
};

// Pipeline stages (train/pipeline.h) as the parameter sets see them: per parameter of the store,
// the chunk of layers whose backward makes its gradient on this rank, kNotHeld for a parameter
// another stage holds, or kEveryStage for one that every stage reads (the pathway's own
// parameters; a tied embedding), whose gradient is summed over the stages after the step's last
// backward. Without pipeline stages: none (every parameter held, one chunk).
struct StageParameters {
  static constexpr int64_t kNotHeld = -2, kEveryStage = -1;
  std::vector<int64_t> chunk;
  Group* pipe = nullptr;  // the ranks of this rank's place in its stage, one per stage
};

// ZeRO-3's shards of each branch's parameters, taken while the model is built
// (Transformer::BranchBuilt): a branch's parameters are drawn whole, this rank's shard of them
// kept, and their memory freed before the next branch is drawn, so that no rank ever holds more
// than the parameters outside the branches and one branch. Made before the model.
class BranchShards {
 public:
  BranchShards(Group& data, const ExpertGroups& experts) : data_(data), experts_(experts) {}
  // The model's BranchBuilt: keeps this rank's shard of branch `branch`'s parameters (`members`,
  // the replicated ones over the data group, an expert's slices over the ranks holding them) as
  // ParameterShard lays it, and frees them.
  void take(ParameterStore& store, int64_t branch, const std::vector<size_t>& members);
  // What take() kept of a branch's replicated parameters (experts: its expert slices), flat [chunk].
  at::Tensor owned(bool experts, int64_t branch) const;

 private:
  Group& data_;
  const ExpertGroups& experts_;
  std::map<std::pair<bool, int64_t>, at::Tensor> owned_;
};

class ParameterSets {
 public:
  // `data`: the ranks that hold the same parameters (world.all(); under pipeline stages, this
  // rank's stage, with `stages` saying which parameters it holds). Under ZeRO-3 `shards` holds
  // what the model's branches left (the model built with its take()).
  ParameterSets(Transformer& model, const Config& cfg, World& world, Group& data, ExpertGroups& experts,
                const BranchShards* shards = nullptr, const StageParameters* stages = nullptr);
  ~ParameterSets();

  // Every rank's parameters made equal to its set's first rank's (a fresh start's safety net;
  // ZeRO-3's shards are each rank's own).
  void broadcast_parameters();
  // The parameters from a checkpoint's file: each rank reads what it holds (its rows; under
  // ZeRO-3 its shard of each branch's parameters).
  void load_parameters(const SafetensorsReader& file);
  // Each set's optimizer state (its shard of its slice) from a checkpoint's file.
  void load_optimizer(const SafetensorsReader& file);

  // Per optimizer step: begin_step(); per micro-step m: begin_micro_step(m is the last);
  // forward; before_backward(); backward; after_backward(); then clip() and step(). Under pipeline
  // stages each backward covers one chunk of layers, and the three calls around it name that
  // chunk (kAllChunks: every set).
  static constexpr int64_t kAllChunks = -3;
  void begin_step();
  void begin_micro_step(bool last, int64_t chunk = kAllChunks);
  void before_backward(int64_t chunk = kAllChunks);
  void after_backward(int64_t chunk = kAllChunks);
  // After the last micro-step: the gradients of parameters every stage reads summed over the
  // stages, ZeRO-2's shards averaged over their groups; then the global gradient norm (every
  // parameter once, whichever ranks hold it), and the gradients scaled to at most max_norm. A
  // collective.
  double clip(double max_norm);
  // AdamW on every set, then (ZeRO ≥ 1) each set's parameters all-gathered over its group.
  void step(double lr);
  // Whether a backward's failure may be a collective's (a reduction ran during it).
  bool communicates_in_backward(bool last_micro_step) const { return last_micro_step || zero_ >= 2; }

  // The checkpoint's files as streams (tensors named and shaped as on one rank): every rank runs
  // them; the experts' slices and the optimizer's shards travel to the data group's first rank,
  // which writes. Under pipeline stages, each stage's part (`every_stage` false) reaches its
  // stage's first rank, and the part of the parameters every stage reads (true) rank 0;
  // train/pipeline.h joins them. Without: one part (false), every parameter.
  TensorStream model_stream(bool every_stage = false);
  TensorStream optimizer_stream(bool every_stage = false, bool with_step = true);

  int64_t optimizer_state_bytes() const;  // this rank's
  int64_t parameter_bytes() const;        // this rank's, kept between uses (ZeRO-3: its shards)
  int64_t gradient_bytes() const;         // this rank's, kept between micro-steps
  int64_t bucket_bytes() const;           // ZeRO-2's largest bucket (0 otherwise)
  std::string describe() const;           // one line for the run's start
  // The bytes this rank has handed to each kind of collective, over all its groups (the
  // Reducer's all-reduces counted as the gradients it averages).
  std::map<std::string, int64_t> traffic() const;
  // ZeRO-3: the branches gathered so far, and how many of them had their gather started ahead
  // (prefetched while the branch before them ran); {0, 0} otherwise.
  struct Gathers {
    int64_t all = 0, prefetched = 0;
  };
  Gathers gathers() const;

 private:
  struct Set;
  class Residency;
  std::vector<std::unique_ptr<Set>> sets_;
  std::unique_ptr<Residency> residency_;  // ZeRO-3
  // The gradients of the parameters every stage reads, summed over all ranks and averaged over
  // the data group.
  void reduce_every_stage();
  Transformer& model_;
  World& world_;
  Group& data_;
  Group* pipe_ = nullptr;  // pipeline stages: this rank's place in each stage
  ParameterStore& params_;
  int64_t zero_ = 0;
  int64_t expert_slices_ = 1;  // P
  Group* expert_split_ = nullptr;
  Group* expert_replicas_ = nullptr;
};

}  // namespace depthkit
