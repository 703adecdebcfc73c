#include "depthkit/ops/shared_source.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <unordered_set>

#include "depthkit/ops/registration.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The accumulator lives in the node's context: created by the first read whose backward runs,
// handed on (and released) by the node's own backward, which autograd runs after all of them.
constexpr const char* kAccumulator = "accumulator";
// A deferred source's (fused::shared_source_deferred): where its backward leaves the sum.
constexpr const char* kDeferred = "deferred";

struct DeferredHolder : torch::CustomClassHolder {
  std::shared_ptr<fused::DeferredSum> deferred;
};

// depthkit::shared_source, registered below: its kernel (a copy) runs under the autograd node.
c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> shared_source_op() {
  static const auto handle = op<at::Tensor(const at::Tensor&)>("depthkit::shared_source");
  return handle;
}

class SharedSource : public torch::autograd::Function<SharedSource> {
 public:
  // copy: the operator form (depthkit::shared_source) returns a tensor of its own, through its
  // kernel below autograd; the C++ pathways' form returns x itself.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, bool copy) {
    ctx->set_materialize_grads(false);  // the reads send nothing: no zero tensor for it
    ctx->saved_data["dtype"] = x.scalar_type();
    if (!copy) return x;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return shared_source_op().call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor sum;
    if (auto it = ctx->saved_data.find(kAccumulator); it != ctx->saved_data.end()) {
      sum = it->second.toTensor();
      ctx->saved_data.erase(it);  // released now; a second backward (retain_graph) starts afresh
    }
    const at::Tensor& other = grads[0];  // from consumers other than fused reads, if any
    if (auto it = ctx->saved_data.find(kDeferred); it != ctx->saved_data.end()) {
      c10::static_intrusive_pointer_cast<DeferredHolder>(it->second.toCapsule())->deferred->sum = sum;
      return {other, at::Tensor()};
    }
    if (!sum.defined()) return {other, at::Tensor()};
    if (other.defined()) sum.add_(other);
    return {sum.to(ctx->saved_data["dtype"].toScalarType()), at::Tensor()};
  }
};

using SharedSourceNode = torch::autograd::CppNode<SharedSource>;

}  // namespace

namespace fused {

at::Tensor shared_source(const at::Tensor& x) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return x;
  return SharedSource::apply(x, false);
}

at::Tensor shared_source_deferred(const at::Tensor& x, std::shared_ptr<DeferredSum> deferred) {
  const at::Tensor y = shared_source(x);
  if (auto* node = dynamic_cast<SharedSourceNode*>(y.grad_fn().get()); node && y.unsafeGetTensorImpl() != x.unsafeGetTensorImpl()) {
    auto holder = c10::make_intrusive<DeferredHolder>();
    holder->deferred = std::move(deferred);
    node->ctx_.saved_data[kDeferred] = c10::IValue::make_capsule(holder);
  }
  return y;
}

bool seed_accumulator(const at::Tensor& x, const at::Tensor& sum) {
  auto* node = dynamic_cast<SharedSourceNode*>(x.grad_fn().get());
  if (!node || !sum.defined()) return false;
  node->ctx_.saved_data[kAccumulator] = sum;
  return true;
}

namespace {
thread_local SourceStandIns* t_stand_ins = nullptr;
}  // namespace

SourceStandIns::SourceStandIns() : previous_(t_stand_ins) { t_stand_ins = this; }

SourceStandIns::~SourceStandIns() { t_stand_ins = previous_; }

void SourceStandIns::add(const at::Tensor& stand_in, const at::Tensor& source) {
  auto* node = dynamic_cast<SharedSourceNode*>(source.grad_fn().get());
  if (node && node->task_should_compute_output(0)) map_.emplace_back(stand_in.unsafeGetTensorImpl(), source);
}

const at::Tensor* SourceStandIns::source_of(const at::Tensor& stand_in) {
  for (const SourceStandIns* s = t_stand_ins; s; s = s->previous_)
    for (const auto& [impl, source] : s->map_)
      if (impl == stand_in.unsafeGetTensorImpl()) return &source;
  return nullptr;
}

}  // namespace fused

