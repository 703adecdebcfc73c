// AdamW (decoupled weight decay, Loshchilov & Hutter) over a ParameterStore, with float32 state,
// written out so its state is plain named tensors for the safetensors checkpoint. Matches
// torch.optim.AdamW step for step.
//
// ZeRO stage 1 (Rajbhandari et al.; docs/training.md): the parameters laid end to end in
// registration order are cut into one contiguous range of elements per rank; each rank keeps the
// AdamW moments of its range only and updates those elements, then the ranks all-gather the
// updated parameters. AdamW is elementwise, so the sharded update equals the unsharded one
// exactly. One rank holds the whole range.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "depthkit/config/config.h"
#include "depthkit/io/safetensors.h"

namespace depthkit {

class ParameterStore;
struct Parameter;
class Group;
class Group;

// The elements [begin, end) of the concatenated parameters that rank `rank` of `ranks` owns:
// about ⌈total / ranks⌉ each, each boundary moved back to a multiple of 64 elements from the start
// of the parameter it falls in, so that every element is updated by the same code path as
// unsharded (ATen's elementwise kernels round a vectorised body and a scalar tail differently).
// Flat shard tensors are `chunk` (the largest share) long on every rank, zero past the share,
// so that ranks all-gather equal lengths.
struct ParameterShard {
  int64_t begin = 0, end = 0, chunk = 0;
  std::vector<int64_t> bounds;  // rank r owns [bounds[r], bounds[r + 1])
  static ParameterShard of(const std::vector<int64_t>& parameter_sizes, int64_t rank, int64_t ranks);
  // Every rank's flat shard laid end to end ([ranks · chunk], as all-gathered) → the [total]
  // elements in order.
  at::Tensor unpad(const at::Tensor& gathered) const;
};

class AdamW {
 public:
  // The sizes of `members` (indices into params.all(); empty: every parameter), in order.
  static std::vector<int64_t> sizes(const ParameterStore& params, const std::vector<size_t>& members = {});
  // State and updates for the elements of `shard` (default: every element) of the parameters
  // `members` (default: all) laid end to end in registration order: one set of parameters that
  // its ranks average alike (expert parallelism keeps two: the replicated ones and the experts).
  AdamW(ParameterStore& params, const OptimConfig& cfg, std::optional<ParameterShard> shard = std::nullopt,
        const std::vector<size_t>& members = {});
  // Updates the shard's elements from the parameters' gradients, or from `shard_gradient`, the
  // shard's gradient laid flat [chunk] (ZeRO-2: train/sharded_gradients.h). The elements updated
  // are the parameters', or `shard_parameters`' when given: the shard's parameters laid flat
  // [chunk] (ZeRO-3, where that is the only copy a rank keeps).
  void step(double lr, const at::Tensor& shard_gradient = {}, const at::Tensor& shard_parameters = {});
  int64_t steps() const { return step_; }
  const ParameterShard& shard() const { return shard_; }
  int64_t total_elements() const { return total_; }
  // The bytes of the moments this rank keeps.
  int64_t state_bytes() const;

  // The shard's elements of the parameters, flat [chunk]; and every element from [total] values
  // (the all-gathered shards, unpadded): the parameters after the ZeRO-1 all-gather.
  at::Tensor shard_of_parameters() const;
  // Elements [lo, lo + length) of that flat shard (zero past the share), copied from the parameters.
  at::Tensor shard_of_parameters(int64_t lo, int64_t length) const;
  void set_parameters(const at::Tensor& all) const;
  // Elements [begin, begin + values.numel()) of the concatenated parameters set from `values`.
  void set_parameter_elements(int64_t begin, const at::Tensor& values) const;
  // The shard's moments, flat [chunk] each.
  const at::Tensor& exp_avg() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const { return exp_avg_sq_; }

