// The causal depthwise convolution of MSAR (eq. 9–10) and its two transposes, for the CPU
// kernels of ops/cpu/msar_cpu.cpp: the windowed sums over rows of d values in register blocks,
// the expansion of a tile of tokens and its backward, the tiling that keeps the backward's
// scatter race-free, and the layout of the taps. Beside kernel_math.h, which it builds on.
//
// A stream of one source at token t is v⁽ʳ⁾_t = Σ_{δ<K, δ≤t} c_{r,δ} ⊙ x_{t−δ} (zero before t = 0,
// per batch row); taps are kept as [K, d] per kernel (so loops over d are contiguous), zero-padded
// to the largest kernel K. Taps after a kernel's last nonzero tap are skipped where that is exact
// (the expansion and ∂x); the gradients of the padding are skipped when the caller gives the
// kernels' lengths (kernel_lengths).
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "depthkit/util/error.h"

namespace depthkit::cpu {

// Stream r of one source at token t (eq. 10): x_t points at row t of its batch row, rows t − δ lie
// δ·d before it; taps [K, d] (nullptr: stream 0, the identity), of which the first `used` can be
// nonzero (the rest are the zero padding of a shorter kernel: skipping them is exact).
template <class acc_t, class scalar_t>
void expand(acc_t* v, const scalar_t* x_t, const acc_t* taps, int64_t used, int64_t t, int64_t d) {
  if (taps == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) v[i] = acc_t(x_t[i]);
    return;
  }
  std::fill_n(v, d, acc_t(0));
  const int64_t taps_used = std::min<int64_t>(used, t + 1);  // zero before position 0
  for (int64_t delta = 0; delta < taps_used; ++delta) {
    const scalar_t* x = x_t - delta * d;
    const acc_t* c = taps + delta * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) v[i] += c[i] * acc_t(x[i]);
  }
}

// The convolution and its two transposes are all windowed sums over rows of d values,
//   out_j (+)= Σ_{k<nk} a_k ⊙ b_{j+σk}
// (expansion: j = t, k = δ, a = taps, b = x, σ = −1; ∂x: j = s, k = δ, a = taps, b = ∂v, σ = +1;
// ∂c: j = δ, k = s, a = x, b = ∂v, σ = +1). They run in register blocks of J rows × one chunk of
// W values of d: the J·W sums stay in registers across k and each a_k is loaded once for the J
// rows, so a multiply-add costs about one load, where a running sum in memory costs two loads and
// a store per multiply-add (and the tap gradient one read-modify-write per token).
// The vector width of the blocked kernels: 64 bytes where the build targets AVX-512 (32 registers),
// 32 (AVX2: 16 registers) otherwise.
#ifdef __AVX512F__
constexpr int64_t kRegBytes = 64;
#else
constexpr int64_t kRegBytes = 32;
#endif
// J: rows per register block. With 32 vector registers (AVX-512), 8 rows × two registers = 16
// accumulators, with room for kSteps taps (8 registers) and a row of b; with 16 (AVX2), 4 rows.
// Blocks of kRows rows, then of 4, then single rows (window_rows).
#ifdef __AVX512F__
constexpr int64_t kRows = 8;
#else
constexpr int64_t kRows = 4;
#endif
template <class acc_t>
constexpr int64_t kChunk = 2 * kRegBytes / int64_t(sizeof(acc_t));  // W: two registers (Reg below)
// Tokens per tile of the blocked kernels: the expansions of a tile (N·kTile·d values in the read
// backward) stay in cache, and the K − 1 rows that the transposes reach outside it are a small part.
constexpr int64_t kTile = 32;

// One register of the blocked kernels (kRegBytes: 16 float32 or 8 float64 on AVX-512 builds, 8 or
// 4 on AVX2), as a GCC/Clang vector type. (With plain loops over a fixed-size array of sums, GCC 12
// kept the sums in memory: a load and a store per multiply-add again.)
template <class acc_t>
struct Reg {
  typedef acc_t type __attribute__((vector_size(kRegBytes)));
  static constexpr int64_t lanes = kRegBytes / int64_t(sizeof(acc_t));
};