namespace {

// ---- The operator: depthkit::shared_source(Tensor x) -> Tensor, for code that reaches the reads
// through the dispatcher only (depthkit.nn in Python, under torch.compile too). An operator's output
// may not alias its input (torch.compile's functionalization and the fake implementation take it to
// be a fresh tensor), so it returns a contiguous copy: one copy per history entry, against one
// clone and one sum per read and entry that it spares under AOTAutograd, whose trace then threads
// one accumulator through the reads' backward operators (Tensor(a!)[]), which Inductor updates in
// place.

at::Tensor shared_source_copy(const at::Tensor& x) { return x.clone(at::MemoryFormat::Contiguous); }

at::Tensor shared_source_autograd(const at::Tensor& x) {
  if (at::GradMode::is_enabled() && x.requires_grad()) return SharedSource::apply(x, true);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return shared_source_op().call(x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthkit, m) {
  m.def("shared_source(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthkit, CPU, m) {
  m.impl("shared_source", &shared_source_copy);
}

TORCH_LIBRARY_IMPL(depthkit, CUDA, m) {
  m.impl("shared_source", &shared_source_copy);
}

TORCH_LIBRARY_IMPL(depthkit, Autograd, m) {
  m.impl("shared_source", &shared_source_autograd);
}

std::vector<at::Tensor> SourceGradients::for_autograd(at::ScalarType dtype) const {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < buffers.size(); ++i) out.push_back(own[i] ? buffers[i].to(dtype) : at::Tensor());
  return out;
}

namespace {

// A zero buffer of x's shape in `dtype`. Symbolic sizes (sym_sizes): under torch.compile with
// dynamic shapes, or torch.library.opcheck's dynamic AOT check, the backward runs on fake tensors
// whose sizes are symbols, which sizes() refuses.
at::Tensor zeros_like_shape(const at::Tensor& x, at::ScalarType dtype) {
  return at::zeros_symint(x.sym_sizes(), x.options().dtype(dtype));
}

// The accumulator of `source` for one call, in dtype `accumulate`; undefined when the source is
// not shared, was given to this call already, is accumulated in another dtype, or when this
// backward will not run the source's node: a partial one (torch::autograd::grad with respect to
// other inputs, or to the wrapped tensor itself) gets the gradient from autograd as usual, and
// leaves no sum behind in the node for a later backward over the same graph. A recomputed
// region's copy of a shared source (fused::SourceStandIns) takes that source's accumulator: the
// enclosing backward, which runs the source's node, was asked when the copy was added.
at::Tensor accumulator(const at::Tensor& source, at::ScalarType accumulate, std::unordered_set<const void*>& taken) {
  const at::Tensor* stands_for = fused::SourceStandIns::source_of(source);
  auto* node = dynamic_cast<SharedSourceNode*>((stands_for ? *stands_for : source).grad_fn().get());
  if (!node || (!stands_for && !node->task_should_compute_output(0)) || !taken.insert(node).second) return {};
  auto& saved = node->ctx_.saved_data;
  auto it = saved.find(kAccumulator);
  if (it == saved.end())
    it = saved.emplace(kAccumulator, zeros_like_shape(source, accumulate)).first;
  at::Tensor sum = it->second.toTensor();
  return sum.scalar_type() == accumulate ? sum : at::Tensor();
}

}  // namespace

SourceGradients source_gradients(at::TensorList sources, at::ScalarType accumulate) {
  SourceGradients g;
  std::unordered_set<const void*> taken;
  for (const at::Tensor& source : sources) {
    at::Tensor shared = accumulator(source, accumulate, taken);
    g.own.push_back(!shared.defined());
    g.buffers.push_back(shared.defined() ? shared : zeros_like_shape(source, accumulate));
  }
  return g;
}

}  // namespace depthkit
