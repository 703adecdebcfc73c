"""depthkit.load: a checkpoint or run directory as a torch module whose logits are `depthkit forward`'s,
with the run's tokenizer, for every pathway kind on the dense and the sparse-MoE backbone.

Each checkpoint is made by `depthkit init` and then every parameter is moved off its initial value:
zero-initialised queries, convolutions and gates read and mix uniformly, and would hide a wrong
index or a swapped stream; the perturbed router spreads the tokens over the experts.
"""
import json
import pathlib
import random
import shutil
import struct
import subprocess

import pytest
import torch

import depthkit  # noqa: F401  (loads the operator library)
from depthkit.model import MoeFeedForward, load, read_safetensors
from depthkit.tokenizer import Tokenizer
from conftest import load_torch_reference, read_shard, split_documents

KINDS = ["residual", "attnres", "dar", "msar", "mhc", "attnres_sepv", "attnres_mhc"]
RTOL = 1e-5  # max |difference| / max |logit|, float32 (issue 32, item 4)
SHRINK = ["model.n_layers=3", "model.seq_len=48"]  # tiny-moe.toml: layer 0 dense, layers 1 and 2 MoE
BATCH = 2
REF = load_torch_reference()  # perturb: parameters moved off their initial values, as its --check does
PYTHON_TUTORIAL = pathlib.Path("/usr/share/doc/python3.11/html/_sources/tutorial")  # python3.11-doc

# Options beyond the two configs' defaults: partial last blocks, shared parameters, other routings,
# full AttnRes (S = 1), MSAR's ablations, tied head, head_dim apart from d_model / n_heads, no GQA,
# model.impl and residual.impl "reference", sigmoid_topk with renormalised gates, the experts' loop,
# top_k 3, two shared experts and no leading dense layer.
VARIANTS = {
    "attnres-tied-hd48-S4": ("tiny", "attnres", ["model.tie_embeddings=true", "model.head_dim=48", "model.n_kv_heads=4",
                                                 "residual.block_sublayers=4"]),
    "dar-shared-self-S3-reference": ("tiny", "dar", ["residual.share_within_block=true", "residual.routing=self",
                                                     "residual.block_sublayers=3", "model.impl=reference"]),
    "dar-cross_value-S4": ("tiny", "dar", ["residual.routing=cross_value", "residual.block_sublayers=4"]),
    "msar-m3-mean-reference": ("tiny", "msar", ["residual.streams=3", "residual.kernels=[2,5]", "residual.fusion=mean",
                                                "residual.impl=reference"]),
    "msar-noconv-S4": ("tiny", "msar", ["residual.conv=false", "residual.block_sublayers=4"]),
    "mhc-m2-iters3-theta500": ("tiny", "mhc", ["residual.streams=2", "residual.sinkhorn_iters=3", "model.rope_theta=500"]),
    "attnres_mhc-S1-reference": ("tiny", "attnres_mhc", ["residual.block_sublayers=1", "model.impl=reference"]),
}
SIGMOID = ["moe.router=sigmoid_topk", "moe.renormalize=true", "moe.expert_impl=loop", "moe.top_k=3",
           "moe.n_shared_experts=2", "moe.leading_dense_layers=0"]
for _kind in ("dar", "msar", "attnres_mhc"):
    VARIANTS[f"moe-sigmoid_topk-{_kind}"] = ("tiny-moe", _kind, SIGMOID)

MEASURED = {}  # case → max relative difference, printed at the end (pytest -s)


# ---- helpers ---------------------------------------------------------------------------------------


def run(*args, cwd=None):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def write_safetensors(path, tensors, metadata=None):
    """Float32 tensors by name: the 8-byte little-endian header length, the JSON header (padded with
    spaces to 8 bytes, as depthkit writes it), then the data in header order."""
    header = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = t.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def make_checkpoint(program, out, config, sets, seed):
    run(program, "init", "--config", config, *sum((["--set", s] for s in sets), []), "--out", out)
    gen = torch.Generator().manual_seed(seed)
    weights = out / "model.safetensors"
    tensors = read_safetensors(weights)
    write_safetensors(weights, {n: REF.perturb(n, t, gen) for n, t in tensors.items()}, {"format": "depthkit"})
    return gen


