// The per-token passes of the MSAR kernels (ops/cpu/msar_cpu.cpp) over rows of d values, in
// register blocks of J rows: the scores' sums (Σ v², q · v, g · v), a weighted sum of rows (the
// depth softmax's value, eq. A.4–A.5; the H_pre fusion, eq. 14), and the key/value gradient of a
// row with the shared vector's gradient (∂v, ∂q). A row at a time, each of these reads the shared
// vector (q, its gradient, or the running sum) from memory once per row: a multiply-add then costs
// two loads (and a store when the sum is in memory), where in a block of J rows the shared
// register serves J rows and the sums stay in registers. Beside causal_window.h, whose registers
// (Reg, load) and row blocks (kRows) these use.
#pragma once
#include <c10/util/BFloat16.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "depthkit/ops/cpu/causal_window.h"

namespace depthkit::cpu {

template <class acc_t>
using Vec = typename Reg<acc_t>::type;

template <class acc_t>
inline acc_t lane_sum(const Vec<acc_t>& v) {
  acc_t s = 0;
  for (int64_t l = 0; l < Reg<acc_t>::lanes; ++l) s += v[l];
  return s;
}

// A register to memory in the storage type (bfloat16: rounded to nearest even, as its conversion).
template <class S, class acc_t>
inline void store(S* p, const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<S, acc_t>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    for (int64_t l = 0; l < Reg<acc_t>::lanes; ++l) p[l] = S(v[l]);
  }
}

// The passes over one row that end in a sum keep four registers of partial sums: with one, each
// multiply-add waits for the last (its latency, about four times its throughput).

// z = λ a + (1 − λ) b over d (b == nullptr: z = a); returns z · z, and with G (g not nullptr)
// g · z into *gz.
template <bool G, class acc_t, class A, class S>
inline acc_t mix_row(acc_t* z, const A* a, const acc_t* b, acc_t lambda, const S* g, acc_t* gz, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t n = Reg<acc_t>::lanes, R = 4;
  const acc_t kb = acc_t(1) - lambda, ka = b == nullptr ? acc_t(1) : lambda;
  V part[R] = {}, gpart[R] = {};
  int64_t i = 0;
  for (; i + R * n <= d; i += R * n)
#pragma GCC unroll 4
    for (int64_t e = 0; e < R; ++e) {
      V x = ka * load<acc_t>(a + i + e * n);
      if (b != nullptr) x += kb * load<acc_t>(b + i + e * n);
      std::memcpy(z + i + e * n, &x, sizeof x);
      part[e] += x * x;
      if constexpr (G) gpart[e] += x * load<acc_t>(g + i + e * n);
    }
  acc_t sum = lane_sum<acc_t>((part[0] + part[1]) + (part[2] + part[3]));
  acc_t gsum = G ? lane_sum<acc_t>((gpart[0] + gpart[1]) + (gpart[2] + gpart[3])) : acc_t(0);
  for (; i < d; ++i) {
    const acc_t x = ka * acc_t(a[i]) + (b == nullptr ? acc_t(0) : kb * b[i]);
    z[i] = x;
    sum += x * x;
    if constexpr (G) gsum += x * acc_t(g[i]);
  }
  if constexpr (G) *gz = gsum;
  return sum;
}

// y = λ g over d; returns g · (a − b).
template <class acc_t, class A>
inline acc_t scale_row_and_dot_difference(acc_t* y, const acc_t* g, const A* a, const acc_t* b, acc_t lambda,
                                          int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t n = Reg<acc_t>::lanes, R = 4;
  V part[R] = {};
  int64_t i = 0;
  for (; i + R * n <= d; i += R * n)
#pragma GCC unroll 4
    for (int64_t e = 0; e < R; ++e) {
      const V gi = load<acc_t>(g + i + e * n);
      const V yi = lambda * gi;
      std::memcpy(y + i + e * n, &yi, sizeof yi);
      part[e] += gi * (load<acc_t>(a + i + e * n) - load<acc_t>(b + i + e * n));
    }
  acc_t sum = lane_sum<acc_t>((part[0] + part[1]) + (part[2] + part[3]));
  for (; i < d; ++i) {
    y[i] = lambda * g[i];
    sum += g[i] * (acc_t(a[i]) - b[i]);
  }
  return sum;
}

