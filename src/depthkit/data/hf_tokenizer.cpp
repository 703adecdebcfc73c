// Byte-level BPE from a tokenizer.json, following `tokenizers` 0.23 step by step: added tokens are split
// out (two passes, as AddedVocabulary does), each remaining piece goes through the pre-tokenizer steps
// (Split, then ByteLevel), and each pre-token is merged by BPE::merge_word/Word::merge_all. Where the
// Rust code has a quirk that changes ids (dropped unknown bytes, later duplicate merges winning, the
// decoder's fallback to raw UTF-8), it is reproduced, since equality with tokenizers is the contract.
#include "depthkit/data/hf_tokenizer.h"

#include "depthkit/data/utf8.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/json.h"

namespace depthkit {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Regular expressions: tokenizers' patterns (Oniguruma syntax) on PCRE2

namespace {

// Oniguruma's \s on UTF-8 is Unicode White_Space; PCRE2's (with UCP) adds U+180E through \h. Spelled
// out, the two engines agree.
constexpr std::string_view kWhiteSpace =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// tokenizers' Oniguruma has Unicode 16 tables, PCRE2 10.42 Unicode 14: the letters and numbers assigned
// since are added to \p{L} and \p{N} (found by classifying every code point with both engines; none
// left either class).
constexpr std::string_view kLettersSince14 =
    "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}\\x{10D4A}-"
    "\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}"
    "\\x{1138B}-\\x{1138B}\\x{1138E}-\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}-\\x{113B7}\\x{113D1}-"
    "\\x{113D1}\\x{113D3}-\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}-\\x{11F02}\\x{11F04}-\\x{11F10}"
    "\\x{11F12}-\\x{11F33}\\x{1342F}-\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-"
    "\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{18CFF}-\\x{18CFF}\\x{1B132}-\\x{1B132}\\x{1B155}-\\x{1B155}"
    "\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}-"
    "\\x{1E5F0}\\x{2B739}-\\x{2B739}\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}";
constexpr std::string_view kNumbersSince14 =
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}\\x{16130}-"
    "\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}"
    "\\x{1E5F1}-\\x{1E5FA}";

// `pattern` rewritten for PCRE2 with Oniguruma's meaning, or refused (constructs the two engines read
// differently, which no supported tokenizer needs). `where` names the file and key for messages.
std::string rewrite_pattern(std::string_view p, const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    fail(where, " uses ", what, ", which Oniguruma and PCRE2 read differently; depthkit refuses it");
  };
  std::string out;
  bool in_class = false;
  size_t class_body = 0;  // where the class's members start (a ']' there is a literal)
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 == p.size()) fail(where, " ends in a lone backslash");
      const char e = p[++i];
      switch (e) {
        case 's':
          if (in_class) out += kWhiteSpace;
          else out.append("[").append(kWhiteSpace).append("]");
          break;
        case 'S':
          if (in_class) refuse("\\S inside a character class");
          out.append("[^").append(kWhiteSpace).append("]");
          break;
        case 'p':
        case 'P': {
          const std::string_view name = p.substr(i + 1, 3);
          if (name != "{L}" && name != "{N}") refuse(cat("\\", e, p.substr(i + 1, 4), " (only \\p{L} and \\p{N} are supported)"));
          const std::string_view members = name == "{L}" ? kLettersSince14 : kNumbersSince14;
          const std::string cls = cat("\\p", name, members);
          if (e == 'P' && in_class) refuse(cat("\\P", name, " inside a character class"));
          if (in_class) out += cls;
          else out.append(e == 'P' ? "[^" : "[").append(cls).append("]");
          i += 3;
          break;
        }
        case 'u': {  // Oniguruma's \uHHHH is PCRE2's \x{HHHH}
          const std::string_view hex = p.substr(i + 1, 4);
          if (hex.size() != 4 || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string_view::npos)
            refuse("a \\u escape without four hex digits");
          out.append("\\x{").append(hex).append("}");
          i += 4;
          break;
        }
        case 'h': case 'H': case 'v': case 'V': case 'w': case 'W': case 'b': case 'B': case 'R': case 'X':
        case 'K': case 'G': case 'A': case 'z': case 'Z': case 'N': case 'O': case 'y': case 'Y': case 'k':
        case 'g': case 'Q': case 'E': case 'C': case 'd': case 'D':  // \d: PCRE2's Unicode 14 digits
          refuse(cat("\\", e));
          break;
        default:
          if (e >= '1' && e <= '9') refuse("a back-reference");
          out += '\\';
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[') refuse("a nested character class");
      if (c == ']' && i > class_body) in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_body = i + 1;
      if (class_body < p.size() && p[class_body] == '^') ++class_body;
    } else if (c == '^' || c == '$') {
      refuse(cat("the anchor ", c));  // line anchors in Oniguruma, subject anchors in PCRE2
    } else if (c == '(' && i + 1 < p.size() && p[i + 1] == '?') {
      // Inline options: Oniguruma's (?m) is PCRE2's (?s), (?x) differs in detail; only (?i) is safe.
      size_t k = i + 2;
      while (k < p.size() && (std::isalpha(static_cast<unsigned char>(p[k])) || p[k] == '-')) ++k;
      if (k > i + 2 && k < p.size() && (p[k] == ':' || p[k] == ')')) {
        for (size_t f = i + 2; f < k; ++f)
          if (p[f] != 'i' && p[f] != '-') refuse(cat("the inline option (?", p.substr(i + 2, k - i - 2), ")"));
      }
    }
    out += c;
  }
  if (in_class) fail(where, " has an unterminated character class");
  return out;
}

