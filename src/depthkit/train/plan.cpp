#include "depthkit/train/plan.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "depthkit/model/transformer.h"
#include "depthkit/train/pipeline.h"
#include "depthkit/util/error.h"

namespace depthkit {

namespace {

// A stage's parameters: the branches' replicated ones, the routed experts' (whole, before
// expert parallelism splits them), and those kept outside the branches (the embedding, the head,
// the final norm, the pathway's own).
struct StageCounts {
  double branches = 0, experts = 0, kept = 0;
  int64_t last_layer = 0;  // one past the stage's last layer
  int64_t layers = 0, moe_layers = 0;
  double largest_branch = 0;  // the parameters of its largest branch (ZeRO-3's gathered unit)
};

StageCounts stage_counts(const Transformer& meta, const PipelineLayout& layout, int64_t stage) {
  StageCounts c;
  const StageParameters sp = stage_parameters(meta.parameters(), layout, stage);
  const auto& all = meta.parameters().all();
  std::map<std::string, double> branch_size;
  for (size_t i = 0; i < all.size(); ++i) {
    if (sp.chunk[i] == StageParameters::kNotHeld) continue;
    const double n = double(all[i].tensor.numel());
    if (all[i].name.rfind("layers.", 0) == 0) {
      (all[i].is_slice() || all[i].name.find(".experts.") != std::string::npos ? c.experts : c.branches) += n;
      const size_t dot = all[i].name.find('.', all[i].name.find('.', 7) + 1);
      branch_size[all[i].name.substr(0, dot)] += n;
    } else {
      c.kept += n;
    }
  }
  for (const auto& [name, n] : branch_size) c.largest_branch = std::max(c.largest_branch, n);
  const ModelConfig& m = meta.config();
  for (int64_t chunk = stage; chunk < layout.chunks(); chunk += layout.stages)
    for (int64_t i = layout.first_layer(chunk); i < layout.first_layer(chunk + 1); ++i) {
      ++c.layers;
      c.moe_layers += m.moe.is_moe_layer(i) ? 1 : 0;
      c.last_layer = std::max(c.last_layer, i + 1);
    }
  return c;
}

// The pathway's per-token footprint, in units of d: what its state keeps per depth source (w: 2 for
// DAR's pairs and SepV's values), what each branch's read and write save for backward, and the
// streams it carries.
struct PathwayFootprint {
  double per_source = 0, per_branch = 0, carried = 1;
  bool sources = false;
};

PathwayFootprint footprint(const ResidualConfig& r) {
  const double m = double(r.streams);
  if (r.kind == "residual") return {0, 0, 1, false};
  if (r.kind == "mhc") return {0, m + 2, m, false};      // the m streams merged, the pre-mix's input
  if (r.kind == "attnres") return {1, 1, 1, true};       // the partial
  if (r.kind == "attnres_sepv") return {2, 3, 1, true};  // and the values
  if (r.kind == "attnres_mhc") return {1, m + 2, 1 + m, true};
  if (r.kind == "dar") return {2, 3, 2, true};           // two streams: partials, transported
  if (r.kind == "msar") return {1, m, 1, true};          // the m retrieved streams
  return {1, 2, 1, true};
}

double bytes_of(const std::string& dtype) { return dtype == "bfloat16" ? 2.0 : 4.0; }

}  // namespace

namespace {

// predict_memory on a model of cfg built on the meta device (built once for every layout).
MemoryParts predict_on(const Transformer& meta, const Config& cfg, const Layout& L) {
  const ModelConfig& m = cfg.model;
  const PipelineLayout layout{L.stages, L.virtual_stages, m.n_layers};
  const double D = double(L.data), P = double(L.experts), b = bytes_of(cfg.train.dtype);
  const double d = double(m.d_model), hd = double(m.resolved_head_dim());
  const double q = double(m.n_heads) * hd, kv = double(m.n_kv_heads) * hd, f = double(m.d_ff);
  const double fe = double(m.moe.expert_d_ff), k = double(m.moe.top_k), E = double(m.moe.n_experts);
  const double fs = double(m.moe.n_shared_experts) * double(m.moe.resolved_shared_d_ff());
  const double t = double(L.micro_batch) * double(m.seq_len);  // tokens of a micro-batch
  const double M = double(L.grad_accum);
  const bool bf16 = cfg.train.dtype == "bfloat16";
  const PathwayFootprint path = footprint(cfg.residual);
  const double S = double(cfg.residual.block_sublayers);
  MemoryParts worst;
  for (int64_t s = 0; s < L.stages; ++s) {
    const StageCounts c = stage_counts(meta, layout, s);
    MemoryParts p;
    // Weights, gradients and AdamW's two moments, float32. An expert tensor is split over P and
    // its slice sharded over the D / P ranks holding it: 1 / D of it on each rank either way.
    const double whole = c.branches + c.kept + c.experts / P, sharded = (c.branches + c.kept + c.experts) / D;
    p.parameters = 4 * (L.zero >= 3 ? c.kept + (c.branches + c.experts) / D : whole);
    p.gradients = 4 * (L.zero >= 2 ? sharded : whole);
    p.optimizer = 8 * (L.zero >= 1 ? sharded : whole);
    // A layer's saved tensors per token (elements): the attention branch's input and normed input,
    // q, k, v after RoPE, the attention's output and its copy for the output projection; the
    // feed-forward's input and normed input, gate and up, their product (dense); or, for an MoE
    // layer, the router's logits and probabilities, each token's k dispatched copies, their
    // experts' gate, up, activation and product, and their outputs; the pathway's share.
    const double attention = 3 * d + (q + 2 * kv) + 2 * q + double(m.n_heads);
    const double dense = 3 * d + 3 * f;
    const double moe = 2 * d + 3 * E + k * (2 * d + 4 * fe) + 4 * fs;
    const double layers = double(c.layers), moe_layers = double(c.moe_layers);
    const double ffn_total = (layers - moe_layers) * dense + moe_layers * moe;
    const double branch_path = 2 * path.per_branch * d;  // per layer
    // The weights a layer's products keep for backward, per micro-batch: bfloat16 copies of every
    // matrix (its experts too), or float32's joined q/k/v and gate/up matrices.
    const double layer_weights = bf16 ? ((q + 2 * kv) * d + q * d + 3 * f * d) * 2 + (moe_layers > 0 ? 3 * fe * d * E / P * 2 : 0)
                                      : ((q + 2 * kv) * d + (moe_layers < layers ? 2 * f * d : 0)) * 4;
    // Micro-batches in flight on this stage (1F1B): in layer-equivalents of saved activations.
    double in_flight = 1;
    if (L.stages > 1)
      in_flight = L.virtual_stages == 1
                      ? std::min<double>(double(L.stages - s), M)
                      : std::min<double>((L.stages - s - 1) * 2 + (L.virtual_stages - 1) * L.stages + 1,
                                         M * L.virtual_stages) / double(L.virtual_stages);
    // Saved per layer and micro-batch: everything (none); each branch's input and the pathway's
    // share (branch); the pathway's state as the layer begins and the slots it sets (layer). Recomputation's working
    // set, in backward: one branch's (branch) or one layer's (layer) saved tensors.
    const double per_layer_kept = L.recompute == "none" ? (attention + ffn_total / std::max(1.0, layers)) * b + branch_path * b
                                : L.recompute == "branch" ? 2 * d * b + branch_path * b
                                                          : (path.carried + (path.sources ? 2 : 0)) * d * b;
    const double working = L.recompute == "none" ? 0
                           : L.recompute == "branch" ? t * (std::max(attention, moe_layers > 0 ? moe : dense) + path.per_branch * d) * b + layer_weights
                                                     : t * (attention + (moe_layers > 0 ? moe : dense) + 2 * branch_path) * b + layer_weights;
    const double weights_kept = L.recompute == "none" ? layers * layer_weights : 0;
    double kept = in_flight * (t * layers * per_layer_kept + weights_kept);
    if (s == 0) kept += in_flight * t * d * b;                       // the embedding's output
    if (s == L.stages - 1) kept += t * (2 * d + 2) * b + t * d * 4;  // the final norm's input and output, the loss's
    // Depth sources up to the stage's last layer, and the carried state, per micro-batch in flight.
    // (On the first stage source 0 is the embedding's output, counted with it.)
    const double sources =
        path.sources ? (std::floor(2.0 * double(c.last_layer) / S) + (s == 0 ? 0 : 1)) * path.per_source : 0;
    // (A later chunk's sources are views of what it received or cached: a micro-batch holds each once.)
    p.sources = in_flight * t * d * b * (sources + path.carried * double(L.virtual_stages));
    // MoE: the all-to-all's received rows and their return, per MoE layer of a micro-batch.
    if (L.experts > 1) p.dispatch = in_flight * moe_layers * 2 * t * k * d * b;
    // c10d's Reducer (ZeRO ≤ 1 over several ranks): its buckets, a copy of every gradient.
    // ZeRO-2's buckets in flight (two, of a quarter of the gradients between 1 and 25 MiB) and
    // ZeRO-3's two gathered branches. The pipeline: the payload being sent (what a stage receives
    // is its sources themselves).
    double bucket = std::clamp(4 * (c.branches + c.kept + c.experts / P) / 4, double(1 << 20), 25.0 * (1 << 20));
    if (L.zero >= 3) bucket = std::min(bucket, 4 * c.largest_branch);  // a set is one branch
    if (L.zero <= 1 && D > 1) p.communication += 4 * (c.branches + c.kept + c.experts / P);
    if (L.zero == 1 && D > 1) p.communication += bucket;  // the updated parameters all-gathered a bucket at a time
    if (L.zero >= 2 && D > 1) p.communication += 2 * bucket;
    if (L.zero >= 2 && D > 1) p.communication += 4 * c.largest_branch;  // a branch's gradients whole, before they are reduced
    if (L.zero >= 3) p.communication += 2 * 4 * c.largest_branch;
    if (L.stages > 1) p.communication += t * d * b * (sources + path.carried);
    // The peak: at backward's start (every saved tensor, the head's gradient), or at its end (every
    // gradient, recomputation's working set), or in the evaluation after a step (every gradient kept
    // until the next step; one layer's forward and a chunk of logits).
    const double head_gradient = s == L.stages - 1 ? 4 * double(m.vocab_size) * d : 0;
    // In backward each depth source's gradient accumulates in one float32 buffer
    // (ops/shared_source.h), alive from its last reader's backward to its own.
    // (Without recomputation the saved tensors counted above cover them.)
    const double accumulators = L.recompute == "none" ? 0 : in_flight * t * d * 4 * sources;
    const double evaluation = t * (attention + std::max(dense, moe_layers > 0 ? moe : 0.0) + 2 * double(m.vocab_size)) * b;
    const double gradients = p.gradients;
    // ZeRO-3 lays a gathered branch out while the next one's gather is in flight and the one before
    // may still be whole: one branch more than the two counted, where the gradients are held.
    const double laid_out = L.zero >= 3 ? 4 * c.largest_branch : 0;
    const double during = std::max({kept + p.sources + p.dispatch + working + head_gradient + accumulators,
                                    gradients + working + p.sources + laid_out, gradients + evaluation + laid_out});
    p.activations = during - gradients - p.sources - p.dispatch;  // what is not the gradients themselves
    if (p.activations < 0) p.activations = 0;
    if (p.total() > worst.total()) worst = p;
  }
  return worst;
}

}  // namespace

MemoryParts predict_memory(const Config& cfg, const Layout& layout) {
  return predict_on(Transformer(cfg.model, cfg.residual, at::kMeta, 0), cfg, layout);
}

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) out.push_back(i);
  return out;
}

}  // namespace

