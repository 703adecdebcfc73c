// The fused MSAR torch operators: schemas (a fragment of the `depthkit` library that
// ops/schema.cpp defines), their CPU kernels (ops/cpu/msar_cpu.cpp), the Autograd kernels that
// route the backward to the hand-written backward operators, and the C++ wrappers (msar_ops.h).
//
//   depthkit::msar_read(Tensor queries, Tensor[] sources, Tensor[] conv, float eps, int[]? kernel_lengths=None,
//                       int context=0) -> (Tensor out, Tensor log_partition)
//   depthkit::msar_fuse(Tensor out, Tensor log_partition, Tensor queries, Tensor? partial,
//                       Tensor? partial_conv, Tensor? w_pre, Tensor? b_pre, Tensor? alpha_pre, float eps,
//                       int[]? kernel_lengths=None, int context=0) -> Tensor
//   depthkit::msar_block_read(Tensor[] queries, Tensor[] sources, Tensor[] conv, float eps,
//                             int[]? kernel_lengths=None, int context=0) -> (Tensor[] out, Tensor[] log_partition)
//   and their *_backward operators. msar_block_read is msar_read for the S branches of one block
//   (one queries tensor each), which read the same sources: each expansion is computed once for
//   them all, in the forward and in the backward (MSAR §3.4, phase 1 batched over a block's
//   targets); msar_read is its S = 1 case, on the same kernels. msar_read_backward adds the
//   sources' gradients into the buffers it is given (Tensor(a!)[], ops/shared_source.h) and returns
//   those of the queries and of the banks, the latter stacked [N, m − 1, d, K]
//   (msar_block_read_backward: the queries' stacked [S, m, d] too): a mutating operator's outputs
//   must be single tensors for torch.compile's functionalization (auto_functionalized) to take it.
//
// What autograd keeps for the backward: the inputs and ζ [m, B, T] (msar_read); the inputs
// (msar_fuse, whose `out` input is msar_read's output). Expanded streams, normalised keys,
// softmax weights, λ and H_pre are recomputed from the raw sources by the backward kernels.
// The backward operators take no context: with one (a decoding step, which never runs a backward;
// torch.library's checks do), the Autograd kernels give the context's positions a zero gradient
// and ζ = +∞, whose softmax weight and merge share are exactly zero, so the backward over all T
// positions is exact, and drop those positions from ∂out and ∂ζ.
#include "depthkit/ops/msar_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/stack.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <initializer_list>
#include <limits>
#include <tuple>

#include "depthkit/ops/cpu/msar_cpu.h"
#include "depthkit/ops/registration.h"
#include "depthkit/ops/shared_source.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Lengths = c10::OptionalIntArrayRef;
using ReadSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::TensorList, at::TensorList, double, Lengths,
                                                    int64_t);
using ReadBackSig = std::tuple<at::Tensor, at::Tensor>(const OptTensor&, const OptTensor&, const at::Tensor&,
                                                        at::TensorList, at::TensorList, const at::Tensor&, double,
                                                        Lengths, at::TensorList);
using BlockReadSig = std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>>(at::TensorList, at::TensorList,
                                                                                 at::TensorList, double, Lengths,
                                                                                 int64_t);
using OptTensors = c10::List<OptTensor>;
using BlockReadBackSig = std::tuple<at::Tensor, at::Tensor>(const OptTensors&, const OptTensors&, at::TensorList,
                                                             at::TensorList, at::TensorList, at::TensorList, double,
                                                             Lengths, at::TensorList);
using FuseSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                           const OptTensor&, const OptTensor&, const OptTensor&, double, Lengths, int64_t);
using FuseBackOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor>;
using FuseBackSig = FuseBackOut(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, double, Lengths);

// The kernel lengths kept for the backward (None when absent), and read back.
c10::IValue keep(Lengths lengths) { return lengths.has_value() ? c10::IValue(lengths->vec()) : c10::IValue(); }
std::optional<std::vector<int64_t>> kept(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toIntVector();
}
Lengths view(const std::optional<std::vector<int64_t>>& v) { return v ? Lengths(*v) : Lengths(); }

// A tensor of positions [..., T − context] (dim `dim`) with `context` positions of `fill` before
// them; undefined stays undefined (a zero gradient).
at::Tensor with_context(const at::Tensor& t, int64_t dim, int64_t context, double fill) {
  if (!t.defined() || context == 0) return t;
  std::vector<int64_t> pad(2 * size_t(t.dim() - dim), 0);
  pad[pad.size() - 2] = context;  // constant_pad_nd pads from the last dim: dim's (before, after) come last
  return at::constant_pad_nd(t, pad, fill);
}
constexpr double kNoWeight = std::numeric_limits<double>::infinity();  // ζ of a context position


