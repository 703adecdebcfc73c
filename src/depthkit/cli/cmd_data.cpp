// depthkit data prepare: a corpus → tokenizer → llm.c token shards.
// depthkit data encode: a tokenizer's ids for lines of text (cmd_data_encode.cpp).
// depthkit data make-task: the built-in cloze task from a prepared corpus's held-out documents.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/data/prepare.h"
#include "depthkit/eval/cloze.h"

namespace depthkit::cli {

void add_data(CLI::App& app, Action& action) {
  auto* data = app.add_subcommand("data", "prepare token shards; build the built-in task")->require_subcommand(1);
  auto* prep = data->add_subcommand("prepare", "train a tokenizer, split by document, write shards");
  auto opt = std::make_shared<PrepareOptions>();
  auto json = std::make_shared<bool>(false);
  prep->add_option("--input", opt->inputs,
                   "JSONL (.jsonl, .jsonl.gz, .jsonl.zst: a document a line), parquet (a document a row) or text files "
                   "(a document a file), directories of them, or glob patterns")
      ->required()
      ->expected(1, -1);
  prep->add_option("--out", opt->out_dir, "output directory")->required();
  prep->add_option("--text-key", opt->text_key, "the JSONL field / parquet column holding the text (default: text)");
  add_number(prep, "--vocab-size", opt->vocab_size, 300, 1 << 20, "BPE vocabulary size (a trained tokenizer)");
  add_number(prep, "--val-fraction", opt->val_fraction, 0.0, 1.0,
             "share of documents held out for validation (each by a seeded hash of its file and row)",
             Bound::open, Bound::open);
  add_number(prep, "--seed", opt->seed, 0, UINT64_MAX, "seed of the train/val split and the tokenizer sample");
  prep->add_option("--tokenizer", opt->tokenizer,
                   "use this tokenizer instead of training one: a SentencePiece tokenizer.model or a Hugging Face "
                   "tokenizer.json (byte-level BPE: GPT-2, Llama-3)")
      ->check(CLI::ExistingFile);
  add_number(prep, "--tokenizer-sample-bytes", opt->tokenizer_sample_bytes, 1, INT64_MAX,
             "the tokenizer is trained on a seeded sample of the training documents of at most this many bytes");
  add_number(prep, "--shard-tokens", opt->shard_tokens, 1024, INT32_MAX, "tokens per shard (llm.c: 100M)");
  add_number(prep, "--threads", opt->threads, 0, 4096, "tokenizing threads (0: every core); the output is the same for any");
  prep->add_flag("--skip-bad", opt->skip_bad,
                 "count malformed records (bad JSON, a missing or non-string field, invalid UTF-8) and go on, "
                 "instead of stopping at the first");
  prep->add_flag("--force", opt->force, "replace an existing output directory");
  prep->add_flag("--json", *json, "print the summary as JSON");
  prep->callback([&action, opt, json] {
    action = [opt, json] {
      auto r = prepare_data(*opt);
      nlohmann::json j = {{"out", opt->out_dir},           {"vocab_size", r.vocab_size},
                          {"train_tokens", r.train_tokens}, {"val_tokens", r.val_tokens},
                          {"train_documents", r.train_docs}, {"val_documents", r.val_docs},
                          {"unigram_entropy_nats", r.unigram_entropy_nats},
                          {"bytes", r.bytes},           {"bad_records_skipped", r.bad_records},
                          {"seconds", r.seconds}};
      if (*json) std::printf("%s\n", j.dump().c_str());
      else
        std::printf("wrote %s: vocab %d, train %lld tokens (%lld docs), val %lld tokens (%lld docs), "
                    "unigram entropy %.4f nats/token\n",
                    opt->out_dir.c_str(), r.vocab_size, (long long)r.train_tokens, (long long)r.train_docs,
                    (long long)r.val_tokens, (long long)r.val_docs, r.unigram_entropy_nats);
      return 0;
    };
  });

  add_data_encode(data, action);

  auto* task = data->add_subcommand("make-task", "build a multiple-choice cloze task from the held-out documents");
  auto copt = std::make_shared<ClozeOptions>();
  auto task_json = std::make_shared<bool>(false);
  task->add_option("--data", copt->data_dir, "a prepared data directory (depthkit data prepare)")->required();
  task->add_option("--out", copt->out, "the task file to write (JSONL)")->required();
  add_number(task, "--items", copt->items, 1, int64_t(1) << 30, "scored items, at most");
  add_number(task, "--dev-items", copt->dev_items, 0, int64_t(1) << 30, "few-shot items (\"split\": \"dev\")");
  add_number(task, "--choices", copt->choices, 2, 26, "candidates per item");
  add_number(task, "--context-bytes", copt->context_bytes, kClozeMinContextOption, int64_t(1) << 20,
             "longest passage, in bytes");
  add_number(task, "--seed", copt->seed, 0, UINT64_MAX, "seed of the construction (and of the task's few-shot draws)");
  task->add_flag("--force", copt->force, "replace an existing output file");
  task->add_flag("--json", *task_json, "print the summary as JSON");
  task->callback([&action, copt, task_json] {
    action = [copt, task_json] {
      const ClozeResult r = make_cloze_task(*copt);
      nlohmann::json j = {{"out", copt->out},           {"items", r.items},
                          {"dev_items", r.dev_items},    {"choices", copt->choices},
                          {"documents", r.documents},    {"dev_documents", r.dev_documents},
                          {"candidate_lines", r.candidate_lines}, {"seed", copt->seed}};
      if (*task_json) std::printf("%s\n", j.dump().c_str());
      else
        std::printf("wrote %s: %lld items + %lld dev items, %lld choices each, from %lld held-out documents "
                    "(%lld for dev), seed %llu\n",
                    copt->out.c_str(), (long long)r.items, (long long)r.dev_items, (long long)copt->choices,
                    (long long)r.documents, (long long)r.dev_documents, (unsigned long long)copt->seed);
      return 0;
    };
  });
}

}  // namespace depthkit::cli
