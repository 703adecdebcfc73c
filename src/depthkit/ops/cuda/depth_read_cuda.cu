// CUDA kernels of the fused depth read (DAR eq. A.1–A.5) and online-softmax merge (A.6–A.10),
// registered on the same torch operators as the CPU kernels (ops/schema.cpp): the algorithms are
// those of ops/cpu/depth_read_cpu.cpp, which says them in full.
//
// Layout: queries q [M, d]; raw keys k and values v [N, P, d] (N sources, P = batch·tokens);
// out [M, P, d]; ζ [M, P]. One warp per token (per target and token in the forward): the lanes
// stride over d, so each row is read with coalesced loads, and reductions over d are warp
// shuffles. The N logits of a token live in shared memory; accumulation is in float32 (float64 for
// float64 inputs), storage float32, bfloat16 or float64. The query's gradient is a sum over
// tokens: each token writes its share to a [P, M, d] buffer that one ATen sum reduces
// (deterministic, no atomics).
#include <ATen/Dispatch.h>
#include <ATen/ops/stack.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "depthkit/util/error.h"

namespace depthkit::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class acc_t>
__device__ __forceinline__ acc_t inv_rms(acc_t sum_sq, int64_t d, double eps) {
  return acc_t(1) / sqrt(sum_sq / acc_t(d) + acc_t(eps));
}

// (k · k, q · k) over d, each lane taking every 32nd element, summed across the warp.
template <class acc_t, class scalar_t>
__device__ __forceinline__ void square_and_dot(const scalar_t* k, const scalar_t* q, int64_t d, int lane, acc_t& kk,
                                               acc_t& qk) {
  kk = 0;
  qk = 0;
  for (int64_t i = lane; i < d; i += kWarp) {
    const acc_t x = acc_t(k[i]);
    kk += x * x;
    qk += acc_t(q[i]) * x;
  }
  kk = warp_sum(kk);
  qk = warp_sum(qk);
}