// What a thread needs to run any pattern: match data (only the whole match is read), and a JIT stack
// large enough for megabyte-long runs.
struct PcreThread {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
  PcreThread() {
    if (!data || !context || !stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~PcreThread() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

PcreThread& pcre_thread() {
  thread_local PcreThread t;
  return t;
}

std::string pcre_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

class Regex {
 public:
  // `literal`: the pattern is a plain string (Split's {"String": ...}).
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    const std::string src = literal ? pattern : rewrite_pattern(pattern, where);
    pcre2_compile_context* cc = pcre2_compile_context_create(nullptr);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    int err = 0;
    PCRE2_SIZE at = 0;
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);  // LITERAL refuses UCP
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(src.data()), src.size(), options, &err, &at, cc);
    pcre2_compile_context_free(cc);
    if (!code_) fail(where, " does not compile at offset ", at, ": ", pcre_message(err));
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without a JIT, pcre2_match interprets
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls f(start, end) for each match in `s` as Oniguruma's find_iter yields them (the onig crate):
  // an empty match right where the previous match ended is skipped by moving on one character.
  template <class F>
  void find_iter(std::string_view s, F&& f) const {
    PcreThread& t = pcre_thread();
    size_t last_end = 0;
    bool have_last = false;
    size_t last_match_end = 0;
    while (last_end <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), last_end,
                                 PCRE2_NO_UTF_CHECK, t.data, t.context);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) fail("tokenizer regex failed: ", pcre_message(rc));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(t.data);
      const size_t a = ov[0], b = ov[1];
      if (a == b && have_last && last_match_end == b) {
        if (last_end >= s.size()) return;
        size_t bad = 0;
        last_end += std::max<size_t>(1, utf8_step(s, last_end, bad));
        continue;
      }
      last_end = b;
      last_match_end = b;
      have_last = true;
      f(a, b);
    }
  }

 private:
  pcre2_code* code_ = nullptr;
};

constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// GPT-2's byte→character map: printable Latin-1 bytes are themselves, the rest 256, 257, ... in order.
std::array<uint32_t, 256> byte_to_char() {
  std::array<uint32_t, 256> m{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    m[b] = printable ? b : 256 + n++;
  }
  return m;
}

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct Step {
  bool byte_level = false;
  // Split
  std::shared_ptr<const Regex> regex;
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
};

// Added tokens as a byte trie, matched leftmost-longest like tokenizers' aho-corasick automaton.
struct Trie {
  struct Node {
    int token = -1;  // index into the added tokens
    std::vector<std::pair<unsigned char, int>> kids;
  };
  std::vector<Node> nodes{1};
  std::array<bool, 256> first{};
  bool empty() const { return nodes.size() == 1; }
  void add(std::string_view s, int token) {
    int n = 0;
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      auto& kids = nodes[n].kids;
      auto it = std::find_if(kids.begin(), kids.end(), [c](const auto& k) { return k.first == c; });
      if (it == kids.end()) {
        nodes.emplace_back();
        nodes[n].kids.emplace_back(c, int(nodes.size()) - 1);
        n = int(nodes.size()) - 1;
      } else {
        n = it->second;
      }
    }
    nodes[n].token = token;
    first[static_cast<unsigned char>(s[0])] = true;
  }
  // The longest token starting at s[i]: (token, length), or token -1.
  std::pair<int, size_t> longest(std::string_view s, size_t i) const {
    int n = 0, best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < s.size(); ++k) {
      const auto c = static_cast<unsigned char>(s[k]);
      const auto& kids = nodes[n].kids;
      auto it = std::find_if(kids.begin(), kids.end(), [c](const auto& x) { return x.first == c; });
      if (it == kids.end()) break;
      n = it->second;
      if (nodes[n].token >= 0) best = nodes[n].token, best_len = k + 1 - i;
    }
    return {best, best_len};
  }
};

