// CPU kernels of the backbone's fused operators: what torch.compile would fuse of the Transformer
// around the pathway (issue 18), each one pass over its tensors per direction. Rows (tokens) run
// in parallel; loops over features are plain and auto-vectorised; accumulation in float32
// (float64 for float64); bfloat16 storage is accepted.
//
// RMSNorm with weight, per row x of d features: r = 1/√(mean x² + ε), y = (x r) ⊙ w. Backward,
// with u = ∂y ⊙ w:  ∂x = r u − x r³ (u · x) / d,  ∂w = Σ_rows ∂y ⊙ x r (in blocks of rows,
// kernel_math.h, so the sum does not depend on the thread count). Only r is stored.
//
// RoPE (rotate-half pairing, RoFormer eq. 34 with dimension i paired with i + hd/2), read from the
// fused q/k/v projection: for each head of q and k, (x₁, x₂) → (x₁ c − x₂ s, x₁ s + x₂ c) with
// c, s the tables at the row's position; v is copied out, so that its gradient lands in the same
// buffer. The backward is the inverse rotation (c, −s), written straight into ∂qkv.
//
// SwiGLU's activation (Shazeer 2020): out = silu(g) ⊙ u with σ = sigmoid(g), silu(g) = g σ.
// Backward: ∂u = ∂out g σ,  ∂g = ∂out u σ (1 + g (1 − σ)).
//
// Cross-entropy of a chunk of logit rows z (the LM head's output, linear_cross_entropy): per row,
// m = max z, S = Σ e^(z − m), loss = m + log S − z[target], in two passes; with the gradient, the
// first pass leaves e^(z − m) in the row and the second scales it by 1/S and subtracts 1 at the
// target, softmax − onehot, in place. (The float32 exponential clamps its argument at −87: a
// logit 87 below the row's max counts e^−87 instead of less, 1e−38 of the sum.)
//
// (The vectorising pragmas inside the dtype dispatch are written _Pragma(...): a #pragma line
// cannot stand in AT_DISPATCH's macro argument.)
#include "depthkit/ops/cpu/backbone_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "depthkit/ops/cpu/kernel_math.h"
#include "depthkit/util/error.h"

namespace depthkit::cpu {

namespace {

// e^x in float32, written so that `omp simd` loops vectorise it (std::exp is a scalar call): e^x =
// 2ⁿ e^r with n = round(x log₂e) (by the 1.5·2²³ rounding trick) and r = x − n ln 2 in two parts
// (Cody–Waite), |r| ≤ ln 2 / 2, e^r by the Cephes expf polynomial (within 2 ulp over the range).
// x is clamped to [−87, 88], where 2ⁿ is a normal float (the sigmoid and the cross-entropy's
// exponentials of logits minus their max use it, for which that range is exact enough); a NaN
// input gives NaN through the polynomial.
inline float exp_vectorisable(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  return er * std::bit_cast<float>((int32_t(n) + 127) << 23);
}
inline double exp_vectorisable(double x) { return std::exp(x); }

template <class acc_t>
inline acc_t sigmoid_vectorisable(acc_t x) {
  return acc_t(1) / (acc_t(1) + exp_vectorisable(-x));
}

// Rows of a tensor whose last dimension is the features (at least one).
int64_t rows_of(const at::Tensor& t, const char* op) {
  if (t.dim() < 1 || t.size(-1) == 0) fail(op, ": the last dimension of ", t.sizes(), " is empty");
  return t.numel() / t.size(-1);
}

void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t hd, int64_t offset) {
  if (cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat || !cos.is_contiguous() || !sin.is_contiguous())
    fail("rope_qkv: the cos and sin tables must be contiguous float32");
  if (cos.dim() != 2 || cos.sizes() != sin.sizes() || cos.size(1) * 2 != hd)
    fail("rope_qkv: tables ", cos.sizes(), " do not match head_dim ", hd);
  if (offset < 0 || offset + T > cos.size(0))
    fail("rope_qkv: positions ", offset, " … ", offset + T - 1, " exceed the tables' ", cos.size(0));
}

// One head's rotation: dst = R(c, sign·s) src over hd = 2·half features (sign −1: the inverse).
template <class acc_t, class D, class S>
inline void rotate(D* dst, const S* src, const float* c, const float* s, int64_t half, acc_t sign) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const acc_t x1 = acc_t(src[i]), x2 = acc_t(src[i + half]);
    const acc_t ci = acc_t(c[i]), si = sign * acc_t(s[i]);
    dst[i] = D(x1 * ci - x2 * si);
    dst[i + half] = D(x1 * si + x2 * ci);
  }
}

}  // namespace

