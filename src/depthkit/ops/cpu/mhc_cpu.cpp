// CPU kernels of the fused mHC operators (MSAR eq. 3–5; the parameterisation of docs/design.md, "mHC").
//
// Layout: the streams of token p are x_p = [x_1; …; x_m] ∈ R^{md} (x [P, m, d] contiguous), the
// branch output f [P, d]; n = m² + 2m logits per token, ordered (pre: m, post: m, res: m² row-major
// over (i, j)). Parallel over tokens p with at::parallel_for; loops over d are contiguous and
// vectorised (`#pragma omp simd`); accumulation in the wide type acc_t (float32,
// float64 for float64 inputs); bfloat16 storage is accepted.
//
// Pre-mix (eq. 3–4). With r = 1/√(mean(x²) + ε) over the md entries, u = x φᵀ ∈ R^n:
//   z = r u                                   (the normalised projection, "proj", kept)
//   l_k = α_{g(k)} z_k + b_k                  g(k) = pre, post, res for the three groups
//   H_pre = σ(l_pre), H_post = 2σ(l_post), res_logits = l_res,  h = Σ_i H_pre[i] x_i
// The product u = x φᵀ stays an ATen GEMM ([P, md] × [md, n], n = 24 for m = 4), one per fixed block
// of tokens (for_each_gemm_block): a skinny GEMM that the BLAS does at memory speed; everything
// around it is one pass over x per token.
// Backward, from ḡ_h, ḡ_post, ḡ_res (undefined = 0):
//   ∂l_pre,i = (ḡ_h · x_i) σ(1 − σ),  ∂l_post,i = ḡ_post,i 2σ(1 − σ),  ∂l_res = ḡ_res
//   ∂b = Σ_p ∂l,  ∂α_g = Σ_p Σ_{k∈g} ∂l_k z_k  (per block of tokens, kernel_math.h),  ∂u_k = r α_k ∂l_k
//   ∂φ = ∂uᵀ x (GEMM),  ∂x_i = [∂u φ]_i (GEMM) + H_pre[i] ḡ_h − (r² q / md) x_i,  q = Σ_k α_k ∂l_k z_k
// (the last term is the path through r: ∂r/∂x = −r³ x / md and ∂r = q / r). Kept for the backward:
// the inputs and proj [P, n]; r and H_pre are recomputed.
//
// Sinkhorn–Knopp (eq. 3, docs/design.md): P⁰ = exp(L − max L); for t = 1 … iters: rows
// P ← P / s (s_i = Σ_j P_ij), then columns P ← P / c (c_j = Σ_i P_ij). All in acc_t; each
// division is a multiplication by the sum's reciprocal, and m = 2, 4 are compiled with fixed m;
// 16 tokens run side by side, one per SIMD lane. Backward recomputes the 2·iters normalisation
// steps into a small thread-local buffer (the m² matrix after each step and its m sums) and walks
// them back:
//   row step Q_ij = P_ij / s_i:     ∂P_ij = (∂Q_ij − Σ_k ∂Q_ik Q_ik) / s_i
//   column step Q_ij = P_ij / c_j:  ∂P_ij = (∂Q_ij − Σ_k ∂Q_kj Q_kj) / c_j
//   ∂L = ∂P⁰ ⊙ P⁰  (the max shift changes nothing). Only the logits are kept.
//
// Post + res merge (eq. 5): x'_j = H_post[j] f + Σ_i H_res[i, j] x_i. Backward from G = ∂x':
//   ∂f = Σ_j H_post[j] G_j,  ∂H_post[j] = G_j · f,  ∂H_res[i, j] = G_j · x_i,  ∂x_i = Σ_j H_res[i, j] G_j.
#include "depthkit/ops/cpu/mhc_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "depthkit/ops/cpu/kernel_math.h"
#include "depthkit/util/error.h"

namespace depthkit::cpu {

namespace {

at::ScalarType wide_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The projection's GEMMs run per fixed block of tokens (kernel_math.h, for_each_gemm_block):
// left to thread one [P, md] × [md, n] product itself, MKL on AMD EPYC split it by the thread
// count and proj and ∂x differed in the last bit between 1, 2 and 3 threads. ∂φ, a sum over
// tokens, is one partial product per block, added in block order.

// Contiguous loops over d, kept out of the AT_DISPATCH lambdas (a pragma can't sit in a macro
// argument). o = a (rounded to storage);  o = c x + w g. (a = w x is kernel_math's set_scaled.)
template <class scalar_t, class acc_t>
void store(scalar_t* o, const acc_t* a, int64_t d) {
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) o[e] = scalar_t(a[e]);
}
template <class acc_t, class scalar_t>
void set_two_scaled(acc_t* o, acc_t c, const scalar_t* x, acc_t w, const scalar_t* g, int64_t d) {
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) o[e] = c * acc_t(x[e]) + w * acc_t(g[e]);
}