// (a, b) → (rank, merged id), open addressing: the lookup is the inner loop of BPE.
class MergeMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
  }
  void put(int a, int b, int rank, int id) {  // a later merge of the same pair replaces the earlier one
    const uint64_t k = key(a, b);
    for (size_t i = hash(k);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.rank < 0 || s.key == k) {
        s = {k, rank, id};
        return;
      }
    }
  }
  // Rank and merged id of (a, b); rank -1 when they do not merge.
  std::pair<int, int> get(int a, int b) const {
    const uint64_t k = key(a, b);
    for (size_t i = hash(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.rank < 0) return {-1, -1};
      if (s.key == k) return {s.rank, s.id};
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int rank = -1, id = -1;
  };
  static uint64_t key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t hash(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

struct Added {
  std::string content;
  int id = 0;
  bool special = false;
};

// Words up to this many bytes are cached (tokenizers' MAX_LENGTH), the first kCacheEntries a thread
// meets.
constexpr size_t kCacheWordBytes = 256;
constexpr size_t kCacheEntries = size_t(1) << 17;

struct WordCache {
  uint64_t owner = 0;  // the tokenizer's serial number (an address could be reused)
  std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> words;
};

std::atomic<uint64_t> g_serial{0};

}  // namespace

// ---------------------------------------------------------------------------------------------

struct HfBpeTokenizer::Impl {
  std::string path;
  uint64_t serial = ++g_serial;
  std::vector<Step> steps;  // the pre-tokenizer, ByteLevel last
  StringMap vocab;          // model.vocab as written (byte-level alphabet)
  StringMap vocab_bytes;    // the same ids keyed by their bytes (tokens wholly in the alphabet)
  std::array<int, 256> byte_id{};  // each byte's own token, -1 if the vocab lacks it
  MergeMap merges;
  bool ignore_merges = false;
  int unk_id = -1;
  bool fuse_unk = false;
  std::vector<Added> added;
  StringMap added_ids;  // content → id
  Trie raw_trie, normalized_trie;  // tokens matched before / after the (null) normalizer
  std::vector<std::string> id_bytes;  // what decode gives for each id
  std::vector<uint8_t> id_kind;       // 0 no such id, 1 text, 2 special (skipped by decode)
  int vocab_size = 0;

  void load(const json& root);
  void load_pre_tokenizer(const json& pt, const std::string& key);
  void load_model(const json& m);
  void load_added(const json& a);

  void encode_piece(std::string_view s, size_t step, std::vector<int>& out) const;
  void bpe(std::string_view word, std::vector<int>& out) const;
  void merge_word(std::string_view word, std::vector<int>& out) const;
};

namespace {

std::string type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  return "a number";
}

// Accessors that refuse, naming the file and key, anything not of the expected type.
struct Reader {
  const std::string& path;
  [[noreturn]] void bad(const std::string& key, const std::string& what) const { fail(path, ": ", key, " ", what); }
  const json& get(const json& obj, const char* name, const std::string& key) const {
    auto it = obj.find(name);
    if (it == obj.end()) bad(key, "is missing");
    return *it;
  }
  const json* find(const json& obj, const char* name) const {
    auto it = obj.find(name);
    return it == obj.end() ? nullptr : &*it;
  }
  const std::string& str(const json& v, const std::string& key) const {
    if (!v.is_string()) bad(key, cat("is ", type_name(v), ", not a string"));
    return v.get_ref<const std::string&>();
  }
  bool boolean(const json& v, const std::string& key) const {
    if (!v.is_boolean()) bad(key, cat("is ", type_name(v), ", not true or false"));
    return v.get<bool>();
  }
  // An optional flag: absent or null reads as `dflt`.
  bool flag(const json& obj, const char* name, const std::string& key, bool dflt) const {
    const json* v = find(obj, name);
    return !v || v->is_null() ? dflt : boolean(*v, key);
  }
  const json& object(const json& v, const std::string& key) const {
    if (!v.is_object()) bad(key, cat("is ", type_name(v), ", not an object"));
    return v;
  }
  const json& array(const json& v, const std::string& key) const {
    if (!v.is_array()) bad(key, cat("is ", type_name(v), ", not an array"));
    return v;
  }
  int id(const json& v, const std::string& key) const {
    constexpr int64_t kMax = int64_t(1) << 24;  // far above any vocabulary; bounds the id tables
    if (!v.is_number_integer()) bad(key, cat("is ", json_excerpt(v), ", not a token id"));
    if (v.is_number_unsigned() ? v.get<uint64_t>() >= uint64_t(kMax) : (v.get<int64_t>() < 0 || v.get<int64_t>() >= kMax))
      bad(key, cat("is ", v.dump(), ", outside [0, ", kMax, ")"));
    return int(v.get<int64_t>());
  }
  const std::string& type(const json& obj, const std::string& key) const {
    object(obj, key);
    return str(get(obj, "type", key + ".type"), key + ".type");
  }
};

std::string quote_token(std::string_view s) { return cat('"', printable(s.substr(0, 60)), s.size() > 60 ? "...\"" : "\""); }

}  // namespace

