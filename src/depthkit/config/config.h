// Run configuration: TOML file → validated structs, with `--set section.key=value` overrides.
// Every key is declared once (config.cpp, `fields`), which gives loading, validation with
// messages that name the key, defaults, and the resolved TOML written next to each run.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace depthkit {

// The sparse mixture-of-experts feed-forward branch (model/moe.h; docs/design.md, "Mixture of
// experts"). n_experts = 0: every layer's feed-forward branch is the dense SwiGLU of width d_ff.
struct MoeConfig {
  int64_t n_experts = 0;             // routed experts per MoE layer; 0: dense
  int64_t top_k = 2;                 // experts each token is processed by
  int64_t expert_d_ff = 0;           // SwiGLU width of each routed expert (required when n_experts > 0)
  int64_t n_shared_experts = 0;      // experts every token goes through (DeepSeekMoE)
  int64_t shared_d_ff = 0;           // width of each shared expert; 0: expert_d_ff
  int64_t leading_dense_layers = 0;  // the first layers keep the dense SwiGLU of width model.d_ff
  std::string router = "softmax_topk";  // a name in the router table (model/router.h)
  // Divide the k selected probabilities by their sum. Off by default: the gates are then the
  // softmax probabilities themselves (Switch, GShard, DeepSeekMoE), and with top_k = 1 the LM
  // loss still trains the router (a renormalised single gate is constantly 1).
  bool renormalize = false;
  double aux_loss_coef = 0.01;  // Switch load balancing: n_experts · Σ_e f_e · P_e (DAR: 0.01)
  double z_loss_coef = 0.0;     // router z-loss (ST-MoE): mean over tokens of logsumexp(logits)²
  // How the routed experts run over their contiguous slices of the sorted tokens: "grouped" (one
  // at::_grouped_mm per projection), "loop" (one at::mm per expert and projection), or "auto":
  // grouped where it can run (grouped_experts_unsupported), else the loop.
  std::string expert_impl = "auto";
  // Expert parallelism: the routed experts split over this many consecutive ranks (a contiguous
  // range each), tokens sent to them and back by all-to-all (model/expert_parallel.h). It must
  // divide n_experts and the number of ranks.
  int64_t expert_parallel = 1;

  bool enabled() const { return n_experts > 0; }
  int64_t resolved_shared_d_ff() const { return shared_d_ff > 0 ? shared_d_ff : expert_d_ff; }
  bool is_moe_layer(int64_t layer) const { return enabled() && layer >= leading_dense_layers; }
};

// Why at::_grouped_mm cannot run the routed experts on `device` ("cpu", "cuda", …) with
// activations of `dtype` ("float32", "bfloat16", "float64", …) at these widths; "" when it can.
// Its CPU kernel takes float32 and bfloat16 operands whose rows are a multiple of 16 bytes; other
// devices take the loop here. One rule for the config's check, the model's and the forward's.
std::string grouped_experts_unsupported(const std::string& device, const std::string& dtype, int64_t d_model,
                                        int64_t expert_d_ff);

// The longest context model.seq_len may name (and bench --decode may time).
constexpr int64_t kMaxSeqLen = int64_t(1) << 24;

struct ModelConfig {
  int64_t n_layers = 4;
  int64_t d_model = 128;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t head_dim = 0;  // 0: d_model / n_heads
  int64_t d_ff = 384;
  int64_t vocab_size = 4096;
  int64_t seq_len = 256;  // at most kMaxSeqLen
  bool tie_embeddings = false;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  // The backbone's RMSNorm, RoPE, SwiGLU activation and LM-head cross-entropy: "fused" (depthkit
  // torch operators, ops/backbone_ops.h) | "reference" (their ATen compositions).
  std::string impl = "fused";
  MoeConfig moe;  // the [moe] section

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  int64_t n_branches() const { return 2 * n_layers; }  // L_b: attention and FFN per layer
};

struct ResidualConfig {
  std::string kind = "residual";
  int64_t block_sublayers = 2;  // S: branches per block (block forms of the depth pathways)
  // One parameter set per block and branch type instead of per branch (AttnRes, DAR; the
  // parameter counts of DAR Tables A.3 and A.5, docs/design.md).
  bool share_within_block = false;
  std::string routing = "cross";  // DAR key/value routing (DAR eq. 22): cross | self | cross_value | fixed
  int64_t streams = 4;            // m: MSAR streams, mHC streams
  std::vector<int64_t> kernels = {4, 8, 12};  // MSAR causal conv kernel sizes κ_1 … κ_{m−1}
  bool conv = true;               // MSAR: false replicates each source into m identical streams
  // MSAR's convolution taps at step 0: zeros (the paper: streams r ≥ 1 start empty) | average
  // (each tap 1/κ_r: causal moving averages) | normal (N(0, model.init_std)); docs/design.md,
  // "MSAR's first hundred steps".
  std::string conv_init = "zeros";
  std::string fusion = "hpre";    // MSAR stream fusion: hpre (eq. 13–14) | mean
  int64_t sinkhorn_iters = 20;    // mHC: Sinkhorn–Knopp iterations (row then column normalisation)
  std::string impl = "fused";  // fused (depthkit torch operators) | reference (ATen composition)
};

struct DataConfig {
  std::string dir = "data/pydoc";  // holds {train,val}_*.bin shards (and meta.json)
};

