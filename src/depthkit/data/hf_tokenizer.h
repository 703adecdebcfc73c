// A Hugging Face tokenizer.json holding a byte-level BPE tokenizer (GPT-2's, Llama-3's, or one
// trained with the `tokenizers` package), encoded token for token as `tokenizers` 0.23 does:
//   encode(text)       == tok.encode(text, add_special_tokens=False).ids   with tok.encode_special_tokens = True
//   encode(text, true) == tok.encode(text, add_special_tokens=False).ids   (the default)
//   decode(ids)        == tok.decode(ids) as bytes (before its lossy UTF-8 conversion)
// No post-processor is applied (no BOS, no template): the caller adds what it needs.
//
// Supported (anything else is refused at load, in one line naming the file and the key):
//   normalizer        null
//   pre_tokenizer     ByteLevel (add_prefix_space, use_regex), or Sequence of Split steps (pattern Regex or
//                     String, any behavior, invert) ending in one ByteLevel
//   model             BPE: vocab, merges (either format), ignore_merges, fuse_unk, unk_token (null or in
//                     the vocab); dropout null, byte_fallback false, no subword prefix or word suffix
//   added_tokens      lstrip, rstrip and single_word false; normalized either (matched before or after the
//                     normalizer, which is null, exactly as tokenizers' two passes do)
//   decoder           ByteLevel, null (decoded as ByteLevel too) or a Sequence of ByteLevel
//   post_processor    anything (never applied); truncation and padding null
// Regular expressions run on PCRE2, rewritten where Oniguruma (tokenizers' engine) means something else:
// \s and \S are spelled out as Oniguruma's Unicode White_Space; constructs whose meaning differs (\h, \v,
// \w, \b, ^, $, ...) are refused.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace depthkit {

class HfBpeTokenizer {
 public:
  // Loads a tokenizer.json. Any unsupported or malformed part is refused with depthkit::fail (one line).
  explicit HfBpeTokenizer(const std::string& json_path);
  ~HfBpeTokenizer();
  HfBpeTokenizer(HfBpeTokenizer&&) noexcept;
  HfBpeTokenizer& operator=(HfBpeTokenizer&&) noexcept;

  // Token ids of `text` (any bytes; each maximal invalid UTF-8 subpart is read as U+FFFD, as Python's
  // bytes.decode('utf-8', 'replace') does). recognise_special=false: special added tokens in the text are
  // ordinary text (tokenizers' encode_special_tokens = True; llm.c's encode_ordinary), while non-special
  // added tokens are still split out, as tokenizers does; true: every added token is split out first.
  // Thread-safe; a per-thread word cache speeds it up without changing any output.
  std::vector<int> encode(std::string_view text, bool recognise_special = false) const;
  // The bytes of `ids` through the ByteLevel decoder. Special added tokens are skipped (tokenizers'
  // skip_special_tokens=True), non-special ones give their content (through the same byte map, as
  // tokenizers does), unknown ids are skipped. May end in incomplete UTF-8 (see utf8_lossy).
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;  // 1 + the largest id in model.vocab and added_tokens
  // "<|endoftext|>" (GPT-2) if it is an added token, else "<|end_of_text|>" (Llama-3); else refused.
  int eos_id() const;
  // An added token's content, or a model token as written in the vocab (byte-level alphabet: "Ġthe").
  std::optional<int> token_to_id(const std::string& token) const;

  struct Impl;

 private:
  std::unique_ptr<const Impl> impl_;
};


}  // namespace depthkit