void HfBpeTokenizer::Impl::load_pre_tokenizer(const json& pt, const std::string& key) {
  const Reader r{path};
  const std::string& type = r.type(pt, key);
  if (!steps.empty() && steps.back().byte_level)
    fail(path, ": ", key, " follows the ByteLevel pre-tokenizer; depthkit needs ByteLevel last");
  if (type == "Sequence") {
    const json& list = r.array(r.get(pt, "pretokenizers", key + ".pretokenizers"), key + ".pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) load_pre_tokenizer(list[i], cat(key, ".pretokenizers[", i, "]"));
  } else if (type == "ByteLevel") {
    Step s;
    s.byte_level = true;
    s.add_prefix_space = r.boolean(r.get(pt, "add_prefix_space", key + ".add_prefix_space"), key + ".add_prefix_space");
    s.use_regex = r.flag(pt, "use_regex", key + ".use_regex", true);
    if (s.use_regex) s.regex = std::make_shared<Regex>(kGpt2Pattern, false, path + ": the GPT-2 pattern");
    steps.push_back(std::move(s));
  } else if (type == "Split") {
    Step s;
    const json& pattern = r.object(r.get(pt, "pattern", key + ".pattern"), key + ".pattern");
    if (pattern.size() != 1 || !(pattern.contains("Regex") || pattern.contains("String")))
      fail(path, ": ", key, ".pattern is not {\"Regex\": ...} or {\"String\": ...}");
    const bool literal = pattern.contains("String");
    const std::string pkey = key + (literal ? ".pattern.String" : ".pattern.Regex");
    const std::string& p = r.str(pattern.begin().value(), pkey);
    if (p.empty()) fail(path, ": ", pkey, " is empty");
    s.regex = std::make_shared<Regex>(p, literal, cat(path, ": ", pkey));
    const std::string& b = r.str(r.get(pt, "behavior", key + ".behavior"), key + ".behavior");
    if (b == "Removed") s.behavior = Behavior::removed;
    else if (b == "Isolated") s.behavior = Behavior::isolated;
    else if (b == "MergedWithPrevious") s.behavior = Behavior::merged_with_previous;
    else if (b == "MergedWithNext") s.behavior = Behavior::merged_with_next;
    else if (b == "Contiguous") s.behavior = Behavior::contiguous;
    else fail(path, ": ", key, ".behavior is ", quote_token(b), "; tokenizers knows Removed, Isolated, MergedWithPrevious, "
              "MergedWithNext, Contiguous");
    s.invert = r.flag(pt, "invert", key + ".invert", false);
    steps.push_back(std::move(s));
  } else {
    fail(path, ": ", key, ".type is ", quote_token(type), "; depthkit runs ByteLevel, or a Sequence of Split steps "
         "ending in ByteLevel");
  }
}

void HfBpeTokenizer::Impl::load_model(const json& m) {
  const Reader r{path};
  const std::string& type = r.type(m, "model");
  if (type != "BPE") fail(path, ": model.type is ", quote_token(type), "; depthkit runs byte-level BPE (model.type \"BPE\")");
  if (const json* d = r.find(m, "dropout"); d && !d->is_null())
    fail(path, ": model.dropout is ", json_excerpt(*d), "; depthkit encodes deterministically (null only)");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = r.find(m, k); v && !v->is_null() && !(v->is_string() && v->get_ref<const std::string&>().empty()))
      fail(path, ": model.", k, " is ", json_excerpt(*v), "; byte-level BPE has none (null or \"\")");
  if (r.flag(m, "byte_fallback", "model.byte_fallback", false))
    fail(path, ": model.byte_fallback is true; byte-level BPE needs none (false only)");
  ignore_merges = r.flag(m, "ignore_merges", "model.ignore_merges", false);
  fuse_unk = r.flag(m, "fuse_unk", "model.fuse_unk", false);

  const json& v = r.object(r.get(m, "vocab", "model.vocab"), "model.vocab");
  const auto to_char = byte_to_char();
  std::unordered_map<uint32_t, unsigned char> to_byte;
  for (int b = 0; b < 256; ++b) to_byte[to_char[b]] = static_cast<unsigned char>(b);
  std::vector<std::string> token_of;  // id → token, to name duplicates
  vocab.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string& tok = it.key();
    const std::string key = cat("model.vocab[", quote_token(tok), "]");
    const int id = r.id(it.value(), key);
    if (tok.empty()) fail(path, ": model.vocab has an empty token (id ", id, ")");
    if (size_t(id) >= token_of.size()) token_of.resize(size_t(id) + 1), id_bytes.resize(size_t(id) + 1);
    if (!token_of[id].empty()) fail(path, ": ", key, " has id ", id, ", already the id of ", quote_token(token_of[id]));
    token_of[id] = tok;
    vocab.emplace(tok, id);
    // The token's bytes: each character through the inverse byte map; a token with a character outside
    // it decodes as its own UTF-8 (tokenizers' ByteLevel decoder) and can never be produced by merging.
    std::string bytes;
    bool in_alphabet = true;
    for (size_t i = 0, bad = 0; i < tok.size();) {
      const size_t n = utf8_step(tok, i, bad);
      if (n == 0) fail(path, ": ", key, " is not UTF-8");
      const auto found = to_byte.find(utf8_code(tok, i, n));
      if (found == to_byte.end()) in_alphabet = false;
      else bytes += char(found->second);
      i += n;
    }
    if (in_alphabet) vocab_bytes.emplace(bytes, id);
    id_bytes[id] = in_alphabet ? bytes : tok;
  }
  id_kind.assign(id_bytes.size(), 0);
  for (size_t i = 0; i < token_of.size(); ++i) id_kind[i] = token_of[i].empty() ? 0 : 1;
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_bytes.find(std::string(1, char(b)));
    byte_id[b] = it == vocab_bytes.end() ? -1 : it->second;
  }

  if (const json* u = r.find(m, "unk_token"); u && !u->is_null()) {
    const std::string& unk = r.str(*u, "model.unk_token");
    auto it = vocab.find(unk);
    if (it == vocab.end()) fail(path, ": model.unk_token ", quote_token(unk), " is not in model.vocab");
    unk_id = it->second;
  }

  const json& ml = r.array(r.get(m, "merges", "model.merges"), "model.merges");
  merges.reserve(ml.size());
  int rank = 0;
  for (size_t i = 0; i < ml.size(); ++i) {
    const std::string key = cat("model.merges[", i, "]");
    std::string a, b;
    if (ml[i].is_string()) {  // the legacy "a b" form; "#version" lines are comments, as in tokenizers
      const std::string& line = ml[i].get_ref<const std::string&>();
      if (line.rfind("#version", 0) == 0) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        fail(path, ": ", key, " is ", quote_token(line), ", not two tokens separated by one space");
      a = line.substr(0, sp), b = line.substr(sp + 1);
    } else if (ml[i].is_array() && ml[i].size() == 2 && ml[i][0].is_string() && ml[i][1].is_string()) {
      a = ml[i][0].get<std::string>(), b = ml[i][1].get<std::string>();
    } else {
      fail(path, ": ", key, " is ", json_excerpt(ml[i]), ", not \"a b\" or [\"a\", \"b\"]");
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end()) fail(path, ": ", key, " names ", quote_token(a), ", which is not in model.vocab");
    if (ib == vocab.end()) fail(path, ": ", key, " names ", quote_token(b), ", which is not in model.vocab");
    if (iab == vocab.end()) fail(path, ": ", key, " makes ", quote_token(a + b), ", which is not in model.vocab");
    merges.put(ia->second, ib->second, rank++, iab->second);
  }
}