// The leading dimensions [*] of a [*, a, b] tensor.
std::vector<int64_t> lead(const at::Tensor& t, int64_t trailing) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - trailing);
}
std::vector<int64_t> with(std::vector<int64_t> s, std::initializer_list<int64_t> tail) {
  s.insert(s.end(), tail);
  return s;
}

// Calls fn with the compile-time m (4 or 2) when it is one of those, else with 0.
template <class Fn>
void with_fixed_m(int64_t m, Fn&& fn) {
  if (m == 4)
    fn(std::integral_constant<int, 4>());
  else if (m == 2)
    fn(std::integral_constant<int, 2>());
  else
    fn(std::integral_constant<int, 0>());
}

// With m fixed at compile time (M > 0), one pass over d computes every output stream at once:
// the M inputs of position e stay in registers instead of M read-modify-write passes.
// out[e] = Σ_i w[i] x_i[e]                                                   (h of eq. 4)
template <int M, class acc_t, class scalar_t>
void mix_streams(scalar_t* out, const acc_t* w, const scalar_t* xs, int64_t d) {
  acc_t wl[M];
  for (int i = 0; i < M; ++i) wl[i] = w[i];
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) {
    acc_t a = 0;
    for (int i = 0; i < M; ++i) a += wl[i] * acc_t(xs[i * d + e]);
    out[e] = scalar_t(a);
  }
}
// out_j[e] = post[j] f[e] + Σ_i H[i, j] x_i[e]                               (eq. 5)
template <int M, class acc_t, class scalar_t>
void merge_streams(scalar_t* out, const acc_t* post, const acc_t* H, const scalar_t* xs, const scalar_t* f, int64_t d) {
  acc_t pl[M], Hl[M * M];
  for (int i = 0; i < M; ++i) pl[i] = post[i];
  for (int k = 0; k < M * M; ++k) Hl[k] = H[k];
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) {
    acc_t xv[M];
    for (int i = 0; i < M; ++i) xv[i] = acc_t(xs[i * d + e]);
    const acc_t fv = acc_t(f[e]);
    for (int j = 0; j < M; ++j) {
      acc_t a = pl[j] * fv;
      for (int i = 0; i < M; ++i) a += Hl[i * M + j] * xv[i];
      out[j * d + e] = scalar_t(a);
    }
  }
}
// The whole backward of one token in one pass over d (eq. 5):
//   df[e] = Σ_j post[j] G_j[e],  dx_i[e] = Σ_j H[i, j] G_j[e],
//   dpost[j] = G_j · f,  dres[i, j] = G_j · x_i.
// The M + M² dot products run side by side, kLanes partial sums each (kernel_math.h), so each of
// G, x and f is loaded once per position instead of once per dot.
template <int M, class acc_t, class scalar_t>
void merge_streams_backward(scalar_t* dx, scalar_t* df, acc_t* dpost, acc_t* dres, const acc_t* post, const acc_t* H,
                            const scalar_t* gs, const scalar_t* xs, const scalar_t* f, int64_t d) {
  acc_t pl[M], Hl[M * M];
  for (int i = 0; i < M; ++i) pl[i] = post[i];
  for (int k = 0; k < M * M; ++k) Hl[k] = H[k];
  acc_t sf[M][kLanes] = {}, sx[M * M][kLanes] = {};
  auto position = [&](int64_t e, int64_t u) {
    acc_t gv[M], xv[M];
    for (int j = 0; j < M; ++j) gv[j] = acc_t(gs[j * d + e]);
    for (int i = 0; i < M; ++i) xv[i] = acc_t(xs[i * d + e]);
    const acc_t fv = acc_t(f[e]);
    acc_t a = 0;
    for (int j = 0; j < M; ++j) {
      a += pl[j] * gv[j];
      sf[j][u] += gv[j] * fv;
    }
    df[e] = scalar_t(a);
    for (int i = 0; i < M; ++i) {
      acc_t b = 0;
      for (int j = 0; j < M; ++j) {
        b += Hl[i * M + j] * gv[j];
        sx[i * M + j][u] += gv[j] * xv[i];
      }
      dx[i * d + e] = scalar_t(b);
    }
  };
  int64_t e0 = 0;
  for (; e0 + kLanes <= d; e0 += kLanes) {
#pragma omp simd
    for (int64_t u = 0; u < kLanes; ++u) position(e0 + u, u);
  }
  for (int64_t e = e0; e < d; ++e) position(e, e - e0);
  for (int j = 0; j < M; ++j) {
    acc_t s = 0;
    for (int64_t u = 0; u < kLanes; ++u) s += sf[j][u];
    dpost[j] = s;
  }
  for (int k = 0; k < M * M; ++k) {
    acc_t s = 0;
    for (int64_t u = 0; u < kLanes; ++u) s += sx[k][u];
    dres[k] = s;
  }
}

