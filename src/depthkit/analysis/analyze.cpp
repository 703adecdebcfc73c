#include "depthkit/analysis/analyze.h"

#include <ATen/TensorOperators.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <functional>
#include <map>

#include "depthkit/analysis/plots.h"
#include "depthkit/config/config.h"
#include "depthkit/data/loader.h"
#include "depthkit/eval/run_model.h"
#include "depthkit/model/transformer.h"
#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/pathways/registry.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

double linear_cka(const at::Tensor& x, const at::Tensor& y) {
  if (x.dim() != 2 || y.dim() != 2 || x.size(0) != y.size(0))
    fail("linear_cka: expected [n, p] and [n, q] with the same n, got ", x.sizes(), " and ", y.sizes());
  at::Tensor xc = x.to(at::kDouble), yc = y.to(at::kDouble);
  xc = xc - xc.mean(0, true);
  yc = yc - yc.mean(0, true);
  const double cross = at::matmul(yc.t(), xc).square().sum().item<double>();
  const double xx = at::matmul(xc.t(), xc).square().sum().sqrt().item<double>();
  const double yy = at::matmul(yc.t(), yc).square().sum().sqrt().item<double>();
  return xx > 0 && yy > 0 ? cross / (xx * yy) : 0.0;
}

std::vector<std::string> supported_analyses(const std::string& kind) {
  const PathwayKind* k = find_pathway_kind(kind);  // each kind's entry lists them (pathways/registry.h)
  return k ? k->analyses : std::vector<std::string>{};
}

namespace {

struct Mean {
  at::Tensor sum;  // float64
  int64_t count = 0;
  void add(const at::Tensor& rows) {  // [n, k]
    at::Tensor s = rows.to(at::kDouble).sum(0);
    sum = sum.defined() ? sum + s : s;
    count += rows.size(0);
  }
  std::vector<double> values() const {
    at::Tensor m = (sum / double(count)).contiguous();
    return std::vector<double>(m.data_ptr<double>(), m.data_ptr<double>() + m.numel());
  }
};

// Averages what the pathway reports over the batch and the last `positions` tokens.
class Collector final : public PathwayObserver {
 public:
  explicit Collector(int64_t positions) : positions_(positions) {}
  void on_retrieval(int64_t branch, int64_t stream, const at::Tensor& w, bool) override {
    weights[{branch, stream}].add(tail(w));
  }
  void on_write_gates(int64_t branch, const at::Tensor& g) override { gates[branch].add(tail(g)); }
  void on_stream_fusion(int64_t branch, const at::Tensor& key_rms, const at::Tensor& fusion_gates,
                        const at::Tensor& shares) override {
    stream_key_rms[branch].add(tail(key_rms));
    stream_gates[branch].add(tail(fusion_gates));
    stream_shares[branch].add(tail(shares));
  }

  std::map<std::pair<int64_t, int64_t>, Mean> weights;  // (branch, stream) → [n]
  std::map<int64_t, Mean> gates;                         // branch → [streams]
  std::map<int64_t, Mean> stream_key_rms, stream_gates, stream_shares;  // branch → [m] (MSAR)

 private:
  at::Tensor tail(const at::Tensor& x) const {  // [B, T, k] → [B·P, k]
    return x.narrow(1, x.size(1) - positions_, positions_).reshape({-1, x.size(-1)});
  }
  int64_t positions_;
};

// The model's forward through the seam, with the analysis hooks: an observer; the stream states
// after each layer's MLP branch; an intervention on them after layer `intervene_layer`.
struct Hooks {
  PathwayObserver* observer = nullptr;
  std::function<void(int64_t layer, const std::vector<at::Tensor>&)> post_mlp;
  int64_t intervene_layer = 0;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> replace;
};

at::Tensor forward(Transformer& model, const at::Tensor& tokens, const Hooks& hooks) {
  ResidualPathway& path = model.pathway();
  struct Unobserve {
    ResidualPathway& p;
    ~Unobserve() { p.set_observer(nullptr); }
  } unobserve{path};
  path.set_observer(hooks.observer);
  return model.logits(tokens, [&](int64_t l, PathwayState& state) {
    if (l % 2 != 0) return;  // after each layer's MLP branch
    if (hooks.post_mlp) hooks.post_mlp(l / 2, path.stream_states(state));
    if (l / 2 == hooks.intervene_layer) path.set_stream_states(state, hooks.replace(path.stream_states(state)));
  });
}

// Mean over tokens of KL(p ‖ q), both given as log-probabilities [n, V] in float64.
double mean_kl(const at::Tensor& log_p, const at::Tensor& log_q) {
  return (at::exp(log_p) * (log_p - log_q)).sum(-1).mean().item<double>();
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

nlohmann::json matrix_json(const std::vector<std::vector<double>>& m) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& row : m) {
    nlohmann::json r = nlohmann::json::array();
    for (double v : row) r.push_back(std::isnan(v) ? nlohmann::json() : nlohmann::json(v));
    j.push_back(r);
  }
  return j;
}

