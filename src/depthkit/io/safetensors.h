// safetensors files (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Written atomically; every malformed input is an
// Error that names the file and the problem.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace depthkit {

class AtomicFile;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A tensor as a file's header describes it.
struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Writes tensors whose bytes arrive in order, a piece at a time (logits computed a chunk of
// sequences at a time; a sharded optimizer state received rank by rank), so the whole never has
// to be in memory. The tensors lie in the file in the order given, and a piece may end one and
// begin the next (all of one dtype then). The file appears, complete, at commit(); a writer
// destroyed before commit() (an error, a signal's unwinding) leaves nothing.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(const std::string& path, const std::vector<TensorSpec>& tensors,
                          const std::map<std::string, std::string>& metadata = {});
  SafetensorsStreamWriter(const std::string& path, const std::string& name, at::ScalarType dtype,
                          std::vector<int64_t> shape, const std::map<std::string, std::string>& metadata = {})
      : SafetensorsStreamWriter(path, {TensorSpec{name, dtype, std::move(shape)}}, metadata) {}
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  // The next bytes of the tensors, in row-major order, cast to the dtype of the tensor they start in.
  void append(const at::Tensor& piece);
  void commit();
  uint64_t file_bytes() const { return header_bytes_ + data_bytes_; }

 private:
  std::string path_;
  std::vector<std::pair<uint64_t, at::ScalarType>> starts_;  // each tensor's first byte and dtype
  std::unique_ptr<AtomicFile> file_;
  uint64_t header_bytes_ = 0, data_bytes_ = 0, written_ = 0;
};

// Tensors whose bytes arrive in order: `specs` in file order, and `produce`, which hands `sink`
// their bytes in that order. In a job of many ranks every rank runs `produce` (it may take part in
// collectives: a sharded state is received rank by rank), and only the writing rank's sink writes.
struct TensorStream {
  using Sink = std::function<void(const at::Tensor& piece)>;
  std::vector<TensorSpec> specs;
  std::function<void(const Sink& sink)> produce;
  // Tensors this process holds whole (referred to: they must outlive the stream).
  static TensorStream of(const NamedTensors& tensors);
};

// Writes `stream` to `path` (atomically), or, when !writer, runs its producer only.
void save_safetensors(const std::string& path, const TensorStream& stream, bool writer,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;  // CPU tensors owning their memory
  std::map<std::string, std::string> metadata;
};
SafetensorsFile load_safetensors(const std::string& path);

// A safetensors file whose header has been read and checked (as load_safetensors checks it) and
// whose tensors are read on demand, whole or a range of their elements: a rank reads only its
// shard of a checkpoint's optimizer state.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;
  const std::string& path() const;
  std::vector<TensorSpec> tensors() const;  // in the order of their bytes
  const std::map<std::string, std::string>& metadata() const;
  bool contains(const std::string& name) const;
  // nullopt when the file has no tensor `name`.
  std::optional<TensorSpec> spec(const std::string& name) const;
  at::Tensor read(const std::string& name) const;
  // Elements [begin, begin + count) of `name` laid flat (a CPU tensor of `count` elements).
  at::Tensor read_elements(const std::string& name, int64_t begin, int64_t count) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace depthkit
