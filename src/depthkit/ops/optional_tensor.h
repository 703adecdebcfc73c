// A schema's optional tensor (`Tensor?`) in C++: std::optional<at::Tensor>, which the dispatcher
// passes to the kernels, and its conversions to and from a possibly undefined at::Tensor, which is
// what the kernels compute with and what the fused:: functions take for an absent input.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace depthkit {

using OptTensor = std::optional<at::Tensor>;

inline at::Tensor unwrap(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
inline OptTensor wrap(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

}  // namespace depthkit
