// CPU kernels of the fused depth read (DAR eq. A.1–A.5) and online-softmax merge (A.6–A.10).
//
// Layout: queries q [M, d]; raw keys k and values v: lists of N sources [P, d] each (P =
// batch·tokens; never stacked, kernel_math.h); out [M, P, d]; ζ [M, P]. Parallel over tokens p; loops over d are plain and auto-vectorised;
// accumulation in float32 (float64 for float64 inputs); bfloat16 storage is accepted.
//
// Forward, per token p: s_r = 1/√(mean_d k_r² + ε) once for all M targets (in the same pass as
// q_0 · k_r); the logits a_r = s_r (q_m · k_r); their max, Z = Σ_r exp(a_r − max) and
// U = Σ_r exp(a_r − max) v_r; out = U / Z, ζ = max + log Z. Nothing else is stored. (The running
// rescale of the online softmax, A.2, is not needed within a token: its N logits are at hand.)
//
// Backward recomputes s_r and a_r from the raw keys and takes w_r = exp(a_r − ζ):
//   g·out = Σ_r w_r (g·v_r),  ∂a_r = w_r (g·v_r − g·out) + ḡ_ζ w_r,
//   ∂v_r += w_r g,  ∂q += ∂a_r s_r k_r,  ∂k_r += ∂a_r (s_r q − s_r³ (q·k_r) k_r / d).
// Two passes per source and target: the reductions (norm, q·k, and g·v when v = k) in one, every
// gradient of the source in the other, added into the buffer given for it (ops/shared_source.h).
#include "depthkit/ops/cpu/depth_read_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "depthkit/ops/cpu/kernel_math.h"
#include "depthkit/util/error.h"

