// The layout planner (`depthkit plan`; docs/training.md, "Planning a layout"): for a config and a
// cluster (N GPUs of M bytes over some nodes), every layout depthkit can run (data parallel D,
// experts over P, pipeline stages K with V virtual stages, ZeRO stage, recomputation,
// micro-batch), the memory each rank needs by part, the bytes each rank sends per step by
// collective, the pipeline's bubble, and which layout it recommends and why.
//
// The memory model counts what this implementation keeps (docs/training.md lists every term):
// parameters, gradients and AdamW's moments in float32 as ZeRO shards them; per micro-batch in
// flight, the activations each layer saves under the recomputation mode, the pathway's depth
// sources, the MoE dispatch buffers; and the communication buffers (ZeRO's buckets and gathered
// branches, the pipeline's boundary payloads). The rank predicted is the one that needs the most
// (under pipeline stages, the stage with the most). A test holds it within 10 % of the peaks
// measured on CPU ranks (tests/cli_plan.sh).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "depthkit/config/config.h"

namespace depthkit {

struct Layout {
  int64_t data = 1, experts = 1, stages = 1, virtual_stages = 1, zero = 0;
  std::string recompute = "none";
  int64_t micro_batch = 1, grad_accum = 1;
  int64_t ranks() const { return data * stages; }
};

struct MemoryParts {
  double parameters = 0, gradients = 0, optimizer = 0;  // float32 state, as ZeRO shards it
  double activations = 0;    // the layers' saved tensors, every micro-batch in flight, and one layer's working set
  double sources = 0;        // the pathway's depth sources and carried state, every micro-batch in flight
  double dispatch = 0;       // MoE: the tokens routed to experts and back, per MoE layer saved
  double communication = 0;  // ZeRO's buckets and gathered branches, the pipeline's payloads
  double total() const { return parameters + gradients + optimizer + activations + sources + dispatch + communication; }
};

struct LayoutPlan {
  Layout layout;
  MemoryParts memory;                          // of the rank that needs the most
  std::map<std::string, double> communication;  // bytes one rank sends per step, by collective
  double bubble = 0;                           // the pipeline schedule's idle share
  double step_seconds = 0;                     // the estimate the recommendation ranks by
  bool fits = false;
};

struct ClusterSpec {
  int64_t gpus = 1, nodes = 1;
  double gpu_memory = 80.0 * (1ull << 30);
  // Assumptions of the time estimate (docs/training.md): a GPU's sustained bfloat16 rate, and
  // the bandwidth a rank sends at within a node and across nodes.
  double flops = 400e12, node_bandwidth = 200e9, network_bandwidth = 25e9;
};

// The memory of one rank (the one that needs the most) training `cfg` laid out as `layout`.
MemoryParts predict_memory(const Config& cfg, const Layout& layout);

// Every layout of cfg's global batch (train.micro_batch × train.grad_accum sequences a step) over
// the cluster, fitting or not, the recommended one first (then by estimated step time).
std::vector<LayoutPlan> plan_layouts(const Config& cfg, const ClusterSpec& cluster);

// The config keys a layout sets (--set key=value), and the torchrun command that launches it.
std::vector<std::string> layout_settings(const Layout& layout);
std::string torchrun_command(const Layout& layout, const ClusterSpec& cluster, const std::string& config_path);

}  // namespace depthkit
