// safetensors files (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Written atomically; every malformed input is an
// Error that names the file and the problem.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace depthkit {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;  // CPU tensors owning their memory
  std::map<std::string, std::string> metadata;
};
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace depthkit
