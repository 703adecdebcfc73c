// Helpers shared by the operator registration files (schema.cpp, dar_ops.cpp, msar_ops.cpp,
// mhc_ops.cpp): typed handles of the depthkit operators, and (optional_tensor.h) the conversions
// between an optional tensor (a `Tensor?` in a schema) and a possibly undefined at::Tensor.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "depthkit/ops/optional_tensor.h"

namespace depthkit {

// The operator `name` ("depthkit::depth_read") with the C++ signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace depthkit
