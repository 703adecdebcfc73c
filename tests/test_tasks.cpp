// Downstream evaluation (eval/tasks.h, eval/cloze.h): batched scoring against a naive forward per
// candidate, the schema mappings, few-shot draws, left truncation, standard errors, malformed
// lines, the built-in cloze task's construction, generation tasks against generate(), and the
// task-type table's completeness.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <set>

#include "depthkit/data/prepare.h"
#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/cloze.h"
#include "depthkit/eval/generate.h"
#include "depthkit/eval/tasks.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/progress.h"
#include "helpers.h"

namespace depthkit::test {

namespace {

// A small model whose next-token distributions are far from uniform, so that a log-probability
// read at the wrong position or for the wrong token shows: every parameter (zero-initialised
// ones too, such as MSAR's causal convolutions along the sequence) gets Gaussian noise.
std::unique_ptr<Transformer> sharp_model(const std::string& kind, int64_t vocab, int64_t seq_len, uint64_t seed = 3) {
  Config c = small_config("unused");
  c.model.vocab_size = vocab;
  c.model.seq_len = seq_len;
  c.residual.kind = kind;
  c.residual.block_sublayers = 2;
  c.residual.streams = 2;
  c.residual.kernels = {4};  // MSAR: one kernel per stream after the first
  auto model = std::make_unique<Transformer>(c.model, c.residual, at::kCPU, seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  for (auto& [name, t] : model->parameters().named()) {
    if (!t.is_contiguous() || t.scalar_type() != at::kFloat) throw std::runtime_error("parameter " + name);
    float* p = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] += noise(rng);
  }
  return model;
}

// The harness's split of a context and a continuation, written from its description
// (lm-evaluation-harness's TemplateLM._encode_pair): trailing spaces of the context move to the
// continuation; the continuation's ids are those that follow the context's in the whole text's.
// (ASCII whitespace only: the tests' texts have no other.)
Continuation split_like_the_harness(const Tokenizer& tok, std::string context, std::string continuation) {
  while (!context.empty() && (context.back() == ' ' || context.back() == '\n' || context.back() == '\t')) {
    continuation.insert(continuation.begin(), context.back());
    context.pop_back();
  }
  std::vector<int> ctx = {tok.eos_id()}, whole = {tok.eos_id()};
  const auto a = tok.encode(context), b = tok.encode(context + continuation);
  ctx.insert(ctx.end(), a.begin(), a.end());
  whole.insert(whole.end(), b.begin(), b.end());
  return {ctx, std::vector<int>(whole.begin() + int64_t(ctx.size()), whole.end())};
}

// Σ log p(continuation | context) from one forward of context ++ continuation alone.
double naive_logprob(Transformer& model, const std::vector<int>& context, const std::vector<int>& continuation) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> ids(context.begin(), context.end());
  ids.insert(ids.end(), continuation.begin(), continuation.end());
  const at::Tensor input = at::tensor(std::vector<int64_t>(ids.begin(), ids.end() - 1), at::kLong).unsqueeze(0);
  const at::Tensor lp = at::log_softmax(model.logits(input).to(at::kDouble), -1)[0];
  double sum = 0;
  for (size_t j = 0; j < continuation.size(); ++j) {
    const int64_t t = int64_t(context.size() + j) - 1;  // the position that predicts continuation[j]
    sum += lp[t][continuation[j]].item<double>();
  }
  return sum;
}

std::vector<int> random_ids(std::mt19937_64& rng, size_t n, int vocab) {
  std::vector<int> v(n);
  for (int& x : v) x = int(rng() % uint64_t(vocab));
  return v;
}

// A corpus of prose documents prepared once for the tests that need a tokenizer and held-out
// documents: 30 documents of a heading and ~40 lines of random words, 30 % held out.
const std::string& prepared_corpus() {
  static TempDir dir;
  static std::string out;
  if (!out.empty()) return out;
  static const char* words[] = {"the",    "module",  "returns", "a",      "list",    "of",     "values",  "when",
                                "called", "with",    "an",      "object", "each",    "item",   "is",      "passed",
                                "to",     "function", "which",  "may",    "raise",   "error",  "if",      "file",
                                "cannot", "be",      "opened",  "string", "number",  "class",  "method",  "instance",
                                "this",   "example", "shows",   "how",    "python",  "reads",  "data",    "from",
                                "stream", "buffer",  "until",   "end",    "line",    "new",    "default", "argument"};
  std::mt19937_64 rng(11);
  fs::create_directories(dir.path / "docs");
  for (int d = 0; d < 30; ++d) {
    std::ofstream f(dir.path / "docs" / ("doc" + std::to_string(100 + d) + ".rst"));
    f << "Document " << d << "\n============\n\n";
    for (int l = 0; l < 40; ++l) {
      if (rng() % 6 == 0) f << "\n";
      const int n = 5 + int(rng() % 10);
      for (int w = 0; w < n; ++w) f << (w ? " " : "") << words[rng() % std::size(words)];
      f << ".\n";
    }
  }
  PrepareOptions opt;
  opt.inputs = {(dir.path / "docs").string()};
  opt.out_dir = (dir.path / "data").string();
  opt.vocab_size = 400;
  opt.val_fraction = 0.3;
  Progress::set_enabled(false);
  prepare_data(opt);
  Progress::set_enabled(true);
  out = opt.out_dir;
  return out;
}

const char* kNative =
    "{\"task\": {\"name\": \"t\", \"seed\": 5}}\n"
    "{\"context\": \"A man is sitting on a roof. He\", \"choices\": [\" starts pulling up roofing.\", \" is ripping level "
    "tiles.\", \" holds a ladder.\"], \"gold\": 0}\n";

}  // namespace

