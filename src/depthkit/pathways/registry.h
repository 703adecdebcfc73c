// The pathway registry: one entry per residual.kind, defined beside the pathway's own code (its
// .cpp file) and listed once in registry.cpp. An entry says everything the rest of depthkit needs
// to know about a kind: its name, how to build it, which configurations it rejects, which
// analyses apply to it (`depthkit analyze`), and its cost terms (`depthkit cost`). The backbone,
// config loading, analysis and accounting ask the registry and name no kind themselves.
// docs/design.md ("Adding a pathway or an operator") lists what a new kind touches.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/pathways/pathway.h"

namespace depthkit {

class ParameterStore;

// One row of a pathway's memory traffic per token per branch, in units of d (MSAR Table 6;
// model/accounting.h states the conventions).
struct TrafficTerm {
  std::string operation;
  double read = 0, write = 0;
};

// What a pathway's cost terms see: the model's shape in the accounting's units.
struct CostShape {
  double d, L, S, N, m;  // width, branches, block size, completed blocks, streams
  BlockSchedule schedule;
  // The completed sources branch ℓ reads, the embedding included.
  int64_t completed_before(int64_t l) const { return schedule.block_of(l); }
  bool first_in_block(int64_t l) const { return schedule.opens(l); }
};

// Per-token forward FLOPs of the pieces the pathways share (d-vectors; a multiply–add is 2).
namespace cost {
constexpr double kNorm = 3;   // weightless RMSNorm: Σx² (2 per element), scale (1)
constexpr double kScore = 2;  // q · k̂
constexpr double kValue = 2;  // weight × value, accumulated
constexpr double kMerge = 3;  // λ·out + (1 − λ)·v (DAR eq. A.10)
}  // namespace cost

struct PathwayKind {
  std::string name;  // residual.kind
  // Builds the pathway, registering its parameters (component "residual").
  std::function<std::unique_ptr<ResidualPathway>(const ResidualConfig&, const ModelConfig&, ParameterStore&)> make;
  // Rejects a configuration the kind cannot run with a one-line error that starts with `where`
  // and names the key (nullptr: every configuration the keys' own ranges allow).
  std::function<void(const ResidualConfig&, const std::string& where)> validate = nullptr;
  // The analyses of `depthkit analyze` that apply: "maps" (depth-attention weights), "cka" and
  // "rescue" (per-stream states), "gates" (write gates).
  std::vector<std::string> analyses = {};
  // Whether residual.block_sublayers applies (the accounting takes S = 1 otherwise), and the
  // number of streams (0: residual.streams).
  bool blocks = true;
  int64_t streams = 0;
  // Forward FLOPs per token of the whole pathway (model/accounting.h: training is 3× this).
  std::function<double(const CostShape&, const ResidualConfig&)> flops;
  // Memory traffic per token per branch (MSAR Table 6 and its conventions).
  std::function<std::vector<TrafficTerm>(const CostShape&)> traffic;
};

// Every registered kind, in a fixed order (registry.cpp).
const std::vector<PathwayKind>& pathway_kinds();
std::vector<std::string> pathway_kind_names();
// The entry of `name`; nullptr if there is none.
const PathwayKind* find_pathway_kind(const std::string& name);
// The entry of `name`; fails with a one-line error naming residual.kind if there is none.
const PathwayKind& pathway_kind(const std::string& name);

// The entries, one per pathway file (defined there).
PathwayKind residual_pathway_kind();
PathwayKind attnres_pathway_kind();
PathwayKind attnres_sepv_pathway_kind();
PathwayKind dar_pathway_kind();
PathwayKind msar_pathway_kind();
PathwayKind mhc_pathway_kind();
PathwayKind attnres_mhc_pathway_kind();

}  // namespace depthkit
