// What loading a compare spec (compare_spec.cpp) and running it (compare.cpp, compare_report.cpp)
// share: how a run of the spec is named and configured, and the spec as a comparison saves it.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "depthkit/analysis/compare.h"

namespace depthkit {

// "<name>-seed<s>": the run's directory under OUT/runs and its key in the kept task results.
std::string compare_run_label(const CompareRun& r, int64_t seed);
// The overrides that make run r with seed `seed` from the base config: the spec's `set`, the run's
// kind and `set`, the seed, and the data seed every run shares.
std::vector<std::string> compare_run_overrides(const CompareSpec& spec, const CompareRun& r, int64_t seed,
                                               int64_t data_seed);
// The data seed of every run: the base config's train.data_seed, else its train.seed.
int64_t compare_data_seed(const CompareSpec& spec);
// The spec as OUT/spec.json holds it; a --resume must give the same.
nlohmann::json compare_spec_json(const CompareSpec& spec);

}  // namespace depthkit