// The batched, right-padded scores equal one full forward per candidate, for candidates of
// different lengths sharing batches (and for every pathway: none lets padding reach back).
TEST(TasksScoring, EqualsNaivePerCandidateForward) {
  std::mt19937_64 rng(1);
  const int vocab = 64;
  for (const char* kind : {"residual", "attnres", "attnres_sepv", "dar", "msar", "mhc", "attnres_mhc"}) {
    const auto owner = sharp_model(kind, vocab, 32);
    Transformer& model = *owner;
    std::vector<Continuation> requests;
    for (int item = 0; item < 4; ++item) {
      const auto context = random_ids(rng, 3 + rng() % 12, vocab);
      for (size_t len : {1, 2, 4, 7}) requests.push_back({context, random_ids(rng, len, vocab)});
    }
    // 40 positions a forward: rows of different lengths share a batch, and there are several batches.
    size_t scored = 0;
    const auto scores = score_continuations(model, requests, 40, [&](size_t) { ++scored; });
    ASSERT_EQ(scores.size(), requests.size());
    EXPECT_EQ(scored, requests.size());
    double lo = 0, hi = -1e9;
    for (size_t q = 0; q < requests.size(); ++q) {
      const double naive = naive_logprob(model, requests[q].context, requests[q].continuation);
      EXPECT_NEAR(scores[q].logprob, naive, 1e-4 * std::max(1.0, std::abs(naive))) << kind << " request " << q;
      EXPECT_EQ(scores[q].tokens, int64_t(requests[q].continuation.size()));
      EXPECT_FALSE(scores[q].truncated);
      const double per_token = scores[q].logprob / double(scores[q].tokens);
      lo = std::min(lo, per_token);
      hi = std::max(hi, per_token);
    }
    // The log-probabilities differ a lot between tokens: a score read off by one position would show.
    EXPECT_GT(hi - lo, 1.0) << kind;
    // One request per forward gives the same scores.
    const auto single = score_continuations(model, requests, 1);
    for (size_t q = 0; q < requests.size(); ++q) EXPECT_NEAR(single[q].logprob, scores[q].logprob, 1e-4) << kind;
  }
}

// A context too long for the model loses ids from its left; the continuation is kept whole and
// scored as the naive forward on the kept context scores it. A continuation longer than the
// model's context is refused.
TEST(TasksScoring, LeftTruncationKeepsTheContinuation) {
  std::mt19937_64 rng(2);
  const auto owner = sharp_model("residual", 64, 16);
  Transformer& model = *owner;
  const auto long_context = random_ids(rng, 30, 64), short_context = random_ids(rng, 5, 64);
  const auto cont = random_ids(rng, 6, 64), cont16 = random_ids(rng, 16, 64);
  const auto scores = score_continuations(model, {{long_context, cont}, {short_context, cont}, {short_context, cont16}});
  EXPECT_TRUE(scores[0].truncated);
  EXPECT_FALSE(scores[1].truncated);
  EXPECT_TRUE(scores[2].truncated);  // 5 + 16 − 1 > 16: the context keeps one id
  // The kept context: the last 16 + 1 − 6 = 11 ids.
  const std::vector<int> kept(long_context.end() - 11, long_context.end());
  EXPECT_NEAR(scores[0].logprob, naive_logprob(model, kept, cont), 1e-4);
  EXPECT_NEAR(scores[2].logprob, naive_logprob(model, {short_context.back()}, cont16), 1e-4);
  expect_error([&] { score_continuations(model, {{short_context, random_ids(rng, 17, 64)}}); },
               {"continuation of 17 tokens exceeds model.seq_len 16"});
}

