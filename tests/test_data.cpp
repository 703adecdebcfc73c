// Token shards (write/read, every malformed-shard error), the batch loader, the tokenizer and
// `data prepare`.
#include <ATen/ops/equal.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/data/utf8.h"
#include "depthkit/data/prepare.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"
#include "helpers.h"

namespace depthkit::test {

TEST(Shards, RoundTripUint16) {
  TempDir d;
  auto tokens = pattern_tokens(1000, 65536, 3);
  tokens[5] = 65535;
  write_shard(d.str("a.bin"), tokens, 65536);
  Shard s(d.str("a.bin"));
  EXPECT_EQ(s.token_bytes(), 2);
  EXPECT_EQ(fs::file_size(d.str("a.bin")), 1024u + 2000u);
  EXPECT_EQ(read_shard(d.str("a.bin")), tokens);
  // The header is the llm.c layout: int32 magic, version, count.
  std::string bytes = read_file(d.str("a.bin"));
  int32_t h[3];
  std::memcpy(h, bytes.data(), sizeof h);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 1000);
}

TEST(Shards, RoundTripUint32ForLargeVocabularies) {
  TempDir d;
  auto tokens = pattern_tokens(500, 152064, 4);
  tokens[0] = 152063;
  write_shard(d.str("b.bin"), tokens, 152064);
  Shard s(d.str("b.bin"));
  EXPECT_EQ(s.token_bytes(), 4);
  EXPECT_EQ(read_shard(d.str("b.bin")), tokens);
}

TEST(Shards, WriteRejectsIdsOutsideVocabulary) {
  TempDir d;
  expect_error([&] { write_shard(d.str("c.bin"), {1, 2, 300}, 256); }, {"c.bin", "token id 300", ">= vocab_size 256"});
  EXPECT_FALSE(fs::exists(d.str("c.bin")));
}

