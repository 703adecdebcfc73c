// depthkit data prepare: documents → SentencePiece BPE tokenizer → llm.c token shards.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/data/prepare.h"

namespace depthkit::cli {

void add_data(CLI::App& app, Action& action) {
  auto* data = app.add_subcommand("data", "prepare token shards")->require_subcommand(1);
  auto* prep = data->add_subcommand("prepare", "train a tokenizer, split by document, write shards");
  auto opt = std::make_shared<PrepareOptions>();
  auto json = std::make_shared<bool>(false);
  prep->add_option("--input", opt->inputs, "text files or directories (every file below is a document)")
      ->required()
      ->expected(1, -1);
  prep->add_option("--out", opt->out_dir, "output directory")->required();
  prep->add_option("--vocab-size", opt->vocab_size, "BPE vocabulary size")->check(CLI::Range(300, 1 << 20));
  prep->add_option("--val-fraction", opt->val_fraction, "share of documents held out for validation");
  prep->add_option("--seed", opt->seed, "seed of the train/val split");
  prep->add_option("--tokenizer", opt->tokenizer, "use this SentencePiece model instead of training one")
      ->check(CLI::ExistingFile);
  prep->add_option("--shard-tokens", opt->shard_tokens, "tokens per shard (llm.c: 100M)");
  prep->add_flag("--force", opt->force, "replace an existing output directory");
  prep->add_flag("--json", *json, "print the summary as JSON");
  prep->callback([&action, opt, json] {
    action = [opt, json] {
      auto r = prepare_data(*opt);
      nlohmann::json j = {{"out", opt->out_dir},           {"vocab_size", r.vocab_size},
                          {"train_tokens", r.train_tokens}, {"val_tokens", r.val_tokens},
                          {"train_documents", r.train_docs}, {"val_documents", r.val_docs},
                          {"unigram_entropy_nats", r.unigram_entropy_nats}};
      if (*json) std::printf("%s\n", j.dump().c_str());
      else
        std::printf("wrote %s: vocab %d, train %lld tokens (%lld docs), val %lld tokens (%lld docs), "
                    "unigram entropy %.4f nats/token\n",
                    opt->out_dir.c_str(), r.vocab_size, (long long)r.train_tokens, (long long)r.train_docs,
                    (long long)r.val_tokens, (long long)r.val_docs, r.unigram_entropy_nats);
      return 0;
    };
  });
}

}  // namespace depthkit::cli
