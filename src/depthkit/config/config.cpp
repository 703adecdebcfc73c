#include "depthkit/config/config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <toml++/toml.h>
#include <variant>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/numbers.h"

namespace depthkit {

namespace {

// One declared key: where it lives, the field it fills and what values it accepts.
struct Field {
  std::string section, key;
  std::variant<int64_t*, double*, bool*, std::string*, std::vector<int64_t>*> target;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices = {};  // for strings; empty: any
  std::string path() const { return section + "." + key; }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<Field> fields(Config& c) {
  auto& m = c.model;
  auto& r = c.residual;
  auto& t = c.train;
  auto& o = c.optim;
  return {
      {"model", "n_layers", &m.n_layers, 1, 4096},
      {"model", "d_model", &m.d_model, 1, 1 << 20},
      {"model", "n_heads", &m.n_heads, 1, 4096},
      {"model", "n_kv_heads", &m.n_kv_heads, 1, 4096},
      {"model", "head_dim", &m.head_dim, 0, 4096},
      {"model", "d_ff", &m.d_ff, 1, 1 << 22},
      {"model", "vocab_size", &m.vocab_size, 2, 1 << 30},
      {"model", "seq_len", &m.seq_len, 1, double(kMaxSeqLen)},
      {"model", "tie_embeddings", &m.tie_embeddings},
      {"model", "rope_theta", &m.rope_theta, 1, kInf},
      {"model", "norm_eps", &m.norm_eps, 0, 1},
      {"model", "init_std", &m.init_std, 0, 10},
      {"model", "impl", &m.impl, -kInf, kInf, {"reference", "fused"}},
      {"moe", "n_experts", &m.moe.n_experts, 0, 4096},
      {"moe", "top_k", &m.moe.top_k, 1, 4096},
      {"moe", "expert_d_ff", &m.moe.expert_d_ff, 0, 1 << 22},
      {"moe", "n_shared_experts", &m.moe.n_shared_experts, 0, 4096},
      {"moe", "shared_d_ff", &m.moe.shared_d_ff, 0, 1 << 22},
      {"moe", "leading_dense_layers", &m.moe.leading_dense_layers, 0, 4096},
      {"moe", "router", &m.moe.router},  // a name in model/router.h's table (ConfigRules)
      {"moe", "renormalize", &m.moe.renormalize},
      {"moe", "aux_loss_coef", &m.moe.aux_loss_coef, 0, 1e6},
      {"moe", "z_loss_coef", &m.moe.z_loss_coef, 0, 1e6},
      {"moe", "expert_impl", &m.moe.expert_impl, -kInf, kInf, {"auto", "grouped", "loop"}},
      {"moe", "expert_parallel", &m.moe.expert_parallel, 1, 1 << 20},
      {"residual", "kind", &r.kind},  // a name in the pathway registry (ConfigRules)
      {"residual", "block_sublayers", &r.block_sublayers, 1, 1 << 20},
      {"residual", "share_within_block", &r.share_within_block},
      {"residual", "routing", &r.routing, -kInf, kInf, {"cross", "self", "cross_value", "fixed"}},
      {"residual", "streams", &r.streams, 1, 64},
      {"residual", "kernels", &r.kernels, 1, 4096},
      {"residual", "conv", &r.conv},
      {"residual", "conv_init", &r.conv_init, -kInf, kInf, {"zeros", "average", "normal"}},
      {"residual", "fusion", &r.fusion, -kInf, kInf, {"hpre", "mean"}},
      {"residual", "sinkhorn_iters", &r.sinkhorn_iters, 1, 1000},
      {"residual", "impl", &r.impl, -kInf, kInf, {"reference", "fused"}},
      {"data", "dir", &c.data.dir},
      {"train", "micro_batch", &t.micro_batch, 1, 1 << 20},
      {"train", "grad_accum", &t.grad_accum, 1, 1 << 20},
      {"train", "steps", &t.steps, 0, kInf},
      {"train", "tokens", &t.tokens, 0, kInf},
      {"train", "seed", &t.seed, 0, kInf},
      {"train", "data_seed", &t.data_seed, -1, kInf},
      {"train", "eval_every", &t.eval_every, 0, kInf},
      {"train", "eval_tokens", &t.eval_tokens, 1, kInf},
      {"train", "checkpoint_every", &t.checkpoint_every, 0, kInf},
      {"train", "keep_checkpoints", &t.keep_checkpoints, 1, 1 << 20},
      {"train", "log_every", &t.log_every, 1, kInf},
      {"train", "threads", &t.threads, 0, 4096},
      {"train", "device", &t.device, -kInf, kInf, {"cpu", "cuda"}},
      {"train", "backend", &t.backend, -kInf, kInf, {"auto", "gloo", "nccl"}},
      {"train", "zero", &t.zero, 0, 3},
      {"train", "bucket_bytes", &t.bucket_bytes, 0, kInf},
      {"train", "timeout_s", &t.timeout_s, 0.1, 1e6},
      {"train", "dtype", &t.dtype, -kInf, kInf, {"float32", "bfloat16"}},
      {"train", "recompute", &t.recompute, -kInf, kInf, {"none", "branch", "layer"}},
      {"train", "pipeline_stages", &t.pipeline_stages, 1, 1 << 16},
      {"train", "virtual_stages", &t.virtual_stages, 1, 1 << 16},
      {"optim", "lr", &o.lr, 0, 10},
      {"optim", "min_lr", &o.min_lr, 0, 10},
      {"optim", "warmup_steps", &o.warmup_steps, 0, kInf},
      {"optim", "schedule", &o.schedule, -kInf, kInf, {"cosine", "wsd"}},
      {"optim", "decay_fraction", &o.decay_fraction, 0, 1},
      {"optim", "weight_decay", &o.weight_decay, 0, 10},
      {"optim", "beta1", &o.beta1, 0, 0.999999},
      {"optim", "beta2", &o.beta2, 0, 0.999999999},
      {"optim", "eps", &o.eps, 0, 1},
      {"optim", "grad_clip", &o.grad_clip, 0, kInf},
      {"optim", "impl", &o.impl, -kInf, kInf, {"reference", "fused"}},
  };
}

std::string describe(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string \"" + printable(*n.value<std::string>()) + "\"";
    case toml::node_type::integer: return "integer " + std::to_string(*n.value<int64_t>());
    case toml::node_type::floating_point: return cat("float ", *n.value<double>());
    case toml::node_type::boolean: return *n.value<bool>() ? "true" : "false";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    default: return "a date/time";
  }
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + ("\"" + v[i] + "\"");
  return s;
}

// Reads one node into its field, checking type and range. `where` names the source.
void assign(const Field& f, const toml::node& n, const std::string& where) {
  auto bad = [&](const std::string& want) {
    fail(where, ": key '", f.path(), "' must be ", want, ", got ", describe(n));
  };
  // Integers print as integers (4194305, not 4.1943e+06), other numbers in full.
  auto check_range = [&](double v, const std::string& given) {
    if (!(v >= f.min && v <= f.max))
      fail(where, ": key '", f.path(), "' must be ", range_text(f.min, f.max, kInf), ", got ", given);
  };
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          auto v = n.value_exact<int64_t>();
          if (!v) bad("an integer");
          check_range(double(*v), std::to_string(*v));
          *p = *v;
        } else if constexpr (std::is_same_v<T, double>) {
          if (!n.is_number()) bad("a number");
          double v = *n.value<double>();
          if (!std::isfinite(v)) fail(where, ": key '", f.path(), "' must be a finite number, got ", v);
          check_range(v, number_text(v));
          *p = v;
        } else if constexpr (std::is_same_v<T, bool>) {
          auto v = n.value_exact<bool>();
          if (!v) bad("true or false");
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          const toml::array* arr = n.as_array();
          if (!arr) bad("an array of integers");
          std::vector<int64_t> out;
          for (const auto& el : *arr) {
            auto v = el.value_exact<int64_t>();
            if (!v) fail(where, ": key '", f.path(), "' must be an array of integers, got an element ", describe(el));
            check_range(double(*v), std::to_string(*v));
            out.push_back(*v);
          }
          *p = out;
        } else {
          auto v = n.value_exact<std::string>();
          if (!v) bad("a string");
          if (!f.choices.empty() &&
              std::find(f.choices.begin(), f.choices.end(), *v) == f.choices.end())
            fail(where, ": key '", f.path(), "' must be one of ", join(f.choices), ", got \"", *v, "\"");
          *p = *v;
        }
      },
      f.target);
}

