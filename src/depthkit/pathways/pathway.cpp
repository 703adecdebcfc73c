#include "depthkit/pathways/pathway.h"

#include "depthkit/util/error.h"

namespace depthkit {

void ResidualPathway::set_stream_states(PathwayState&, const std::vector<at::Tensor>&) {
  fail("residual.kind \"", kind(), "\": the pathway keeps no streams to replace");
}

std::unique_ptr<PathwayState> ResidualPathway::resume(const at::Tensor&, PathwayCache&, const std::vector<int64_t>&) {
  fail("residual.kind \"", kind(), "\": the pathway carries nothing between chunks, so it has no cache to resume from");
}

StageState ResidualPathway::stage_out(PathwayState&, int64_t) {
  fail("residual.kind \"", kind(), "\": the pathway's state cannot cross a pipeline stage boundary");
}

std::unique_ptr<PathwayState> ResidualPathway::stage_in(const StageState&, int64_t, int64_t, int64_t) {
  fail("residual.kind \"", kind(), "\": the pathway's state cannot cross a pipeline stage boundary");
}

void check_stream_count(const std::vector<at::Tensor>& states, size_t expected, const std::string& kind) {
  if (states.size() != expected)
    fail("residual.kind \"", kind, "\": ", states.size(), " stream states given, the pathway keeps ", expected);
}

}  // namespace depthkit
