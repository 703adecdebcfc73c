// Helpers shared by the operator registration files (schema.cpp, dar_ops.cpp, msar_ops.cpp,
// mhc_ops.cpp): typed handles of the depthkit operators, and the conversions between an optional
// tensor (a `Tensor?` in a schema) and a possibly undefined at::Tensor (what the kernels take).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace depthkit {

using OptTensor = std::optional<at::Tensor>;

// The operator `name` ("depthkit::depth_read") with the C++ signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

inline at::Tensor unwrap(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
inline OptTensor wrap(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

}  // namespace depthkit