void write_figure(const fs::path& out, const std::string& what, const nlohmann::json& data) {
  write_file_atomic(out / (what + ".json"), data.dump(1) + "\n");
  render_plot(what, out / (what + ".json"), out / (what + ".png"));
}

// What every analysis reads: the model, its input, and its clean pass over that input.
struct CleanPass {
  Transformer& model;
  at::Tensor tokens;  // [B, T]
  int64_t T, P, L;    // seq_len, the positions analysed (the last P), layers
  std::string title;  // "<run> (<kind>, step N)", for the figures' titles
  Collector collect{P};  // retrieval weights and write gates
  // [layer][stream]: the post-MLP states [B·P, d]
  std::vector<std::vector<at::Tensor>> states = std::vector<std::vector<at::Tensor>>(size_t(L + 1));
  int64_t streams = 0;
  at::Tensor log_probs = at::Tensor();  // [B·P, V] float64, of the last P positions

  at::Tensor tail_log_probs(const at::Tensor& logits) const {  // [B, T, V] → [B·P, V] float64
    return at::log_softmax(logits.narrow(1, T - P, P).reshape({-1, logits.size(-1)}).to(at::kDouble), -1);
  }
  void run() {  // retrieval weights, gates, post-MLP states, log-probabilities
    Hooks clean;
    clean.observer = &collect;
    clean.post_mlp = [&](int64_t layer, const std::vector<at::Tensor>& s) {
      for (const at::Tensor& x : s) states[layer].push_back(x.narrow(1, T - P, P).reshape({-1, x.size(-1)}).clone());
    };
    log_probs = tail_log_probs(forward(model, tokens, clean));
    streams = states[1].empty() ? 0 : int64_t(states[1].size());
  }
};

// `sequences` windows of the validation split of data_dir, spread over it: [sequences, T].
at::Tensor validation_tokens(const std::string& data_dir, const Config& cfg, int64_t sequences) {
  const int64_t T = cfg.model.seq_len;
  TokenDataset val(data_dir, "val", cfg.model.vocab_size);
  const int64_t windows = val.windows(T);
  if (windows < sequences)
    fail(data_dir, ": validation split has ", windows, " windows of ", T + 1, " tokens, fewer than --sequences ",
         sequences);
  at::Tensor batch = at::empty({sequences, T + 1}, at::kLong);
  for (int64_t i = 0; i < sequences; ++i)
    val.read_window(i * (windows / sequences), T, batch.data_ptr<int64_t>() + i * (T + 1));
  return batch.narrow(1, 0, T).contiguous();
}

// Retrieval maps: the mean depth-attention weight of each read (pre-attention, pre-MLP, readout)
// on each source, per layer and stream.
nlohmann::json retrieval_maps(const CleanPass& pass) {
  int64_t n_cols = 0, n_streams = 0;
  for (auto& [key, m] : pass.collect.weights) {
    n_cols = std::max<int64_t>(n_cols, m.sum.size(0));
    n_streams = std::max<int64_t>(n_streams, key.second + 1);
  }
  nlohmann::json labels = {"emb"};
  for (int64_t c = 1; c < n_cols; ++c) labels.push_back(cat("b", c));
  nlohmann::json maps = {{"title", "retrieval maps: " + pass.title}, {"source_labels", labels},
                         {"streams", nlohmann::json::array()}};
  for (int64_t j = 0; j < n_streams; ++j) {
    std::vector<std::vector<double>> reads[2];  // pre-attention, pre-MLP: [layer][source]
    for (int64_t layer = 1; layer <= pass.L; ++layer)
      for (int r = 0; r < 2; ++r) {
        std::vector<double> row(size_t(n_cols), NAN);
        auto it = pass.collect.weights.find({2 * layer - 1 + r, j});
        if (it != pass.collect.weights.end()) {
          auto v = it->second.values();
          std::copy(v.begin(), v.end(), row.begin());
        }
        reads[r].push_back(row);
      }
    nlohmann::json s = {{"stream", j}, {"pre_attention", matrix_json(reads[0])}, {"pre_mlp", matrix_json(reads[1])}};
    if (auto it = pass.collect.weights.find({2 * pass.L + 1, j}); it != pass.collect.weights.end())
      s["readout"] = it->second.values();
    maps["streams"].push_back(s);
  }
  return maps;
}