// ---- RMSNorm ----------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  if (weight_in.dim() != 1 || x_in.size(-1) != weight_in.size(0))
    fail("rms_norm: weight ", weight_in.sizes(), " does not match input ", x_in.sizes());
  if (x_in.scalar_type() != weight_in.scalar_type()) fail("rms_norm: input and weight must share a dtype");
  const at::Tensor x = x_in.contiguous(), w = weight_in.contiguous();
  const int64_t d = x.size(-1), N = rows_of(x, "rms_norm");
  at::Tensor y = at::empty_like(x);
  at::Tensor inv = at::empty({N}, x.options().dtype(acc_type_of(x)));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    acc_t* ip = inv.data_ptr<acc_t>();
    at::parallel_for(0, N, grain(d), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* xr = xp + p * d;
        const acc_t r = inv_rms<acc_t>(dot<acc_t>(xr, xr, d), d, eps);
        ip[p] = r;
        scalar_t* yr = yp + p * d;
        _Pragma("omp simd")
        for (int64_t i = 0; i < d; ++i) yr[i] = scalar_t(acc_t(xr[i]) * r * acc_t(wp[i]));
      }
    });
  });
  return {y, inv};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                     const at::Tensor& weight_in, const at::Tensor& inv_in) {
  const at::Tensor g = grad_in.contiguous(), x = x_in.contiguous(), w = weight_in.contiguous();
  const at::Tensor inv = inv_in.contiguous();
  if (g.sizes() != x.sizes()) fail("rms_norm_backward: gradient ", g.sizes(), " does not match input ", x.sizes());
  const int64_t d = x.size(-1), N = rows_of(x, "rms_norm_backward");
  at::Tensor gx = at::empty_like(x);
  at::Tensor partial = at::zeros({sum_blocks(N), d}, x.options().dtype(acc_type_of(x)));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const acc_t* ip = inv.data_ptr<acc_t>();
    scalar_t* gxp = gx.data_ptr<scalar_t>();
    acc_t* pp = partial.data_ptr<acc_t>();
    parallel_for_blocks(N, grain(3 * d), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* xr = xp + p * d;
        const scalar_t* gr = gp + p * d;
        const acc_t r = ip[p];
        acc_t ux = 0;  // (∂y ⊙ w) · x
        _Pragma("omp simd reduction(+ : ux)")
        for (int64_t i = 0; i < d; ++i) ux += acc_t(gr[i]) * acc_t(wp[i]) * acc_t(xr[i]);
        const acc_t c = r * r * r * ux / acc_t(d);
        scalar_t* gxr = gxp + p * d;
        acc_t* gw = pp + sum_block(p) * d;
        _Pragma("omp simd")
        for (int64_t i = 0; i < d; ++i) {
          const acc_t xi = acc_t(xr[i]), gi = acc_t(gr[i]);
          gxr[i] = scalar_t(r * gi * acc_t(wp[i]) - xi * c);
          gw[i] += gi * xi * r;
        }
      }
    });
  });
  return {gx, partial.sum(0).to(w.scalar_type())};
}

// ---- RoPE on the fused q/k/v projection -------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_forward(const at::Tensor& qkv_in, const at::Tensor& cos,
                                                                const at::Tensor& sin, int64_t H, int64_t KV,
                                                                int64_t offset) {
  if (qkv_in.dim() != 3 || H < 1 || KV < 1 || qkv_in.size(2) % (H + 2 * KV) != 0)
    fail("rope_qkv: expected qkv [B, T, (H + 2 KV) · head_dim], got ", qkv_in.sizes(), " for H = ", H, ", KV = ", KV);
  const at::Tensor qkv = qkv_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2), hd = C / (H + 2 * KV), half = hd / 2;
  if (hd % 2 != 0) fail("rope_qkv: head_dim ", hd, " is odd");
  check_rope(cos, sin, T, hd, offset);
  at::Tensor q = at::empty({B, T, H, hd}, qkv.options());
  at::Tensor k = at::empty({B, T, KV, hd}, qkv.options());
  at::Tensor v = at::empty({B, T, KV, hd}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_qkv", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    at::parallel_for(0, B * T, grain(C), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t pos = p % T + offset;
        const float *c = cp + pos * half, *s = sp + pos * half;
        const scalar_t* row = src + p * C;
        for (int64_t h = 0; h < H; ++h) rotate<acc_t>(qp + (p * H + h) * hd, row + h * hd, c, s, half, acc_t(1));
        for (int64_t h = 0; h < KV; ++h)
          rotate<acc_t>(kp + (p * KV + h) * hd, row + (H + h) * hd, c, s, half, acc_t(1));
        std::copy(row + (H + KV) * hd, row + C, vp + p * KV * hd);
      }
    });
  });
  return {q, k, v};
}

