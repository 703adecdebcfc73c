// safetensors files (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Written atomically; every malformed input is an
// Error that names the file and the problem.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace depthkit {

class AtomicFile;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes one tensor whose bytes arrive in order, a piece at a time (logits computed a chunk of
// sequences at a time), so the whole never has to be in memory. The file appears, complete, at
// commit(); a writer destroyed before commit() (an error, a signal's unwinding) leaves nothing.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(const std::string& path, const std::string& name, at::ScalarType dtype,
                          std::vector<int64_t> shape, const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  void append(const at::Tensor& piece);  // the next bytes of the tensor, in row-major order
  void commit();
  uint64_t file_bytes() const { return header_bytes_ + data_bytes_; }

 private:
  std::string path_;
  at::ScalarType dtype_;
  std::unique_ptr<AtomicFile> file_;
  uint64_t header_bytes_ = 0, data_bytes_ = 0, written_ = 0;
};

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;  // CPU tensors owning their memory
  std::map<std::string, std::string> metadata;
};
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace depthkit