void HfBpeTokenizer::Impl::load_added(const json& list) {
  const Reader r{path};
  r.array(list, "added_tokens");
  // tokenizers ignores the ids written here and numbers the tokens itself (a token in the vocab keeps its
  // id, a new one takes the next free id after the vocab); a file whose ids disagree is refused.
  const int model_size = int(vocab.size());
  int max_added = -1;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string key = cat("added_tokens[", i, "]");
    const json& t = r.object(list[i], key);
    Added a;
    a.content = r.str(r.get(t, "content", key + ".content"), key + ".content");
    const std::string name = cat(key, " (", quote_token(a.content), ")");
    if (a.content.empty()) fail(path, ": ", key, ".content is empty");
    if (!valid_utf8(a.content)) fail(path, ": ", name, " is not UTF-8");
    a.id = r.id(r.get(t, "id", key + ".id"), key + ".id");
    a.special = r.flag(t, "special", key + ".special", false);
    for (const char* f : {"lstrip", "rstrip", "single_word"})
      if (r.flag(t, f, cat(key, ".", f), false)) fail(path, ": ", name, " has ", f, " true; depthkit supports false only");
    const bool normalized = r.flag(t, "normalized", key + ".normalized", !a.special);
    if (added_ids.count(a.content)) fail(path, ": ", name, " repeats an earlier added token");
    int expect;
    if (auto it = vocab.find(a.content); it != vocab.end()) expect = it->second;
    else if (max_added < 0) expect = model_size;
    else expect = (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
    if (a.id != expect)
      fail(path, ": ", key, ".id is ", a.id, " but tokenizers numbers ", quote_token(a.content), " ", expect);
    max_added = std::max(max_added, a.id);
    if (size_t(a.id) >= id_bytes.size()) id_bytes.resize(size_t(a.id) + 1), id_kind.resize(size_t(a.id) + 1, 0);
    added_ids.emplace(a.content, a.id);
    (normalized ? normalized_trie : raw_trie).add(a.content, int(added.size()));
    added.push_back(std::move(a));
  }
}

