#include <cuda_runtime.h>

#include "depthkit/util/cuda/device_info.h"

namespace depthkit::cuda {

namespace {
// dst[i] = src[i] over n float4 elements; grid-stride loop. Shapes: src, dst [n] float4.
__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

double copy_bandwidth_gbs(long long bytes, int repeats) {
  if (device_count() == 0) return -1;
  const long long n = bytes / 16;
  float4 *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, n * 16) != cudaSuccess) return -1;
  if (cudaMalloc(&dst, n * 16) != cudaSuccess) {
    cudaFree(src);
    return -1;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  copy_kernel<<<1024, 256>>>(src, dst, n);  // warm-up
  cudaEventRecord(start);
  for (int r = 0; r < repeats; ++r) copy_kernel<<<1024, 256>>>(src, dst, n);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * double(n) * 16 * repeats / (ms * 1e-3) / 1e9;
}

}  // namespace depthkit::cuda
