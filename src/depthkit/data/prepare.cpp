#include "depthkit/data/prepare.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/data/shards.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {

// The documents the inputs name, each once: a regular file is one document, a directory gives every
// regular file below it (in name order). Anything else is refused by name, never skipped: a FIFO,
// socket or device, a symbolic link to nothing, a link to a directory inside an input directory
// (not followed: name it as an input of its own), and a document reached twice ("--input X X", a
// directory and a file inside it).
std::vector<fs::path> list_documents(const std::vector<std::string>& inputs) {
  std::vector<fs::path> docs;
  std::map<fs::path, std::string> seen;  // canonical path → the input that named it
  auto add = [&](const fs::path& doc, const std::string& input) {
    const fs::path key = fs::canonical(doc);
    if (auto [it, fresh] = seen.emplace(key, input); !fresh)
      fail(doc.string(), ": named twice (by --input '", it->second, "' and by '", input,
           "'); each document is read once: drop one of them");
    docs.push_back(doc);
  };
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_regular_file(in, ec)) {
      add(in, in);
    } else if (fs::is_directory(in, ec)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(in); it != fs::recursive_directory_iterator(); ++it) {
        const fs::directory_entry& e = *it;
        if (e.is_symlink() && e.is_directory())
          fail(e.path().string(), ": a symbolic link to a directory inside --input '", in,
               "' (not followed; name it as an --input of its own)");
        if (e.is_directory()) continue;
        if (!e.is_regular_file())
          fail(e.path().string(), ": is ", path_kind(e.path()), " inside --input '", in,
               "', not a document (data prepare reads regular files; remove it, or name the files to read)");
        found.push_back(e.path());
      }
      if (found.empty()) fail(in, ": input directory holds no files");
      std::sort(found.begin(), found.end());
      for (const fs::path& doc : found) add(doc, in);
    } else {
      const std::string kind = path_kind(in);
      if (kind == "nothing") fail(in, ": input not found");
      fail(in, ": is ", kind, ", not a document or a directory of documents");
    }
  }
  if (docs.empty()) fail("data prepare: no --input given");
  return docs;
}

// The output must stay clear of the inputs: never one of them, never holding one (--force would
// remove it), never inside an input directory (the next prepare would read its shards as
// documents).
void check_output_apart(const fs::path& out, const std::vector<std::string>& inputs) {
  for (const auto& in : inputs) {
    if (is_within(in, out))
      fail("--out ", out.string(), ": holds the input '", in, "'; data prepare never writes where its inputs are "
           "(choose another --out)");
    if (fs::is_directory(in) && is_within(out, in))
      fail("--out ", out.string(), ": lies inside the input directory '", in,
           "', whose files are all documents (choose an --out outside it)");
  }
}

// What data prepare writes into its output directory: meta.json, tokenizer.model and the shards
// meta.json lists (for a directory without such a meta.json, nothing). --force replaces a
// directory that holds nothing else.
std::set<std::string> prepared_files(const fs::path& out) {
  const fs::path meta_path = out / "meta.json";
  nlohmann::json meta;
  if (fs::is_regular_file(meta_path)) meta = nlohmann::json::parse(read_file(meta_path, 64u << 20), nullptr, false);
  const bool ours = meta.is_object() && meta.contains("format") && meta["format"] == "llm.c token shards" &&
                    meta.contains("splits") && meta["splits"].is_object();
  if (!ours) return {};
  std::set<std::string> files = {"meta.json", "tokenizer.model"};
  for (const auto& [split, info] : meta["splits"].items())
    if (info.is_object() && info.contains("shards") && info["shards"].is_array())
      for (const auto& name : info["shards"])
        if (name.is_string()) files.insert(name.get<std::string>());
  return files;
}

// Writes one split's tokens as shards of at most shard_tokens; returns the shard names.
std::vector<std::string> write_split(const fs::path& dir, const std::string& split,
                                     const std::vector<uint32_t>& tokens, int64_t shard_tokens,
                                     int64_t vocab_size) {
  std::vector<std::string> names;
  for (int64_t start = 0, k = 0; start < int64_t(tokens.size()); start += shard_tokens, ++k) {
    int64_t end = std::min<int64_t>(tokens.size(), start + shard_tokens);
    char name[64];
    std::snprintf(name, sizeof name, "%s_%06lld.bin", split.c_str(), (long long)k);
    write_shard((dir / name).string(), std::vector<uint32_t>(tokens.begin() + start, tokens.begin() + end),
                vocab_size);
    names.push_back(name);
  }
  return names;
}

// In nats per token: the train split's unigram entropy, and the val split's cross-entropy under
// the train split's unigram model (add-one smoothing).
std::pair<double, double> unigram_entropies(const std::vector<uint32_t>& train, const std::vector<uint32_t>& val,
                                            int64_t vocab_size) {
  std::vector<int64_t> counts(vocab_size, 0);
  for (uint32_t t : train) ++counts[t];
  double entropy = 0;
  for (int64_t c : counts)
    if (c > 0) {
      const double p = double(c) / double(train.size());
      entropy -= p * std::log(p);
    }
  double val_ce = 0;
  for (uint32_t t : val) val_ce -= std::log((double(counts[t]) + 1) / (double(train.size()) + double(vocab_size)));
  val_ce /= double(std::max<size_t>(1, val.size()));
  return {entropy, val_ce};
}

}  // namespace

