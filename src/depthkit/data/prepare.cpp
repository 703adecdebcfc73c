#include "depthkit/data/prepare.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "depthkit/data/corpus.h"
#include "depthkit/data/loader.h"
#include "depthkit/data/shards.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"

namespace depthkit {

namespace {

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

// What data prepare writes into its output directory: meta.json, the tokenizer (tokenizer.model or
// tokenizer.json) and the shards meta.json lists (for a directory without such a meta.json, nothing). --force replaces a
// directory that holds nothing else.
std::set<std::string> prepared_files(const fs::path& out) {
  const fs::path meta_path = out / "meta.json";
  nlohmann::json meta;
  if (fs::is_regular_file(meta_path)) meta = nlohmann::json::parse(read_file(meta_path, 64u << 20), nullptr, false);
  const bool ours = meta.is_object() && meta.contains("format") && meta["format"] == "llm.c token shards" &&
                    meta.contains("splits") && meta["splits"].is_object();
  if (!ours) return {};
  std::set<std::string> files = {"meta.json", "tokenizer.model", "tokenizer.json"};
  for (const auto& [split, info] : meta["splits"].items())
    if (info.is_object() && info.contains("shards") && info["shards"].is_array())
      for (const auto& name : info["shards"])
        if (name.is_string()) files.insert(name.get<std::string>());
  return files;
}


// Output directories a prepare left behind when it was killed (SIGKILL, power loss: no unwinding
// removed them): "<out>.partial-XXXXXX" beside `out`, holding only what prepare writes there
// (shards, their temporaries, the tokenizer, meta.json), and not locked by a prepare running now.
void remove_abandoned_partials(const fs::path& out) {
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  const std::string prefix = out.filename().string() + ".partial-";
  std::error_code ec;
  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() == prefix.size() + 6 && name.starts_with(prefix) && e.is_directory(ec) && !e.is_symlink(ec))
      found.push_back(e.path());
  }
  const OwnedNames ours = [](const std::string& name) {
    return name == "meta.json" || name == "tokenizer.model" || name == "tokenizer.json" ||
           ((name.starts_with("train_") || name.starts_with("val_")) &&
            (name.ends_with(".bin") || name.find(".bin.tmp-") != std::string::npos));
  };
  for (const fs::path& dir : found) {
    try {
      check_only_owned(dir, ours, "what data prepare writes");
      DirectoryLock running(dir);  // fails while the prepare that made it still runs
      fs::remove_all(dir);
      std::fprintf(stderr, "data prepare: removed %s, left by an interrupted prepare\n", dir.c_str());
    } catch (const Error&) {
      // Someone else's folder, or a prepare still running: not ours to remove.
    }
  }
}

// The corpus streams through a pool of threads in batches of records. Reading and consuming
// (writing shards, sampling) happen on the calling thread in input order; the threads parse,
// check and encode. Results are consumed in the order the batches were made, so the output is
// the same for any number of threads.
struct Document {
  bool ok = false;
  bool val = false;
  std::string why;               // a malformed record: what is wrong
  std::string text;              // sampling pass: the text of a training document
  std::vector<uint32_t> tokens;  // encoding pass: its ids, then eos
  size_t text_bytes = 0;
};

struct Batch {
  std::vector<Record> records;
  std::vector<Document> docs;
  size_t bytes = 0;
  uintmax_t position = 0;  // input bytes consumed when the batch was cut (progress)
  std::string error;       // an exception on a worker (out of memory, a tokenizer failure)
};

