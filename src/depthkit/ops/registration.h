// Helpers shared by the operator registration files (schema.cpp, dar_ops.cpp, msar_ops.cpp,
// mhc_ops.cpp): typed handles of the depthkit operators, outputs made tensors of their own, and
// (optional_tensor.h) the conversions between an optional tensor (a `Tensor?` in a schema) and a
// possibly undefined at::Tensor.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <initializer_list>
#include <vector>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit {

// The operator `name` ("depthkit::depth_read") with the C++ signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// A schema's outputs (no alias annotation) are tensors of their own: SchemaCheckMode
// (torch.library.opcheck) fails outputs that share storage, and torch.compile's functionalization
// and the fake implementations (python/depthkit/_fake.py) take each output to be a fresh,
// contiguous tensor. Some backward kernels return views of one buffer of token-summed gradients
// (∂b and ∂α of mhc_pre, the gate gradients of dar_read) or a transposed view (MSAR's tap
// gradients): those are copied here, which costs a parameter-sized copy each, nothing per token.
// Undefined outputs (an absent input's gradient) stay undefined.
inline void own_storage(std::initializer_list<at::Tensor*> outputs) {
  std::vector<const at::Tensor*> kept;
  for (at::Tensor* t : outputs) {
    if (!t->defined()) continue;
    bool shared = t->storage_offset() != 0 || !t->is_contiguous();
    for (const at::Tensor* k : kept) shared = shared || t->storage().is_alias_of(k->storage());
    if (shared) *t = t->clone(at::MemoryFormat::Contiguous);
    kept.push_back(t);
  }
}

}  // namespace depthkit
