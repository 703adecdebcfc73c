#include "depthkit/train/schedule.h"

#include <algorithm>
#include <cmath>

namespace depthkit {

double learning_rate(const OptimConfig& o, int64_t step, int64_t total) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * double(step + 1) / double(o.warmup_steps);
  if (o.schedule == "wsd") {
    const int64_t decay_steps = std::max<int64_t>(1, std::llround(o.decay_fraction * double(total)));
    const int64_t decay_start = std::max(o.warmup_steps, total - decay_steps);
    if (step < decay_start) return o.lr;
    const double t = std::min(1.0, double(step - decay_start + 1) / double(total - decay_start));
    // Exponential decay needs min_lr > 0; with min_lr = 0 the decay is linear to zero.
    return o.min_lr > 0 ? o.lr * std::pow(o.min_lr / o.lr, t) : o.lr * (1.0 - t);
  }
  const int64_t span = std::max<int64_t>(1, total - o.warmup_steps - 1);
  const double t = std::clamp(double(step - o.warmup_steps) / double(span), 0.0, 1.0);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * t));
}

}  // namespace depthkit
