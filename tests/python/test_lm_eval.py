"""lm-evaluation-harness on a depthkit run (depthkit.lm_eval), against depthkit's own scorer.

- `depthkit eval --task` and lm_eval agree item by item on a small trained run: the real hellaswag
  and arc_easy task configs of the installed lm_eval (included as they are; only the data come from
  local files, so nothing is downloaded), and depthkit's native schema through a task with
  target_delimiter "" (contexts ending in blanks, an empty context, a piece spanning the seam of
  context and continuation). Every candidate's log-likelihood, each item's choice by acc and
  acc_norm, and the totals.
- loglikelihood_rolling is the sum of the text's per-token log-probabilities computed here.
- generate_until is greedy, honours max_gen_toks and stops at a stop string.
- `python -m depthkit.lm_eval` runs lm_eval's own command line end to end on a local task.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

# No hub access, and the datasets cache out of the home directory: set before `datasets` is imported
# (lm_eval imports it), and passed on to the command-line run below.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import lm_eval  # noqa: E402
import lm_eval.tasks  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

import depthkit.lm_eval as dk_lm_eval  # noqa: E402  (registers the model "depthkit")
from conftest import SOURCE_DIR  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent / "data"
LM_EVAL_TASKS = pathlib.Path(lm_eval.tasks.__file__).resolve().parent
CORPUS = pathlib.Path("/usr/share/doc/python3.11/html/_sources/tutorial")  # as tests/cli_tasks.sh
SEQ_LEN = 64  # short, so that some HellaSwag contexts are cut from the left (the harness's way)

# The three tasks: depthkit's file, lm_eval's task name, and the choices lm_eval divides by for
# acc_norm (its doc_to_choice of a logged doc).
TASKS = {
    "hellaswag": ("hellaswag.jsonl", "dk_hellaswag", lambda doc: doc["choices"]),
    "arc_easy": ("arc_easy.jsonl", "dk_arc_easy", lambda doc: doc["choices"]["text"]),
    "native": ("native.jsonl", "dk_native", lambda doc: doc["choices"]),
}


def run(cmd, **kwargs):
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, depthkit_program):
    """A small run trained a few dozen steps on the bundled corpus (tests/cli_tasks.sh's recipe):
    its candidates' scores differ, so the choices are not ties."""
    if not CORPUS.is_dir():
        pytest.fail(f"{CORPUS} missing (scripts/setup installs python3.11-doc)")
    work = tmp_path_factory.mktemp("lm_eval_run")
    run([depthkit_program, "data", "prepare", "--input", str(CORPUS), "--out", str(work / "data"),
         "--vocab-size", "512", "--val-fraction", "0.2", "--json"])
    sets = {"model.vocab_size": 512, "model.seq_len": SEQ_LEN, "model.d_model": 64, "model.d_ff": 128,
            "model.n_layers": 2, "train.micro_batch": 4, "data.dir": str(work / "data"), "train.eval_tokens": 1024,
            "train.eval_every": 0, "train.checkpoint_every": 0, "optim.warmup_steps": 5, "train.steps": 120}
    cmd = [depthkit_program, "train", "--config", str(SOURCE_DIR / "configs" / "tiny.toml"), "--run-dir",
           str(work / "run"), "--json"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    run(cmd)
    return work / "run"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """lm_eval task configs over the local files: the installed hellaswag and arc_easy configs
    included as they are (process_docs, doc_to_text, doc_to_choice, target, metrics), with only
    the data source replaced; the native schema as a plain multiple-choice task."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    native_items = d / "native_items.jsonl"  # lm_eval reads items only: the file less its header
    native_items.write_text("".join(line for line in (DATA / "native.jsonl").read_text().splitlines(True)
                                    if "task" not in json.loads(line)))
    (d / "dk_hellaswag.yaml").write_text(
        f"include: {LM_EVAL_TASKS / 'hellaswag' / 'hellaswag.yaml'}\n"
        "task: dk_hellaswag\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {DATA / 'hellaswag.jsonl'}\n"
        "training_split: null\n")
    (d / "dk_arc_easy.yaml").write_text(
        f"include: {LM_EVAL_TASKS / 'arc' / 'arc_easy.yaml'}\n"
        "task: dk_arc_easy\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA / 'arc_easy.jsonl'}\n"
        "training_split: null\nvalidation_split: null\n")
    # depthkit's native choice is the whole continuation (its leading space included): lm_eval's
    # target_delimiter "" with the choices as they are.
    (d / "dk_native.yaml").write_text(
        "task: dk_native\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {native_items}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return d


@pytest.fixture(scope="module")
def lm(run_dir):
    return dk_lm_eval.DepthkitLM(path=str(run_dir), batch_size=8)


@pytest.fixture(scope="module")
def harness(lm, task_dir, tmp_path_factory):
    """lm_eval's scores of the three tasks, with every sample logged."""
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
    manager = lm_eval.tasks.TaskManager(include_path=str(task_dir))
    return lm_eval.simple_evaluate(model=lm, tasks=[t[1] for t in TASKS.values()], task_manager=manager,
                                   log_samples=True)


@pytest.mark.parametrize("task", list(TASKS))
def test_depthkit_eval_agrees_with_lm_eval_item_by_item(task, run_dir, harness, depthkit_program):
    file, name, doc_choices = TASKS[task]
    ours = json.loads(run([depthkit_program, "eval", "--run-dir", str(run_dir), "--task", str(DATA / file), "--json",
                           "--per-item"]).stdout)
    samples = sorted(harness["samples"][name], key=lambda s: s["doc_id"])
    assert len(ours["per_item"]) == len(samples) == ours["items"] > 0
    right = {"acc": 0, "acc_norm": 0}
    for mine, theirs in zip(ours["per_item"], samples):
        lls = np.array([resp[0] for resp in theirs["filtered_resps"]])
        # The same text, split into the same tokens, through the same weights: each candidate's
        # log-likelihood agrees to float32 rounding of the forward (sums of ~60 terms of magnitude
        # ~5, each rounded at ~1e-7 relative), far below the gaps between candidates.
        np.testing.assert_allclose(mine["logprobs"], lls, rtol=0, atol=1e-4, err_msg=f"{task} line {mine['line']}")
        # lm_eval's choices: acc the argmax of the log-likelihoods, acc_norm of them over each
        # choice's length in characters (api/task.py, process_results), ties to the first.
        lengths = np.array([len(c) for c in doc_choices(theirs["doc"])], dtype=float)
        assert mine["chosen"]["total"] == int(np.argmax(lls)), (task, mine, lls)
        assert mine["chosen"]["acc_norm"] == int(np.argmax(lls / lengths)), (task, mine, lls, lengths)
        assert (mine["chosen"]["total"] == mine["gold"]) == bool(theirs["acc"])
        assert (mine["chosen"]["acc_norm"] == mine["gold"]) == bool(theirs["acc_norm"])
        right["acc"] += bool(theirs["acc"])
        right["acc_norm"] += bool(theirs["acc_norm"])
    n = len(samples)
    totals = harness["results"][name]
    assert totals["acc,none"] == pytest.approx(right["acc"] / n, abs=1e-12)
    assert totals["acc_norm,none"] == pytest.approx(right["acc_norm"] / n, abs=1e-12)
    assert ours["accuracy"]["total"]["value"] == pytest.approx(totals["acc,none"], abs=1e-12)
    assert ours["accuracy"]["acc_norm"]["value"] == pytest.approx(totals["acc_norm,none"], abs=1e-12)
    # The scores are not all ties: candidates of an item differ.
    assert any(len(set(item["logprobs"])) == len(item["logprobs"]) for item in ours["per_item"])
    print(f"{task}: {n} items; acc {totals['acc,none']:.4f} (depthkit total {ours['accuracy']['total']['value']:.4f}), "
          f"acc_norm {totals['acc_norm,none']:.4f} (depthkit acc_norm {ours['accuracy']['acc_norm']['value']:.4f})")


def test_the_items_exercise_what_agreement_depends_on(lm, harness):
    """The files hold the cases where a scorer could differ from the harness; were they absent, the
    agreement above would show less."""
    tok = lm.tokenizer
    # A piece spans the seam: "The mod" + "ule ..." is not encode("The mod") + encode("ule ...").
    assert tok.encode("The mod" + "ule returns a value.")[:len(tok.encode("The mod"))] != tok.encode("The mod")
    # Trailing blanks (a space, a newline, a no-break space, a tab) move to the continuation.
    contexts = [json.loads(line).get("context") for line in (DATA / "native.jsonl").read_text().splitlines()]
    assert {c[-1] for c in contexts if c and c[-1].isspace()} == {" ", "\n", "\u00a0", "\t"}
    assert "" in contexts
    # HellaSwag's text as the harness's task makes it: ctx_b capitalized (non-ASCII letters
    # lowercased too), WikiHow's bracketed markers removed, double blanks halved; some contexts
    # longer than seq_len (cut from the left).
    queries = [s["arguments"][0][0] for s in harness["samples"]["dk_hellaswag"]]
    choices = [c for s in harness["samples"]["dk_hellaswag"] for c in s["doc"]["choices"]]
    assert any("The école students of i\u0307zmir watch" in q for q in queries)
    assert any(". Use the def keyword." in q and "[" not in q for q in queries)
    assert "paints the wall  blue." in choices and "Go outside and look at the clouds [for a while." in choices
    assert max(len(tok.encode(q)) for q in queries) > SEQ_LEN


def direct_log_probs(model, ids):
    """log P(ids[t] | ids[:t]) for t ≥ 1, from one forward of ids[:-1] (the last id is only predicted)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]], dtype=torch.long))[0].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


ROLLING_TEXT = (
    "Python is an easy to learn, powerful programming language. It has efficient high-level data structures "
    "and a simple but effective approach to object-oriented programming. Python's elegant syntax and dynamic "
    "typing, together with its interpreted nature, make it an ideal language for scripting and rapid "
    "application development in many areas on most platforms.\n\nThe Python interpreter and the extensive "
    "standard library are freely available in source or binary form for all major platforms from the Python "
    "web site, and may be freely distributed.\n")


def test_loglikelihood_rolling_is_the_sum_of_per_token_log_probs(lm):
    model, tok = lm._model, lm.tokenizer
    ids = tok.encode(ROLLING_TEXT)
    T = SEQ_LEN
    assert len(ids) > 2 * T + 1 and len(ids) % T != 0  # three windows or more, the last one partial
    # Directly: every id predicted once, the first from the end-of-document id. Predictions go in
    # blocks of T; a block ending at e reads the last T ids before its predictions' ends (as many as
    # exist), so the final, partial block still has a whole context.
    full = [tok.eos_id] + ids
    expected = 0.0
    for start in range(0, len(ids), T):
        end = min(start + T, len(ids))  # predicts ids[start:end] = full[start + 1:end + 1]
        window = full[max(0, end - T):end + 1]
        lp = direct_log_probs(model, window)
        expected += float(lp[-(end - start):].sum())
    short = "A short text, one window."
    short_ids = [tok.eos_id] + tok.encode(short)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING_TEXT,), 0),
                                    Instance("loglikelihood_rolling", {}, (short,), 1)], disable_tqdm=True)
    # float32 log-softmax over ~150 tokens summed, against the same in float64 here.
    assert got[0] == pytest.approx(expected, rel=1e-5)
    assert got[1] == pytest.approx(float(direct_log_probs(model, short_ids).sum()), rel=1e-5)


def test_generate_until_is_greedy_and_stops_at_a_stop_string(lm):
    model, tok = lm._model, lm.tokenizer
    prompt = "The interpreter reads a line of input and"
    # Greedy decoding computed here: 12 ids, none the end-of-document id (the run's text goes on).
    ids = [tok.eos_id] + tok.encode(prompt)
    for _ in range(12):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    generated = ids[-12:]
    assert tok.eos_id not in generated
    full = tok.decode(generated)
    assert len(full) >= 8, full

    calls = []
    real_model = lm._model

    def counting(tokens):
        calls.append(tokens.shape[1])
        return real_model(tokens)

    lm._model = counting
    try:
        # No stop string: max_gen_toks ids, the text as decoded.
        out = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 12}), 0)],
                                disable_tqdm=True)
        assert out == [full] and len(calls) == 12
        # A stop string from the first half of the output: the text before it, and decoding ended
        # as soon as the text held it (fewer forwards than max_gen_toks).
        stop = full[len(full) // 3:len(full) // 3 + 2]
        calls.clear()
        out = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)],
                                disable_tqdm=True)
        assert out == [full.split(stop)[0]] and len(calls) < 12, (out, stop, calls)
        # `until` as one string, as some task configs give it.
        out = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": stop, "max_gen_toks": 12}), 0)],
                                disable_tqdm=True)
        assert out == [full.split(stop)[0]]
        with pytest.raises(ValueError, match="greedily"):
            lm.generate_until([Instance("generate_until", {}, (prompt, {"do_sample": True, "temperature": 1.0}), 0)],
                              disable_tqdm=True)
    finally:
        lm._model = real_model


def test_python_m_depthkit_lm_eval_runs_lm_evals_command_line(run_dir, task_dir, harness, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    r = run([sys.executable, "-m", "depthkit.lm_eval", "--model", "depthkit", "--model_args", f"path={run_dir}",
             "--tasks", "dk_arc_easy", "--include_path", str(task_dir), "--batch_size", "4", "--output_path", str(out)],
            env=env, cwd=tmp_path)
    assert "dk_arc_easy" in r.stdout and "acc_norm" in r.stdout, r.stdout
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1, files
    results = json.loads(files[0].read_text())["results"]["dk_arc_easy"]
    # The command line's model is the one simple_evaluate scored above (batch size 4 against 8).
    for metric in ("acc,none", "acc_norm,none"):
        assert results[metric] == pytest.approx(harness["results"]["dk_arc_easy"][metric], abs=1e-12)