// Forward. Grid: (⌈P / warps⌉, M) blocks of kWarpsPerBlock warps; warp w of block (b, m) reads
// token p = b·warps + w for target m. Shared: N logits per warp.
//   a_r = s_r (q_m · k_r) (A.1), out = Σ_r e^{a_r − max} v_r / Z (A.2–A.5), ζ = max + log Z.
template <class scalar_t, class acc_t>
__global__ void depth_read_forward_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                          const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                                          acc_t* __restrict__ lse, int64_t N, int64_t P, int64_t d, double eps) {
  extern __shared__ unsigned char shared_bytes[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = int64_t(blockIdx.x) * kWarpsPerBlock + warp, m = blockIdx.y;
  if (p >= P) return;
  acc_t* a = reinterpret_cast<acc_t*>(shared_bytes) + warp * N;  // [N] logits of this token
  const scalar_t* qm = q + m * d;
  for (int64_t r = 0; r < N; ++r) {
    acc_t kk, qk;
    square_and_dot(k + (r * P + p) * d, qm, d, lane, kk, qk);
    if (lane == 0) a[r] = inv_rms(kk, d, eps) * qk;
  }
  __syncwarp();
  acc_t mx = a[0];
  for (int64_t r = 1; r < N; ++r) mx = max(mx, a[r]);
  acc_t Z = 0;
  for (int64_t r = 0; r < N; ++r) Z += exp(a[r] - mx);
  const acc_t inv_Z = acc_t(1) / Z;
  scalar_t* o = out + (m * P + p) * d;
  for (int64_t i = lane; i < d; i += kWarp) {
    acc_t acc = 0;
    for (int64_t r = 0; r < N; ++r) acc += exp(a[r] - mx) * acc_t(v[(r * P + p) * d + i]);
    o[i] = scalar_t(acc * inv_Z);
  }
  if (lane == 0) lse[m * P + p] = mx + log(Z);
}

// Backward. Grid: ⌈P / warps⌉ blocks of kWarpsPerBlock warps, one warp per token, all M targets.
// Shared per warp: s_r, q·k_r, g·v_r, w_r and the coefficients of ∂q and ∂k ([6, N]).
//   g·out = Σ_r w_r (g·v_r),  ∂a_r = w_r (g·v_r − g·out) + ḡ_ζ w_r,
//   ∂v_r += w_r g,  ∂q += ∂a_r s_r k_r,  ∂k_r += ∂a_r (s_r q − s_r³ (q·k_r) k_r / d).
// gk, gv [N, P, d] (gv = gk when the values are the keys), gq_tok [P, M, d]: written, never read
// uninitialised (the first target writes, later ones add).
template <class scalar_t, class acc_t>
__global__ void depth_read_backward_kernel(const scalar_t* __restrict__ go, const acc_t* __restrict__ gl,
                                           const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                           const scalar_t* __restrict__ v, const acc_t* __restrict__ lse,
                                           acc_t* gk, acc_t* gv, acc_t* __restrict__ gq_tok, int64_t M, int64_t N,
                                           int64_t P, int64_t d, double eps, bool shared_values) {
  extern __shared__ unsigned char shared_bytes[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (p >= P) return;
  acc_t* s = reinterpret_cast<acc_t*>(shared_bytes) + warp * 6 * N;
  acc_t *qk = s + N, *gdotv = s + 2 * N, *w = s + 3 * N, *a_q = s + 4 * N, *a_k = s + 5 * N;
  for (int64_t r = 0; r < N; ++r) {
    const scalar_t* kr = k + (r * P + p) * d;
    acc_t kk = 0;
    for (int64_t i = lane; i < d; i += kWarp) {
      const acc_t x = acc_t(kr[i]);
      kk += x * x;
    }
    kk = warp_sum(kk);
    if (lane == 0) s[r] = inv_rms(kk, d, eps);
  }
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* qm = q + m * d;
    const scalar_t* g = go + (m * P + p) * d;
    for (int64_t r = 0; r < N; ++r) {
      const scalar_t *kr = k + (r * P + p) * d, *vr = v + (r * P + p) * d;
      acc_t dq = 0, dg = 0;
      for (int64_t i = lane; i < d; i += kWarp) {
        dq += acc_t(qm[i]) * acc_t(kr[i]);
        dg += acc_t(g[i]) * acc_t(vr[i]);
      }
      dq = warp_sum(dq);
      dg = warp_sum(dg);
      if (lane == 0) {
        qk[r] = dq;
        gdotv[r] = dg;
      }
    }
    __syncwarp();
    if (lane == 0) {  // the weights and each source's ∂a_r, as coefficients of q and k_r
      acc_t g_out = 0;
      for (int64_t r = 0; r < N; ++r) {
        w[r] = exp(s[r] * qk[r] - lse[m * P + p]);
        g_out += w[r] * gdotv[r];
      }
      for (int64_t r = 0; r < N; ++r) {
        const acc_t da = w[r] * (gdotv[r] - g_out) + gl[m * P + p] * w[r];
        a_q[r] = da * s[r];
        a_k[r] = -da * s[r] * s[r] * s[r] * qk[r] / acc_t(d);
      }
    }
    __syncwarp();
    acc_t* gqm = gq_tok + (p * M + m) * d;
    for (int64_t i = lane; i < d; i += kWarp) {
      const acc_t gi = acc_t(g[i]), qi = acc_t(qm[i]);
      acc_t gq_i = 0;
      for (int64_t r = 0; r < N; ++r) {
        const int64_t at = (r * P + p) * d + i;
        const acc_t ki = acc_t(k[at]);
        acc_t gk_i = a_q[r] * qi + a_k[r] * ki;
        if (shared_values) gk_i += w[r] * gi;
        gk[at] = m == 0 ? gk_i : gk[at] + gk_i;
        if (!shared_values) gv[at] = m == 0 ? w[r] * gi : gv[at] + w[r] * gi;
        gq_i += a_q[r] * ki;
      }
      gqm[i] = gq_i;
    }
    __syncwarp();
  }
}

// Merge forward, one warp per token: a = s (q·k_part), λ = σ(ζ − a), h = λ out + (1 − λ) v_part.
template <class scalar_t, class acc_t>
__global__ void depth_merge_forward_kernel(const scalar_t* __restrict__ out, const acc_t* __restrict__ lse,
                                           const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                           const scalar_t* __restrict__ v, scalar_t* __restrict__ h, int64_t P,
                                           int64_t d, double eps) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (p >= P) return;
  acc_t kk, qk;
  square_and_dot(k + p * d, q, d, lane, kk, qk);
  const acc_t a = inv_rms(kk, d, eps) * qk;                         // (A.8)
  const acc_t lambda = acc_t(1) / (acc_t(1) + exp(a - lse[p]));    // (A.9)
  for (int64_t i = lane; i < d; i += kWarp)                         // (A.10)
    h[p * d + i] = scalar_t(lambda * acc_t(out[p * d + i]) + (acc_t(1) - lambda) * acc_t(v[p * d + i]));
}

