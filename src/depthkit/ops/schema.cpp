// The depthkit torch operators: schemas, the CPU kernels behind them, and the Autograd kernels
// that route the backward to the hand-written backward operators. ops/cuda/depth_read_cuda.cu
// registers CUDA kernels of depth_read and depth_merge (forward and backward) on the same schemas.
//
//   depthkit::depth_read(Tensor queries, Tensor[] keys, Tensor[] values, float eps) -> (Tensor out, Tensor log_partition)
//   depthkit::depth_merge(Tensor out, Tensor log_partition, Tensor query, Tensor key_part, Tensor? value_part, float eps) -> Tensor
// The keys and values of depth_read are lists of sources, one tensor per history entry: a pathway
// appends an entry without copying its history. Missing values (an empty list, or value_part
// None) are the keys themselves (AttnRes: keys = values = sources): then both gradients go into
// the key's buffer, in one pass.
//   and their *_backward operators. depth_read_backward returns the queries' gradient and adds the
// sources' into the buffers it is given (Tensor(a!)[]): one per source, in the accumulation dtype
// (ζ's), which for a shared source (ops/shared_source.h) is the one buffer of all its reads.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "depthkit/ops/cpu/depth_read_cpu.h"
#include "depthkit/ops/fused.h"
#include "depthkit/ops/registration.h"
#include "depthkit/ops/shared_source.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ReadSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::TensorList, at::TensorList, double);
using ReadBackSig = at::Tensor(const OptTensor&, const OptTensor&, const at::Tensor&, at::TensorList, at::TensorList,
                               const at::Tensor&, double, at::TensorList, at::TensorList);
using MergeSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                            double);
using MergeBackSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    double);


class DepthReadFunction : public torch::autograd::Function<DepthReadFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, at::TensorList k, at::TensorList v,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto read = op<ReadSig>("depthkit::depth_read");
    auto [out, lse] = read.call(q, k, v, eps);
    // Only the inputs and the log-partition are kept: normalised keys and weights are recomputed.
    variable_list saved = {q};
    saved.insert(saved.end(), k.begin(), k.end());
    saved.insert(saved.end(), v.begin(), v.end());
    saved.push_back(lse);
    ctx->save_for_backward(saved);
    ctx->saved_data["keys"] = int64_t(k.size());
    ctx->saved_data["eps"] = eps;
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<ReadBackSig>("depthkit::depth_read_backward");
    auto s = ctx->get_saved_variables();
    const auto N = ctx->saved_data["keys"].toInt(), V = int64_t(s.size()) - 2 - N;
    const at::TensorList keys = at::TensorList(s).slice(1, N), values = at::TensorList(s).slice(1 + N, V);
    const SourceGradients g = source_gradients(at::TensorList(s).slice(1, N + V), s.back().scalar_type());
    const at::TensorList buffers(g.buffers);
    at::Tensor gq = back.call(wrap(grads[0]), wrap(grads[1]), s[0], keys, values, s.back(),
                              ctx->saved_data["eps"].toDouble(), buffers.slice(0, N), buffers.slice(N, V));
    // One gradient per input of forward, in order: the query, each key, each value (none for a
    // shared source: its buffer carries it), eps.
    variable_list out = {gq};
    for (at::Tensor& t : g.for_autograd(s[0].scalar_type())) out.push_back(std::move(t));
    out.emplace_back();
    return out;
  }
};

class DepthMergeFunction : public torch::autograd::Function<DepthMergeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q,
                               const at::Tensor& k, const OptTensor& v, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto merge = op<MergeSig>("depthkit::depth_merge");
    ctx->save_for_backward({out, lse, q, k, unwrap(v)});
    ctx->saved_data["eps"] = eps;
    return {merge.call(out, lse, q, k, v, eps)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<MergeBackSig>("depthkit::depth_merge_backward");
    auto s = ctx->get_saved_variables();
    auto [go, gl, gq, gk, gv] = back.call(grads[0], s[0], s[1], s[2], s[3], wrap(s[4]), ctx->saved_data["eps"].toDouble());
    return {go, gl, gq, gk, gv, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> depth_read_autograd(const at::Tensor& q, at::TensorList k, at::TensorList v,
                                                       double eps) {
  auto r = DepthReadFunction::apply(q, k, v, eps);
  return {r[0], r[1]};
}

at::Tensor depth_merge_autograd(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
                                const OptTensor& v, double eps) {
  return DepthMergeFunction::apply(out, lse, q, k, v, eps)[0];
}

}  // namespace

TORCH_LIBRARY(depthkit, m) {
  m.def("depth_read(Tensor queries, Tensor[] keys, Tensor[] values, float eps) -> (Tensor, Tensor)");
  m.def("depth_read_backward(Tensor? grad_out, Tensor? grad_log_partition, Tensor queries, Tensor[] keys, "
        "Tensor[] values, Tensor log_partition, float eps, Tensor(a!)[] grad_keys, Tensor(b!)[] grad_values) "
        "-> Tensor");
  m.def("depth_merge(Tensor out, Tensor log_partition, Tensor query, Tensor key_part, Tensor? value_part, "
        "float eps) -> Tensor");
  m.def("depth_merge_backward(Tensor grad, Tensor out, Tensor log_partition, Tensor query, Tensor key_part, "
        "Tensor? value_part, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("depth_read", &cpu::depth_read_forward);
  m.impl("depth_read_backward", &cpu::depth_read_backward);
  m.impl("depth_merge", &cpu::depth_merge_forward);
  m.impl("depth_merge_backward", &cpu::depth_merge_backward);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("depth_read", &depth_read_autograd);
  m.impl("depth_merge", &depth_merge_autograd);
}

namespace fused {

std::tuple<at::Tensor, at::Tensor> depth_read(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                                              double eps) {
  static auto read = op<ReadSig>("depthkit::depth_read");
  return read.call(queries, keys, values, eps);
}

at::Tensor depth_merge(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& query,
                       const at::Tensor& key_part, const at::Tensor& value_part, double eps) {
  static auto merge = op<MergeSig>("depthkit::depth_merge");
  return merge.call(out, log_partition, query, key_part, wrap(value_part), eps);
}

}  // namespace fused

}  // namespace depthkit