// MSAR's streams at each read: key RMS before normalisation, H_pre gate, share of the fused input.
nlohmann::json stream_fusion(const CleanPass& pass) {
  auto rows = [](const std::map<int64_t, Mean>& by_branch) {
    std::vector<std::vector<double>> m;
    for (const auto& [branch, mean] : by_branch) m.push_back(mean.values());
    return matrix_json(m);
  };
  nlohmann::json reads = nlohmann::json::array();
  for (const auto& [branch, mean] : pass.collect.stream_shares) reads.push_back(branch);
  return {{"title", "MSAR streams at each read: " + pass.title}, {"reads", reads},
          {"key_rms", rows(pass.collect.stream_key_rms)}, {"gates", rows(pass.collect.stream_gates)},
          {"shares", rows(pass.collect.stream_shares)}, {"key_norm_eps", kKeyNormEps}};
}

// Linear CKA between the post-MLP states of every pair of streams, layer against layer.
nlohmann::json cross_stream_cka(const CleanPass& pass) {
  const int64_t L = pass.L;
  nlohmann::json cka = {{"title", "cross-stream CKA of post-MLP states: " + pass.title}, {"layers", L},
                        {"pairs", nlohmann::json::array()}};
  for (int64_t a = 0; a < pass.streams; ++a)
    for (int64_t b = a + 1; b < pass.streams; ++b) {
      std::vector<std::vector<double>> m(static_cast<size_t>(L), std::vector<double>(static_cast<size_t>(L)));
      for (int64_t i = 1; i <= L; ++i)
        for (int64_t k = 1; k <= L; ++k) m[i - 1][k - 1] = linear_cka(pass.states[i][a], pass.states[k][b]);
      cka["pairs"].push_back({{"a", a}, {"b", b}, {"matrix", matrix_json(m)}});
    }
  return cka;
}

// Rescue gain after each layer's MLP: 1 − KL(clean ‖ keep stream j only) / KL(clean ‖ zero all).
// gain[stream][layer − 1] is filled for the gate analysis.
nlohmann::json rescue_gain(const CleanPass& pass, std::vector<std::vector<double>>& gain) {
  gain.assign(size_t(pass.streams), {});
  nlohmann::json kl_zero = nlohmann::json::array(), kl_keep = nlohmann::json::array();
  for (int64_t layer = 1; layer <= pass.L; ++layer) {
    auto kl_after = [&](int64_t keep) {  // keep = −1: zero every stream
      Hooks h;
      h.intervene_layer = layer;
      h.replace = [keep](const std::vector<at::Tensor>& s) {
        std::vector<at::Tensor> r;
        for (size_t i = 0; i < s.size(); ++i) r.push_back(int64_t(i) == keep ? s[i] : at::zeros_like(s[i]));
        return r;
      };
      return mean_kl(pass.log_probs, pass.tail_log_probs(forward(pass.model, pass.tokens, h)));
    };
    const double zero = kl_after(-1);
    kl_zero.push_back(zero);
    nlohmann::json keeps = nlohmann::json::array();
    for (int64_t j = 0; j < pass.streams; ++j) {
      const double kl = kl_after(j);
      keeps.push_back(kl);
      gain[j].push_back(1.0 - kl / std::max(zero, 1e-12));
    }
    kl_keep.push_back(keeps);
  }
  nlohmann::json layers = nlohmann::json::array(), per_stream = nlohmann::json::array();
  for (int64_t i = 1; i <= pass.L; ++i) layers.push_back(i);
  for (int64_t j = 0; j < pass.streams; ++j) per_stream.push_back({{"stream", j}, {"gain", gain[j]}});
  return {{"title", "rescue gain after each layer's MLP: " + pass.title}, {"layers", layers},
          {"streams", per_stream}, {"kl_zero_all", kl_zero}, {"kl_keep", kl_keep}};
}