// One register's worth of p in the accumulation type (bfloat16: its bits are the high half of the float32's).
template <class acc_t, class S>
inline typename Reg<acc_t>::type load(const S* p) {
  typename Reg<acc_t>::type v;
  if constexpr (std::is_same_v<S, acc_t>) {
    std::memcpy(&v, p, sizeof v);
  } else if constexpr (std::is_same_v<S, at::BFloat16> && std::is_same_v<acc_t, float>) {
    typedef uint16_t half_bits __attribute__((vector_size(kRegBytes / 2)));
    typedef uint32_t bits __attribute__((vector_size(kRegBytes)));
    half_bits h;
    std::memcpy(&h, p, sizeof h);
    const bits w = __builtin_convertvector(h, bits) << 16;
    std::memcpy(&v, &w, sizeof v);
  } else {
    for (int64_t l = 0; l < Reg<acc_t>::lanes; ++l) v[l] = acc_t(p[l]);
  }
  return v;
}

// The second level of blocking: kSteps consecutive k at a time. Row i of b serves every (j, k) of
// the step with j + σk = i, so the J·kSteps multiply-adds load J + kSteps − 1 rows of b and
// kSteps of a, where k one at a time loads J rows of b and one of a per J multiply-adds.
constexpr int64_t kSteps = 4;

// One block: J rows of out (d apart) on the kChunk columns where out, a and b point.
template <int64_t J, int64_t sigma, bool add, class acc_t, class A, class Bv>
inline void window_block(acc_t* out, const A* a, const Bv* b, int64_t nk, int64_t d) {
  using V = typename Reg<acc_t>::type;
  constexpr int64_t n = Reg<acc_t>::lanes, R = kChunk<acc_t> / n;
  V acc[J][R];
  for (int64_t j = 0; j < J; ++j)
    for (int64_t e = 0; e < R; ++e) acc[j][e] = add ? load<acc_t>(out + j * d + e * n) : V{};
  int64_t k = 0;
  if constexpr (J > 1) {
    // o = j + σt (t < kSteps the step's k − k0): the b row of (j, t) is o + σk0, and j = o − σt.
    constexpr int64_t o_lo = sigma > 0 ? 0 : 1 - kSteps, o_hi = sigma > 0 ? J + kSteps - 2 : J - 1;
    for (; k + kSteps <= nk; k += kSteps) {
      V ak[kSteps][R];
#pragma GCC unroll 8
      for (int64_t t = 0; t < kSteps; ++t)
#pragma GCC unroll 4
        for (int64_t e = 0; e < R; ++e) ak[t][e] = load<acc_t>(a + (k + t) * d + e * n);
#pragma GCC unroll 16
      for (int64_t o = o_lo; o <= o_hi; ++o) {
        V bo[R];
#pragma GCC unroll 4
        for (int64_t e = 0; e < R; ++e) bo[e] = load<acc_t>(b + (o + sigma * k) * d + e * n);
#pragma GCC unroll 8
        for (int64_t t = 0; t < kSteps; ++t) {
          const int64_t j = o - sigma * t;
          if (j < 0 || j >= J) continue;
#pragma GCC unroll 4
          for (int64_t e = 0; e < R; ++e) acc[j][e] += ak[t][e] * bo[e];
        }
      }
    }
  }
  for (; k < nk; ++k) {
    V ak[R];
    for (int64_t e = 0; e < R; ++e) ak[e] = load<acc_t>(a + k * d + e * n);
    for (int64_t j = 0; j < J; ++j) {
      const Bv* bj = b + (j + sigma * k) * d;
      for (int64_t e = 0; e < R; ++e) acc[j][e] += ak[e] * load<acc_t>(bj + e * n);
    }
  }
  for (int64_t j = 0; j < J; ++j)
    for (int64_t e = 0; e < R; ++e) std::memcpy(out + j * d + e * n, &acc[j][e], sizeof(V));
}

// The same on the one column where out, a and b point (the columns left when d is not a multiple of kChunk).
template <int64_t J, int64_t sigma, bool add, class acc_t, class A, class Bv>
inline void window_column(acc_t* out, const A* a, const Bv* b, int64_t nk, int64_t d) {
  for (int64_t j = 0; j < J; ++j) {
    acc_t acc = add ? out[j * d] : acc_t(0);
    for (int64_t k = 0; k < nk; ++k) acc += acc_t(a[k * d]) * acc_t(b[(j + sigma * k) * d]);
    out[j * d] = acc;
  }
}

