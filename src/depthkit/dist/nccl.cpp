// NCCL's header comes from the nvidia-nccl wheel that torch depends on (CMakeLists.txt). c10d's
// headers read USE_C10D_NCCL, so it is defined before any of them, this file's own header included.
#ifdef DEPTHKIT_WITH_NCCL
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "depthkit/dist/nccl.h"

#include <chrono>

#include "depthkit/util/error.h"

namespace depthkit {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout) {
#ifdef DEPTHKIT_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  fail("train.backend = \"nccl\": this build of depthkit has no CUDA (build it where nvcc is found: scripts/setup)");
#endif
}

}  // namespace depthkit