// Through evaluate_task: truncations are counted in the report, per candidate; a choice that
// alone exceeds the context names its file and line.
TEST(TasksScoring, TruncationsAreCountedInTheReport) {
  const std::string& data = prepared_corpus();
  Tokenizer tok(data + "/tokenizer.model");
  const auto owner = sharp_model("residual", 400, 24);
  Transformer& model = *owner;
  std::string long_context;
  for (int i = 0; i < 20; ++i) long_context += "the module returns a list of values. ";
  const std::string text =
      "{\"context\": \"" + long_context + "\", \"choices\": [\" the end.\", \" a file.\", \" an error.\"], \"gold\": 1}\n" +
      "{\"context\": \"the module\", \"choices\": [\" returns.\", \" reads.\"], \"gold\": 0}\n";
  const Task task = parse_task(text, "long.jsonl");
  TaskOptions opt;
  opt.progress = false;
  const TaskResult r = evaluate_task(model, tok, task, opt);
  EXPECT_EQ(r.items, 2);
  EXPECT_EQ(r.sequences, 5);
  EXPECT_EQ(r.truncated, 3);
  EXPECT_EQ(r.to_json()["truncated"], 3);
  EXPECT_NE(r.to_text().find("3 of 5 candidates"), std::string::npos) << r.to_text();
  // The candidates' scores are those of the naive forward on [eos] + context, split as the
  // harness splits it and cut from the left.
  std::vector<Continuation> requests;
  for (const char* c : {" the end.", " a file.", " an error."})
    requests.push_back(split_like_the_harness(tok, long_context, c));
  const auto scores = score_continuations(model, requests);
  for (size_t c = 0; c < 3; ++c) {
    const std::vector<int>& ctx = requests[c].context;
    const std::vector<int> kept(ctx.end() - (25 - int64_t(requests[c].continuation.size())), ctx.end());
    EXPECT_NEAR(scores[c].logprob, naive_logprob(model, kept, requests[c].continuation), 1e-4);
  }
  std::string long_choice;
  for (int i = 0; i < 30; ++i) long_choice += " value";
  const Task bad = parse_task("\n{\"context\": \"a\", \"choices\": [\"" + long_choice + "\", \" b\"], \"gold\": 1}\n", "bad.jsonl");
  expect_error([&] { evaluate_task(model, tok, bad, opt); }, {"bad.jsonl:2", "choice 0 is", "model.seq_len 24"});
}

// Accuracy: the chosen candidate by total, per-token and per-byte log-likelihood, against scores
// computed here; chance is the mean of 1 / choices.
TEST(TasksScoring, AccuraciesFollowTheScores) {
  const std::string& data = prepared_corpus();
  Tokenizer tok(data + "/tokenizer.model");
  const auto owner = sharp_model("residual", 400, 64);
  Transformer& model = *owner;
  std::string text;
  const std::vector<std::string> contexts = {"the module returns", "when called with an object", "this example shows",
                                             "the file cannot be", "each item is passed to", "a string of"};
  const std::vector<std::vector<std::string>> choices = {
      {" a list.", " an error if the file cannot be opened.", " values"}, {" it reads.", " x"},
      {" how python reads data.", " the end", " new line", " a"},      {" opened.", " passed to the function."},
      {" the method.", " a default argument value."},                   {" values.", " numbers", " data"}};
  for (size_t i = 0; i < contexts.size(); ++i) {
    nlohmann::json j = {{"context", contexts[i]}, {"choices", choices[i]}, {"gold", int(i % choices[i].size())}};
    text += j.dump() + "\n";
  }
  const Task task = parse_task(text, "acc.jsonl");
  TaskOptions opt;
  opt.progress = false;
  const TaskResult r = evaluate_task(model, tok, task, opt);
  std::vector<double> total, token, byte, character;
  double chance = 0;
  for (size_t i = 0; i < contexts.size(); ++i) {
    double best[4] = {-1e300, -1e300, -1e300, -1e300};
    int64_t arg[4] = {0, 0, 0, 0};
    for (size_t c = 0; c < choices[i].size(); ++c) {
      const Continuation q = split_like_the_harness(tok, contexts[i], choices[i][c]);
      const double lp = naive_logprob(model, q.context, q.continuation);
      // acc_norm divides by characters: the choices are ASCII, so by their bytes too, as per_byte.
      const double v[4] = {lp, lp / double(q.continuation.size()), lp / double(choices[i][c].size()),
                           lp / double(choices[i][c].size())};
      for (int m = 0; m < 4; ++m)
        if (v[m] > best[m]) best[m] = v[m], arg[m] = int64_t(c);
    }
    const int64_t gold = int64_t(i % choices[i].size());
    total.push_back(arg[0] == gold);
    token.push_back(arg[1] == gold);
    byte.push_back(arg[2] == gold);
    character.push_back(arg[3] == gold);
    EXPECT_EQ(r.predictions[i], arg[1]) << i;
    chance += 1.0 / double(choices[i].size()) / double(contexts.size());
  }
  EXPECT_DOUBLE_EQ(r.total.value, mean_with_stderr(total).value);
  EXPECT_DOUBLE_EQ(r.per_token.value, mean_with_stderr(token).value);
  EXPECT_DOUBLE_EQ(r.per_byte.value, mean_with_stderr(byte).value);
  EXPECT_DOUBLE_EQ(r.acc_norm.value, mean_with_stderr(character).value);
  EXPECT_DOUBLE_EQ(r.per_token.standard_error, mean_with_stderr(token).standard_error);
  EXPECT_NEAR(r.chance, chance, 1e-12);
  const auto j = r.to_json();
  EXPECT_EQ(j["type"], "multiple_choice");
  EXPECT_EQ(j["metric"], "per_token");
  EXPECT_DOUBLE_EQ(j["accuracy"]["per_byte"]["value"].get<double>(), r.per_byte.value);
}

