#include "depthkit/train/pipeline.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include "depthkit/model/transformer.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/ops/shared_source.h"
#include "depthkit/util/error.h"

namespace depthkit {

int64_t PipelineLayout::chunk_of_layer(int64_t layer) const {
  for (int64_t c = chunks() - 1; c >= 0; --c)
    if (layer >= first_layer(c)) return c;
  return 0;
}

PipelineLayout PipelineLayout::of(const Config& cfg) {
  return {cfg.train.pipeline_stages, cfg.train.virtual_stages, cfg.model.n_layers};
}

void check_pipeline_layout(const Config& cfg, int64_t ranks) {
  const int64_t K = cfg.train.pipeline_stages, P = cfg.model.moe.expert_parallel;
  if (ranks % K != 0)
    fail("key 'train.pipeline_stages' (", K, ") must divide the number of ranks (", ranks, "): each stage is ",
         "an equal block of ranks");
  // Two stages with virtual stages send activations and gradients both ways between the same two
  // ranks, in orders each rank's schedule sets: Gloo pairs them by tag, NCCL only in issue order.
  if (K == 2 && cfg.train.virtual_stages > 1 && cfg.train.device == "cuda" && cfg.train.backend != "gloo")
    fail("key 'train.virtual_stages' (", cfg.train.virtual_stages, ") with key 'train.pipeline_stages' = 2 needs ",
         "train.backend = \"gloo\": NCCL would pair the messages the two stages exchange both ways out of order; ",
         "use 4 or more stages, or no virtual stages");
  if ((ranks / K) % P != 0)
    fail("key 'moe.expert_parallel' (", P, ") must divide the ranks of each pipeline stage (", ranks, " ranks / ", K,
         " stages = ", ranks / K, "): the experts are split among the ranks that hold the same layers");
}

StageParameters stage_parameters(const ParameterStore& store, const PipelineLayout& layout, int64_t stage) {
  StageParameters out;
  const int64_t last = layout.chunks() - 1;
  auto held_in = [&](int64_t chunk) { return layout.stage_of(chunk) == stage ? chunk : StageParameters::kNotHeld; };
  for (const Parameter& p : store.all()) {
    int64_t chunk = StageParameters::kNotHeld;
    if (p.component == "residual") {
      chunk = StageParameters::kEveryStage;  // read at every depth
    } else if (p.name.rfind("layers.", 0) == 0) {
      chunk = held_in(layout.chunk_of_layer(std::stoll(p.name.substr(7))));
    } else if (p.name == "embedding") {
      // Tied to the head, the embedding is read on the first and the last stage: every stage holds it.
      const bool tied = std::none_of(store.all().begin(), store.all().end(),
                                     [](const Parameter& q) { return q.name == "lm_head"; });
      chunk = tied && layout.stages > 1 ? StageParameters::kEveryStage : held_in(0);
    } else if (p.name == "final_norm" || p.name == "lm_head") {
      chunk = held_in(last);
    } else {
      fail("pipeline stages: parameter '", p.name, "' belongs to no stage");
    }
    out.chunk.push_back(chunk);
  }
  return out;
}

// ---- The schedule ----

PipelineSchedule PipelineSchedule::one_f_one_b(const PipelineLayout& layout, int64_t M) {
  const int64_t K = layout.stages, V = layout.virtual_stages, C = layout.chunks();
  PipelineSchedule out;
  out.by_stage.resize(size_t(K));
  for (int64_t s = 0; s < K; ++s) {
    // The k-th forward and backward of the stage (Megatron's order): with virtual stages, groups
    // of K micro-batches through chunk v, then the same group through chunk v + 1.
    auto op = [&](int64_t k, bool backward) {
      const int64_t group = k / (K * V), in_group = k % (K * V);
      int64_t v = in_group / K;
      if (backward) v = V - 1 - v;
      return PipelineOp{backward, V == 1 ? k : group * K + in_group % K, v * K + s};
    };
    const int64_t total = M * V;
    const int64_t warmup = std::min(total, V == 1 ? K - s - 1 : (K - s - 1) * 2 + (V - 1) * K);
    std::vector<PipelineOp>& ops = out.by_stage[size_t(s)];
    for (int64_t k = 0; k < warmup; ++k) ops.push_back(op(k, false));
    for (int64_t k = 0; k < total - warmup; ++k) {
      ops.push_back(op(warmup + k, false));
      ops.push_back(op(k, true));
    }
    for (int64_t k = total - warmup; k < total; ++k) ops.push_back(op(k, true));
  }
  // Timed: each op starts when its stage is free and its input is ready (forward 1, backward 2).
  std::map<std::tuple<bool, int64_t, int64_t>, double> done;
  std::vector<size_t> next(size_t(K), 0);
  std::vector<double> free_at(size_t(K), 0);
  size_t left = 0;
  for (const auto& ops : out.by_stage) left += ops.size();
  while (left > 0) {
    bool progressed = false;
    for (int64_t s = 0; s < K; ++s) {
      if (next[size_t(s)] == out.by_stage[size_t(s)].size()) continue;
      const PipelineOp& o = out.by_stage[size_t(s)][next[size_t(s)]];
      std::tuple<bool, int64_t, int64_t> dep;
      bool has_dep = true;
      if (!o.backward) {
        has_dep = o.chunk > 0;
        dep = {false, o.micro, o.chunk - 1};
      } else {
        dep = o.chunk == C - 1 ? std::make_tuple(false, o.micro, o.chunk) : std::make_tuple(true, o.micro, o.chunk + 1);
      }
      if (has_dep && !done.count(dep)) continue;
      const double start = std::max(free_at[size_t(s)], has_dep ? done[dep] : 0.0);
      free_at[size_t(s)] = start + (o.backward ? 2 : 1);
      done[{o.backward, o.micro, o.chunk}] = free_at[size_t(s)];
      ++next[size_t(s)];
      --left;
      progressed = true;
    }
    if (!progressed) fail("pipeline schedule: the 1F1B order of ", K, " stages and ", M, " micro-batches deadlocks");
  }
  const double span = *std::max_element(free_at.begin(), free_at.end());
  out.bubble = 1.0 - double(M * V * 3) / span;  // every stage is busy 3 units per micro-batch and chunk
  return out;
}

// ---- One rank's part ----

namespace {

enum Direction { kForward = 0, kBackward = 1 };

// A message's tag, unique within a step: its micro-batch, the chunk it enters (forward) or
// leaves (backward), its direction and its part (header, shapes, payload).
int tag_of(int64_t micro, int64_t chunk, Direction direction, int part, int64_t chunks) {
  const int64_t tag = ((micro * chunks + chunk) * 2 + direction) * 3 + part;
  if (tag > std::numeric_limits<int>::max()) fail("pipeline: too many micro-batches × chunks for a message tag");
  return int(tag);
}

}  // namespace

struct Pipeline::Run {
  std::vector<at::Tensor> inputs;   // leaves: the sources this rank held already, those received, the carried
  int64_t cached = 0;               // inputs [0, cached) taken from this rank's chunk − K of the micro-batch
  std::vector<at::Tensor> outputs;  // the state after the chunk (not the last): its sources, then the carried
  int64_t output_sources = 0;
  int64_t sent_from = 0;  // outputs [sent_from, …) went to the next chunk; the rest its rank held
  at::Tensor loss;        // this chunk's share of the micro-batch's loss, over the micro-batches
};

Pipeline::Pipeline(Transformer& model, ParameterSets& sets, const PipelineLayout& layout, World& world, Group& pipe,
                   int64_t micro_batches)
    : model_(model),
      sets_(sets),
      layout_(layout),
      world_(world),
      pipe_(pipe),
      stage_(pipe.rank()),
      micro_batches_(micro_batches),
      schedule_(PipelineSchedule::one_f_one_b(layout, micro_batches)),
      sent_(size_t(layout.chunks()), 0) {
  if (pipe.size() != layout.stages)
    fail("Pipeline: a pipe of ", pipe.size(), " ranks for ", layout.stages, " stages");
  const ModelConfig& cfg = model.config();
  int64_t n = 0;
  for (int64_t i = 0; i < cfg.n_layers; ++i) moe_index_.push_back(cfg.moe.enabled() && cfg.moe.is_moe_layer(i) ? n++ : -1);
}

Pipeline::~Pipeline() {
  try {
    wait_sends();
  } catch (...) {
  }
}

void Pipeline::wait_sends() {
  for (auto& [key, sends] : sends_)
    for (auto& s : sends) s->wait();
  sends_.clear();
}

void Pipeline::forward(int64_t m, int64_t c, const at::Tensor& batch, bool grad) {
  const int64_t C = layout_.chunks(), K = layout_.stages;
  const int64_t first = layout_.first_layer(c), last = layout_.first_layer(c + 1);
  const int64_t B = batch.size(0), T = batch.size(1) - 1;
  const at::TensorOptions options = at::TensorOptions(model_.compute_dtype()).device(model_.parameters().device());
  ResidualPathway& path = model_.pathway();
  auto run = std::make_unique<Run>();
  std::unique_ptr<PathwayState> state;
  if (c == 0) {
    state = path.begin(model_.embed(batch.narrow(1, 0, T)));
  } else {
    const int64_t from = layout_.stage_of(c - 1);
    at::Tensor header = at::empty({3}, at::kLong);  // tensors, sources among them, tensors per source
    pipe_.recv(header, from, tag_of(m, c, kForward, 0, C));
    const int64_t n = header[0].item<int64_t>(), n_sources = header[1].item<int64_t>();
    at::Tensor shapes = at::empty({std::max<int64_t>(1, 5 * n)}, at::kLong);  // per tensor: rank, up to 4 sizes
    pipe_.recv(shapes, from, tag_of(m, c, kForward, 1, C));
    std::vector<std::vector<int64_t>> sizes;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto* row = shapes.data_ptr<int64_t>() + 5 * i;
      sizes.emplace_back(row + 1, row + 1 + row[0]);
      int64_t numel = 1;
      for (int64_t s : sizes.back()) numel *= s;
      total += numel;
    }
    at::Tensor payload = at::empty({total}, options);
    pipe_.recv(payload, from, tag_of(m, c, kForward, 2, C));
    StageState in;
    in.width = header[2].item<int64_t>();
    auto leaf = [grad](const at::Tensor& t) { return t.detach().requires_grad_(grad); };
    // The sources this rank holds from its own earlier chunk of the micro-batch come first.
    if (c >= K) {
      const Run& earlier = *runs_.at({m, c - K});
      for (int64_t i = 0; i < earlier.output_sources; ++i) in.sources.push_back(leaf(earlier.outputs[size_t(i)]));
      run->cached = earlier.output_sources;
    }
    int64_t at = 0;
    for (int64_t i = 0; i < n; ++i) {
      int64_t numel = 1;
      for (int64_t s : sizes[size_t(i)]) numel *= s;
      at::Tensor t = leaf(payload.narrow(0, at, numel).view(sizes[size_t(i)]));
      at += numel;
      (i < n_sources ? in.sources : in.carried).push_back(t);
    }
    run->inputs = in.sources;
    run->inputs.insert(run->inputs.end(), in.carried.begin(), in.carried.end());
    state = path.stage_in(in, 2 * first, B, T);
  }
  model_.run_stage(*state, first, last);
  const MoeTerms& terms = model_.moe_terms();
  at::Tensor part;
  if (c == C - 1) {
    part = model_.stage_lm_loss(*state, batch.narrow(1, 1, T));
    if (!grad) loss_ = part.item<double>() * double(B * T);
    if (grad && moe_wanted_) moe_[0] += part.item<double>() / double(micro_batches_);
  }
  if (grad && terms.aux_loss.defined()) {
    const at::Tensor aux = part.defined() ? terms.aux_loss.to(part.scalar_type()) : terms.aux_loss;
    part = part.defined() ? part + aux : aux;
    if (moe_wanted_) {
      const double M = double(micro_batches_);
      moe_[1] += aux.item<double>() / M;
      moe_[2] += terms.balance.item<double>() / M;
      const std::vector<double> load = terms.load_max_over_mean();
      for (size_t k = 0; k < load.size(); ++k) moe_[size_t(3 + moe_index_[size_t(terms.layers[k])])] += load[k] / M;
    }
  }
  if (grad && part.defined()) {
    run->loss = part / double(micro_batches_);
    loss_ += run->loss.item<double>();
  }
  if (c < C - 1) {
    const StageState out = path.stage_out(*state, 2 * last);
    if (int64_t(out.sources.size()) != path.sources_after(2 * last) * out.width)
      fail("pipeline: residual.kind \"", path.kind(), "\" hands on ", out.sources.size(), " source tensors after branch ",
           2 * last, ", its count says ", path.sources_after(2 * last) * out.width);
    run->outputs = out.sources;
    run->outputs.insert(run->outputs.end(), out.carried.begin(), out.carried.end());
    run->output_sources = int64_t(out.sources.size());
    // The next chunk's rank holds the sources its chunk c + 1 − K of this micro-batch ended with.
    run->sent_from = c + 1 >= K ? path.sources_after(2 * layout_.first_layer(c + 2 - K)) * out.width : 0;
    const int64_t n = int64_t(run->outputs.size()) - run->sent_from;
    at::Tensor header = at::empty({3}, at::kLong), shapes = at::zeros({std::max<int64_t>(1, 5 * n)}, at::kLong);
    header.data_ptr<int64_t>()[0] = n;
    header.data_ptr<int64_t>()[1] = run->output_sources - run->sent_from;
    header.data_ptr<int64_t>()[2] = out.width;
    std::vector<at::Tensor> flat;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = run->outputs[size_t(run->sent_from + i)];
      if (t.dim() > 4 || t.scalar_type() != options.dtype().toScalarType())
        fail("pipeline: a state tensor of ", t.sizes(), " in ", t.scalar_type(), " cannot cross a stage boundary");
      int64_t* row = shapes.data_ptr<int64_t>() + 5 * i;
      row[0] = t.dim();
      for (int64_t d = 0; d < t.dim(); ++d) row[1 + d] = t.size(d);
      flat.push_back(t.detach().reshape(-1));
    }
    const at::Tensor payload = flat.empty() ? at::empty({0}, options) : at::cat(flat);
    const int64_t to = layout_.stage_of(c + 1);
    auto& sends = sends_[{m, c + 1, kForward}];
    sends.push_back(pipe_.isend(header, to, tag_of(m, c + 1, kForward, 0, C)));
    sends.push_back(pipe_.isend(shapes, to, tag_of(m, c + 1, kForward, 1, C)));
    sends.push_back(pipe_.isend(payload, to, tag_of(m, c + 1, kForward, 2, C)));
    if (grad) sent_[size_t(c)] += payload.nbytes();
  }
  runs_[{m, c}] = std::move(run);
}

