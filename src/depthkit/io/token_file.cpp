#include "depthkit/io/token_file.h"

#include <ATen/ops/empty.h>

#include <cstring>
#include <regex>
#include <sstream>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

namespace {

// NumPy format: "\x93NUMPY", major, minor, header length (u16 in 1.x, u32 in 2.x/3.x), a Python
// dict literal {'descr': '<i8', 'fortran_order': False, 'shape': (2, 5), }, then the data.
at::Tensor read_npy(const std::string& path, const std::string& bytes) {
  if (bytes.size() < 10) fail(path, ": truncated .npy header");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail(path, ": truncated .npy header");
    for (int i = 0; i < 4; ++i) header_len |= size_t(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  } else {
    fail(path, ": unsupported .npy version ", major);
  }
  if (offset + header_len > bytes.size()) fail(path, ": truncated .npy header");
  const std::string header = bytes.substr(offset, header_len);
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']*)'"))) fail(path, ": .npy header has no 'descr'");
  const std::string descr = m[1];
  if (std::regex_search(header, std::regex("'fortran_order':\\s*True")))
    fail(path, ": Fortran-ordered .npy arrays are not supported (save with C order)");
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) fail(path, ": .npy header has no 'shape'");
  std::vector<int64_t> shape;
  std::stringstream dims(m[1].str());
  for (std::string dim; std::getline(dims, dim, ',');)
    if (dim.find_first_not_of(" ") != std::string::npos) shape.push_back(std::stoll(dim));
  if (shape.size() == 1) shape.insert(shape.begin(), 1);
  if (shape.size() != 2) fail(path, ": token array must be 1-D or 2-D, got ", shape.size(), " dimensions");
  const size_t n = size_t(shape[0] * shape[1]), data = offset + header_len;
  at::Tensor out = at::empty(shape, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  auto convert = [&](auto zero) {
    using T = decltype(zero);
    if (bytes.size() - data != n * sizeof(T))
      fail(path, ": .npy data has ", bytes.size() - data, " bytes, shape and dtype need ", n * sizeof(T));
    for (size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, bytes.data() + data + i * sizeof(T), sizeof(T));
      if constexpr (std::is_signed_v<T>)
        if (v < 0) fail(path, ": negative token id ", int64_t(v), " at index ", i);
      dst[i] = int64_t(v);
    }
  };
  if (descr == "<i8") convert(int64_t{});
  else if (descr == "<i4") convert(int32_t{});
  else if (descr == "<i2") convert(int16_t{});
  else if (descr == "|i1") convert(int8_t{});
  else if (descr == "|u1") convert(uint8_t{});
  else if (descr == "<u2") convert(uint16_t{});
  else if (descr == "<u4") convert(uint32_t{});
  else if (descr == "<u8") convert(uint64_t{});
  else fail(path, ": .npy dtype '", descr, "' is not a little-endian integer type");
  return out;
}

at::Tensor read_text(const std::string& path, const std::string& text) {
  std::vector<std::vector<int64_t>> rows;
  std::stringstream lines(text);
  int line_no = 0;
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    std::stringstream ids(line);
    std::vector<int64_t> row;
    for (std::string id; ids >> id;) {
      size_t used = 0;
      int64_t v = -1;
      try {
        v = std::stoll(id, &used);
      } catch (const std::exception&) {
      }
      if (used != id.size() || v < 0) fail(path, ":", line_no, ": '", id, "' is not a token id");
      row.push_back(v);
    }
    if (row.empty()) continue;
    if (!rows.empty() && row.size() != rows.front().size())
      fail(path, ":", line_no, ": ", row.size(), " ids, but the first sequence has ", rows.front().size());
    rows.push_back(row);
  }
  if (rows.empty()) fail(path, ": no token ids");
  at::Tensor out = at::empty({int64_t(rows.size()), int64_t(rows.front().size())}, at::kLong);
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(out.data_ptr<int64_t>() + i * rows[i].size(), rows[i].data(), rows[i].size() * 8);
  return out;
}

}  // namespace

at::Tensor read_token_file(const std::string& path) {
  const std::string bytes = read_file(path);
  if (bytes.size() >= 6 && bytes.compare(0, 6, "\x93NUMPY") == 0) return read_npy(path, bytes);
  return read_text(path, bytes);
}

}  // namespace depthkit