// The harness's split: trailing whitespace of the context (str.rstrip(), so Unicode spaces too)
// moves to the continuation, and the continuation is cut from the whole text's ids.
TEST(TasksScoring, ContextAndContinuationSplitAsTheHarnessDoes) {
  const std::string& data = prepared_corpus();
  Tokenizer tok(data + "/tokenizer.model");
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"Question: which module reads files?\nAnswer: ", "the reader"}, {"the mod", "ule returns"},
      {"the list of ", "values."}, {"a\t\n", "b"}, {"x", "y"}, {"the end", "."}};
  for (const auto& [context, continuation] : pairs) {
    const Continuation got = harness_split(tok, context, continuation);
    const Continuation want = split_like_the_harness(tok, context, continuation);
    EXPECT_EQ(got.context, want.context) << context;
    EXPECT_EQ(got.continuation, want.continuation) << context << "|" << continuation;
  }
  // "Answer: " + "5" reads as "Answer:" + " 5".
  std::vector<int> answer = {tok.eos_id()};
  for (int id : tok.encode("Answer:")) answer.push_back(id);
  EXPECT_EQ(harness_split(tok, "Answer: ", "5").context, answer);
  // U+3000 IDEOGRAPHIC SPACE and U+00A0 NO-BREAK SPACE are whitespace to str.rstrip().
  EXPECT_EQ(harness_split(tok, "Answer:\u3000\u00a0", "5").context, answer);
}

// Standard error of the mean of 0/1 scores: the sample standard deviation over √n.
TEST(TasksScoring, StandardErrorsByHand) {
  // 3 of 4 right: mean 0.75; sample variance (3·0.0625 + 0.5625)/3 = 0.25; over n = 4: 0.0625 → 0.25.
  const Accuracy a = mean_with_stderr({1, 1, 0, 1});
  EXPECT_DOUBLE_EQ(a.value, 0.75);
  EXPECT_DOUBLE_EQ(a.standard_error, 0.25);
  // 1 of 5: mean 0.2; sample variance (0.64 + 4·0.04)/4 = 0.2; /5 = 0.04 → 0.2.
  const Accuracy b = mean_with_stderr({0, 0, 1, 0, 0});
  EXPECT_DOUBLE_EQ(b.value, 0.2);
  EXPECT_NEAR(b.standard_error, 0.2, 1e-15);
  EXPECT_EQ(mean_with_stderr({1}).standard_error, 0);
  EXPECT_EQ(mean_with_stderr({1, 1, 1}).standard_error, 0);
}

// HellaSwag-style and ARC-style lines give the items their native form states.
TEST(TasksSchema, MappingsGiveTheSameItems) {
  const Task native = parse_task(
      "{\"context\": \"A man is on a roof. He\", \"choices\": [\" climbs.\", \" falls.\"], \"gold\": 1}\n"
      "{\"context\": \"Question: Which is a gas?\\nAnswer:\", \"choices\": [\" iron\", \" oxygen\", \" salt\"], \"gold\": 1}\n",
      "native.jsonl");
  const Task mapped = parse_task(
      "{\"ind\": 4, \"activity_label\": \"Roof\", \"ctx\": \"A man is on a roof. He\", \"endings\": [\"climbs.\", \"falls.\"], "
      "\"label\": 1, \"split\": \"val\"}\n"
      "{\"id\": \"Mercury_1\", \"question\": \"Which is a gas?\", \"choices\": {\"text\": [\"iron\", \"oxygen\", \"salt\"], "
      "\"label\": [\"A\", \"B\", \"C\"]}, \"answerKey\": \"B\"}\n",
      "mapped.jsonl");
  // ctx_a/ctx_b and a label written as a string, as some exports do.
  const Task split = parse_task(
      "{\"ctx_a\": \"A man is on a roof.\", \"ctx_b\": \"He\", \"endings\": [\"climbs.\", \"falls.\"], \"label\": \"1\"}\n"
      "{\"question\": \"Which is a gas?\", \"choices\": {\"text\": [\"iron\", \"oxygen\", \"salt\"], \"label\": [\"1\", \"2\", "
      "\"3\"]}, \"answerKey\": \"2\"}\n",
      "split.jsonl");
  for (const Task* t : {&mapped, &split}) {
    ASSERT_EQ(t->items.size(), 2u);
    EXPECT_EQ(t->type, TaskType::kChoice);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(t->items[i].context, native.items[i].context) << t->file << " " << i;
      EXPECT_EQ(t->items[i].choices, native.items[i].choices) << t->file << " " << i;
      EXPECT_EQ(t->items[i].gold, native.items[i].gold) << t->file << " " << i;
      EXPECT_FALSE(t->items[i].dev);
    }
  }
  // Generation items: answers as a list or a string; target defaults to the first answer.
  const Task gen = parse_task(
      "{\"task\": {\"stop\": [\"\\n\", \".\"], \"regex\": \"is (\\\\d+)\", \"max_new_tokens\": 8}}\n"
      "{\"prompt\": \"Q: 2+2?\\nA:\", \"answers\": [\"4\", \"four\"]}\n"
      "{\"prompt\": \"Q: 3+3?\\nA:\", \"answers\": \"6\", \"target\": \" It is 6.\", \"split\": \"dev\"}\n",
      "gen.jsonl");
  EXPECT_EQ(gen.type, TaskType::kGeneration);
  EXPECT_EQ(gen.items[0].answers, (std::vector<std::string>{"4", "four"}));
  EXPECT_EQ(gen.items[0].target, "4");
  EXPECT_EQ(gen.items[1].target, " It is 6.");
  EXPECT_TRUE(gen.items[1].dev);
  EXPECT_EQ(gen.stop, (std::vector<std::string>{"\n", "."}));
  EXPECT_EQ(gen.max_new_tokens, 8);
  EXPECT_EQ(gen.name, "gen");
  EXPECT_EQ(extract_answer(" It is 6 apples", gen.regex), "6");
  EXPECT_EQ(extract_answer(" It is six", gen.regex), "");
  EXPECT_EQ(extract_answer("  42 \n", ""), "42");
  EXPECT_EQ(extract_answer("x = 17;", "\\d+"), "17");  // no group: the whole match
  EXPECT_EQ(cut_at_stop(" 4.\nQ: next", gen.stop), " 4");
  EXPECT_EQ(cut_at_stop(" 4", gen.stop), " 4");
}