class BatchPool {
 public:
  using Work = std::function<void(Batch&)>;
  // `threads` encoding threads beside the calling one, which reads and writes; with one, the calling
  // thread does everything (so that --threads 1 is one core's work).
  BatchPool(int threads, Work work) : work_(std::move(work)) {
    for (int i = 0; threads > 1 && i < threads; ++i) threads_.emplace_back([this] { run(); });
  }
  ~BatchPool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    ready_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(std::unique_ptr<Batch> b) {
    if (threads_.empty()) {  // one thread: the work runs here, between reading and writing
      run_one(*b);
      done_.emplace(next_in_++, std::move(b));
      return;
    }
    std::lock_guard<std::mutex> g(mu_);
    queue_.emplace_back(next_in_++, std::move(b));
    ready_.notify_one();
  }
  int64_t in_flight() const { return next_in_ - next_out_; }
  // The next batch in submission order, waiting for it.
  std::unique_ptr<Batch> take() {
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [&] { return done_.count(next_out_) > 0; });
    auto it = done_.find(next_out_);
    auto b = std::move(it->second);
    done_.erase(it);
    ++next_out_;
    return b;
  }

 private:
  void run() {
    for (;;) {
      std::pair<int64_t, std::unique_ptr<Batch>> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        ready_.wait(g, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      run_one(*job.second);
      {
        std::lock_guard<std::mutex> g(mu_);
        done_.emplace(job.first, std::move(job.second));
      }
      done_cv_.notify_all();
    }
  }
  void run_one(Batch& b) {
    try {
      work_(b);
    } catch (const std::exception& e) {
      b.error = error_line(e);
    }
  }
  Work work_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable ready_, done_cv_;
  std::deque<std::pair<int64_t, std::unique_ptr<Batch>>> queue_;
  std::map<int64_t, std::unique_ptr<Batch>> done_;
  int64_t next_in_ = 0, next_out_ = 0;
  bool stop_ = false;
};

constexpr size_t kBatchBytes = size_t(1) << 20;
constexpr size_t kBatchRecords = 4096;

// Reads every record of `files` into batches for `pool`, handing each finished batch to
// `consume` in order. At most 2·threads + 2 batches are in memory at once.
void stream_corpus(const std::vector<CorpusFile>& files, const std::string& text_key, BatchPool& pool, int threads,
                   const std::function<void(Batch&)>& consume) {
  const int64_t max_in_flight = 2 * int64_t(threads) + 2;
  auto drain = [&](int64_t keep) {
    while (pool.in_flight() > keep) {
      auto b = pool.take();
      if (!b->error.empty()) throw Error(b->error);
      consume(*b);
    }
  };
  auto batch = std::make_unique<Batch>();
  uintmax_t finished_bytes = 0;
  auto submit = [&](uintmax_t position) {
    batch->position = position;
    pool.submit(std::move(batch));
    batch = std::make_unique<Batch>();
    drain(max_in_flight - 1);
  };
  for (uint32_t f = 0; f < files.size(); ++f) {
    auto reader = open_records(files[f], f, text_key);
    Record r;
    while (reader->next(r)) {
      batch->bytes += r.bytes.size();
      batch->records.push_back(std::move(r));
      r = Record();
      if (batch->bytes >= kBatchBytes || batch->records.size() >= kBatchRecords)
        submit(finished_bytes + reader->position());
    }
    finished_bytes += files[f].bytes;
  }
  if (!batch->records.empty()) submit(finished_bytes);
  drain(0);
}

// The bottom of a seeded order of the training documents, as many as fit in `budget` bytes: the
// documents whose sample hash is smallest, the longest such prefix that fits. The same set whatever
// the order the documents come in, and memory never holds more than `budget` of them.
class TokenizerSample {
 public:
  explicit TokenizerSample(int64_t budget) : budget_(budget) {}
  void offer(uint64_t priority, int64_t order, std::string&& text) {
    const int64_t size = int64_t(text.size());
    if (rejected_below_ && priority >= *rejected_below_) return;
    kept_.emplace(priority, std::make_pair(order, std::move(text)));
    bytes_ += size;
    while (bytes_ > budget_) {  // drop the largest priorities until the rest fits
      auto last = std::prev(kept_.end());
      bytes_ -= int64_t(last->second.second.size());
      rejected_below_ = rejected_below_ ? std::min(*rejected_below_, last->first) : last->first;
      kept_.erase(last);
    }
  }
  // The sampled texts in corpus order, and their bytes.
  std::vector<std::string> take(int64_t& bytes) {
    std::vector<std::pair<int64_t, std::string>> docs;
    for (auto& [priority, doc] : kept_) docs.push_back(std::move(doc));
    std::sort(docs.begin(), docs.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::string> texts;
    for (auto& d : docs) texts.push_back(std::move(d.second));
    bytes = bytes_;
    return texts;
  }

 private:
  int64_t budget_, bytes_ = 0;
  std::optional<uint64_t> rejected_below_;
  std::multimap<uint64_t, std::pair<int64_t, std::string>> kept_;
};

// Input position → progress: megabytes of input read (compressed where the files are).
// The rate is tokens/s while encoding, documents/s while sampling (rate_unit "tok" or "doc").
struct PrepareProgress {
  PrepareProgress(const char* label, uintmax_t total_bytes, const char* rate_unit)
      : bar(label, std::max<int64_t>(1, int64_t(total_bytes >> 20)), rate_unit),
        start(std::chrono::steady_clock::now()) {}
  void update(uintmax_t position, double rate_amount, int64_t docs) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char status[96];
    std::snprintf(status, sizeof status, "MiB, %.1f MB/s, %s docs", s > 0 ? double(position) / s / 1e6 : 0.0,
                  format_count(double(docs)).c_str());
    bar.update(int64_t(position >> 20), rate_amount, status);
  }
  Progress bar;
  std::chrono::steady_clock::time_point start;
};

}  // namespace