// J rows over all of d: chunks of kChunk columns, then the columns left one by one.
template <int64_t J, int64_t sigma, bool add, class acc_t, class A, class Bv>
void window(acc_t* out, const A* a, const Bv* b, int64_t nk, int64_t d) {
  constexpr int64_t W = kChunk<acc_t>;
  int64_t i0 = 0;
  for (; i0 + W <= d; i0 += W) window_block<J, sigma, add>(out + i0, a + i0, b + i0, nk, d);
  for (; i0 < d; ++i0) window_column<J, sigma, add>(out + i0, a + i0, b + i0, nk, d);
}

// `rows` rows: blocks of kRows, then the rows left one by one.
template <int64_t sigma, bool add, class acc_t, class A, class Bv>
void window_rows(acc_t* out, const A* a, const Bv* b, int64_t nk, int64_t rows, int64_t d) {
  int64_t j = 0;
  for (; j + kRows <= rows; j += kRows) window<kRows, sigma, add>(out + j * d, a, b + j * d, nk, d);
  if constexpr (kRows > 4)
    for (; j + 4 <= rows; j += 4) window<4, sigma, add>(out + j * d, a, b + j * d, nk, d);
  for (; j < rows; ++j) window<1, sigma, add>(out + j * d, a, b + j * d, nk, d);
}

// `expand` for the nt tokens t0, t0 + 1, … of one batch row, into the rows of E [nt, d]; x0 points
// at row t0. The first used − 1 tokens of a batch row reach before position 0: they go one by one.
template <class acc_t, class scalar_t>
void expand_tile(acc_t* E, const scalar_t* x0, const acc_t* taps, int64_t used, int64_t t0, int64_t nt, int64_t d) {
  if (taps == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < nt * d; ++i) E[i] = acc_t(x0[i]);
    return;
  }
  int64_t j = 0;
  for (; j < nt && t0 + j + 1 < used; ++j) expand(E + j * d, x0 + j * d, taps, used, t0 + j, d);
  window_rows<-1, false>(E + j * d, taps, x0 + j * d, used, nt - j, d);
}

// The transpose of `expand_tile` for the tokens t0 ≤ t < t1 of one batch row: dv0 points at the ∂v
// of token t0 in a buffer with K − 1 zero rows before and after the tile's; x0 at row 0 of the
// batch row; gx_t0 at the ∂x row of token t0 (accumulation type) in a buffer that holds the K − 1
// rows before it too; gc [K, d] a partial sum of its group of tiles. Then
//   ∂x_s += Σ_{δ<used} c_δ ⊙ ∂v_{s+δ}   for t0 − (used − 1) ≤ s < t1, s ≥ 0 (nothing to add for
//            the zero taps δ ≥ used),
//   ∂c_δ += Σ_s ∂v_{s+δ} ⊙ x_s          for δ < length (zero taps have gradients too),
// with the zero rows standing in for ∂v outside the tile, so that neither sum has bounds inside.
// Only the first `length` tap gradients are wanted (the kernel's own taps, not its padding): the
// last block of taps may run up to kRows − 1 past it, and the caller zeroes those (zero_padding).
template <class acc_t, class scalar_t>
void expand_backward_tile(const acc_t* dv0, acc_t* gx_t0, acc_t* gc, const scalar_t* x0, const acc_t* taps,
                          int64_t used, int64_t length, int64_t K, int64_t t0, int64_t t1, int64_t d) {
  if (taps == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < (t1 - t0) * d; ++i) gx_t0[i] += dv0[i];
    return;
  }
  if (used > 0) {
    const int64_t s0 = std::max<int64_t>(0, t0 - (used - 1));
    window_rows<+1, true>(gx_t0 + (s0 - t0) * d, taps, dv0 + (s0 - t0) * d, used, t1 - s0, d);
  }
  // Blocks of taps δ0 ≤ δ < δ0 + J (J ≤ K − δ0, so the rows read stay within the zero rows), each
  // over the rows s with a term inside the tile: t0 − (δ0 + J − 1) ≤ s < t1 − δ0. J = kRows while
  // more than 4 of the kernel's taps are left, then 4, then 1.
  for (int64_t delta0 = 0; delta0 < length;) {
    const int64_t left = length - delta0;
    const int64_t J = left > 4 && delta0 + kRows <= K ? kRows : delta0 + 4 <= K ? 4 : 1;
    const int64_t s_lo = std::max<int64_t>(0, t0 - (delta0 + J - 1)), s_hi = t1 - delta0;
    if (s_hi > s_lo) {
      const acc_t* b = dv0 + (s_lo + delta0 - t0) * d;
      acc_t* g = gc + delta0 * d;
      const scalar_t* x = x0 + s_lo * d;
      if (J == kRows)
        window<kRows, +1, true>(g, x, b, s_hi - s_lo, d);
      else if (J == 4)
        window<4, +1, true>(g, x, b, s_hi - s_lo, d);
      else
        window<1, +1, true>(g, x, b, s_hi - s_lo, d);
    }
    delta0 += J;
  }
}

