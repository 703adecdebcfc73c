#include "depthkit/train/sharded_gradients.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "depthkit/dist/world.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

// How many reductions may be in flight before the hook waits for the oldest: bounds the
// buckets alive at once (and so the memory) while letting communication overlap backward.
constexpr size_t kMaxInFlight = 2;

class GradientReady final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientReady(ShardedGradients* owner, size_t param) : owner_(owner), param_(param) {}
  void operator()(const torch::autograd::Variable&) override { owner_->on_gradient(param_); }

 private:
  ShardedGradients* owner_;
  size_t param_;
};

}  // namespace

ReductionsInFlight::~ReductionsInFlight() {
  for (Entry& e : entries_) try {
      e.work->wait();
    } catch (...) {  // a failed job: its error is being reported already
    }
}

void ReductionsInFlight::push(std::unique_ptr<PendingCollective> work, at::Tensor buffer, at::Tensor received,
                              at::Tensor target) {
  entries_.push_back({std::move(work), std::move(buffer), std::move(received), std::move(target)});
}

void ReductionsInFlight::make_room() {
  while (entries_.size() >= kMaxInFlight) complete_oldest();
}

void ReductionsInFlight::complete_oldest() {
  Entry e = std::move(entries_.front());
  entries_.erase(entries_.begin());
  e.work->wait();
  if (e.target.defined()) e.target.add_(e.received);  // undefined: this rank's piece is empty
}

void ReductionsInFlight::drain() {
  at::NoGradGuard no_grad;
  while (!entries_.empty()) complete_oldest();
}

ShardedGradients::ShardedGradients(const std::vector<const Parameter*>& params, const ParameterShard& shard,
                                   Group& group, int64_t bucket_bytes, std::shared_ptr<ReductionsInFlight> in_flight)
    : params_(params), shard_(shard), group_(group),
      in_flight_(in_flight ? std::move(in_flight) : std::make_shared<ReductionsInFlight>()) {
  const auto& ps = params_;
  int64_t start = 0;
  for (const Parameter* p : ps) {
    offset_of_.push_back(start);
    start += p->tensor.numel();
  }
  bucket_of_.resize(ps.size());
  // Whole parameters, last first, each bucket closed once it holds bucket_bytes.
  for (size_t i = ps.size(); i-- > 0;) {
    const int64_t end = offset_of_[i] + ps[i]->tensor.numel();
    if (buckets_.empty() || (buckets_.back().end - buckets_.back().begin) * int64_t(sizeof(float)) >= bucket_bytes)
      buckets_.push_back({i + 1, i + 1, end, end, 0, {}});
    Bucket& b = buckets_.back();
    b.first_param = i;
    b.begin = offset_of_[i];
    bucket_of_[i] = buckets_.size() - 1;
  }
  for (const Bucket& b : buckets_)
    largest_bucket_bytes_ = std::max(largest_bucket_bytes_, (b.end - b.begin) * int64_t(sizeof(float)));
  const at::TensorOptions options = ps.empty() ? at::TensorOptions(at::kFloat) : ps.front()->tensor.options();
  gradient_ = at::zeros({shard_.chunk}, options.requires_grad(false));
  for (size_t i = 0; i < ps.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(ps[i]->tensor, std::make_unique<GradientReady>(this, i));
}

ShardedGradients::~ShardedGradients() {
  for (const Parameter* p : params_) torch::autograd::impl::post_acc_grad_hooks(p->tensor).reset();
}

void ShardedGradients::begin_step() { gradient_.zero_(); }

void ShardedGradients::on_gradient(size_t param) {
  at::NoGradGuard no_grad;
  const at::Tensor& tensor = params_[param]->tensor;
  Bucket& b = buckets_[bucket_of_[param]];
  if (!b.buffer.defined()) b.buffer = at::zeros({b.end - b.begin}, gradient_.options());
  at::Tensor grad = tensor.grad();
  b.buffer.narrow(0, offset_of_[param] - b.begin, tensor.numel()).copy_(grad.reshape(-1));
  tensor.mutable_grad().reset();  // the full gradient is let go at once: only the bucket holds it
  if (++b.arrived == int64_t(b.end_param - b.first_param)) launch_ready();
}

void ShardedGradients::launch_ready() {
  while (next_launch_ < buckets_.size()) {
    Bucket& b = buckets_[next_launch_];
    if (b.arrived != int64_t(b.end_param - b.first_param)) return;
    launch(b);
  }
}

void ShardedGradients::launch(Bucket& b) {
  if (!b.buffer.defined()) b.buffer = at::zeros({b.end - b.begin}, gradient_.options());
  // Rank r's piece: the bucket's elements that r's shard holds (possibly none).
  std::vector<at::Tensor> pieces;
  const int64_t ranks = int64_t(shard_.bounds.size()) - 1;
  int64_t mine_begin = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t lo = std::clamp(shard_.bounds[size_t(r)], b.begin, b.end);
    const int64_t hi = std::clamp(shard_.bounds[size_t(r) + 1], b.begin, b.end);
    pieces.push_back(b.buffer.narrow(0, lo - b.begin, hi - lo));
    if (r == group_.rank()) mine_begin = lo;
  }
  const int64_t n = pieces[size_t(group_.rank())].numel();
  in_flight_->make_room();
  at::Tensor received = at::empty({n}, gradient_.options());
  in_flight_->push(group_.reduce_scatter(pieces, received), b.buffer, received,
                   n > 0 ? gradient_.narrow(0, mine_begin - shard_.begin, n) : at::Tensor());
  b.buffer = at::Tensor();
  b.arrived = 0;
  ++next_launch_;
}

void ShardedGradients::finish_micro_step() {
  at::NoGradGuard no_grad;
  while (next_launch_ < buckets_.size()) launch(buckets_[next_launch_]);
  in_flight_->drain();
  next_launch_ = 0;
}

}  // namespace depthkit