def depthkit_logits(program, checkpoint, tokens, tmp):
    """`depthkit forward`'s float32 logits of `checkpoint` (a folder or a run directory) for tokens."""
    ids, out = tmp / "tokens.txt", tmp / "logits.safetensors"
    ids.write_text("\n".join(" ".join(map(str, row)) for row in tokens.tolist()) + "\n")
    run(program, "forward", "--checkpoint", checkpoint, "--tokens", ids, "--out", out)
    return read_safetensors(out)["logits"]


def max_rel(ours, theirs):
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


def routing_of(model, tokens):
    """The experts each MoE layer selects for `tokens` ([N, k] per layer), recomputed from the inputs
    the layers receive."""
    chosen = []

    def hook(module, args):
        x = module.ops.rms_norm(args[0], module.norm, module.eps).reshape(-1, args[0].shape[-1])
        chosen.append(module.route(x)[0])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoeFeedForward)]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return chosen


def one_line(excinfo):
    text = str(excinfo.value)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


# ---- logits equal to `depthkit forward`'s -------------------------------------------------------------


CASES = [pytest.param("tiny", k, [], id=f"dense-{k}") for k in KINDS]
CASES += [pytest.param("tiny-moe", k, [], id=f"moe-{k}") for k in KINDS]
CASES += [pytest.param(*v, id=name) for name, v in VARIANTS.items()]


@pytest.mark.parametrize("config,kind,extra", CASES)
def test_logits_equal_depthkit_forward(depthkit_program, source_dir, tmp_path, request, config, kind, extra):
    sets = [f"residual.kind={kind}", *SHRINK, *extra]
    case = request.node.callspec.id
    gen = make_checkpoint(depthkit_program, tmp_path / "ck", source_dir / "configs" / f"{config}.toml", sets,
                          seed=sum(map(ord, case)))
    model = load(tmp_path / "ck")
    assert model.config["residual"]["kind"] == kind
    V, T = model.config["model"]["vocab_size"], model.config["model"]["seq_len"]
    tokens = torch.randint(V, (BATCH, T), generator=gen)
    theirs = depthkit_logits(depthkit_program, tmp_path / "ck", tokens, tmp_path)
    with torch.no_grad():
        ours = model(tokens)
    assert ours.dtype == torch.float32 and ours.shape == (BATCH, T, V)
    rel = max_rel(ours, theirs)
    MEASURED[case] = rel
    assert rel <= RTOL, f"{case}: logits differ from depthkit forward's by {rel:.3g} of the largest |logit|"
    if model.config["moe"]["n_experts"] > 0:
        # The routing is not trivial: most experts take tokens, and none takes most of them.
        E = model.config["moe"]["n_experts"]
        for layer, experts in enumerate(routing_of(model, tokens)):
            share = torch.bincount(experts.reshape(-1), minlength=E).double() / experts.numel()
            assert (share > 0).sum() >= E // 2 + 1 and share.max() < 0.5, f"MoE layer {layer}: expert shares {share}"