namespace depthkit::cpu {

namespace {

void check_read(const at::Tensor& q, at::TensorList k, at::TensorList v) {
  if (k.empty()) fail("depth_read: needs at least one source");
  if (q.dim() != 2 || k[0].dim() != 2) fail("depth_read: expected queries [M, d], keys and values [P, d] each");
  if (v.size() != k.size()) fail("depth_read: ", k.size(), " keys and ", v.size(), " values");
  for (size_t r = 0; r < k.size(); ++r) {
    if (k[r].sizes() != k[0].sizes() || v[r].sizes() != k[0].sizes())
      fail("depth_read: key/value ", r, " is ", k[r].sizes(), "/", v[r].sizes(), ", source 0 ", k[0].sizes());
    if (k[r].scalar_type() != q.scalar_type() || v[r].scalar_type() != q.scalar_type())
      fail("depth_read: queries, keys and values must share a dtype");
  }
  if (q.size(1) != k[0].size(1)) fail("depth_read: queries have d = ", q.size(1), ", keys d = ", k[0].size(1));
}

// (k · k, q · k, g · (o − v)) in one pass: the reductions of the merge's backward.
template <class acc_t, class scalar_t>
std::tuple<acc_t, acc_t, acc_t> merge_reductions(const scalar_t* k, const scalar_t* q, const scalar_t* g,
                                                 const scalar_t* o, const scalar_t* v, int64_t d) {
  acc_t kk = 0, qk = 0, gd = 0;
#pragma omp simd reduction(+ : kk, qk, gd)
  for (int64_t i = 0; i < d; ++i) {
    const acc_t ki = acc_t(k[i]);
    kk += ki * ki;
    qk += acc_t(q[i]) * ki;
    gd += acc_t(g[i]) * (acc_t(o[i]) - acc_t(v[i]));
  }
  return {kk, qk, gd};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> depth_read_forward(const at::Tensor& queries, at::TensorList keys,
                                                      at::TensorList values_, double eps) {
  const at::TensorList values = values_.empty() ? keys : values_;  // none: the values are the keys
  check_read(queries, keys, values);
  const at::Tensor q = queries.contiguous();
  const std::vector<at::Tensor> k = contiguous_all(keys), v = values_.empty() ? k : contiguous_all(values);
  const int64_t M = q.size(0), N = int64_t(k.size()), P = k[0].size(0), d = k[0].size(1);
  at::Tensor out = at::empty({M, P, d}, k[0].options());
  const auto acc_type = acc_type_of(k[0]);
  at::Tensor lse = at::empty({M, P}, k[0].options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "depth_read_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    const std::vector<const scalar_t*> kp = data_of<scalar_t>(k), vp = data_of<scalar_t>(v);
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    acc_t* lp = lse.mutable_data_ptr<acc_t>();
    at::parallel_for(0, P, grain(N * d * (M + 1)), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> a(M * N), acc(d);
      for (int64_t p = p0; p < p1; ++p) {
        // Logits a[m, r] = s_r (q_m · K_r) (A.1): the key's norm and the first dot in one pass.
        for (int64_t r = 0; r < N; ++r) {
          const scalar_t* kr = kp[r] + p * d;
          const auto [kk, qk] = square_and_dot<acc_t>(kr, qp, d);
          const acc_t s = inv_rms<acc_t>(kk, d, eps);
          a[r] = s * qk;
          for (int64_t m = 1; m < M; ++m) a[m * N + r] = s * dot<acc_t>(qp + m * d, kr, d);
        }
        // With a token's N logits at hand the softmax needs no running rescale: the online form
        // (A.2–A.4) reduces to one max, then one weighted pass over the values.
        for (int64_t m = 0; m < M; ++m) {
          const acc_t* am = a.data() + m * N;
          const acc_t mx = *std::max_element(am, am + N);
          acc_t Z = 0;
          std::fill(acc.begin(), acc.end(), acc_t(0));
          for (int64_t r = 0; r < N; ++r) {
            const acc_t w = std::exp(am[r] - mx);
            Z += w;                                           // (A.3)
            axpy(acc.data(), w, vp[r] + p * d, d);           // (A.4)
          }
          scalar_t* o = op + (m * P + p) * d;
          const acc_t inv_Z = acc_t(1) / Z;
          for (int64_t i = 0; i < d; ++i) o[i] = scalar_t(acc[i] * inv_Z);  // (A.5)
          lp[m * P + p] = mx + std::log(Z);
        }
      }
    });
  });
  return {out, lse};
}

at::Tensor depth_read_backward(const OptTensor& grad_out_opt, const OptTensor& grad_lse_opt, const at::Tensor& queries,
                               at::TensorList keys, at::TensorList values_, const at::Tensor& lse_, double eps,
                               at::TensorList gk, at::TensorList gv) {
  const at::Tensor grad_out_ = unwrap(grad_out_opt);
  const at::Tensor grad_lse_ = unwrap(grad_lse_opt);
  // Values that are the keys (AttnRes: keys = values = sources) have one buffer, which takes both.
  const bool values_are_keys = values_.empty();
  const at::TensorList values = values_are_keys ? keys : values_;
  check_read(queries, keys, values);
  const at::Tensor q = queries.contiguous(), lse = lse_.contiguous();
  const std::vector<at::Tensor> k = contiguous_all(keys), v = values_are_keys ? k : contiguous_all(values);
  const int64_t M = q.size(0), N = int64_t(k.size()), P = k[0].size(0), d = k[0].size(1);
  const auto acc_type = lse.scalar_type();
  const auto options = k[0].options();
  check_gradient_buffers("depth_read_backward: grad_keys", gk, N, {P, d}, acc_type);
  check_gradient_buffers("depth_read_backward: grad_values", gv, values_are_keys ? 0 : N, {P, d}, acc_type);
  const at::Tensor go = grad_out_.defined() ? grad_out_.contiguous() : at::zeros({M, P, d}, options);
  const at::Tensor gl = grad_lse_.defined() ? grad_lse_.to(acc_type).contiguous() : at::zeros({M, P}, lse.options());
  // Gradients of keys and values are added per token (no two threads share a token) into the
  // buffers given, one per source; the query gradient is a sum over tokens: one partial sum per
  // block of tokens (kernel_math.h).
  at::Tensor gq_parts = at::zeros({sum_blocks(P), M, d}, options.dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "depth_read_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    const std::vector<const scalar_t*> kp = data_of<scalar_t>(k), vp = data_of<scalar_t>(v);
    const scalar_t* gop = go.const_data_ptr<scalar_t>();
    const acc_t *lp = lse.const_data_ptr<acc_t>(), *glp = gl.const_data_ptr<acc_t>();
    const std::vector<acc_t*> gkp = mutable_data_of<acc_t>(gk), gvp = mutable_data_of<acc_t>(values_are_keys ? gk : gv);
    acc_t* gq_all = gq_parts.mutable_data_ptr<acc_t>();
    parallel_for_blocks(P, grain(N * d * (3 * M + 1)), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> s(N), w(N), gdotv(N), qk(N);
      for (int64_t p = p0; p < p1; ++p) {
        acc_t* gq = gq_all + sum_block(p) * M * d;
        // One pass over each key: its norm, q_0 · K_r and, when the values are the keys, g_0 · V_r.
        for (int64_t r = 0; r < N; ++r) {
          const scalar_t* kr = kp[r] + p * d;
          acc_t kk;
          if (values_are_keys) {
            std::tie(kk, qk[r], gdotv[r]) = square_and_two_dots<acc_t>(kr, qp, gop + p * d, d);
          } else {
            std::tie(kk, qk[r]) = square_and_dot<acc_t>(kr, qp, d);
          }
          s[r] = inv_rms<acc_t>(kk, d, eps);
        }
        for (int64_t m = 0; m < M; ++m) {
          const scalar_t* qm = qp + m * d;
          const scalar_t* g = gop + (m * P + p) * d;
          acc_t g_out = 0;  // g · out = Σ_r w_r (g · v_r)
          for (int64_t r = 0; r < N; ++r) {
            const scalar_t* kr = kp[r] + p * d;
            if (m > 0) qk[r] = dot<acc_t>(qm, kr, d);
            if (m > 0 || !values_are_keys) gdotv[r] = dot<acc_t>(g, vp[r] + p * d, d);
            w[r] = std::exp(s[r] * qk[r] - lp[m * P + p]);
            g_out += w[r] * gdotv[r];
          }
          // Each source's gradients in one pass, added to what the buffers hold.
          for (int64_t r = 0; r < N; ++r) {
            const scalar_t* kr = kp[r] + p * d;
            const acc_t da = w[r] * (gdotv[r] - g_out) + glp[m * P + p] * w[r];
            const acc_t a_q = da * s[r], a_k = -da * s[r] * s[r] * s[r] * qk[r] / acc_t(d);
            const acc_t a_g = values_are_keys ? w[r] : acc_t(0);  // values_are_keys values: ∂v_r lands on ∂k_r
            candidate_grads<true>(gkp[r] + p * d, gq + m * d, a_q, qm, a_k, kr, a_g, g, d);
            if (!values_are_keys) axpy(gvp[r] + p * d, w[r], g, d);
          }
        }
      }
    });
  });
  return gq_parts.sum(0).to(q.scalar_type());
}

