// A history source that many fused reads take, with one gradient buffer for all of them.
//
// A pathway's history entry (AttnRes's block summaries, DAR's H_r, MSAR's sources) is read by
// every later branch. Left to autograd, each read's backward returns that entry's gradient as a
// tensor of its own, and autograd adds them up: per read and source, one write by the kernel and
// one read-read-write by the sum. Wrapped by `fused::shared_source`, the entry carries an
// accumulator instead: each read's backward kernel adds its share into it while the rows are in
// cache (one read-modify-write), returns no gradient for it to autograd, and the entry's own
// backward node, which autograd runs only after every read that took the entry (its consumers),
// hands the sum on once.
//
// A backward that will not run the entry's node (torch::autograd::grad with respect to other
// inputs only, or to the wrapped tensor itself) does not use the buffer: the reads then hand
// autograd the entry's gradient as any other input's.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace depthkit {

namespace fused {

// x, as a source whose gradient the fused reads accumulate in one buffer. x itself when no
// gradient is being recorded (grad mode off, or x does not require one). The operator
// depthkit::shared_source(x) is the same for callers that reach the reads through the dispatcher
// (depthkit.nn, under torch.compile too), but returns a copy of x: an operator's output may not
// alias its input.
at::Tensor shared_source(const at::Tensor& x);

// Recomputation by layer (model/recompute.h, Transformer): a source that a recomputed region made,
// as the enclosing graph sees it. The later regions' reads add into its accumulator as into any
// shared source's; but its node hands on only what reached it otherwise, and leaves that sum in
// `deferred`, where the region's run in backward takes it up (seed_accumulator): so its own reads
// add to the one running sum after the later ones, as without recomputation.
struct DeferredSum {
  at::Tensor sum;  // set by the node's backward (undefined: no read added into it)
};
at::Tensor shared_source_deferred(const at::Tensor& x, std::shared_ptr<DeferredSum> deferred);
// Starts the accumulator of `x`, a shared source made in a region's run in backward (or a
// pipeline stage's source whose later reads ran on the next stage), from `sum`, in the reads'
// accumulation dtype. False, and nothing done, when x is not a shared source.
bool seed_accumulator(const at::Tensor& x, const at::Tensor& sum);

// Recomputation (model/recompute.h) runs a region again on detached copies of its inputs. Where an
// input is a shared source of the enclosing graph, the region's reads add its gradient into that
// source's accumulator, as they did without recomputation, instead of handing it to autograd: the
// same sums in the same order and dtype, so the gradients stay bit-identical (a float32 buffer,
// not a bfloat16 gradient per region, under bfloat16 compute). While alive, on this thread, an
// object of this class maps each copy added to its source.
class SourceStandIns {
 public:
  SourceStandIns();
  ~SourceStandIns();
  SourceStandIns(const SourceStandIns&) = delete;
  SourceStandIns& operator=(const SourceStandIns&) = delete;
  // `stand_in` reads as `source` when `source` is a shared source whose node the backward now
  // running will run (otherwise this does nothing). Call it in that backward.
  void add(const at::Tensor& stand_in, const at::Tensor& source);
  // The source `stand_in` reads as, on this thread (null: none).
  static const at::Tensor* source_of(const at::Tensor& stand_in);

 private:
  std::vector<std::pair<const void*, at::Tensor>> map_;  // a copy's TensorImpl → its source
  SourceStandIns* previous_;
};

}  // namespace fused

// For the Autograd kernels of the reads: where the backward kernel adds each source's gradient.
struct SourceGradients {
  std::vector<at::Tensor> buffers;  // one per source, zero or holding other reads' shares: add into
  std::vector<bool> own;            // a buffer of this read's alone, which autograd then receives

  // The gradients this read hands to autograd, one per source, in `dtype`: its own buffers; none
  // (undefined) for a shared source, whose accumulator carries it.
  std::vector<at::Tensor> for_autograd(at::ScalarType dtype) const;
};

// The buffers for `sources`, in dtype `accumulate` (the kernels' accumulation type): a shared
// source's accumulator (created, zero, by the first read whose backward runs), or a zero buffer of
// this read's own. A source that appears twice in one call gets an own buffer the second time, so
// that no kernel is given one buffer twice.
SourceGradients source_gradients(at::TensorList sources, at::ScalarType accumulate);

}  // namespace depthkit