// ∂x of the tokens t0 − (K − 1) ≤ s < t1 of one batch row (s ≥ 0), gathered in the buffer
// `local` [t1 − t0 + K − 1, d] (row 0: token t0 − (K − 1)) over every stream of a tile, added to
// ∂x in memory (row 0 of the batch row at gx0) at once: one read-modify-write of a token's ∂x per
// tile, where adding each stream's transpose to it would be m.
template <class acc_t>
void add_rows(acc_t* gx0, const acc_t* local, int64_t K, int64_t t0, int64_t t1, int64_t d) {
  const int64_t s0 = std::max<int64_t>(0, t0 - (K - 1));
  const acc_t* src = local + (s0 - (t0 - (K - 1))) * d;
  acc_t* dst = gx0 + s0 * d;
#pragma omp simd
  for (int64_t i = 0; i < (t1 - s0) * d; ++i) dst[i] += src[i];
}

// The transposes scatter into the K − 1 tokens before a tile, and every token adds to the
// gradients shared by all tokens (queries, taps, W_pre, ...). Tiles of at least K − 1 tokens (and
// kTile, the blocked kernels' tile) of every batch row, numbered c = b · tiles + j, are cut into
// groups of consecutive tiles covering about kGroupTokens tokens; each group adds to its own
// partial sums, which are added at the end (kernel_math.h: kSumBlock, the same for the other
// kernels). The groups depend on the shapes only, so the gradients do not depend on the number of
// threads; a group is one task, which runs its tiles in order.
constexpr int64_t kGroupTokens = 256;

struct TileGroups {
  int64_t tile;    // tokens per tile, ≥ K − 1 and ≥ the kernel's tile (kTile unless it asks for more)
  int64_t tiles;   // tiles per batch row
  int64_t count;   // B · tiles
  int64_t per_group, groups;
};

inline TileGroups tile_groups(int64_t B, int64_t T, int64_t K, int64_t min_tile = kTile) {
  TileGroups g;
  g.tile = std::max<int64_t>(K - 1, min_tile);
  g.tiles = (T + g.tile - 1) / g.tile;
  g.count = B * g.tiles;
  g.per_group = std::max<int64_t>(1, kGroupTokens / g.tile);
  g.groups = (g.count + g.per_group - 1) / g.per_group;
  return g;
}

// Runs fn(b, t0, t1, group) over the tiles of every batch row such that no two concurrent tiles
// touch the same token when each also writes the K − 1 tokens before it: the even tiles of every
// row first, then the odd ones; within a group, tiles run in order on one thread. So the order in
// which a group's partial sums (and each token of ∂x) are added to is fixed by the shapes.
template <class Fn>
void for_each_tile(const TileGroups& g, int64_t T, const Fn& fn) {
  for (int64_t parity = 0; parity < 2; ++parity) {
    at::parallel_for(0, g.groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t group = g0; group < g1; ++group) {
        const int64_t c1 = std::min(g.count, (group + 1) * g.per_group);
        for (int64_t c = group * g.per_group; c < c1; ++c) {
          const int64_t b = c / g.tiles, j = c % g.tiles;
          if (j % 2 == parity) fn(b, j * g.tile, std::min(T, (j + 1) * g.tile), group);
        }
      }
    });
  }
}

// t contiguous in `type`, without an operator call when it already is (a decoding step makes
// many small calls, where each no-op `to` is a dispatch).
inline at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type ? t.contiguous() : t.to(type).contiguous();
}

// One bank's taps p [L, d, K] → o [L, K, d], kernel r's first lengths[r] taps transposed and the
// rest (padding, which no kernel reads: taps_used stops before it) zero.
template <class acc_t, class scalar_t>
void transpose_taps(acc_t* o, const scalar_t* p, int64_t L, int64_t d, int64_t K, const std::vector<int64_t>& lengths) {
  for (int64_t r = 0; r < L; ++r) {
    acc_t* o_r = o + r * K * d;
    const scalar_t* p_r = p + r * d * K;
    const int64_t len = lengths[size_t(r)];
    for (int64_t k = 0; k < len; ++k) {  // rows of d written in order (the reads stride K)
      acc_t* o_k = o_r + k * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o_k[i] = acc_t(p_r[i * K + k]);
    }
    std::fill(o_r + len * d, o_r + K * d, acc_t(0));
  }
}

