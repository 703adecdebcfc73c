#include "depthkit/analysis/accounting.h"

#include <numeric>

#include "depthkit/pathways/pathway.h"

namespace depthkit {

double CostReport::traffic_d() const {
  double t = 0;
  for (const TrafficTerm& term : traffic) t += term.read + term.write;
  return t;
}

namespace {

// Per-token forward FLOPs of the pieces the pathways share (d-vectors; multiply–add = 2).
constexpr double kNorm = 3;   // weightless RMSNorm: Σx² (2 per element), scale (1)
constexpr double kScore = 2;  // q · k̂
constexpr double kValue = 2;  // weight × value, accumulated
constexpr double kMerge = 3;  // λ·out + (1 − λ)·v (DAR eq. A.10)

struct Shape {
  double d, L, S, N, m;  // width, branches, block size, completed blocks, streams
  BlockSchedule schedule;
  // The completed sources branch ℓ reads, the embedding included.
  int64_t completed_before(int64_t l) const { return schedule.block_of(l); }
  bool first_in_block(int64_t l) const { return schedule.opens(l); }
};

// AttnRes (eq. 9, two-phase): keys normalised once per append, per read scores and value sums
// over the completed sources, the partial's norm, score and merge, the block accumulation.
double attnres_flops(const Shape& s, bool sepv) {
  double f = (s.N + 1) * kNorm * s.d;                              // key norms, once per source
  if (sepv) f += (s.N + 1) * 2 * s.d * s.d;                        // value maps W_v,r (eq. 21)
  for (int64_t l = 2; l <= int64_t(s.L); ++l) {
    f += double(s.completed_before(l)) * (kScore + kValue) * s.d;  // phase 1
    if (!s.first_in_block(l)) {
      f += (kNorm + kScore + kMerge) * s.d + s.d;                  // phase 2, partial += f
      if (sepv) f += 2 * s.d * s.d;                                // the partial's value map
    }
  }
  return f + (s.N + 1) * (kScore + kValue) * s.d;                  // output query
}

// DAR (eq. 10–18): both streams read, gates α, β on Norm([h⁰; h¹]), the gated write with M(ρ).
double dar_flops(const Shape& s) {
  double f = (s.N + 1) * 2 * kNorm * s.d;  // both streams' key norms, once per entry
  for (int64_t l = 1; l <= int64_t(s.L); ++l) {
    f += 2 * double(s.completed_before(l)) * (kScore + kValue) * s.d;
    f += 2 * kNorm * s.d + 2 * (2 * 2 * s.d) + 3 * s.d;  // Norm([h⁰;h¹]), α and β (2×2d each), α⁰h⁰ + α¹h¹
    f += 2 * s.d;                                        // β ⊗ f
    if (!s.first_in_block(l))
      f += 2 * (kNorm + kScore + kMerge) * s.d            // the partials
           + 2 * kNorm * s.d + 2 * 2 * s.d                // ρ = σ(Norm([P⁰;P¹]) W_ρ + b_ρ)
           + 2 * 3 * s.d + 2 * s.d;                       // M(ρ) P, + β ⊗ f
  }
  return f + 2 * (s.N + 1) * (kScore + kValue) * s.d + s.d;  // two output reads, h⁰ + h¹
}

// MSAR (eq. 10–17): causal depthwise expansion of each source (once, N appends; the last output
// is merged, not expanded) and of each partial, per-stream reads, H_pre fusion.
double msar_flops(const Shape& s, const ResidualConfig& r) {
  const double conv = r.conv ? 2 * s.d * double(std::accumulate(r.kernels.begin(), r.kernels.end(), int64_t(0))) : 0;
  double f = s.N * (conv + s.m * kNorm * s.d);
  for (int64_t l = 1; l <= int64_t(s.L); ++l) {
    f += s.m * double(s.completed_before(l)) * (kScore + kValue) * s.d;
    if (!s.first_in_block(l)) f += conv + s.m * (kNorm + kScore + kMerge) * s.d + s.d;
    f += r.fusion == "mean" ? s.m * s.d
                            : kNorm * s.m * s.d + 2 * s.m * s.d * s.m + 2 * s.m * s.d;  // Norm, W_pre, Σ H_pre Z
  }
  return f + s.d;  // h_L + f_L(h_L)
}

// mHC (eq. 3–5): the md × (m² + 2m) projection on the normalised state, Sinkhorn on m × m, the
// pre-mix, post and res maps.
double mhc_flops(const Shape& s, int64_t sinkhorn_iters) {
  const double md = s.m * s.d, n = s.m * s.m + 2 * s.m;
  const double per_branch = kNorm * md + 2 * md * n + s.m * s.m * (1 + 4 * double(sinkhorn_iters))  // exp, rows/cols
                            + 2 * md + md + 2 * s.m * md + md;  // H_pre x, H_post f, H_res x, + together
  return s.L * per_branch + md;                                 // sum of streams
}

}  // namespace

CostReport training_cost(const ModelConfig& model, const ResidualConfig& residual) {
  CostReport c;
  c.kind = residual.kind;
  c.d = model.d_model;
  c.branches = model.n_branches();
  c.block_sublayers = residual.kind == "residual" || residual.kind == "mhc" ? 1 : residual.block_sublayers;
  const BlockSchedule schedule{c.block_sublayers, c.branches};
  c.blocks = schedule.blocks();
  c.streams = residual.kind == "dar" ? 2 : residual.streams;
  const Shape s{double(c.d), double(c.branches), double(c.block_sublayers), double(c.blocks), double(c.streams), schedule};

  // Backbone, forward, per token.
  const double d = double(c.d), hd = double(model.resolved_head_dim());
  const double H = double(model.n_heads), KV = double(model.n_kv_heads), T = double(model.seq_len);
  const double projections = 2 * d * H * hd + 2 * 2 * d * KV * hd + 2 * H * hd * d;  // Q; K, V; O
  const double attention = 2 * 2 * H * hd * (T + 1) / 2;                             // QKᵀ and A·V, causal
  const double ffn = 2 * 3 * d * double(model.d_ff);                                  // SwiGLU
  const double head = 2 * d * double(model.vocab_size);
  c.backbone_flops = 3 * (double(model.n_layers) * (projections + attention + ffn) + head);
  c.lm_head_flops = 3 * head;

  const double residual_adds = s.L * d;
  double f = residual_adds;
  const std::string& k = residual.kind;
  if (k == "attnres" || k == "attnres_sepv") f = attnres_flops(s, k == "attnres_sepv");
  else if (k == "dar") f = dar_flops(s);
  else if (k == "msar") f = msar_flops(s, residual);
  else if (k == "mhc") f = mhc_flops(s, residual.sinkhorn_iters);
  else if (k == "attnres_mhc") f = attnres_flops(s, false) + mhc_flops(s, residual.sinkhorn_iters) + residual_adds + d;
  c.pathway_flops = 3 * f;
  c.overhead_percent = 100 * (f - residual_adds) / (c.backbone_flops / 3 + residual_adds);

  // Memory traffic per token per branch, in units of d (MSAR Table 6 and its conventions).
  const double NS = s.N / s.S, m = s.m;
  auto row = [&](const char* operation, double read, double write) {
    TrafficTerm& t = c.traffic.emplace_back();
    t.operation = operation;
    t.read = read;
    t.write = write;
  };
  auto attnres_rows = [&] {
    row("phase 1 (amortised)", NS, 1);
    row("phase 2", 3, 1);
  };
  auto mhc_rows = [&] {
    row("compute mixing coefficients", m, 0);
    row("apply H_pre", m, 1);
    row("apply H_post", 1, m);
    row("apply H_res", m, m);
    row("residual merge", 2 * m, m);
  };
  if (k == "residual") {
    row("residual merge", 2, 1);
  } else if (k == "attnres") {
    attnres_rows();
  } else if (k == "attnres_sepv") {  // values read apart from keys; each source and partial mapped
    row("phase 1: keys and values (amortised)", 2 * NS, 1);
    row("value map of completed sources (amortised)", 1 / s.S, 1 / s.S);
    row("value map of the partial", 1, 1);
    row("phase 2", 4, 1);
  } else if (k == "dar") {  // both streams' sources once; the merge reads two outputs and two partials
    row("phase 1: both streams (amortised)", 2 * NS, 2);
    row("phase 2: merge and alpha gate", 4, 1);
    row("gated write with transport", 3, 2);
  } else if (k == "msar") {
    row("phase 1: logits (amortised)", NS / 2, 0);
    row("phase 1: values (amortised)", NS / 2, m);
    row("phase 2: partial update and scoring", 2, 1);
    row("phase 2: merge and H_pre gate", m + 1, m);
    row("stream aggregation", m, 1);
  } else if (k == "mhc") {
    mhc_rows();
  } else if (k == "attnres_mhc") {
    attnres_rows();
    mhc_rows();
    row("sum of the two reads", 2, 1);
  }
  return c;
}

}  // namespace depthkit
