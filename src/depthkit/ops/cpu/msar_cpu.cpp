// CPU kernels of the fused MSAR read (MSAR eq. 9–12, 17 phase 1; DAR eq. A.1–A.5) and of the
// fused partial merge + stream fusion (DAR eq. A.6–A.10; MSAR eq. 13–14), with hand-written
// backward passes. The expanded streams are never written to memory (MSAR §3.4, Table 6).
//
// Layout: queries q [m, d] (the read: S of them, one per branch of a block, each with its own out
// and ζ; each expansion serves all S); raw sources x: a list of N [B, T, d] (never stacked, kernel_math.h);
// their banks c: a list of N [m−1, d, K] (zero-padded to the largest kernel K; used here stacked as
// [N, m−1, K, d], a parameter-sized copy, so the loops over d are contiguous); out [m, B, T, d];
// ζ [m, B, T]. Accumulation in float32 (float64 for float64 inputs); bfloat16 storage accepted;
// expansions, normalised keys and weights live in thread-local buffers in the accumulation type.
//
// Read forward, per token (b, t) and source n, stream r (eq. 10):
//   v⁽⁰⁾ = x_{n,t},   v⁽ʳ⁾ = Σ_{δ<K, δ≤t} c_{n,r,δ} ⊙ x_{n,t−δ}      (zero before t = 0, per batch row)
//   s = 1/√(mean_d v² + ε),  a = s (q_r · v)                          (A.1)
// and stream r's online softmax over n: running max, shifted sum Z, numerator U (A.2–A.4);
//   out_r = U / Z,  ζ_r = max + log Z                                  (A.5)
//
// Read backward recomputes v, s, a and w = exp(a − ζ_r) per (r, n), then
//   g·out = Σ_n w_n (g·v_n),  ∂a_n = w_n (g·v_n − g·out) + ḡ_ζ w_n,
//   ∂v_n = w_n g + ∂a_n (s q_r − s³ (q_r·v_n) v_n / d),  ∂q_r += ∂a_n s v_n,
//   ∂x_{n,t−δ} += c_{n,r,δ} ⊙ ∂v_n,  ∂c_{n,r,δ} += ∂v_n ⊙ x_{n,t−δ}    (identity for r = 0).
// With S queries, ∂v_n is the sum of their terms (key_grads, the second on with ADD) before the
// one transpose: ∂x and ∂c are linear in ∂v.
// The ∂x scatter reaches K − 1 tokens back: tokens are cut into tiles of at least K − 1 per batch
// row and the even tiles run in parallel, then the odd ones, so no two tasks write one token.
// Query and tap gradients are sums over tokens: one partial sum per group of tiles (a fixed number
// of tokens, causal_window.h), added at the end, so they do not depend on the number of threads.
// Taps after a kernel's last nonzero tap (the zero padding of the shorter kernels) are skipped in
// the expansion and in ∂x, which is exact; ∂c is computed for the taps within each kernel's length
// (the optional kernel_lengths; all K without them) and is zero for the padding.
// The expansions and their transposes run a tile of kTile tokens of one batch row at a time, in
// register blocks (window_block): 8 rows (AVX-512; 4 on AVX2) × two registers of d (16 float32 values on AVX2, 32 on
// AVX-512) summed in registers, each tap (or source row) read once for the 4 rows; ∂c is summed
// over the tile before it is added to the group's partial, and ∂x gathers Σ_δ c_δ ⊙ ∂v_{s+δ} per
// row s, one update of ∂x_s per tile.
//
// Merge-fuse forward, per token: with the partial p (bank c'),
//   v_r = expansion of p,  a_r = s_r (q_r·v_r),  λ_r = σ(ζ_r − a_r),
//   z_r = λ_r out_r + (1 − λ_r) v_r                                    (A.8–A.10)
// or z_r = out_r at a block's first branch; then
//   S = 1/√(mean over m·d of z² + ε),  y_j = W_j · z,  π_j = σ(α S y_j + b_j),  h = Σ_r π_r z_r
// (eq. 13–14), or h = mean_r z_r. Backward, with u_j = (g·z_j) π_j (1 − π_j):
//   ∂b_j += u_j,  ∂α += Σ_j u_j S y_j,  ∂W_j += u_j α S z,
//   ∂z = π ⊙ g + α S Σ_j u_j W_j − α S³ (Σ_j u_j y_j) z / (m d);
//   ∂out_r = λ_r ∂z_r,  ∂ζ_r = (∂z_r·(out_r − v_r)) λ_r (1 − λ_r),  ∂a_r = −∂ζ_r,
//   ∂v_r = (1 − λ_r) ∂z_r + ∂a_r (s q_r − s³ (q_r·v_r) v_r / d), then as in the read.
#include "depthkit/ops/cpu/msar_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "depthkit/ops/cpu/causal_window.h"
#include "depthkit/ops/cpu/kernel_math.h"
#include "depthkit/ops/cpu/row_blocks.h"
#include "depthkit/util/error.h"