void HfBpeTokenizer::Impl::load(const json& root) {
  const Reader r{path};
  r.object(root, "the top level");
  for (const char* k : {"truncation", "padding"})
    if (const json* v = r.find(root, k); v && !v->is_null())
      fail(path, ": ", k, " is ", json_excerpt(*v), "; depthkit encodes without ", k, " (null only)");
  if (const json* n = r.find(root, "normalizer"); n && !n->is_null()) {
    const std::string& type = r.type(*n, "normalizer");
    const bool empty_sequence = type == "Sequence" && n->contains("normalizers") && (*n)["normalizers"].is_array() &&
                                (*n)["normalizers"].empty();
    if (!empty_sequence) fail(path, ": normalizer.type is ", quote_token(type), "; depthkit runs none (normalizer null)");
  }
  const json* pt = r.find(root, "pre_tokenizer");
  if (!pt || pt->is_null()) fail(path, ": pre_tokenizer is null; byte-level BPE needs ByteLevel");
  load_pre_tokenizer(*pt, "pre_tokenizer");
  if (steps.empty() || !steps.back().byte_level)
    fail(path, ": pre_tokenizer has no ByteLevel step; depthkit needs one, last");

  if (const json* d = r.find(root, "decoder"); d && !d->is_null()) {
    const std::string& type = r.type(*d, "decoder");
    bool ok = type == "ByteLevel";
    if (type == "Sequence") {
      const json& list = r.array(r.get(*d, "decoders", "decoder.decoders"), "decoder.decoders");
      ok = true;
      for (const json& x : list) ok = ok && x.is_object() && x.value("type", "") == "ByteLevel";
    }
    if (!ok) fail(path, ": decoder.type is ", quote_token(type), "; depthkit decodes ByteLevel only");
  }
  // The post-processor is read by nobody: encode adds no template (see the header).

  load_model(r.get(root, "model", "model"));
  if (const json* a = r.find(root, "added_tokens"); a && !a->is_null()) load_added(*a);

  // What decode gives per id: tokenizers looks an id up among the added tokens first, then the model,
  // and skips it when that string is a special token's content.
  std::unordered_set<std::string> specials;
  for (const Added& a : added)
    if (a.special) specials.insert(a.content);
  std::vector<std::string> model_token(id_bytes.size());
  for (const auto& [tok, id] : vocab) model_token[id] = tok;
  const auto to_char = byte_to_char();
  std::unordered_map<uint32_t, unsigned char> to_byte;
  for (int b = 0; b < 256; ++b) to_byte[to_char[b]] = static_cast<unsigned char>(b);
  for (const Added& a : added) {
    model_token[a.id] = a.content;
    std::string bytes;
    bool in_alphabet = true;
    for (size_t i = 0, bad = 0; i < a.content.size();) {
      const size_t n = utf8_step(a.content, i, bad);
      const auto found = to_byte.find(utf8_code(a.content, i, n));
      if (found == to_byte.end()) in_alphabet = false;
      else bytes += char(found->second);
      i += n;
    }
    id_bytes[a.id] = in_alphabet ? bytes : a.content;
    id_kind[a.id] = 1;
  }
  for (size_t id = 0; id < id_kind.size(); ++id)
    if (id_kind[id] && specials.count(model_token[id])) id_kind[id] = 2;
  vocab_size = int(id_bytes.size());
}

