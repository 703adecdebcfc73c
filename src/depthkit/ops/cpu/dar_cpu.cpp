// CPU kernels of DAR's fused residual read and gated write (DAR Appendix A.1, eq. 9–17).
//
// Layout: completed streams H⁰, H¹, lists of N entries [P, d] (P = batch·tokens; never stacked,
// kernel_math.h); the block's partial P⁰, P¹ [P, d] is one more candidate (index N) when present. Parallel over tokens; per token everything lives in
// thread-local buffers of d (or 2d) floats: nothing of size N·P·d is written but the gradients.
//
// Read, per token (eq. 10–15): one pass over each candidate of both streams gives its inverse RMS
// s (keys normalised on the fly, shared by the two reads) and its logits. Output stream j reads
// with key stream k_j and value stream v_j (routing, eq. 22) by a softmax over the candidates
// (eq. A.1–A.5, the partial folded in as the last candidate, which is the merge A.6–A.10; with all
// C logits at hand the online form needs no running rescale):
//   a_c = s_c (q_j · K_c),  z_j = Σ_c softmax(a)_c V_c,  ζ_j = logsumexp_c a_c.
// Then the gates: u = [z⁰; z¹], ū = u / rms(u), α = σ(ū W_αᵀ + b_α), β = 2σ(ū W_βᵀ + b_β),
// h = α⁰ z⁰ + α¹ z¹. Only ζ [2, P] is kept for the backward.
//
// Read backward, per token: z_j is recomputed from ζ without a running max (w_c = exp(a_c − ζ_j)),
// then the gates are differentiated:
//   ∂α_k = g_h · z_k,  ∂ℓα_k = ∂α_k α_k(1 − α_k),  ∂ℓβ_k = ∂β_k · β_k(1 − β_k/2),
//   ∂ū = Σ_k ∂ℓα_k W_α[k] + ∂ℓβ_k W_β[k],  ∂u = (∂ū − ū (ū·∂ū)/2d) / rms(u),
//   ∂z_k = α_k g_h + ∂u[k],
// and the read (as depth_read_cpu.cpp): ∂a_c = w_c (∂z·V_c − ∂z·z), ∂V_c += w_c ∂z,
//   ∂q += ∂a_c s_c K_c,  ∂K_c += ∂a_c (s_c q − s_c³ (q·K_c) K_c / d).
// Gate and query gradients are sums over tokens: one partial sum per block of tokens (kernel_math.h).
//
// Write (eq. 16–17): P'_j = β_j f at block start; otherwise with ρ = σ(Norm([P⁰; P¹]) w_ρ + b_ρ),
//   P'⁰ = ρ P⁰ + (1 − ρ) P¹ + β⁰ f,   P'¹ = (1 − ρ) P⁰ + ρ P¹ + β¹ f.
// Its backward: ∂f = Σ_j β_j g_j, ∂β_j = g_j · f, ∂ρ = (g⁰ − g¹)·(P⁰ − P¹), ∂ℓρ = ∂ρ ρ(1 − ρ),
//   ∂P⁰ = ρ g⁰ + (1 − ρ) g¹ + ∂u[0], ∂P¹ = (1 − ρ) g⁰ + ρ g¹ + ∂u[1] with ∂ū = ∂ℓρ w_ρ.
#include "depthkit/ops/cpu/dar_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <vector>

#include "depthkit/ops/cpu/kernel_math.h"
#include "depthkit/util/error.h"