namespace depthkit::cpu {

namespace {

inline int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }
// The read backward's sub-tile: twice kTile. Its transposes reach K − 1 rows past either end of a
// sub-tile with zero rows of ∂v, work that is a smaller share of a longer one (at κ = 12 and 32
// tokens about a third of ∂x's multiply-adds; measured 10 % faster at 64 on the 0.1B width). Its
// buffers hold one stream of the N sources, where the fusion's hold all m streams of a token:
// those stay at kTile.
constexpr int64_t kReadBackTile = 2 * kTile;
static_assert(kTile % 4 == 0, "the H_pre products run blocks of 4 tokens within a tile");

// The H_pre gates of a tile's tokens, as small matrix products over the tile (eq. 13): the merged
// streams Z [rows, m·d] (a token's m streams side by side), W_pre padded to m4 rows (a multiple of
// 4; the rows past m are zero) and the per-token coefficients U [rows, m4]. rows is a multiple of 4
// (the tile's buffers have room; rows past the tile's tokens are zero, and so are their U). Each
// product runs in register blocks of 4 tokens × 4 rows of W_pre, so that a row of W_pre (m·d
// values) is read once per 4 tokens and a row of ∂W_pre updated in memory once per tile, where a
// token at a time reads all of W_pre and updates all of ∂W_pre per token.
// Y [rows, m4] = Z · W_preᵀ: y_{t,j} = W_j · z_t.
template <class acc_t>
void gate_logits(acc_t* Y, const acc_t* Z, const acc_t* W, int64_t rows, int64_t m4, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t lanes = Reg<acc_t>::lanes;
  const int64_t nv = n / lanes * lanes;
  for (int64_t t0 = 0; t0 < rows; t0 += 4)
    for (int64_t j0 = 0; j0 < m4; j0 += 4) {
      V acc[4][4] = {};
      for (int64_t i = 0; i < nv; i += lanes) {
        V w[4], z[4];
        for (int64_t a = 0; a < 4; ++a) w[a] = load<acc_t>(W + (j0 + a) * n + i);
        for (int64_t a = 0; a < 4; ++a) z[a] = load<acc_t>(Z + (t0 + a) * n + i);
        for (int64_t a = 0; a < 4; ++a)
          for (int64_t b = 0; b < 4; ++b) acc[a][b] += z[a] * w[b];
      }
      for (int64_t a = 0; a < 4; ++a)
        for (int64_t b = 0; b < 4; ++b) {
          acc_t sum = lane_sum<acc_t>(acc[a][b]);
          for (int64_t i = nv; i < n; ++i) sum += Z[(t0 + a) * n + i] * W[(j0 + b) * n + i];
          Y[(t0 + a) * m4 + j0 + b] = sum;
        }
    }
}

// dZ [rows, n] += U · W_pre: ∂z_t += Σ_j u_{t,j} W_j.
template <class acc_t>
void add_gate_inputs_grad(acc_t* dZ, const acc_t* U, const acc_t* W, int64_t rows, int64_t m4, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t lanes = Reg<acc_t>::lanes;
  const int64_t nv = n / lanes * lanes;
  for (int64_t t0 = 0; t0 < rows; t0 += 4) {
    const acc_t* u = U + t0 * m4;
    for (int64_t i = 0; i < nv; i += lanes) {
      V acc[4];
      for (int64_t a = 0; a < 4; ++a) acc[a] = load<acc_t>(dZ + (t0 + a) * n + i);
      for (int64_t j = 0; j < m4; ++j) {
        const V w = load<acc_t>(W + j * n + i);
        for (int64_t a = 0; a < 4; ++a) acc[a] += u[a * m4 + j] * w;
      }
      for (int64_t a = 0; a < 4; ++a) std::memcpy(dZ + (t0 + a) * n + i, &acc[a], sizeof(V));
    }
    for (int64_t i = nv; i < n; ++i)
      for (int64_t a = 0; a < 4; ++a)
        for (int64_t j = 0; j < m4; ++j) dZ[(t0 + a) * n + i] += u[a * m4 + j] * W[j * n + i];
  }
}

// gW [m, n] += Uᵀ · Z: ∂W_j += Σ_t u_{t,j} z_t (the m rows of ∂W_pre; U's columns past m are not read).
template <class acc_t>
void add_gate_weights_grad(acc_t* gW, const acc_t* U, const acc_t* Z, int64_t rows, int64_t m, int64_t m4, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t lanes = Reg<acc_t>::lanes;
  const int64_t nv = n / lanes * lanes;
  for (int64_t j0 = 0; j0 < m; j0 += 4) {
    const int64_t jb = std::min<int64_t>(4, m - j0);
    for (int64_t i = 0; i < nv; i += lanes) {
      V acc[4] = {};
      for (int64_t t = 0; t < rows; ++t) {
        const V z = load<acc_t>(Z + t * n + i);
        for (int64_t b = 0; b < 4; ++b) acc[b] += U[t * m4 + j0 + b] * z;
      }
      for (int64_t b = 0; b < jb; ++b) {
        acc_t* g = gW + (j0 + b) * n + i;
        const V sum = load<acc_t>(g) + acc[b];
        std::memcpy(g, &sum, sizeof(V));
      }
    }
    for (int64_t i = nv; i < n; ++i)
      for (int64_t b = 0; b < jb; ++b) {
        acc_t sum = 0;
        for (int64_t t = 0; t < rows; ++t) sum += U[t * m4 + j0 + b] * Z[t * n + i];
        gW[(j0 + b) * n + i] += sum;
      }
  }
}

// The H_pre gates of a tile's nt tokens (eq. 13), shared by msar_fuse and its backward: per token
// S = 1/rms(z) over its m·d entries (from zz, its Σ z², merge_tile), y_j = W_j · z, π_j = σ(α S y_j + b_j). Writes S [rows] and
// y [rows, m4] (rows = nt rounded up to 4) and π [nt, m4] (its first m columns); the backward needs all three.
template <class acc_t>
void hpre_gates(acc_t* S, acc_t* y, acc_t* pre, const acc_t* Z, const acc_t* zz, const acc_t* W4, const acc_t* b,
                acc_t alpha, int64_t nt, int64_t m, int64_t m4, int64_t md, double eps) {
  gate_logits(y, Z, W4, round_up4(nt), m4, md);
  for (int64_t t = 0; t < nt; ++t) {
    S[t] = inv_rms<acc_t>(zz[t], md, eps);
    for (int64_t j = 0; j < m; ++j) pre[t * m4 + j] = sigmoid(alpha * S[t] * y[t * m4 + j] + b[j]);
  }
}

// Stream r of one source on the nt tokens t0, … of one batch row (eq. 10), x0 pointing at row t0,
// with the taps of its bank (taps [banks, K, d], `used` per bank): the identity stream (r = 0) is
// the source itself, read in place where it is stored in the accumulation type; any other stream
// is expanded into buf [nt, d]. Returns the rows.
template <class acc_t, class scalar_t>
const acc_t* stream_rows(acc_t* buf, const scalar_t* x0, const acc_t* taps, const std::vector<int64_t>& used,
                         int64_t bank, int64_t r, int64_t K, int64_t t0, int64_t nt, int64_t d) {
  if (r == 0) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) return x0;
    expand_tile(buf, x0, static_cast<const acc_t*>(nullptr), 1, t0, nt, d);
    return buf;
  }
  expand_tile(buf, x0, taps + bank * K * d, used[bank], t0, nt, d);
  return buf;
}

