#include "depthkit/train/optimizer.h"

#include <ATen/TensorOperators.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/square.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>

#include "depthkit/dist/world.h"
#include "depthkit/nn/parameters.h"
#include "depthkit/util/error.h"

namespace depthkit {

ParameterShard ParameterShard::of(const std::vector<int64_t>& sizes, int64_t rank, int64_t ranks) {
  constexpr int64_t kAlign = 64;  // elements: a whole number of vectors of any width ATen uses
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const int64_t ideal = (total + ranks - 1) / ranks;
  ParameterShard s;
  for (int64_t r = 0; r <= ranks; ++r) {
    const int64_t b = std::min(total, r * ideal);
    int64_t start = 0, snapped = b;
    for (int64_t n : sizes) {  // the parameter that b falls in
      if (b < start + n) {
        snapped = start + (b - start) / kAlign * kAlign;
        break;
      }
      start += n;
    }
    s.bounds.push_back(std::max(snapped, s.bounds.empty() ? int64_t(0) : s.bounds.back()));
  }
  for (int64_t r = 0; r < ranks; ++r) s.chunk = std::max(s.chunk, s.bounds[r + 1] - s.bounds[r]);
  s.begin = s.bounds[rank];
  s.end = s.bounds[rank + 1];
  return s;
}

at::Tensor ParameterShard::unpad(const at::Tensor& gathered) const {
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r + 1 < bounds.size(); ++r)
    parts.push_back(gathered.narrow(0, int64_t(r) * chunk, bounds[r + 1] - bounds[r]));
  return at::cat(parts);
}

std::vector<int64_t> AdamW::sizes(const ParameterStore& params, const std::vector<size_t>& members) {
  std::vector<int64_t> out;
  if (members.empty())
    for (const auto& p : params.all()) out.push_back(p.tensor.numel());
  for (size_t i : members) out.push_back(params.all()[i].tensor.numel());
  return out;
}

AdamW::AdamW(ParameterStore& params, const OptimConfig& cfg, std::optional<ParameterShard> shard,
             const std::vector<size_t>& members)
    : params_(params), cfg_(cfg) {
  if (members.empty())
    for (const auto& p : params_.all()) members_.push_back(&p);
  for (size_t i : members) members_.push_back(&params_.all()[i]);
  const auto& ps = members_;
  for (const Parameter* p : ps) total_ += p->tensor.numel();
  shard_ = shard ? *shard : ParameterShard::of(sizes(params_, members), 0, 1);
  int64_t start = 0;  // of parameter i in the concatenation
  for (size_t i = 0; i < ps.size(); ++i) {
    const int64_t n = ps[i]->tensor.numel();
    starts_.push_back(start);
    const int64_t lo = std::max(start, shard_.begin), hi = std::min(start + n, shard_.end);
    if (lo < hi) slices_.push_back({i, lo - start, hi - lo, lo - shard_.begin});
    start += n;
  }
  const at::TensorOptions options = ps.empty() ? at::TensorOptions(at::kFloat) : ps.front()->tensor.options();
  Building building(cat("the AdamW moments of ", shard_.chunk, " parameters (", 2 * shard_.chunk, " values)"));
  exp_avg_ = at::zeros({shard_.chunk}, options.requires_grad(false));
  exp_avg_sq_ = at::zeros({shard_.chunk}, options.requires_grad(false));
}

int64_t AdamW::state_bytes() const { return 2 * exp_avg_.numel() * int64_t(exp_avg_.element_size()); }

at::Tensor AdamW::gradient_of(const Slice& s, const at::Tensor& shard_gradient) const {
  if (shard_gradient.defined()) return shard_gradient.narrow(0, s.flat, s.length);
  const at::Tensor& g = members_[s.param]->tensor.grad();
  return g.defined() ? g.reshape(-1).narrow(0, s.offset, s.length) : at::Tensor();
}

at::Tensor AdamW::parameter_of(const Slice& s, const at::Tensor& shard_parameters) const {
  if (shard_parameters.defined()) return shard_parameters.narrow(0, s.flat, s.length);
  return members_[s.param]->tensor.view(-1).narrow(0, s.offset, s.length);
}