// Writes `bytes` as a file and expects opening it as a shard to fail naming file and problem.
void expect_bad_shard(const std::string& path, const std::string& bytes, const std::string& problem) {
  {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  expect_error([&] { Shard s(path); }, {path, problem});
}

TEST(Shards, EveryMalformedShardIsAClearError) {
  TempDir d;
  write_shard(d.str("good.bin"), pattern_tokens(100, 1000, 5), 1000);
  const std::string good = read_file(d.str("good.bin"));
  expect_bad_shard(d.str("tiny.bin"), good.substr(0, 100), "smaller than the 1024-byte header");
  expect_bad_shard(d.str("trunc.bin"), good.substr(0, good.size() - 2), "truncated shard: header says 100 tokens");
  expect_bad_shard(d.str("long.bin"), good + "xy", "wrong size");
  std::string magic = good;
  magic[0] ^= 0x5a;
  expect_bad_shard(d.str("magic.bin"), magic, "wrong magic");
  std::string version = good;
  version[4] = 9;
  expect_bad_shard(d.str("version.bin"), version, "unsupported version 9");
  std::string negative = good;
  int32_t minus = -5;
  std::memcpy(negative.data() + 8, &minus, 4);
  expect_bad_shard(d.str("neg.bin"), negative, "negative token count");
  expect_error([&] { Shard s(d.str("missing.bin")); }, {"missing.bin", "cannot open"});
}

TEST(Loader, TokenIdAboveVocabularyIsNamed) {
  TempDir d;
  write_shard(d.str("train_000000.bin"), pattern_tokens(200, 100, 6), 100);
  TokenDataset data(d.str(), "train", 50);  // a model with a smaller vocabulary
  BatchLoader loader(data, 2, 16, 1);
  expect_error([&] {
    for (int i = 0; i < 10; ++i) loader.next();
  }, {"train_000000.bin", "token id", ">= vocab_size 50"});
}

TEST(Loader, MissingDataIsNamed) {
  TempDir d;
  expect_error([&] { TokenDataset x(d.str("nope"), "train", 10); }, {"nope", "data directory not found"});
  expect_error([&] { TokenDataset x(d.str(), "val", 10); }, {"no val shards"});
}

TEST(Loader, SeededOrderIsReproducibleAndResumable) {
  TempDir d;
  write_shard(d.str("x_train_000000.bin"), pattern_tokens(1000, 64, 7), 64);
  write_shard(d.str("x_train_000001.bin"), pattern_tokens(700, 64, 8), 64);
  TokenDataset data(d.str(), "train", 64);
  const int64_t T = 16, W = data.windows(T);
  EXPECT_EQ(W, (999 / 16) + (699 / 16));
  BatchLoader a(data, 3, T, 42), b(data, 3, T, 42), c(data, 3, T, 43);
  bool differs = false;
  std::vector<at::Tensor> seq;
  for (int i = 0; i < 50; ++i) {  // several epochs
    auto x = a.next();
    EXPECT_TRUE(at::equal(x, b.next()));
    differs |= !at::equal(x, c.next());
    seq.push_back(x);
  }
  EXPECT_TRUE(differs);
  // Resume at a recorded position continues with exactly the same batches.
  BatchLoader first(data, 3, T, 42);
  for (int i = 0; i < 23; ++i) first.next();
  BatchLoader resumed(data, 3, T, 42, first.position());
  for (int i = 23; i < 50; ++i) EXPECT_TRUE(at::equal(resumed.next(), seq[i])) << i;
}

TEST(Loader, AnEpochVisitsEveryWindowOnce) {
  TempDir d;
  std::vector<uint32_t> t(16 * 10 + 1);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint32_t(i % 200);
  write_shard(d.str("train_000000.bin"), t, 256);
  TokenDataset data(d.str(), "train", 256);
  BatchLoader loader(data, 1, 16, 9);
  std::vector<int64_t> starts;
  for (int i = 0; i < 10; ++i) starts.push_back(loader.next()[0][0].item<int64_t>());
  std::sort(starts.begin(), starts.end());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(starts[i], (16 * i) % 200);
  EXPECT_EQ(loader.position().epoch, 0);
  loader.next();
  EXPECT_EQ(loader.position().epoch, 1);
}

// N ranks with accumulation A read, between them, exactly the micro-batches one rank with
// accumulation N·A reads, each once, and every rank's position stays the single-rank position.
TEST(Loader, RanksShareOneGlobalOrder) {
  TempDir d;
  write_shard(d.str("train_000000.bin"), pattern_tokens(1000, 64, 7), 64);
  TokenDataset data(d.str(), "train", 64);
  const int64_t T = 16, B = 3, N = 3, A = 2;
  BatchLoader one(data, B, T, 5);
  std::vector<BatchLoader> ranks;
  for (int64_t r = 0; r < N; ++r) ranks.emplace_back(data, B, T, 5);
  for (int step = 0; step < 9; ++step) {  // crosses epochs (62 windows, 18 a step)
    for (int64_t m = 0; m < A; ++m)
      for (int64_t r = 0; r < N; ++r)  // micro-step m of rank r is global micro-batch m·N + r
        EXPECT_TRUE(at::equal(ranks[r].next(r, N), one.next())) << "step " << step << " rank " << r;
    for (int64_t r = 0; r < N; ++r) {
      EXPECT_EQ(ranks[r].position().epoch, one.position().epoch);
      EXPECT_EQ(ranks[r].position().index, one.position().index);
    }
  }
}

const char* kText =
    "The Python tutorial: an informal introduction.\n"
    "    >>> print(\"naïve café — ✓\", 3 + 4)  # comments\n\n"
    "Tabs\there, trailing spaces   \nand a last line without newline";

std::vector<std::string> sample_documents() {
  std::vector<std::string> docs;
  for (int i = 0; i < 40; ++i)
    docs.push_back(std::string(kText) + "\nDocument " + std::to_string(i) +
                   " talks about lists, dictionaries, classes and modules in Python " + std::to_string(i * 17) + ".\n");
  return docs;
}

TEST(Tokenizer, RoundTripIsExact) {
  TempDir d;
  train_tokenizer(sample_documents(), 400, 1, d.str("tok.model"));
  Tokenizer tok(d.str("tok.model"));
  EXPECT_LE(tok.vocab_size(), 400);
  EXPECT_EQ(tok.eos_id(), 1);
  for (std::string s : {std::string(kText), std::string("\n\nleading newlines"), std::string("日本語 and emoji 🙂\n"),
                        std::string("")}) {
    auto ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s);
    for (int id : ids) EXPECT_NE(id, tok.eos_id());
  }
  // Merges were learned: common text takes far fewer tokens than bytes.
  EXPECT_LT(tok.encode(kText).size(), std::strlen(kText) / 2);
  expect_error([&] { Tokenizer bad(d.str("missing.model")); }, {"missing.model"});
}

