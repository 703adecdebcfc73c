#include "depthkit/eval/task_scoring.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/logsumexp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <regex>

#include "depthkit/data/tokenizer.h"
#include "depthkit/eval/generate.h"
#include "depthkit/model/transformer.h"
#include "depthkit/util/error.h"
#include "depthkit/util/progress.h"
#include "depthkit/util/text.h"

namespace depthkit {

namespace {

using nlohmann::json;

// The default positions per forward: the logits of a batch, [positions, vocabulary] floats, kept
// to 64 MiB (with as much again for the log-sum-exp's temporary).
int64_t default_batch_tokens(int64_t seq_len, int64_t vocab) {
  return std::max<int64_t>(seq_len, (int64_t(1) << 24) / std::max<int64_t>(1, vocab));
}

// The position of the earliest stop string in `text`, npos when none occurs.
size_t find_stop(const std::string& text, const std::vector<std::string>& stop) {
  size_t at = std::string::npos;
  for (const auto& s : stop) at = std::min(at, text.find(s));
  return at;
}

}  // namespace

Continuation harness_split(const Tokenizer& tok, const std::string& context, const std::string& continuation) {
  // The harness moves the context's trailing whitespace into the continuation ("Answer: " + "5" is
  // scored as "Answer:" + " 5"), so that a word's leading space is tokenized with the word.
  const std::string kept = context.substr(0, context.size() - trailing_python_space(context));
  Continuation out;
  out.context = {tok.eos_id()};
  const auto ctx = tok.encode(kept);
  out.context.insert(out.context.end(), ctx.begin(), ctx.end());
  // The whole text is tokenized at once and cut after as many ids as the context alone has, as the
  // harness does: where the two tokenizations differ at the seam (a piece spanning it), the
  // continuation is what follows the context's count of ids in the whole, not encode(continuation).
  std::vector<int> whole = {tok.eos_id()};
  const auto all = tok.encode(context + continuation);
  whole.insert(whole.end(), all.begin(), all.end());
  if (whole.size() > out.context.size()) out.continuation.assign(whole.begin() + int64_t(out.context.size()), whole.end());
  return out;
}

void evaluate_choice_items(Transformer& model, const Tokenizer& tok, const Task& task, const std::vector<size_t>& scored,
                           const TaskOptions& opt, TaskResult& r) {
  const int64_t T = model.config().seq_len;
  std::vector<Continuation> requests;
  std::vector<size_t> first_request(scored.size() + 1, 0);  // item i's candidates: [first[i], first[i+1])
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    // Every sequence starts with the end-of-document id: the model saw each training document
    // begin after one, so the context reads as the start of a document (the harness's BOS).
    const std::string context = few_shot_prefix(task, few_shot_items(task, scored[i], r.shots, r.seed)) + item.context;
    first_request[i] = requests.size();
    for (size_t c = 0; c < item.choices.size(); ++c) {
      Continuation q = harness_split(tok, context, item.choices[c]);
      if (q.continuation.empty())
        fail(task.file, ":", item.line, ": choice ", c, " adds no token to its context (tokenized together, the context's "
             "tokens already cover it)");
      if (int64_t(q.continuation.size()) > T)
        fail(task.file, ":", item.line, ": choice ", c, " is ", q.continuation.size(),
             " tokens, more than the model's whole context (model.seq_len ", T, ") holds");
      requests.push_back(std::move(q));
    }
  }
  first_request[scored.size()] = requests.size();
  std::vector<size_t> owner(requests.size()), remaining(scored.size());
  for (size_t i = 0; i < scored.size(); ++i) {
    remaining[i] = first_request[i + 1] - first_request[i];
    for (size_t q = first_request[i]; q < first_request[i + 1]; ++q) owner[q] = i;
  }
  Progress bar("score " + task.name, int64_t(scored.size()), "items");
  int64_t items_done = 0;
  auto on_scored = [&](size_t q) {
    if (--remaining[owner[q]] == 0 && opt.progress) {
      ++items_done;
      bar.update(items_done, double(items_done));
    }
  };
  if (opt.progress) bar.update(0, 0);  // the rate and ETA count from here
  const auto scores = score_continuations(model, requests, opt.batch_tokens, on_scored);
  if (opt.progress) bar.finish();

