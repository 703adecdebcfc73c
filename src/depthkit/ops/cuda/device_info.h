// CUDA runtime facts, compiled by nvcc when DEPTHKIT_CUDA is on. The fused depth-retrieval
// kernels (a later issue) live beside this file.
#pragma once

namespace depthkit::cuda {

// Number of visible CUDA devices (0 when no driver or device is present).
int device_count();

// Device-to-device copy bandwidth in GB/s (bytes read + written ÷ time) measured with a
// grid-stride float4 copy kernel; the baseline the fused reads are compared against. -1 without a device.
double copy_bandwidth_gbs(long long bytes, int repeats);

}  // namespace depthkit::cuda