// Per row j < J of v (rows d apart): ss_j = v_j · v_j and, for each of NQ queries k, qv_k[j] =
// q_k · v_j and, with GRAD, gv_k[j] = g_k,j · v_j (g_k's rows d apart; without GRAD, g and gv are
// not read). The NQ queries of a block's branches read the same candidates (msar_block_read): one
// pass loads each register of v once for all of them, where a pass per query loads it NQ times.
// Each sum runs in the same order whatever NQ and J, so a query's dots do not depend on the others.
template <int64_t J, int64_t NQ, bool GRAD, class acc_t, class X, class Q, class G>
inline void row_dots_block(acc_t* ss, acc_t* const* qv, acc_t* const* gv, const X* v, const Q* const* q,
                           const G* const* g, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t n = Reg<acc_t>::lanes;
  V s[J] = {}, a[NQ][J] = {}, c[NQ][J] = {};
  int64_t i = 0;
  for (; i + n <= d; i += n) {
    V qi[NQ];
#pragma GCC unroll 4
    for (int64_t k = 0; k < NQ; ++k) qi[k] = load<acc_t>(q[k] + i);
#pragma GCC unroll 8
    for (int64_t j = 0; j < J; ++j) {
      const V x = load<acc_t>(v + j * d + i);
      s[j] += x * x;
#pragma GCC unroll 4
      for (int64_t k = 0; k < NQ; ++k) {
        a[k][j] += x * qi[k];
        if constexpr (GRAD) c[k][j] += x * load<acc_t>(g[k] + j * d + i);
      }
    }
  }
  for (int64_t j = 0; j < J; ++j) {
    acc_t sj = lane_sum<acc_t>(s[j]);
    for (int64_t e = i; e < d; ++e) sj += acc_t(v[j * d + e]) * acc_t(v[j * d + e]);
    ss[j] = sj;
    for (int64_t k = 0; k < NQ; ++k) {
      acc_t ak = lane_sum<acc_t>(a[k][j]), ck = GRAD ? lane_sum<acc_t>(c[k][j]) : acc_t(0);
      for (int64_t e = i; e < d; ++e) {
        const acc_t x = acc_t(v[j * d + e]);
        ak += x * acc_t(q[k][e]);
        if constexpr (GRAD) ck += x * acc_t(g[k][j * d + e]);
      }
      qv[k][j] = ak;
      if constexpr (GRAD) gv[k][j] = ck;
    }
  }
}

// row_dots_block over `rows` rows of v for NQ queries: blocks of as many rows as keep every sum in
// a register (kRows; half that with two queries' q · v and g · v: 5 sums a row), then of 4, then
// single rows. qv[k], gv[k] and g[k] point at row 0 of their rows.
template <int64_t NQ, bool GRAD, class acc_t, class X, class Q, class G>
void row_dots_queries(acc_t* ss, const std::array<acc_t*, NQ>& qv, const std::array<acc_t*, NQ>& gv, const X* v,
                      const std::array<const Q*, NQ>& q, const std::array<const G*, NQ>& g, int64_t rows, int64_t d) {
  constexpr int64_t widest = GRAD && NQ > 1 ? kRows / 2 : kRows;
  int64_t j = 0;
  auto block = [&](auto J) {
    std::array<acc_t*, NQ> qj, gj;
    std::array<const G*, NQ> g_j;
    for (int64_t k = 0; k < NQ; ++k) {
      qj[k] = qv[k] + j;
      gj[k] = GRAD ? gv[k] + j : nullptr;
      g_j[k] = GRAD ? g[k] + j * d : g[k];
    }
    row_dots_block<decltype(J)::value, NQ, GRAD>(ss + j, qj.data(), gj.data(), v + j * d, q.data(), g_j.data(), d);
    j += decltype(J)::value;
  };
  while (j + widest <= rows) block(std::integral_constant<int64_t, widest>{});
  if constexpr (widest > 4)
    while (j + 4 <= rows) block(std::integral_constant<int64_t, 4>{});
  while (j < rows) block(std::integral_constant<int64_t, 1>{});
}

// One query's: ss, qv and gv [rows].
template <bool GRAD, class acc_t, class X, class Q, class G>
void row_dots(acc_t* ss, acc_t* qv, acc_t* gv, const X* v, const Q* q, const G* g, int64_t rows, int64_t d) {
  row_dots_queries<1, GRAD, acc_t, X, Q, G>(ss, {qv}, {gv}, v, {q}, {g}, rows, d);
}

// S queries' (a block's branches, msar_block_read): two a pass, the last one alone where S is odd.
// Query j's q_j · v at qv + j·stride and, with GRAD, g_j · v at gv + j·stride; query(j) and
// grad(j) give q_j and the first row of g_j (grad is not called without GRAD).
template <bool GRAD, class acc_t, class X, class QueryOf, class GradOf>
void row_dots_per_query(acc_t* ss, acc_t* qv, acc_t* gv, int64_t stride, const X* v, int64_t S, QueryOf query,
                        GradOf grad, int64_t rows, int64_t d) {
  using Q = std::remove_const_t<std::remove_pointer_t<decltype(query(0))>>;
  using G = std::remove_const_t<std::remove_pointer_t<decltype(grad(0))>>;
  auto g = [&](int64_t j) { return GRAD ? grad(j) : static_cast<const G*>(nullptr); };
  auto at = [&](acc_t* p, int64_t j) { return p == nullptr ? nullptr : p + j * stride; };
  for (int64_t j = 0; j < S; j += 2) {
    if (j + 1 < S)
      row_dots_queries<2, GRAD, acc_t, X, Q, G>(ss, {at(qv, j), at(qv, j + 1)}, {at(gv, j), at(gv, j + 1)}, v,
                                                {query(j), query(j + 1)}, {g(j), g(j + 1)}, rows, d);
    else
      row_dots_queries<1, GRAD, acc_t, X, Q, G>(ss, {at(qv, j)}, {at(gv, j)}, v, {query(j)}, {g(j)}, rows, d);
  }
}