void Pipeline::backward(int64_t m, int64_t c, bool last_micro) {
  const int64_t C = layout_.chunks(), K = layout_.stages;
  Run& run = *runs_.at({m, c});
  std::vector<at::Tensor> roots, grads;
  if (run.loss.defined()) {
    roots.push_back(run.loss);
    grads.push_back(at::ones_like(run.loss));
  }
  Run* later = c + K < C ? runs_.at({m, c + K}).get() : nullptr;
  if (c < C - 1) {
    // The gradients of what went to the next chunk, and of the sources this rank's chunk c + K took up.
    int64_t total = 0;
    for (size_t i = size_t(run.sent_from); i < run.outputs.size(); ++i) total += run.outputs[i].numel();
    at::Tensor payload = at::empty({total}, run.outputs.back().options().requires_grad(false));
    pipe_.recv(payload, layout_.stage_of(c + 1), tag_of(m, c + 1, kBackward, 2, C));
    // The next chunk took what was sent to it before it sent this: those sends are done.
    if (auto it = sends_.find({m, c + 1, kForward}); it != sends_.end()) {
      for (auto& send : it->second) send->wait();
      sends_.erase(it);
    }
    int64_t at = 0;
    for (size_t i = 0; i < run.outputs.size(); ++i) {
      const at::Tensor& out = run.outputs[i];
      at::Tensor g;
      if (int64_t(i) >= run.sent_from) {
        g = payload.narrow(0, at, out.numel()).view(out.sizes());
        at += out.numel();
      }
      if (later && int64_t(i) < later->cached && later->inputs[i].grad().defined())
        g = g.defined() ? g + later->inputs[i].grad() : later->inputs[i].grad();
      if (!g.defined() || !out.requires_grad()) continue;
      // A shared source takes the sum its later reads left as its accumulator's start, which this
      // chunk's reads continue: the additions of one rank's backward, in its order.
      const bool seeded = g.scalar_type() == at::kFloat && fused::seed_accumulator(out, g.clone());
      roots.push_back(out);
      grads.push_back(seeded ? at::zeros_like(g) : g);
    }
  }
  sets_.begin_micro_step(last_micro, c);
  sets_.before_backward(c);
  if (!roots.empty()) torch::autograd::backward(roots, grads);
  sets_.after_backward(c);
  if (c > 0) {  // the gradients of what this chunk received, back to the chunk before
    std::vector<at::Tensor> flat;
    for (size_t i = size_t(run.cached); i < run.inputs.size(); ++i) {
      const at::Tensor& x = run.inputs[i];
      flat.push_back(x.grad().defined() ? x.grad().reshape(-1) : at::zeros({x.numel()}, x.options().requires_grad(false)));
    }
    const at::Tensor payload = flat.empty() ? at::empty({0}, run.outputs.empty() ? at::TensorOptions() : run.outputs[0].options())
                                            : at::cat(flat);
    sends_[{m, c, kBackward}].push_back(pipe_.isend(payload, layout_.stage_of(c - 1), tag_of(m, c, kBackward, 2, C)));
  }
  if (later) runs_.erase({m, c + K});  // its sources' gradients are taken up
  run.outputs.clear();
  run.loss = at::Tensor();
  if (c < K) runs_.erase({m, c});  // else kept for chunk c − K, which takes its cached inputs' gradients
}

