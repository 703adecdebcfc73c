"""A depthkit run as an lm-evaluation-harness model ("depthkit"), pinned to lm-eval 0.4.13.

    python -m depthkit.lm_eval --model depthkit --model_args path=runs/quickstart \\
        --tasks hellaswag --batch_size 16

``python -m depthkit.lm_eval`` registers the model and hands its arguments to lm_eval's own command
line (lm_eval's CLI only knows registered models). From Python: ``import depthkit.lm_eval`` (which
registers "depthkit"), then ``lm_eval.simple_evaluate(model="depthkit", model_args="path=...")``,
or pass ``DepthkitLM(path=...)`` itself. This module imports lm_eval, so ``import depthkit`` does not
import it.

model_args: ``path`` (a run directory or a checkpoint, what ``depthkit.load`` takes), ``device``
("cpu", "cuda", ...; as HFLM, the GPU when CUDA is available, else the CPU, also when the command
line's default "cuda:0" is asked for on a machine without CUDA), ``batch_size`` (sequences per forward; "auto": a budget of
positions, as ``depthkit eval`` sizes its batches), ``max_gen_toks`` (generate_until's default,
256 as HFLM's).

How it scores, and why (docs/tasks.md says the same of ``depthkit eval --task``, which agrees with
it item by item):

- **Tokenization as HFLM's.** loglikelihood is lm_eval's own ``TemplateLM.loglikelihood`` and
  ``_encode_pair``: the context's trailing whitespace moves to the continuation; the context is
  encoded alone, the context and continuation together, and the continuation's ids are those of
  the whole after as many ids as the context alone has. ``tok_encode`` behaves as a Hugging Face
  tokenizer that adds a BOS: with special tokens (the default) it puts the run's end-of-document id
  first. That id plays the BOS: depthkit trained every document to begin after one, so a context
  reads as the start of a document (``prefix_token_id`` is the same id, for an empty context).
- **Too long.** As HFLM: context + continuation is cut from the left to seq_len + 1 ids, the
  continuation never (one longer than seq_len is an error).
- **Log-likelihoods** are float32 log-softmax values summed in float64 (as ``depthkit eval``
  sums them), with HFLM's is_greedy (every continuation id the argmax at its position).
- **loglikelihood_rolling**: HFLM's windows (lm_eval.utils.get_rolling_token_windows with
  context_len 1, made disjoint) over the text's ids without special tokens, the first predicted
  from the end-of-document id: every id is predicted exactly once, with as much context as fits.
  (HFLM encodes with its tokenizer's default, which for a BOS-adding tokenizer would score the BOS
  too; here the text's own ids are scored, as for GPT-2.)
- **generate_until**: greedy (ties to the lower id), the prompt encoded as in loglikelihood and cut
  from the left to seq_len − max_gen_toks ids; decoding stops at the end-of-document id, after
  max_gen_toks ids, or once the decoded text holds one of ``until``; the text is then cut before
  the first stop string (lm_eval's own postprocess_generated_text). Sampling is refused.
"""
from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

__all__ = ["DepthkitLM", "main"]

log = logging.getLogger(__name__)

# batch_size "auto": the logits of a forward, [positions, vocabulary] float32, kept to 64 MiB, as
# `depthkit eval` keeps them (score_continuations' default).
_AUTO_LOGIT_FLOATS = 1 << 24


def _load(path, device):
    # Imported here so that importing this module (registering the model) loads no run.
    import depthkit

    # In the precision the run trained in, as `depthkit eval` scores it.
    return depthkit.load(path, device=device, compute_dtype="trained")