  std::vector<double> right_total, right_token, right_byte, right_char;
  double chance = 0;
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    ChoiceItemScores s;
    s.line = item.line;
    s.gold = item.gold;
    auto better = [](double a, double b) { return a > b; };  // ties keep the first candidate
    double best_total = 0, best_token = 0, best_byte = 0, best_char = 0;
    for (size_t c = 0; c < item.choices.size(); ++c) {
      const ContinuationScore& q = scores[first_request[i] + c];
      const double total = q.logprob, token = q.logprob / double(q.tokens),
                   byte = q.logprob / double(item.choices[c].size()),
                   // The harness's acc_norm: numpy's float64 division, as here (a choice of no
                   // characters gives −inf, never chosen).
                   character = q.logprob / double(item.characters(c));
      if (c == 0 || better(total, best_total)) best_total = total, s.total = int64_t(c);
      if (c == 0 || better(token, best_token)) best_token = token, s.per_token = int64_t(c);
      if (c == 0 || better(byte, best_byte)) best_byte = byte, s.per_byte = int64_t(c);
      if (c == 0 || better(character, best_char)) best_char = character, s.acc_norm = int64_t(c);
      s.logprob.push_back(q.logprob);
      s.tokens.push_back(q.tokens);
      r.truncated += q.truncated;
      // Positions run: the context as kept, the continuation, less its last id (never an input).
      r.tokens += std::min<int64_t>(int64_t(requests[first_request[i] + c].context.size()), T + 1 - q.tokens) +
                  q.tokens - 1;
    }
    right_total.push_back(s.total == item.gold);
    right_token.push_back(s.per_token == item.gold);
    right_byte.push_back(s.per_byte == item.gold);
    right_char.push_back(s.acc_norm == item.gold);
    r.predictions.push_back(s.per_token);
    r.lines.push_back(item.line);
    r.choice_items.push_back(std::move(s));
    chance += 1.0 / double(item.choices.size());
  }
  r.sequences = int64_t(requests.size());
  r.total = mean_with_stderr(right_total);
  r.per_token = mean_with_stderr(right_token);
  r.per_byte = mean_with_stderr(right_byte);
  r.acc_norm = mean_with_stderr(right_char);
  r.chance = chance / double(scored.size());
}