at::Tensor rope_qkv_backward(const OptTensor& grad_q, const OptTensor& grad_k, const OptTensor& grad_v,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KV, int64_t offset) {
  const at::Tensor* any = grad_q ? &*grad_q : grad_k ? &*grad_k : grad_v ? &*grad_v : nullptr;
  if (!any) fail("rope_qkv_backward: no gradient given");
  const int64_t B = any->size(0), T = any->size(1), hd = any->size(3), half = hd / 2, C = (H + 2 * KV) * hd;
  check_rope(cos, sin, T, hd, offset);
  auto part = [&](const OptTensor& g, int64_t heads) {
    if (!g) return at::Tensor();
    if (g->sizes() != at::IntArrayRef{B, T, heads, hd}) fail("rope_qkv_backward: gradient of shape ", g->sizes());
    return g->contiguous();
  };
  const at::Tensor gq = part(grad_q, H), gk = part(grad_k, KV), gv = part(grad_v, KV);
  at::Tensor out = at::empty({B, T, C}, any->options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "rope_qkv_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gqp = gq.defined() ? gq.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gkp = gk.defined() ? gk.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gvp = gv.defined() ? gv.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    at::parallel_for(0, B * T, grain(C), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t pos = p % T + offset;
        const float *c = cp + pos * half, *s = sp + pos * half;
        scalar_t* row = op + p * C;
        if (gqp)
          for (int64_t h = 0; h < H; ++h) rotate<acc_t>(row + h * hd, gqp + (p * H + h) * hd, c, s, half, acc_t(-1));
        else
          std::fill(row, row + H * hd, scalar_t(0));
        if (gkp)
          for (int64_t h = 0; h < KV; ++h)
            rotate<acc_t>(row + (H + h) * hd, gkp + (p * KV + h) * hd, c, s, half, acc_t(-1));
        else
          std::fill(row + H * hd, row + (H + KV) * hd, scalar_t(0));
        if (gvp)
          std::copy(gvp + p * KV * hd, gvp + (p + 1) * KV * hd, row + (H + KV) * hd);
        else
          std::fill(row + (H + KV) * hd, row + C, scalar_t(0));
      }
    });
  });
  return out;
}

// ---- SwiGLU -------------------------------------------------------------------------------------

at::Tensor swiglu_forward(const at::Tensor& gu_in) {
  if (gu_in.dim() < 1 || gu_in.size(-1) % 2 != 0) fail("swiglu: expected gate_up [..., 2F], got ", gu_in.sizes());
  const at::Tensor gu = gu_in.contiguous();
  const int64_t F = gu.size(-1) / 2, N = rows_of(gu, "swiglu");
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = F;
  at::Tensor out = at::empty(shape, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "swiglu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = gu.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain(4 * F), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t *gate = src + p * 2 * F, *up = gate + F;
        scalar_t* o = dst + p * F;
        _Pragma("omp simd")
        for (int64_t i = 0; i < F; ++i) {
          const acc_t g = acc_t(gate[i]);
          o[i] = scalar_t(g * sigmoid_vectorisable(g) * acc_t(up[i]));
        }
      }
    });
  });
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& grad_in, const at::Tensor& gu_in) {
  const at::Tensor g_out = grad_in.contiguous(), gu = gu_in.contiguous();
  const int64_t F = gu.size(-1) / 2, N = rows_of(gu, "swiglu_backward");
  if (g_out.numel() != N * F) fail("swiglu_backward: gradient ", g_out.sizes(), " does not match ", gu.sizes());
  at::Tensor out = at::empty_like(gu);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "swiglu_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = gu.data_ptr<scalar_t>();
    const scalar_t* gp = g_out.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain(6 * F), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t *gate = src + p * 2 * F, *up = gate + F, *go = gp + p * F;
        scalar_t *d_gate = dst + p * 2 * F, *d_up = d_gate + F;
        _Pragma("omp simd")
        for (int64_t i = 0; i < F; ++i) {
          const acc_t g = acc_t(gate[i]), u = acc_t(up[i]), o = acc_t(go[i]);
          const acc_t s = sigmoid_vectorisable(g);
          d_up[i] = scalar_t(o * g * s);
          d_gate[i] = scalar_t(o * u * s * (acc_t(1) + g * (acc_t(1) - s)));
        }
      }
    });
  });
  return out;
}