namespace depthkit::cpu {

namespace {

void check_read(const at::Tensor& q, at::TensorList h0, at::TensorList h1, const at::Tensor& p0,
                const at::Tensor& p1, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                const at::Tensor& bb) {
  if (h0.empty() || h0.size() != h1.size())
    fail("dar_read: expected completed streams h0, h1 of N >= 1 entries each, got ", h0.size(), " and ", h1.size());
  if (h0[0].dim() != 2) fail("dar_read: completed entries must be [P, d], got ", h0[0].sizes());
  for (size_t n = 0; n < h0.size(); ++n)
    for (const at::Tensor* t : {&h0[n], &h1[n]}) {
      if (t->sizes() != h0[0].sizes())
        fail("dar_read: completed entry ", n, " of h0, h1 is ", t->sizes(), ", entry 0 of h0 ", h0[0].sizes());
      if (t->scalar_type() != q.scalar_type()) fail("dar_read: all inputs must share one dtype");
    }
  const int64_t P = h0[0].size(0), d = h0[0].size(1);
  if (q.dim() != 2 || q.size(0) != 2 || q.size(1) != d) fail("dar_read: queries must be [2, ", d, "], got ", q.sizes());
  if (p0.defined() != p1.defined()) fail("dar_read: give both partial streams or neither");
  if (p0.defined() && (p0.sizes() != at::IntArrayRef{P, d} || p1.sizes() != p0.sizes()))
    fail("dar_read: partial streams must be [", P, ", ", d, "], got ", p0.sizes(), " and ", p1.sizes());
  for (const at::Tensor* w : {&wa, &wb})
    if (w->sizes() != at::IntArrayRef{2, 2 * d}) fail("dar_read: gate weights must be [2, ", 2 * d, "], got ", w->sizes());
  for (const at::Tensor* b : {&ba, &bb})
    if (b->sizes() != at::IntArrayRef{2}) fail("dar_read: gate biases must be [2], got ", b->sizes());
  for (const at::Tensor* t : {&wa, &ba, &wb, &bb})
    if (t->scalar_type() != q.scalar_type()) fail("dar_read: all inputs must share one dtype");
  if (p0.defined() && (p0.scalar_type() != q.scalar_type() || p1.scalar_type() != q.scalar_type()))
    fail("dar_read: all inputs must share one dtype");
}

// The routing arguments of the schema (int[] key_stream, int[] value_stream, DAR eq. 22).
DarRouting routing_of(at::IntArrayRef key, at::IntArrayRef value) {
  if (key.size() != 2 || value.size() != 2) fail("dar_read: key_stream and value_stream must name 2 streams each");
  for (int64_t s : {key[0], key[1], value[0], value[1]})
    if (s != 0 && s != 1) fail("dar_read: stream indices must be 0 or 1, got ", s);
  return {{key[0], key[1]}, {value[0], value[1]}};
}

at::Tensor contiguous_or_undefined(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

// Candidate c of a stream for token p: a completed entry (c < N), then the partial (c = N) when
// there is one. Each candidate is a [P, d] tensor of its own (its gradient buffer too).
template <class T>
struct Candidates {
  std::vector<T*> stream[2];  // C per stream
  int64_t d;
  int64_t count() const { return int64_t(stream[0].size()); }
  T* at(int s, int64_t c, int64_t p) const { return stream[s][c] + p * d; }
};
// The candidates of both streams: the completed entries, then the partial when defined.
template <class T>
Candidates<const T> candidates(const std::vector<at::Tensor>& h0, const std::vector<at::Tensor>& h1,
                               const at::Tensor& p0, const at::Tensor& p1, int64_t d) {
  Candidates<const T> c{{data_of<T>(h0), data_of<T>(h1)}, d};
  if (p0.defined()) {
    c.stream[0].push_back(p0.const_data_ptr<T>());
    c.stream[1].push_back(p1.const_data_ptr<T>());
  }
  return c;
}

// The logits of both reads for token p in one pass over each candidate of each stream: its
// inverse RMS s and its dot with the query (or queries) of the read(s) that take it as key.
// a[j·C + c] = s_{k_j, c} (q_j · K_{k_j, c}); s[st·C + c] when s is not null.
template <class acc_t, class scalar_t>
void logits(const Candidates<const scalar_t>& cand, const scalar_t* q, const DarRouting& routing, int64_t p, double eps,
            acc_t* a, acc_t* s_out) {
  const int64_t C = cand.count(), d = cand.d;
  const int k0 = int(routing.key[0]), k1 = int(routing.key[1]);
  for (int st = 0; st < 2; ++st) {
    const bool for0 = k0 == st, for1 = k1 == st;
    for (int64_t c = 0; c < C; ++c) {
      const scalar_t* x = cand.at(st, c, p);
      acc_t xx, d0 = 0, d1 = 0;
      if (for0 && for1) std::tie(xx, d0, d1) = square_and_two_dots<acc_t>(x, q, q + d, d);
      else if (for0) std::tie(xx, d0) = square_and_dot<acc_t>(x, q, d);
      else if (for1) std::tie(xx, d1) = square_and_dot<acc_t>(x, q + d, d);
      else xx = dot<acc_t>(x, x, d);
      const acc_t sc = inv_rms<acc_t>(xx, d, eps);
      if (for0) a[c] = sc * d0;
      if (for1) a[C + c] = sc * d1;
      if (s_out) s_out[st * C + c] = sc;
    }
  }
}

// The gate pre-activations on u = [z⁰; z¹] [2d] in one pass: r = 1/rms(u) and the four dots
// W_α[k]·u, W_β[k]·u (the logits are r·dot + b).
template <class acc_t>
struct GateLogits {
  acc_t r, alpha[2], beta[2];
};
template <class acc_t, class scalar_t>
GateLogits<acc_t> gate_logits(const acc_t* u, const scalar_t* wa, const scalar_t* wb, int64_t d, double eps) {
  acc_t uu = 0, a0 = 0, a1 = 0, b0 = 0, b1 = 0;
  const int64_t n = 2 * d;
#pragma omp simd reduction(+ : uu, a0, a1, b0, b1)
  for (int64_t i = 0; i < n; ++i) {
    const acc_t ui = u[i];
    uu += ui * ui;
    a0 += acc_t(wa[i]) * ui;
    a1 += acc_t(wa[n + i]) * ui;
    b0 += acc_t(wb[i]) * ui;
    b1 += acc_t(wb[n + i]) * ui;
  }
  return {inv_rms<acc_t>(uu, n, eps), {a0, a1}, {b0, b1}};
}

// The gates' backward over u = [z⁰; z¹] (2d) from the logit gradients ∂ℓα, ∂ℓβ (eq. 13–15):
//   ∂W_α[k] += ∂ℓα_k r u,  ∂W_β[k] += ∂ℓβ_k r u,  ∂ū = Σ_k ∂ℓα_k W_α[k] + ∂ℓβ_k W_β[k]  (one pass),
//   ∂z_k = r (∂ū − ū (ū·∂ū) / 2d)[k] + α_k g_h                                         (a second).
template <class acc_t, class scalar_t>
void gate_backward(const acc_t* z, acc_t* gu, acc_t* gz, const scalar_t* g, acc_t r, const acc_t* alpha,
                   const acc_t* dla, const acc_t* dlb, const scalar_t* wa, const scalar_t* wb, acc_t* gwa, acc_t* gwb,
                   int64_t d) {
  const int64_t n = 2 * d;
  acc_t zgu = 0;
#pragma omp simd reduction(+ : zgu)
  for (int64_t i = 0; i < n; ++i) {
    const acc_t zi = z[i];
    gwa[i] += dla[0] * r * zi;
    gwa[n + i] += dla[1] * r * zi;
    gwb[i] += dlb[0] * r * zi;
    gwb[n + i] += dlb[1] * r * zi;
    gu[i] = dla[0] * acc_t(wa[i]) + dla[1] * acc_t(wa[n + i]) + dlb[0] * acc_t(wb[i]) + dlb[1] * acc_t(wb[n + i]);
    zgu += zi * gu[i];
  }
  const acc_t c_u = r * r * zgu / acc_t(n);
  for (int k = 0; k < 2; ++k) {
    const acc_t ak = alpha[k];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) gz[k * d + i] = r * (gu[k * d + i] - c_u * z[k * d + i]) + ak * acc_t(g[i]);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> dar_read_forward(
    const at::Tensor& queries, at::TensorList h0_, at::TensorList h1_, const OptTensor& p0_opt,
    const OptTensor& p1_opt, const at::Tensor& w_alpha, const at::Tensor& b_alpha, const at::Tensor& w_beta,
    const at::Tensor& b_beta, at::IntArrayRef key_stream, at::IntArrayRef value_stream, double eps) {
  const at::Tensor p0_ = unwrap(p0_opt);
  const at::Tensor p1_ = unwrap(p1_opt);
  const DarRouting routing = routing_of(key_stream, value_stream);
  check_read(queries, h0_, h1_, p0_, p1_, w_alpha, b_alpha, w_beta, b_beta);
  const std::vector<at::Tensor> h0 = contiguous_all(h0_), h1 = contiguous_all(h1_);
  const at::Tensor q = queries.contiguous(), p0 = contiguous_or_undefined(p0_), p1 = contiguous_or_undefined(p1_),
                   wa = w_alpha.contiguous(), ba = b_alpha.contiguous(), wb = w_beta.contiguous(),
                   bb = b_beta.contiguous();
  const int64_t N = int64_t(h0.size()), P = h0[0].size(0), d = h0[0].size(1), C = N + (p0.defined() ? 1 : 0);
  const auto options = q.options();
  at::Tensor h = at::empty({P, d}, options), beta = at::empty({P, 2}, options);
  at::Tensor lse = at::empty({2, P}, options.dtype(acc_type_of(q)));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "dar_read_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto cand = candidates<scalar_t>(h0, h1, p0, p1, d);
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *wap = wa.const_data_ptr<scalar_t>(),
                   *bap = ba.const_data_ptr<scalar_t>(), *wbp = wb.const_data_ptr<scalar_t>(),
                   *bbp = bb.const_data_ptr<scalar_t>();
    scalar_t *hp = h.mutable_data_ptr<scalar_t>(), *betap = beta.mutable_data_ptr<scalar_t>();
    acc_t* lp = lse.mutable_data_ptr<acc_t>();
    at::parallel_for(0, P, grain(6 * C * d), [&](int64_t p0i, int64_t p1i) {
      std::vector<acc_t> a(2 * C), z(2 * d);
      for (int64_t p = p0i; p < p1i; ++p) {
        logits<acc_t>(cand, qp, routing, p, eps, a.data(), nullptr);
        for (int j = 0; j < 2; ++j) {  // the two reads (eq. 11–12, A.1–A.5), logits at hand
          const int vs = int(routing.value[j]);
          const acc_t* aj = a.data() + j * C;
          const acc_t mx = *std::max_element(aj, aj + C);
          acc_t* zj = z.data() + j * d;
          std::fill_n(zj, d, acc_t(0));
          acc_t Z = 0;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t w = std::exp(aj[c] - mx);
            Z += w;
            axpy(zj, w, cand.at(vs, c, p), d);
          }
          scale(zj, acc_t(1) / Z, d);
          lp[j * P + p] = mx + std::log(Z);
        }
        // Gates on ū = Norm([z⁰; z¹]) (eq. 13–14), then the mix (eq. 15).
        const GateLogits<acc_t> gl = gate_logits(z.data(), wap, wbp, d, eps);
        acc_t alpha[2], beta_k[2];
        for (int k = 0; k < 2; ++k) {
          alpha[k] = sigmoid(gl.r * gl.alpha[k] + acc_t(bap[k]));
          beta_k[k] = acc_t(2) * sigmoid(gl.r * gl.beta[k] + acc_t(bbp[k]));
          betap[p * 2 + k] = scalar_t(beta_k[k]);
        }
        scalar_t* hr = hp + p * d;
        for (int64_t i = 0; i < d; ++i) hr[i] = scalar_t(alpha[0] * z[i] + alpha[1] * z[d + i]);
      }
    });
  });
  return {h, beta, lse};
}

std::vector<at::Tensor> dar_read_backward(const OptTensor& grad_h_opt, const OptTensor& grad_beta_opt,
                                          const at::Tensor& queries, at::TensorList h0_, at::TensorList h1_,
                                          const OptTensor& p0_opt, const OptTensor& p1_opt, const at::Tensor& w_alpha,
                                          const at::Tensor& b_alpha, const at::Tensor& w_beta,
                                          const at::Tensor& b_beta, const at::Tensor& lse_,
                                          at::IntArrayRef key_stream, at::IntArrayRef value_stream, double eps,
                                          at::TensorList gH0, at::TensorList gH1) {
  const at::Tensor grad_h_ = unwrap(grad_h_opt);
  const at::Tensor grad_beta_ = unwrap(grad_beta_opt);
  const at::Tensor p0_ = unwrap(p0_opt);
  const at::Tensor p1_ = unwrap(p1_opt);
  const DarRouting routing = routing_of(key_stream, value_stream);
  check_read(queries, h0_, h1_, p0_, p1_, w_alpha, b_alpha, w_beta, b_beta);
  const std::vector<at::Tensor> h0 = contiguous_all(h0_), h1 = contiguous_all(h1_);
  const at::Tensor q = queries.contiguous(), p0 = contiguous_or_undefined(p0_), p1 = contiguous_or_undefined(p1_),
                   wa = w_alpha.contiguous(), ba = b_alpha.contiguous(), wb = w_beta.contiguous(),
                   bb = b_beta.contiguous(), lse = lse_.contiguous();
  const int64_t N = int64_t(h0.size()), P = h0[0].size(0), d = h0[0].size(1), C = N + (p0.defined() ? 1 : 0);
  const auto acc = acc_type_of(q);
  const auto acc_opt = q.options().dtype(acc);
  const at::Tensor gh = grad_h_.defined() ? grad_h_.contiguous() : at::zeros({P, d}, q.options());
  const at::Tensor gb = grad_beta_.defined() ? grad_beta_.contiguous() : at::zeros({P, 2}, q.options());
  // Candidate gradients, one tensor each, added to: the entries' buffers given, the partials' own.
  // Every token's rows are written by the thread that owns it.
  check_gradient_buffers("dar_read_backward: grad_h0", gH0, N, {P, d}, acc);
  check_gradient_buffers("dar_read_backward: grad_h1", gH1, N, {P, d}, acc);
  at::Tensor gP0 = p0.defined() ? at::zeros({P, d}, acc_opt) : at::Tensor();
  at::Tensor gP1 = p0.defined() ? at::zeros({P, d}, acc_opt) : at::Tensor();
  // Partial sums per block of tokens (kernel_math.h) of the token-summed gradients: q [2, d],
  // W_α, W_β [2, 2d], b_α, b_β [2].
  const int64_t part = 2 * d + 8 * d + 4;
  at::Tensor parts = at::zeros({sum_blocks(P), part}, acc_opt);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "dar_read_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto cand = candidates<scalar_t>(h0, h1, p0, p1, d);
    Candidates<acc_t> grad{{mutable_data_of<acc_t>(gH0), mutable_data_of<acc_t>(gH1)}, d};
    if (p0.defined()) {
      grad.stream[0].push_back(gP0.mutable_data_ptr<acc_t>());
      grad.stream[1].push_back(gP1.mutable_data_ptr<acc_t>());
    }
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *wap = wa.const_data_ptr<scalar_t>(),
                   *bap = ba.const_data_ptr<scalar_t>(), *wbp = wb.const_data_ptr<scalar_t>(),
                   *bbp = bb.const_data_ptr<scalar_t>(), *ghp = gh.const_data_ptr<scalar_t>(),
                   *gbp = gb.const_data_ptr<scalar_t>();
    const acc_t* lp = lse.const_data_ptr<acc_t>();
    acc_t* parts_p = parts.mutable_data_ptr<acc_t>();
    parallel_for_blocks(P, grain(10 * C * d), [&](int64_t p0i, int64_t p1i) {
      std::vector<acc_t> s(2 * C), a(2 * C), z(2 * d), gz(2 * d), gu(2 * d);
      for (int64_t p = p0i; p < p1i; ++p) {
        acc_t* gq = parts_p + sum_block(p) * part;  // [2, d]
        acc_t *gwa = gq + 2 * d, *gwb = gwa + 4 * d, *gba = gwb + 4 * d, *gbb = gba + 2;
        logits<acc_t>(cand, qp, routing, p, eps, a.data(), s.data());
        // Recompute the reads from ζ: z_j = Σ_c exp(a_c − ζ_j) V_c.
        for (int j = 0; j < 2; ++j) {
          const int vs = int(routing.value[j]);
          acc_t* zj = z.data() + j * d;
          std::fill_n(zj, d, acc_t(0));
          for (int64_t c = 0; c < C; ++c) axpy(zj, std::exp(a[j * C + c] - lp[j * P + p]), cand.at(vs, c, p), d);
        }
        // Gates (eq. 13–15).
        const scalar_t* g = ghp + p * d;
        const GateLogits<acc_t> gl = gate_logits(z.data(), wap, wbp, d, eps);
        const acc_t r = gl.r;
        acc_t alpha[2], dla[2], dlb[2];
        for (int k = 0; k < 2; ++k) {
          alpha[k] = sigmoid(r * gl.alpha[k] + acc_t(bap[k]));
          const acc_t beta_half = sigmoid(r * gl.beta[k] + acc_t(bbp[k]));
          dla[k] = dot<acc_t>(g, z.data() + k * d, d) * alpha[k] * (acc_t(1) - alpha[k]);
          dlb[k] = acc_t(gbp[p * 2 + k]) * acc_t(2) * beta_half * (acc_t(1) - beta_half);
          gba[k] += dla[k];
          gbb[k] += dlb[k];
        }
        gate_backward(z.data(), gu.data(), gz.data(), g, r, alpha, dla, dlb, wap, wbp, gwa, gwb, d);
        // The reads' backward (eq. A.1–A.5), each candidate's three gradients in one pass.
        for (int j = 0; j < 2; ++j) {
          const int ks = int(routing.key[j]), vs = int(routing.value[j]);
          const acc_t* gzj = gz.data() + j * d;
          const scalar_t* qj = qp + j * d;
          acc_t* gqj = gq + j * d;
          const acc_t g_out = dot<acc_t>(gzj, z.data() + j * d, d);
          for (int64_t c = 0; c < C; ++c) {
            const scalar_t *kc = cand.at(ks, c, p), *vc = cand.at(vs, c, p);
            const acc_t w = std::exp(a[j * C + c] - lp[j * P + p]), sc = s[ks * C + c];
            const acc_t da = w * (dot<acc_t>(gzj, vc, d) - g_out);
            const acc_t a_q = da * sc, a_k = -da * sc * sc * a[j * C + c] / acc_t(d);  // s³ (q·K) = s² a
            acc_t *gv = grad.at(vs, c, p), *gk = grad.at(ks, c, p);
            if (gv == gk) {  // self-stream keys and values (DAR-SelfKV): ∂V lands on ∂K
              candidate_grads<true>(gk, gqj, a_q, qj, a_k, kc, w, gzj, d);
            } else {
              axpy(gv, w, gzj, d);
              candidate_grads<true>(gk, gqj, a_q, qj, a_k, kc, acc_t(0), gzj, d);
            }
          }
        }
      }
    });
  });
  const auto st = q.scalar_type();
  at::Tensor total = parts.sum(0);
  auto piece = [&](int64_t offset, at::IntArrayRef shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    return total.narrow(0, offset, n).view(shape).to(st);
  };
  return {piece(0, {2, d}),
          gP0.defined() ? gP0.to(st) : at::Tensor(),
          gP1.defined() ? gP1.to(st) : at::Tensor(),
          piece(2 * d, {2, 2 * d}),
          piece(10 * d, {2}),
          piece(6 * d, {2, 2 * d}),
          piece(10 * d + 2, {2})};
}