void evaluate_generation_items(Transformer& model, const Tokenizer& tok, const Task& task,
                               const std::vector<size_t>& scored, const TaskOptions& opt, TaskResult& r) {
  const int64_t T = model.config().seq_len;
  // The prompt keeps room for the whole answer: at most seq_len − max_new_tokens ids.
  const int64_t room = T - task.max_new_tokens;
  if (room < 1)
    fail(task.file, ": task.max_new_tokens ", task.max_new_tokens, " leaves no room for a prompt in the model's context (model.seq_len ",
         T, ")");
  std::vector<std::vector<int>> prompts;
  for (size_t i = 0; i < scored.size(); ++i) {
    const TaskItem& item = task.items[scored[i]];
    std::vector<int> ids = {tok.eos_id()};
    const auto text = tok.encode(few_shot_prefix(task, few_shot_items(task, scored[i], r.shots, r.seed)) + item.prompt);
    ids.insert(ids.end(), text.begin(), text.end());
    if (int64_t(ids.size()) > room) {  // cut from the left: the prompt's end is what the answer continues
      ids.erase(ids.begin(), ids.end() - room);
      ++r.truncated;
    }
    prompts.push_back(std::move(ids));
  }
  Progress bar("generate " + task.name, int64_t(scored.size()), "items");
  if (opt.progress) bar.update(0, 0);
  const Sampling greedy{.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 0};
  const int64_t per_batch = std::max<int64_t>(1, opt.generation_batch);
  std::vector<double> right;
  for (size_t start = 0; start < prompts.size(); start += size_t(per_batch)) {
    const size_t n = std::min(prompts.size() - start, size_t(per_batch));
    const std::vector<std::vector<int>> batch(prompts.begin() + int64_t(start), prompts.begin() + int64_t(start + n));
    std::vector<std::vector<int>> generated(n);
    // A sequence ends as soon as its decoded text holds a stop string.
    auto on_token = [&](size_t s, int id) {  // never called with the end-of-document id
      generated[s].push_back(id);
      return find_stop(tok.decode(generated[s]), task.stop) == std::string::npos;
    };
    const Generation g = generate(model, batch, task.max_new_tokens, greedy, tok.eos_id(), on_token);
    r.tokens += g.prefill_tokens + g.decode_tokens;
    for (size_t s = 0; s < n; ++s) {
      std::vector<int> ids = g.tokens[s];
      if (!ids.empty() && ids.back() == tok.eos_id()) ids.pop_back();
      const std::string text = cut_at_stop(tok.decode(ids), task.stop);
      const std::string answer = extract_answer(text, task.regex);
      const auto& refs = task.items[scored[start + s]].answers;
      const bool ok = std::any_of(refs.begin(), refs.end(), [&](const std::string& a) { return strip(a) == answer; });
      right.push_back(ok);
      r.predictions.push_back(ok);
      r.lines.push_back(task.items[scored[start + s]].line);
      r.outputs.push_back(text);
    }
    if (opt.progress) bar.update(int64_t(start + n), double(start + n));
  }
  if (opt.progress) bar.finish();
  r.sequences = int64_t(prompts.size());
  r.exact_match = mean_with_stderr(right);
}

std::vector<ContinuationScore> score_continuations(Transformer& model, const std::vector<Continuation>& requests,
                                                   int64_t batch_tokens, const std::function<void(size_t)>& on_scored) {
  const int64_t T = model.config().seq_len, V = model.config().vocab_size;
  if (batch_tokens <= 0) batch_tokens = default_batch_tokens(T, V);
  std::vector<ContinuationScore> out(requests.size());
  // What each request runs: the context's last `keep` ids, then the continuation; the model reads
  // all but the last id and predicts from position keep − 1 on.
  std::vector<int64_t> keep(requests.size()), length(requests.size());
  for (size_t q = 0; q < requests.size(); ++q) {
    const auto& r = requests[q];
    const int64_t n_ctx = int64_t(r.context.size()), n_cont = int64_t(r.continuation.size());
    if (n_ctx < 1 || n_cont < 1) fail("score_continuations: request ", q, " has an empty context or continuation");
    if (n_cont > T)
      fail("score_continuations: request ", q, "'s continuation of ", n_cont, " tokens exceeds model.seq_len ", T);
    for (const auto* ids : {&r.context, &r.continuation})
      for (int id : *ids)
        if (id < 0 || id >= V) fail("score_continuations: token id ", id, " is outside the vocabulary of ", V);
    keep[q] = std::min(n_ctx, T + 1 - n_cont);
    out[q].truncated = keep[q] < n_ctx;
    out[q].tokens = n_cont;
    length[q] = keep[q] + n_cont - 1;
  }
  // Longest first, so that a batch's rows are about as long as its first (little padding).
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return length[a] > length[b]; });

  at::NoGradGuard no_grad;
  const at::Device device = model.parameters().device();
  for (size_t start = 0; start < order.size();) {
    const int64_t L = length[order[start]];
    const size_t rows = std::min(order.size() - start, size_t(std::max<int64_t>(1, batch_tokens / L)));
    // Right-padded with id 0: a padded position is after every real one of its row, and the
    // causal model lets no position see later ones, so padding changes no scored logit.
    at::Tensor input = at::empty({int64_t(rows), L}, at::kLong), target = at::empty({int64_t(rows), L}, at::kLong);
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* tg = target.data_ptr<int64_t>();
    std::fill(in, in + rows * size_t(L), 0);
    std::fill(tg, tg + rows * size_t(L), 0);
    for (size_t k = 0; k < rows; ++k) {
      const auto& r = requests[order[start + k]];
      std::vector<int64_t> ids(r.context.end() - keep[order[start + k]], r.context.end());
      ids.insert(ids.end(), r.continuation.begin(), r.continuation.end());
      for (int64_t t = 0; t + 1 < int64_t(ids.size()); ++t) {
        in[int64_t(k) * L + t] = ids[size_t(t)];
        tg[int64_t(k) * L + t] = ids[size_t(t) + 1];
      }
    }
    Building building(cat("the logits of ", rows, " sequences of ", L, " tokens"));
    const at::Tensor logits = model.logits(input.to(device));  // [rows, L, V]
    const at::Tensor picked = logits.gather(-1, target.to(device).unsqueeze(-1)).squeeze(-1);
    const at::Tensor logprob = (picked - at::logsumexp(logits, {-1})).to(at::kDouble).cpu().contiguous();
    const double* lp = logprob.data_ptr<double>();
    for (size_t k = 0; k < rows; ++k) {
      const size_t q = order[start + k];
      double sum = 0;
      for (int64_t t = keep[q] - 1; t < length[q]; ++t) sum += lp[int64_t(k) * L + t];
      out[q].logprob = sum;
      if (on_scored) on_scored(q);
    }
    start += rows;
  }
  return out;
}