at::Tensor depth_merge_forward(const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& query,
                               const at::Tensor& key_part, const OptTensor& value_part_opt, double eps) {
  const at::Tensor value_part_ = unwrap(value_part_opt);
  const at::Tensor& value_part = value_part_.defined() ? value_part_ : key_part;  // undefined: the key
  if (out_.dim() != 2 || key_part.sizes() != out_.sizes() || value_part.sizes() != out_.sizes() ||
      lse_.dim() != 1 || lse_.size(0) != out_.size(0) || query.dim() != 1 || query.size(0) != out_.size(1))
    fail("depth_merge: expected out, key_part, value_part [P, d], log_partition [P], query [d]");
  // The kernel reads all four as one storage type (the log-partition is converted).
  for (const at::Tensor* t : {&query, &key_part, &value_part})
    if (t->scalar_type() != out_.scalar_type()) fail("depth_merge: out, query, key_part and value_part must share a dtype");
  const auto acc_type = out_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor o = out_.contiguous(), lse = lse_.to(acc_type).contiguous(), q = query.contiguous(),
                   k = key_part.contiguous(), v = value_part.contiguous();
  const int64_t P = o.size(0), d = o.size(1);
  at::Tensor h = at::empty({P, d}, o.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "depth_merge_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *op = o.const_data_ptr<scalar_t>(), *qp = q.const_data_ptr<scalar_t>(), *kp = k.const_data_ptr<scalar_t>(),
                   *vp = v.const_data_ptr<scalar_t>();
    const acc_t* lp = lse.const_data_ptr<acc_t>();
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, P, grain(3 * d), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* kr = kp + p * d;
        const auto [kk, qk] = square_and_dot<acc_t>(kr, qp, d);
        const acc_t a = qk * inv_rms<acc_t>(kk, d, eps);  // (A.8)
        const acc_t lambda = acc_t(1) / (acc_t(1) + std::exp(a - lp[p]));      // σ(ζ − a) (A.9)
        for (int64_t i = 0; i < d; ++i)
          hp[p * d + i] = scalar_t(lambda * acc_t(op[p * d + i]) + (acc_t(1) - lambda) * acc_t(vp[p * d + i]));  // (A.10)
      }
    });
  });
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_merge_backward(
    const at::Tensor& grad_, const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& query,
    const at::Tensor& key_part, const OptTensor& value_part_opt, double eps) {
  const at::Tensor value_part_ = unwrap(value_part_opt);
  const bool shared = !value_part_.defined();  // the value is the key: one gradient
  const at::Tensor& value_part = shared ? key_part : value_part_;
  const auto acc_type = out_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor g = grad_.contiguous(), o = out_.contiguous(), lse = lse_.to(acc_type).contiguous(),
                   q = query.contiguous(), k = key_part.contiguous(), v = value_part.contiguous();
  const int64_t P = o.size(0), d = o.size(1);
  at::Tensor go = at::empty({P, d}, o.options().dtype(acc_type)), gk = at::empty({P, d}, o.options().dtype(acc_type)),
             gv = shared ? gk : at::empty({P, d}, o.options().dtype(acc_type)), gl = at::empty({P}, lse.options());
  at::Tensor gq_parts = at::zeros({sum_blocks(P), d}, o.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "depth_merge_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *gp = g.const_data_ptr<scalar_t>(), *op = o.const_data_ptr<scalar_t>(), *qp = q.const_data_ptr<scalar_t>(),
                   *kp = k.const_data_ptr<scalar_t>(), *vp = v.const_data_ptr<scalar_t>();
    const acc_t* lp = lse.const_data_ptr<acc_t>();
    acc_t *gop = go.mutable_data_ptr<acc_t>(), *gvp = gv.mutable_data_ptr<acc_t>(), *gkp = gk.mutable_data_ptr<acc_t>(),
          *glp = gl.mutable_data_ptr<acc_t>(), *gq_all = gq_parts.mutable_data_ptr<acc_t>();
    parallel_for_blocks(P, grain(5 * d), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        acc_t* gq = gq_all + sum_block(p) * d;
        const scalar_t *kr = kp + p * d, *gr = gp + p * d, *orow = op + p * d, *vr = vp + p * d;
        // One pass for the key's norm, q · k and ∂h/∂λ · g = g · (out − v_part).
        const auto [kk, qk, dlambda] = merge_reductions<acc_t>(kr, qp, gr, orow, vr, d);
        const acc_t s = inv_rms<acc_t>(kk, d, eps), a = s * qk;
        const acc_t lambda = acc_t(1) / (acc_t(1) + std::exp(a - lp[p]));
        const acc_t dz = dlambda * lambda * (acc_t(1) - lambda);  // ∂λ/∂ζ = λ(1 − λ) = −∂λ/∂a
        glp[p] = dz;
        const acc_t da = -dz, a_q = da * s, a_k = -da * s * s * s * qk / acc_t(d), mu = acc_t(1) - lambda;
        // Every gradient in a second pass.
        acc_t *gor = gop + p * d, *gkr = gkp + p * d, *gvr = gvp + p * d;
        const acc_t a_g = shared ? mu : acc_t(0);  // the value is the key: (1 − λ) g lands on ∂k
        set_scaled(gor, lambda, gr, d);
        candidate_grads<false>(gkr, gq, a_q, qp, a_k, kr, a_g, gr, d);
        if (!shared) set_scaled(gvr, mu, gr, d);
      }
    });
  });
  const auto st = o.scalar_type();
  return {go.to(st), gl.to(lse_.scalar_type()), gq_parts.sum(0).to(q.scalar_type()), gk.to(st),
          shared ? at::Tensor() : gv.to(st)};
}

int kernel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return std::popcount(seen.load());
}

}  // namespace depthkit::cpu
