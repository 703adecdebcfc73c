// ZeRO stage 2 (Rajbhandari et al.; docs/training.md, "Sharded state"): each rank keeps the
// gradient of its own shard of the parameters (ParameterShard, as ZeRO-1's optimizer state) and
// no other. As backward produces a parameter's gradient, a hook copies it into a bucket and frees
// it; a full bucket is reduce-scattered over the ranks at once (each rank receives the sum of the
// part it owns) and let go. Peak gradient memory per rank is its shard plus the buckets in
// flight, not the model's size. Every micro-step communicates (as DeepSpeed's stage 2), so
// accumulation adds into the shard.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "depthkit/train/optimizer.h"

namespace depthkit {

struct Parameter;
class Group;
class PendingCollective;

// The reduce-scatters in flight, oldest first: at most two at once, each added into its shard's
// gradient when it completes. Shared by the sets of one job (ZeRO-3 has one per branch), so that
// the bound holds over all of them: the buckets alive at once, and so the memory, stay two.
class ReductionsInFlight {
 public:
  ~ReductionsInFlight();
  // Waits for the oldest while two are in flight: called before starting another.
  void make_room();
  // Tracks `work`, whose result `received` is to be added to `target`; `buffer` (its input) is
  // kept alive until then.
  void push(std::unique_ptr<PendingCollective> work, at::Tensor buffer, at::Tensor received, at::Tensor target);
  void drain();  // every one completed and added

 private:
  struct Entry {
    std::unique_ptr<PendingCollective> work;
    at::Tensor buffer, received, target;
  };
  void complete_oldest();
  std::vector<Entry> entries_;
};

class ShardedGradients {
 public:
  // The gradients of `params` (one set, laid end to end in order as AdamW lays them; `shard`
  // over the ranks of `group`). Buckets hold whole parameters in reverse order (the order backward
  // produces them), about `bucket_bytes` each. Installs a post-accumulation hook on each one.
  // `in_flight`: shared with the job's other sets (absent: this set's own).
  ShardedGradients(const std::vector<const Parameter*>& params, const ParameterShard& shard, Group& group,
                   int64_t bucket_bytes, std::shared_ptr<ReductionsInFlight> in_flight = nullptr);
  ~ShardedGradients();
  ShardedGradients(const ShardedGradients&) = delete;
  ShardedGradients& operator=(const ShardedGradients&) = delete;

  // Before an optimizer step's first micro-step: the shard's gradient set to zero.
  void begin_step();
  // After each micro-step's backward: the buckets not yet sent (a parameter that received no
  // gradient counts as zero) sent in order, and every reduction in flight (of any set sharing
  // them) waited for and added in.
  void finish_micro_step();
  // The shard's gradient, flat [chunk] (zero past the share): the sum over ranks and micro-steps.
  at::Tensor& gradient() { return gradient_; }
  // Bytes of the gradient shard, and of the largest bucket.
  int64_t shard_bytes() const { return gradient_.nbytes(); }
  int64_t bucket_bytes() const { return largest_bucket_bytes_; }

  // Called by a parameter's hook once its gradient of this backward is accumulated.
  void on_gradient(size_t param);

 private:
  struct Bucket {
    size_t first_param, end_param;  // registration indices [first, end)
    int64_t begin, end;             // elements of the concatenation
    int64_t arrived = 0;            // parameters whose gradient is in `buffer`
    at::Tensor buffer;              // [end − begin], while filling or in flight
  };
  void launch_ready();
  void launch(Bucket& b);

  std::vector<const Parameter*> params_;
  ParameterShard shard_;
  Group& group_;
  std::vector<Bucket> buckets_;         // in launch order (the last parameters first)
  std::vector<size_t> bucket_of_;       // parameter → bucket
  std::vector<int64_t> offset_of_;      // parameter → its first element in the concatenation
  size_t next_launch_ = 0;              // buckets launch in order, on every rank alike
  std::shared_ptr<ReductionsInFlight> in_flight_;
  at::Tensor gradient_;
  int64_t largest_bucket_bytes_ = 0;
};

}  // namespace depthkit
