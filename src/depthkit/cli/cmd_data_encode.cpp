// depthkit data encode: token ids of each line of a JSONL file under a tokenizer (a tokenizer.json or
// a SentencePiece tokenizer.model), one JSON line out per line in. It is how the tests hold the tokenizer to `tokenizers` token for token, and a way
// to look at what a corpus becomes. A line is a JSON string, or {"b64": "..."} for bytes that are not
// UTF-8.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"

namespace depthkit::cli {

namespace {

// Standard base64 (padding required), refusing anything else: a line's bytes must be exactly those meant.
bool base64_decode(std::string_view in, std::string& out) {
  if (in.size() % 4) return false;
  const auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    const int pad = last ? (in[i + 3] == '=') + (in[i + 2] == '=') : 0;
    if (pad == 1 && in[i + 2] == '=') return false;  // "x=y=" is not padding
    uint32_t v = 0;
    for (int k = 0; k < 4 - pad; ++k) {
      const int d = value(in[i + k]);
      if (d < 0) return false;
      v |= uint32_t(d) << (18 - 6 * k);
    }
    out += char(v >> 16);
    if (pad < 2) out += char((v >> 8) & 0xFF);
    if (pad < 1) out += char(v & 0xFF);
  }
  return true;
}

struct EncodeArgs {
  std::string tokenizer, input;
  bool special = false, decode = false;
};

int run_encode(const EncodeArgs& a) {
  const Tokenizer tok(a.tokenizer);
  if (a.special && std::string_view(tok.file_name()) != "tokenizer.json")
    fail("--special: ", a.tokenizer, " is a SentencePiece model, whose special tokens are never read from text "
         "(--special is for a tokenizer.json)");
  const std::string text = read_file(a.input);
  std::string bytes, out;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    const std::string where = cat(a.input, ":", line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(where, ": not JSON (", one_line(e), ")");
    }
    if (j.is_string()) {
      bytes = j.get<std::string>();
    } else if (j.is_object() && j.size() == 1 && j.contains("b64") && j["b64"].is_string()) {
      if (!base64_decode(j["b64"].get_ref<const std::string&>(), bytes)) fail(where, ": b64 is not base64");
    } else {
      fail(where, " is ", json_excerpt(j), "; expected a JSON string or {\"b64\": \"...\"}");
    }
    nlohmann::json r = {{"ids", tok.encode(bytes, a.special)}};
    if (a.decode) r["decoded"] = tok.decode(r["ids"].get<std::vector<int>>());  // U+FFFD for broken bytes
    out = r.dump(-1, ' ', true);  // ASCII: U+2028 and friends would break some line readers
    out += '\n';
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  if (std::fflush(stdout) != 0) fail("cannot write the output");
  return 0;
}

}  // namespace

void add_data_encode(CLI::App* data, Action& action) {
  auto* enc = data->add_subcommand("encode", "token ids of each line of a JSONL file, under a tokenizer");
  auto args = std::make_shared<EncodeArgs>();
  enc->add_option("--tokenizer", args->tokenizer,
                  "a Hugging Face tokenizer.json (byte-level BPE) or a SentencePiece tokenizer.model")
      ->required()
      ->check(CLI::ExistingFile);
  enc->add_option("--input", args->input, "JSONL: each line a JSON string, or {\"b64\": \"...\"} for raw bytes")
      ->required()
      ->check(CLI::ExistingFile);
  enc->add_flag("--special", args->special, "split out special tokens written in the text (default: read them as text)");
  enc->add_flag("--decode", args->decode, "also print the ids decoded back to text (\"decoded\")");
  enc->callback([&action, args] { action = [args] { return run_encode(*args); }; });
}

}  // namespace depthkit::cli
