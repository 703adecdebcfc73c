// Hostile files and run directories, case by case (issue 14): the safetensors rules, state.json's
// fields, `latest`, pruning by step number, .npy shapes, shards that change under a reader, and the
// config's range checks. tests/fuzz_inputs.cpp mutates the same inputs by the thousand.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/io/safetensors.h"
#include "depthkit/io/token_file.h"
#include "depthkit/model/transformer.h"
#include "depthkit/train/checkpoint.h"
#include "depthkit/train/optimizer.h"
#include "depthkit/util/fs.h"
#include "helpers.h"
#include <ATen/ops/arange.h>

namespace depthkit::test {
namespace {

void write_bytes(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// A safetensors file from a header (JSON text) and a data section, with the length given or exact.
std::string safetensors_bytes(const std::string& json, const std::string& data, int64_t length_delta = 0) {
  const uint64_t n = json.size() + uint64_t(length_delta);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out + json + data;
}

TEST(Safetensors, RangesMustTileTheDataExactly) {
  TempDir d;
  const std::string path = d.str("x.safetensors");
  const std::string data(16, '\1');
  auto header = [](const std::string& a, const std::string& b) {
    return "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" + a + "},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" + b + "}}";
  };
  write_bytes(path, safetensors_bytes(header("[0,8]", "[8,16]"), data));
  EXPECT_EQ(load_safetensors(path).tensors.size(), 2u);
  write_bytes(path, safetensors_bytes(header("[0,8]", "[0,8]"), data));  // aliased weights
  expect_error([&] { load_safetensors(path); }, {path, "overlap"});
  write_bytes(path, safetensors_bytes(header("[0,8]", "[4,12]"), data));
  expect_error([&] { load_safetensors(path); }, {path, "overlap"});
  write_bytes(path, safetensors_bytes(header("[8,16]", "[16,24]"), data + std::string(8, '\0')));  // a hole
  expect_error([&] { load_safetensors(path); }, {path, "belong to no tensor"});
  write_bytes(path, safetensors_bytes(header("[0,8]", "[8,16]"), data + "xxxx"));  // trailing bytes
  expect_error([&] { load_safetensors(path); }, {path, "cover 16 of the 20 data bytes"});
  write_bytes(path, safetensors_bytes(header("[0,8]", "[8,12]"), data));
  expect_error([&] { load_safetensors(path); }, {path, "tensor 'b'", "need 8 bytes"});
}

TEST(Safetensors, HeaderLengthOneByteShortIsAnErrorNotShiftedWeights) {
  TempDir d;
  const std::string path = d.str("m.safetensors");
  save_safetensors(path, {{"w", at::arange(6, at::kFloat)}});
  std::string bytes = read_file(path);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  for (int64_t delta : {-1, 1, -8}) {
    std::string bad = bytes;
    const uint64_t n = len + uint64_t(delta);
    for (int i = 0; i < 8; ++i) bad[i] = char((n >> (8 * i)) & 0xff);
    write_bytes(path, bad);
    EXPECT_THROW(load_safetensors(path), Error) << "header length off by " << delta;
  }
}

TEST(Safetensors, HugeOrNegativeShapesAreRefusedBeforeAllocating) {
  TempDir d;
  const std::string path = d.str("h.safetensors");
  for (const char* shape : {"[4611686018427387904, 4611686018427387904]", "[-1]", "[1.5]", "[\"2\"]",
                            "[18446744073709551615, 2]"}) {
    write_bytes(path, safetensors_bytes(std::string("{\"w\":{\"dtype\":\"F32\",\"shape\":") + shape +
                                            ",\"data_offsets\":[0,8]}}", std::string(8, '\0')));
    expect_error([&] { load_safetensors(path); }, {path, "tensor 'w'"});
  }
  write_bytes(path, safetensors_bytes("{\"__metadata__\":{\"k\":3}}", ""));
  expect_error([&] { load_safetensors(path); }, {path, "metadata 'k' is not a string"});
}

TEST(TokenFiles, NpyShapesAreCheckedAgainstTheData) {
  TempDir d;
  const std::string path = d.str("t.npy");
  auto npy = [](const std::string& shape, const std::string& descr, size_t data_bytes) {
    std::string h = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
    h.resize(118, ' ');
    h += '\n';
    return std::string("\x93NUMPY\x01\x00", 8) + char(h.size() & 0xff) + char(h.size() >> 8) + h +
           std::string(data_bytes, '\0');
  };
  write_bytes(path, npy("(2, 4)", "<i4", 32));
  EXPECT_EQ(read_token_file(path).sizes(), at::IntArrayRef({2, 4}));
  write_bytes(path, npy("(461168601842738790, 4)", "<i4", 32));
  expect_error([&] { read_token_file(path); }, {path, "needs more elements"});
  write_bytes(path, npy("(-1, 4)", "<i4", 32));
  expect_error([&] { read_token_file(path); }, {path, "'-1' is not a non-negative integer"});
  write_bytes(path, npy("(0, 4)", "<i4", 0));
  expect_error([&] { read_token_file(path); }, {path, "empty"});
  std::string big = npy("(1,)", "<u8", 0) + std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8);
  write_bytes(path, big);
  expect_error([&] { read_token_file(path); }, {path, "does not fit 63 bits"});
}

TEST(Shards, AShardThatShrinksUnderAReaderIsANamedError) {
  TempDir d;
  write_pattern_data(d.str("data"), 64, 4000, 1000);
  TokenDataset train(d.str("data"), "train", 64);
  std::vector<int64_t> window(17);
  train.read_window(200, 16, window.data());
  fs::resize_file(d.path / "data" / "train_000000.bin", 2048);
  expect_error([&] { train.read_window(200, 16, window.data()); }, {"train_000000.bin", "shard changed while in use"});
}

class RunDirectory : public ::testing::Test {
 protected:
  void SetUp() override {
    write_pattern_data(dir.str("data"), 64, 4000, 1000);
    cfg = small_config(dir.str("data"));
  }
  TempDir dir;
  Config cfg;
};

TEST_F(RunDirectory, PruningOrdersByStepNumberAndKeepsLatest) {
  Transformer model(cfg.model, cfg.residual, at::kCPU, 1);
  AdamW opt(model.parameters(), cfg.optim);
  const fs::path run = dir.path / "run";
  TrainerState st;
  st.config_toml = cfg.to_toml();
  // Names past 8 digits sort before smaller steps as text: pruning must use the numbers.
  for (int64_t step : {99999998, 99999999, 100000000, 100000001}) {
    st.step = step;
    save_checkpoint(run, model, opt.state(), st, 2);
  }
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(run / "checkpoints"))
    if (e.is_directory()) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step_100000000", "step_100000001"}));
  EXPECT_EQ(find_checkpoint(run)->filename(), "step_100000001");
  // A stale folder of a higher step never takes the place of the checkpoint just written.
  fs::create_directories(run / "checkpoints" / "step_900000000");
  st.step = 100000002;
  save_checkpoint(run, model, opt.state(), st, 1);
  EXPECT_TRUE(fs::is_directory(run / "checkpoints" / "step_100000002"));
  EXPECT_EQ(find_checkpoint(run)->filename(), "step_100000002");
}

TEST_F(RunDirectory, LatestMustNameOneCheckpoint) {
  const fs::path root = dir.path / "run" / "checkpoints";
  fs::create_directories(root / "step_00000004");
  write_bytes(root / "latest", "step_00000004\r\n");  // CRLF from an editor: forgiven
  EXPECT_EQ(find_checkpoint(dir.path / "run")->filename(), "step_00000004");
  for (const std::string& bad : {std::string("step_00000004\0\n", 15), std::string("../../etc\n"), std::string(""),
                                std::string("step_4\nstep_5\n")}) {
    write_bytes(root / "latest", bad);
    expect_error([&] { find_checkpoint(dir.path / "run"); }, {"latest", "does not name a checkpoint"});
  }
  fs::remove(root / "latest");
  fs::create_directories(root / "latest");
  expect_error([&] { find_checkpoint(dir.path / "run"); }, {"latest", "is a directory"});
}

TEST_F(RunDirectory, StateJsonFieldsAreValidated) {
  Transformer model(cfg.model, cfg.residual, at::kCPU, 1);
  AdamW opt(model.parameters(), cfg.optim);
  TrainerState st;
  st.step = 3;
  st.rng_state = capture_rng_state();
  st.config_toml = cfg.to_toml();
  const fs::path ck = dir.path / "ck";
  write_checkpoint_dir(ck, model, opt.state(), st);
  const std::string good = read_file(ck / "state.json");
  EXPECT_EQ(load_checkpoint(ck, false).state.step, 3);
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(good);
    edit(j);
    write_bytes(ck / "state.json", j.dump());
  };
  const std::string path = (ck / "state.json").string();
  with([](auto& j) { j["step"] = -1; });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'step' must be a non-negative integer, got -1"});
  with([](auto& j) { j["step"] = 2.5; });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'step'"});
  with([](auto& j) { j["data"]["index"] = -4; });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'data.index'"});
  with([](auto& j) { j["data"] = "x"; });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'data.epoch' is missing"});
  with([](auto& j) { j["tokens_seen"] = UINT64_MAX; });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'tokens_seen'"});
  with([](auto& j) { j["rng_state"] = j["rng_state"].template get<std::string>().substr(2); });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'rng_state' has"});
  with([](auto& j) { j.erase("config"); });
  expect_error([&] { load_checkpoint(ck, false); }, {path, "field 'config' is missing"});
  write_bytes(ck / "state.json", "[1, 2]");
  expect_error([&] { load_checkpoint(ck, false); }, {path, "not a JSON object"});
}

