"""depthkit.nn: every pathway module equals bench/torch_reference.py's plain-PyTorch pathway of the same
kind (itself held equal to depthkit's C++ model's logits by `torch_reference.py --check`), outputs
and gradients, in float64, on the same parameters, moved off their initial values first (zero
queries, convolutions and gates read and mix uniformly, which hides a wrong index). Also: the
parameter names, shapes and initialisation equal `depthkit init`'s checkpoint; bad options are one-
line ValueErrors; float32 is as accurate as plain PyTorch's; torch.compile(fullgraph=True) equals
eager; examples/train_gpt.py trains, with and without torch.compile, on a shard made here.
"""
import copy
import json
import math
import struct
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import depthkit.nn as dn
from conftest import SOURCE_DIR, load_torch_reference

TOL = 1e-10  # float64: max |difference| relative to the largest |value| of each tensor


REF = load_torch_reference()

# (kind, n_branches, options): every kind and the main ablations. n_branches is even because the
# reference builds 2 · n_layers branches; 6 branches in blocks of 4 leave a partial last block.
CASES = [
    ("residual", 4, {}),
    ("attnres", 4, {"block_sublayers": 1}),  # Full AttnRes
    ("attnres", 6, {"block_sublayers": 2}),  # Block AttnRes
    ("attnres", 6, {"block_sublayers": 4}),  # a partial last block
    ("attnres", 8, {"block_sublayers": 4, "share_within_block": True}),
    ("attnres", 6, {"block_sublayers": 3, "share_within_block": True}),  # odd S: types alternate per block
    ("attnres_sepv", 4, {"block_sublayers": 2}),
    ("attnres_sepv", 6, {"block_sublayers": 4}),
    ("attnres_sepv", 4, {"block_sublayers": 1}),
    ("dar", 4, {"block_sublayers": 2}),
    ("dar", 4, {"block_sublayers": 2, "routing": "self"}),
    ("dar", 4, {"block_sublayers": 2, "routing": "cross_value"}),
    ("dar", 4, {"block_sublayers": 2, "routing": "fixed"}),
    ("dar", 6, {"block_sublayers": 4}),
    ("dar", 8, {"block_sublayers": 4, "share_within_block": True}),
    ("dar", 6, {"block_sublayers": 3, "share_within_block": True, "routing": "self"}),
    ("msar", 4, {"block_sublayers": 2}),  # m = 4, κ = 4, 8, 12: taps longer than T
    ("msar", 4, {"block_sublayers": 1}),  # Full MSAR
    ("msar", 6, {"block_sublayers": 4, "streams": 3, "kernels": [2, 3]}),  # partial last block, every tap reaches
    ("msar", 4, {"block_sublayers": 2, "conv": False}),
    ("msar", 4, {"block_sublayers": 2, "fusion": "mean"}),
    ("msar", 4, {"block_sublayers": 2, "streams": 2, "kernels": [5], "conv": False, "fusion": "mean"}),
    ("msar", 4, {"block_sublayers": 2, "streams": 1, "kernels": []}),
    ("mhc", 4, {}),  # m = 4, 20 Sinkhorn rounds
    ("mhc", 4, {"streams": 2, "sinkhorn_iters": 3}),
    ("mhc", 2, {"streams": 1}),
    ("attnres_mhc", 4, {"block_sublayers": 2}),
    ("attnres_mhc", 6, {"block_sublayers": 4, "share_within_block": True, "streams": 3, "sinkhorn_iters": 5}),
]
B, T, D = 2, 5, 8


def case_id(case):
    kind, n, options = case
    return "-".join([kind, f"L{n}"] + [f"{k}={v}" for k, v in options.items()]).replace(" ", "")