// The task-type table (eval/task_types.h): an entry for every TaskType, in TaskType order, with
// every field set, so that a type added without its entry fails here rather than being reported
// as another type. Each entry's names are its own and found again, no reader takes a line of no
// schema, and a result of the type writes its primary metric under the key the entry names, with
// the value primary() reads.
TEST(TaskTypes, TableCoversEveryTypeCompletely) {
  const size_t n = size_t(TaskType::kCount);
  ASSERT_EQ(task_types().size(), n) << "a TaskType lacks its entry in eval/task_types.cpp";
  std::set<std::string> names, json_names;
  for (size_t i = 0; i < n; ++i) {
    const TaskType type = TaskType(i);
    const TaskTypeInfo& t = task_type_info(type);
    ASSERT_EQ(t.type, type) << "entry " << i << " is not in TaskType order";
    for (const char* text : {t.name, t.json_name, t.metric, t.metric_label})
      ASSERT_TRUE(text != nullptr && *text != '\0') << "entry " << i << " lacks a name, metric or label";
    ASSERT_TRUE(t.primary && t.metric_note && t.read_item && t.shot && t.evaluate && t.write_json && t.text)
        << t.name << " lacks a function";
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    EXPECT_TRUE(json_names.insert(t.json_name).second) << t.json_name;
    EXPECT_EQ(find_task_type(t.json_name), &t);
    EXPECT_FALSE(t.read_item(nlohmann::json{{"text", "c"}}, "f.jsonl", 1)) << t.name << " reads a line of no schema";
    TaskResult r;
    r.type = type;
    r.*t.primary = Accuracy{0.625, 0.125};
    EXPECT_EQ(&r.primary(), &(r.*t.primary));
    EXPECT_STREQ(r.primary_metric(), t.metric);
    const nlohmann::json j = r.to_json();
    EXPECT_EQ(j["type"], t.json_name);
    EXPECT_EQ(j["metric"], t.metric);
    EXPECT_EQ(j["accuracy"][t.metric]["value"], 0.625) << j.dump();
    EXPECT_TRUE(j.contains("chance")) << j.dump();
    EXPECT_NE(r.to_text().find(" 62.5 % ± 12.5"), std::string::npos) << r.to_text();
    EXPECT_FALSE(t.metric_note(nlohmann::json{{"chance", 0.5}}).empty());
  }
  EXPECT_EQ(find_task_type("no_such_type"), nullptr);
  expect_error([] { task_type_info(TaskType::kCount); }, {cat("task type ", size_t(TaskType::kCount), " has no entry")});
}

// Few-shot draws: the same for the same seed and item, only dev items, never the scored item
// (a dev line repeating its text), varying with the seed; the prefix shows context + gold each.
TEST(TasksFewShot, DeterministicDevOnlyNeverTheItem) {
  std::string text = "{\"task\": {\"separator\": \"\\n--\\n\"}}\n";
  for (int i = 0; i < 8; ++i)
    text += cat("{\"context\": \"dev ", i, "\", \"choices\": [\" a\", \" b\"], \"gold\": ", i % 2, ", \"split\": \"",
                i % 2 ? "dev" : "train", "\"}\n");
  for (int i = 0; i < 5; ++i) text += cat("{\"context\": \"test ", i, "\", \"choices\": [\" a\", \" b\"], \"gold\": 0}\n");
  // The same text as test item 2, marked dev: it must never be shown before test item 2.
  text += "{\"context\": \"test 2\", \"choices\": [\" a\", \" b\"], \"gold\": 0, \"split\": \"dev\"}\n";
  const Task task = parse_task(text, "shots.jsonl");
  ASSERT_EQ(task.scored().size(), 5u);
  ASSERT_EQ(task.dev().size(), 9u);
  const size_t duplicate = task.items.size() - 1, item2 = task.scored()[2];
  std::set<std::vector<size_t>> draws_of_item0;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    for (size_t i : task.scored()) {
      const auto shots = few_shot_items(task, i, 4, seed);
      EXPECT_EQ(shots, few_shot_items(task, i, 4, seed));
      EXPECT_EQ(shots.size(), 4u);
      EXPECT_EQ(std::set<size_t>(shots.begin(), shots.end()).size(), 4u) << "a shot drawn twice";
      for (size_t s : shots) {
        EXPECT_TRUE(task.items[s].dev) << "drew a scored item";
        EXPECT_NE(s, i);
        if (i == item2) {
          EXPECT_NE(s, duplicate) << "drew the scored item's own text";
        }
      }
    }
    draws_of_item0.insert(few_shot_items(task, task.scored()[0], 4, seed));
  }
  EXPECT_GT(draws_of_item0.size(), 20u) << "the seed does not change the draw";
  // Item 2's pool is the 8 dev items other than its duplicate: 8 shots fit, 9 do not.
  EXPECT_EQ(few_shot_items(task, item2, 8, 1).size(), 8u);
  expect_error([&] { few_shot_items(task, item2, 9, 1); }, {"shots.jsonl", "9 shots", "holds 8 other than the item scored"});
  EXPECT_TRUE(few_shot_items(task, item2, 0, 1).empty());
  const auto shots = few_shot_items(task, task.scored()[0], 2, 7);
  const TaskItem &a = task.items[shots[0]], &b = task.items[shots[1]];
  EXPECT_EQ(few_shot_prefix(task, shots), a.context + a.choices[size_t(a.gold)] + "\n--\n" + b.context +
                                              b.choices[size_t(b.gold)] + "\n--\n");
  // A dev file's items join the pool.
  TempDir d;
  write_file_atomic(d.path / "dev.jsonl", "{\"context\": \"x\", \"choices\": [\" a\", \" b\"], \"gold\": 1}\n");
  Task more = task;
  add_dev_file(more, d.path / "dev.jsonl");
  EXPECT_EQ(more.dev().size(), 10u);
  EXPECT_EQ(more.scored().size(), 5u);
}