TEST(ConfigRanges, ProductsAndValuesThatCannotRunAreRefused) {
  const std::string base = "[train]\nsteps = 10\n";
  expect_error([&] { parse_config(base, "c.toml", {"model.rope_theta=inf"}); }, {"model.rope_theta", "finite"});
  expect_error([&] { parse_config("[model]\nrope_theta = nan\n[train]\nsteps = 1\n", "c.toml"); },
               {"c.toml", "model.rope_theta", "finite"});
  expect_error([&] { parse_config("[train]\ntokens = 9223372036854775807\nmicro_batch = 1048576\n", "c.toml"); },
               {"c.toml", "overflows 64 bits"});
  // The step count of a huge token budget is exact (no overflow to zero steps).
  Config c = parse_config("[train]\ntokens = 9223372036854775807\nmicro_batch = 1\ngrad_accum = 1\n[model]\nseq_len = 1\n", "c.toml");
  EXPECT_EQ(c.total_steps(), INT64_MAX);
  expect_error([&] { parse_config(base, "c.toml", {"model.n_layers=2\nmodel.d_model = 7"}); }, {"--set", "line break"});
  expect_error([&] { parse_config(base, "c.toml", {"data.dir=\"\""}); }, {"data.dir", "must not be empty"});
}

}  // namespace
}  // namespace depthkit::test