// ---------------------------------------------------------------------------------------------
// Encoding

// tokenizers' BPE::merge_word + Word::merge_all: symbols in a linked list, candidate merges in a heap
// ordered by (rank, position); a popped candidate whose pair has changed since is stale and skipped.
void HfBpeTokenizer::Impl::merge_word(std::string_view word, std::vector<int>& out) const {
  struct Symbol {
    int c, prev, next, len;
  };
  struct Merge {
    int pos, rank, id;
  };
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Merge> heap;
  sym.clear();
  heap.clear();
  const auto add = [&](int c, int len) {
    const int n = int(sym.size());
    if (n) sym.back().next = n;
    sym.push_back({c, n - 1, -1, len});
  };
  // A byte missing from the vocab becomes the unknown token, or vanishes when there is none.
  int unk_len = 0;
  for (const char ch : word) {
    const int id = byte_id[static_cast<unsigned char>(ch)];
    if (id >= 0) {
      if (unk_len) add(unk_id, unk_len), unk_len = 0;
      add(id, 1);
    } else if (unk_id >= 0) {
      if (unk_len && !fuse_unk) add(unk_id, unk_len), unk_len = 0;
      unk_len += 1;
    }
  }
  if (unk_len) add(unk_id, unk_len);

  const auto worse = [](const Merge& a, const Merge& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    const auto [rank, id] = merges.get(sym[i].c, sym[i + 1].c);
    if (rank >= 0) heap.push_back({int(i), rank, id});
  }
  std::make_heap(heap.begin(), heap.end(), worse);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Merge top = heap.back();
    heap.pop_back();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int next_pos = cur.next;
    const Symbol right = sym[next_pos];
    const auto [rank, id] = merges.get(cur.c, right.c);
    if (rank < 0 || id != top.id) continue;  // stale
    cur.c = top.id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      const auto [r2, id2] = merges.get(sym[cur.prev].c, cur.c);
      if (r2 >= 0) heap.push_back({cur.prev, r2, id2}), std::push_heap(heap.begin(), heap.end(), worse);
    }
    if (cur.next >= 0) {
      const auto [r2, id2] = merges.get(cur.c, sym[cur.next].c);
      if (r2 >= 0) heap.push_back({top.pos, r2, id2}), std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  for (const Symbol& s : sym)
    if (s.len) out.push_back(s.c);
}

