// Learning-rate schedules, as a pure function of the step (so resuming needs no state).
//   cosine: linear warm-up to lr, then cosine decay to min_lr at the last step.
//   wsd:    linear warm-up, constant lr, then an exponential decay to min_lr over the last
//           decay_fraction of the steps (MSAR Appendix A: "warmup–stable–decay (exponential
//           decay)", min LR ratio 0.1).
#pragma once
#include <cstdint>

#include "depthkit/config/config.h"

namespace depthkit {

// lr for 0-based step `step` of `total` steps.
double learning_rate(const OptimConfig& o, int64_t step, int64_t total);

}  // namespace depthkit