// DAR's gate asymmetry: per layer, the MLP branch's write-gate gap g = β₁ − β₀ against the rescue
// gap d = gain₁ − gain₀, and their Pearson correlation.
nlohmann::json gate_asymmetry(const CleanPass& pass, const std::vector<std::vector<double>>& gain) {
  std::vector<double> g, d;
  nlohmann::json layers = nlohmann::json::array();
  for (int64_t layer = 1; layer <= pass.L; ++layer) {
    auto beta = pass.collect.gates.at(2 * layer).values();  // the MLP branch's write gates
    g.push_back(beta[1] - beta[0]);
    d.push_back(gain[1][layer - 1] - gain[0][layer - 1]);
    layers.push_back(layer);
  }
  double mg = 0, md = 0, abs_g = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    mg += g[i] / double(g.size());
    md += d[i] / double(d.size());
    abs_g += std::abs(g[i]) / double(g.size());
  }
  double sgd = 0, sgg = 0, sdd = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    sgd += (g[i] - mg) * (d[i] - md);
    sgg += (g[i] - mg) * (g[i] - mg);
    sdd += (d[i] - md) * (d[i] - md);
  }
  const double r = sgg > 0 && sdd > 0 ? sgd / std::sqrt(sgg * sdd) : NAN;
  return {{"title", "write-gate and rescue gaps: " + pass.title}, {"layers", layers}, {"g", g}, {"d", d},
          {"pearson", std::isnan(r) ? nlohmann::json() : nlohmann::json(r)}, {"mean_abs_g", abs_g}};
}

}  // namespace

nlohmann::json run_analyze(const AnalyzeOptions& opt) {
  if (opt.sequences < 1) fail("analyze: --sequences must be at least 1, got ", opt.sequences);
  if (opt.positions < 1) fail("analyze: --positions must be at least 1, got ", opt.positions);
  const RunModel run = load_run_model(opt.run_dir, opt.checkpoint, RunPrecision::float32);
  const Config& cfg = run.config;
  const std::string kind = cfg.residual.kind;
  const auto supported = supported_analyses(kind);
  std::vector<std::string> what = opt.what.empty() ? supported : opt.what;
  if (what.empty()) fail("analyze: residual.kind \"", kind, "\" has no depth attention or streams to analyse");
  for (const auto& w : what) {
    if (w != "maps" && w != "streams" && w != "cka" && w != "rescue" && w != "gates")
      fail("analyze: --what '", w, "' is not one of maps, streams, cka, rescue, gates");
    if (std::find(supported.begin(), supported.end(), w) == supported.end())
      fail("analyze: --what ", w, " does not apply to residual.kind \"", kind, "\" (it supports: ", join(supported), ")");
  }
  const int64_t T = cfg.model.seq_len;
  if (opt.positions > T) fail("analyze: --positions ", opt.positions, " exceeds the model's seq_len ", T);
  const std::string data_dir = opt.data.empty() ? cfg.data.dir : opt.data;
  const at::Tensor tokens = validation_tokens(data_dir, cfg, opt.sequences);

  const fs::path out = opt.out.empty() ? opt.run_dir / "analysis" : opt.out;
  fs::create_directories(out);
  c10::NoGradGuard no_grad;
  CleanPass pass{*run.model, tokens, T, opt.positions, cfg.model.n_layers,
                 cat(opt.run_dir.filename().string(), " (", kind, ", step ", run.step, ")")};
  pass.run();

  nlohmann::json result = {{"run_dir", opt.run_dir.string()}, {"checkpoint", run.checkpoint.string()}, {"kind", kind},
                           {"step", run.step}, {"sequences", opt.sequences}, {"positions", opt.positions},
                           {"seq_len", T}, {"data", data_dir}};
  auto wants = [&](const char* w) { return std::find(what.begin(), what.end(), w) != what.end(); };
  auto figure = [&](const char* name, nlohmann::json data) {
    write_figure(out, name, data);
    result[name] = std::move(data);
  };
  if (wants("maps")) figure("maps", retrieval_maps(pass));
  if (wants("streams")) figure("streams", stream_fusion(pass));
  if (wants("cka")) figure("cka", cross_stream_cka(pass));
  std::vector<std::vector<double>> gain;  // [stream][layer − 1]
  if (wants("rescue") || wants("gates")) {
    nlohmann::json rescue = rescue_gain(pass, gain);
    if (wants("rescue")) figure("rescue", std::move(rescue));
  }
  if (wants("gates")) figure("gates", gate_asymmetry(pass, gain));
  write_file_atomic(out / "analysis.json", result.dump(1) + "\n");
  return result;
}

}  // namespace depthkit