// Merge backward, one warp per token (ops/cpu/depth_read_cpu.cpp): ∂λ = g·(out − v), ∂ζ = ∂λ λ(1 − λ),
// ∂a = −∂ζ; ∂out = λ g, ∂v = (1 − λ) g, ∂k = ∂a (s q − s³ (q·k) k / d), ∂q_tok = ∂a s k.
template <class scalar_t, class acc_t>
__global__ void depth_merge_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ out,
                                            const acc_t* __restrict__ lse, const scalar_t* __restrict__ q,
                                            const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                                            acc_t* __restrict__ go, acc_t* __restrict__ gl, acc_t* gk, acc_t* gv,
                                            acc_t* __restrict__ gq_tok, int64_t P, int64_t d, double eps,
                                            bool shared_values) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (p >= P) return;
  const int64_t row = p * d;
  acc_t kk = 0, qk = 0, dlambda = 0;
  for (int64_t i = lane; i < d; i += kWarp) {
    const acc_t x = acc_t(k[row + i]);
    kk += x * x;
    qk += acc_t(q[i]) * x;
    dlambda += acc_t(g[row + i]) * (acc_t(out[row + i]) - acc_t(v[row + i]));
  }
  kk = warp_sum(kk);
  qk = warp_sum(qk);
  dlambda = warp_sum(dlambda);
  const acc_t s = inv_rms(kk, d, eps), a = s * qk;
  const acc_t lambda = acc_t(1) / (acc_t(1) + exp(a - lse[p])), mu = acc_t(1) - lambda;
  const acc_t dz = dlambda * lambda * mu;
  if (lane == 0) gl[p] = dz;
  const acc_t a_q = -dz * s, a_k = dz * s * s * s * qk / acc_t(d);
  for (int64_t i = lane; i < d; i += kWarp) {
    const acc_t gi = acc_t(g[row + i]), ki = acc_t(k[row + i]);
    go[row + i] = lambda * gi;
    gk[row + i] = a_q * acc_t(q[i]) + a_k * ki + (shared_values ? mu * gi : acc_t(0));
    if (!shared_values) gv[row + i] = mu * gi;
    gq_tok[row + i] = a_q * ki;
  }
}

void check_cuda(const char* op, std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts)
    if (t->defined() && !t->is_cuda()) fail(op, ": every tensor must be on the same CUDA device");
}