def perturb_(module, gen):
    """Every parameter moved off its initial value, as torch_reference.py's --check moves them
    (REF.perturb: the gate scales far enough that H_res is far from uniform)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(REF.perturb(name, p, gen))


class Branch(torch.nn.Module):
    """A small random branch: f(h) = tanh(h Wᵀ + b)."""

    def __init__(self, d, gen, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=gen, dtype=dtype) * 1.5 / math.sqrt(d))
        self.b = torch.nn.Parameter(torch.randn(d, generator=gen, dtype=dtype) * 0.3)

    def forward(self, h):
        return torch.tanh(F.linear(h, self.w, self.b))


def reference_pathway(kind, n, options, d):
    """bench/torch_reference.py's pathway of `kind`, with its parameters by depthkit's names without
    "residual." (it registers attnres_mhc's under "residual.attnres.", "residual.mhc.")."""
    r = dict(REF.RESIDUAL_DEFAULTS, kind=kind, **options)
    if kind == "msar" and r["streams"] == 1:
        # The reference takes max(kernels) even with no kernel; with one stream there is no bank,
        # so conv changes nothing, and conv = false gives it what it needs.
        r["conv"] = False
    root = torch.nn.Module()
    path = REF.PATHWAYS[kind](r, {"d_model": d, "n_layers": n // 2, "init_std": 0.02}, REF.Params(root, ""))
    params = {name.removeprefix("residual."): p for name, p in root.named_parameters()}
    return root, path, params


def run_reference(path, x, branches):
    s = path.begin(x)
    for l, f in enumerate(branches, start=1):
        path.write(s, l, f(path.read(s, l)))
    return path.finish(s)


def max_rel(got, want):
    """max |got − want| / max |want| (0 when both are 0)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    return err / scale if scale > 0 else err


def copy_in(dtype, module):
    """A copy of `module` in `dtype` (the float64 module itself for float64)."""
    return module if dtype == torch.float64 else copy.deepcopy(module).to(dtype)


def compare_with_reference(kind, n, options, dtype=torch.float64, reference_dtype=torch.float64, seed=0):
    """Runs depthkit.nn's pathway in `dtype` and the reference in `reference_dtype` on the same
    perturbed parameters, input and branches (drawn in float64, then rounded), and returns
    {tensor: max relative difference} over the output and the gradients of the input, of every
    pathway parameter and of the branches' parameters."""
    torch.manual_seed(seed)  # the modules' own initial draws
    gen = torch.Generator().manual_seed(seed)
    master = dn.make(kind, D, n, dtype=torch.float64, **options)
    perturb_(master, gen)
    root, ref, ref_params = reference_pathway(kind, n, options, D)
    assert sorted(dict(master.named_parameters())) == sorted(ref_params), (
        sorted(dict(master.named_parameters())), sorted(ref_params))
    root.double()
    with torch.no_grad():
        for name, p in master.named_parameters():
            assert p.shape == ref_params[name].shape, name
            ref_params[name].copy_(p)
    root.to(reference_dtype)
    mine = copy_in(dtype, master)
    ours = dict(mine.named_parameters())
    branches = [Branch(D, gen, torch.float64) for _ in range(n)]
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    cotangent = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    names = sorted(ours)

    def run(dtype, pathway, params, forward):
        xi = x.to(dtype).requires_grad_()
        fs = [copy_in(dtype, b) for b in branches]
        y = forward(pathway, xi, fs)
        assert y.shape == (B, T, D) and y.dtype == dtype
        wrt = [xi] + [params[k] for k in names] + [p for f in fs for p in f.parameters()]
        return [y] + list(torch.autograd.grad(y, wrt, cotangent.to(dtype)))

    want = run(reference_dtype, ref, ref_params, run_reference)
    got = run(dtype, mine, ours, lambda path, xi, fs: path(xi, fs))
    labels = ["output", "grad x"] + [f"grad {k}" for k in names] + [f"grad branch {i // 2 + 1} {'wb'[i % 2]}"
                                                                     for i in range(2 * n)]
    assert len(labels) == len(got) == len(want)
    return {label: max_rel(g.double(), w.double()) for label, g, w in zip(labels, got, want)}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_equals_reference_float64(case):
    kind, n, options = case
    diffs = compare_with_reference(kind, n, options)
    worst = max(diffs, key=diffs.get)
    print(f"{case_id(case)}: {len(diffs)} tensors, max rel diff {diffs[worst]:.2e} ({worst})")
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, bad


# float32: the operators' own dtype in training. Its error against float64 is rounding, which the
# perturbed gates (saturated sigmoids, large mHC scales) amplify in some gradients; it must stay of
# the size plain PyTorch's own float32 has on the same problem: the reference run in float32.
@pytest.mark.parametrize("case", [("attnres", 6, {"block_sublayers": 4}), ("dar", 6, {"block_sublayers": 4}),
                                  ("msar", 4, {"block_sublayers": 2}), ("mhc", 4, {}),
                                  ("attnres_sepv", 4, {"block_sublayers": 2})], ids=case_id)
def test_float32(case):
    kind, n, options = case
    ours = compare_with_reference(kind, n, options, dtype=torch.float32)
    torchs = compare_with_reference(kind, n, options, reference_dtype=torch.float32)
    worst = max(ours, key=ours.get)
    print(f"float32 {case_id(case)}: max rel diff {ours[worst]:.2e} ({worst}; plain PyTorch float32: "
          f"{torchs[worst]:.2e}, its worst {max(torchs.values()):.2e})")
    # float32's unit roundoff is 6e-8: 16 of them, or 10 times PyTorch's own error where that is larger.
    bad = {k: (v, torchs[k]) for k, v in ours.items() if not v <= max(1e-6, 10 * torchs[k])}
    assert not bad, bad


def test_the_loop_and_the_fused_operators():
    """forward is the begin/read/write/finish loop, and what runs is the fused operators."""
    gen = torch.Generator().manual_seed(3)
    path = dn.make("dar", D, 4, block_sublayers=2, dtype=torch.float64)
    perturb_(path, gen)
    branches = [Branch(D, gen, torch.float64) for _ in range(4)]
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    with torch.autograd.profiler.profile() as prof:
        y = path(x, branches)
        y.sum().backward()
    ran = {e.name for e in prof.function_events if e.name.startswith("depthkit::")}
    assert {"depthkit::dar_read", "depthkit::dar_write", "depthkit::depth_read", "depthkit::dar_read_backward",
            "depthkit::dar_write_backward", "depthkit::depth_read_backward", "depthkit::shared_source"} <= ran, ran
    s = path.begin(x)
    for l, f in enumerate(branches, start=1):
        path.write(s, l, f(path.read(s, l)))
    assert torch.equal(path.finish(s), y)
    with pytest.raises(ValueError, match="3 branches given"):
        path(x, branches[:3])
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model = 8\]"):
        path(x[..., :4], branches)


def test_a_device_without_the_kernels_is_one_clear_error():
    """On CUDA the library has depth_read and depth_merge only (ops/cuda/): a pathway that needs
    another operator says which, before the dispatcher would fail deep in the loop."""
    from types import SimpleNamespace
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    dn.make("attnres", D, 4).check_device(on_cuda)  # depth_read: has its CUDA kernels
    dn.make("residual", D, 4).check_device(on_cuda)
    for kind, op in [("dar", "dar_read"), ("msar", "msar_block_read"), ("mhc", "mhc_pre"), ("attnres_mhc", "mhc_pre")]:
        with pytest.raises(RuntimeError, match=f"depthkit::{op} has no CUDA kernel"):
            dn.make(kind, D, 4).check_device(on_cuda)


# ---- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,options,message", [
    ("dar", {"foo": 1}, "unknown key 'residual.foo'"),
    ("dar", {"kind": "mhc"}, "key 'residual.kind' given twice"),
    ("dar", {"routing": "diag"}, "key 'residual.routing' must be one of \"cross\", \"self\", \"cross_value\", "
                                 "\"fixed\", got \"diag\""),
    ("attnres", {"block_sublayers": 0}, "key 'residual.block_sublayers' must be an integer in [1, 1048576], got 0"),
    ("attnres", {"block_sublayers": 2.0}, "key 'residual.block_sublayers' must be an integer, got 2.0"),
    ("mhc", {"streams": True}, "key 'residual.streams' must be an integer, got True"),
    ("mhc", {"sinkhorn_iters": 1001}, "key 'residual.sinkhorn_iters' must be an integer in [1, 1000], got 1001"),
    ("msar", {"kernels": [4, 0, 12]}, "key 'residual.kernels' must hold integers in [1, 4096], got 0"),
    ("msar", {"kernels": "4,8"}, "key 'residual.kernels' must be an array of integers, got \"4,8\""),
    ("msar", {"conv": 1}, "key 'residual.conv' must be true or false, got 1"),
    ("msar", {"fusion": "sum"}, "key 'residual.fusion' must be one of \"hpre\", \"mean\", got \"sum\""),
    ("msar", {"streams": 3}, "key 'residual.kernels' has 3 kernel sizes; MSAR with residual.streams = 3 needs 2"),
    ("dar", {"block_sublayers": 1}, "key 'residual.block_sublayers' = 1 is degenerate for DAR"),
    ("dar", {"impl": "fast"}, "key 'residual.impl' must be one of \"reference\", \"fused\", got \"fast\""),
    ("dar", {"streams": 0}, "key 'residual.streams' must be an integer in [1, 64], got 0"),  # checked though unread
    ("residual", {"share_within_block": "yes"}, "key 'residual.share_within_block' must be true or false"),
    ("hyper", {}, "key 'residual.kind' must be one of 'residual', 'attnres', 'dar', 'msar', 'mhc', 'attnres_sepv', "
                  "'attnres_mhc', got 'hyper'"),
])
def test_bad_options_are_one_line_value_errors(kind, options, message):
    with pytest.raises(ValueError) as e:
        dn.make(kind, D, 4, **options)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_options_and_classes():
    # Keys the kind does not read are accepted (the TOML accepts them); each class takes its own.
    p = dn.make("dar", D, 4, streams=2, kernels=[3], fusion="mean", sinkhorn_iters=3, impl="reference")
    assert type(p) is dn.DAR and p.kind == "dar"
    assert type(dn.make("msar", D, 4, kind="msar", routing="self")) is dn.MSAR  # a whole [residual] table
    assert p.options["routing"] == "cross" and p.options["block_sublayers"] == 2
    for kind, cls in dn.KINDS.items():
        assert cls.kind == kind and isinstance(dn.make(kind, D, 4), cls)
    with pytest.raises(ValueError, match="d_model must be a positive integer"):
        dn.DAR(0, 4)
    with pytest.raises(ValueError, match="n_branches must be a positive integer"):
        dn.make("mhc", D, 0)
    # Defaults are depthkit's (config.h, ResidualConfig).
    assert dn.MSAR(D, 4).options == {"block_sublayers": 2, "streams": 4, "kernels": (4, 8, 12), "conv": True,
                                     "conv_init": "zeros", "fusion": "hpre", "impl": "fused"}
    # residual.conv_init: the taps at step 0 (zeros, the paper's; average: 1/κ_r; normal: N(0, init_std)).
    bank = getattr(dn.MSAR(D, 4).bank, "0")
    assert not bank.conv1.any() and not bank.conv3.any()
    bank = getattr(dn.MSAR(D, 4, conv_init="average").bank, "1")
    assert torch.equal(bank.conv2, torch.full((D, 8), 1 / 8)) and torch.equal(bank.conv3, torch.full((D, 12), 1 / 12))
    taps = getattr(dn.MSAR(D, 4, conv_init="normal", init_std=0.5).bank, "0").conv3
    assert 0.3 < taps.std().item() < 0.7
    with pytest.raises(ValueError, match="conv_init"):
        dn.make("msar", D, 4, conv_init="ones")
    assert dn.MHC(D, 4).options == {"streams": 4, "sinkhorn_iters": 20, "impl": "fused"}