struct TrainConfig {
  int64_t micro_batch = 8;
  int64_t grad_accum = 1;
  int64_t steps = 0;   // optimizer steps; 0: derived from `tokens`
  int64_t tokens = 0;  // token budget; used when steps = 0
  int64_t seed = 42;       // initialisation (and the data order unless data_seed is set)
  int64_t data_seed = -1;  // the data order; -1: train.seed (compare fixes it across seeds)
  int64_t eval_every = 100;
  int64_t eval_tokens = 262144;
  int64_t checkpoint_every = 200;
  int64_t keep_checkpoints = 2;
  int64_t log_every = 10;
  int64_t threads = 0;  // 0: all cores (OMP_NUM_THREADS when set; --nproc gives each rank its share)
  std::string device = "cpu";
  // The compute dtype: "float32", or "bfloat16" for mixed precision (parameters, gradients and
  // AdamW state stay float32; docs/design.md, "Precision"). Transformer takes it as
  // compute_dtype(train) (model/transformer.h).
  std::string dtype = "float32";
  // Many processes (docs/training.md): the c10d backend (auto: nccl on cuda, gloo on cpu), ZeRO
  // stage (0: every rank keeps all AdamW state; 1: the AdamW state sharded across ranks; 2: the
  // gradients too, train/sharded_gradients.h; 3: the parameters too, each branch's gathered around
  // its use, train/parameter_sets.h; needs recompute), and the bound on every
  // collective and on the rendezvous, after which a lost rank stops the job.
  std::string backend = "auto";
  int64_t zero = 0;
  double timeout_s = 300;
  // ZeRO's buckets, in bytes (DDP's bucket_cap_mb, DeepSpeed's reduce_bucket_size): ZeRO-2's
  // gradient buckets (whole parameters each) and the parameters all-gathered at a time. 0: a
  // quarter of the gradients (of a set; of a branch under ZeRO-3), between 1 MiB and 25 MiB.
  int64_t bucket_bytes = 0;
  // Activations recomputed in backward instead of kept (docs/training.md, "Recomputation"):
  // "none" | "branch" (each attention and feed-forward branch) | "layer" (each layer with the
  // pathway's reads and writes; Transformer::set_recompute).
  std::string recompute = "none";
  // Pipeline stages (docs/training.md, "Pipeline stages"; train/pipeline.h): the layers cut into
  // pipeline_stages × virtual_stages chunks of consecutive layers, chunk c on stage c mod
  // pipeline_stages, each stage a block of WORLD_SIZE / pipeline_stages ranks, run by a 1F1B
  // schedule over the train.grad_accum micro-batches (interleaved when virtual_stages > 1).
  int64_t pipeline_stages = 1;
  int64_t virtual_stages = 1;
};

struct OptimConfig {
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 300;
  std::string schedule = "cosine";  // cosine | wsd
  double decay_fraction = 0.2;      // wsd: share of steps in the final decay
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;
  // The update: "fused" (ATen's at::_fused_adamw_, one kernel over every parameter of a weight-decay
  // group) | "reference" (the elementwise ATen ops per parameter, torch.optim.AdamW's formula).
  std::string impl = "fused";
};

struct Config;

// What the layers above config know about some keys: the names they take (residual.kind names a
// pathway in the registry, moe.router a router in the table) and the checks of a whole config that
// only they can make (a kind's own constraints). Config::parse applies the rules it is given, so
// that config stays below the code that defines those names; model/config_check.h gives them.
struct ConfigRules {
  std::map<std::string, std::vector<std::string>> choices;  // "section.key" → its allowed values
  std::function<void(const Config&, const std::string& where)> check = nullptr;
};

// One declared key, for the docs' key table, the fuzzer and `--set` help: its type ("integer",
// "number", "boolean", "string", "integer array"), range and fixed choices (empty: any value, or
// names given by ConfigRules).
struct ConfigKey {
  std::string section, key, type;
  double min, max;
  std::vector<std::string> choices;
  std::string path() const { return section + "." + key; }
};

struct Config {
  ModelConfig model;
  ResidualConfig residual;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;

  // Loads a TOML file, applies "section.key=value" overrides, validates every key's type and range
  // and the keys' relations, and applies `rules`. Throws depthkit::Error. The rules are required
  // so that no caller forgets them: a program loads a config through model/config_check.h, which
  // passes the registries'; with ConfigRules{} (config's own tests), names defined above config
  // (residual.kind, moe.router) are not checked.
  static Config load(const std::string& path, const ConfigRules& rules, const std::vector<std::string>& overrides = {});
  // Same from TOML text; `source` names it in messages.
  static Config parse(const std::string& toml_text, const std::string& source, const ConfigRules& rules,
                      const std::vector<std::string>& overrides = {});
  // Every declared key, in declaration order (the order of to_toml and values).
  static std::vector<ConfigKey> keys();
  // The fully resolved configuration (every key, defaults included) as TOML.
  std::string to_toml() const;
  // Every key with its value as TOML writes it, "section.key" → "value", in declaration order.
  std::vector<std::pair<std::string, std::string>> values() const;

  // Over `ranks` processes, each with train.micro_batch x train.grad_accum sequences a step.
  int64_t tokens_per_step(int64_t ranks = 1) const {
    return ranks * train.micro_batch * train.grad_accum * model.seq_len;
  }
  int64_t total_steps(int64_t ranks = 1) const;
};

}  // namespace depthkit
