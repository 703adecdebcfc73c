#include "depthkit/pathways/pathway.h"

#include <ATen/ops/stack.h>

#include "depthkit/util/error.h"

namespace depthkit {

void ResidualPathway::set_stream_states(PathwayState&, const std::vector<at::Tensor>&) {
  fail("residual.kind \"", kind(), "\": the pathway keeps no streams to replace");
}

void StackedHistory::push(at::Tensor entry) {
  entries_.push_back(std::move(entry));
  stacked_ = at::Tensor();
}

void StackedHistory::replace_last(at::Tensor entry) {
  entries_.back() = std::move(entry);
  stacked_ = at::Tensor();
}

const at::Tensor& StackedHistory::stacked() {
  if (!stacked_.defined()) stacked_ = at::stack(entries_);
  return stacked_;
}

void check_stream_count(const std::vector<at::Tensor>& states, size_t expected, const std::string& kind) {
  if (states.size() != expected)
    fail("residual.kind \"", kind, "\": ", states.size(), " stream states given, the pathway keeps ", expected);
}

}  // namespace depthkit