  // "exp_avg.<param>", "exp_avg_sq.<param>" and "step", for the checkpoint. Needs the moments of
  // every element: this optimizer's own (one rank), or every rank's, all-gathered and unpadded.
  NamedTensors state() const;
  NamedTensors state(const at::Tensor& exp_avg_all, const at::Tensor& exp_avg_sq_all) const;
  // The same state as a stream for the checkpoint (io/safetensors.h), tensors named and shaped as
  // on one rank: every exp_avg, then every exp_avg_sq, in registration order, then (with_step)
  // step. Sharded, each rank's share is sent to the group's first member in pieces of at most
  // 16 MiB, in the file's order: no rank ever holds more than its shard and one piece. `world` is
  // the data-parallel group (every rank; a pipeline stage's ranks), whose member q + j·slices holds
  // slice q < slices of the parameters (expert parallelism: rows q of P of every expert tensor; 1:
  // whole) and place j in the set's own group. Every member of `world` runs the producer.
  TensorStream state_stream(Group& world, int64_t slices = 1, bool with_step = true) const;
  // Member j's elements of a tensor laid flat as the shards are ([chunk] on each rank, as the
  // moments), handed to `sink` on rank 0 in order, in pieces of at most 16 MiB (relay_to_root):
  // what state_stream does for each moment, and ZeRO-3 for the parameters themselves.
  void relay_member(Group& world, int64_t slices, size_t j, const at::Tensor& flat, const TensorStream::Sink& sink) const;
  // Takes the shard's elements from a checkpoint's full state.
  void load_state(const std::map<std::string, at::Tensor>& tensors, const std::string& source);
  // The same from the file, reading the shard's elements only (of this rank's slice).
  void load_state(const SafetensorsReader& file);
  // The shard's elements of the file's tensors `prefix` + each member's name, into `flat`
  // [chunk] (the moments; ZeRO-3's parameters, with no prefix). Shapes are the caller's to check.
  void read_shard(const SafetensorsReader& file, const std::string& prefix, const at::Tensor& flat) const;
  // The parameters of this set, in order.
  const std::vector<const Parameter*>& members() const { return members_; }

 private:
  // A parameter's part of the shard: elements [offset, offset + length) of parameter `param`, at
  // `flat` in the shard.
  struct Slice {
    size_t param;
    int64_t offset, length, flat;
  };
  void fused_step(double lr, const at::Tensor& shard_gradient, const at::Tensor& shard_parameters);  // optim.impl = "fused"
  // Slice s's gradient, flat: from shard_gradient when given, else from its parameter's .grad
  // (undefined when the parameter has none).
  at::Tensor gradient_of(const Slice& s, const at::Tensor& shard_gradient) const;
  // Slice s's parameter elements, flat: in shard_parameters when given, else in its parameter.
  at::Tensor parameter_of(const Slice& s, const at::Tensor& shard_parameters) const;
  ParameterStore& params_;
  std::vector<const Parameter*> members_;
  OptimConfig cfg_;
  ParameterShard shard_;
  int64_t total_ = 0;
  int64_t step_ = 0;
  std::vector<Slice> slices_;
  std::vector<int64_t> starts_;  // member j's first element in the set laid flat
  at::Tensor exp_avg_, exp_avg_sq_;
};

// One piece of a checkpoint's stream, held by member `owner` of the group: its first member hands it to `sink`,
// received from the owner when another rank holds it. Every rank passes a tensor of the piece's
// shape and dtype (its own copy of it, on the owner); every rank calls this for every piece.
void relay_to_root(Group& world, int64_t owner, const at::Tensor& piece, const TensorStream::Sink& sink);

// ZeRO-1 and -2 after each step: every rank's updated shard of the parameters given to every rank
// of `group` (the set's data-parallel group), all-gathered in pieces of `gathered_bytes` from all
// ranks together (ZeRO's buckets, train.bucket_bytes), each copied from the parameters as it goes:
// no whole copy of the set is made.
void all_gather_parameters(const AdamW& optim, Group& group, int64_t gathered_bytes);

// Scales gradients so their global L2 norm is at most max_norm (max_norm 0: no clipping).
// Returns the norm before clipping.
double clip_grad_norm(ParameterStore& params, double max_norm);
// Adds Σ g² to `sum` (a float64 scalar on g's device, undefined for 0): g squared in its dtype,
// summed in float64 a piece at a time (no whole copy), on the device (no synchronisation). Sums
// of pieces differ from the whole's only in float64's last bits, which the clipping coefficient,
// a float32 scale, does not see.
void add_sum_of_squares(at::Tensor& sum, const at::Tensor& g);
// Scales the gradients by max_norm / (norm + 1e-6) when that is below 1 (torch's rule).
void clip_to(double norm, double max_norm, const std::vector<at::Tensor>& gradients);

}  // namespace depthkit