// The merged streams of a tile's nt tokens (A.8–A.10), shared by msar_fuse and its backward, into
// Z [nt, m·d] (a token's m streams side by side); out_r's rows of the tile at o + r·P·d, ζ_r's at
// lse + r·P. With the partial (its row t0 at x0, banks [m − 1, K, d]): per stream r its expansion
// (stream_rows, into V [m, tile, d]; rows[r] its rows) and the rows' (Σ v², q_r · v) in one
// blocked pass (row_dots); then per token s = 1/rms(v), λ = σ(ζ_r − s (q_r · v)) and
// z_r = λ out_r + (1 − λ) v, keeping s, q_r · v and λ at [r·tile + j] for the backward. Without it,
// z_r = out_r. zz [nt]: each token's Σ z² over its m·d entries, for the fusion's rms (eq. 13). The
// backward's (g: the tile's first row of ∂h) also g · z_r at gz[r·tile + j], in the same pass.
template <class acc_t, class scalar_t>
void merge_tile(acc_t* Z, acc_t* zz, acc_t* gz, acc_t* s, acc_t* qv, acc_t* lam, const acc_t** rows, acc_t* V,
                int64_t tile, const scalar_t* o, const acc_t* lse, int64_t P, const acc_t* q, const scalar_t* x0,
                const acc_t* taps, const std::vector<int64_t>& used, int64_t K, const scalar_t* g, int64_t t0,
                int64_t nt, int64_t m, int64_t d, double eps) {
  const int64_t md = m * d;
  std::fill_n(zz, nt, acc_t(0));
  // z_r of token j from a and b, as mix_row: with g · z_r where the backward asks for it.
  auto mix = [&](int64_t j, int64_t r, const scalar_t* a, const acc_t* b, acc_t l) {
    acc_t* z = Z + j * md + r * d;
    zz[j] += g == nullptr ? mix_row<false>(z, a, b, l, g, gz, d)
                          : mix_row<true>(z, a, b, l, g + j * d, gz + r * tile + j, d);
  };
  for (int64_t r = 0; r < m; ++r) {
    const scalar_t* o_r = o + r * P * d;
    if (x0 == nullptr) {  // a block's first branch: z_r = out_r
      for (int64_t j = 0; j < nt; ++j) mix(j, r, o_r + j * d, nullptr, acc_t(1));
      continue;
    }
    const acc_t* v = rows[r] = stream_rows(V + r * tile * d, x0, taps, used, r - 1, r, K, t0, nt, d);
    acc_t* ss = s + r * tile;  // (Σ v², then s)
    acc_t* dots = qv + r * tile;
    row_dots<false>(ss, dots, static_cast<acc_t*>(nullptr), v, q + r * d, static_cast<const acc_t*>(nullptr), nt, d);
    for (int64_t j = 0; j < nt; ++j) {
      const acc_t sj = inv_rms<acc_t>(ss[j], d, eps);
      const acc_t l = acc_t(1) / (acc_t(1) + std::exp(sj * dots[j] - lse[r * P + j]));  // (A.8, A.9)
      ss[j] = sj;
      lam[r * tile + j] = l;
      mix(j, r, o_r + j * d, v + j * d, l);  // (A.10)
    }
  }
}

void check_read(at::TensorList queries, at::TensorList x, at::TensorList c, int64_t context = 0) {
  if (queries.empty()) fail("msar_read: needs at least one query tensor");
  if (x.empty()) fail("msar_read: needs at least one source");
  const at::Tensor& q = queries[0];
  if (q.dim() != 2 || x[0].dim() != 3) fail("msar_read: expected queries [m, d], sources [B, T, d] each");
  const int64_t m = q.size(0), d = q.size(1);
  if (m < 1) fail("msar_read: needs at least one stream");
  for (size_t j = 1; j < queries.size(); ++j) {
    if (queries[j].sizes() != q.sizes())
      fail("msar_read: queries ", j, " are ", queries[j].sizes(), ", queries 0 ", q.sizes());
    if (queries[j].scalar_type() != q.scalar_type()) fail("msar_read: every queries tensor must share a dtype");
  }
  if (x[0].size(2) != d) fail("msar_read: queries have d = ", d, ", sources d = ", x[0].size(2));
  if (c.size() != x.size()) fail("msar_read: ", x.size(), " sources and ", c.size(), " banks (conv)");
  for (size_t n = 0; n < x.size(); ++n) {
    if (x[n].sizes() != x[0].sizes()) fail("msar_read: source ", n, " is ", x[n].sizes(), ", source 0 ", x[0].sizes());
    if (c[n].dim() != 3 || c[n].size(0) != m - 1 || c[n].size(1) != d || c[n].size(2) < 1 ||
        c[n].sizes() != c[0].sizes())
      fail("msar_read: conv ", n, " is ", c[n].sizes(), ", expected [m - 1, d, K] = [", m - 1, ", ", d,
           ", K >= 1] as conv 0");
    if (x[n].scalar_type() != q.scalar_type() || c[n].scalar_type() != q.scalar_type())
      fail("msar_read: queries, sources and conv must share a dtype");
  }
  if (context < 0 || context >= x[0].size(1))
    fail("msar_read: context = ", context, " must leave a position of the sources' T = ", x[0].size(1),
         " (0 <= context < T)");
}

struct FuseArgs {
  int64_t m, B, T, d, K;
  int64_t Tx;  // the partial's positions: T + context
  bool partial, hpre;
};

FuseArgs check_fuse(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& part,
                    const at::Tensor& pconv, const at::Tensor& w, const at::Tensor& b, const at::Tensor& alpha,
                    int64_t context) {
  if (out.dim() != 4 || lse.dim() != 3 || q.dim() != 2)
    fail("msar_fuse: expected out [m, B, T, d], log_partition [m, B, T], queries [m, d]");
  FuseArgs a{out.size(0), out.size(1), out.size(2), out.size(3), 1, out.size(2) + context, part.defined(), w.defined()};
  if (lse.sizes() != out.sizes().slice(0, 3)) fail("msar_fuse: log_partition ", lse.sizes(), " vs out ", out.sizes());
  if (q.size(0) != a.m || q.size(1) != a.d) fail("msar_fuse: queries ", q.sizes(), " vs out ", out.sizes());
  if (part.defined() != pconv.defined()) fail("msar_fuse: partial and partial_conv come together");
  if (context < 0 || (context > 0 && !part.defined()))
    fail("msar_fuse: context = ", context, " must be 0, or positive with a partial (its window rows)");
  if (a.partial) {
    if (part.dim() != 3 || part.size(0) != a.B || part.size(1) != a.Tx || part.size(2) != a.d)
      fail("msar_fuse: partial ", part.sizes(), " vs [B, context + T, d] of out ", out.sizes(), " and context = ",
           context);
    if (pconv.dim() != 3 || pconv.size(0) != a.m - 1 || pconv.size(1) != a.d || pconv.size(2) < 1)
      fail("msar_fuse: partial_conv ", pconv.sizes(), " does not match [m - 1, d, K] = [", a.m - 1, ", ", a.d, ", K]");
    a.K = pconv.size(2);
  }
  if (w.defined() != b.defined() || w.defined() != alpha.defined())
    fail("msar_fuse: w_pre, b_pre and alpha_pre come together (none of them: mean fusion)");
  if (a.hpre && (w.dim() != 2 || w.size(0) != a.m || w.size(1) != a.m * a.d || b.numel() != a.m || alpha.numel() != 1))
    fail("msar_fuse: expected w_pre [m, m d], b_pre [m], alpha_pre [1] for m = ", a.m, ", d = ", a.d);
  return a;
}