void HfBpeTokenizer::Impl::bpe(std::string_view word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {  // a whole word in the vocab is one token, whatever the merges would make of it
    if (auto it = vocab_bytes.find(word); it != vocab_bytes.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() >= kCacheWordBytes) {
    merge_word(word, out);
    return;
  }
  thread_local WordCache cache;
  if (cache.owner != serial) cache.words.clear(), cache.owner = serial;
  if (auto it = cache.words.find(word); it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t from = out.size();
  merge_word(word, out);
  // Full, it keeps what it has (tokenizers' policy): the words seen first are a corpus's most
  // frequent ones, where emptying it would cost a warm-up each time it fills.
  if (cache.words.size() < kCacheEntries)
    cache.words.emplace(std::string(word), std::vector<int>(out.begin() + from, out.end()));
}

// The pre-tokenizer from step `step` on, then BPE, on one piece of text (no added token in it).
void HfBpeTokenizer::Impl::encode_piece(std::string_view s, size_t step, std::vector<int>& out) const {
  if (s.empty()) return;  // tokenizers drops empty pieces between steps
  const Step& st = steps[step];
  if (st.byte_level) {
    std::string spaced;
    if (st.add_prefix_space && s.front() != ' ') {
      spaced.reserve(s.size() + 1);
      spaced.append(" ").append(s);
      s = spaced;
    }
    if (!st.use_regex) return bpe(s, out);
    size_t prev = 0;  // Isolated: the gaps between matches are pieces too
    st.regex->find_iter(s, [&](size_t a, size_t b) {
      if (a > prev) bpe(s.substr(prev, a - prev), out);
      bpe(s.substr(a, b - a), out);
      prev = b;
    });
    if (prev < s.size()) bpe(s.substr(prev), out);
    return;
  }
  // Split: NormalizedString::split over Pattern::find_matches (gaps and matches, in order).
  struct Part {
    size_t a, b;
    bool match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  st.regex->find_iter(s, [&](size_t a, size_t b) {
    if (a != prev) parts.push_back({prev, a, false});
    parts.push_back({a, b, true});
    prev = b;
  });
  if (prev != s.size()) parts.push_back({prev, s.size(), false});
  if (st.invert)
    for (Part& p : parts) p.match = !p.match;
  std::vector<std::pair<size_t, size_t>> keep;
  bool previous_match = false;
  switch (st.behavior) {
    case Behavior::isolated:
      for (const Part& p : parts) keep.emplace_back(p.a, p.b);
      break;
    case Behavior::removed:
      for (const Part& p : parts)
        if (!p.match) keep.emplace_back(p.a, p.b);
      break;
    case Behavior::contiguous:
      for (const Part& p : parts) {
        if (p.match == previous_match && !keep.empty()) keep.back().second = p.b;
        else keep.emplace_back(p.a, p.b);
        previous_match = p.match;
      }
      break;
    case Behavior::merged_with_previous:
      for (const Part& p : parts) {
        if (p.match && !previous_match && !keep.empty()) keep.back().second = p.b;
        else keep.emplace_back(p.a, p.b);
        previous_match = p.match;
      }
      break;
    case Behavior::merged_with_next:
      for (size_t i = parts.size(); i-- > 0;) {
        const Part& p = parts[i];
        if (p.match && !previous_match && !keep.empty()) keep.back().first = p.a;
        else keep.emplace_back(p.a, p.b);
        previous_match = p.match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
  }
  for (const auto& [a, b] : keep) encode_piece(s.substr(a, b - a), step + 1, out);
}

// ---------------------------------------------------------------------------------------------

HfBpeTokenizer::HfBpeTokenizer(const std::string& json_path) {
  auto impl = std::make_unique<Impl>();
  impl->path = json_path;
  const std::string text = read_file(json_path);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(json_path, ": not JSON (", one_line(e), ")");
  }
  impl->load(root);
  impl_ = std::move(impl);
}

HfBpeTokenizer::~HfBpeTokenizer() = default;
HfBpeTokenizer::HfBpeTokenizer(HfBpeTokenizer&&) noexcept = default;
HfBpeTokenizer& HfBpeTokenizer::operator=(HfBpeTokenizer&&) noexcept = default;

std::vector<int> HfBpeTokenizer::encode(std::string_view text, bool recognise_special) const {
  const Impl& m = *impl_;
  std::string clean;
  if (!valid_utf8(text)) clean = utf8_lossy(text), text = clean;
  std::vector<int> out;
  out.reserve(text.size() / 3 + 1);
  // tokenizers' AddedVocabulary::find_matches: leftmost-longest; a special token read as text
  // (encode_special_tokens) is still consumed by the automaton, so nothing inside it matches.
  const auto split = [&](std::string_view s, const Trie& trie, const auto& gap) {
    if (trie.empty()) return gap(s);
    size_t start = 0, i = 0;
    while (i < s.size()) {
      if (!trie.first[static_cast<unsigned char>(s[i])]) {
        ++i;
        continue;
      }
      const auto [tok, len] = trie.longest(s, i);
      if (tok < 0) {
        ++i;
        continue;
      }
      if (!recognise_special && m.added[tok].special) {
        i += len;
        continue;
      }
      if (i > start) gap(s.substr(start, i - start));
      out.push_back(m.added[tok].id);
      start = i = i + len;
    }
    if (start < s.size()) gap(s.substr(start));
  };
  const auto text_piece = [&](std::string_view s) { m.encode_piece(s, 0, out); };
  const auto raw_gap = [&](std::string_view s) { split(s, m.normalized_trie, text_piece); };
  split(text, m.raw_trie, raw_gap);
  return out;
}

std::string HfBpeTokenizer::decode(const std::vector<int>& ids) const {
  const Impl& m = *impl_;
  std::string out;
  for (const int id : ids)
    if (id >= 0 && id < m.vocab_size && m.id_kind[id] == 1) out += m.id_bytes[id];
  return out;
}

int HfBpeTokenizer::vocab_size() const { return impl_->vocab_size; }

int HfBpeTokenizer::eos_id() const {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>"})
    if (auto it = impl_->added_ids.find(name); it != impl_->added_ids.end()) return it->second;
  fail(impl_->path, ": added_tokens has neither \"<|endoftext|>\" (GPT-2) nor \"<|end_of_text|>\" (Llama-3), "
       "the end-of-document token");
}

std::optional<int> HfBpeTokenizer::token_to_id(const std::string& token) const {
  if (auto it = impl_->added_ids.find(token); it != impl_->added_ids.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

}  // namespace depthkit
