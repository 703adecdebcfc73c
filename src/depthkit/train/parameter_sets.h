// How the ranks of a job share the model's parameters (docs/training.md, "Many processes",
// "Expert parallelism", "Sharded state"). The parameters fall into sets, each averaged over its
// own data-parallel group: without expert parallelism one set, over every rank; with
// moe.expert_parallel = P, the replicated parameters over every rank and the routed experts
// (each rank holding a slice of P) over the W / P ranks that hold the same slice. Each set has
// its AdamW (its state sharded over its group under ZeRO ≥ 1), and its gradients are averaged
// by c10d's Reducer (ZeRO ≤ 1) or reduce-scattered into shards (ZeRO-2).
#pragma once
#include <ATen/core/Tensor.h>

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

// Expert parallelism's groups (docs/design.md, "Expert parallelism"): the P consecutive ranks
// that split the experts between them, and the ranks P apart that hold the same experts. Made
// before the model, whose expert tensors they size.
struct ExpertGroups {
  std::unique_ptr<Group> split, replicas;
  ExpertPlacement placement;  // every expert when P = 1
  static ExpertGroups of(World& world, const Config& cfg);
};

class ParameterSets {
 public:
  ParameterSets(Transformer& model, const Config& cfg, World& world, ExpertGroups& experts);
  ~ParameterSets();

  // Every rank's parameters made equal to its set's first rank's (a fresh start's safety net).
  void broadcast_parameters();
  // Each set's optimizer state (its shard of its slice) from a checkpoint's file.
  void load_optimizer(const SafetensorsReader& file);

  // Per optimizer step: begin_step(); per micro-step m: begin_micro_step(m is the last);
  // forward; before_backward(); backward; after_backward(); then clip() and step().
  void begin_step();
  void begin_micro_step(bool last);
  void before_backward();
  void after_backward();
  // After the last micro-step: ZeRO-2's shards averaged over their groups; then the global
  // gradient norm (every parameter once, whichever ranks hold it), and the gradients scaled to
  // at most max_norm. A collective.
  double clip(double max_norm);
  // AdamW on every set, then (ZeRO ≥ 1) each set's parameters all-gathered over its group.
  void step(double lr);
  // Whether a backward's failure may be a collective's (a reduction ran during it).
  bool communicates_in_backward(bool last_micro_step) const { return last_micro_step || zero_ >= 2; }

  // The checkpoint's files as streams (tensors named and shaped as on one rank): every rank runs
  // them; the experts' slices and the optimizer's shards travel to rank 0, which writes.
  TensorStream model_stream();
  TensorStream optimizer_stream();

  int64_t optimizer_state_bytes() const;  // this rank's
  int64_t gradient_bytes() const;         // this rank's, kept between micro-steps
  int64_t bucket_bytes() const;           // ZeRO-2's largest bucket (0 otherwise)
  std::string describe() const;           // one line for the run's start
  // The bytes this rank has handed to each kind of collective, over all its groups (the
  // Reducer's all-reduces counted as the gradients it averages).
  std::map<std::string, int64_t> traffic() const;

 private:
  struct Set;
  std::vector<std::unique_ptr<Set>> sets_;
  World& world_;
  const ParameterStore& params_;
  int64_t zero_ = 0;
  int64_t expert_slices_ = 1;  // P
  Group* expert_split_ = nullptr;
  Group* expert_replicas_ = nullptr;
};

}  // namespace depthkit