// ---- CPU: the kernels' outputs in the schemas' form, each a tensor of its own ------------------

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read_cpu(at::TensorList q, at::TensorList x,
                                                                                 at::TensorList c, double eps,
                                                                                 Lengths lengths, int64_t context) {
  return cpu::msar_read_forward(q, x, c, eps, lengths, context);
}

// The banks' gradients stacked into one [N, m − 1, d, K] tensor (the kernel's are transposed
// views of one buffer, one per source): a parameter-sized copy.
std::tuple<at::Tensor, at::Tensor> msar_block_read_backward_cpu(const OptTensors& grad_out, const OptTensors& grad_lse,
                                                                at::TensorList q, at::TensorList x, at::TensorList c,
                                                                at::TensorList lse, double eps, Lengths lengths,
                                                                at::TensorList grad_sources) {
  std::vector<at::Tensor> go, gl;
  for (const OptTensor& g : grad_out.vec()) go.push_back(unwrap(g));
  for (const OptTensor& g : grad_lse.vec()) gl.push_back(unwrap(g));
  auto [gq, gc] = cpu::msar_read_backward(go, gl, q, x, c, lse, eps, lengths, grad_sources);
  return {gq, at::stack(gc)};
}

// msar_read: msar_block_read's kernels for one queries tensor.
std::tuple<at::Tensor, at::Tensor> msar_read_cpu(const at::Tensor& q, at::TensorList x, at::TensorList c, double eps,
                                                 Lengths lengths, int64_t context) {
  auto [out, lse] = cpu::msar_read_forward({q}, x, c, eps, lengths, context);
  return {out[0], lse[0]};
}

std::tuple<at::Tensor, at::Tensor> msar_read_backward_cpu(const OptTensor& grad_out, const OptTensor& grad_lse,
                                                          const at::Tensor& q, at::TensorList x, at::TensorList c,
                                                          const at::Tensor& lse, double eps, Lengths lengths,
                                                          at::TensorList grad_sources) {
  auto [gq, gc] = cpu::msar_read_backward({unwrap(grad_out)}, {unwrap(grad_lse)}, {q}, x, c, {lse}, eps, lengths,
                                          grad_sources);
  return {gq[0], at::stack(gc)};
}

FuseBackOut msar_fuse_backward_cpu(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& lse,
                                   const at::Tensor& q, const OptTensor& part, const OptTensor& pconv,
                                   const OptTensor& w, const OptTensor& b, const OptTensor& a, double eps,
                                   Lengths lengths) {
  auto [go, gl, gq, gp, gc, gw, gb, ga] = cpu::msar_fuse_backward(grad, out, lse, q, part, pconv, w, b, a, eps, lengths);
  own_storage({&go, &gl, &gq, &gp, &gc, &gw, &gb, &ga});  // the token sums are views of one buffer
  return {go, gl, gq, gp, gc, gw, gb, ga};
}