# ---- names, shapes and initialisation: depthkit's checkpoint ------------------------------------


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32", (name, e["dtype"])
        a, b = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).view(e["shape"])
    return out


@pytest.mark.parametrize("kind,sets", [
    ("residual", []), ("attnres", ["residual.block_sublayers=4", "residual.share_within_block=true"]),
    ("attnres_sepv", ["residual.block_sublayers=3"]), ("dar", ["residual.block_sublayers=3"]),
    ("dar", ["residual.block_sublayers=4", "residual.share_within_block=true"]),
    ("msar", []), ("msar", ["residual.conv=false", "residual.fusion=\"mean\"", "residual.block_sublayers=1"]),
    ("mhc", ["residual.streams=3"]), ("attnres_mhc", []),
])
def test_names_shapes_and_init_are_depthkits(kind, sets, depthkit_program, tmp_path):
    """state_dict() is `depthkit init`'s residual.* tensors without the prefix, the same shapes, and
    the same initialisation: the deterministic tensors equal, the random ones of the same spread."""
    cmd = [depthkit_program, "init", "--config", str(SOURCE_DIR / "configs" / "tiny.toml"), "--set",
           f"residual.kind={kind}", "--out", str(tmp_path / "ck")]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True)
    theirs = {k.removeprefix("residual."): v for k, v in read_safetensors(tmp_path / "ck" / "model.safetensors").items()
              if k.startswith("residual.")}
    options = {}
    for s in sets:
        key, value = s.removeprefix("residual.").split("=")
        options[key] = {"true": True, "false": False}.get(value, value.strip('"') if value.startswith('"')
                                                          else int(value) if value.isdigit() else value)
    torch.manual_seed(0)
    mine = {k: v.detach() for k, v in dn.make(kind, 128, 8, **options).state_dict().items()}  # tiny: d 128, 4 layers
    assert sorted(mine) == sorted(theirs)
    for name, t in theirs.items():
        assert mine[name].shape == t.shape and mine[name].dtype == torch.float32, name
        if torch.equal(mine[name], t):
            continue
        # Random in both (never a constant in one of them), with the same spread.
        assert t.std().item() > 0 and mine[name].std().item() > 0, name
        assert abs(mine[name].std().item() / t.std().item() - 1) < 0.15, (name, mine[name].std(), t.std())


