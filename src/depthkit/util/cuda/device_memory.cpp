// The CUDA allocator's counters (util/cuda/device_info.h). A host-compiler file: it needs c10's
// CUDA headers (and through them cuda_runtime_api.h), not nvcc.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "depthkit/util/cuda/device_info.h"

namespace depthkit::cuda {

namespace {

c10::DeviceIndex device_index(int index) {
  return index < 0 ? c10::cuda::current_device() : c10::DeviceIndex(index);
}

// The sum over the allocator's pools (small and large blocks).
const c10::CachingAllocator::Stat& allocated(const c10::CachingDeviceAllocator::DeviceStats& stats) {
  return stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)];
}

}  // namespace

int64_t allocated_bytes(int index) {
  return allocated(c10::cuda::CUDACachingAllocator::getDeviceStats(device_index(index))).current;
}

int64_t peak_allocated_bytes(int index) {
  return allocated(c10::cuda::CUDACachingAllocator::getDeviceStats(device_index(index))).peak;
}

void reset_peak_allocated(int index) { c10::cuda::CUDACachingAllocator::resetPeakStats(device_index(index)); }

}  // namespace depthkit::cuda