std::string cut_at_stop(const std::string& text, const std::vector<std::string>& stop) {
  return text.substr(0, find_stop(text, stop));
}

std::string extract_answer(const std::string& text, const std::string& regex) {
  if (regex.empty()) return std::string(strip(text));
  const std::regex re(regex);  // checked when the task was read
  std::smatch m;
  if (!std::regex_search(text, m, re)) return "";
  return std::string(strip(m.size() > 1 && m[1].matched ? m[1].str() : m[0].str()));
}

Accuracy mean_with_stderr(const std::vector<double>& scores) {
  Accuracy a;
  const double n = double(scores.size());
  if (scores.empty()) return a;
  for (double s : scores) a.value += s;
  a.value /= n;
  if (scores.size() < 2) return a;
  double ss = 0;
  for (double s : scores) ss += (s - a.value) * (s - a.value);
  a.standard_error = std::sqrt(ss / (n - 1) / n);
  return a;
}

TaskResult evaluate_task(Transformer& model, const Tokenizer& tokenizer, const Task& task, const TaskOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  TaskResult r;
  r.name = task.name;
  r.file = task.file;
  r.type = task.type;
  r.shots = opt.shots >= 0 ? opt.shots : task.shots;
  r.seed = opt.seed.value_or(task.seed);
  r.per_item = opt.per_item;
  if (tokenizer.vocab_size() > model.config().vocab_size)
    fail(tokenizer.path(), ": tokenizer has ", tokenizer.vocab_size(), " ids, more than the model's model.vocab_size ",
         model.config().vocab_size);
  auto scored = task.scored();
  if (opt.limit > 0 && int64_t(scored.size()) > opt.limit) scored.resize(size_t(opt.limit));
  r.items = int64_t(scored.size());
  task_type_info(task.type).evaluate(model, tokenizer, task, scored, opt, r);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

const Accuracy& TaskResult::primary() const { return this->*task_type_info(type).primary; }

const char* TaskResult::primary_metric() const { return task_type_info(type).metric; }

json TaskResult::to_json() const {
  const TaskTypeInfo& info = task_type_info(type);
  json j = {{"task", name},   {"file", file},         {"items", items},     {"shots", shots},
            {"seed", seed},   {"sequences", sequences}, {"truncated", truncated}, {"tokens", tokens},
            {"seconds", seconds}, {"metric", info.metric}, {"type", info.json_name}};
  info.write_json(*this, j);  // "accuracy" and "chance"
  return j;
}

std::string TaskResult::to_text() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %s tokens in %.1f s\n", format_count(double(tokens)).c_str(), seconds);
  return cat(name, " (", file, "): ", items, " items, ", shots, "-shot, ") + task_type_info(type).text(*this) + buf;
}

}  // namespace depthkit