double cross_entropy_rows(const at::Tensor& z, const at::Tensor& targets, bool gradient) {
  if (z.dim() != 2 || !z.is_contiguous() || targets.dim() != 1 || targets.size(0) != z.size(0) ||
      targets.scalar_type() != at::kLong)
    fail("cross_entropy_rows: expected contiguous logits [n, V] and int64 targets [n], got ", z.sizes(), " and ",
         targets.sizes());
  const int64_t n = z.size(0), V = z.size(1);
  const at::Tensor t = targets.contiguous();
  std::vector<double> loss(n);  // per row, summed in order below: independent of the thread count
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "cross_entropy_rows", [&] {
    scalar_t* zp = z.mutable_data_ptr<scalar_t>();
    const int64_t* tp = t.const_data_ptr<int64_t>();
    at::parallel_for(0, n, grain(4 * V), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = zp + r * V;
        const scalar_t target_logit = row[tp[r]];
        scalar_t mx = row[0];
        _Pragma("omp simd reduction(max : mx)")
        for (int64_t i = 0; i < V; ++i) mx = row[i] > mx ? row[i] : mx;
        scalar_t sum = 0;
        if (gradient) {
          _Pragma("omp simd reduction(+ : sum)")
          for (int64_t i = 0; i < V; ++i) {
            const scalar_t e = exp_vectorisable(row[i] - mx);
            row[i] = e;
            sum += e;
          }
          const scalar_t inv = scalar_t(1) / sum;
          _Pragma("omp simd")
          for (int64_t i = 0; i < V; ++i) row[i] *= inv;
          row[tp[r]] -= scalar_t(1);
        } else {
          _Pragma("omp simd reduction(+ : sum)")
          for (int64_t i = 0; i < V; ++i) sum += exp_vectorisable(row[i] - mx);
        }
        loss[r] = double(mx) + std::log(double(sum)) - double(target_logit);
      }
    });
  });
  double total = 0;
  for (double l : loss) total += l;
  return total;
}

// MKL (LibTorch's BLAS on x86) chooses a product's code path, and with it the order of its sums,
// by more than the shapes: on an Intel Xeon the same blocks of rows gave linear_cross_entropy's
// ∂hidden and ∂weight up to 4e-8 apart on 1 and on 2 intra-op threads (the loss equal), where on
// AMD EPYC they were equal. MKL's strict conditional-reproducibility mode (MKL_CBWR=AUTO,STRICT)
// makes them equal, and timed no slower on the 0.1B width's projections (2,048 × 640 × 2,560
// three ways, 2 threads: 66–79 ms a round either way). MKL reads the variable at its first call,
// so the library sets it as it loads, unless it is set already (a user's choice stands). From
// Python, `import depthkit` before the first matrix product for it to apply.
namespace {
const bool kStrictBlas = [] { return setenv("MKL_CBWR", "AUTO,STRICT", /*overwrite=*/0) == 0; }();
}  // namespace

void addmm_in_row_blocks(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double beta, double alpha) {
  if (out.dim() != 2 || a.dim() != 2 || b.dim() != 2 || a.size(0) != out.size(0) || b.size(1) != out.size(1) ||
      a.size(1) != b.size(0))
    fail("addmm_in_row_blocks: expected out [r, c] = a [r, k] b [k, c], got ", out.sizes(), ", ", a.sizes(), " and ",
         b.sizes());
  // Detached: the blocks run on worker threads, which do not inherit the caller's exclusion of
  // autograd, and an out= product refuses inputs that require grad.
  const at::Tensor a_in = a.detach(), b_in = b.detach(), out_in = out.detach();
  for_each_gemm_block(out.size(0), [&](int64_t, int64_t r0, int64_t rows) {
    at::Tensor o = out_in.narrow(0, r0, rows);
    at::addmm_out(o, o, a_in.narrow(0, r0, rows), b_in, beta, alpha);
  });
}

}  // namespace depthkit::cpu
