// HfBpeTokenizer on small tokenizer.json files written here: the byte map, merge order, ignore_merges,
// added tokens, decoding, refusals (one line naming file and key), and linear time on long runs.
// Equality with the `tokenizers` package itself is tests/python/test_tokenizer_json.py.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "depthkit/data/hf_tokenizer.h"
#include "depthkit/data/utf8.h"
#include "depthkit/util/error.h"

using depthkit::HfBpeTokenizer;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// GPT-2's byte → character map, written out independently of the implementation.
std::string byte_char(unsigned char b) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    uint32_t n = 0;
    for (uint32_t x = 0; x < 256; ++x) {
      const bool keep = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE);
      t[x] = keep ? x : 256 + n++;
    }
    return t;
  }();
  const uint32_t c = table[b];
  std::string s;
  if (c < 0x80) {
    s += char(c);
  } else {
    s += char(0xC0 | (c >> 6));
    s += char(0x80 | (c & 0x3F));
  }
  return s;
}

std::string bl(std::string_view bytes) {  // bytes as a byte-level token
  std::string s;
  for (const char c : bytes) s += byte_char(static_cast<unsigned char>(c));
  return s;
}

json byte_level(bool use_regex = true, bool prefix = false) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", prefix}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

// A tokenizer.json: every byte in the vocab (ids 0..255 by byte value), then `extra` tokens (bytes) and
// `merges` (pairs of bytes) in order.
json make(const std::vector<std::string>& extra = {}, const std::vector<std::pair<std::string, std::string>>& merges = {},
          json pre = byte_level()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<unsigned char>(b))] = b;
  int id = 256;
  for (const auto& t : extra) vocab[bl(t)] = id++;
  json m = json::array();
  for (const auto& [a, b] : merges) m.push_back({bl(a), bl(b)});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
            {"vocab", vocab}, {"merges", m}}}};
}

json added(const std::string& content, int id, bool special = true) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},  {"normalized", !special}, {"special", special}};
}

