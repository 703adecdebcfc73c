// The references of msar_read and msar_fuse (reference.h): MSAR eq. 9–17 composed of grouped
// conv1d (the expansion), the depth-attention primitive per stream and ATen ops. They hold every
// expansion in memory (m·N·B·T·d), which the fused operators never write (docs/design.md).
#include <ATen/TensorOperators.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"
#include "depthkit/util/error.h"

namespace depthkit::reference {

namespace {
// Stream r of x [B, T, d] under taps c [d, K] (c[:, δ] weighs x_{t−δ}, eq. 10).
at::Tensor conv_stream(const at::Tensor& x, const at::Tensor& c) {
  const int64_t T = x.size(1), d = x.size(2), K = c.size(1);
  // conv1d correlates: out_t = Σ_j w_j x_{t−(K−1)+j} after K−1 zeros on the left, so w_j = c_{K−1−j}.
  at::Tensor padded = at::constant_pad_nd(x.transpose(1, 2), {K - 1, 0});
  at::Tensor y = at::conv1d(padded, c.flip({1}).unsqueeze(1), std::nullopt, at::IntArrayRef{1}, at::IntArrayRef{0},
                            at::IntArrayRef{1}, d);
  return y.transpose(1, 2).narrow(1, 0, T);
}

// Banks conv [..., m − 1, d, K] with each kernel's padding (taps δ ≥ lengths[r]) zeroed, so that it
// is neither read nor given a gradient (msar_ops.h).
at::Tensor within_lengths(const at::Tensor& conv, c10::OptionalIntArrayRef lengths) {
  if (!lengths.has_value() || !conv.defined()) return conv;
  const int64_t L = conv.size(-3), K = conv.size(-1);
  if (int64_t(lengths->size()) != L) fail("msar: kernel_lengths has ", lengths->size(), " entries, expected ", L);
  at::Tensor mask = at::zeros({L, 1, K}, conv.options());
  for (int64_t r = 0; r < L; ++r) mask[r][0].narrow(0, 0, (*lengths)[r]).fill_(1);
  return conv * mask;
}
}  // namespace

at::Tensor msar_expand(const at::Tensor& x, const at::Tensor& bank) {
  std::vector<at::Tensor> out = {x};  // stream 0: the identity
  for (int64_t r = 1; r <= bank.size(0); ++r) out.push_back(conv_stream(x, bank[r - 1]));
  return at::stack(out);
}

std::tuple<at::Tensor, at::Tensor> msar_read(const at::Tensor& queries_, at::TensorList source_list,
                                             at::TensorList conv_list, double eps,
                                             c10::OptionalIntArrayRef kernel_lengths, int64_t context) {
  const at::Tensor sources_ = at::stack(source_list), conv_ = at::stack(conv_list);
  // As the fused kernel: the expansion and the reads in the accumulation dtype (the expanded
  // streams are never rounded to the sources' dtype), out stored in the sources' dtype, ζ not.
  const at::Tensor queries = widen(queries_, sources_), sources = widen(sources_, sources_),
                   conv = widen(within_lengths(conv_, kernel_lengths), sources_);
  std::vector<at::Tensor> expanded;
  for (int64_t n = 0; n < sources.size(0); ++n) expanded.push_back(msar_expand(sources[n], conv[n]));
  at::Tensor E = at::stack(expanded, 1);  // [m, N, B, T, d]
  E = E.narrow(3, context, E.size(3) - context);  // the context only fed the windows
  std::vector<at::Tensor> outs, lses;
  for (int64_t r = 0; r < queries.size(0); ++r) {  // per-stream depth attention (eq. 11–12)
    DepthRead read = depthkit::depth_read(queries[r], E[r], E[r], eps);
    outs.push_back(read.out);
    lses.push_back(read.log_partition);
  }
  return {at::stack(outs).to(sources_.scalar_type()), at::stack(lses)};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_block_read(at::TensorList queries,
                                                                             at::TensorList sources,
                                                                             at::TensorList conv, double eps,
                                                                             c10::OptionalIntArrayRef kernel_lengths,
                                                                             int64_t context) {
  std::vector<at::Tensor> outs, lses;
  for (const at::Tensor& q : queries) {
    auto [out, lse] = msar_read(q, sources, conv, eps, kernel_lengths, context);
    outs.push_back(out);
    lses.push_back(lse);
  }
  return {outs, lses};
}

at::Tensor msar_merged_streams(const at::Tensor& out_, const at::Tensor& log_partition_, const at::Tensor& queries_,
                               const at::Tensor& partial_, const at::Tensor& partial_conv_, double eps,
                               c10::OptionalIntArrayRef kernel_lengths, int64_t context) {
  const at::Tensor out = widen(out_, out_), log_partition = widen(log_partition_, out_),
                   queries = widen(queries_, out_), partial = widen(partial_, out_),
                   partial_conv = widen(within_lengths(partial_conv_, kernel_lengths), out_);
  at::Tensor part = partial.defined() ? msar_expand(partial, partial_conv).narrow(2, context, out.size(2)) : at::Tensor();
  std::vector<at::Tensor> z;
  for (int64_t r = 0; r < queries.size(0); ++r)  // phase 2 (eq. 17, A.6–A.10)
    z.push_back(partial.defined()
                    ? merge_partial(DepthRead{out[r], log_partition[r]}, queries[r], part[r], part[r], eps)
                    : out[r]);
  return at::stack(z, -2);  // [B, T, m, d]
}

at::Tensor msar_fusion_gates(const at::Tensor& Z, const at::Tensor& w_pre, const at::Tensor& b_pre,
                             const at::Tensor& alpha_pre, double eps) {
  return at::sigmoid(widen(alpha_pre, Z) * at::linear(key_norm(Z.flatten(-2), eps), widen(w_pre, Z)) +
                     widen(b_pre, Z));  // eq. 13
}

at::Tensor msar_fuse(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& queries,
                     const at::Tensor& partial, const at::Tensor& partial_conv, const at::Tensor& w_pre,
                     const at::Tensor& b_pre, const at::Tensor& alpha_pre, double eps,
                     c10::OptionalIntArrayRef kernel_lengths, int64_t context) {
  // As the fused kernel: the merge, H_pre and the fusion in the accumulation dtype, h stored in
  // out's dtype.
  const at::Tensor Z = msar_merged_streams(out, log_partition, queries, partial, partial_conv, eps, kernel_lengths,
                                           context);
  if (!w_pre.defined()) return Z.mean(-2).to(out.scalar_type());  // fusion = "mean"
  const at::Tensor pre = msar_fusion_gates(Z, w_pre, b_pre, alpha_pre, eps);
  return (pre.unsqueeze(-1) * Z).sum(-2).to(out.scalar_type());  // eq. 14
}

}  // namespace depthkit::reference
