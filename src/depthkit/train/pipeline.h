// Pipeline stages (docs/training.md, "Pipeline stages"; docs/design.md, "Pipeline stages"; MSAR
// §3.4). The layers are cut into C = K·V chunks of consecutive layers (K = train.pipeline_stages,
// V = train.virtual_stages), chunk c on stage c mod K; the job's W ranks form K stages of D = W / K
// ranks each (stage s: ranks s·D … s·D + D − 1, its data-parallel group), and the ranks at the same
// place of every stage form a pipe, over which the micro-batches flow. Stage 0 holds the
// embedding, the last stage the final norm and the LM head, every stage the pathway's own
// parameters (read at every depth: their gradients are summed over the stages).
//
// What crosses a boundary is the pathway's state after the chunk (ResidualPathway::stage_out): the
// completed depth sources and what is carried (a block's partial, a stream). A rank that already
// holds some of the sources, from its own earlier chunk of the same micro-batch (V > 1), keeps
// them and receives only the newer ones (cross-stage caching); their gradients return to that
// earlier chunk on the same rank.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <tuple>
#include <memory>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/dist/world.h"
#include "depthkit/train/parameter_sets.h"

namespace depthkit {

class Transformer;
class ParameterStore;

struct PipelineLayout {
  int64_t stages = 1, virtual_stages = 1, layers = 0;
  int64_t chunks() const { return stages * virtual_stages; }
  // Chunk c holds layers [first_layer(c), first_layer(c + 1)): as equal as they divide.
  int64_t first_layer(int64_t chunk) const { return chunk * layers / chunks(); }
  int64_t stage_of(int64_t chunk) const { return chunk % stages; }
  int64_t chunk_of_layer(int64_t layer) const;
  static PipelineLayout of(const Config& cfg);
};

// The layout against the job's ranks, before any rank starts: one line naming the keys.
void check_pipeline_layout(const Config& cfg, int64_t ranks);

// Per parameter of `store` (a model of the config), the chunk whose backward makes its gradient on
// `stage`, or StageParameters::kNotHeld / kEveryStage.
StageParameters stage_parameters(const ParameterStore& store, const PipelineLayout& layout, int64_t stage);

// The 1F1B schedule (Megatron's; interleaved when V > 1): each stage's forwards and backwards of
// (micro-batch, chunk) in the order it runs them, and the bubble: the share of the stages' time
// they idle, timed with a forward of one chunk as 1 and its backward as 2.
struct PipelineOp {
  bool backward = false;
  int64_t micro = 0, chunk = 0;
};
struct PipelineSchedule {
  std::vector<std::vector<PipelineOp>> by_stage;
  double bubble = 0;
  static PipelineSchedule one_f_one_b(const PipelineLayout& layout, int64_t micro_batches);
};

// One rank's part of the pipeline: its chunks of the model, run by the schedule.
class Pipeline {
 public:
  // `pipe`: the ranks at this rank's place in every stage (member s is stage s).
  Pipeline(Transformer& model, ParameterSets& sets, const PipelineLayout& layout, World& world, Group& pipe,
           int64_t micro_batches);
  ~Pipeline();
  int64_t stage() const { return stage_; }

  // One optimizer step's forwards and backwards over this pipe's micro-batches (int64 [B, T + 1]
  // each; every stage is given the same). Returns what this rank adds to the step's loss (the
  // cross-entropy on the last stage, the MoE auxiliary terms of its layers), summed over the
  // micro-batches and divided by their number; with `moe_terms`, the same for the MoE log:
  // lm_loss, aux_loss, balance, then each MoE layer's load (zero for the layers of other stages).
  double train_step(const std::vector<at::Tensor>& batches, std::vector<double>* moe_terms);
  // Forward only: the summed cross-entropy of `batch` over its tokens on the last stage (0 elsewhere).
  double loss_sum(const at::Tensor& batch);

  // The payload bytes this rank sent forward over each boundary (chunk c → c + 1, index c), per
  // micro-batch, over the steps trained (the gradients sent back are as many).
  std::vector<int64_t> sent_bytes() const;
  const PipelineSchedule& schedule() const { return schedule_; }

 private:
  struct Run;
  void forward(int64_t micro, int64_t chunk, const at::Tensor& batch, bool grad);
  void backward(int64_t micro, int64_t chunk, bool last_micro);
  void wait_sends();
  Transformer& model_;
  ParameterSets& sets_;
  PipelineLayout layout_;
  World& world_;
  Group& pipe_;
  int64_t stage_ = 0, micro_batches_ = 1;
  PipelineSchedule schedule_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Run>> runs_;  // (micro-batch, chunk)
  // Sends not yet known to be received, by (micro-batch, chunk they enter or leave, direction).
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<std::unique_ptr<PendingCollective>>> sends_;
  std::vector<int64_t> sent_;  // per boundary, payload bytes sent forward
  int64_t micro_batches_run_ = 0;
  double loss_ = 0;               // the step's, this rank's part
  std::vector<double> moe_;       // the step's MoE log terms, this rank's part
  bool moe_wanted_ = false;
  std::vector<int64_t> moe_index_;  // per layer: its place among the MoE layers (−1: dense)
};

// A checkpoint file's stream under pipeline stages: the part every stage holds (rank 0's), then
// each stage's part in stage order, every piece relayed to rank 0 by its stage's first rank. The
// tensors' names and shapes are one rank's, so any layout resumes from it.
TensorStream joined_stream(World& world, Group& data, int64_t stage, int64_t stages, const TensorStream& every_stage,
                           const TensorStream& this_stage);

}  // namespace depthkit