void check_streams(const char* op, const at::Tensor& x) {
  if (x.dim() < 2 || x.size(-2) < 1) fail(op, ": expected streams x [*, m, d] with m ≥ 1, got ", x.sizes());
  if (!at::isFloatingType(x.scalar_type()) || x.scalar_type() == at::kHalf)
    fail(op, ": x must be float32, float64 or bfloat16");
}

void check_pre(const at::Tensor& x, const at::Tensor& phi, const at::Tensor& bias, const at::Tensor& scale) {
  check_streams("mhc_pre", x);
  const int64_t m = x.size(-2), d = x.size(-1), n = m * m + 2 * m;
  if (phi.dim() != 2 || phi.size(0) != n || phi.size(1) != m * d)
    fail("mhc_pre: phi must be [m² + 2m, md] = [", n, ", ", m * d, "], got ", phi.sizes());
  if (bias.dim() != 1 || bias.size(0) != n) fail("mhc_pre: bias must be [", n, "], got ", bias.sizes());
  if (scale.dim() != 1 || scale.size(0) != 3) fail("mhc_pre: scale must be [3] (pre, post, res), got ", scale.sizes());
  if (phi.scalar_type() != x.scalar_type()) fail("mhc_pre: x and phi must share a dtype");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Pre-mix

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_pre_forward(const at::Tensor& x_, const at::Tensor& phi,
                                                                           const at::Tensor& bias_,
                                                                           const at::Tensor& scale_, double eps) {
  check_pre(x_, phi, bias_, scale_);
  const int64_t m = x_.size(-2), d = x_.size(-1), n = m * m + 2 * m, md = m * d;
  const auto wide = wide_type(x_.scalar_type());
  const at::Tensor x = x_.contiguous();
  const int64_t P = md == 0 ? 0 : x.numel() / md;
  const at::Tensor X = x.view({P, md});
  // u = x φᵀ [P, n] in the wide type; overwritten in place with z = r u below.
  // (Detached: the blocks run on worker threads, which do not inherit the caller's exclusion of
  // autograd, and an out= product refuses inputs that require grad.)
  at::Tensor proj = at::empty({P, n}, x.options().dtype(wide));
  const at::Tensor X_in = X.detach(), phi_t = phi.detach().to(wide).t();
  for_each_gemm_block(P, [&](int64_t, int64_t p0, int64_t rows) {
    at::Tensor out = proj.narrow(0, p0, rows);
    at::mm_out(out, X_in.narrow(0, p0, rows).to(wide), phi_t);
  });
  const at::Tensor bias = bias_.to(wide).contiguous(), scale = scale_.to(wide).contiguous();
  at::Tensor h = at::empty({P, d}, x.options());
  at::Tensor post = at::empty({P, m}, x.options().dtype(wide));
  at::Tensor res = at::empty({P, m * m}, x.options().dtype(wide));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_pre_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = X.const_data_ptr<scalar_t>();
    const acc_t *bp = bias.const_data_ptr<acc_t>(), *ap = scale.const_data_ptr<acc_t>();
    acc_t *zp = proj.mutable_data_ptr<acc_t>(), *postp = post.mutable_data_ptr<acc_t>(), *resp = res.mutable_data_ptr<acc_t>();
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, P, grain(3 * md + n), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> acc(d), pre(m);
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* xs = xp + p * md;
        const acc_t r = inv_rms<acc_t>(dot<acc_t>(xs, xs, md), md, eps);
        acc_t* z = zp + p * n;
        for (int64_t k = 0; k < n; ++k) z[k] *= r;
        for (int64_t i = 0; i < m; ++i) pre[i] = sigmoid(ap[0] * z[i] + bp[i]);                          // H_pre
        for (int64_t i = 0; i < m; ++i) postp[p * m + i] = 2 * sigmoid(ap[1] * z[m + i] + bp[m + i]);  // H_post
        for (int64_t k = 0; k < m * m; ++k) resp[p * m * m + k] = ap[2] * z[2 * m + k] + bp[2 * m + k];
        // eq. 4: h = Σ_i H_pre[i] x_i
        if (m == 4) {
          mix_streams<4>(hp + p * d, pre.data(), xs, d);
        } else {
          set_scaled(acc.data(), pre[0], xs, d);
          for (int64_t i = 1; i < m; ++i) axpy(acc.data(), pre[i], xs + i * d, d);
          store(hp + p * d, acc.data(), d);
        }
      }
    });
  });
  const auto L = lead(x, 2);
  return {h.view(with(L, {d})), post.view(with(L, {m})), res.view(with(L, {m, m})), proj.view(with(L, {n}))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_pre_backward(
    const OptTensor& grad_h_opt, const OptTensor& grad_post_opt, const OptTensor& grad_res_opt, const at::Tensor& x_,
    const at::Tensor& phi, const at::Tensor& bias_, const at::Tensor& scale_, const at::Tensor& proj_, double eps) {
  const at::Tensor grad_h_ = unwrap(grad_h_opt);
  const at::Tensor grad_post_ = unwrap(grad_post_opt);
  const at::Tensor grad_res_ = unwrap(grad_res_opt);
  check_pre(x_, phi, bias_, scale_);
  const int64_t m = x_.size(-2), d = x_.size(-1), n = m * m + 2 * m, md = m * d;
  const auto wide = wide_type(x_.scalar_type());
  const at::Tensor x = x_.contiguous();
  const int64_t P = md == 0 ? 0 : x.numel() / md;
  const at::Tensor X = x.view({P, md});
  const at::Tensor proj = proj_.to(wide).contiguous().view({P, n});
  const at::Tensor bias = bias_.to(wide).contiguous(), scale = scale_.to(wide).contiguous();
  const at::Tensor gh = grad_h_.defined() ? grad_h_.to(x.scalar_type()).contiguous() : at::Tensor();
  const at::Tensor gpost = grad_post_.defined() ? grad_post_.to(wide).contiguous() : at::Tensor();
  const at::Tensor gres = grad_res_.defined() ? grad_res_.to(wide).contiguous() : at::Tensor();
  const auto wopt = x.options().dtype(wide);
  // ∂b = Σ_p ∂l and ∂α_g = Σ_p Σ_{k∈g} ∂l_k z_k, one partial sum per block of tokens (kernel_math.h):
  // [blocks, n + 3], the n entries of ∂b then the three of ∂α.
  at::Tensor parts = at::zeros({sum_blocks(P), n + 3}, wopt);
  at::Tensor du = at::empty({P, n}, wopt);   // ∂u = r α ∂l
  at::Tensor dx = at::empty({P, md}, wopt);  // H_pre[i] ḡ_h − (r² q / md) x_i, then + ∂u φ
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_pre_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = X.const_data_ptr<scalar_t>();
    const scalar_t* ghp = gh.defined() ? gh.const_data_ptr<scalar_t>() : nullptr;
    const acc_t* gpp = gpost.defined() ? gpost.const_data_ptr<acc_t>() : nullptr;
    const acc_t* grp = gres.defined() ? gres.const_data_ptr<acc_t>() : nullptr;
    const acc_t *zp = proj.const_data_ptr<acc_t>(), *bp = bias.const_data_ptr<acc_t>(), *ap = scale.const_data_ptr<acc_t>();
    acc_t *partp = parts.mutable_data_ptr<acc_t>(), *dup = du.mutable_data_ptr<acc_t>(), *dxp = dx.mutable_data_ptr<acc_t>();
    parallel_for_blocks(P, grain(4 * md + 2 * n), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> pre(m), dl(n);
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* xs = xp + p * md;
        const scalar_t* g = ghp ? ghp + p * d : nullptr;
        const acc_t r = inv_rms<acc_t>(dot<acc_t>(xs, xs, md), md, eps);
        const acc_t* z = zp + p * n;
        acc_t* dlk = dl.data();
        for (int64_t i = 0; i < m; ++i) {
          const acc_t s = sigmoid(ap[0] * z[i] + bp[i]);
          pre[i] = s;
          dlk[i] = g ? dot<acc_t>(g, xs + i * d, d) * s * (1 - s) : acc_t(0);
        }
        for (int64_t i = 0; i < m; ++i) {
          const acc_t s = sigmoid(ap[1] * z[m + i] + bp[m + i]);
          dlk[m + i] = gpp ? gpp[p * m + i] * 2 * s * (1 - s) : acc_t(0);
        }
        for (int64_t k = 0; k < m * m; ++k) dlk[2 * m + k] = grp ? grp[p * m * m + k] : acc_t(0);
        acc_t q = 0;
        acc_t* duk = dup + p * n;
        acc_t* part = partp + sum_block(p) * (n + 3);
        for (int64_t k = 0; k < n; ++k) {
          const int64_t group = k < m ? 0 : k < 2 * m ? 1 : 2;
          const acc_t a = ap[group];
          q += a * dlk[k] * z[k];
          duk[k] = r * a * dlk[k];
          part[k] += dlk[k];                    // ∂b
          part[n + group] += dlk[k] * z[k];     // ∂α
        }
        const acc_t c = -q * r * r / acc_t(md);
        for (int64_t i = 0; i < m; ++i) {
          if (g)
            set_two_scaled(dxp + p * md + i * d, c, xs + i * d, pre[i], g, d);
          else
            set_scaled(dxp + p * md + i * d, c, xs + i * d, d);
        }
      }
    });
  });
  // The two GEMMs of the projection's backward: ∂x += ∂u φ, ∂φ = ∂uᵀ x.
  const at::Tensor phi_w = phi.detach().to(wide), X_in = X.detach();  // (detached: as in the forward)
  at::Tensor dphi_parts = at::empty({gemm_blocks(P).count, n, md}, wopt);
  for_each_gemm_block(P, [&](int64_t block, int64_t p0, int64_t rows) {
    const at::Tensor du_b = du.narrow(0, p0, rows);
    dx.narrow(0, p0, rows).addmm_(du_b, phi_w);
    at::Tensor part = dphi_parts.select(0, block);
    at::mm_out(part, du_b.t(), X_in.narrow(0, p0, rows).to(wide));
  });
  at::Tensor dphi = dphi_parts.sum(0);
  const at::Tensor sums = parts.sum(0);
  at::Tensor dbias = sums.narrow(0, 0, n), dscale = sums.narrow(0, n, 3);
  return {dx.to(x.scalar_type()).view(x_.sizes()), dphi.to(phi.scalar_type()), dbias.to(bias_.scalar_type()),
          dscale.to(scale_.scalar_type())};
}

