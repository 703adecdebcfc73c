// CUDA runtime facts, compiled only when DEPTHKIT_CUDA is on: the device query and copy
// bandwidth (device_info.cu, nvcc, no torch) and LibTorch's CUDA allocator counters
// (device_memory.cpp, the host compiler with c10's CUDA headers). util/device.h is what the rest
// of the program calls.
#pragma once
#include <cstdint>

namespace depthkit::cuda {

// Number of visible CUDA devices (0 when no driver or device is present).
int device_count();

// Device-to-device copy bandwidth in GB/s (bytes read + written ÷ time) measured with a
// grid-stride float4 copy kernel; the baseline the fused reads are compared against. -1 without a device.
double copy_bandwidth_gbs(long long bytes, int repeats);

// LibTorch's CUDA caching allocator on device `index` (-1: the current device): bytes of tensor
// storage allocated now and at most since the last reset_peak_allocated (torch.cuda's
// memory_allocated, max_memory_allocated and reset_peak_memory_stats).
int64_t allocated_bytes(int index);
int64_t peak_allocated_bytes(int index);
void reset_peak_allocated(int index);

}  // namespace depthkit::cuda
