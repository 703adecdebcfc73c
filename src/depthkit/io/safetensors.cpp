#include "depthkit/io/safetensors.h"

#include <ATen/ops/empty.h>


#include <algorithm>
#include <exception>
#include <optional>
#include <cerrno>
#include <cstring>
#include <tuple>
#include <fstream>
#include <nlohmann/json.hpp>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"

namespace depthkit {

namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool},
  };
  return names;
}

std::string dtype_name(at::ScalarType t) {
  for (auto& [n, s] : dtype_names())
    if (s == t) return n;
  fail("safetensors: unsupported dtype ", c10::toString(t));
}


// The 8-byte little-endian length and the JSON header, padded with spaces to 8 bytes (the spec).
std::string header_bytes(const nlohmann::json& header) {
  std::string json = header.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(json.size()) >> (8 * i)) & 0xff);
  return out + json;
}

std::string_view tensor_bytes(const at::Tensor& c) {
  return {static_cast<const char*>(c.const_data_ptr()), size_t(c.numel()) * c.element_size()};
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    size_t bytes = c.numel() * c.element_size();
    header[name] = {{"dtype", dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(c);
  }
  // Written piece by piece: a checkpoint never needs a second copy of the weights in memory.
  AtomicFile file(path);
  file.write(header_bytes(header));
  for (const auto& c : contiguous) file.write(tensor_bytes(c));
  file.commit();
}

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& path, const std::vector<TensorSpec>& tensors,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(path) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const TensorSpec& t : tensors) {
    uint64_t bytes = c10::elementSize(t.dtype);
    for (int64_t n : t.shape)
      if (n < 0 || __builtin_mul_overflow(bytes, uint64_t(n), &bytes)) fail(path, ": tensor '", t.name, "' shape too large");
    if (header.contains(t.name)) fail(path, ": tensor '", t.name, "' given twice");
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {data_bytes_, data_bytes_ + bytes}}};
    starts_.emplace_back(data_bytes_, t.dtype);
    data_bytes_ += bytes;
  }
  const std::string head = header_bytes(header);
  header_bytes_ = head.size();
  file_ = std::make_unique<AtomicFile>(path);
  file_->write(head);
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

TensorStream TensorStream::of(const NamedTensors& tensors) {
  TensorStream s;
  for (const auto& [name, t] : tensors) s.specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  s.produce = [&tensors](const Sink& sink) {
    for (const auto& entry : tensors) sink(entry.second);
  };
  return s;
}