// ---------------------------------------------------------------------------------------------
// Sinkhorn–Knopp

namespace {

void check_square(const char* op, const at::Tensor& t) {
  if (t.dim() < 2 || t.size(-1) != t.size(-2) || t.size(-1) < 1) fail(op, ": expected logits [*, m, m], got ", t.sizes());
  if (!at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kHalf)
    fail(op, ": logits must be float32, float64 or bfloat16");
}

// Sinkhorn–Knopp works on tiny matrices (m² = 16 entries) with 2·iters dependent steps, each a few
// sums and one reciprocal per row or column: per token it is a chain of scalar divisions. So kLanes
// tokens run side by side, one per SIMD lane (kernel_math.h's kLanes = 16): every buffer is
// [entry][lane] and every loop over lanes vectorises, the divisions included. A group's lanes past
// the last token repeat it.

// Loads the [m²] matrices of tokens p0 … p0 + w − 1 from src [P, m²] into dst [m²][kLanes].
template <class acc_t>
void load_lanes(const acc_t* src, acc_t* dst, int64_t mm, int64_t w) {
  for (int64_t v = 0; v < kLanes; ++v) {
    const acc_t* row = src + std::min(v, w - 1) * mm;
    for (int64_t k = 0; k < mm; ++k) dst[k * kLanes + v] = row[k];
  }
}

// The first w lanes of src [m²][kLanes] to dst [w, m²].
template <class acc_t>
void store_lanes(const acc_t* src, acc_t* dst, int64_t mm, int64_t w) {
  for (int64_t v = 0; v < w; ++v)
    for (int64_t k = 0; k < mm; ++k) dst[v * mm + k] = src[k * kLanes + v];
}

// Sinkhorn–Knopp of kLanes tokens, logits l [m²][kLanes]. M > 0 fixes m at compile time (m = 4 is
// the common case), M = 0 reads it from m_rt. P⁰ = exp(L − max L) goes to q[0 … m²); with keep,
// every step's result follows it in q (2·iters matrices) and its reciprocal sums go to inv
// (2·iters·m rows of kLanes) for the backward; otherwise q is updated in place and inv is m rows.
template <int M, class acc_t>
void sinkhorn_lanes(const acc_t* l, acc_t* q, acc_t* inv, int64_t m_rt, int64_t iters, bool keep) {
  const int64_t m = M > 0 ? M : m_rt, mm = m * m;
  alignas(64) acc_t mx[kLanes];
  for (int64_t v = 0; v < kLanes; ++v) mx[v] = l[v];
  for (int64_t k = 1; k < mm; ++k)
#pragma omp simd
    for (int64_t v = 0; v < kLanes; ++v) mx[v] = std::max(mx[v], l[k * kLanes + v]);
  for (int64_t k = 0; k < mm; ++k)
    for (int64_t v = 0; v < kLanes; ++v) q[k * kLanes + v] = std::exp(l[k * kLanes + v] - mx[v]);
  acc_t* cur = q;
  for (int64_t t = 0; t < iters; ++t) {
    for (int half = 0; half < 2; ++half) {  // rows (P ← P / s), then columns (P ← P / c)
      acc_t* nxt = keep ? cur + mm * kLanes : cur;
      acc_t* sums = keep ? inv + (2 * t + half) * m * kLanes : inv;
      for (int64_t a = 0; a < m; ++a) {  // row a, or column a
        acc_t* s = sums + a * kLanes;
        const int64_t first = half == 0 ? a * m : a, stride = half == 0 ? 1 : m;
#pragma omp simd
        for (int64_t v = 0; v < kLanes; ++v) s[v] = cur[first * kLanes + v];
        for (int64_t b = 1; b < m; ++b) {
          const acc_t* e = cur + (first + b * stride) * kLanes;
#pragma omp simd
          for (int64_t v = 0; v < kLanes; ++v) s[v] += e[v];
        }
#pragma omp simd
        for (int64_t v = 0; v < kLanes; ++v) s[v] = acc_t(1) / s[v];
        for (int64_t b = 0; b < m; ++b) {
          const int64_t k = (first + b * stride) * kLanes;
#pragma omp simd
          for (int64_t v = 0; v < kLanes; ++v) nxt[k + v] = cur[k + v] * s[v];
        }
      }
      cur = nxt;
    }
  }
}

// The backward of kLanes tokens: recompute into q / inv, then walk the steps back from g = ∂H_res
// [m²][kLanes] (overwritten with ∂L).
template <int M, class acc_t>
void sinkhorn_lanes_backward(const acc_t* l, acc_t* g, acc_t* q, acc_t* inv, int64_t m_rt, int64_t iters) {
  const int64_t m = M > 0 ? M : m_rt, mm = m * m;
  sinkhorn_lanes<M>(l, q, inv, m, iters, true);
  alignas(64) acc_t dot[kLanes];
  for (int64_t step = 2 * iters - 1; step >= 0; --step) {
    const acc_t* out = q + (step + 1) * mm * kLanes;  // the matrix this step produced
    const bool columns = step % 2 == 1;
    // row step Q_ij = P_ij / s_i:     ∂P_ij = (∂Q_ij − Σ_k ∂Q_ik Q_ik) / s_i
    // column step Q_ij = P_ij / c_j:  ∂P_ij = (∂Q_ij − Σ_k ∂Q_kj Q_kj) / c_j
    for (int64_t a = 0; a < m; ++a) {
      const acc_t* s = inv + (step * m + a) * kLanes;
      const int64_t first = columns ? a : a * m, stride = columns ? m : 1;
#pragma omp simd
      for (int64_t v = 0; v < kLanes; ++v) dot[v] = 0;
      for (int64_t b = 0; b < m; ++b) {
        const int64_t k = (first + b * stride) * kLanes;
#pragma omp simd
        for (int64_t v = 0; v < kLanes; ++v) dot[v] += g[k + v] * out[k + v];
      }
      for (int64_t b = 0; b < m; ++b) {
        const int64_t k = (first + b * stride) * kLanes;
#pragma omp simd
        for (int64_t v = 0; v < kLanes; ++v) g[k + v] = (g[k + v] - dot[v]) * s[v];
      }
    }
  }
#pragma omp simd
  for (int64_t k = 0; k < mm * kLanes; ++k) g[k] *= q[k];  // ∂L = ∂P⁰ ⊙ P⁰
}

}  // namespace