// o = scale · Σ_{n<N} w[n · w_stride] x_n over d, x_n = rows[n] + offset: the sum in registers,
// so that each row is read once and o written once (a running sum in memory costs a load and a
// store of it per row).
template <class acc_t, class scalar_t, class X>
void weighted_row_sum(scalar_t* o, const acc_t* w, int64_t w_stride, const X* const* rows, int64_t offset, int64_t N,
                      acc_t scale, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t n = Reg<acc_t>::lanes, R = 4;  // four registers of d per pass
  int64_t i = 0;
  for (; i + R * n <= d; i += R * n) {
    V acc[R] = {};
    for (int64_t k = 0; k < N; ++k) {
      const acc_t wk = w[k * w_stride];
      const X* x = rows[k] + offset + i;
#pragma GCC unroll 4
      for (int64_t e = 0; e < R; ++e) acc[e] += wk * load<acc_t>(x + e * n);
    }
#pragma GCC unroll 4
    for (int64_t e = 0; e < R; ++e) store<scalar_t, acc_t>(o + i + e * n, acc[e] * scale);
  }
  for (; i < d; ++i) {
    acc_t acc = 0;
    for (int64_t k = 0; k < N; ++k) acc += w[k * w_stride] * acc_t(rows[k][offset + i]);
    o[i] = scalar_t(acc * scale);
  }
}

// Per row j < J (rows of v and out d apart, of g gs apart): out_j = α_j g_j + β_j q − γ_j v_j (ADD:
// out_j += …, where several queries read one candidate, msar_read_backward), and
// gq += Σ_j β_j v_j: the gradient of a key-normalised candidate v, whose score is s (q · v), with
// β = ∂a s and γ = ∂a s³ (q · v) / d (∂/∂v of s (q · v)), plus α g from its value; gq (the
// query's gradient) is loaded and stored once per J rows.
template <int64_t J, bool ADD, class acc_t, class G>
inline void key_grads_block(acc_t* out, acc_t* gq, const acc_t* v, const G* g, int64_t gs, const acc_t* q,
                            const acc_t* alpha, const acc_t* beta, const acc_t* gamma, int64_t d) {
  using V = Vec<acc_t>;
  constexpr int64_t n = Reg<acc_t>::lanes;
  int64_t i = 0;
  for (; i + n <= d; i += n) {
    const V qi = load<acc_t>(q + i);
    V gqi = load<acc_t>(gq + i);
#pragma GCC unroll 8
    for (int64_t j = 0; j < J; ++j) {
      const V x = load<acc_t>(v + j * d + i);
      V o = alpha[j] * load<acc_t>(g + j * gs + i) + beta[j] * qi - gamma[j] * x;
      if constexpr (ADD) o += load<acc_t>(out + j * d + i);
      std::memcpy(out + j * d + i, &o, sizeof o);
      gqi += beta[j] * x;
    }
    std::memcpy(gq + i, &gqi, sizeof gqi);
  }
  for (; i < d; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const acc_t x = v[j * d + i];
      const acc_t o = alpha[j] * acc_t(g[j * gs + i]) + beta[j] * q[i] - gamma[j] * x;
      out[j * d + i] = ADD ? out[j * d + i] + o : o;
      gq[i] += beta[j] * x;
    }
}

// key_grads_block over `rows` rows: blocks of kRows, then of 4, then single rows.
template <bool ADD = false, class acc_t, class G>
void key_grads(acc_t* out, acc_t* gq, const acc_t* v, const G* g, int64_t gs, const acc_t* q, const acc_t* alpha,
               const acc_t* beta, const acc_t* gamma, int64_t rows, int64_t d) {
  int64_t j = 0;
  auto block = [&](auto J) {
    key_grads_block<decltype(J)::value, ADD>(out + j * d, gq, v + j * d, g + j * gs, gs, q, alpha + j, beta + j,
                                              gamma + j, d);
    j += decltype(J)::value;
  };
  while (j + kRows <= rows) block(std::integral_constant<int64_t, kRows>{});
  while (j + 4 <= rows) block(std::integral_constant<int64_t, 4>{});
  while (j < rows) block(std::integral_constant<int64_t, 1>{});
}

}  // namespace depthkit::cpu