// A malformed line names the file and line (blank lines counted) and what is wrong.
TEST(TasksSchema, MalformedLinesNameFileAndLine) {
  const std::string ok = "{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 0}\n";
  struct Case {
    std::string line;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 0", {"bad.jsonl:3", "not valid JSON"}},
      {"[1, 2]", {"bad.jsonl:3", "expected a JSON object, got an array of 2"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 1e999}", {"bad.jsonl:3", "number out of range"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 18446744073709551615}",
       {"bad.jsonl:3", "'gold' must be an integer index, got 18446744073709551615"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"]}", {"bad.jsonl:3", "key 'gold' is missing"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 2}", {"bad.jsonl:3", "gold index 2 is outside the 2 choices"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": \"0\"}", {"bad.jsonl:3", "'gold' must be an integer"}},
      {"{\"context\": 7, \"choices\": [\" a\", \" b\"], \"gold\": 0}", {"bad.jsonl:3", "'context' must be a string, got 7"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", 3], \"gold\": 0}", {"bad.jsonl:3", "element 1 is 3"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \"\"], \"gold\": 0}", {"bad.jsonl:3", "choice 1 is empty"}},
      {"{\"context\": \"c\", \"choices\": [\" a\"], \"gold\": 0}", {"bad.jsonl:3", "at least 2 choices"}},
      {"{\"text\": \"c\"}", {"bad.jsonl:3", "not a task item"}},
      {"{\"prompt\": \"p\", \"answers\": [\"a\"]}", {"bad.jsonl:3", "a generation item in a multiple-choice task", "line 1"}},
      {"{\"task\": {\"seed\": 1}}", {"bad.jsonl:3", "may only be the first line"}},
      {"{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": \"\"}", {"bad.jsonl:3", "'label' is empty"}},
      {"{\"ctx\": \"c\", \"endings\": \"a\", \"label\": 0}", {"bad.jsonl:3", "'endings' must be an array of strings"}},
      {"{\"question\": \"q\", \"choices\": {\"text\": [\"a\", \"b\"], \"label\": [\"A\", \"B\"]}, \"answerKey\": \"C\"}",
       {"bad.jsonl:3", "answerKey \"C\" is not one of the choice labels"}},
      {"{\"question\": \"q\", \"choices\": [\"a\", \"b\"], \"answerKey\": \"A\"}", {"bad.jsonl:3", "'text' and 'label'"}},
      {"{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 0, \"split\": 1}", {"bad.jsonl:3", "'split' must be a string"}},
  };
  for (const auto& c : cases) expect_error([&] { parse_task(ok + "\n" + c.line + "\n" + ok, "bad.jsonl"); }, c.want);
  const std::vector<Case> headers = {
      {"{\"task\": {\"shots\": -1}}", {"bad.jsonl:1", "'task.shots' must be an integer in [0, 1000], got -1"}},
      {"{\"task\": {\"sed\": 1}}", {"bad.jsonl:1", "unknown key 'task.sed'"}},
      {"{\"task\": {\"regex\": \"(\"}}", {"bad.jsonl:1", "'task.regex'", "not a valid ECMAScript regular expression"}},
      {"{\"task\": {\"stop\": [\"\"]}}", {"bad.jsonl:1", "'task.stop' holds an empty string"}},
      {"{\"task\": 3}", {"bad.jsonl:1", "'task' must be an object"}},
  };
  for (const auto& c : headers) expect_error([&] { parse_task(c.line + "\n" + ok, "bad.jsonl"); }, c.want);
  expect_error([&] { parse_task("\n\n", "empty.jsonl"); }, {"empty.jsonl", "holds no task items"});
  expect_error([&] { parse_task("{\"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 0, \"split\": \"dev\"}\n", "dev.jsonl"); },
               {"dev.jsonl", "nothing to score"});
  expect_error([&] { load_task("/nonexistent/task.jsonl"); }, {"/nonexistent/task.jsonl", "not found"});
  // Windows line ends and a byte-order mark are read.
  EXPECT_EQ(parse_task("\xEF\xBB\xBF" + ok.substr(0, ok.size() - 1) + "\r\n" + ok, "crlf.jsonl").items.size(), 2u);
}

// Mutated task files (bytes flipped, inserted, deleted, lines cut) either still parse or fail with
// one line naming the file; never another exception or a crash.
TEST(TasksSchema, MutatedFilesParseOrFailInOneLine) {
  const std::string valid = std::string(kNative) +
                            "{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": 1, \"split\": \"train\"}\n"
                            "{\"question\": \"q\", \"choices\": {\"text\": [\"a\", \"b\"], \"label\": [\"A\", \"B\"]}, "
                            "\"answerKey\": \"B\"}\n";
  ASSERT_EQ(parse_task(valid, "ok.jsonl").items.size(), 3u);
  const std::string alphabet = "{}[]\",:0-9\\\n";
  std::mt19937_64 rng(5);
  int parsed = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string s = valid;
    for (int k = 0, n = 1 + int(rng() % 3); k < n; ++k) {
      const size_t at = rng() % s.size();
      const size_t op = rng() % 5, r = rng();
      if (op == 0) s[at] = char(r % 256);
      else if (op == 1) s.insert(s.begin() + int64_t(at), alphabet[r % alphabet.size()]);
      else if (op == 2) s.erase(at, 1 + r % 8);
      else if (op == 3) s = s.substr(0, at) + s.substr(at, 1 + r % 32) + s.substr(at);
      else s.resize(at + 1);
      if (s.empty()) s.push_back('x');
    }
    try {
      parse_task(s, "fuzz.jsonl");
      ++parsed;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind("fuzz.jsonl", 0), 0u) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a depthkit::Error: " << e.what() << " on: " << printable(s);
    }
  }
  EXPECT_GT(parsed, 100);
  EXPECT_GT(refused, 1000);
}

// The built-in cloze task: the same seed gives the same bytes, another seed another file; every
// gold choice is the line that follows its passage in its held-out document; no distractor is a
// line of that document; dev items come from documents no scored item uses; gold positions vary.
TEST(TasksMakeTask, DeterministicAndGoldIsTheTrueContinuation) {
  const std::string& data = prepared_corpus();
  TempDir d;
  ClozeOptions opt;
  opt.data_dir = data;
  opt.items = 60;
  opt.dev_items = 10;
  opt.seed = 9;
  opt.out = d.str("a.jsonl");
  const ClozeResult r = make_cloze_task(opt);
  EXPECT_EQ(r.items, 60);
  EXPECT_EQ(r.dev_items, 10);
  EXPECT_EQ(r.documents, 13);
  EXPECT_EQ(r.dev_documents, 2);
  opt.out = d.str("b.jsonl");
  make_cloze_task(opt);
  EXPECT_TRUE(read_file(d.str("a.jsonl")) == read_file(d.str("b.jsonl"))) << "same seed, different files";
  opt.out = d.str("c.jsonl");
  opt.seed = 10;
  make_cloze_task(opt);
  EXPECT_TRUE(read_file(d.str("a.jsonl")) != read_file(d.str("c.jsonl"))) << "another seed, the same file";
  expect_error([&] { make_cloze_task(opt); }, {"c.jsonl", "already exists"});

  const Task task = load_task(d.str("a.jsonl"));
  EXPECT_EQ(task.name, "a");
  EXPECT_EQ(task.seed, 9u);
  EXPECT_EQ(task.scored().size(), 60u);
  EXPECT_EQ(task.dev().size(), 10u);
  const auto docs = held_out_documents(data);
  ASSERT_EQ(docs.size(), 13u);
  // The items' documents and line numbers, from the file's "source" fields.
  std::vector<nlohmann::json> sources;
  {
    std::istringstream in(read_file(d.str("a.jsonl")));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) sources.push_back(nlohmann::json::parse(line)["source"]);
  }
  ASSERT_EQ(sources.size(), task.items.size());
  std::set<int64_t> dev_docs, test_docs;
  std::vector<int64_t> gold_count(4, 0);
  for (size_t i = 0; i < task.items.size(); ++i) {
    const TaskItem& item = task.items[i];
    const std::string& doc = docs[sources[i]["document"].get<size_t>()];
    (item.dev ? dev_docs : test_docs).insert(sources[i]["document"].get<int64_t>());
    ASSERT_EQ(item.choices.size(), 4u);
    const std::string& gold = item.choices[size_t(item.gold)];
    ++gold_count[size_t(item.gold)];
    // The passage is a run of whole lines of the document, and the gold line follows it.
    const size_t at = doc.find(item.context + gold + "\n");
    ASSERT_NE(at, std::string::npos) << "item " << i;
    EXPECT_TRUE(at == 0 || doc[at - 1] == '\n') << "item " << i;
    EXPECT_LE(item.context.size(), 600u);
    EXPECT_GE(item.context.size(), 100u);
    std::vector<std::string> lines;
    std::istringstream in(doc);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    EXPECT_EQ(lines[sources[i]["line"].get<size_t>() - 1], gold) << "item " << i;
    for (size_t c = 0; c < 4; ++c) {
      if (int64_t(c) == item.gold) continue;
      EXPECT_EQ(std::find(lines.begin(), lines.end(), item.choices[c]), lines.end())
          << "item " << i << ": distractor " << c << " is a line of the item's own document";
    }
  }
  for (int64_t dd : dev_docs) EXPECT_EQ(test_docs.count(dd), 0u) << "document " << dd << " serves dev and test items";
  for (int64_t n : gold_count) EXPECT_GT(n, 5) << "gold positions are not spread over the choices";
  // Too few held-out documents, a missing corpus.
  opt.out = d.str("x.jsonl");
  opt.data_dir = d.str("nowhere");
  expect_error([&] { make_cloze_task(opt); }, {"nowhere/tokenizer.model", "not found"});
  EXPECT_FALSE(fs::exists(d.str("x.jsonl")));
}