std::tuple<at::Tensor, at::Tensor> dar_write_forward(const at::Tensor& f_, const at::Tensor& beta_,
                                                     const OptTensor& p0_opt, const OptTensor& p1_opt,
                                                     const OptTensor& w_rho_opt, const OptTensor& b_rho_opt, double eps) {
  const at::Tensor p0_ = unwrap(p0_opt);
  const at::Tensor p1_ = unwrap(p1_opt);
  const at::Tensor w_rho = unwrap(w_rho_opt);
  const at::Tensor b_rho = unwrap(b_rho_opt);
  if (f_.dim() != 2 || beta_.sizes() != at::IntArrayRef{f_.size(0), 2})
    fail("dar_write: expected f [P, d] and beta [P, 2], got ", f_.sizes(), " and ", beta_.sizes());
  const int64_t P = f_.size(0), d = f_.size(1);
  const bool transport = p0_.defined();
  if (transport && (p0_.sizes() != f_.sizes() || p1_.sizes() != f_.sizes() ||
                    w_rho.sizes() != at::IntArrayRef{1, 2 * d} || b_rho.sizes() != at::IntArrayRef{1}))
    fail("dar_write: expected partial streams [", P, ", ", d, "], w_rho [1, ", 2 * d, "] and b_rho [1]");
  // The kernel reads every input as f's storage type.
  for (const at::Tensor* t : {&beta_, &p0_, &p1_, &w_rho, &b_rho})
    if (t->defined() && t->scalar_type() != f_.scalar_type()) fail("dar_write: all inputs must share one dtype");
  const at::Tensor f = f_.contiguous(), beta = beta_.contiguous(), p0 = contiguous_or_undefined(p0_),
                   p1 = contiguous_or_undefined(p1_), wr = contiguous_or_undefined(w_rho),
                   br = contiguous_or_undefined(b_rho);
  at::Tensor out0 = at::empty({P, d}, f.options()), out1 = at::empty({P, d}, f.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, f.scalar_type(), "dar_write_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *fp = f.const_data_ptr<scalar_t>(), *bp = beta.const_data_ptr<scalar_t>();
    const scalar_t *pp0 = transport ? p0.const_data_ptr<scalar_t>() : nullptr,
                   *pp1 = transport ? p1.const_data_ptr<scalar_t>() : nullptr,
                   *wrp = transport ? wr.const_data_ptr<scalar_t>() : nullptr;
    const acc_t brv = transport ? acc_t(br.const_data_ptr<scalar_t>()[0]) : acc_t(0);
    scalar_t *o0 = out0.mutable_data_ptr<scalar_t>(), *o1 = out1.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, P, grain(6 * d), [&](int64_t a, int64_t b) {
      for (int64_t p = a; p < b; ++p) {
        const scalar_t* fr = fp + p * d;
        const acc_t b0 = acc_t(bp[2 * p]), b1 = acc_t(bp[2 * p + 1]);
        scalar_t *r0 = o0 + p * d, *r1 = o1 + p * d;
        if (!transport) {
          for (int64_t i = 0; i < d; ++i) {
            r0[i] = scalar_t(b0 * acc_t(fr[i]));
            r1[i] = scalar_t(b1 * acc_t(fr[i]));
          }
          continue;
        }
        const scalar_t *x0 = pp0 + p * d, *x1 = pp1 + p * d;
        const acc_t r = inv_rms<acc_t>(dot<acc_t>(x0, x0, d) + dot<acc_t>(x1, x1, d), 2 * d, eps);
        const acc_t rho = sigmoid(r * (dot<acc_t>(wrp, x0, d) + dot<acc_t>(wrp + d, x1, d)) + brv);
        for (int64_t i = 0; i < d; ++i) {
          const acc_t a0 = acc_t(x0[i]), a1 = acc_t(x1[i]), fi = acc_t(fr[i]);
          r0[i] = scalar_t(rho * a0 + (acc_t(1) - rho) * a1 + b0 * fi);
          r1[i] = scalar_t((acc_t(1) - rho) * a0 + rho * a1 + b1 * fi);
        }
      }
    });
  });
  return {out0, out1};
}

