// The safetensors reader and writer (io/safetensors.h): round trips of every dtype, shape and the
// metadata; every malformed file a clear one-line error.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <cstring>
#include <fstream>

#include "depthkit/io/safetensors.h"
#include "depthkit/util/fs.h"
#include "helpers.h"

namespace depthkit::test {

TEST(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  TempDir d;
  NamedTensors in = {{"a", at::arange(12, at::kFloat).reshape({3, 4})},
                     {"b", at::arange(5, at::kLong)},
                     {"c", at::ones({2, 2}, at::kBFloat16)},
                     {"scalar", at::full({}, 2.5, at::kDouble)}};
  save_safetensors(d.str("x.safetensors"), in, {{"k", "v"}});
  auto out = load_safetensors(d.str("x.safetensors"));
  ASSERT_EQ(out.tensors.size(), 4u);
  for (auto& [name, t] : in) EXPECT_TRUE(at::equal(out.tensors.at(name), t)) << name;
  EXPECT_EQ(out.metadata.at("k"), "v");
  // Header length is a multiple of 8, as the format asks.
  std::string bytes = read_file(d.str("x.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, MalformedFilesAreClearErrors) {
  TempDir d;
  save_safetensors(d.str("ok.safetensors"), {{"w", at::ones({100})}});
  std::string good = read_file(d.str("ok.safetensors"));
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(d.str(name), std::ios::binary) << bytes;
    return d.str(name);
  };
  expect_error([&] { load_safetensors(write("short", "abc")); }, {"short", "no header"});
  expect_error([&] { load_safetensors(write("trunc", good.substr(0, good.size() - 10))); }, {"trunc", "'w'", "data"});
  std::string huge = good;
  huge[6] = 1;
  expect_error([&] { load_safetensors(write("len", huge)); }, {"len", "header length"});
  std::string json = good;
  json[8] = '#';
  expect_error([&] { load_safetensors(write("json", json)); }, {"json", "not valid JSON"});
  expect_error([&] { load_safetensors(d.str("absent")); }, {"absent", "cannot open"});
}

}  // namespace depthkit::test