// The optional inputs of msar_fuse and its backward, contiguous and in the types the kernels read:
// the partial (storage type) with its taps [K, d] per stream and their used lengths; W_pre (padded
// to a multiple of 4 rows), b_pre (accumulation type) and α_pre.
struct FuseInputs {
  at::Tensor x, c, W, bias;
  std::vector<int64_t> lengths, used;
  double alpha = 0.0;
};
FuseInputs fuse_inputs(const FuseArgs& A, at::ScalarType storage, at::ScalarType acc, const at::Tensor& partial,
                       const at::Tensor& partial_conv, const at::Tensor& w_pre, const at::Tensor& b_pre,
                       const at::Tensor& alpha_pre, c10::OptionalIntArrayRef lengths) {
  FuseInputs in;
  if (A.partial) {
    in.x = contiguous_as(partial, storage);
    in.lengths = kernel_lengths(lengths, A.m - 1, A.K, "msar_fuse");
    in.c = stacked_taps_kd({partial_conv}, acc, in.lengths)[0];
    in.used = taps_used(in.c, in.lengths);
  }
  if (A.hpre) {  // W_pre padded to a multiple of 4 rows with zeros (hpre_gates' register blocks)
    if (round_up4(A.m) == A.m) {
      in.W = contiguous_as(w_pre, acc);
    } else {
      in.W = at::zeros({round_up4(A.m), A.m * A.d}, w_pre.options().dtype(acc));
      in.W.narrow(0, 0, A.m).copy_(w_pre);
    }
    in.bias = contiguous_as(b_pre, acc);
    // α read in place (a CPU scalar), not by item(): one operator call less per read.
    const at::Tensor a = alpha_pre.contiguous();
    in.alpha = AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, a.scalar_type(), "msar_fuse alpha",
                                              [&] { return double(*a.const_data_ptr<scalar_t>()); });
  }
  return in;
}

}  // namespace

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> msar_read_forward(at::TensorList queries,
                                                                               at::TensorList sources,
                                                                               at::TensorList conv, double eps,
                                                                               c10::OptionalIntArrayRef lengths_,
                                                                               int64_t context) {
  check_read(queries, sources, conv, context);
  const auto acc_type = acc_type_of(queries[0]);
  const std::vector<at::Tensor> x = contiguous_all(sources);
  const int64_t K = conv[0].size(2);
  const std::vector<int64_t> lengths = kernel_lengths(lengths_, conv[0].size(0), K, "msar_read");
  const at::Tensor c = stacked_taps_kd(conv, acc_type, lengths);
  std::vector<at::Tensor> q;
  for (const at::Tensor& qj : queries) q.push_back(contiguous_as(qj, acc_type));
  const std::vector<int64_t> used = taps_used(c, lengths);
  const int64_t S = int64_t(q.size()), m = q[0].size(0), N = int64_t(x.size()), B = x[0].size(0), T = x[0].size(1),
                d = x[0].size(2);
  const int64_t To = T - context, P = B * To;  // the positions read: context … T − 1
  std::vector<at::Tensor> out, lse;
  for (int64_t j = 0; j < S; ++j) {
    out.push_back(at::empty({m, B, To, d}, x[0].options()));
    lse.push_back(at::empty({m, B, To}, x[0].options().dtype(acc_type)));
  }
  // The kernel is a generic lambda outside the dispatch macro: pragmas may not appear in macro arguments.
  auto kernel = [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = at::opmath_type<scalar_t>;
    const std::vector<const scalar_t*> xp = data_of<scalar_t>(x);
    const std::vector<const acc_t*> qp = data_of<acc_t>(q);
    const std::vector<scalar_t*> op = mutable_data_of<scalar_t>(out);
    const std::vector<acc_t*> lp = mutable_data_of<acc_t>(lse);
    const acc_t* cp = c.const_data_ptr<acc_t>();
    // Tiles of kTile tokens of one batch row. Per stream r: the expansions of every source for the
    // whole tile (expand_tile, E [N, kTile, d]), each read by every query: its (Σ v², q·v); then
    // per query the scores, the softmax over the sources and out token by token. (The scores of a
    // tile are independent of one another, so their square roots and exponentials overlap, where
    // an online softmax token by token waits on each in turn.) The tiles cover the positions read;
    // the context before them is read only through the expansions' windows.
    // (A tile of at most the positions read: a decoding step's buffers hold its one position.)
    const int64_t tile = std::min(kTile, To), tiles = (To + tile - 1) / tile;
    at::parallel_for(0, B * tiles, 1, [&](int64_t c0, int64_t c1) {
      Scratch<acc_t> E(N * tile * d), a(S * N * tile), ss(tile), w(N);
      std::vector<const acc_t*> rows(N);  // stream r of each source on the tile: in E, or the source itself
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = c / tiles, t0 = context + (c % tiles) * tile, nt = std::min(T, t0 + tile) - t0;
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t n = 0; n < N; ++n) {
            rows[n] = stream_rows(E.data() + n * tile * d, xp[n] + (b * T + t0) * d, cp, used, n * (m - 1) + r - 1, r, K, t0, nt, d);
            row_dots_per_query<false>(
                ss.data(), a.data() + n * tile, static_cast<acc_t*>(nullptr), N * tile, rows[n], S,
                [&](int64_t j) { return qp[j] + r * d; }, [](int64_t) { return static_cast<const acc_t*>(nullptr); },
                nt, d);
            for (int64_t i = 0; i < nt; ++i) {
              const acc_t si = inv_rms<acc_t>(ss[i], d, eps);
              for (int64_t j = 0; j < S; ++j) a[(j * N + n) * tile + i] *= si;  // (A.1)
            }
          }
          for (int64_t j = 0; j < S; ++j) {
            const acc_t* aj = a.data() + j * N * tile;
            for (int64_t i = 0; i < nt; ++i) {
              const int64_t p = b * To + t0 - context + i;
              acc_t mx = -std::numeric_limits<acc_t>::infinity(), Z = 0;
              for (int64_t n = 0; n < N; ++n) mx = std::max(mx, aj[n * tile + i]);  // (A.2)
              for (int64_t n = 0; n < N; ++n) Z += w[n] = std::exp(aj[n * tile + i] - mx);  // (A.3)
              weighted_row_sum(op[j] + (r * P + p) * d, w.data(), 1, rows.data(), i * d, N, acc_t(1) / Z, d);  // (A.4, A.5)
              lp[j][r * P + p] = mx + std::log(Z);
            }
          }
        }
      }
    });
  };
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, queries[0].scalar_type(), "msar_read_forward", [&] { kernel(scalar_t(0)); });
  return {out, lse};
}