std::vector<LayoutPlan> plan_layouts(const Config& cfg, const ClusterSpec& cluster) {
  const ModelConfig& m = cfg.model;
  const int64_t N = cluster.gpus, global = cfg.train.micro_batch * cfg.train.grad_accum;
  if (N < 1 || cluster.nodes < 1 || N % cluster.nodes != 0)
    fail("--gpus (", N, ") must be a positive multiple of --nodes (", cluster.nodes, ")");
  const Transformer meta(m, cfg.residual, at::kMeta, 0);
  const ParameterCounts counts = meta.count();
  const double b = bytes_of(cfg.train.dtype), d = double(m.d_model), T = double(m.seq_len);
  const int64_t per_node = N / cluster.nodes;
  std::vector<LayoutPlan> plans;
  for (int64_t K : divisors(N)) {
    if (K > m.n_layers) continue;
    const int64_t D = N / K;
    if (global % D != 0) continue;
    for (int64_t V : {int64_t(1), int64_t(2)}) {
      if (V > 1 && (K == 1 || K * V > m.n_layers)) continue;
      for (int64_t P : divisors(D)) {
        if (P > 1 && (!m.moe.enabled() || m.moe.n_experts % P != 0)) continue;
        for (int64_t mb : divisors(global / D)) {
          const int64_t accum = global / D / mb;
          if (V > 1 && accum % K != 0) continue;
          for (int64_t zero = 0; zero <= 3; ++zero)
            for (const char* recompute : {"none", "branch", "layer"}) {
              if (zero == 3 && std::string(recompute) == "none") continue;
              LayoutPlan plan;
              plan.layout = {D, P, K, V, zero, recompute, mb, accum};
              plan.memory = predict_on(meta, cfg, plan.layout);
              plan.fits = plan.memory.total() <= cluster.gpu_memory;
              // Bytes one rank sends per step. The gradients' all-reduce (a ring sends 2(D−1)/D of
              // them), or ZeRO's reduce-scatter and all-gather (the same), plus ZeRO-3's gathers in
              // forward and backward; the experts' all-to-all (dispatch and return, forward and
              // backward, the share that leaves the rank); the pipeline's boundaries.
              const double params_rank = double(counts.total) / double(K);
              const double ring = 2.0 * double(D - 1) / double(D) * 4 * params_rank;
              if (D > 1) plan.communication[zero >= 2 ? "reduce_scatter+all_gather" : "all_reduce"] = ring;
              if (zero >= 3 && D > 1) plan.communication["all_gather (ZeRO-3)"] = 2.0 * double(D - 1) / double(D) * 4 * params_rank;
              const double tokens = double(global / D) * T;  // per rank per step
              int64_t moe_layers = 0;
              for (int64_t i = 0; i < m.n_layers; ++i) moe_layers += m.moe.is_moe_layer(i) ? 1 : 0;
              if (P > 1)
                plan.communication["all_to_all"] = 4.0 * double(moe_layers) / double(K) * tokens * double(m.moe.top_k) * d * b *
                                                   double(P - 1) / double(P) * (std::string(recompute) == "none" ? 1.0 : 1.5);
              if (K > 1) {
                const PathwayFootprint path = footprint(cfg.residual);
                const double n = path.sources ? 1 + double(m.n_branches()) / double(cfg.residual.block_sublayers) / 2 : 0;
                plan.communication["send (pipeline)"] = 2.0 * double(V) * tokens * d * b * (n * path.per_source + path.carried);
              }
              plan.bubble = K > 1 ? PipelineSchedule::one_f_one_b({K, V, m.n_layers}, accum).bubble : 0;
              // The estimate: 6 FLOPs per active parameter and token, more by the forward run again
              // under recomputation, stretched by the bubble; plus each collective at the bandwidth
              // of where its ranks sit (within a node when they fit in one).
              const double compute = 6.0 * double(counts.active) * double(global) * T / double(N) / cluster.flops *
                                      (std::string(recompute) == "none" ? 1.0 : 4.0 / 3.0) / (1.0 - plan.bubble);
              double comm = 0;
              for (const auto& [name, bytes] : plan.communication) {
                const int64_t spread = name.rfind("all_to_all", 0) == 0 ? P : name.rfind("send", 0) == 0 ? K * D : D;
                comm += bytes / (spread <= per_node ? cluster.node_bandwidth : cluster.network_bandwidth);
              }
              plan.step_seconds = compute + comm;
              plans.push_back(plan);
            }
        }
      }
    }
  }
  // Fitting first; among them the fastest estimate, then the least memory.
  std::stable_sort(plans.begin(), plans.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits && std::abs(a.step_seconds - b.step_seconds) > 1e-9 * a.step_seconds) return a.step_seconds < b.step_seconds;
    return a.memory.total() < b.memory.total();
  });
  return plans;
}

std::vector<std::string> layout_settings(const Layout& L) {
  std::vector<std::string> out = {cat("train.micro_batch=", L.micro_batch), cat("train.grad_accum=", L.grad_accum),
                                  cat("train.zero=", L.zero), cat("train.recompute=", L.recompute)};
  if (L.experts > 1) out.push_back(cat("moe.expert_parallel=", L.experts));
  if (L.stages > 1) out.push_back(cat("train.pipeline_stages=", L.stages));
  if (L.virtual_stages > 1) out.push_back(cat("train.virtual_stages=", L.virtual_stages));
  return out;
}

std::string torchrun_command(const Layout& L, const ClusterSpec& cluster, const std::string& config_path) {
  std::ostringstream out;
  out << "torchrun --nnodes " << cluster.nodes << " --nproc-per-node " << cluster.gpus / cluster.nodes;
  if (cluster.nodes > 1) out << " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500";
  out << " --no-python depthkit train --config " << config_path << " --set train.device=cuda";
  for (const std::string& s : layout_settings(L)) out << " --set " << s;
  out << " --run-dir runs/planned";
  return out.str();
}

}  // namespace depthkit