double Pipeline::train_step(const std::vector<at::Tensor>& batches, std::vector<double>* moe_terms) {
  if (int64_t(batches.size()) != micro_batches_)
    fail("Pipeline: ", batches.size(), " micro-batches for a schedule of ", micro_batches_);
  loss_ = 0;
  moe_wanted_ = moe_terms != nullptr;
  moe_.assign(moe_wanted_ ? size_t(3 + std::count_if(moe_index_.begin(), moe_index_.end(), [](int64_t i) { return i >= 0; })) : 0,
              0.0);
  for (const PipelineOp& op : schedule_.by_stage[size_t(stage_)]) {
    if (!op.backward)
      forward(op.micro, op.chunk, batches[size_t(op.micro)], true);
    else
      backward(op.micro, op.chunk, op.micro == micro_batches_ - 1);
    // The sends received by now free their buffers (the rest are waited for at the step's end).
    for (auto it = sends_.begin(); it != sends_.end();) {
      const bool done = std::all_of(it->second.begin(), it->second.end(), [](const auto& s) { return s->done(); });
      if (done) {
        for (auto& send : it->second) send->wait();  // reports a failed one
        it = sends_.erase(it);
      } else {
        ++it;
      }
    }
  }
  wait_sends();
  runs_.clear();
  micro_batches_run_ += micro_batches_;
  if (moe_terms) *moe_terms = moe_;
  return loss_;
}