class Files {
 public:
  Files() {
    dir_ = fs::temp_directory_path() / ("hf_tokenizer_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(counter_++));
    fs::create_directories(dir_);
  }
  ~Files() { fs::remove_all(dir_); }
  std::string write(const std::string& text, const std::string& name = "tok.json") {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  std::string write(const json& j, const std::string& name = "tok.json") { return write(j.dump(), name); }

 private:
  fs::path dir_;
  static inline int counter_ = 0;
};

std::string error_of(const std::string& path) {
  try {
    HfBpeTokenizer t(path);
  } catch (const depthkit::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(HfTokenizer, BytesMap) {
  EXPECT_EQ(byte_char(' '), "\xC4\xA0");    // Ġ U+0120
  EXPECT_EQ(byte_char('\n'), "\xC4\x8A");   // Ċ U+010A
  EXPECT_EQ(byte_char(0xAD), "\xC5\x83");   // Ń U+0143, the last remapped byte
  EXPECT_EQ(byte_char('a'), "a");
  Files f;
  HfBpeTokenizer t(f.write(make({}, {}, byte_level(false))));
  EXPECT_EQ(t.vocab_size(), 256);
  for (int b = 0; b < 256; ++b) {
    const std::string s(1, char(b));
    EXPECT_EQ(t.token_to_id(byte_char(static_cast<unsigned char>(b))), b);
    if (b < 0x80) {  // above: not UTF-8 alone
      EXPECT_EQ(t.encode(s), std::vector<int>{b}) << b;
    }
    EXPECT_EQ(t.decode({b}), s);
  }
  EXPECT_EQ(t.encode("\xC3\xA9"), (std::vector<int>{0xC3, 0xA9}));
  EXPECT_EQ(t.encode(""), std::vector<int>{});
}

TEST(HfTokenizer, MergesByRankThenLeftmost) {
  Files f;
  HfBpeTokenizer bc_first(f.write(make({"ab", "bc"}, {{"b", "c"}, {"a", "b"}}), "1.json"));
  EXPECT_EQ(bc_first.encode("abc"), (std::vector<int>{'a', 257}));
  HfBpeTokenizer ab_first(f.write(make({"ab", "bc"}, {{"a", "b"}, {"b", "c"}}), "2.json"));
  EXPECT_EQ(ab_first.encode("abc"), (std::vector<int>{256, 'c'}));
  // Equal ranks: the leftmost pair merges first.
  HfBpeTokenizer aa(f.write(make({"aa", "aaaa"}, {{"a", "a"}, {"aa", "aa"}}), "3.json"));
  EXPECT_EQ(aa.encode("aaa"), (std::vector<int>{256, 'a'}));
  EXPECT_EQ(aa.encode("aaaaa"), (std::vector<int>{257, 'a'}));
  EXPECT_EQ(aa.encode("aaaaaaa"), (std::vector<int>{257, 256, 'a'}));
  // The legacy "a b" form reads the same.
  json legacy = make({"ab", "bc"}, {});
  legacy["model"]["merges"] = {"#version: 0.2", "b c", "a b"};
  HfBpeTokenizer l(f.write(legacy, "4.json"));
  EXPECT_EQ(l.encode("abc"), (std::vector<int>{'a', 257}));
  // The GPT-2 pattern splits before merging: no merge crosses " ".
  HfBpeTokenizer sp(f.write(make({"a ", " a"}, {{"a", " "}, {" ", "a"}}), "5.json"));
  EXPECT_EQ(sp.encode("a a"), (std::vector<int>{'a', 257}));
}

TEST(HfTokenizer, IgnoreMerges) {
  Files f;
  json j = make({"ab", "abc"}, {{"a", "b"}});
  HfBpeTokenizer plain(f.write(j, "1.json"));
  EXPECT_EQ(plain.encode("abc"), (std::vector<int>{256, 'c'}));
  j["model"]["ignore_merges"] = true;
  HfBpeTokenizer whole(f.write(j, "2.json"));
  EXPECT_EQ(whole.encode("abc"), std::vector<int>{257});
  EXPECT_EQ(whole.encode("abcabc"), (std::vector<int>{256, 'c', 256, 'c'}));  // not itself in the vocab
}

TEST(HfTokenizer, AddedTokens) {
  Files f;
  json j = make({"ab"}, {{"a", "b"}});
  j["added_tokens"] = {added("<|endoftext|>", 257), added("<|end|>", 258), added("<|end|>x", 259),
                       added("plain", 260, false)};
  HfBpeTokenizer t(f.write(j));
  EXPECT_EQ(t.vocab_size(), 261);
  EXPECT_EQ(t.eos_id(), 257);
  EXPECT_EQ(t.token_to_id("<|end|>"), 258);
  EXPECT_EQ(t.token_to_id("Ġ"), 32);
  EXPECT_EQ(t.token_to_id("nope"), std::nullopt);
  EXPECT_EQ(t.encode("ab<|endoftext|>ab", true), (std::vector<int>{256, 257, 256}));
  EXPECT_EQ(t.encode("<|end|>x<|end|>", true), (std::vector<int>{259, 258}));  // leftmost-longest
  // Read as text, special tokens are bytes; a non-special added token is still split out (as tokenizers does).
  const std::vector<int> text = t.encode("<|endoftext|>", false);
  EXPECT_GT(text.size(), 1u);
  EXPECT_EQ(t.decode(text), "<|endoftext|>");
  EXPECT_EQ(t.encode("abplainab", false), (std::vector<int>{256, 260, 256}));
  // Decoding skips special tokens and keeps non-special ones.
  EXPECT_EQ(t.decode({256, 257, 260, 258, 'c'}), "abplainc");
  EXPECT_EQ(t.decode({-1, 100000, 'a'}), "a");  // unknown ids are skipped, as tokenizers does

  json llama = make();
  llama["added_tokens"] = {added("<|begin_of_text|>", 256), added("<|end_of_text|>", 257)};
  EXPECT_EQ(HfBpeTokenizer(f.write(llama, "l.json")).eos_id(), 257);
  const std::string none = f.write(make(), "n.json");
  try {
    HfBpeTokenizer(none).eos_id();
    ADD_FAILURE() << "no end-of-document token, yet eos_id() answered";
  } catch (const depthkit::Error& e) {
    EXPECT_NE(std::string(e.what()).find(none + ": added_tokens has neither"), std::string::npos) << e.what();
  }
}

TEST(HfTokenizer, LlamaStyleSplit) {
  Files f;
  const json pre = {{"type", "Sequence"},
                    {"pretokenizers",
                     {{{"type", "Split"},
                       {"pattern", {{"Regex", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                              "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      byte_level(false)}}};
  json j = make({"12", "123", "'S"}, {{"1", "2"}, {"12", "3"}, {"'", "S"}}, pre);
  HfBpeTokenizer t(f.write(j));
  EXPECT_EQ(t.encode("1234"), (std::vector<int>{257, '4'}));  // digits in threes
  EXPECT_EQ(t.encode("IT'S"), (std::vector<int>{'I', 'T', 258}));  // contractions ignore case
  // U+180E is not White_Space (Oniguruma) though PCRE2's \s matches it: "x\u180e's" is x, \u180e', s.
  const std::vector<int> mvs = t.encode("x\xE1\xA0\x8E's");
  EXPECT_EQ(mvs, (std::vector<int>{'x', 0xE1, 0xA0, 0x8E, '\'', 's'}));
}

TEST(HfTokenizer, SplitBehaviors) {
  Files f;
  const auto ids = [&](const std::string& behavior, const std::string& text) {
    const json pre = {{"type", "Sequence"},
                      {"pretokenizers",
                       {{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", false}},
                        byte_level(false)}}};
    // "a-" and "-b" exist, so what each behavior keeps together shows in the ids.
    return HfBpeTokenizer(f.write(make({"a-", "-b"}, {{"a", "-"}, {"-", "b"}}, pre), behavior + ".json")).encode(text);
  };
  EXPECT_EQ(ids("Isolated", "a-b"), (std::vector<int>{'a', '-', 'b'}));
  EXPECT_EQ(ids("Removed", "a-b"), (std::vector<int>{'a', 'b'}));
  EXPECT_EQ(ids("MergedWithPrevious", "a-b"), (std::vector<int>{256, 'b'}));
  EXPECT_EQ(ids("MergedWithNext", "a-b"), (std::vector<int>{'a', 257}));
  EXPECT_EQ(ids("Contiguous", "a--b"), (std::vector<int>{'a', '-', '-', 'b'}));
}

TEST(HfTokenizer, PrefixSpaceAndInvalidUtf8) {
  Files f;
  HfBpeTokenizer t(f.write(make({" a"}, {{" ", "a"}}, byte_level(true, true))));
  EXPECT_EQ(t.encode("a"), std::vector<int>{256});
  EXPECT_EQ(t.encode(" a"), std::vector<int>{256});
  EXPECT_EQ(t.encode(""), std::vector<int>{});
  // Each maximal invalid subpart is one U+FFFD (EF BF BD), as Python's decode('utf-8', 'replace').
  EXPECT_EQ(depthkit::utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(depthkit::utf8_lossy("\xE2\x82" "a"), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(depthkit::utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  EXPECT_EQ(depthkit::utf8_lossy("\xC0\xAF\xFF"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(depthkit::utf8_lossy("ok \xC3\xA9"), "ok \xC3\xA9");
  EXPECT_EQ(t.encode("\x80"), t.encode("\xEF\xBF\xBD"));
}

TEST(HfTokenizer, DecodeRoundTrip) {
  Files f;
  HfBpeTokenizer t(f.write(make({"th", "the", " the", "in"}, {{"t", "h"}, {"th", "e"}, {" ", "the"}, {"i", "n"}})));
  std::mt19937 rng(3);
  for (int n = 0; n < 200; ++n) {
    std::string s;
    const int len = int(rng() % 40);
    for (int k = 0; k < len; ++k) s += char(rng() % 4 ? "the in \n\t"[rng() % 9] : char(rng() % 256));
    EXPECT_EQ(t.decode(t.encode(s)), depthkit::utf8_lossy(s));
  }
  EXPECT_EQ(t.encode(" the the"), (std::vector<int>{258, 258}));
}

TEST(HfTokenizer, ThreadsAgree) {
  Files f;
  HfBpeTokenizer t(f.write(make({"th", "the", " the"}, {{"t", "h"}, {"th", "e"}, {" ", "the"}})));
  std::string text;
  for (int i = 0; i < 2000; ++i) text += (i % 7 ? " the" : " them\n") + std::to_string(i % 13);
  const auto want = t.encode(text);
  std::vector<std::thread> threads;
  std::vector<int> same(4, 0);
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] { same[k] = t.encode(text) == want && t.encode(text) == want; });
  for (auto& th : threads) th.join();
  EXPECT_EQ(same, std::vector<int>(4, 1));
}

TEST(HfTokenizer, LongRunsAreFast) {
  Files f;
  // Merges that build long runs: "  " → "    " → ..., "11" → "1111" → ....
  std::vector<std::string> extra;
  std::vector<std::pair<std::string, std::string>> merges;
  for (const char c : {' ', '1', '\n'})
    for (std::string s(1, c); s.size() < 64; s += s) extra.push_back(s + s), merges.emplace_back(s, s);
  HfBpeTokenizer t(f.write(make(extra, merges)));
  for (const char c : {' ', '1', '\n'}) {
    const std::string text = std::string(1 << 20, c) + "x";
    const auto start = std::chrono::steady_clock::now();
    const auto ids = t.encode(text);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(s, 1.0) << "a 1 MB run of byte " << int(c);
    EXPECT_EQ(t.decode(ids), text);
  }
}

TEST(HfTokenizer, Refusals) {
  Files f;
  const auto refused = [&](json j, const std::string& expect) {
    const std::string path = f.write(j, "bad.json");
    const std::string msg = error_of(path);
    EXPECT_NE(msg.find(path + ": "), std::string::npos) << msg;
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  EXPECT_NE(error_of("/nonexistent/tok.json").find("/nonexistent/tok.json"), std::string::npos);
  {
    const std::string p = f.write(std::string("{\"model\": "), "trunc.json");
    EXPECT_NE(error_of(p).find(p + ": not JSON"), std::string::npos) << error_of(p);
  }
  json j = make();
  j["model"]["type"] = "WordPiece";
  refused(j, "model.type is \"WordPiece\"; depthkit runs byte-level BPE");
  j = make(), j["normalizer"] = {{"type", "NFC"}};
  refused(j, "normalizer.type is \"NFC\"");
  j = make(), j["pre_tokenizer"] = {{"type", "Whitespace"}};
  refused(j, "pre_tokenizer.type is \"Whitespace\"");
  j = make(), j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {byte_level(false)}}},
  j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Split"}, {"pattern", {{"String", "x"}}}, {"behavior", "Isolated"}});
  refused(j, "pre_tokenizer.pretokenizers[1] follows the ByteLevel pre-tokenizer");
  j = make(), j["pre_tokenizer"] = {{"type", "Sequence"},
                                    {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}},
                                                        {"behavior", "Isolated"}}, byte_level(false)}}};
  refused(j, "pre_tokenizer.pretokenizers[0].pattern.Regex uses \\w");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(";
  refused(j, "pre_tokenizer.pretokenizers[0].pattern.Regex does not compile");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "a";
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Shuffled";
  refused(j, "pre_tokenizer.pretokenizers[0].behavior is \"Shuffled\"");
  j = make(), j["model"]["merges"] = json::array({json::array({"a", "zz"})});
  refused(j, "model.merges[0] names \"zz\", which is not in model.vocab");
  j = make(), j["model"]["merges"] = json::array({"a b c"});
  refused(j, "model.merges[0] is \"a b c\"");
  j = make(), j["model"]["merges"] = json::array({json::array({"a", "b"})});
  refused(j, "model.merges[0] makes \"ab\"");
  j = make(), j["model"]["vocab"]["zz"] = 5;
  refused(j, "has id 5, already the id of");
  j = make(), j["model"]["vocab"]["zz"] = -1;
  refused(j, "model.vocab[\"zz\"] is -1");
  j = make(), j["model"]["vocab"] = json::array();
  refused(j, "model.vocab is an array, not an object");
  j = make(), j["model"].erase("merges");
  refused(j, "model.merges is missing");
  j = make(), j["model"]["dropout"] = 0.1;
  refused(j, "model.dropout is 0.1");
  j = make(), j["model"]["byte_fallback"] = true;
  refused(j, "model.byte_fallback is true");
  j = make(), j["model"]["continuing_subword_prefix"] = "##";
  refused(j, "model.continuing_subword_prefix is \"##\"");
  j = make(), j["model"]["unk_token"] = "<unk>";
  refused(j, "model.unk_token \"<unk>\" is not in model.vocab");
  j = make(), j["decoder"] = {{"type", "WordPiece"}};
  refused(j, "decoder.type is \"WordPiece\"");
  j = make(), j["truncation"] = {{"max_length", 5}};
  refused(j, "truncation is an object of 1 keys");
  j = make(), j["added_tokens"] = {added("<s>", 256)}, j["added_tokens"][0]["lstrip"] = true;
  refused(j, "added_tokens[0] (\"<s>\") has lstrip true");
  j = make(), j["added_tokens"] = {added("<s>", 300)};
  refused(j, "added_tokens[0].id is 300 but tokenizers numbers \"<s>\" 256");
  j = make(), j["added_tokens"] = {added("<s>", 256), added("<s>", 257)};
  refused(j, "added_tokens[1] (\"<s>\") repeats an earlier added token");
  j = make(), j["added_tokens"] = {{{"id", 256}}};
  refused(j, "added_tokens[0].content is missing");
}