// Parses the value of a --set override as TOML; bare words are strings (train.device=cpu).
// A value is one TOML value: a line break in it would let it define further keys, unseen.
toml::table parse_override_value(const std::string& value, const std::string& where) {
  if (value.find_first_of("\r\n") != std::string::npos || value.find('\0') != std::string::npos)
    fail(where.substr(0, where.find_first_of("\r\n")), "...: the value contains a line break or NUL byte; give one value per --set");
  try {
    toml::table t = toml::parse("v = " + value);
    if (t.size() == 1) return t;
  } catch (const toml::parse_error&) {
  }
  toml::table t;
  t.insert("v", value);
  return t;
}

// a · b, or a failure naming `what` when the product does not fit in 64 bits.
int64_t checked_mul(int64_t a, int64_t b, const std::string& where, const std::string& what) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) fail(where, ": ", what, " overflows 64 bits (", a, " x ", b, ")");
  return out;
}

void validate(const Config& c, const std::string& where, const ConfigRules& rules) {
  const auto& m = c.model;
  if (m.n_heads % m.n_kv_heads != 0)
    fail(where, ": key 'model.n_kv_heads' (", m.n_kv_heads, ") must divide model.n_heads (", m.n_heads, ")");
  if (m.head_dim == 0 && m.d_model % m.n_heads != 0)
    fail(where, ": key 'model.head_dim' is unset and model.d_model (", m.d_model,
         ") is not divisible by model.n_heads (", m.n_heads, ")");
  if (m.resolved_head_dim() % 2 != 0)
    fail(where, ": key 'model.head_dim' must be even for RoPE, got ", m.resolved_head_dim());
  if (m.moe.enabled()) {
    if (m.moe.top_k > m.moe.n_experts)
      fail(where, ": key 'moe.top_k' (", m.moe.top_k, ") must not exceed moe.n_experts (", m.moe.n_experts, ")");
    if (m.moe.expert_d_ff == 0)
      fail(where, ": key 'moe.expert_d_ff' must be set (>= 1) when moe.n_experts is ", m.moe.n_experts);
    if (m.moe.leading_dense_layers >= m.n_layers)
      fail(where, ": key 'moe.leading_dense_layers' (", m.moe.leading_dense_layers,
           ") must be below model.n_layers (", m.n_layers, "): no layer would be MoE");
    checked_mul(checked_mul(checked_mul(m.moe.n_experts, m.moe.expert_d_ff, where, "moe.n_experts x moe.expert_d_ff"),
                            m.d_model, where, "the experts' matrices (moe.n_experts x moe.expert_d_ff x model.d_model)"),
                12, where, "the experts' bytes (3 x moe.n_experts x moe.expert_d_ff x model.d_model x 4)");
    if (m.moe.n_experts % m.moe.expert_parallel != 0)
      fail(where, ": key 'moe.expert_parallel' (", m.moe.expert_parallel, ") must divide moe.n_experts (",
           m.moe.n_experts, ")");
    if (m.moe.expert_impl == "grouped") {
      const std::string why = grouped_experts_unsupported(c.train.device, c.train.dtype, m.d_model, m.moe.expert_d_ff);
      if (!why.empty()) fail(where, ": key 'moe.expert_impl' is \"grouped\", but ", why, "; use \"auto\" or \"loop\"");
    }
    checked_mul(checked_mul(m.moe.n_shared_experts, m.moe.resolved_shared_d_ff(), where,
                            "moe.n_shared_experts x moe.shared_d_ff"),
                checked_mul(m.d_model, 12, where, "model.d_model x 12"), where,
                "the shared experts' bytes (3 x moe.n_shared_experts x moe.shared_d_ff x model.d_model x 4)");
  }
  if (c.train.zero == 3 && c.train.recompute == "none")
    fail(where, ": key 'train.zero' is 3, which needs key 'train.recompute' = \"branch\" or \"layer\" (got \"none\"): "
         "ZeRO-3 gathers a branch's parameters again in backward, where the branch runs again");
  if (const int64_t chunks = c.train.pipeline_stages * c.train.virtual_stages; chunks > m.n_layers)
    fail(where, ": key 'train.pipeline_stages' × 'train.virtual_stages' (", c.train.pipeline_stages, " × ",
         c.train.virtual_stages, " = ", chunks, ") exceeds model.n_layers (", m.n_layers,
         "): every chunk of a stage needs a layer of its own");
  if (c.train.virtual_stages > 1 && c.train.pipeline_stages == 1)
    fail(where, ": key 'train.virtual_stages' is ", c.train.virtual_stages,
         ", which needs key 'train.pipeline_stages' > 1 (virtual stages interleave the chunks of several stages)");
  if (c.train.virtual_stages > 1 && c.train.grad_accum % c.train.pipeline_stages != 0)
    fail(where, ": key 'train.grad_accum' (", c.train.grad_accum, ") must be a multiple of key 'train.pipeline_stages' (",
         c.train.pipeline_stages, ") when key 'train.virtual_stages' is ", c.train.virtual_stages,
         ": the interleaved schedule runs the micro-batches in groups of one per stage");
  if (!m.moe.enabled() && m.moe.expert_parallel > 1)
    fail(where, ": key 'moe.expert_parallel' is ", m.moe.expert_parallel, " but the model has no experts (moe.n_experts = 0)");
  if (rules.check) rules.check(c, where);  // the kind's own checks, from above (ConfigRules)
  if (c.train.steps == 0 && c.train.tokens == 0)
    fail(where, ": key 'train.steps' or 'train.tokens' must be set (both are 0)");
  if (c.data.dir.empty()) fail(where, ": key 'data.dir' must not be empty");
  // Sizes that are products of keys must fit in 64 bits: tokens per step, tokens over the whole
  // run, and the largest parameter matrices (their element counts, in bytes).
  const int64_t tokens_per_step = checked_mul(
      checked_mul(c.train.micro_batch, c.train.grad_accum, where, "train.micro_batch x train.grad_accum"),
      m.seq_len, where, "tokens per step (train.micro_batch x train.grad_accum x model.seq_len)");
  checked_mul(c.total_steps(), tokens_per_step, where,
              "the run's token count (train.steps x train.micro_batch x train.grad_accum x model.seq_len)");
  checked_mul(checked_mul(m.vocab_size, m.d_model, where, "the embedding (model.vocab_size x model.d_model)"), 4,
              where, "the embedding's bytes (model.vocab_size x model.d_model x 4)");
  checked_mul(checked_mul(m.d_ff, m.d_model, where, "the feed-forward matrix (model.d_ff x model.d_model)"), 12,
              where, "the feed-forward matrices' bytes (3 x model.d_ff x model.d_model x 4)");
  checked_mul(checked_mul(m.n_heads, m.resolved_head_dim(), where, "model.n_heads x model.head_dim"),
              checked_mul(m.d_model, 4, where, "model.d_model x 4"), where,
              "the attention projection's bytes (model.n_heads x model.head_dim x model.d_model x 4)");
  if (c.optim.min_lr > c.optim.lr)
    fail(where, ": key 'optim.min_lr' (", c.optim.min_lr, ") must not exceed optim.lr (", c.optim.lr, ")");
}

}  // namespace

