// Small building blocks shared by the CPU kernels: dot products and norms over d, accumulated in
// acc_t (float32 for float32/bfloat16 storage, float64 for float64). The loops are plain so that
// the compiler vectorises them (the kernel files compile with -fopenmp-simd; no OpenMP runtime).
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace depthkit::cpu {

// Float32 accumulation for float32 and bfloat16 storage, float64 for float64.
inline at::ScalarType acc_type_of(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// a · b over d.
template <class acc_t, class A, class B>
inline acc_t dot(const A* a, const B* b, int64_t d) {
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += acc_t(a[i]) * acc_t(b[i]);
  return s;
}

// (x · x, q · x) in one pass: two independent sums, and x is read once.
template <class acc_t, class X, class Q>
inline std::pair<acc_t, acc_t> square_and_dot(const X* x, const Q* q, int64_t d) {
  acc_t xx = 0, qx = 0;
#pragma omp simd reduction(+ : xx, qx)
  for (int64_t i = 0; i < d; ++i) {
    const acc_t xi = acc_t(x[i]);
    xx += xi * xi;
    qx += acc_t(q[i]) * xi;
  }
  return {xx, qx};
}

// 1 / √(mean_d x² + ε): the weightless RMSNorm's scale (Norm_h, DAR eq. 2).
template <class acc_t, class scalar_t>
inline acc_t inv_rms(const scalar_t* x, int64_t d, double eps) {
  return acc_t(1) / std::sqrt(dot<acc_t>(x, x, d) / acc_t(d) + acc_t(eps));
}

template <class acc_t>
inline acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

// y += a · x over d.
template <class acc_t, class X>
inline void axpy(acc_t* y, acc_t a, const X* x, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * acc_t(x[i]);
}

// y += a · x + b · z over d.
template <class acc_t, class X, class Z>
inline void axpy2(acc_t* y, acc_t a, const X* x, acc_t b, const Z* z, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * acc_t(x[i]) + b * acc_t(z[i]);
}

// y *= a over d.
template <class acc_t>
inline void scale(acc_t* y, acc_t a, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] *= a;
}

// (a − b) · (c − e) over d.
template <class acc_t, class X>
inline acc_t dot_of_differences(const X* a, const X* b, const X* c, const X* e, int64_t d) {
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += (acc_t(a[i]) - acc_t(b[i])) * (acc_t(c[i]) - acc_t(e[i]));
  return s;
}

// A parallel_for grain that gives each task a few thousand multiply-adds.
inline int64_t grain(int64_t work_per_token) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, work_per_token));
}

}  // namespace depthkit::cpu