class DepthkitLM(TemplateLM):
    """lm-evaluation-harness's model for a depthkit run: ``DepthkitLM(path=RUN_OR_CHECKPOINT)``,
    or ``DepthkitLM(model=module)`` with a module as ``depthkit.load`` returns (``model(tokens)``
    → logits [B, T, V], ``.tokenizer``, ``.config``)."""

    backend = "causal"

    def __init__(self, path=None, device=None, batch_size=16, max_batch_size=None, max_gen_toks=256, model=None,
                 **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"depthkit: unknown model_args {sorted(unknown)} (known: path, device, batch_size, "
                             "max_gen_toks)")
        if (path is None) == (model is None):
            raise ValueError("depthkit: give model_args path=RUN_DIR_OR_CHECKPOINT")
        self._path = str(path) if path is not None else None
        self._device = self._pick_device(device)
        module = _load(path, self._device) if model is None else model
        self._model = module.to(self._device).eval()
        self.tokenizer = module.tokenizer
        self._max_length = int(module.config["model"]["seq_len"])
        self._vocab = int(module.config["model"]["vocab_size"])
        self._max_gen_toks = int(max_gen_toks)
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            self._batch_size = "auto"
        else:
            self._batch_size = int(batch_size)
            if self._batch_size < 1:
                raise ValueError(f"depthkit: batch_size {batch_size} must be at least 1 (or auto)")
        self._max_batch_size = int(max_batch_size) if max_batch_size is not None else None

    @staticmethod
    def _pick_device(device):
        # lm_eval's command line passes device "cuda:0" unless told otherwise; as HFLM, a CUDA device
        # on a machine without CUDA (or no device) means the GPU when there is one, else the CPU.
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:
                log.warning("depthkit: device %s requested but CUDA is not available; using the CPU", device)
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(device)

    # --- what lm_eval asks of a model -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self):
        return self._batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"depthkit:{self._path}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # As a Hugging Face tokenizer that adds a BOS: special tokens by default, and the end-of-
        # document id is depthkit's BOS (the module's docstring says why).
        ids = list(self.tokenizer.encode(string))
        if add_special_tokens is None or add_special_tokens:
            ids = [self.eot_token_id] + ids
        return ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in tokens]
        if skip_special_tokens:
            ids = [t for t in ids if t != self.eot_token_id]
        return self.tokenizer.decode(ids)

    # --- scoring ----------------------------------------------------------------------------

    def _rows_per_forward(self, length: int) -> int:
        if self._batch_size == "auto":
            rows = max(1, max(self._max_length, _AUTO_LOGIT_FLOATS // max(1, self._vocab)) // max(1, length))
            return min(rows, self._max_batch_size) if self._max_batch_size else rows
        return self._batch_size

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(request strings or None, context ids, continuation ids) → (log P(continuation), is_greedy),
        in request order. The model reads (context + continuation)[-(seq_len + 1):][:-1], as HFLM."""
        inputs = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("depthkit: a request with an empty context or continuation (after the harness's split)")
            if len(continuation) > self._max_length:
                raise ValueError(f"depthkit: a continuation of {len(continuation)} tokens exceeds the model's seq_len "
                                 f"{self._max_length}")
            inputs.append((context + continuation)[-(self._max_length + 1):][:-1])
        # Longest first, as HFLM's Collator: a batch is as long as its first row, with little padding.
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        results = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="depthkit loglikelihood")
        start = 0
        while start < len(order):
            length = len(inputs[order[start]])
            rows = order[start:start + self._rows_per_forward(length)]
            # Right-padded with id 0: a causal model's positions never see later ones, so the
            # padding changes no scored logit.
            batch = torch.zeros(len(rows), length, dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(inputs[i])] = torch.tensor(inputs[i], dtype=torch.long)
            logprobs = F.log_softmax(self._model(batch.to(self._device)).float(), dim=-1)
            for r, i in enumerate(rows):
                strings, _, continuation = requests[i]
                n, m = len(inputs[i]), len(continuation)
                # The positions whose next id is a continuation id: the input's last m.
                scored = logprobs[r, n - m:n]
                target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
                picked = scored.gather(-1, target.unsqueeze(-1)).squeeze(-1)
                answer = (float(picked.double().sum()), bool((scored.argmax(-1) == target).all()))
                results[i] = answer
                if strings is not None:
                    self.cache_hook.add_partial("loglikelihood", strings, answer)
                bar.update(1)
            start += len(rows)
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(string, add_special_tokens=False)
            for context, predicted in map(lm_utils.make_disjoint_window,
                                          lm_utils.get_rolling_token_windows(token_list=ids,
                                                                             prefix_token=self.prefix_token_id,
                                                                             max_seq_len=self._max_length,
                                                                             context_len=1)):
                windows.append((None, context, predicted))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, scores):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for req in tqdm(requests, disable=disable_tqdm, desc="depthkit generate_until"):
            context, gen_kwargs = req.args
            results.append(self._generate_one(context, dict(gen_kwargs or {})))
            self.cache_hook.add_partial("generate_until", req.args, results[-1])
        return results

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        kwargs = normalize_gen_kwargs(gen_kwargs, self._max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError("depthkit: generate_until decodes greedily; this task asks for sampling (do_sample)")
        # The end-of-document id ends decoding by its id (it decodes to no text, so it is no stop string).
        until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=None) if s]
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        room = self._max_length - max_gen_toks
        if room < 1:
            raise ValueError(f"depthkit: max_gen_toks {max_gen_toks} leaves no room for a prompt in the model's "
                             f"seq_len {self._max_length}")
        ids = self.tok_encode(context)[-room:]  # cut from the left: the prompt's end is what is continued
        generated: list[int] = []
        for _ in range(max_gen_toks):
            logits = self._model(torch.tensor([ids + generated], dtype=torch.long, device=self._device))
            token = int(logits[0, -1].float().argmax())  # ties: the first maximum, the lower id
            if token == self.eot_token_id:
                break
            generated.append(token)
            if any(stop in self.tok_decode(generated) for stop in until):
                break
        return postprocess_generated_text(self.tok_decode(generated), stop=until, think_end_token=None)


# Registered from the importable module only: under `python -m depthkit.lm_eval` this file also runs
# as __main__, and a second class under the same name would collide in lm_eval's registry.
if __name__ != "__main__":
    register_model("depthkit")(DepthkitLM)


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with "depthkit" registered: ``python -m depthkit.lm_eval ARGS``."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    cli_evaluate()


if __name__ == "__main__":
    import depthkit.lm_eval as registered  # the importable module, which registers "depthkit"

    registered.main()