std::tuple<at::Tensor, std::vector<at::Tensor>> msar_read_backward(
    const std::vector<at::Tensor>& grad_out, const std::vector<at::Tensor>& grad_lse, at::TensorList queries,
    at::TensorList sources, at::TensorList conv, at::TensorList lse_, double eps, c10::OptionalIntArrayRef lengths_,
    at::TensorList gx) {
  check_read(queries, sources, conv);
  const int64_t S = int64_t(queries.size());
  if (int64_t(grad_out.size()) != S || int64_t(grad_lse.size()) != S || int64_t(lse_.size()) != S)
    fail("msar_read_backward: ", S, " queries, ", grad_out.size(), " grad_out, ", grad_lse.size(),
         " grad_log_partition and ", lse_.size(), " log_partition");
  const auto acc_type = acc_type_of(queries[0]);
  const std::vector<at::Tensor> x = contiguous_all(sources);
  const int64_t K = conv[0].size(2);
  const std::vector<int64_t> lengths = kernel_lengths(lengths_, conv[0].size(0), K, "msar_read");
  const at::Tensor c = stacked_taps_kd(conv, acc_type, lengths);
  const std::vector<int64_t> used = taps_used(c, lengths);
  const int64_t m = queries[0].size(0), N = int64_t(x.size()), B = x[0].size(0), T = x[0].size(1), d = x[0].size(2);
  const int64_t P = B * T, L = m - 1;
  const auto options = x[0].options();
  std::vector<at::Tensor> q, lse, go, gl;
  for (int64_t j = 0; j < S; ++j) {
    q.push_back(contiguous_as(queries[j], acc_type));
    lse.push_back(contiguous_as(lse_[j], acc_type));
    if (lse[j].sizes() != at::IntArrayRef({m, B, T}))
      fail("msar_read_backward: log_partition ", j, " is ", lse[j].sizes(), ", expected [m, B, T] = [", m, ", ", B,
           ", ", T, "]");
    go.push_back(grad_out[j].defined() ? grad_out[j].contiguous() : at::zeros({m, B, T, d}, options));
    gl.push_back(grad_lse[j].defined() ? contiguous_as(grad_lse[j], acc_type) : at::zeros({m, B, T}, lse[j].options()));
  }
  check_gradient_buffers("msar_read_backward: grad_sources", gx, N, {B, T, d}, acc_type);  // added into
  constexpr int64_t sub = kReadBackTile;
  const TileGroups tiles = tile_groups(B, T, K, sub);  // one partial sum of ∂q and ∂c per group
  at::Tensor gq_parts = at::zeros({tiles.groups, S, m, d}, options.dtype(acc_type));
  at::Tensor gc_parts = at::zeros({tiles.groups, N, L, K, d}, options.dtype(acc_type));
  // The kernel is a generic lambda outside the dispatch macro: pragmas may not appear in macro arguments.
  auto kernel = [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = at::opmath_type<scalar_t>;
    const std::vector<const scalar_t*> xp = data_of<scalar_t>(x), gop = data_of<scalar_t>(go);
    const std::vector<acc_t*> gxp = mutable_data_of<acc_t>(gx);
    const std::vector<const acc_t*> qp = data_of<acc_t>(q), lp = data_of<acc_t>(lse), glp = data_of<acc_t>(gl);
    const acc_t* cp = c.const_data_ptr<acc_t>();
    acc_t *gq_all = gq_parts.mutable_data_ptr<acc_t>(),
          *gc_all = gc_parts.mutable_data_ptr<acc_t>();
    const int64_t pad = K - 1;  // zero rows of ∂v before and after a tile (expand_backward_tile)
    for_each_tile(tiles, T, [&](int64_t b, int64_t t0, int64_t t1, int64_t group) {
      acc_t* gq = gq_all + group * S * m * d;  // query j's [m, d] at j·m·d
      acc_t* gc = gc_all + group * N * L * K * d;
      // Per sub-tile of `sub` tokens and stream r: the expansions of all sources V [N, sub, d] and
      // per (n, t) s; per query j and (n, t) q·v, w, g·v, and per (j, t) g·out; then per source ∂v
      // of the tile, summed over the queries (they read the same candidates), and its transpose,
      // once. ∂x of the sub-tile and the pad rows before it, per source, is gathered in GX over the
      // streams (add_rows).
      const int64_t gx_rows = sub + pad;
      Scratch<acc_t> V(N * sub * d), DV((sub + 2 * pad) * d, acc_t(0)), GX(N * gx_rows * d), s(N * sub),
          qv(S * N * sub), w(S * N * sub), gdotv(S * N * sub), g_out(S * sub), beta(sub), gamma(sub);
      std::vector<const acc_t*> rows(N);  // stream r of each source on the sub-tile (stream_rows)
      acc_t* dv0 = DV.data() + pad * d;
      for (int64_t u0 = t0; u0 < t1; u0 += sub) {
        const int64_t u1 = std::min(t1, u0 + sub), nt = u1 - u0, p0 = b * T + u0;
        std::fill(dv0 + nt * d, dv0 + (nt + pad) * d, acc_t(0));  // (the last sub-tile may be shorter)
        // GX's rows of the sub-tile are first written by the identity stream (r = 0, below); only
        // the pad rows before them start at zero.
        for (int64_t n = 0; n < N; ++n) std::fill_n(GX.data() + n * gx_rows * d, pad * d, acc_t(0));
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t n = 0; n < N; ++n) {
            const acc_t* Vn = rows[n] =
                stream_rows(V.data() + n * sub * d, xp[n] + (b * T + u0) * d, cp, used, n * L + r - 1, r, K, u0, nt, d);
            acc_t* sn = s.data() + n * sub;
            row_dots_per_query<true>(
                sn, qv.data() + n * sub, gdotv.data() + n * sub, N * sub, Vn, S, [&](int64_t j) { return qp[j] + r * d; },
                [&](int64_t j) { return gop[j] + (r * P + p0) * d; }, nt, d);
            for (int64_t i = 0; i < nt; ++i) sn[i] = inv_rms<acc_t>(sn[i], d, eps);
            for (int64_t j = 0; j < S; ++j) {
              const int64_t k0 = (j * N + n) * sub;
              for (int64_t i = 0; i < nt; ++i) w[k0 + i] = std::exp(sn[i] * qv[k0 + i] - lp[j][r * P + p0 + i]);
            }
          }
          for (int64_t j = 0; j < S; ++j)
            for (int64_t i = 0; i < nt; ++i) {  // g · out = Σ_n w_n (g · v_n)
              acc_t go_i = 0;
              for (int64_t n = 0; n < N; ++n) go_i += w[(j * N + n) * sub + i] * gdotv[(j * N + n) * sub + i];
              g_out[j * sub + i] = go_i;
            }
          for (int64_t n = 0; n < N; ++n) {
            // Per token: ∂a, then ∂v = w g + ∂a s q − ∂a s³ (q·v) v / d, and ∂q in the same pass
            // over v (key_grads), the queries' terms added. The identity stream's ∂v is ∂x's share
            // itself (its transpose is the identity): written to GX directly, the first of the
            // terms of its rows.
            const acc_t* Vn = rows[n];
            const acc_t* sn = s.data() + n * sub;
            acc_t* dv = r == 0 ? GX.data() + (n * gx_rows + pad) * d : dv0;
            for (int64_t j = 0; j < S; ++j) {
              const int64_t k0 = (j * N + n) * sub;
              for (int64_t i = 0; i < nt; ++i) {
                const int64_t k = k0 + i;
                const acc_t da = w[k] * (gdotv[k] - g_out[j * sub + i]) + glp[j][r * P + p0 + i] * w[k];
                beta[i] = da * sn[i];
                gamma[i] = da * sn[i] * sn[i] * sn[i] * qv[k] / acc_t(d);
              }
              const scalar_t* g0 = gop[j] + (r * P + p0) * d;
              const acc_t *qr = qp[j] + r * d, *wn = w.data() + k0;
              acc_t* gqr = gq + (j * m + r) * d;
              if (j == 0) {
                key_grads(dv, gqr, Vn, g0, d, qr, wn, beta.data(), gamma.data(), nt, d);
              } else {
                key_grads<true>(dv, gqr, Vn, g0, d, qr, wn, beta.data(), gamma.data(), nt, d);
              }
            }
            if (r == 0) continue;
            const int64_t bank = n * L + r - 1;
            expand_backward_tile(dv0, GX.data() + (n * gx_rows + pad) * d, gc + bank * K * d, xp[n] + b * T * d,
                                 cp + bank * K * d, used[bank], lengths[r - 1], K, u0, u1, d);
          }
        }
        for (int64_t n = 0; n < N; ++n) add_rows(gxp[n] + b * T * d, GX.data() + n * gx_rows * d, K, u0, u1, d);
      }
    });
  };
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, queries[0].scalar_type(), "msar_read_backward", [&] { kernel(scalar_t(0)); });
  const auto st = queries[0].scalar_type();
  at::Tensor gq = gq_parts.sum(0).to(st);  // [S, m, d]
  at::Tensor gc_kd = gc_parts.sum(0);  // [N, m−1, K, d]
  zero_padding(gc_kd, lengths);
  std::vector<at::Tensor> gc = gc_kd.transpose(-1, -2).to(st).unbind(0);  // [m−1, d, K] per source
  return {gq, gc};
}