@pytest.mark.parametrize("config,kind", [("tiny", "msar"), ("tiny-moe", "dar")])
def test_float64(depthkit_program, source_dir, tmp_path, config, kind):
    """dtype=torch.float64 runs the whole model in float64 (the RoPE tables stay float32, as in C++):
    it differs from the float32 program by float32's rounding alone."""
    gen = make_checkpoint(depthkit_program, tmp_path / "ck", source_dir / "configs" / f"{config}.toml",
                          [f"residual.kind={kind}", *SHRINK], seed=5)
    model = load(tmp_path / "ck", dtype="float64")  # a dtype or its name
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model.rope.cos.dtype == torch.float32
    tokens = torch.randint(model.vocab_size, (BATCH, model.seq_len), generator=gen)
    theirs = depthkit_logits(depthkit_program, tmp_path / "ck", tokens, tmp_path)
    with torch.no_grad():
        ours = model(tokens)
    assert ours.dtype == torch.float64
    rel = max_rel(ours, theirs)
    MEASURED[f"float64-{config}-{kind}"] = rel
    assert 0 < rel <= RTOL


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")  # torch's own, from inductor
def test_compile_fullgraph_equals_eager(depthkit_program, source_dir, tmp_path):
    """torch.compile(model, fullgraph=True): no graph break anywhere (the fused operators' fake
    implementations, the pathway's depth loop, the MoE layer's routing-independent form), and the
    logits of eager mode. DAR on tiny-moe: one dense and one MoE layer. The backend is
    AOTAutograd's without Inductor's code generation (tracing is what a graph break would stop);
    Inductor compiles the nn example's model (test_nn.py) and the operators (test_opcheck.py)."""
    gen = make_checkpoint(depthkit_program, tmp_path / "ck", source_dir / "configs" / "tiny-moe.toml",
                          ["residual.kind=dar", "model.n_layers=2", "model.seq_len=32"], seed=9)
    model = load(tmp_path / "ck")
    tokens = torch.randint(model.vocab_size, (BATCH, model.seq_len), generator=gen)
    with torch.no_grad():
        eager = model(tokens)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(tokens)
    rel = max_rel(compiled, eager)
    MEASURED["compile-vs-eager-moe-dar"] = rel
    assert rel <= RTOL


# ---- the tokenizer -------------------------------------------------------------------------------------

SNIPPETS = [
    "def f(x):\n    return x ** 2  # square\n",
    "Héllo, wörld! Ça va? 日本語のテキスト。 Emoji: 🙂🚀 and a combining e\u0301.",
    "\n\nleading blank lines, trailing spaces   \n\ttab\tseparated\tvalues\n",
    "Windows line ends\r\nstay as they are\r\n",
    "digits 1234567890 and 3.14159e-10, 0xFF, -42",
    "   indented text with  double  spaces",
    "mixed\n\n\n\nmany newlines\n",
    "class A:\n    \"\"\"Docstring.\"\"\"\n    pass\n",
    "<|endoftext|> is text here, not the end-of-document id",
    "ünïcödé ∑ ∫ √ ≤ ≥ — “quotes” ‘single’ …",
]