TEST(Prepare, WritesShardsAndMetaDeterministically) {
  TempDir d;
  auto docs = sample_documents();
  fs::create_directories(d.str("docs/sub"));
  for (size_t i = 0; i < docs.size(); ++i)
    std::ofstream(d.str(i % 2 ? "docs/sub/" : "docs/") + "doc" + std::to_string(i) + ".rst.txt") << docs[i];
  PrepareOptions opt;
  opt.inputs = {d.str("docs")};
  opt.out_dir = d.str("out1");
  opt.vocab_size = 400;
  opt.val_fraction = 0.1;
  Progress::set_enabled(false);
  PrepareResult r = prepare_data(opt);
  EXPECT_EQ(r.train_docs + r.val_docs, 40);
  // Each document's split is the seeded hash of its file's key (its path below the input) and row.
  int64_t val = 0;
  for (size_t i = 0; i < docs.size(); ++i)
    val += is_validation_document(opt.seed, (i % 2 ? "sub/doc" : "doc") + std::to_string(i) + ".rst.txt", 0,
                                  opt.val_fraction);
  EXPECT_EQ(r.val_docs, val);
  EXPECT_GT(val, 0);
  EXPECT_GT(r.unigram_entropy_nats, 1.0);
  auto meta = nlohmann::json::parse(read_file(d.str("out1/meta.json")));
  EXPECT_EQ(meta["vocab_size"].get<int>(), r.vocab_size);
  EXPECT_EQ(meta["splits"]["train"]["tokens"].get<int64_t>(), r.train_tokens);
  // Every document ends with the end-of-document token; decoding restores the text.
  auto train = read_shard(d.str("out1/train_000000.bin"));
  EXPECT_EQ(int64_t(train.size()), r.train_tokens);
  EXPECT_EQ(int64_t(std::count(train.begin(), train.end(), 1u)), r.train_docs);
  Tokenizer tok(d.str("out1/tokenizer.model"));
  std::vector<int> first_doc(train.begin(), std::find(train.begin(), train.end(), 1u));
  EXPECT_NE(std::find(docs.begin(), docs.end(), tok.decode(first_doc)), docs.end());
  // Same inputs and seed: identical shards, with the given tokenizer too.
  opt.out_dir = d.str("out2");
  opt.tokenizer = d.str("out1/tokenizer.model");
  prepare_data(opt);
  EXPECT_EQ(read_file(d.str("out1/train_000000.bin")), read_file(d.str("out2/train_000000.bin")));
  EXPECT_EQ(read_file(d.str("out1/val_000000.bin")), read_file(d.str("out2/val_000000.bin")));
  // An existing output is not overwritten without --force; nothing half-written is left.
  expect_error([&] { prepare_data(opt); }, {"out2", "already exists"});
  opt.inputs = {d.str("nothing-here")};
  opt.out_dir = d.str("out3");
  expect_error([&] { prepare_data(opt); }, {"nothing-here", "input not found"});
  EXPECT_FALSE(fs::exists(d.str("out3")));
  Progress::set_enabled(true);
}

// A shard written as its ids arrive: invisible until commit(), then the llm.c layout for its
// vocabulary (uint16 up to 65,536 ids, uint32 above: Llama-3's 128,256), read back whole; an id out
// of range is refused naming the shard, and an uncommitted writer leaves nothing behind.
TEST(Shards, WriterStreamsBothLayouts) {
  TempDir d;
  for (const int64_t vocab : {int64_t(50257), int64_t(128256)}) {
    const std::string path = d.str("train_" + std::to_string(vocab) + ".bin");
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < 3000; ++i) ids.push_back(uint32_t((i * 2654435761u) % uint64_t(vocab)));
    {
      ShardWriter w(path, vocab);
      w.append(ids.data(), 1000);
      w.append(ids.data() + 1000, 2000);
      EXPECT_FALSE(fs::exists(path)) << "visible before commit";
      w.commit();
    }
    EXPECT_EQ(read_shard(path), ids);
    Shard s(path);
    EXPECT_EQ(s.token_bytes(), vocab > 65536 ? 4 : 2);
  }
  {
    ShardWriter w(d.str("bad.bin"), 100);
    const uint32_t bad = 100;
    expect_error([&] { w.append(&bad, 1); }, {"bad.bin", "token id 100", "vocab_size 100"});
  }
  EXPECT_FALSE(fs::exists(d.str("bad.bin")));
  for (const auto& e : fs::directory_iterator(d.path)) EXPECT_EQ(e.path().string().find(".tmp-"), std::string::npos);
}

// Well-formed UTF-8 as Unicode's Table 3-7 defines it; the first bad byte is the one named.
TEST(Utf8, Validation) {
  size_t at = 99;
  EXPECT_TRUE(valid_utf8(""));
  EXPECT_TRUE(valid_utf8("plain ascii, long enough to take the eight-byte path"));
  EXPECT_TRUE(valid_utf8("na\xC3\xAFve \xE6\x9D\xB1\xE4\xBA\xAC \xF0\x9F\x99\x82 \xF4\x8F\xBF\xBF"));  // ï 東京 🙂 U+10FFFF
  const std::pair<std::string, size_t> bad[] = {
      {"ab\x80", 2},                  // a lone continuation byte
      {"abc\xC3", 3},                 // cut short
      {"\xC0\xAF", 0},               // overlong '/'
      {"x\xE0\x80\xAF", 1},           // overlong, three bytes
      {"\xED\xA0\x80", 0},            // a surrogate (U+D800)
      {"\xF4\x90\x80\x80", 0},        // past U+10FFFF
      {"12345678\xF5\x80\x80\x80", 8},  // F5 never starts a sequence
      {"\xE6\x9D", 0},                // a three-byte sequence cut after two
  };
  for (const auto& [text, where] : bad) {
    EXPECT_FALSE(valid_utf8(text, &at)) << printable(text);
    EXPECT_EQ(at, where) << printable(text);
  }
}

}  // namespace depthkit::test
