// ProcessGroupNCCL for CUDA tensors (dist/nccl.cpp): compiled with NCCL only when the build has
// CUDA (DEPTHKIT_CUDA); without it, a one-line refusal naming train.backend. dist/world.cpp calls it.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace depthkit {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout);

}  // namespace depthkit