// Generation: greedy decoding through generate(), cut at the stop string, the answer extracted by
// the task's regex and matched exactly; the outputs equal generate()'s own greedy continuation.
TEST(TasksGeneration, GreedyUntilStopThenExactMatch) {
  const std::string& data = prepared_corpus();
  Tokenizer tok(data + "/tokenizer.model");
  const auto owner = sharp_model("residual", 400, 48);
  Transformer& model = *owner;
  const std::vector<std::string> prompts = {"the module returns", "when called with", "this example shows how",
                                            "a list of", "the file"};
  // What greedy decoding gives for each prompt, computed here with generate() alone.
  const Sampling greedy{.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 0};
  std::vector<std::vector<int>> ids;
  for (const auto& p : prompts) {
    std::vector<int> v = {tok.eos_id()};
    const auto e = tok.encode(p);
    v.insert(v.end(), e.begin(), e.end());
    ids.push_back(v);
  }
  const Generation g = generate(model, ids, 6, greedy, tok.eos_id());
  const std::vector<std::string> stop = {"."};
  std::vector<std::string> expected;
  for (auto t : g.tokens) {
    if (!t.empty() && t.back() == tok.eos_id()) t.pop_back();
    expected.push_back(cut_at_stop(tok.decode(t), stop));
  }
  // References: right for the first two items whose greedy answer is not blank (their own
  // answer; a blank reference is refused), wrong for the others.
  std::string text = "{\"task\": {\"stop\": [\".\"], \"max_new_tokens\": 6}}\n";
  std::vector<double> right;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string own = extract_answer(expected[i], "");
    right.push_back(!own.empty() && std::count(right.begin(), right.end(), 1.0) < 2 ? 1.0 : 0.0);
    text += nlohmann::json({{"prompt", prompts[i]}, {"answers", {right.back() ? own : "no such answer"}}}).dump() + "\n";
  }
  ASSERT_EQ(std::count(right.begin(), right.end(), 1.0), 2) << "fewer than two prompts with a non-blank greedy answer";
  const Task task = parse_task(text, "gen.jsonl");
  TaskOptions opt;
  opt.progress = false;
  opt.generation_batch = 2;  // several calls of generate()
  const TaskResult r = evaluate_task(model, tok, task, opt);
  ASSERT_EQ(r.outputs.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(r.outputs[i], expected[i]) << i;
  for (const auto& o : r.outputs) EXPECT_EQ(o.find('.'), std::string::npos);
  EXPECT_DOUBLE_EQ(r.exact_match.value, 0.4);
  EXPECT_DOUBLE_EQ(r.exact_match.standard_error, mean_with_stderr(right).standard_error);
  EXPECT_EQ(r.to_json()["metric"], "exact_match");
  EXPECT_EQ(r.truncated, 0);
  // A prompt longer than the room left for the answer is cut from the left and counted.
  std::string long_prompt;
  for (int i = 0; i < 30; ++i) long_prompt += "the module returns a list. ";
  const Task long_task = parse_task("{\"task\": {\"max_new_tokens\": 6}}\n" +
                                        nlohmann::json({{"prompt", long_prompt}, {"answers", {"x"}}}).dump() + "\n",
                                    "long.jsonl");
  EXPECT_EQ(evaluate_task(model, tok, long_task, opt).truncated, 1);
  const Task no_room = parse_task("{\"task\": {\"max_new_tokens\": 48}}\n{\"prompt\": \"a\", \"answers\": [\"b\"]}\n", "room.jsonl");
  expect_error([&] { evaluate_task(model, tok, no_room, opt); }, {"room.jsonl", "max_new_tokens 48 leaves no room"});
}

// A blank reference answer would match every output the regex misses; a second header would
// silently replace the first.
TEST(TasksSchema, RefusesBlankAnswersAndASecondHeader) {
  expect_error([] { parse_task("{\"prompt\": \"p\", \"answers\": [\"a\", \" \"]}\n", "g.jsonl"); },
               {"g.jsonl:1", "blank answer"});
  expect_error([] { parse_task("{\"task\": {\"seed\": 1}}\n\n{\"task\": {\"seed\": 2}}\n{\"prompt\": \"p\", \"answers\": \"a\"}\n", "g.jsonl"); },
               {"g.jsonl:3", "may only be the first line"});
}

}  // namespace depthkit::test