void save_safetensors(const std::string& path, const TensorStream& stream, bool writer,
                      const std::map<std::string, std::string>& metadata) {
  if (!writer) return stream.produce([](const at::Tensor&) {});
  // A writer that cannot write still runs the producer to its end (the other ranks' collectives
  // wait for it), then reports why.
  std::exception_ptr error;
  std::optional<SafetensorsStreamWriter> file;
  try {
    file.emplace(path, stream.specs, metadata);
  } catch (...) {
    error = std::current_exception();
  }
  stream.produce([&](const at::Tensor& piece) {
    if (error) return;
    try {
      file->append(piece);
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
  file->commit();
}

void SafetensorsStreamWriter::append(const at::Tensor& piece) {
  // The dtype of the tensor this piece starts in (the last one that starts at or before written_).
  at::ScalarType dtype = starts_.empty() ? piece.scalar_type() : starts_.front().second;
  for (const auto& [start, t] : starts_)
    if (start <= written_) dtype = t;
  at::Tensor c = piece.detach().to(at::kCPU, dtype).contiguous();
  const uint64_t bytes = uint64_t(c.numel()) * c.element_size();
  if (written_ + bytes > data_bytes_) fail(path_, ": more tensor bytes written than the shapes hold");
  file_->write(tensor_bytes(c));
  written_ += bytes;
}

void SafetensorsStreamWriter::commit() {
  if (written_ != data_bytes_) fail(path_, ": ", written_, " of the tensors' ", data_bytes_, " bytes were written");
  file_->commit();
}

struct SafetensorsReader::Impl {
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::string path;
  uint64_t data_start = 0;
  std::vector<Entry> entries;  // in the order of their bytes
  std::map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;
  mutable std::ifstream in;
  const Entry& entry(const std::string& name) const {
    auto it = index.find(name);
    if (it == index.end()) fail(path, ": no tensor '", name, "'");
    return entries[it->second];
  }
  void read_bytes(void* into, uint64_t offset, uint64_t bytes, const std::string& name) const {
    in.clear();
    in.seekg(std::streamoff(data_start + offset));
    in.read(static_cast<char*>(into), std::streamsize(bytes));
    if (!in) fail(path, ": could not read the ", bytes, " bytes of tensor '", name, "'");
  }
};

SafetensorsReader::SafetensorsReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  // Everything is checked against the format's rules before any tensor is allocated: the header
  // lies inside the file; every entry has a known dtype, a shape of non-negative dimensions and
  // two offsets; shape × dtype size equals its byte range; the ranges, in order, are contiguous,
  // do not overlap and cover the data section exactly (no holes, no aliased weights).
  const uint64_t file_size = regular_file_size(path);
  std::ifstream& in = impl_->in;
  in.open(path, std::ios::binary);
  if (!in) fail(path, ": cannot open safetensors file");
  if (file_size < 8) fail(path, ": not a safetensors file (", file_size, " bytes, no header)");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(len_bytes[i]) << (8 * i);
  if (header_len > file_size - 8 || header_len > (100u << 20))
    fail(path, ": safetensors header length ", header_len, " exceeds the file (", file_size, " bytes)");
  std::string json(header_len, '\0');
  in.read(json.data(), std::streamsize(header_len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json);
  } catch (const std::exception&) {
    fail(path, ": safetensors header is not valid JSON");
  }
  if (!header.is_object()) fail(path, ": safetensors header is not a JSON object");
  const uint64_t data_size = file_size - 8 - header_len;

  using Entry = Impl::Entry;
  std::vector<Entry>& entries = impl_->entries;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path, ": safetensors '__metadata__' is not a JSON object");
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) fail(path, ": safetensors metadata '", k, "' is not a string");
        impl_->metadata[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const auto&... what) { fail(path, ": tensor '", name, "' ", what...); };
    if (!entry.is_object()) bad("has a header entry that is not a JSON object");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(key)) bad("has no '", key, "'");
    const auto& dt = entry["dtype"];
    if (!dt.is_string()) bad("has a dtype that is not a string");
    auto it = std::find_if(dtype_names().begin(), dtype_names().end(),
                           [&](auto& p) { return p.first == dt.get<std::string>(); });
    if (it == dtype_names().end()) bad("has unsupported dtype ", json_excerpt(dt));
    Entry e{name, it->second, {}, 0, 0};
    const auto& shape = entry["shape"];
    if (!shape.is_array()) bad("has a shape that is not an array");
    uint64_t bytes = c10::elementSize(e.dtype);
    for (const auto& d : shape) {
      if (!d.is_number_unsigned())  // nlohmann parses every non-negative integer as unsigned
        bad("has a shape dimension ", json_excerpt(d), " that is not a non-negative integer");
      const uint64_t n = d.get<uint64_t>();
      if (n > uint64_t(INT64_MAX) || __builtin_mul_overflow(bytes, n, &bytes))
        bad("has a shape whose size overflows 64 bits (", n, " in dimension ", e.shape.size(), ")");
      e.shape.push_back(int64_t(n));
    }
    const auto& offs = entry["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned())
      bad("data_offsets must be two non-negative integers, got ", json_excerpt(offs));
    e.begin = offs[0].get<uint64_t>();
    e.end = offs[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      bad("data_offsets [", e.begin, ", ", e.end, "] lie outside the data (", data_size, " bytes)");
    if (bytes != e.end - e.begin)
      bad("shape and dtype need ", bytes, " bytes but data_offsets give ", e.end - e.begin);
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t covered = 0;
  for (const Entry& e : entries) {
    if (e.begin < covered) fail(path, ": tensor '", e.name, "' data_offsets overlap another tensor's bytes");
    if (e.begin > covered) fail(path, ": data bytes [", covered, ", ", e.begin, ") belong to no tensor (before '", e.name, "')");
    covered = e.end;
  }
  if (covered != data_size)
    fail(path, ": the tensors cover ", covered, " of the ", data_size, " data bytes (header length or offsets are wrong)");

  impl_->data_start = 8 + header_len;
  for (size_t i = 0; i < entries.size(); ++i) impl_->index[entries[i].name] = i;
}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;
const std::string& SafetensorsReader::path() const { return impl_->path; }
const std::map<std::string, std::string>& SafetensorsReader::metadata() const { return impl_->metadata; }
bool SafetensorsReader::contains(const std::string& name) const { return impl_->index.count(name) > 0; }

std::vector<TensorSpec> SafetensorsReader::tensors() const {
  std::vector<TensorSpec> out;
  for (const auto& e : impl_->entries) out.push_back({e.name, e.dtype, e.shape});
  return out;
}

std::optional<TensorSpec> SafetensorsReader::spec(const std::string& name) const {
  if (!contains(name)) return std::nullopt;
  const auto& e = impl_->entry(name);
  return TensorSpec{e.name, e.dtype, e.shape};
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const auto& e = impl_->entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  impl_->read_bytes(t.mutable_data_ptr(), e.begin, e.end - e.begin, name);
  return t;
}

at::Tensor SafetensorsReader::read_elements(const std::string& name, int64_t begin, int64_t count) const {
  const auto& e = impl_->entry(name);
  const uint64_t size = c10::elementSize(e.dtype);
  const uint64_t numel = (e.end - e.begin) / size;
  if (begin < 0 || count < 0 || uint64_t(begin) + uint64_t(count) > numel)
    fail(impl_->path, ": elements [", begin, ", ", begin + count, ") of tensor '", name, "' lie outside its ", numel);
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(e.dtype));
  impl_->read_bytes(t.mutable_data_ptr(), e.begin + uint64_t(begin) * size, uint64_t(count) * size, name);
  return t;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  SafetensorsFile out;
  for (const TensorSpec& t : reader.tensors()) out.tensors[t.name] = reader.read(t.name);
  out.metadata = reader.metadata();
  return out;
}

}  // namespace depthkit