# ---- torch.compile -------------------------------------------------------------------------------


def fake_impls_registered():
    """Whether DAR's operators run under FakeTensorMode (python/depthkit/_fake.py registers their fake
    implementations), which torch.compile needs to trace them: (False, why) only where an operator
    has none; any other failure of a fake implementation is an error of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException
    try:
        with FakeTensorMode() as mode:
            flat = mode.from_tensor(torch.randn(6, 4))
            q = torch.zeros(2, 4)
            _, beta, _ = torch.ops.depthkit.dar_read(q, [flat], [flat], None, None, torch.zeros(2, 8), torch.zeros(2),
                                                     torch.zeros(2, 8), torch.zeros(2), [1, 0], [0, 1], 1e-6)
            torch.ops.depthkit.dar_write(flat, beta, None, None, None, None, 1e-6)
            torch.ops.depthkit.depth_read(q[:1], [flat], [flat], 1e-6)
    except UnsupportedOperatorException as e:
        return False, f"no fake implementation of {e}"
    return True, ""


class PathwayModel(torch.nn.Module):
    def __init__(self, path, branches):
        super().__init__()
        self.path, self.branches = path, torch.nn.ModuleList(branches)

    def forward(self, x):
        return self.path(x, self.branches)


def test_compile_fullgraph_equals_eager():
    ok, why = fake_impls_registered()
    if not ok:
        pytest.skip(f"the depthkit operators have no fake implementations yet (python/depthkit/_fake.py): {why}")
    import torch._dynamo
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    path = dn.make("dar", D, 6, block_sublayers=4, dtype=torch.float64)
    perturb_(path, gen)
    model = PathwayModel(path, [Branch(D, gen, torch.float64) for _ in range(6)])
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    params = list(model.parameters())

    def run(m):
        xi = x.clone().requires_grad_()
        y = m(xi)
        return [y] + list(torch.autograd.grad(y, [xi] + params, torch.ones_like(y)))

    eager = run(model)
    # AOTAutograd's joint graph without Inductor's code generation: what tracing the pathway takes
    # (no graph break, the fake implementations, the mutating backward operators functionalized)
    # at a fraction of the time; Inductor compiles the example below and tests/python/test_opcheck.py.
    compiled = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    worst = max(max_rel(c, e) for c, e in zip(compiled, eager))
    print(f"compile dar: max rel diff {worst:.2e}")
    assert worst <= TOL


# ---- examples/train_gpt.py ---------------------------------------------------------------------


def write_shard(path, tokens):
    """An llm.c token shard (docs/data.md): 256 int32 header (magic 20240520, version 1, count), uint16 ids."""
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A corpus with structure to learn: a repeated pattern of 64 tokens with some noise."""
    folder = tmp_path_factory.mktemp("corpus")
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(64, (64,), generator=gen)
    tokens = pattern.repeat(400)
    noise = torch.rand(tokens.shape, generator=gen) < 0.05
    tokens[noise] = torch.randint(64, (int(noise.sum()),), generator=gen)
    write_shard(folder / "train_000000.bin", tokens.tolist())
    return folder


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_example_trains(tiny_corpus, compiled):
    if compiled:
        ok, why = fake_impls_registered()
        if not ok:
            pytest.skip(f"the depthkit operators have no fake implementations yet (python/depthkit/_fake.py): {why}")
    cmd = [sys.executable, str(SOURCE_DIR / "examples" / "train_gpt.py"), "--data", str(tiny_corpus), "--kind", "dar",
           "--steps", "12", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch", "8",
           "--vocab-size", "64", "--lr", "3e-3", "--set", "block_sublayers=4", "--seed", "1"]
    if compiled:
        cmd.append("--compile")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 12, r.stdout
    assert all(math.isfinite(v) for v in losses), losses
    assert "tokens/s" in r.stdout
    # From about ln 64 ≈ 4.2 (uniform over the pattern's tokens) well down in 12 steps.
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