// Both reads' Function: msar_read (one queries tensor, `block` false) and msar_block_read (S of
// them), outputs (out_0 … out_{S−1}, ζ_0 … ζ_{S−1}). The backward runs once, when every output's
// gradient is in (every branch of a block has fused), and calls the backward operator of the read
// that ran.
class MsarReadFunction : public torch::autograd::Function<MsarReadFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList q, at::TensorList x, at::TensorList c, double eps,
                               Lengths lengths, int64_t context, bool block) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto read = op<ReadSig>("depthkit::msar_read");
    static auto block_read = op<BlockReadSig>("depthkit::msar_block_read");
    std::vector<at::Tensor> out, lse;
    if (block) {
      std::tie(out, lse) = block_read.call(q, x, c, eps, lengths, context);
    } else {
      auto [o, l] = read.call(q[0], x, c, eps, lengths, context);
      out = {o};
      lse = {l};
    }
    variable_list saved(q.begin(), q.end());  // then ζ, the sources and their banks; not `out`
    saved.insert(saved.end(), lse.begin(), lse.end());
    saved.insert(saved.end(), x.begin(), x.end());
    saved.insert(saved.end(), c.begin(), c.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["queries"] = int64_t(q.size());
    ctx->saved_data["block"] = block;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["lengths"] = keep(lengths);
    ctx->saved_data["context"] = context;
    variable_list outputs = out;
    outputs.insert(outputs.end(), lse.begin(), lse.end());
    return outputs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<ReadBackSig>("depthkit::msar_read_backward");
    static auto block_back = op<BlockReadBackSig>("depthkit::msar_block_read_backward");
    auto s = ctx->get_saved_variables();
    const int64_t S = ctx->saved_data["queries"].toInt(), N = (int64_t(s.size()) - 2 * S) / 2;
    const auto lengths = kept(ctx->saved_data["lengths"]);
    const int64_t context = ctx->saved_data["context"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::TensorList all(s), queries = all.slice(0, S), sources = all.slice(2 * S, N), banks = all.slice(2 * S + N, N);
    const SourceGradients gx = source_gradients(sources, s[S].scalar_type());  // ζ: the accumulation dtype
    OptTensors go, gl;
    std::vector<at::Tensor> lse;
    for (int64_t j = 0; j < S; ++j) {
      go.push_back(wrap(with_context(grads[size_t(j)], 2, context, 0)));
      gl.push_back(wrap(with_context(grads[size_t(S + j)], 2, context, 0)));
      lse.push_back(with_context(s[size_t(S + j)], 2, context, kNoWeight));
    }
    at::Tensor gq, gc;  // [S, m, d], [N, m − 1, d, K]
    if (ctx->saved_data["block"].toBool()) {
      std::tie(gq, gc) = block_back.call(go, gl, queries, sources, banks, lse, eps, view(lengths), gx.buffers);
    } else {
      std::tie(gq, gc) = back.call(go[0], gl[0], queries[0], sources, banks, lse[0], eps, view(lengths), gx.buffers);
      gq = gq.unsqueeze(0);
    }
    // One gradient per input of forward, in order (none for a shared source: its buffer carries it).
    variable_list out;
    for (at::Tensor& t : gq.unbind(0)) out.push_back(std::move(t));
    for (at::Tensor& t : gx.for_autograd(s[0].scalar_type())) out.push_back(std::move(t));
    for (at::Tensor& t : gc.unbind(0)) out.push_back(std::move(t));  // one bank per source
    out.insert(out.end(), 4, at::Tensor());  // eps, lengths, context, block
    return out;
  }
};

