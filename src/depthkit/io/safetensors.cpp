#include "depthkit/io/safetensors.h"

#include <ATen/ops/empty.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

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
  std::string json = header.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');  // the spec pads the header to 8 bytes
  std::string out;
  out.reserve(8 + json.size() + offset);
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(char((n >> (8 * i)) & 0xff));
  out += json;
  for (const auto& c : contiguous)
    out.append(static_cast<const char*>(c.const_data_ptr()), c.numel() * c.element_size());
  write_file_atomic(path, out);
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail(path, ": cannot open safetensors file");
  uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) fail(path, ": not a safetensors file (", file_size, " bytes, no header)");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(len_bytes[i]) << (8 * i);
  if (header_len > file_size - 8 || header_len > (100u << 20))
    fail(path, ": safetensors header length ", header_len, " exceeds the file (", file_size, " bytes)");
  std::string json(header_len, '\0');
  in.read(json.data(), header_len);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    fail(path, ": safetensors header is not valid JSON");
  }
  if (!header.is_object()) fail(path, ": safetensors header is not a JSON object");
  uint64_t data_size = file_size - 8 - header_len;
  std::string data(data_size, '\0');
  in.read(data.data(), data_size);
  if (!in) fail(path, ": could not read ", data_size, " bytes of tensor data");

  SafetensorsFile out;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (auto& [k, v] : entry.items())
        out.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
      continue;
    }
    try {
      std::string dt = entry.at("dtype").get<std::string>();
      auto shape = entry.at("shape").get<std::vector<int64_t>>();
      auto offs = entry.at("data_offsets").get<std::vector<uint64_t>>();
      auto it = std::find_if(dtype_names().begin(), dtype_names().end(),
                             [&](auto& p) { return p.first == dt; });
      if (it == dtype_names().end()) fail(path, ": tensor '", name, "' has unsupported dtype ", dt);
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size)
        fail(path, ": tensor '", name, "' data_offsets lie outside the data (", data_size, " bytes)");
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(it->second));
      if (uint64_t(t.numel() * t.element_size()) != offs[1] - offs[0])
        fail(path, ": tensor '", name, "' shape and dtype need ", t.numel() * t.element_size(),
             " bytes but data_offsets give ", offs[1] - offs[0]);
      std::memcpy(t.mutable_data_ptr(), data.data() + offs[0], offs[1] - offs[0]);
      out.tensors[name] = t;
    } catch (const nlohmann::json::exception&) {
      fail(path, ": tensor '", name, "' has a malformed header entry");
    }
  }
  return out;
}

}  // namespace depthkit