// A list of N banks [L, d, K] → one [N, L, K, d] in the accumulation type (`acc`, the opmath type
// of the banks' dtype), by a plain loop: one allocation where a stack, a cast and a transpose
// would be three ops and two copies per read; the padding past each kernel's length is not
// transposed (transpose_taps).
inline at::Tensor stacked_taps_kd(at::TensorList conv, at::ScalarType acc, const std::vector<int64_t>& lengths) {
  const int64_t N = int64_t(conv.size()), L = conv[0].size(0), d = conv[0].size(1), K = conv[0].size(2);
  at::Tensor out = at::empty({N, L, K, d}, conv[0].options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, conv[0].scalar_type(), "stacked_taps_kd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    TORCH_INTERNAL_ASSERT(out.scalar_type() == c10::CppTypeToScalarType<acc_t>::value);
    for (int64_t n = 0; n < N; ++n) {
      const at::Tensor c = conv[size_t(n)].contiguous();
      transpose_taps(out.mutable_data_ptr<acc_t>() + n * L * K * d, c.const_data_ptr<scalar_t>(), L, d, K, lengths);
    }
  });
  return out;
}

// The length of each of the L = m − 1 kernels of a bank zero-padded to K taps (MSAR Appendix C:
// κ = {4, 8, 12} padded to 12): `lengths` when the caller gives them, each in 1 … K, else K. Taps
// at δ ≥ length are padding, not parameters: they are not read and their gradient is zero.
inline std::vector<int64_t> kernel_lengths(c10::OptionalIntArrayRef lengths, int64_t L, int64_t K, const char* op) {
  if (!lengths.has_value()) return std::vector<int64_t>(L, K);
  if (int64_t(lengths->size()) != L)
    fail(op, ": kernel_lengths has ", lengths->size(), " entries, expected one per convolved stream (m - 1 = ", L, ")");
  for (size_t r = 0; r < lengths->size(); ++r)
    if ((*lengths)[r] < 1 || (*lengths)[r] > K)
      fail(op, ": kernel_lengths[", r, "] = ", (*lengths)[r], " is outside 1 ... K = ", K, " (the padded kernel)");
  return lengths->vec();
}

// Per kernel of taps [..., L, K, d]: 1 + the last δ below its length with a nonzero tap. Taps after
// it are zero (padding, or a kernel's own zeros at its end): the expansion and ∂x skip them, which
// is exact; ∂c skips only the padding (zero_padding), as the kernel's own zero taps have gradients.
// A plain scan from each kernel's last tap back (one row of d for a kernel whose last tap is
// nonzero), not ATen ops: a decoding step calls it per read.
inline std::vector<int64_t> taps_used(const at::Tensor& taps_kd, const std::vector<int64_t>& lengths) {
  const int64_t K = taps_kd.size(-2), d = taps_kd.size(-1), L = int64_t(lengths.size());
  std::vector<int64_t> used(size_t(taps_kd.numel() / std::max<int64_t>(K * d, 1)), 0);
  AT_DISPATCH_FLOATING_TYPES(taps_kd.scalar_type(), "taps_used", [&] {
    const scalar_t* c = taps_kd.const_data_ptr<scalar_t>();  // contiguous (stacked_taps_kd)
    for (size_t k = 0; k < used.size(); ++k)
      for (int64_t delta = lengths[k % size_t(L)] - 1; delta >= 0 && used[k] == 0; --delta) {
        const scalar_t* row = c + (int64_t(k) * K + delta) * d;
        if (std::any_of(row, row + d, [](scalar_t v) { return v != scalar_t(0); })) used[k] = delta + 1;
      }
  });
  return used;
}

// Zeroes the gradient of the padding of taps gradients [..., L, K, d]: taps δ ≥ lengths[r].
inline void zero_padding(const at::Tensor& grad_taps_kd, const std::vector<int64_t>& lengths) {
  const int64_t K = grad_taps_kd.size(-2);
  for (size_t r = 0; r < lengths.size(); ++r)
    if (lengths[r] < K) grad_taps_kd.select(-3, int64_t(r)).narrow(-2, lengths[r], K - lengths[r]).zero_();
}

}  // namespace depthkit::cpu