at::Tensor msar_fuse_forward(const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& queries,
                             const OptTensor& partial_opt, const OptTensor& partial_conv_opt,
                             const OptTensor& w_pre_opt, const OptTensor& b_pre_opt, const OptTensor& alpha_pre_opt,
                             double eps, c10::OptionalIntArrayRef lengths, int64_t context) {
  const at::Tensor partial = unwrap(partial_opt);
  const at::Tensor partial_conv = unwrap(partial_conv_opt);
  const at::Tensor w_pre = unwrap(w_pre_opt);
  const at::Tensor b_pre = unwrap(b_pre_opt);
  const at::Tensor alpha_pre = unwrap(alpha_pre_opt);
  const FuseArgs A = check_fuse(out_, lse_, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, context);
  const auto acc_type = acc_type_of(out_);
  const int64_t m = A.m, B = A.B, T = A.T, Tx = A.Tx, d = A.d, K = A.K, P = B * T;
  const at::Tensor o = out_.contiguous(), lse = contiguous_as(lse_, acc_type), q = contiguous_as(queries, acc_type);
  const FuseInputs in = fuse_inputs(A, out_.scalar_type(), acc_type, partial, partial_conv, w_pre, b_pre, alpha_pre, lengths);
  const at::Tensor &x = in.x, &c = in.c, &W = in.W, &bias = in.bias;
  const std::vector<int64_t>& used = in.used;
  const double alpha = in.alpha;
  at::Tensor h = at::empty({B, T, d}, o.options());
  // The kernel is a generic lambda outside the dispatch macro: pragmas may not appear in macro arguments.
  auto kernel = [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* op = o.const_data_ptr<scalar_t>();
    const scalar_t* xp = A.partial ? x.const_data_ptr<scalar_t>() : nullptr;
    const acc_t *lp = lse.const_data_ptr<acc_t>(), *qp = q.const_data_ptr<acc_t>();
    const acc_t* cp = A.partial ? c.const_data_ptr<acc_t>() : nullptr;
    const acc_t* Wp = A.hpre ? W.const_data_ptr<acc_t>() : nullptr;
    const acc_t* bp = A.hpre ? bias.const_data_ptr<acc_t>() : nullptr;
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    // Tiles of kTile tokens of one batch row: the expansions of the partial for the whole tile
    // (expand_tile, V [m, kTile, d]), the merged streams Z [kTile, m·d] token by token, the tile's
    // H_pre gates (hpre_gates), then h token by token. A tile's positions t0 … count the partial's
    // rows (the context first); out, ζ and h have none for the context.
    // (A tile of at most the positions fused; its gate products' rows rounded up to 4.)
    const int64_t tile = std::min(kTile, T), tiles = (T + tile - 1) / tile, rows4 = round_up4(tile), md = m * d,
                  m4 = round_up4(m);
    at::parallel_for(0, B * tiles, 1, [&](int64_t c0, int64_t c1) {
      Scratch<acc_t> V(A.partial ? m * tile * d : 0), Z(rows4 * md, acc_t(0)), pre(rows4 * m4), y(rows4 * m4),
          S(tile), zz(tile), sv(m * tile), qv(m * tile), lam(m * tile);
      std::vector<const acc_t*> rows(m), zrows(m);
      for (int64_t r = 0; r < m; ++r) zrows[r] = Z.data() + r * d;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = c / tiles, t0 = Tx - T + (c % tiles) * tile, nt = std::min(Tx, t0 + tile) - t0;
        std::fill(Z.begin() + nt * md, Z.begin() + round_up4(nt) * md, acc_t(0));  // (a shorter last tile)
        const int64_t p0 = b * T + t0 - (Tx - T);  // the tile's first position in out, ζ and h
        merge_tile(Z.data(), zz.data(), static_cast<acc_t*>(nullptr), sv.data(), qv.data(), lam.data(), rows.data(),
                   V.data(), tile, op + p0 * d, lp + p0, P, qp, A.partial ? xp + (b * Tx + t0) * d : nullptr, cp, used,
                   K, static_cast<const scalar_t*>(nullptr), t0, nt, m, d, eps);
        if (A.hpre) {
          hpre_gates(S.data(), y.data(), pre.data(), Z.data(), zz.data(), Wp, bp, acc_t(alpha), nt, m, m4, md, eps);  // eq. 13
        } else {
          std::fill(pre.begin(), pre.end(), acc_t(1) / acc_t(m));  // mean fusion
        }
        for (int64_t j = 0; j < nt; ++j)  // eq. 14
          weighted_row_sum(hp + (p0 + j) * d, pre.data() + j * m4, 1, zrows.data(), j * md, m, acc_t(1), d);
      }
    });
  };
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "msar_fuse_forward", [&] { kernel(scalar_t(0)); });
  return h;
}