class MsarFuseFunction : public torch::autograd::Function<MsarFuseFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q,
                               const OptTensor& part, const OptTensor& pconv, const OptTensor& w, const OptTensor& b,
                               const OptTensor& a, double eps, Lengths lengths, int64_t context) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fuse = op<FuseSig>("depthkit::msar_fuse");
    ctx->save_for_backward({out, lse, q, unwrap(part), unwrap(pconv), unwrap(w),
                            unwrap(b), unwrap(a)});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["lengths"] = keep(lengths);
    ctx->saved_data["context"] = context;
    return {fuse.call(out, lse, q, part, pconv, w, b, a, eps, lengths, context)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto back = op<FuseBackSig>("depthkit::msar_fuse_backward");
    auto s = ctx->get_saved_variables();
    const auto lengths = kept(ctx->saved_data["lengths"]);
    const int64_t context = ctx->saved_data["context"].toInt();
    auto [go, gl, gq, gp, gc, gw, gb, ga] =
        back.call(with_context(grads[0], 1, context, 0), with_context(s[0], 2, context, 0),
                  with_context(s[1], 2, context, kNoWeight), s[2], wrap(s[3]), wrap(s[4]), wrap(s[5]), wrap(s[6]),
                  wrap(s[7]), ctx->saved_data["eps"].toDouble(), view(lengths));
    if (context > 0) {
      go = go.narrow(2, context, go.size(2) - context);
      gl = gl.narrow(2, context, gl.size(2) - context);
    }
    return {go, gl, gq, gp, gc, gw, gb, ga, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Whether autograd has anything to record: grad mode on and an input that requires a gradient.
// When not (a decoding step, an evaluation), the Autograd kernels call the device kernel directly,
// without a Function's context and saved inputs.
bool records(std::initializer_list<at::TensorList> lists) {
  if (!at::GradMode::is_enabled()) return false;
  for (at::TensorList list : lists)
    for (const at::Tensor& t : list)
      if (t.defined() && t.requires_grad()) return true;
  return false;
}

std::tuple<at::Tensor, at::Tensor> msar_read_autograd(const at::Tensor& q, at::TensorList x, at::TensorList c,
                                                      double eps, Lengths lengths, int64_t context) {
  if (!records({q, x, c})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto read = op<ReadSig>("depthkit::msar_read");
    return read.call(q, x, c, eps, lengths, context);
  }
  auto r = MsarReadFunction::apply(at::TensorList(q), x, c, eps, lengths, context, false);
  return {r[0], r[1]};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read_autograd(at::TensorList q,
                                                                                      at::TensorList x,
                                                                                      at::TensorList c, double eps,
                                                                                      Lengths lengths,
                                                                                      int64_t context) {
  if (!records({q, x, c})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto read = op<BlockReadSig>("depthkit::msar_block_read");
    return read.call(q, x, c, eps, lengths, context);
  }
  variable_list r = MsarReadFunction::apply(q, x, c, eps, lengths, context, true);
  const auto S = std::ptrdiff_t(q.size());
  return {std::vector<at::Tensor>(r.begin(), r.begin() + S), std::vector<at::Tensor>(r.begin() + S, r.end())};
}

at::Tensor msar_fuse_autograd(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const OptTensor& part,
                              const OptTensor& pconv, const OptTensor& w, const OptTensor& b, const OptTensor& a, double eps,
                              Lengths lengths, int64_t context) {
  if (!records({out, lse, q, unwrap(part), unwrap(pconv), unwrap(w), unwrap(b), unwrap(a)})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fuse = op<FuseSig>("depthkit::msar_fuse");
    return fuse.call(out, lse, q, part, pconv, w, b, a, eps, lengths, context);
  }
  return MsarFuseFunction::apply(out, lse, q, part, pconv, w, b, a, eps, lengths, context)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthkit, m) {
  m.def("msar_read(Tensor queries, Tensor[] sources, Tensor[] conv, float eps, int[]? kernel_lengths=None, "
        "int context=0) -> (Tensor, Tensor)");
  m.def("msar_read_backward(Tensor? grad_out, Tensor? grad_log_partition, Tensor queries, Tensor[] sources, "
        "Tensor[] conv, Tensor log_partition, float eps, int[]? kernel_lengths, Tensor(a!)[] grad_sources) "
        "-> (Tensor, Tensor)");
  m.def("msar_block_read(Tensor[] queries, Tensor[] sources, Tensor[] conv, float eps, int[]? kernel_lengths=None, "
        "int context=0) -> (Tensor[], Tensor[])");
  m.def("msar_block_read_backward(Tensor?[] grad_out, Tensor?[] grad_log_partition, Tensor[] queries, "
        "Tensor[] sources, Tensor[] conv, Tensor[] log_partition, float eps, int[]? kernel_lengths, "
        "Tensor(a!)[] grad_sources) -> (Tensor, Tensor)");
  m.def("msar_fuse(Tensor out, Tensor log_partition, Tensor queries, Tensor? partial, Tensor? partial_conv, "
        "Tensor? w_pre, Tensor? b_pre, Tensor? alpha_pre, float eps, int[]? kernel_lengths=None, int context=0) "
        "-> Tensor");
  m.def("msar_fuse_backward(Tensor grad, Tensor out, Tensor log_partition, Tensor queries, Tensor? partial, "
        "Tensor? partial_conv, Tensor? w_pre, Tensor? b_pre, Tensor? alpha_pre, float eps, "
        "int[]? kernel_lengths=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("msar_read", &msar_read_cpu);
  m.impl("msar_read_backward", &msar_read_backward_cpu);
  m.impl("msar_block_read", &msar_block_read_cpu);
  m.impl("msar_block_read_backward", &msar_block_read_backward_cpu);
  m.impl("msar_fuse", &cpu::msar_fuse_forward);
  m.impl("msar_fuse_backward", &msar_fuse_backward_cpu);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("msar_read", &msar_read_autograd);
  m.impl("msar_block_read", &msar_block_read_autograd);
  m.impl("msar_fuse", &msar_fuse_autograd);
}

namespace fused {

std::tuple<at::Tensor, at::Tensor> msar_read(const at::Tensor& queries, at::TensorList sources, at::TensorList conv,
                                             double eps, c10::OptionalIntArrayRef kernel_lengths, int64_t context) {
  static auto read = op<ReadSig>("depthkit::msar_read");
  return read.call(queries, sources, conv, eps, kernel_lengths, context);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read(at::TensorList queries,
                                                                             at::TensorList sources,
                                                                             at::TensorList conv, double eps,
                                                                             c10::OptionalIntArrayRef kernel_lengths,
                                                                             int64_t context) {
  static auto read = op<BlockReadSig>("depthkit::msar_block_read");
  return read.call(queries, sources, conv, eps, kernel_lengths, context);
}

at::Tensor msar_fuse(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& queries,
                     const at::Tensor& partial, const at::Tensor& partial_conv, const at::Tensor& w_pre,
                     const at::Tensor& b_pre, const at::Tensor& alpha_pre, double eps,
                     c10::OptionalIntArrayRef kernel_lengths, int64_t context) {
  static auto fuse = op<FuseSig>("depthkit::msar_fuse");
  return fuse.call(out, log_partition, queries, wrap(partial), wrap(partial_conv), wrap(w_pre), wrap(b_pre),
                   wrap(alpha_pre), eps, kernel_lengths, context);
}

}  // namespace fused

}  // namespace depthkit
