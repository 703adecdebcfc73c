// `depthkit data make-task`: the built-in multiple-choice task, a next-line cloze built from the
// held-out (val) documents of a prepared corpus, since no benchmark data can be downloaded here.
// Given a passage of a document, choose the line that follows it among `choices`; the other
// candidates are lines of other held-out documents. The construction (docs/tasks.md) is seeded and
// deterministic: the same corpus, options and seed give a byte-identical file.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace depthkit {

// The least --context-bytes that can yield items: a passage holds at least 100 bytes and starts at
// a line start, so the window must also take the line it cuts into; at 300, any line of up to 200
// bytes (the longest continuation) fits. At 100 a passage would have to start exactly 100 bytes
// before its line, and hardly any does.
constexpr int64_t kClozeMinContextOption = 300;

struct ClozeOptions {
  std::string data_dir;  // a `depthkit data prepare` output: tokenizer.model and val shards
  std::string out;       // the task file (JSONL), written atomically
  int64_t items = 500;   // scored items, at most
  int64_t dev_items = 25;   // few-shot items ("split": "dev"), from documents no scored item uses
  int64_t choices = 4;
  int64_t context_bytes = 600;  // a passage is at most this long, cut at a line start
  uint64_t seed = 1234;
  bool force = false;  // replace an existing output file
};

struct ClozeResult {
  int64_t items = 0, dev_items = 0;
  int64_t documents = 0, dev_documents = 0;  // held-out documents, and of them those the dev items use
  int64_t candidate_lines = 0;               // possible answers: qualifying lines with a passage before them
};

ClozeResult make_cloze_task(const ClozeOptions& opt);

// The held-out documents of a prepared directory: its val tokens decoded and split at the
// end-of-document id, in shard order.
std::vector<std::string> held_out_documents(const std::string& data_dir);

}  // namespace depthkit