std::vector<at::Tensor> dar_write_backward(const OptTensor& grad0_opt, const OptTensor& grad1_opt, const at::Tensor& f_,
                                           const at::Tensor& beta_, const OptTensor& p0_opt, const OptTensor& p1_opt,
                                           const OptTensor& w_rho_opt, const OptTensor& b_rho_opt, double eps) {
  const at::Tensor grad0_ = unwrap(grad0_opt);
  const at::Tensor grad1_ = unwrap(grad1_opt);
  const at::Tensor p0_ = unwrap(p0_opt);
  const at::Tensor p1_ = unwrap(p1_opt);
  const at::Tensor w_rho = unwrap(w_rho_opt);
  const at::Tensor b_rho = unwrap(b_rho_opt);
  const int64_t P = f_.size(0), d = f_.size(1);
  const bool transport = p0_.defined();
  const auto acc = acc_type_of(f_);
  const auto acc_opt = f_.options().dtype(acc);
  const at::Tensor g0 = grad0_.defined() ? grad0_.contiguous() : at::zeros({P, d}, f_.options());
  const at::Tensor g1 = grad1_.defined() ? grad1_.contiguous() : at::zeros({P, d}, f_.options());
  const at::Tensor f = f_.contiguous(), beta = beta_.contiguous(), p0 = contiguous_or_undefined(p0_),
                   p1 = contiguous_or_undefined(p1_), wr = contiguous_or_undefined(w_rho),
                   br = contiguous_or_undefined(b_rho);
  at::Tensor gf = at::empty({P, d}, acc_opt), gbeta = at::empty({P, 2}, acc_opt);
  at::Tensor gp0 = transport ? at::empty({P, d}, acc_opt) : at::Tensor();
  at::Tensor gp1 = transport ? at::empty({P, d}, acc_opt) : at::Tensor();
  at::Tensor parts = at::zeros({sum_blocks(P), 2 * d + 1}, acc_opt);  // ∂w_ρ [2d], ∂b_ρ per block of tokens
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, f.scalar_type(), "dar_write_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *fp = f.const_data_ptr<scalar_t>(), *bp = beta.const_data_ptr<scalar_t>(),
                   *g0p = g0.const_data_ptr<scalar_t>(), *g1p = g1.const_data_ptr<scalar_t>();
    const scalar_t *pp0 = transport ? p0.const_data_ptr<scalar_t>() : nullptr,
                   *pp1 = transport ? p1.const_data_ptr<scalar_t>() : nullptr,
                   *wrp = transport ? wr.const_data_ptr<scalar_t>() : nullptr;
    const acc_t brv = transport ? acc_t(br.const_data_ptr<scalar_t>()[0]) : acc_t(0);
    acc_t *gfp = gf.mutable_data_ptr<acc_t>(), *gbp = gbeta.mutable_data_ptr<acc_t>();
    acc_t *gp0p = transport ? gp0.mutable_data_ptr<acc_t>() : nullptr,
          *gp1p = transport ? gp1.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* parts_p = parts.mutable_data_ptr<acc_t>();
    parallel_for_blocks(P, grain(10 * d), [&](int64_t a, int64_t b) {
      for (int64_t p = a; p < b; ++p) {
        acc_t* gw = parts_p + sum_block(p) * (2 * d + 1);
        const scalar_t *fr = fp + p * d, *x0 = g0p + p * d, *x1 = g1p + p * d;
        const acc_t b0 = acc_t(bp[2 * p]), b1 = acc_t(bp[2 * p + 1]);
        acc_t* gfr = gfp + p * d;
        for (int64_t i = 0; i < d; ++i) gfr[i] = b0 * acc_t(x0[i]) + b1 * acc_t(x1[i]);
        gbp[2 * p] = dot<acc_t>(x0, fr, d);
        gbp[2 * p + 1] = dot<acc_t>(x1, fr, d);
        if (!transport) continue;
        const scalar_t *a0 = pp0 + p * d, *a1 = pp1 + p * d;
        const acc_t r = inv_rms<acc_t>(dot<acc_t>(a0, a0, d) + dot<acc_t>(a1, a1, d), 2 * d, eps);
        const acc_t rho = sigmoid(r * (dot<acc_t>(wrp, a0, d) + dot<acc_t>(wrp + d, a1, d)) + brv);
        const acc_t drho = dot_of_differences<acc_t>(x0, x1, a0, a1, d);  // (g⁰ − g¹)·(P⁰ − P¹)
        const acc_t dl = drho * rho * (acc_t(1) - rho);
        gw[2 * d] += dl;
        axpy(gw, dl * r, a0, d);
        axpy(gw + d, dl * r, a1, d);
        // ∂u = r (∂ū − ū (ū·∂ū)/2d), ∂ū = dl w_ρ, ū = r u.
        const acc_t c_u = r * r * dl * (dot<acc_t>(wrp, a0, d) + dot<acc_t>(wrp + d, a1, d)) / acc_t(2 * d);
        acc_t *o0 = gp0p + p * d, *o1 = gp1p + p * d;
        for (int64_t i = 0; i < d; ++i) {
          const acc_t y0 = acc_t(x0[i]), y1 = acc_t(x1[i]);
          o0[i] = rho * y0 + (acc_t(1) - rho) * y1 + r * (dl * acc_t(wrp[i]) - c_u * acc_t(a0[i]));
          o1[i] = (acc_t(1) - rho) * y0 + rho * y1 + r * (dl * acc_t(wrp[d + i]) - c_u * acc_t(a1[i]));
        }
      }
    });
  });
  const auto st = f.scalar_type();
  at::Tensor gw_total = parts.sum(0);
  if (!transport) return {gf.to(st), gbeta.to(st), {}, {}, {}, {}};
  return {gf.to(st), gbeta.to(st), gp0.to(st), gp1.to(st), gw_total.narrow(0, 0, 2 * d).view({1, 2 * d}).to(st),
          gw_total.narrow(0, 2 * d, 1).to(st)};
}

}  // namespace depthkit::cpu