def synthetic_documents(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(SNIPPETS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.fixture(scope="session")
def prepared(depthkit_program, tmp_path_factory):
    """A data directory `depthkit data prepare` made from synthetic documents (its own tokenizer,
    trained here): (directory, the documents' texts)."""
    root = tmp_path_factory.mktemp("prepared")
    docs = synthetic_documents(24, seed=3)
    (root / "docs").mkdir()
    for i, text in enumerate(docs):
        (root / "docs" / f"doc_{i:03d}.txt").write_bytes(text.encode())
    run(depthkit_program, "data", "prepare", "--input", root / "docs", "--out", root / "data", "--vocab-size", 420,
        "--val-fraction", 0.25)
    return root / "data", docs


def shard_documents(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    out = {}
    for split, info in meta["splits"].items():
        ids = [i for shard in info["shards"] for i in read_shard(data_dir / shard)]
        out[split] = split_documents(ids, meta["eos_id"])
    return out, meta["eos_id"]


def test_tokenizer_equals_cpp_on_prepared_shards(prepared):
    """The ids `depthkit data prepare` wrote for each document (the C++ Tokenizer) are encode()'s,
    and decode() gives the document back."""
    data_dir, docs = prepared
    tok = Tokenizer(data_dir / "tokenizer.model")
    by_split, eos = shard_documents(data_dir)
    assert tok.eos_id == eos
    ours = {tuple(tok.encode(d)): i for i, d in enumerate(docs)}
    assert len(ours) == len(docs)
    seen = []
    for split, cpp_docs in by_split.items():
        index = []
        for ids in cpp_docs:
            assert tuple(ids) in ours, f"{split}: a document's C++ ids are not encode() of any document"
            index.append(ours[tuple(ids)])
            assert tok.decode(ids) == docs[index[-1]]
        assert index == sorted(index)  # each split keeps the documents' order
        seen += index
    assert sorted(seen) == list(range(len(docs)))


def test_tokenizer_equals_cpp_on_real_text(depthkit_program, tmp_path):
    """Real text: the Python tutorial's reStructuredText sources (Debian's python3.11-doc, which
    scripts/setup installs: the bundled corpus's documents), prepared by `depthkit data prepare`
    with a 1,024-piece tokenizer. Each document's C++ ids decode to its text, which encode() turns
    back into the same ids."""
    run(depthkit_program, "data", "prepare", "--input", PYTHON_TUTORIAL, "--out", tmp_path / "data",
        "--vocab-size", 1024, "--val-fraction", 0.25)
    tok = Tokenizer(tmp_path / "data" / "tokenizer.model")
    docs, _ = shard_documents(tmp_path / "data")
    checked = 0
    for split in docs.values():
        for ids in split:
            assert tok.encode(tok.decode(ids)) == ids
            checked += len(ids)
    assert checked > 10000


def test_tokenizer_round_trip(prepared):
    tok = Tokenizer(prepared[0] / "tokenizer.model")
    for text in SNIPPETS + ["", "\n", "\n\n", "a\n", "\na", " ", "\x00\x7f", "🙂" * 5, "".join(SNIPPETS)]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, repr(text)
    assert tok.encode("a\nb") == tok.encode("a") + [tok.newline_id] + tok.encode("b")


# ---- a run directory: its latest checkpoint, its tokenizer ------------------------------------------


def test_run_directory_loads_its_latest_checkpoint(depthkit_program, source_dir, prepared, tmp_path):
    data_dir = prepared[0]
    run_dir = tmp_path / "run"
    sets = ["model.n_layers=2", "model.seq_len=32", "residual.kind=attnres", f"data.dir={data_dir}",
            "train.steps=3", "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.micro_batch=2",
            "train.eval_every=1000", "train.eval_tokens=256", "train.log_every=1", "train.threads=1"]
    run(depthkit_program, "train", "--config", source_dir / "configs" / "tiny.toml", "--run-dir", run_dir,
        *sum((["--set", s] for s in sets), []))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    model = load(run_dir)
    assert model.step == 3 and model.checkpoint.name == "step_00000003"
    assert model.config["train"]["steps"] == 3 and model.config["data"]["dir"] == str(data_dir)
    assert model.tokenizer.path == data_dir / "tokenizer.model"
    tokens = torch.tensor([model.tokenizer.encode("def f(x):\n    return x  # héllo\n")[:32]])
    theirs = depthkit_logits(depthkit_program, run_dir, tokens, tmp_path)
    with torch.no_grad():
        ours = model(tokens)
        earlier = load(run_dir / "checkpoints" / "step_00000002")(tokens)
    assert max_rel(ours, theirs) <= RTOL
    assert max_rel(earlier, theirs) > 1e-4  # a step of training shows: the latest was taken


def test_tokenizer_found_above_a_moved_run(depthkit_program, source_dir, prepared, tmp_path, monkeypatch):
    """A relative data.dir that the working directory does not hold is looked for above the
    checkpoint (a project folder moved whole); a tokenizer the checkpoint carries comes first; without
    any, .tokenizer says where it looked, and tokenizer= names one."""
    project = tmp_path / "project"
    shutil.copytree(prepared[0], project / "prep")
    ck = project / "runs" / "r" / "ck"
    run(depthkit_program, "init", "--config", source_dir / "configs" / "tiny.toml", "--set", "model.n_layers=1",
        "--set", "data.dir=prep", "--out", ck)
    monkeypatch.chdir(tmp_path)
    assert load(ck).tokenizer.path == project / "prep" / "tokenizer.model"
    shutil.copy(project / "prep" / "tokenizer.model", ck / "tokenizer.model")
    assert load(ck).tokenizer.path == ck / "tokenizer.model"
    (ck / "tokenizer.model").unlink()
    shutil.rmtree(project / "prep")
    model = load(ck)
    with pytest.raises(FileNotFoundError) as e:
        model.tokenizer
    assert "prep/tokenizer.model: not found" in one_line(e)
    assert load(ck, tokenizer=prepared[0]).tokenizer.vocab_size == Tokenizer(prepared[0] / "tokenizer.model").vocab_size


# ---- errors: one line, naming the file and what is wrong -----------------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint(depthkit_program, source_dir, tmp_path_factory):
    ck = tmp_path_factory.mktemp("small") / "ck"
    run(depthkit_program, "init", "--config", source_dir / "configs" / "tiny.toml", "--set", "model.n_layers=1",
        "--set", "model.seq_len=16", "--out", ck)
    return ck


def copy_of(ck, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(ck, out)
    return out


def test_bad_paths(tmp_path, small_checkpoint):
    with pytest.raises(FileNotFoundError) as e:
        load(tmp_path / "nowhere")
    assert "nowhere: no such file or directory" in one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        load(tmp_path / "empty")
    assert "not a checkpoint (no state.json) nor a run directory with checkpoints" in one_line(e)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError) as e:
        load(tmp_path / "file.txt")
    assert "file.txt: not a directory" in one_line(e)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text("yesterday\n")
    with pytest.raises(ValueError) as e:
        load(tmp_path / "run")
    assert "latest: does not name a checkpoint" in one_line(e)
    (checkpoints / "latest").write_text("step_00000007\n")
    with pytest.raises(FileNotFoundError) as e:
        load(tmp_path / "run")
    assert "names missing checkpoint 'step_00000007'" in one_line(e)
    ck = copy_of(small_checkpoint, tmp_path)
    (ck / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as e:
        load(ck)
    assert "model.safetensors: not found" in one_line(e)


def test_bad_configs(tmp_path, small_checkpoint):
    ck = copy_of(small_checkpoint, tmp_path)
    state = json.loads((ck / "state.json").read_text())
    for edits, says in [([("kind = 'residual'", "kind = 'highway'")], "key 'residual.kind' must be one of"),
                        ([("n_kv_heads = 2", "n_kv_heads = 3")], "key 'model.n_kv_heads' (3) must divide"),
                        ([("impl = 'fused'", "impl = 'cuda'")], "impl' must be one of"),
                        ([("kind = 'residual'", "kind = 'dar'"), ("block_sublayers = 2", "block_sublayers = 1")],
                         "key 'residual.block_sublayers' = 1 is degenerate for DAR"),
                        ([("[model]", "[model")], "field 'config' is not valid TOML")]:
        text = state["config"]
        for old, new in edits:
            assert old in text
            text = text.replace(old, new, 1)
        (ck / "state.json").write_text(json.dumps(dict(state, config=text)))
        with pytest.raises(ValueError) as e:
            load(ck)
        text = one_line(e)
        assert "state.json" in text and says in text, text
    (ck / "state.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        load(ck)
    assert "state.json: not valid JSON" in one_line(e)


def test_bad_weights(tmp_path, small_checkpoint):
    ck = copy_of(small_checkpoint, tmp_path)
    weights = ck / "model.safetensors"
    tensors = read_safetensors(weights)
    cases = [({n: t for n, t in tensors.items() if n != "final_norm"}, "missing tensor 'final_norm'"),
             (dict(tensors, final_norm=torch.ones(7)), "tensor 'final_norm' has shape [7], the model needs [128]"),
             (dict(tensors, extra=torch.ones(1)), "unexpected tensor 'extra' (not a parameter of this model)")]
    for case, says in cases:
        write_safetensors(weights, case)
        with pytest.raises(ValueError) as e:
            load(ck)
        assert "model.safetensors" in one_line(e) and says in one_line(e)
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        load(ck)
    assert "model.safetensors" in one_line(e)


def test_bad_tokens(small_checkpoint):
    model = load(small_checkpoint)
    for tokens, says in [(torch.zeros(1, 17, dtype=torch.long), "sequence of 17 tokens exceeds model.seq_len 16"),
                         (torch.full((1, 4), 4096), "token id 4096 is outside"),
                         (torch.zeros(4, dtype=torch.long), "tokens must be [batch, T]")]:
        with pytest.raises(ValueError) as e:
            model(tokens)
        assert says in one_line(e)
    with pytest.raises(ValueError) as e:
        load(small_checkpoint, dtype=torch.float16)
    assert "float32, float64 or bfloat16" in one_line(e)


def test_state_dict_round_trips(small_checkpoint):
    """state_dict() names are the checkpoint's: what it holds loads back into a model of its config."""
    model = load(small_checkpoint)
    saved = read_safetensors(small_checkpoint / "model.safetensors")
    assert set(model.state_dict()) == set(saved)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in saved.items())


def teardown_module(module):
    if MEASURED:
        print("\nmax relative differences (of the logits to the largest |logit|; of the validation loss):")
        for case, rel in MEASURED.items():
            print(f"  {case:36s} {rel:.3e}")


def test_trained_precision_equals_depthkit_eval(depthkit_program, source_dir, prepared, tmp_path):
    """compute_dtype="trained" runs a bfloat16-trained checkpoint as `depthkit eval` does (float32
    parameters, bfloat16 activations): the same validation loss on the same windows."""
    data_dir = prepared[0]
    run_dir = tmp_path / "run"
    make_checkpoint(depthkit_program, run_dir / "checkpoints" / "step_00000000", source_dir / "configs" / "tiny.toml",
                    ["residual.kind=dar", "model.n_layers=2", "model.seq_len=32", "train.dtype=bfloat16",
                     f"data.dir={data_dir}", "train.micro_batch=4"], seed=11)
    (run_dir / "checkpoints" / "latest").write_text("step_00000000\n")
    budget = 640
    theirs = json.loads(run(depthkit_program, "eval", "--run-dir", run_dir, "--json", "--tokens", budget))
    model = load(run_dir, compute_dtype="trained")
    assert model.compute_dtype == torch.bfloat16 and model.embedding.dtype == torch.float32
    # eval_batches (data/loader.cpp): window w of a shard is its tokens w·T … w·T + T, over the
    # shards in order, the first budget / T of them, micro_batch at a time.
    T, B = model.seq_len, model.config["train"]["micro_batch"]
    meta = json.loads((data_dir / "meta.json").read_text())
    windows = []
    for shard in meta["splits"]["val"]["shards"]:
        ids = read_shard(data_dir / shard)
        windows += [ids[w * T: w * T + T + 1] for w in range((len(ids) - 1) // T)]
    windows = torch.tensor(windows[: max(1, budget // T)])
    total, count = 0.0, 0
    with torch.no_grad():
        for b in windows.split(B):
            h = model.hidden(b[:, :T])
            assert h.dtype == torch.bfloat16 and model(b[:, :T]).dtype == torch.float32
            # Transformer::lm_loss: the fused linear_cross_entropy takes the bfloat16 hidden states and
            # the head cast to bfloat16 in float32, so its logits are not rounded to bfloat16.
            logits = torch.nn.functional.linear(h.float(), model.head_weight.to(h.dtype).float())
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1),
                                                       reduction="sum").item()
            count += b[:, 1:].numel()
    assert count == theirs["tokens"]
    rel = abs(total / count - theirs["val_loss"]) / theirs["val_loss"]
    MEASURED["bfloat16-trained-val-loss"] = rel
    assert rel <= RTOL
