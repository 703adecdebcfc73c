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

#include <vector>

namespace depthkit {

namespace fused {

// x, as a source whose gradient the fused reads accumulate in one buffer. x itself when no
// gradient is being recorded (grad mode off, or x does not require one). The operator
// depthkit::shared_source(x) is the same for callers that reach the reads through the dispatcher
// (depthkit.nn, under torch.compile too), but returns a copy of x: an operator's output may not
// alias its input.
at::Tensor shared_source(const at::Tensor& x);

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