at::Tensor mhc_sinkhorn_forward(const at::Tensor& logits, int64_t iters) {
  check_square("mhc_sinkhorn", logits);
  if (iters < 0) fail("mhc_sinkhorn: iters must be ≥ 0, got ", iters);
  const int64_t m = logits.size(-1), mm = m * m;
  const at::Tensor L = logits.to(wide_type(logits.scalar_type())).contiguous();
  const int64_t P = L.numel() / mm;
  at::Tensor H = at::empty_like(L);
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "mhc_sinkhorn_forward", [&] {
    const scalar_t* lp = L.const_data_ptr<scalar_t>();
    scalar_t* hp = H.mutable_data_ptr<scalar_t>();
    with_fixed_m(m, [&](auto M) {
      const int64_t groups = (P + kLanes - 1) / kLanes;
      at::parallel_for(0, groups, std::max<int64_t>(1, grain(2 * iters * mm + mm) / kLanes), [&](int64_t g0, int64_t g1) {
        std::vector<scalar_t> l(mm * kLanes), q(mm * kLanes), inv(m * kLanes);
        for (int64_t group = g0; group < g1; ++group) {
          const int64_t p = group * kLanes, w = std::min(kLanes, P - p);
          load_lanes(lp + p * mm, l.data(), mm, w);
          sinkhorn_lanes<decltype(M)::value>(l.data(), q.data(), inv.data(), m, iters, false);
          store_lanes(q.data(), hp + p * mm, mm, w);
        }
      });
    });
  });
  return H;
}

