#include "depthkit/util/device.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cerrno>
#include <cstdlib>

#include "depthkit/util/error.h"
#ifdef DEPTHKIT_WITH_CUDA
#include "depthkit/util/cuda/device_info.h"
#endif

namespace depthkit {

at::Device resolve_device(const std::string& name, int64_t local_rank) {
  if (name == "cpu") return at::Device(at::kCPU);
  if (name != "cuda") fail("train.device: unknown device \"", printable(name), "\" (cpu or cuda)");
  if (local_rank < 0) fail("train.device = \"cuda\": local rank ", local_rank, " is negative");
  // The hooks answer without CUDA headers: LibTorch's CUDA library registers them when it is
  // loaded (the build links it whether or not this program uses it), and a CPU-only LibTorch
  // leaves the stubs, which report no CUDA runtime. A CUDA LibTorch on a machine without a GPU
  // has the runtime but counts no device.
  const at::CUDAHooksInterface& hooks = at::detail::getCUDAHooks();
  if (!hooks.hasCUDART())
    fail("train.device = \"cuda\", but this LibTorch was built without CUDA (a CUDA build of torch is needed)");
  const int64_t devices = hooks.getNumGPUs();
  if (devices == 0)
    fail("train.device = \"cuda\", but no CUDA device is visible (no GPU or driver here, or CUDA_VISIBLE_DEVICES "
         "hides them)");
  if (local_rank >= devices)
    fail("train.device = \"cuda\": local rank ", local_rank, " needs GPU ", local_rank, ", but ", devices,
         " CUDA device", devices == 1 ? " is" : "s are", " visible");
  return at::Device(at::kCUDA, at::DeviceIndex(local_rank));
}

int64_t device_allocated_bytes(at::Device device) {
#ifdef DEPTHKIT_WITH_CUDA
  if (device.is_cuda()) return cuda::allocated_bytes(device.index());
#endif
  (void)device;
  return -1;
}

int64_t device_peak_bytes(at::Device device) {
#ifdef DEPTHKIT_WITH_CUDA
  if (device.is_cuda()) return cuda::peak_allocated_bytes(device.index());
#endif
  (void)device;
  return -1;
}

void reset_device_peak(at::Device device) {
#ifdef DEPTHKIT_WITH_CUDA
  if (device.is_cuda()) cuda::reset_peak_allocated(device.index());
#endif
  (void)device;
}

void synchronize(at::Device device) {
  if (device.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(device.index());
}

}  // namespace depthkit