void AdamW::step(double lr, const at::Tensor& shard_gradient, const at::Tensor& shard_parameters) {
  at::NoGradGuard no_grad;
  ++step_;
  if (cfg_.impl == "fused") return fused_step(lr, shard_gradient, shard_parameters);
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(step_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, double(step_));
  for (const Slice& s : slices_) {
    const at::Tensor grad = gradient_of(s, shard_gradient);
    if (!grad.defined()) continue;
    at::Tensor p = parameter_of(s, shard_parameters);
    at::Tensor m = exp_avg_.narrow(0, s.flat, s.length), v = exp_avg_sq_.narrow(0, s.flat, s.length);
    if (members_[s.param]->decay && cfg_.weight_decay > 0) p.mul_(1.0 - lr * cfg_.weight_decay);
    m.lerp_(grad, 1.0 - cfg_.beta1);
    v.mul_(cfg_.beta2).addcmul_(grad, grad, 1.0 - cfg_.beta2);
    at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    p.addcdiv_(m, denom, -lr / bc1);
  }
}

void AdamW::fused_step(double lr, const at::Tensor& shard_gradient, const at::Tensor& shard_parameters) {
  // The slices of the parameters with and without weight decay, each group one call of ATen's
  // fused kernel: the same update as step()'s loop, in one pass over each tensor instead of five.
  struct Group {
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq;
  } groups[2];
  for (const Slice& s : slices_) {
    const at::Tensor grad = gradient_of(s, shard_gradient);
    if (!grad.defined()) continue;
    Group& group = groups[members_[s.param]->decay && cfg_.weight_decay > 0 ? 1 : 0];
    group.params.push_back(parameter_of(s, shard_parameters));
    group.grads.push_back(grad);
    group.exp_avg.push_back(exp_avg_.narrow(0, s.flat, s.length));
    group.exp_avg_sq.push_back(exp_avg_sq_.narrow(0, s.flat, s.length));
  }
  // The kernel reads the step count (for the bias corrections) from a float32 tensor per parameter.
  const at::Tensor step = at::scalar_tensor(double(step_), exp_avg_.options().dtype(at::kFloat));
  for (int decay = 0; decay < 2; ++decay) {
    Group& group = groups[decay];
    if (group.params.empty()) continue;
    const std::vector<at::Tensor> steps(group.params.size(), step);
    at::_fused_adamw_(group.params, group.grads, group.exp_avg, group.exp_avg_sq, {}, steps, lr, cfg_.beta1,
                      cfg_.beta2, decay ? cfg_.weight_decay : 0.0, cfg_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

at::Tensor AdamW::shard_of_parameters() const { return shard_of_parameters(0, shard_.chunk); }

at::Tensor AdamW::shard_of_parameters(int64_t lo, int64_t length) const {
  at::Tensor out = at::zeros({length}, exp_avg_.options());
  for (const Slice& s : slices_) {  // the part of each slice inside [lo, lo + length)
    const int64_t a = std::max(lo, s.flat), b = std::min(lo + length, s.flat + s.length);
    if (a < b)
      out.narrow(0, a - lo, b - a)
          .copy_(members_[s.param]->tensor.detach().view(-1).narrow(0, s.offset + (a - s.flat), b - a));
  }
  return out;
}

void AdamW::set_parameters(const at::Tensor& all) const {
  at::NoGradGuard no_grad;
  int64_t start = 0;
  for (const Parameter* p : members_) {
    const int64_t n = p->tensor.numel();
    p->tensor.view(-1).copy_(all.narrow(0, start, n));
    start += n;
  }
}

void AdamW::set_parameter_elements(int64_t begin, const at::Tensor& values) const {
  at::NoGradGuard no_grad;
  const int64_t end = begin + values.numel();
  int64_t start = 0;
  for (const Parameter* p : members_) {
    const int64_t n = p->tensor.numel();
    const int64_t lo = std::max(start, begin), hi = std::min(start + n, end);
    if (lo < hi) p->tensor.view(-1).narrow(0, lo - start, hi - lo).copy_(values.narrow(0, lo - begin, hi - lo));
    start += n;
  }
}

void all_gather_parameters(const AdamW& optim, Group& world, int64_t gathered_bytes) {
  const ParameterShard& shard = optim.shard();
  const int64_t piece = std::max<int64_t>(1, gathered_bytes / (int64_t(sizeof(float)) * world.size()));
  for (int64_t lo = 0; lo < shard.chunk; lo += piece) {
    const int64_t len = std::min(piece, shard.chunk - lo);
    const at::Tensor gathered = world.all_gather(optim.shard_of_parameters(lo, len));  // [ranks · len]
    for (size_t r = 0; r + 1 < shard.bounds.size(); ++r) {
      const int64_t share = shard.bounds[r + 1] - shard.bounds[r];
      const int64_t n = std::clamp<int64_t>(share - lo, 0, len);  // past the share: padding
      if (n > 0) optim.set_parameter_elements(shard.bounds[r] + lo, gathered.narrow(0, int64_t(r) * len, n));
    }
  }
}

NamedTensors AdamW::state() const {
  if (shard_.begin != 0 || shard_.end != total_)
    fail("AdamW::state: this optimizer holds elements [", shard_.begin, ", ", shard_.end, ") of ", total_,
         "; gather every rank's moments first");
  return state(exp_avg_, exp_avg_sq_);
}

NamedTensors AdamW::state(const at::Tensor& exp_avg_all, const at::Tensor& exp_avg_sq_all) const {
  NamedTensors out;
  int64_t start = 0;
  for (const Parameter* p : members_) {
    if (p->is_slice()) fail("AdamW::state: parameter '", p->name, "' is a slice; use state_stream");
    const int64_t n = p->tensor.numel();
    out.emplace_back("exp_avg." + p->name, exp_avg_all.narrow(0, start, n).view(p->tensor.sizes()));
    out.emplace_back("exp_avg_sq." + p->name, exp_avg_sq_all.narrow(0, start, n).view(p->tensor.sizes()));
    start += n;
  }
  out.emplace_back("step", at::scalar_tensor(step_, at::kLong));
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, const std::string& source) {
  std::vector<Parameter> ps;
  for (const Parameter* p : members_) ps.push_back(*p);
  auto get = [&](const std::string& name, const at::Tensor& like) {
    auto it = tensors.find(name);
    if (it == tensors.end()) fail(source, ": missing optimizer tensor '", name, "'");
    if (it->second.sizes() != like.sizes() || it->second.scalar_type() != like.scalar_type())
      fail(source, ": optimizer tensor '", name, "' has shape ", it->second.sizes(), ", expected ", like.sizes());
    return it->second;
  };
  if (tensors.size() != 2 * ps.size() + 1)
    fail(source, ": holds ", tensors.size(), " optimizer tensors, this model needs ", 2 * ps.size() + 1);
  at::NoGradGuard no_grad;
  for (const auto& p : ps) {  // every tensor is checked, whichever shard this rank takes
    get("exp_avg." + p.name, p.tensor);
    get("exp_avg_sq." + p.name, p.tensor);
  }
  for (const Slice& s : slices_) {
    const std::string& name = ps[s.param].name;
    exp_avg_.narrow(0, s.flat, s.length).copy_(tensors.at("exp_avg." + name).reshape(-1).narrow(0, s.offset, s.length));
    exp_avg_sq_.narrow(0, s.flat, s.length)
        .copy_(tensors.at("exp_avg_sq." + name).reshape(-1).narrow(0, s.offset, s.length));
  }
  step_ = get("step", at::scalar_tensor(0, at::kLong)).item<int64_t>();
}

TensorStream AdamW::state_stream(Group& world, int64_t slices, bool with_step) const {
  TensorStream out;
  for (const char* moment : {"exp_avg.", "exp_avg_sq."})
    for (const Parameter* p : members_) out.specs.push_back({moment + p->name, exp_avg_.scalar_type(), p->full_shape});
  if (with_step) out.specs.push_back({"step", at::kLong, {}});
  out.produce = [this, &world, slices, with_step](const TensorStream::Sink& sink) {
    for (const at::Tensor* moment : {&exp_avg_, &exp_avg_sq_})
      for (size_t j = 0; j < members_.size(); ++j) relay_member(world, slices, j, *moment, sink);
    if (with_step && world.rank() == 0) sink(at::scalar_tensor(step_, at::kLong));
  };
  return out;
}

void AdamW::relay_member(Group& world, int64_t slices, size_t j, const at::Tensor& flat,
                         const TensorStream::Sink& sink) const {
  const int64_t piece = (int64_t(16) << 20) / int64_t(flat.element_size());
  // Member k of slice q's group owns elements [bounds[k], bounds[k + 1]) of the set laid flat
  // (unsharded: member 0 owns them all, and every member holds a copy).
  const bool whole = shard_.begin == 0 && shard_.end == total_;
  const std::vector<int64_t> bounds = whole ? std::vector<int64_t>{0, total_} : shard_.bounds;
  const int64_t owners = int64_t(bounds.size()) - 1;
  const int64_t start = starts_[j], n = members_[j]->tensor.numel();
  for (int64_t q = 0; q < slices; ++q)  // the parameter's rows, slice after slice
    for (int64_t k = 0; k < owners; ++k) {
      const int64_t owner = q + k * slices;  // its place in the group
      const int64_t lo = std::max(start, bounds[size_t(k)]), hi = std::min(start + n, bounds[size_t(k) + 1]);
      for (int64_t at = lo; at < hi; at += piece) {
        const int64_t len = std::min(piece, hi - at);
        relay_to_root(world, owner, flat.narrow(0, at - bounds[size_t(k)], len), sink);  // in the owner's flat shard
      }
    }
}

void relay_to_root(Group& world, int64_t owner, const at::Tensor& piece, const TensorStream::Sink& sink) {
  const bool root = world.rank() == 0;
  if (owner == world.rank() && root) {
    sink(piece);
  } else if (owner == world.rank()) {
    world.send(piece, 0);
  } else if (root) {
    at::Tensor received = at::empty(piece.sizes(), piece.options().requires_grad(false));
    world.recv(received, owner);
    sink(received);
  }
}

void AdamW::load_state(const SafetensorsReader& file) {
  const std::string& source = file.path();
  auto check = [&](const std::string& name, at::IntArrayRef shape, at::ScalarType dtype) {
    const std::optional<TensorSpec> spec = file.spec(name);
    if (!spec) fail(source, ": missing optimizer tensor '", name, "'");
    if (at::IntArrayRef(spec->shape) != shape || spec->dtype != dtype)
      fail(source, ": optimizer tensor '", name, "' has shape ", at::IntArrayRef(spec->shape), ", expected ", shape);
  };
  for (const Parameter* p : members_) {  // every tensor is checked, whichever shard this rank takes
    check("exp_avg." + p->name, p->full_shape, exp_avg_.scalar_type());
    check("exp_avg_sq." + p->name, p->full_shape, exp_avg_.scalar_type());
  }
  check("step", {}, at::kLong);
  read_shard(file, "exp_avg.", exp_avg_);
  read_shard(file, "exp_avg_sq.", exp_avg_sq_);
  step_ = file.read("step").item<int64_t>();
}

void AdamW::read_shard(const SafetensorsReader& file, const std::string& prefix, const at::Tensor& flat) const {
  at::NoGradGuard no_grad;
  for (const Slice& s : slices_) {
    const Parameter& p = *members_[s.param];
    flat.narrow(0, s.flat, s.length).copy_(file.read_elements(prefix + p.name, p.first_element() + s.offset, s.length));
  }
}

void add_sum_of_squares(at::Tensor& sum, const at::Tensor& g) {
  constexpr int64_t kPiece = int64_t(1) << 16;  // elements squared at a time
  const at::Tensor flat = g.reshape(-1);
  if (!sum.defined()) sum = at::zeros({}, flat.options().dtype(at::kDouble));
  for (int64_t lo = 0; lo < flat.numel(); lo += kPiece)
    sum.add_(at::sum(at::square(flat.narrow(0, lo, std::min(kPiece, flat.numel() - lo))), at::kDouble));
}

void clip_to(double norm, double max_norm, const std::vector<at::Tensor>& gradients) {
  if (max_norm <= 0 || !std::isfinite(norm)) return;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  at::NoGradGuard no_grad;
  for (at::Tensor g : gradients)
    if (g.defined()) g.mul_(coef);
}

double clip_grad_norm(ParameterStore& params, double max_norm) {
  at::NoGradGuard no_grad;
  at::Tensor squares;
  std::vector<at::Tensor> grads;
  for (const auto& p : params.all())
    if (p.tensor.grad().defined()) {
      add_sum_of_squares(squares, p.tensor.grad());
      grads.push_back(p.tensor.mutable_grad());
    }
  const double total = squares.defined() ? std::sqrt(squares.item<double>()) : 0.0;  // one synchronisation
  clip_to(total, max_norm, grads);
  return total;
}

}  // namespace depthkit