at::Tensor mhc_sinkhorn_backward(const at::Tensor& grad, const at::Tensor& logits, int64_t iters) {
  check_square("mhc_sinkhorn_backward", logits);
  const int64_t m = logits.size(-1), mm = m * m;
  const auto wide = wide_type(logits.scalar_type());
  const at::Tensor L = logits.to(wide).contiguous(), G = grad.to(wide).contiguous();
  if (G.sizes() != L.sizes()) fail("mhc_sinkhorn_backward: grad ", grad.sizes(), " and logits ", logits.sizes(), " differ");
  const int64_t P = L.numel() / mm;
  at::Tensor dL = at::empty_like(L);
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "mhc_sinkhorn_backward", [&] {
    const scalar_t *lp = L.const_data_ptr<scalar_t>(), *gp = G.const_data_ptr<scalar_t>();
    scalar_t* dp = dL.mutable_data_ptr<scalar_t>();
    with_fixed_m(m, [&](auto M) {
      const int64_t groups = (P + kLanes - 1) / kLanes;
      at::parallel_for(0, groups, std::max<int64_t>(1, grain(5 * iters * mm + mm) / kLanes), [&](int64_t g0, int64_t g1) {
        std::vector<scalar_t> l(mm * kLanes), g(mm * kLanes), q((2 * iters + 1) * mm * kLanes),
            inv(std::max<int64_t>(2 * iters, 1) * m * kLanes);
        for (int64_t group = g0; group < g1; ++group) {
          const int64_t p = group * kLanes, w = std::min(kLanes, P - p);
          load_lanes(lp + p * mm, l.data(), mm, w);
          load_lanes(gp + p * mm, g.data(), mm, w);
          sinkhorn_lanes_backward<decltype(M)::value>(l.data(), g.data(), q.data(), inv.data(), m, iters);
          store_lanes(g.data(), dp + p * mm, mm, w);
        }
      });
    });
  });
  return dL.to(logits.scalar_type());
}