double Pipeline::loss_sum(const at::Tensor& batch) {
  at::NoGradGuard no_grad;
  loss_ = 0;
  for (int64_t c = stage_; c < layout_.chunks(); c += layout_.stages) forward(0, c, batch, false);
  wait_sends();
  runs_.clear();
  return loss_;
}

std::vector<int64_t> Pipeline::sent_bytes() const {
  std::vector<int64_t> out;
  for (int64_t c = 0; c + 1 < layout_.chunks(); ++c)
    out.push_back(micro_batches_run_ ? sent_[size_t(c)] / micro_batches_run_ : 0);
  return out;
}

// ---- Checkpoints ----

namespace {

// Specs as text, one per line: name, dtype, sizes (the stage's first rank tells rank 0).
std::string encode_specs(const std::vector<TensorSpec>& specs) {
  std::ostringstream out;
  for (const TensorSpec& s : specs) {
    out << s.name << '\t' << int(s.dtype);
    for (int64_t d : s.shape) out << '\t' << d;
    out << '\n';
  }
  return out.str();
}

std::vector<TensorSpec> decode_specs(const std::string& text) {
  std::vector<TensorSpec> specs;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    TensorSpec s;
    std::string dtype, d;
    std::getline(fields, s.name, '\t');
    std::getline(fields, dtype, '\t');
    s.dtype = at::ScalarType(std::stoi(dtype));
    while (std::getline(fields, d, '\t')) s.shape.push_back(std::stoll(d));
    specs.push_back(s);
  }
  return specs;
}

