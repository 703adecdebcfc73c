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
  // NumPy itself refuses headers over 10,000 bytes; so does this reader (its regexes recurse per
  // character, and a hostile megabyte-long header would overflow the stack).
  if (header_len > 10000) fail(path, ": .npy header of ", header_len, " bytes exceeds NumPy's limit of 10000");
  const std::string header = bytes.substr(offset, header_len);
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']*)'"))) fail(path, ": .npy header has no 'descr'");
  const std::string descr = m[1];
  if (std::regex_search(header, std::regex("'fortran_order':\\s*True")))
    fail(path, ": Fortran-ordered .npy arrays are not supported (save with C order)");
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) fail(path, ": .npy header has no 'shape'");
  // The shape is checked against the data's byte count before anything is allocated, so a
  // header that declares a huge or negative shape is an error, not an allocation.
  std::vector<int64_t> shape;
  std::stringstream dims(m[1].str());
  for (std::string dim; std::getline(dims, dim, ',');) {
    const size_t first = dim.find_first_not_of(" "), last = dim.find_last_not_of(" ");
    if (first == std::string::npos) continue;
    const std::string digits = dim.substr(first, last - first + 1);
    if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos)
      fail(path, ": .npy shape dimension '", digits, "' is not a non-negative integer below 10^18");
    shape.push_back(std::stoll(digits));
  }
  if (shape.size() == 1) shape.insert(shape.begin(), 1);
  if (shape.size() != 2) fail(path, ": token array must be 1-D or 2-D, got ", shape.size(), " dimensions");
  if (shape[0] == 0 || shape[1] == 0) fail(path, ": token array is empty (shape ", shape[0], " x ", shape[1], ")");
  const size_t data = offset + header_len;
  size_t n = 0;
  if (__builtin_mul_overflow(size_t(shape[0]), size_t(shape[1]), &n) || n > (bytes.size() - data))
    fail(path, ": .npy shape (", shape[0], ", ", shape[1], ") needs more elements than its ",
         bytes.size() - data, " data bytes hold");
  auto convert = [&](auto zero) {
    using T = decltype(zero);
    if (bytes.size() - data != n * sizeof(T))
      fail(path, ": .npy data has ", bytes.size() - data, " bytes, shape and dtype need ", n * sizeof(T));
    at::Tensor out = at::empty(shape, at::kLong);
    int64_t* dst = out.data_ptr<int64_t>();
    for (size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, bytes.data() + data + i * sizeof(T), sizeof(T));
      if constexpr (std::is_signed_v<T>) {
        if (v < 0) fail(path, ": negative token id ", int64_t(v), " at index ", i);
      } else if constexpr (sizeof(T) == 8) {
        if (v > uint64_t(INT64_MAX)) fail(path, ": token id ", v, " at index ", i, " does not fit 63 bits");
      }
      dst[i] = int64_t(v);
    }
    return out;
  };
  if (descr == "<i8") return convert(int64_t{});
  if (descr == "<i4") return convert(int32_t{});
  if (descr == "<i2") return convert(int16_t{});
  if (descr == "|i1") return convert(int8_t{});
  if (descr == "|u1") return convert(uint8_t{});
  if (descr == "<u2") return convert(uint16_t{});
  if (descr == "<u4") return convert(uint32_t{});
  if (descr == "<u8") return convert(uint64_t{});
  fail(path, ": .npy dtype '", descr, "' is not a little-endian integer type");
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
      if (used != id.size() || v < 0) fail(path, ":", line_no, ": '", printable(id.substr(0, 40)), "' is not a token id");
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