unsigned blocks_for(int64_t P) { return unsigned((P + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// The schema's keys and values are lists of sources (ops/schema.cpp); these kernels read them
// stacked, [N, P, d], which costs a copy of the history per read that the CPU kernels, reading the
// list in place, do not make.
std::tuple<at::Tensor, at::Tensor> depth_read_cuda(const at::Tensor& queries, at::TensorList key_list,
                                                   at::TensorList value_list, double eps) {
  if (key_list.empty() || (!value_list.empty() && value_list.size() != key_list.size()))
    fail("depth_read: expected N >= 1 keys and as many values (or none)");
  const at::Tensor keys = at::stack(key_list), values = value_list.empty() ? keys : at::stack(value_list);
  check_cuda("depth_read", {&queries, &keys, &values});
  if (queries.dim() != 2 || keys.dim() != 3 || keys.sizes() != values.sizes() || queries.size(1) != keys.size(2) ||
      keys.size(0) < 1)
    fail("depth_read: expected queries [M, d], keys and values [N, P, d] with N ≥ 1");
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor q = queries.contiguous(), k = keys.contiguous(), v = values.contiguous();
  const int64_t M = q.size(0), N = k.size(0), P = k.size(1), d = k.size(2);
  const auto acc_type = k.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({M, P, d}, k.options()), lse = at::empty({M, P}, k.options().dtype(acc_type));
  if (P == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, k.scalar_type(), "depth_read_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const size_t shared = size_t(kWarpsPerBlock) * N * sizeof(acc_t);
    depth_read_forward_kernel<scalar_t, acc_t>
        <<<dim3(blocks_for(P), unsigned(M)), kWarpsPerBlock * kWarp, shared, at::cuda::getCurrentCUDAStream()>>>(
            q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
            out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<acc_t>(), N, P, d, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

// The sources' gradients are computed stacked, then added into the buffers given (schema.cpp).
at::Tensor depth_read_backward_cuda(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                                    const at::Tensor& queries, at::TensorList key_list, at::TensorList value_list,
                                    const at::Tensor& lse_, double eps, at::TensorList grad_keys,
                                    at::TensorList grad_values) {
  const bool shared_values = value_list.empty();
  if (key_list.empty() || (!shared_values && value_list.size() != key_list.size()))
    fail("depth_read_backward: expected N >= 1 keys and as many values (or none)");
  const at::Tensor keys = at::stack(key_list), values = shared_values ? keys : at::stack(value_list);
  check_cuda("depth_read_backward", {&queries, &keys, &values, &lse_});
  // The buffers the sources' gradients are added into: one per key (and per value), [P, d] in ζ's dtype.
  if (grad_keys.size() != key_list.size() || grad_values.size() != (shared_values ? 0 : value_list.size()))
    fail("depth_read_backward: ", grad_keys.size(), " key and ", grad_values.size(), " value gradient buffers for ",
         key_list.size(), " sources");
  for (const at::TensorList list : {grad_keys, grad_values})
    for (const at::Tensor& b : list)
      if (b.sizes() != key_list[0].sizes() || b.scalar_type() != lse_.scalar_type() || !b.is_cuda())
        fail("depth_read_backward: a gradient buffer is ", b.sizes(), " ", b.scalar_type(), ", expected ",
             key_list[0].sizes(), " ", lse_.scalar_type(), " on the keys' device");
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor q = queries.contiguous(), k = keys.contiguous(), v = values.contiguous(), lse = lse_.contiguous();
  const int64_t M = q.size(0), N = k.size(0), P = k.size(1), d = k.size(2);
  const auto acc_type = lse.scalar_type();
  const at::Tensor go = grad_out.has_value() ? grad_out->contiguous() : at::zeros({M, P, d}, k.options());
  const at::Tensor gl = grad_lse.has_value() ? grad_lse->to(acc_type).contiguous() : at::zeros({M, P}, lse.options());
  at::Tensor gk = at::empty({N, P, d}, k.options().dtype(acc_type));
  at::Tensor gv = shared_values ? gk : at::empty({N, P, d}, k.options().dtype(acc_type));
  at::Tensor gq_tok = at::empty({P, M, d}, k.options().dtype(acc_type));
  if (P > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, k.scalar_type(), "depth_read_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const size_t shared = size_t(kWarpsPerBlock) * 6 * N * sizeof(acc_t);
      depth_read_backward_kernel<scalar_t, acc_t>
          <<<blocks_for(P), kWarpsPerBlock * kWarp, shared, at::cuda::getCurrentCUDAStream()>>>(
              go.const_data_ptr<scalar_t>(), gl.const_data_ptr<acc_t>(), q.const_data_ptr<scalar_t>(),
              k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(),
              gk.mutable_data_ptr<acc_t>(), gv.mutable_data_ptr<acc_t>(), gq_tok.mutable_data_ptr<acc_t>(), M, N, P, d,
              eps, shared_values);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (M > 0)  // with no queries the kernel wrote nothing: there is nothing to add
    for (int64_t r = 0; r < N; ++r) {
      grad_keys[r].add_(gk[r]);
      if (!shared_values) grad_values[r].add_(gv[r]);
    }
  return gq_tok.sum(0).to(q.scalar_type());
}

at::Tensor depth_merge_cuda(const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& query,
                            const at::Tensor& key_part, const std::optional<at::Tensor>& value_part_, double eps) {
  const at::Tensor value_part = value_part_.has_value() ? *value_part_ : key_part;
  check_cuda("depth_merge", {&out_, &lse_, &query, &key_part, &value_part});
  if (out_.dim() != 2 || key_part.sizes() != out_.sizes() || value_part.sizes() != out_.sizes() || lse_.dim() != 1 ||
      lse_.size(0) != out_.size(0) || query.dim() != 1 || query.size(0) != out_.size(1))
    fail("depth_merge: expected out, key_part, value_part [P, d], log_partition [P], query [d]");
  const c10::cuda::CUDAGuard guard(out_.device());
  const auto acc_type = out_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor o = out_.contiguous(), lse = lse_.to(acc_type).contiguous(), q = query.contiguous(),
                   k = key_part.contiguous(), v = value_part.contiguous();
  const int64_t P = o.size(0), d = o.size(1);
  at::Tensor h = at::empty({P, d}, o.options());
  if (P == 0) return h;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "depth_merge_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    depth_merge_forward_kernel<scalar_t, acc_t>
        <<<blocks_for(P), kWarpsPerBlock * kWarp, 0, at::cuda::getCurrentCUDAStream()>>>(
            o.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(), q.const_data_ptr<scalar_t>(),
            k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), h.mutable_data_ptr<scalar_t>(), P, d, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_merge_backward_cuda(
    const at::Tensor& grad, const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& query,
    const at::Tensor& key_part, const std::optional<at::Tensor>& value_part_, double eps) {
  const bool shared_values = !value_part_.has_value();
  const at::Tensor value_part = shared_values ? key_part : *value_part_;
  const c10::cuda::CUDAGuard guard(out_.device());
  const auto acc_type = out_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor g = grad.contiguous(), o = out_.contiguous(), lse = lse_.to(acc_type).contiguous(),
                   q = query.contiguous(), k = key_part.contiguous(), v = value_part.contiguous();
  const int64_t P = o.size(0), d = o.size(1);
  const auto acc_opt = o.options().dtype(acc_type);
  at::Tensor go = at::empty({P, d}, acc_opt), gk = at::empty({P, d}, acc_opt),
             gv = shared_values ? gk : at::empty({P, d}, acc_opt), gl = at::empty({P}, acc_opt),
             gq_tok = at::empty({P, d}, acc_opt);
  if (P > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "depth_merge_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      depth_merge_backward_kernel<scalar_t, acc_t>
          <<<blocks_for(P), kWarpsPerBlock * kWarp, 0, at::cuda::getCurrentCUDAStream()>>>(
              g.const_data_ptr<scalar_t>(), o.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(),
              q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
              go.mutable_data_ptr<acc_t>(), gl.mutable_data_ptr<acc_t>(), gk.mutable_data_ptr<acc_t>(),
              gv.mutable_data_ptr<acc_t>(), gq_tok.mutable_data_ptr<acc_t>(), P, d, eps, shared_values);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  const auto st = o.scalar_type();
  return {go.to(st), gl.to(lse_.scalar_type()), gq_tok.sum(0).to(q.scalar_type()), gk.to(st),
          shared_values ? at::Tensor() : gv.to(st)};
}

}  // namespace

TORCH_LIBRARY_IMPL(depthkit, CUDA, m) {
  m.impl("depth_read", &depth_read_cuda);
  m.impl("depth_read_backward", &depth_read_backward_cuda);
  m.impl("depth_merge", &depth_merge_cuda);
  m.impl("depth_merge_backward", &depth_merge_backward_cuda);
}

}  // namespace depthkit::cuda
