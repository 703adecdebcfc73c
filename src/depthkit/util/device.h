// Where a run's tensors live: `train.device` resolved to an at::Device, and the device facts that
// training and `bench` need around it (the allocator's peak memory; synchronisation for timing).
// This file needs no CUDA headers: the CUDA allocator is asked through util/cuda/device_info.h,
// compiled only with DEPTHKIT_CUDA, and a build without it answers -1 (unknown).
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace depthkit {

// "cpu" → the CPU; "cuda" → CUDA device `local_rank` (one process per GPU: a launcher's
// LOCAL_RANK picks the GPU). Throws depthkit::Error, one line naming train.device, when this
// LibTorch has no CUDA, when it sees no CUDA device, or when local_rank is past the devices seen.
at::Device resolve_device(const std::string& name, int64_t local_rank = 0);

// Bytes of tensor storage allocated on a CUDA device, now and at most since the last
// reset_device_peak (the caching allocator's memory_allocated and max_memory_allocated). -1 for
// the CPU (util/memory.h's TensorMemory counts CPU tensors) and in a build without DEPTHKIT_CUDA.
int64_t device_allocated_bytes(at::Device device);
int64_t device_peak_bytes(at::Device device);
void reset_device_peak(at::Device device);  // peak := current; nothing for the CPU

// Waits until every kernel queued on `device` has finished: CUDA runs asynchronously, so a step's
// wall time means something only between two of these. Nothing to wait for on the CPU.
void synchronize(at::Device device);

}  // namespace depthkit