// One function of ~170 lines on purpose: the sub-tile's buffers (V, DV, GX, Z, ∂Z and the gate
// rows) are thread-local and reused by every step of the per-tile pipeline below, whose steps are
// already functions of their own (expand_tile, hpre_gates, expand_backward_tile, add_rows); what
// is left is the order in which they run over one sub-tile, which reads best in one place.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
msar_fuse_backward(const at::Tensor& grad_, const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& queries,
                   const OptTensor& partial_opt, const OptTensor& partial_conv_opt, const OptTensor& w_pre_opt,
                   const OptTensor& b_pre_opt, const OptTensor& alpha_pre_opt, double eps,
                   c10::OptionalIntArrayRef lengths) {
  const at::Tensor partial = unwrap(partial_opt);
  const at::Tensor partial_conv = unwrap(partial_conv_opt);
  const at::Tensor w_pre = unwrap(w_pre_opt);
  const at::Tensor b_pre = unwrap(b_pre_opt);
  const at::Tensor alpha_pre = unwrap(alpha_pre_opt);
  const FuseArgs A = check_fuse(out_, lse_, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, 0);
  const auto acc_type = acc_type_of(out_);
  const int64_t m = A.m, B = A.B, T = A.T, d = A.d, K = A.K, P = B * T, L = m - 1;
  const auto acc_opts = out_.options().dtype(acc_type);
  const at::Tensor g = grad_.defined() ? contiguous_as(grad_, out_.scalar_type()) : at::zeros({B, T, d}, out_.options());
  const at::Tensor o = out_.contiguous(), lse = contiguous_as(lse_, acc_type), q = contiguous_as(queries, acc_type);
  const FuseInputs in = fuse_inputs(A, out_.scalar_type(), acc_type, partial, partial_conv, w_pre, b_pre, alpha_pre, lengths);
  const at::Tensor &x = in.x, &c = in.c, &W = in.W, &bias = in.bias;
  const std::vector<int64_t>& used = in.used;
  const double alpha = in.alpha;
  at::Tensor gout = at::empty({m, B, T, d}, acc_opts), glse = at::empty({m, B, T}, acc_opts);
  at::Tensor gx = A.partial ? at::zeros({B, T, d}, acc_opts) : at::Tensor();
  const TileGroups tiles = tile_groups(B, T, A.partial ? K : 1);
  // Partial sums per group of tiles: queries [m, d], taps [m−1, K, d], W_pre [m, m d], then b_pre [m] and α [1].
  const int64_t n_q = m * d, n_c = A.partial ? L * K * d : 0, n_w = A.hpre ? m * m * d : 0, n_b = A.hpre ? m + 1 : 0;
  const int64_t stride = n_q + n_c + n_w + n_b;
  at::Tensor parts = at::zeros({tiles.groups, stride}, acc_opts);
  // The kernel is a generic lambda outside the dispatch macro: pragmas may not appear in macro arguments.
  auto kernel = [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *gp = g.const_data_ptr<scalar_t>(), *op = o.const_data_ptr<scalar_t>();
    const scalar_t* xp = A.partial ? x.const_data_ptr<scalar_t>() : nullptr;
    const acc_t *lp = lse.const_data_ptr<acc_t>(), *qp = q.const_data_ptr<acc_t>();
    const acc_t* cp = A.partial ? c.const_data_ptr<acc_t>() : nullptr;
    const acc_t* Wp = A.hpre ? W.const_data_ptr<acc_t>() : nullptr;
    const acc_t* bp = A.hpre ? bias.const_data_ptr<acc_t>() : nullptr;
    acc_t *gop = gout.mutable_data_ptr<acc_t>(), *glp = glse.mutable_data_ptr<acc_t>();
    acc_t* gxp = A.partial ? gx.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* parts_all = parts.mutable_data_ptr<acc_t>();
    const acc_t al = acc_t(alpha);
    const int64_t md = m * d;
    const int64_t pad = K - 1, rows = kTile + 2 * pad;  // (K = 1 without a partial)
    for_each_tile(tiles, T, [&](int64_t b, int64_t t0, int64_t t1, int64_t group) {
      acc_t* gq = parts_all + group * stride;
      acc_t* gc = gq + n_q;
      acc_t* gW = gc + n_c;
      acc_t* gb = gW + n_w;  // [m], then α at gb[m]
      // Per sub-tile of kTile tokens: the partial's expansions V [m, kTile, d] and the merged
      // streams Z [kTile, m·d] (merge_tile); the fusion's backward for the sub-tile (its H_pre
      // products in register blocks, hpre_gates) into ∂Z; then stream by stream the merge's
      // backward with ∂v into DV [kTile + 2(K − 1), d] (K − 1 zero rows either side) and its
      // transpose (expand_backward_tile). ∂partial of the sub-tile and the pad rows before it is
      // gathered in GX over the streams (add_rows). (One stream's DV at a time: the sub-tile's
      // buffers are most of L2, and the rows of out it reads twice should stay there.) ∂Z starts
      // at zero for the rows past a short sub-tile's tokens, which the gate products run over.
      const int64_t m4 = round_up4(m);
      Scratch<acc_t> V(A.partial ? m * kTile * d : 0), DV(A.partial ? rows * d : 0, acc_t(0)),
          GX(A.partial ? (kTile + pad) * d : 0), Z(kTile * md, acc_t(0)), dZ(kTile * md, acc_t(0)), s(kTile * m),
          qv(kTile * m), lam(kTile * m), S(kTile), pre(kTile * m4), y(kTile * m4), U(kTile * m4, acc_t(0)), zz(kTile),
          gz(kTile * m), keep(kTile), beta(kTile), gamma(kTile);
      std::vector<const acc_t*> vrows(m);  // the partial's expansions, per stream (merge_tile)
      for (int64_t u0 = t0; u0 < t1; u0 += kTile) {
        const int64_t u1 = std::min(t1, u0 + kTile), nt = u1 - u0, nt4 = round_up4(nt);
        acc_t* dv0 = A.partial ? DV.data() + pad * d : nullptr;
        if (A.partial) std::fill(dv0 + nt * d, dv0 + (nt + pad) * d, acc_t(0));  // (the last sub-tile may be shorter)
        std::fill(Z.begin() + nt * md, Z.begin() + nt4 * md, acc_t(0));  // (a shorter last sub-tile)
        // Recompute the merge (A.8–A.10).
        const int64_t p0 = b * T + u0;
        merge_tile(Z.data(), zz.data(), gz.data(), s.data(), qv.data(), lam.data(), vrows.data(), V.data(), kTile,
                   op + p0 * d, lp + p0, P, qp, A.partial ? xp + p0 * d : nullptr, cp, used, K,
                   A.hpre ? gp + p0 * d : nullptr, u0, nt, m, d, eps);  // (g · z: the gates' backward)
        // Fusion backward (eq. 13–14) → ∂Z. With u_j = (g·z_j) π_j (1 − π_j):
        // ∂z = π ⊙ g + α S Σ_j u_j W_j − α S³ (Σ_j u_j y_j) z / (m d), ∂W_j += u_j α S z.
        if (A.hpre) {
          hpre_gates(S.data(), y.data(), pre.data(), Z.data(), zz.data(), Wp, bp, al, nt, m, m4, md, eps);  // eq. 13
          for (int64_t j = 0; j < nt; ++j) {
            const scalar_t* g_p = gp + (b * T + u0 + j) * d;
            const acc_t* z = Z.data() + j * md;
            acc_t* u = U.data() + j * m4;
            acc_t uy = 0;
            for (int64_t k = 0; k < m; ++k) {
              const acc_t pk = pre[j * m4 + k], yk = y[j * m4 + k];
              const acc_t uk = gz[k * kTile + j] * pk * (acc_t(1) - pk);  // (g · z_k: merge_tile)
              gb[k] += uk;
              gb[m] += uk * S[j] * yk;
              uy += uk * yk;
              u[k] = uk * al * S[j];  // the coefficient of W_k in ∂z and of z in ∂W_k
            }
            const acc_t c_z = al * S[j] * S[j] * S[j] * uy / acc_t(md);
            for (int64_t r = 0; r < m; ++r) {
              acc_t* dz_r = dZ.data() + j * md + r * d;
              const acc_t* z_r = z + r * d;
              const acc_t pr = pre[j * m4 + r];
#pragma omp simd
              for (int64_t i = 0; i < d; ++i) dz_r[i] = pr * acc_t(g_p[i]) - c_z * z_r[i];
            }
          }
          std::fill(U.begin() + nt * m4, U.begin() + nt4 * m4, acc_t(0));
          add_gate_inputs_grad(dZ.data(), U.data(), Wp, nt4, m4, md);
          add_gate_weights_grad(gW, U.data(), Z.data(), nt4, m, m4, md);
        } else {
          for (int64_t j = 0; j < nt; ++j) {
            const scalar_t* g_p = gp + (b * T + u0 + j) * d;
            for (int64_t r = 0; r < m; ++r)
              for (int64_t i = 0; i < d; ++i) dZ[j * md + r * d + i] = acc_t(g_p[i]) / acc_t(m);
          }
        }
        // Merge backward (A.8–A.10) → ∂out, ∂ζ, ∂q, ∂partial, ∂taps, per stream over the sub-tile:
        // ∂v into DV, then its transpose into GX. The identity stream's ∂v is its share of
        // ∂partial itself, written to GX's rows of the sub-tile first; only the pad rows start at 0.
        if (A.partial) std::fill_n(GX.data(), pad * d, acc_t(0));
        for (int64_t r = 0; r < m; ++r) {
          const acc_t* dz0 = dZ.data() + r * d;  // token j's ∂z_r at j·m·d
          acc_t* go0 = gop + (r * P + p0) * d;
          if (!A.partial) {
            for (int64_t j = 0; j < nt; ++j) {
              std::copy_n(dz0 + j * md, d, go0 + j * d);
              glp[r * P + p0 + j] = 0;
            }
            continue;
          }
          const scalar_t* o0 = op + (r * P + p0) * d;
          const acc_t* v0 = vrows[r];
          for (int64_t j = 0; j < nt; ++j) {
            const acc_t l = lam[r * kTile + j], sr = s[r * kTile + j];
            // ∂z · ∂z/∂λ = ∂z · (out − v), and ∂out = λ ∂z in the same pass
            const acc_t dlambda = scale_row_and_dot_difference(go0 + j * d, dz0 + j * md, o0 + j * d, v0 + j * d, l, d);
            const acc_t dzeta = dlambda * l * (acc_t(1) - l);  // ∂λ/∂ζ = λ(1 − λ) = −∂λ/∂a
            glp[r * P + p0 + j] = dzeta;
            const acc_t da = -dzeta;
            keep[j] = acc_t(1) - l;
            beta[j] = da * sr;
            gamma[j] = da * sr * sr * sr * qv[r * kTile + j] / acc_t(d);
          }
          // ∂v = (1 − λ) ∂z + ∂a s q − ∂a s³ (q·v) v / d, and ∂q, in one blocked pass
          key_grads(r == 0 ? GX.data() + pad * d : dv0, gq + r * d, v0, dz0, md, qp + r * d, keep.data(), beta.data(),
                    gamma.data(), nt, d);
          if (r == 0) continue;
          expand_backward_tile(dv0, GX.data() + pad * d, gc + (r - 1) * K * d, xp + b * T * d, cp + (r - 1) * K * d,
                               used[r - 1], in.lengths[r - 1], K, u0, u1, d);
        }
        if (A.partial) add_rows(gxp + b * T * d, GX.data(), K, u0, u1, d);
      }
    });
  };
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "msar_fuse_backward", [&] { kernel(scalar_t(0)); });
  at::Tensor total = parts.sum(0);
  at::Tensor gq = total.narrow(0, 0, n_q).view({m, d}).to(queries.scalar_type());
  at::Tensor gx_out, gc_out, gw_out, gb_out, ga_out;
  if (A.partial) {
    gx_out = gx.to(partial.scalar_type());
    const at::Tensor gc_kd = total.narrow(0, n_q, n_c).view({L, K, d});
    zero_padding(gc_kd, in.lengths);
    gc_out = gc_kd.transpose(-1, -2).to(partial_conv.scalar_type());
  }
  if (A.hpre) {
    gw_out = total.narrow(0, n_q + n_c, n_w).view({m, m * d}).to(w_pre.scalar_type());
    gb_out = total.narrow(0, n_q + n_c + n_w, m).to(b_pre.scalar_type());
    ga_out = total.narrow(0, n_q + n_c + n_w + m, 1).view(alpha_pre.sizes()).to(alpha_pre.scalar_type());
  }
  return {gout.to(out_.scalar_type()), glse.to(lse_.scalar_type()), gq, gx_out, gc_out, gw_out, gb_out, ga_out};
}

}  // namespace depthkit::cpu
