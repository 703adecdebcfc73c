#include "depthkit/data/prepare.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "depthkit/data/loader.h"
#include "depthkit/data/shards.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {

std::vector<fs::path> list_documents(const std::vector<std::string>& inputs) {
  std::vector<fs::path> docs;
  for (const auto& in : inputs) {
    if (fs::is_regular_file(in)) {
      docs.emplace_back(in);
    } else if (fs::is_directory(in)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::recursive_directory_iterator(in))
        if (e.is_regular_file()) found.push_back(e.path());
      if (found.empty()) fail(in, ": input directory holds no files");
      std::sort(found.begin(), found.end());
      docs.insert(docs.end(), found.begin(), found.end());
    } else {
      fail(in, ": input not found");
    }
  }
  if (docs.empty()) fail("data prepare: no --input given");
  return docs;
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

}  // namespace

PrepareResult prepare_data(const PrepareOptions& opt) {
  if (opt.out_dir.empty()) fail("data prepare: --out is required");
  if (!(opt.val_fraction > 0 && opt.val_fraction < 1))
    fail("--val-fraction must be in (0, 1), got ", opt.val_fraction);
  if (opt.shard_tokens < 1024) fail("--shard-tokens must be >= 1024, got ", opt.shard_tokens);
  fs::path out(opt.out_dir);
  if (fs::exists(out) && !opt.force)
    fail(out.string(), ": output directory already exists (pass --force to replace it)");

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
  if (n < 2) fail("data prepare: need at least 2 documents to split train/val, got ", n);
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = opt.seed ^ 0xd1b54a32d192ed03ull;
  for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[splitmix64(state) % uint64_t(i + 1)]);
  const int64_t n_val = std::clamp<int64_t>(std::llround(opt.val_fraction * n), 1, n - 1);
  std::vector<bool> is_val(n, false);
  for (int64_t i = 0; i < n_val; ++i) is_val[order[i]] = true;

  // Everything is built in a sibling folder and renamed into place at the end.
  fs::path partial = out.string() + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  const fs::path model_path = partial / "tokenizer.model";
  if (opt.tokenizer.empty()) {
    std::vector<std::string> train_texts;
    for (int64_t i = 0; i < n; ++i)
      if (!is_val[i]) train_texts.push_back(texts[i]);
    std::fprintf(stderr, "training BPE tokenizer (vocab %d) on %lld documents, %s bytes...\n",
                 opt.vocab_size, (long long)train_texts.size(), format_count(double(bytes)).c_str());
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
  r.train_tokens = split_tokens[0].size();
  r.val_tokens = split_tokens[1].size();
  r.train_docs = docs_in[0];
  r.val_docs = docs_in[1];
  std::vector<int64_t> counts(r.vocab_size, 0);
  for (uint32_t t : split_tokens[0]) ++counts[t];
  for (int64_t c : counts)
    if (c > 0) {
      double p = double(c) / double(r.train_tokens);
      r.unigram_entropy_nats -= p * std::log(p);
    }
  // Cross-entropy of the val split under the train unigram model (add-one smoothing).
  double val_ce = 0;
  for (uint32_t t : split_tokens[1])
    val_ce -= std::log((double(counts[t]) + 1) / (double(r.train_tokens) + r.vocab_size));
  val_ce /= std::max<int64_t>(1, r.val_tokens);

  nlohmann::json meta;
  meta["format"] = "llm.c token shards";
  meta["token_dtype"] = r.vocab_size > 65536 ? "uint32" : "uint16";
  meta["tokenizer"] = "tokenizer.model";
  meta["tokenizer_type"] = "sentencepiece-bpe-byte-fallback";
  meta["vocab_size"] = r.vocab_size;
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

  if (fs::exists(out)) {
    fs::path old = out.string() + ".old";
    fs::remove_all(old);
    rename_durable(out, old);
    rename_durable(partial, out);
    fs::remove_all(old);
  } else {
    if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
    rename_durable(partial, out);
  }
  return r;
}

}  // namespace depthkit
