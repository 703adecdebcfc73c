// The report of a comparison whose runs are trained and whose tasks are scored (compare.cpp runs
// them): OUT/results.json, OUT/table.md (compare_table, analysis/compare.h) and the curves.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "depthkit/analysis/compare.h"

namespace depthkit {

// Per task, in the spec's order: its name and its result (TaskResult::to_json, with "step" and
// "file_hash") by run label ("<run>-seed<s>").
using CompareTaskScores = std::vector<std::pair<std::string, std::map<std::string, nlohmann::json>>>;

// Reads each run's summary.json, config.toml and metrics.jsonl under OUT/runs; writes
// OUT/results.json, OUT/table.md, OUT/loss_curves.{json,png} and, for MoE runs, OUT/aux_curves.{json,png}.
// Returns results.json's content.
nlohmann::json write_compare_report(const CompareSpec& spec, const std::filesystem::path& out, int64_t data_seed,
                                    const CompareTaskScores& task_scores);

}  // namespace depthkit
