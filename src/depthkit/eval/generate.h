// Text generation with the incremental decoder (Transformer::start_decoding / extend): the
// prompts are prefilled in one forward, then every unfinished sequence advances one position per
// step. Sampling is temperature → top-k → top-p (nucleus) over the next-token distribution, with
// one seeded generator, so a run is reproducible; temperature 0 (or top-k 1) is greedy.
#pragma once
#include <cstdint>
#include <ATen/core/Tensor.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

namespace depthkit {

class Transformer;

struct Sampling {
  double temperature = 1.0;  // 0: greedy (argmax; ties to the lower id)
  int64_t top_k = 0;         // 0: all ids
  double top_p = 1.0;        // 1: all ids
  uint64_t seed = 0;
};

struct Generation {
  std::vector<std::vector<int>> tokens;  // per prompt, the generated ids (without the prompt; with the
                                         // end-of-document id when it ended the sequence)
  // Per prompt, why it ended: "eos" (end-of-document), "stop" (on_token said so), "limit"
  // (max_new_tokens), "context" (prompt and generated ids fill model.seq_len).
  std::vector<std::string> stopped;
  int64_t prefill_tokens = 0, decode_tokens = 0;  // positions run by the prefill, by the decode steps
  double prefill_seconds = 0, decode_seconds = 0;
};

// The next id from one row of logits [V]: the argmax at temperature 0; otherwise one draw from
// `rng` over the temperature-scaled distribution restricted to its top-k ids, then to its smallest
// nucleus of mass ≥ top_p. Ids are ranked by logit with ties to the lower id, so greedy and top-k
// = 1 agree.
int sample_next(const at::Tensor& logits, const Sampling& sampling, std::mt19937_64& rng);

// Called with (prompt index, the id just generated), for every id but the end-of-document;
// returning false finishes that sequence (a stop string found). The id is already in `tokens`.
using OnToken = std::function<bool(size_t sequence, int token)>;

// Generates up to `max_new_tokens` ids after each prompt (non-empty, ids < vocabulary), stopping a
// sequence at `eos` (when ≥ 0) or when it reaches the model's context (model.seq_len positions).
// A prompt longer than model.seq_len is refused, naming it. Runs without gradients.
Generation generate(Transformer& model, const std::vector<std::vector<int>>& prompts, int64_t max_new_tokens,
                    const Sampling& sampling, int eos, const OnToken& on_token = {});

}  // namespace depthkit