PrepareResult prepare_data(const PrepareOptions& opt) {
  if (opt.out_dir.empty()) fail("data prepare: --out is required");
  if (!(opt.val_fraction > 0 && opt.val_fraction < 1))
    fail("--val-fraction must be in (0, 1), got ", opt.val_fraction);
  if (opt.shard_tokens < 1024) fail("--shard-tokens must be >= 1024, got ", opt.shard_tokens);
  const fs::path out = output_directory(opt.out_dir, "--out");
  check_output_apart(out, opt.inputs);
  std::error_code ec;
  std::set<std::string> replaced;  // what --force may remove from an existing output
  if (fs::exists(fs::symlink_status(out, ec))) {
    if (!fs::is_directory(out)) fail(out.string(), ": is ", path_kind(out), ", not an output directory");
    if (!opt.force) fail(out.string(), ": output directory already exists (pass --force to replace it)");
    replaced = prepared_files(out);
    if (replaced.empty() && !fs::is_empty(out, ec))
      fail(out.string(), ": --force replaces only a directory that data prepare wrote, and it has no meta.json of "
           "data prepare's (choose another --out, or empty it yourself)");
  }
  const OwnedNames owned = [&](const std::string& name) { return replaced.count(name) > 0; };
  if (!replaced.empty())
    check_only_owned(out, owned, "what data prepare wrote there (meta.json, tokenizer.model and the shards meta.json lists)");

  auto paths = list_documents(opt.inputs);
  std::vector<std::string> texts;
  texts.reserve(paths.size());
  int64_t bytes = 0;
  for (const auto& p : paths) {
    texts.push_back(read_file(p));
    bytes += texts.back().size();
  }
  // Deterministic split by document: a seeded Fisher–Yates permutation, the first share is val.
  const int64_t n = texts.size();
  if (n < 2) fail("data prepare: --input names ", n, " document; the train/val split needs at least 2");
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = opt.seed ^ 0xd1b54a32d192ed03ull;
  for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[splitmix64(state) % uint64_t(i + 1)]);
  const int64_t n_val = std::clamp<int64_t>(std::llround(opt.val_fraction * n), 1, n - 1);
  std::vector<bool> is_val(n, false);
  for (int64_t i = 0; i < n_val; ++i) is_val[order[i]] = true;

  // Everything is built in a fresh sibling folder and renamed into place at the end; a failure
  // removes that folder and nothing else.
  TemporaryDirectory building(make_sibling_dir(out, "partial"));
  const fs::path& partial = building.path();
  const fs::path model_path = partial / "tokenizer.model";
  if (opt.tokenizer.empty()) {
    std::vector<std::string> train_texts;
    for (int64_t i = 0; i < n; ++i)
      if (!is_val[i]) train_texts.push_back(texts[i]);
    if (Progress::enabled())
      std::fprintf(stderr, "training BPE tokenizer (vocab %d) on %lld documents, %s bytes...\n", opt.vocab_size,
                   (long long)train_texts.size(), format_count(double(bytes)).c_str());
    train_tokenizer(train_texts, opt.vocab_size, opt.seed, model_path.string());
  } else {
    Tokenizer check(opt.tokenizer);  // validates it before copying
    fs::copy_file(opt.tokenizer, model_path, fs::copy_options::overwrite_existing);
  }
  Tokenizer tok(model_path.string());

  std::vector<uint32_t> split_tokens[2];
  int64_t docs_in[2] = {0, 0};
  Progress bar("tokenize", n, "tok");
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto ids = tok.encode(texts[i]);
    auto& dst = split_tokens[is_val[i] ? 1 : 0];
    dst.insert(dst.end(), ids.begin(), ids.end());
    dst.push_back(static_cast<uint32_t>(tok.eos_id()));  // end-of-document token
    ++docs_in[is_val[i] ? 1 : 0];
    total += ids.size() + 1;
    bar.update(i + 1, double(total));
  }
  bar.finish();

  PrepareResult r;
  r.vocab_size = tok.vocab_size();
  if (opt.tokenizer.empty() && r.vocab_size < opt.vocab_size)
    std::fprintf(stderr, "data prepare: the training documents yield %d pieces, fewer than --vocab-size %d; the "
                 "tokenizer has %d (meta.json: vocab_size_requested)\n",
                 r.vocab_size, opt.vocab_size, r.vocab_size);
  r.train_tokens = split_tokens[0].size();
  r.val_tokens = split_tokens[1].size();
  r.train_docs = docs_in[0];
  r.val_docs = docs_in[1];
  const auto [train_entropy, val_ce] = unigram_entropies(split_tokens[0], split_tokens[1], r.vocab_size);
  r.unigram_entropy_nats = train_entropy;

  nlohmann::json meta;
  meta["format"] = "llm.c token shards";
  meta["token_dtype"] = r.vocab_size > 65536 ? "uint32" : "uint16";
  meta["tokenizer"] = "tokenizer.model";
  meta["tokenizer_type"] = "sentencepiece-bpe-byte-fallback";
  meta["vocab_size"] = r.vocab_size;
  if (opt.tokenizer.empty()) meta["vocab_size_requested"] = opt.vocab_size;
  meta["eos_id"] = tok.eos_id();
  meta["seed"] = opt.seed;
  meta["val_fraction"] = opt.val_fraction;
  meta["sources"] = opt.inputs;
  meta["documents"] = n;
  meta["bytes"] = bytes;
  meta["unigram_entropy_nats"] = r.unigram_entropy_nats;
  meta["val_unigram_cross_entropy_nats"] = val_ce;
  for (int s = 0; s < 2; ++s) {
    std::string split = s == 0 ? "train" : "val";
    auto shards = write_split(partial, split, split_tokens[s], opt.shard_tokens, r.vocab_size);
    meta["splits"][split] = {{"documents", docs_in[s]},
                             {"tokens", int64_t(split_tokens[s].size())},
                             {"shards", shards}};
  }
  write_file_atomic(partial / "meta.json", meta.dump(2) + "\n");
  fsync_path(partial);
  replace_directory(partial, out, owned);
  building.release();
  return r;
}

}  // namespace depthkit