void send_text(Group& group, const std::string& text, int64_t to) {
  at::Tensor n = at::empty({1}, at::kLong);
  n.data_ptr<int64_t>()[0] = int64_t(text.size());
  group.send(n, to);
  at::Tensor bytes = at::empty({std::max<int64_t>(1, int64_t(text.size()))}, at::kByte);
  std::copy(text.begin(), text.end(), bytes.data_ptr<uint8_t>());
  group.send(bytes, to);
}

std::string receive_text(Group& group, int64_t from) {
  at::Tensor n = at::empty({1}, at::kLong);
  group.recv(n, from);
  at::Tensor bytes = at::empty({std::max<int64_t>(1, n.data_ptr<int64_t>()[0])}, at::kByte);
  group.recv(bytes, from);
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), size_t(n.data_ptr<int64_t>()[0]));
}

int64_t numel_of(const TensorSpec& s) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return n;
}

}  // namespace

TensorStream joined_stream(World& world, Group& data, int64_t stage, int64_t stages, const TensorStream& every_stage,
                           const TensorStream& this_stage) {
  Group& all = world.all();
  const int64_t per_stage = data.size();
  const bool stage_root = data.rank() == 0;
  // Rank 0 learns every stage's tensors from its first rank.
  std::vector<std::vector<TensorSpec>> by_stage(static_cast<size_t>(stages));
  by_stage[size_t(stage)] = this_stage.specs;
  if (world.root()) {
    for (int64_t s = 1; s < stages; ++s) by_stage[size_t(s)] = decode_specs(receive_text(all, s * per_stage));
  } else if (stage_root) {
    send_text(all, encode_specs(this_stage.specs), 0);
  }
  TensorStream out;
  out.specs = every_stage.specs;
  for (const auto& specs : by_stage) out.specs.insert(out.specs.end(), specs.begin(), specs.end());
  out.produce = [&world, &all, stage, stages, per_stage, stage_root, every_stage, this_stage,
                 by_stage](const TensorStream::Sink& sink) {
    every_stage.produce(sink);  // every rank takes part; rank 0 writes
    for (int64_t s = 0; s < stages; ++s) {
      if (s == 0 && stage == 0) {
        this_stage.produce(sink);
      } else if (s == stage) {  // a piece's length, then the piece, to rank 0
        this_stage.produce([&all, stage_root](const at::Tensor& piece) {
          if (!stage_root) return;
          at::Tensor n = at::empty({1}, at::kLong);
          n.data_ptr<int64_t>()[0] = piece.numel();
          all.send(n, 0);
          all.send(piece.contiguous(), 0);
        });
      } else if (world.root()) {
        for (const TensorSpec& spec : by_stage[size_t(s)])
          for (int64_t left = numel_of(spec); left > 0;) {
            at::Tensor n = at::empty({1}, at::kLong);
            all.recv(n, s * per_stage);
            at::Tensor piece = at::empty({n.data_ptr<int64_t>()[0]}, at::TensorOptions(spec.dtype));
            all.recv(piece, s * per_stage);
            sink(piece);
            left -= piece.numel();
          }
      }
    }
  };
  return out;
}

}  // namespace depthkit