// ---------------------------------------------------------------------------------------------
// Post + res merge

namespace {

void check_merge(const at::Tensor& x, const at::Tensor& f, const at::Tensor& h_post, const at::Tensor& h_res) {
  check_streams("mhc_merge", x);
  const int64_t m = x.size(-2), d = x.size(-1);
  const auto L = lead(x, 2);
  const auto f_shape = with(L, {d}), post_shape = with(L, {m}), res_shape = with(L, {m, m});
  if (f.sizes() != at::IntArrayRef(f_shape)) fail("mhc_merge: f must be ", at::IntArrayRef(f_shape), ", got ", f.sizes());
  if (h_post.sizes() != at::IntArrayRef(post_shape))
    fail("mhc_merge: h_post must be ", at::IntArrayRef(post_shape), ", got ", h_post.sizes());
  if (h_res.sizes() != at::IntArrayRef(res_shape))
    fail("mhc_merge: h_res must be ", at::IntArrayRef(res_shape), ", got ", h_res.sizes());
  if (f.scalar_type() != x.scalar_type()) fail("mhc_merge: x and f must share a dtype");
}

}  // namespace

at::Tensor mhc_merge_forward(const at::Tensor& x_, const at::Tensor& f_, const at::Tensor& h_post,
                             const at::Tensor& h_res) {
  check_merge(x_, f_, h_post, h_res);
  const int64_t m = x_.size(-2), d = x_.size(-1), md = m * d;
  const auto wide = wide_type(x_.scalar_type());
  const at::Tensor x = x_.contiguous(), f = f_.contiguous();
  const at::Tensor post = h_post.to(wide).contiguous(), res = h_res.to(wide).contiguous();
  const int64_t P = md == 0 ? 0 : x.numel() / md;
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_merge_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *fp = f.const_data_ptr<scalar_t>();
    const acc_t *pp = post.const_data_ptr<acc_t>(), *rp = res.const_data_ptr<acc_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, P, grain((m + 1) * md), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> acc(d);
      acc_t* a = acc.data();
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* fs = fp + p * d;
        const scalar_t* xs = xp + p * md;
        const acc_t* H = rp + p * m * m;
        if (m == 4) {
          merge_streams<4>(op + p * md, pp + p * m, H, xs, fs, d);
          continue;
        }
        for (int64_t j = 0; j < m; ++j) {
          set_scaled(a, pp[p * m + j], fs, d);
          for (int64_t i = 0; i < m; ++i) axpy(a, H[i * m + j], xs + i * d, d);
          store(op + p * md + j * d, a, d);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mhc_merge_backward(const at::Tensor& grad_,
                                                                              const at::Tensor& x_, const at::Tensor& f_,
                                                                              const at::Tensor& h_post,
                                                                              const at::Tensor& h_res) {
  check_merge(x_, f_, h_post, h_res);
  const int64_t m = x_.size(-2), d = x_.size(-1), md = m * d;
  const auto wide = wide_type(x_.scalar_type());
  const at::Tensor x = x_.contiguous(), f = f_.contiguous(), G = grad_.to(x.scalar_type()).contiguous();
  if (G.sizes() != x.sizes()) fail("mhc_merge_backward: grad ", grad_.sizes(), " and x ", x.sizes(), " differ");
  const at::Tensor post = h_post.to(wide).contiguous(), res = h_res.to(wide).contiguous();
  const int64_t P = md == 0 ? 0 : x.numel() / md;
  at::Tensor dx = at::empty(x.sizes(), x.options()), df = at::empty(f.sizes(), f.options());
  at::Tensor dpost = at::empty(post.sizes(), post.options()), dres = at::empty(res.sizes(), res.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_merge_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *fp = f.const_data_ptr<scalar_t>(), *gp = G.const_data_ptr<scalar_t>();
    const acc_t *pp = post.const_data_ptr<acc_t>(), *rp = res.const_data_ptr<acc_t>();
    scalar_t *dxp = dx.mutable_data_ptr<scalar_t>(), *dfp = df.mutable_data_ptr<scalar_t>();
    acc_t *dpp = dpost.mutable_data_ptr<acc_t>(), *drp = dres.mutable_data_ptr<acc_t>();
    at::parallel_for(0, P, grain((3 * m + 2) * md), [&](int64_t p0, int64_t p1) {
      std::vector<acc_t> acc(d);
      acc_t* a = acc.data();
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* fs = fp + p * d;
        const scalar_t* xs = xp + p * md;
        const scalar_t* gs = gp + p * md;
        const acc_t* H = rp + p * m * m;
        const acc_t* hp = pp + p * m;
        if (m == 4) {
          merge_streams_backward<4>(dxp + p * md, dfp + p * d, dpp + p * 4, drp + p * 16, hp, H, gs, xs, fs, d);
          continue;
        }
        // ∂H_post[j] = G_j · f, ∂H_res[i, j] = G_j · x_i
        for (int64_t j = 0; j < m; ++j) {
          dpp[p * m + j] = dot<acc_t>(gs + j * d, fs, d);
          for (int64_t i = 0; i < m; ++i) drp[p * m * m + i * m + j] = dot<acc_t>(gs + j * d, xs + i * d, d);
        }
        // ∂f = Σ_j H_post[j] G_j
        set_scaled(a, hp[0], gs, d);
        for (int64_t j = 1; j < m; ++j) axpy(a, hp[j], gs + j * d, d);
        store(dfp + p * d, a, d);
        // ∂x_i = Σ_j H_res[i, j] G_j
        for (int64_t i = 0; i < m; ++i) {
          set_scaled(a, H[i * m], gs, d);
          for (int64_t j = 1; j < m; ++j) axpy(a, H[i * m + j], gs + j * d, d);
          store(dxp + p * md + i * d, a, d);
        }
      }
    });
  });
  return {dx.view(x_.sizes()), df.view(f_.sizes()), dpost.to(h_post.scalar_type()), dres.to(h_res.scalar_type())};
}

}  // namespace depthkit::cpu