std::string grouped_experts_unsupported(const std::string& device, const std::string& dtype, int64_t d_model,
                                        int64_t expert_d_ff) {
  if (device != "cpu") return cat("at::_grouped_mm runs the experts on the CPU only, and the device is ", device);
  if (dtype != "float32" && dtype != "bfloat16") return cat("at::_grouped_mm takes float32 or bfloat16, not ", dtype);
  const int64_t bytes = dtype == "float32" ? 4 : 2;
  if ((d_model * bytes) % 16 != 0 || (expert_d_ff * bytes) % 16 != 0)
    return cat("at::_grouped_mm needs rows of a multiple of 16 bytes: model.d_model (", d_model, ") and moe.expert_d_ff (",
               expert_d_ff, ") multiples of ", 16 / bytes, " in ", dtype);
  return "";
}

Config Config::parse(const std::string& text, const std::string& source, const ConfigRules& rules,
                     const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    fail(source, ":", b.line, ":", b.column, ": TOML syntax error: ", e.description());
  }
  Config c;
  auto fs = fields(c);
  for (auto& f : fs)
    if (auto it = rules.choices.find(f.path()); it != rules.choices.end()) f.choices = it->second;
  auto find = [&](const std::string& section, const std::string& key) -> const Field* {
    for (auto& f : fs)
      if (f.section == section && f.key == key) return &f;
    return nullptr;
  };
  // Every key in the file must be declared.
  for (auto&& [sec, node] : root) {
    std::string s(sec.str());
    auto* tbl = node.as_table();
    if (!tbl) fail(source, ": top-level key '", s, "' must be a [section] table");
    bool known_section = false;
    for (auto& f : fs) known_section |= f.section == s;
    if (!known_section) fail(source, ": unknown section '[", s, "]'");
    for (auto&& [key, val] : *tbl) {
      const Field* f = find(s, std::string(key.str()));
      if (!f) fail(source, ": unknown key '", s, ".", key.str(), "'");
      assign(*f, val, source);
    }
  }
  for (const auto& o : overrides) {
    std::string where = "--set " + o;
    auto eq = o.find('=');
    if (eq == std::string::npos) fail(where, ": expected section.key=value");
    std::string path = o.substr(0, eq);
    auto dot = path.find('.');
    if (dot == std::string::npos) fail(where, ": key '", path, "' must be section.key");
    const Field* f = find(path.substr(0, dot), path.substr(dot + 1));
    if (!f) fail(where, ": unknown key '", path, "'");
    auto value = parse_override_value(o.substr(eq + 1), where);
    assign(*f, *value.get("v"), where);
  }
  validate(c, source, rules);
  return c;
}

