// Small building blocks shared by the CPU kernels: dot products and norms over d, accumulated in
// acc_t (float32 for float32/bfloat16 storage, float64 for float64). The loops are plain so that
// the compiler vectorises them: the kernel files compile with -fopenmp, which makes `#pragma omp
// simd` vectorise the reductions and at::parallel_for run on LibTorch's OpenMP thread pool
// (CMakeLists.txt).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <tuple>
#include <utility>
#include <vector>

#include "depthkit/util/error.h"

namespace depthkit::cpu {

// The kernels' thread-local scratch rows, aligned to a cache line (64 bytes): a 512-bit register's
// load or store at a row start (d·4 bytes apart, a multiple of 64 at the widths used) then stays
// within one line, where std::vector's 16-byte alignment splits every such access over two (the
// MSAR expansion at κ = 12 ran at 81 GFLOP/s from a 16-byte aligned buffer, 133 from an aligned one).
// Scratch<T> buf(n) leaves its values uninitialised (default-initialised, as `new T[n]`): the
// kernels write each scratch value before they read it, and zeroing a task's buffers (a megabyte
// in the MSAR fusion's backward) cost 3 % of that operator. A buffer that must start at zero says
// so: Scratch<T> buf(n, T(0)).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialised: no zeros
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <class T>
using Scratch = std::vector<T, CacheLineAllocator<T>>;

// Float32 accumulation for float32 and bfloat16 storage, float64 for float64.
inline at::ScalarType acc_type_of(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The history a read takes is a list of sources (one tensor per completed entry, never stacked:
// appending an entry copies nothing), and the backward kernels add each source's gradient into a
// buffer given for it (ops/shared_source.h: one buffer for all the reads of a shared source). The
// kernels take their data pointers.
inline std::vector<at::Tensor> contiguous_all(at::TensorList list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const at::Tensor& t : list) out.push_back(t.contiguous());
  return out;
}
template <class T>
std::vector<const T*> data_of(at::TensorList list) {
  std::vector<const T*> out;
  for (const at::Tensor& t : list) out.push_back(t.const_data_ptr<T>());
  return out;
}
template <class T>
std::vector<T*> mutable_data_of(at::TensorList list) {
  std::vector<T*> out;
  for (const at::Tensor& t : list) out.push_back(t.mutable_data_ptr<T>());
  return out;
}
// The gradient buffers a backward kernel adds into: N contiguous tensors of `sizes` in `dtype`.
inline void check_gradient_buffers(const char* what, at::TensorList buffers, size_t N, at::IntArrayRef sizes,
                                   at::ScalarType dtype) {
  if (buffers.size() != N) fail(what, ": ", buffers.size(), " buffers for ", N, " sources");
  for (const at::Tensor& b : buffers)
    if (b.sizes() != sizes || b.scalar_type() != dtype || !b.is_contiguous())
      fail(what, ": a buffer is ", b.sizes(), " ", b.scalar_type(), ", expected contiguous ", sizes, " ", dtype);
}

// The reductions over d keep kLanes partial sums per sum (two AVX2 registers of float32), so
// that consecutive multiply-adds are independent: with a single vector accumulator each one waits
// for the last (FMA latency), which measured 1.5× slower at d = 640. Each function takes one
// pass over its inputs for all its sums.
constexpr int64_t kLanes = 16;

// a · b over d.
template <class acc_t, class A, class B>
inline acc_t dot(const A* a, const B* b, int64_t d) {
  acc_t part[kLanes] = {};
  int64_t i0 = 0;
  for (; i0 + kLanes <= d; i0 += kLanes) {
#pragma omp simd
    for (int64_t u = 0; u < kLanes; ++u) part[u] += acc_t(a[i0 + u]) * acc_t(b[i0 + u]);
  }
  acc_t s = 0;
  for (int64_t i = i0; i < d; ++i) s += acc_t(a[i]) * acc_t(b[i]);
#pragma omp simd reduction(+ : s)
  for (int64_t u = 0; u < kLanes; ++u) s += part[u];
  return s;
}

// (x · x, q · x) in one pass: two independent sums, and x is read once.
template <class acc_t, class X, class Q>
inline std::pair<acc_t, acc_t> square_and_dot(const X* x, const Q* q, int64_t d) {
  acc_t pxx[kLanes] = {}, pqx[kLanes] = {};
  int64_t i0 = 0;
  for (; i0 + kLanes <= d; i0 += kLanes) {
#pragma omp simd
    for (int64_t u = 0; u < kLanes; ++u) {
      const acc_t xi = acc_t(x[i0 + u]);
      pxx[u] += xi * xi;
      pqx[u] += acc_t(q[i0 + u]) * xi;
    }
  }
  acc_t xx = 0, qx = 0;
  for (int64_t i = i0; i < d; ++i) {
    const acc_t xi = acc_t(x[i]);
    xx += xi * xi;
    qx += acc_t(q[i]) * xi;
  }
#pragma omp simd reduction(+ : xx, qx)
  for (int64_t u = 0; u < kLanes; ++u) {
    xx += pxx[u];
    qx += pqx[u];
  }
  return {xx, qx};
}

// (x · x, q · x, g · x) in one pass: three independent sums, and x is read once.
template <class acc_t, class X, class Q, class G>
inline std::tuple<acc_t, acc_t, acc_t> square_and_two_dots(const X* x, const Q* q, const G* g, int64_t d) {
  acc_t pxx[kLanes] = {}, pqx[kLanes] = {}, pgx[kLanes] = {};
  int64_t i0 = 0;
  for (; i0 + kLanes <= d; i0 += kLanes) {
#pragma omp simd
    for (int64_t u = 0; u < kLanes; ++u) {
      const acc_t xi = acc_t(x[i0 + u]);
      pxx[u] += xi * xi;
      pqx[u] += acc_t(q[i0 + u]) * xi;
      pgx[u] += acc_t(g[i0 + u]) * xi;
    }
  }
  acc_t xx = 0, qx = 0, gx = 0;
  for (int64_t i = i0; i < d; ++i) {
    const acc_t xi = acc_t(x[i]);
    xx += xi * xi;
    qx += acc_t(q[i]) * xi;
    gx += acc_t(g[i]) * xi;
  }
#pragma omp simd reduction(+ : xx, qx, gx)
  for (int64_t u = 0; u < kLanes; ++u) {
    xx += pxx[u];
    qx += pqx[u];
    gx += pgx[u];
  }
  return {xx, qx, gx};
}

// 1 / √(mean x² + ε) from Σ x² over n entries: the scale of the weightless RMSNorm (Norm_h, DAR
// eq. 2; the joint Norm([·;·]) of eq. 13 and 16 over 2d; mHC's rms over md; MSAR's over the m·d of
// flatten Z, eq. 13). Every kernel takes the sum of squares from a pass it makes anyway
// (square_and_dot, square_and_two_dots), so this is the one place the formula is written. (The
// CUDA kernels have the same function in ops/cuda/depth_read_cuda.cu.)
template <class acc_t>
inline acc_t inv_rms(acc_t sum_squares, int64_t n, double eps) {
  return acc_t(1) / std::sqrt(sum_squares / acc_t(n) + acc_t(eps));
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

// The gradients of one depth-attention candidate in one pass (depth_read, depth_merge, dar_read):
//   gk = a_q q + a_k k + a_g g   (ADD: gk +=),   gq += a_q k.
template <bool ADD, class acc_t, class Q, class K, class G>
inline void candidate_grads(acc_t* gk, acc_t* gq, acc_t a_q, const Q* q, acc_t a_k, const K* k, acc_t a_g, const G* g,
                            int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const acc_t ki = acc_t(k[i]);
    const acc_t v = a_q * acc_t(q[i]) + a_k * ki + a_g * acc_t(g[i]);
    gk[i] = ADD ? gk[i] + v : v;
    gq[i] += a_q * ki;
  }
}

// y = a · x over d.
template <class acc_t, class X>
inline void set_scaled(acc_t* y, acc_t a, const X* x, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] = a * acc_t(x[i]);
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

// Gradients that every token adds to (queries, gate weights) are summed in float32 by blocks of
// kSumBlock tokens, one partial sum per block, which ATen's sum adds at the end. A partial adds at
// most kSumBlock terms in sequence, and the blocks do not depend on the number of threads, so
// neither does the result. (One partial per thread adds P / threads terms in sequence: at P = 1001
// that was 2e-5 relative off the reference's pairwise sum.)
constexpr int64_t kSumBlock = 64;
inline int64_t sum_blocks(int64_t P) { return (P + kSumBlock - 1) / kSumBlock; }
// The partial sum of token p.
inline int64_t sum_block(int64_t p) { return p / kSumBlock; }

// at::parallel_for over tokens [0, P) in ranges that start and end on block boundaries, so that no
// two threads add to one block's partial sum. f(p0, p1) as for at::parallel_for.
template <class F>
void parallel_for_blocks(int64_t P, int64_t token_grain, const F& f) {
  const int64_t block_grain = std::max<int64_t>(1, token_grain / kSumBlock);
  at::parallel_for(0, sum_blocks(P), block_grain, [&](int64_t b0, int64_t b1) {
    f(b0 * kSumBlock, std::min(P, b1 * kSumBlock));
  });
}

// Matrix products whose results must not depend on the number of threads run on fixed blocks of
// rows, one BLAS call per block inside a parallel region: a BLAS left to thread one product itself
// splits it by the thread count (MKL on AMD EPYC does, for mhc_pre's projection and the linear
// cross-entropy's three products), and the sums then round differently. A call made inside an
// active parallel region runs on one thread; with one thread, at::set_num_threads has set the BLAS
// to one. At least two blocks when there are two rows or more, so that the region is active
// whenever there are two threads or more. (A one-row product, such as a last chunk of one token,
// is one call outside a region, which the BLAS may still thread.)
constexpr int64_t kGemmRows = 256;

struct GemmBlocks {
  int64_t size, count;
};

inline GemmBlocks gemm_blocks(int64_t rows) {
  const int64_t wanted = std::min<int64_t>(rows, std::max<int64_t>(2, (rows + kGemmRows - 1) / kGemmRows));
  const int64_t size = wanted == 0 ? 1 : (rows + wanted - 1) / wanted;
  return {size, (rows + size - 1) / size};
}

// fn(block, first row, rows) for every block of gemm_blocks(rows), the blocks in parallel.
template <class Fn>
void for_each_gemm_block(int64_t rows, const Fn& fn) {
  const GemmBlocks blocks = gemm_blocks(rows);
  at::parallel_for(0, blocks.count, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      fn(b, b * blocks.size, std::min(rows, (b + 1) * blocks.size) - b * blocks.size);
  });
}

}  // namespace depthkit::cpu