uint64_t document_hash(uint64_t seed, const std::string& key, int64_t row) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the key
  for (unsigned char c : key) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  uint64_t state = seed ^ h;
  state = splitmix64(state) ^ uint64_t(row);
  return splitmix64(state);
}

bool is_validation_document(uint64_t seed, const std::string& key, int64_t row, double val_fraction) {
  return double(document_hash(seed, key, row) >> 11) * 0x1.0p-53 < val_fraction;
}

PrepareResult prepare_data(const PrepareOptions& opt) {
  if (opt.out_dir.empty()) fail("data prepare: --out is required");
  if (!(opt.val_fraction > 0 && opt.val_fraction < 1))
    fail("--val-fraction must be in (0, 1), got ", opt.val_fraction);
  if (opt.shard_tokens < 1024) fail("--shard-tokens must be >= 1024, got ", opt.shard_tokens);
  if (opt.shard_tokens > int64_t(INT32_MAX)) fail("--shard-tokens must be < 2^31 (the shard header's count), got ", opt.shard_tokens);
  if (opt.tokenizer_sample_bytes < 1) fail("--tokenizer-sample-bytes must be positive, got ", opt.tokenizer_sample_bytes);
  if (opt.text_key.empty()) fail("--text-key must not be empty");
  const int threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));
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
    check_only_owned(out, owned, "what data prepare wrote there (meta.json, the tokenizer and the shards meta.json lists)");

  const std::vector<CorpusFile> files = list_corpus_files(opt.inputs);
  for (const CorpusFile& f : files)
    if (is_within(f.path, out) || is_within(out, f.path))
      fail("--out ", out.string(), ": holds the input file ", f.path.string(), " (choose another --out)");
  uintmax_t input_bytes = 0;
  for (const CorpusFile& f : files) input_bytes += f.bytes;
  remove_abandoned_partials(out);

  // Everything is built in a fresh sibling folder, locked while this prepare runs, and renamed
  // into place at the end; a failure removes that folder and nothing else. Each shard appears in
  // it only complete (ShardWriter).
  TemporaryDirectory building(make_sibling_dir(out, "partial"));
  const fs::path& partial = building.path();
  std::optional<DirectoryLock> lock(std::in_place, partial);

  auto malformed = [&](const CorpusFile& f, const Record& r, const std::string& why) {
    fail(record_location(f, r), ": ", why, " (--skip-bad counts such records and goes on)");
  };

  // The tokenizer: the one given, or a SentencePiece BPE trained on a sample of the training
  // documents (a first pass that parses and samples; no encoding).
  std::string tokenizer_path;
  int64_t sample_docs = 0, sample_bytes = 0;
  if (opt.tokenizer.empty()) {
    TokenizerSample sample(opt.tokenizer_sample_bytes);
    int64_t order = 0, seen = 0;
    PrepareProgress progress("sample", input_bytes, "doc");
    {
      BatchPool pool(threads, [&](Batch& b) {
        b.docs.resize(b.records.size());
        for (size_t i = 0; i < b.records.size(); ++i) {
          Record& r = b.records[i];
          Document& d = b.docs[i];
          d.ok = document_text(files[r.file], r, opt.text_key, d.text, d.why);
          if (d.ok) d.val = is_validation_document(opt.seed, files[r.file].key, r.row, opt.val_fraction);
          if (d.val) d.text.clear();
        }
      });
      stream_corpus(files, opt.text_key, pool, threads, [&](Batch& b) {
        for (size_t i = 0; i < b.records.size(); ++i) {
          const Record& r = b.records[i];
          Document& d = b.docs[i];
          ++order;
          if (!d.ok) {
            if (!opt.skip_bad) malformed(files[r.file], r, d.why);
            continue;
          }
          ++seen;
          if (!d.val) sample.offer(document_hash(opt.seed ^ 0x7f4a7c15f39cc060ull, files[r.file].key, r.row), order,
                                   std::move(d.text));
        }
        progress.update(b.position, double(seen), seen);
      });
    }
    progress.bar.finish();
    std::vector<std::string> texts = sample.take(sample_bytes);
    sample_docs = int64_t(texts.size());
    if (texts.empty())
      fail("data prepare: no training document fits in --tokenizer-sample-bytes ", opt.tokenizer_sample_bytes,
           " to train the tokenizer on", seen == 0 ? " (the inputs hold no document)" : " (raise it)");
    if (Progress::enabled())
      std::fprintf(stderr, "training BPE tokenizer (vocab %d) on %lld sampled training documents, %s bytes...\n",
                   opt.vocab_size, (long long)sample_docs, format_count(double(sample_bytes)).c_str());
    tokenizer_path = (partial / "tokenizer.model").string();
    train_tokenizer(texts, opt.vocab_size, opt.seed, tokenizer_path);
  } else {
    Tokenizer given(opt.tokenizer);  // validates it before copying
    tokenizer_path = (partial / given.file_name()).string();
    fs::copy_file(opt.tokenizer, tokenizer_path, fs::copy_options::overwrite_existing);
  }
  const Tokenizer tok(tokenizer_path);
  const int64_t vocab = tok.vocab_size();
  const uint32_t eos = uint32_t(tok.eos_id());

  // The pass that encodes and writes.
  PrepareResult r;
  r.vocab_size = int(vocab);
  std::vector<int64_t> counts[2] = {std::vector<int64_t>(size_t(vocab), 0), std::vector<int64_t>(size_t(vocab), 0)};
  std::vector<std::string> shard_names[2];
  std::unique_ptr<ShardWriter> writer[2];
  int64_t docs_in[2] = {0, 0}, tokens_in[2] = {0, 0};
  const char* split_name[2] = {"train", "val"};
  auto append = [&](int s, const uint32_t* ids, size_t n) {
    while (n > 0) {
      if (!writer[s]) {
        char name[64];
        std::snprintf(name, sizeof name, "%s_%06zu.bin", split_name[s], shard_names[s].size());
        writer[s] = std::make_unique<ShardWriter>((partial / name).string(), vocab);
        shard_names[s].push_back(name);
      }
      const size_t take = std::min<size_t>(n, size_t(opt.shard_tokens - writer[s]->size()));
      writer[s]->append(ids, take);
      ids += take;
      n -= take;
      if (writer[s]->size() == opt.shard_tokens) {
        writer[s]->commit();
        writer[s].reset();
      }
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  {
    PrepareProgress progress("tokenize", input_bytes, "tok");
    BatchPool pool(threads, [&](Batch& b) {
      b.docs.resize(b.records.size());
      std::string text;
      for (size_t i = 0; i < b.records.size(); ++i) {
        Record& rec = b.records[i];
        Document& d = b.docs[i];
        d.ok = document_text(files[rec.file], rec, opt.text_key, text, d.why);
        if (!d.ok) continue;
        d.val = is_validation_document(opt.seed, files[rec.file].key, rec.row, opt.val_fraction);
        const std::vector<int> ids = tok.encode(text);
        d.tokens.assign(ids.begin(), ids.end());
        d.tokens.push_back(eos);  // end-of-document token
        d.text_bytes = text.size();
      }
    });
    stream_corpus(files, opt.text_key, pool, threads, [&](Batch& b) {
      for (size_t i = 0; i < b.records.size(); ++i) {
        const Record& rec = b.records[i];
        const Document& d = b.docs[i];
        if (!d.ok) {
          if (!opt.skip_bad) malformed(files[rec.file], rec, d.why);
          ++r.bad_records;
          continue;
        }
        const int s = d.val ? 1 : 0;
        append(s, d.tokens.data(), d.tokens.size());
        for (uint32_t t : d.tokens) ++counts[s][t];
        ++docs_in[s];
        tokens_in[s] += int64_t(d.tokens.size());
        r.bytes += int64_t(d.text_bytes);
      }
      progress.update(b.position, double(tokens_in[0] + tokens_in[1]), docs_in[0] + docs_in[1]);
    });
    progress.bar.finish();
  }
  for (int s = 0; s < 2; ++s)
    if (writer[s]) writer[s]->commit();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (docs_in[0] == 0 || docs_in[1] == 0)
    fail("data prepare: no document of the --input files fell into the ", docs_in[0] == 0 ? "train" : "validation",
         " split (", docs_in[0] + docs_in[1], " documents, --val-fraction ", opt.val_fraction, ", assigned by a seeded hash of "
         "each document's file and row): ", docs_in[0] == 0 ? "lower --val-fraction" : "raise --val-fraction, change --seed",
         " or add documents");
  if (r.bad_records > 0)
    std::fprintf(stderr, "data prepare: skipped %lld malformed records (--skip-bad)\n", (long long)r.bad_records);
  if (opt.tokenizer.empty() && r.vocab_size < opt.vocab_size)
    std::fprintf(stderr, "data prepare: the training documents yield %d pieces, fewer than --vocab-size %d; the "
                 "tokenizer has %d (meta.json: vocab_size_requested)\n",
                 r.vocab_size, opt.vocab_size, r.vocab_size);
  r.train_tokens = tokens_in[0];
  r.val_tokens = tokens_in[1];
  r.train_docs = docs_in[0];
  r.val_docs = docs_in[1];
  // In nats per token: the train split's unigram entropy, and the val split's cross-entropy under
  // the train split's unigram model (add-one smoothing).
  double entropy = 0, val_ce = 0;
  for (int64_t t = 0; t < vocab; ++t) {
    if (counts[0][t] > 0) {
      const double p = double(counts[0][t]) / double(r.train_tokens);
      entropy -= p * std::log(p);
    }
    if (counts[1][t] > 0)
      val_ce -= double(counts[1][t]) * std::log((double(counts[0][t]) + 1) / (double(r.train_tokens) + double(vocab)));
  }
  val_ce /= double(std::max<int64_t>(1, r.val_tokens));
  r.unigram_entropy_nats = entropy;

  nlohmann::json meta;
  meta["format"] = "llm.c token shards";
  meta["token_dtype"] = vocab > 65536 ? "uint32" : "uint16";
  meta["tokenizer"] = fs::path(tokenizer_path).filename().string();
  meta["tokenizer_type"] = tok.type();
  meta["vocab_size"] = r.vocab_size;
  if (opt.tokenizer.empty()) {
    meta["vocab_size_requested"] = opt.vocab_size;
    meta["tokenizer_sample"] = {{"budget_bytes", opt.tokenizer_sample_bytes},
                                {"documents", sample_docs},
                                {"bytes", sample_bytes}};
  }
  meta["eos_id"] = tok.eos_id();
  meta["seed"] = opt.seed;
  meta["val_fraction"] = opt.val_fraction;
  meta["split_rule"] = "per document: validation when a seeded hash of (file key, row) < val_fraction";
  meta["text_key"] = opt.text_key;
  meta["sources"] = opt.inputs;
  meta["files"] = int64_t(files.size());
  meta["input_bytes"] = int64_t(input_bytes);
  meta["documents"] = docs_in[0] + docs_in[1];
  meta["bytes"] = r.bytes;
  meta["bad_records_skipped"] = r.bad_records;
  meta["unigram_entropy_nats"] = r.unigram_entropy_nats;
  meta["val_unigram_cross_entropy_nats"] = val_ce;
  for (int s = 0; s < 2; ++s)
    meta["splits"][split_name[s]] = {{"documents", docs_in[s]}, {"tokens", tokens_in[s]}, {"shards", shard_names[s]}};
  write_file_atomic(partial / "meta.json", meta.dump(2) + "\n");
  fsync_path(partial);
  lock.reset();
  replace_directory(partial, out, owned);
  building.release();
  return r;
}

}  // namespace depthkit