Config Config::load(const std::string& path, const ConfigRules& rules, const std::vector<std::string>& overrides) {
  return parse(read_file(path, 16u << 20), path, rules, overrides);
}

std::vector<ConfigKey> Config::keys() {
  Config c;
  std::vector<ConfigKey> out;
  for (const auto& f : fields(c)) {
    const char* type = std::visit(
        [](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, int64_t>) return "integer";
          else if constexpr (std::is_same_v<T, double>) return "number";
          else if constexpr (std::is_same_v<T, bool>) return "boolean";
          else if constexpr (std::is_same_v<T, std::string>) return "string";
          else return "integer array";
        },
        f.target);
    out.push_back({f.section, f.key, type, f.min, f.max, f.choices});
  }
  return out;
}

namespace {

// The config as a TOML table, one [section] per field section, in declaration order.
toml::table as_table(const Config& c) {
  Config copy = c;
  toml::table root;
  for (const auto& f : fields(copy)) {
    if (!root.contains(f.section)) root.insert(f.section, toml::table{});
    auto* sec = root.get_as<toml::table>(f.section);
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            toml::array arr;
            for (int64_t v : *p) arr.push_back(v);
            sec->insert(f.key, arr);
          } else {
            sec->insert(f.key, *p);
          }
        },
        f.target);
  }
  return root;
}

}  // namespace

std::string Config::to_toml() const {
  std::ostringstream os;
  os << as_table(*this) << "\n";
  return os.str();
}

std::vector<std::pair<std::string, std::string>> Config::values() const {
  const toml::table root = as_table(*this);
  Config copy = *this;
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& f : fields(copy)) {
    std::ostringstream os;
    const toml::node& n = *root.get_as<toml::table>(f.section)->get(f.key);
    if (n.is_floating_point()) os << number_text(*n.value<double>());  // 0.003, not 0.0030000000000000001
    else n.visit([&](const auto& v) { os << v; });
    out.emplace_back(f.path(), os.str());
  }
  return out;
}

int64_t Config::total_steps(int64_t ranks) const {
  if (train.steps > 0) return train.steps;
  int64_t per_step = 0;  // one rank's is validated to fit in 64 bits; the trainer checks ranks x that
  if (__builtin_mul_overflow(tokens_per_step(), ranks, &per_step))
    fail("tokens per step (", ranks, " ranks x ", tokens_per_step(), ") overflow 64 bits");
  return train.tokens / per_step + (train.tokens % per_step != 0);  // ceil, without overflow
}

}  // namespace depthkit
