"""The depthkit operators under PyTorch's tracing tools: torch.library.opcheck (schema, autograd
registration, fake implementation against the kernel, AOT dispatch with dynamic shapes) for every
registered operator in float32 and float64 on several shapes and edge cases; torch.compile with
fullgraph=True of a function that runs every forward operator (the 14 fused ones and
shared_source; so the 14 backward ones in its backward), with one graph, no break, and outputs
and gradients equal to eager; torch.export of a module that uses them; and bad inputs that fail
as RuntimeErrors with one and the same line, from the kernel in eager mode and from the fake
implementation while tracing.

Inputs are built with tests/test_python_ops.py's helpers (`randn`, `rope_tables`, EPS), which
that file also uses for its comparisons against the equations; the operator list is the
dispatcher's (test_python_ops.registered_operators), so an operator without cases here, or without
a fake implementation (python/depthkit/_fake.py), fails test_every_operator_is_covered.
"""
import pathlib
import sys

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

import depthkit  # noqa: F401  (loads the operators and registers their fake implementations)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import test_python_ops as composed  # noqa: E402

ops = torch.ops.depthkit
EPS = composed.EPS
DTYPES = [torch.float32, torch.float64]


def acc(dtype):
    """The kernels' accumulation dtype: ζ, inverse RMS and the gradient buffers are kept in it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def leaf(dtype, *shape, scale=1.0):
    """A random input in `dtype` that requires a gradient (so opcheck checks the autograd paths)."""
    return composed.randn(*shape, scale=scale).to(dtype).requires_grad_()


def detached(args):
    """The same arguments without gradients: a backward operator's inputs (its autograd caller
    runs it with grad mode off; it has no Autograd kernel of its own)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), args)


def zeros(n, shape, dtype):
    """n gradient buffers that a backward operator adds into (Tensor(a!)[])."""
    return [torch.zeros(shape, dtype=dtype) for _ in range(n)]


# ---- Cases: for each operator, (name, build(dtype) -> args) ------------------------------------
# Forward cases are shared with their backward's: the backward runs on the forward's inputs and
# saved outputs. Each operator has an edge case: one source, T = 1 (P = 1 token), the block's first
# branch (no partial), MSAR's longest κ.


def depth_read_case(N, M, P, d, with_values):
    def build(dtype):
        keys = [leaf(dtype, P, d) for _ in range(N)]
        values = [leaf(dtype, P, d) for _ in range(N)] if with_values else []
        return leaf(dtype, M, d, scale=1.5), keys, values, EPS
    return build


DEPTH_READ = [("3-sources", depth_read_case(3, 2, 5, 4, True)),
              ("1-source-1-token-values-are-keys", depth_read_case(1, 1, 1, 4, False))]


def depth_read_backward_case(forward, grad_lse):
    def build(dtype):
        q, keys, values, eps = detached(forward(dtype))
        out, lse = ops.depth_read(q, keys, values, eps)
        g_lse = composed.randn(*lse.shape).to(lse.dtype) if grad_lse else None
        buffers = (zeros(len(keys), keys[0].shape, acc(dtype)), zeros(len(values), keys[0].shape, acc(dtype)))
        return (composed.randn(*out.shape).to(dtype), g_lse, q, keys, values, lse, eps, *buffers)
    return build


def depth_merge_case(P, d, with_value):
    def build(dtype):
        value = leaf(dtype, P, d) if with_value else None
        return leaf(dtype, P, d), leaf(acc(dtype), P), leaf(dtype, d), leaf(dtype, P, d), value, EPS
    return build


DEPTH_MERGE = [("value", depth_merge_case(5, 4, True)), ("1-token-value-is-key", depth_merge_case(1, 4, False))]


def backward_of(forward, grad_shapes):
    """A backward operator's arguments: the gradient(s) of the forward's output(s), then its inputs."""
    def build(dtype):
        args = detached(forward(dtype))
        return (*(composed.randn(*shape(args)).to(dtype) for shape in grad_shapes), *args)
    return build


def dar_read_case(N, P, d, partial, key, value):
    def build(dtype):
        h0, h1 = [leaf(dtype, P, d) for _ in range(N)], [leaf(dtype, P, d) for _ in range(N)]
        p0, p1 = (leaf(dtype, P, d), leaf(dtype, P, d)) if partial else (None, None)
        gates = [leaf(dtype, 2, 2 * d, scale=0.7), leaf(dtype, 2), leaf(dtype, 2, 2 * d, scale=0.7), leaf(dtype, 2)]
        return (leaf(dtype, 2, d), h0, h1, p0, p1, *gates, key, value, EPS)
    return build


DAR_READ = [("partial-cross-keys", dar_read_case(2, 3, 4, True, [1, 0], [0, 1])),
            ("block-start-1-entry-1-token", dar_read_case(1, 1, 4, False, [0, 0], [1, 1]))]


def dar_read_backward_case(forward, grad_beta):
    def build(dtype):
        q, h0, h1, p0, p1, wa, ba, wb, bb, key, value, eps = detached(forward(dtype))
        h, beta, lse = ops.dar_read(q, h0, h1, p0, p1, wa, ba, wb, bb, key, value, eps)
        g_beta = composed.randn(*beta.shape).to(dtype) if grad_beta else None
        buffers = zeros(len(h0), h0[0].shape, acc(dtype)), zeros(len(h1), h1[0].shape, acc(dtype))
        return (composed.randn(*h.shape).to(dtype), g_beta, q, h0, h1, p0, p1, wa, ba, wb, bb, lse, key, value, eps,
                *buffers)
    return build


def dar_write_case(P, d, transport):
    def build(dtype):
        f, beta = leaf(dtype, P, d), (torch.rand(P, 2, dtype=torch.float64) * 2).to(dtype).requires_grad_()
        if not transport:
            return f, beta, None, None, None, None, EPS
        return f, beta, leaf(dtype, P, d), leaf(dtype, P, d), leaf(dtype, 1, 2 * d), leaf(dtype, 1), EPS
    return build


DAR_WRITE = [("transport", dar_write_case(3, 4, True)), ("block-start-1-token", dar_write_case(1, 4, False))]


def msar_read_case(m, N, B, T, d, K, lengths):
    def build(dtype):
        sources = [leaf(dtype, B, T, d) for _ in range(N)]
        conv = [leaf(dtype, m - 1, d, K, scale=0.5) for _ in range(N)]
        return leaf(dtype, m, d, scale=1.5), sources, conv, EPS, lengths
    return build


# MSAR Appendix C: κ = {4, 8, 12} padded to K = 12, over T = 13 tokens so that the longest kernel's
# last tap reaches token 0.
MSAR_READ = [("longest-kappa", msar_read_case(4, 2, 1, 13, 4, 12, [4, 8, 12])),
             ("1-source-1-token", msar_read_case(2, 1, 2, 1, 4, 2, None))]


def msar_read_context_case(m, N, B, T, d, K, lengths, context):
    def build(dtype):
        return (*msar_read_case(m, N, B, T, d, K, lengths)(dtype), context)
    return build


# A cached decoding step: the K − 1 positions of the convolution tail, then the new position(s).
MSAR_READ_CONTEXT = [("decoding-step", msar_read_context_case(4, 2, 2, 12, 4, 12, [4, 8, 12], 11)),
                     ("two-new-positions", msar_read_context_case(3, 1, 1, 5, 4, 3, None, 3))]


def msar_block_read_case(S, forward):
    """msar_read's case read by S queries tensors (the branches of one block)."""
    def build(dtype):
        q, *rest = forward(dtype)
        return ([q] + [leaf(dtype, *q.shape, scale=1.5) for _ in range(S - 1)], *rest)
    return build


MSAR_BLOCK_READ = [(f"{name}-3-queries", msar_block_read_case(3, build)) for name, build in MSAR_READ + MSAR_READ_CONTEXT]


def msar_block_read_backward_case(forward, grads):
    """grads: per queries tensor, whether its out and its ζ have a gradient."""
    def build(dtype):
        qs, sources, conv, eps, lengths = detached(forward(dtype))
        outs, lses = ops.msar_block_read(qs, sources, conv, eps, lengths)
        g_out = [composed.randn(*o.shape).to(dtype) if given[0] else None for o, given in zip(outs, grads)]
        g_lse = [composed.randn(*l.shape).to(l.dtype) if given[1] else None for l, given in zip(lses, grads)]
        buffers = zeros(len(sources), sources[0].shape, acc(dtype))
        return (g_out, g_lse, qs, sources, conv, lses, eps, lengths, buffers)
    return build


def msar_read_backward_case(forward, grad_lse):
    def build(dtype):
        q, sources, conv, eps, lengths = detached(forward(dtype))
        out, lse = ops.msar_read(q, sources, conv, eps, lengths)
        g_lse = composed.randn(*lse.shape).to(lse.dtype) if grad_lse else None
        buffers = zeros(len(sources), sources[0].shape, acc(dtype))
        return (composed.randn(*out.shape).to(dtype), g_lse, q, sources, conv, lse, eps, lengths, buffers)
    return build


def msar_fuse_case(m, B, T, d, K, partial, hpre, lengths):
    def build(dtype):
        part = (leaf(dtype, B, T, d), leaf(dtype, m - 1, d, K, scale=0.5)) if partial else (None, None)
        gates = ((leaf(dtype, m, m * d, scale=0.3), leaf(dtype, m), (composed.randn(1) + 1).to(dtype).requires_grad_())
                 if hpre else (None, None, None))
        return (leaf(dtype, m, B, T, d), leaf(acc(dtype), m, B, T), leaf(dtype, m, d, scale=1.5), *part, *gates, EPS,
                lengths)
    return build


def msar_fuse_context_case(m, B, T, d, K, hpre, lengths, context):
    def build(dtype):
        args = list(msar_fuse_case(m, B, T, d, K, True, hpre, lengths)(dtype))
        args[3] = leaf(dtype, B, context + T, d)  # the partial with its tail first
        return (*args, context)
    return build


MSAR_FUSE_CONTEXT = [("decoding-step-hpre", msar_fuse_context_case(4, 2, 1, 4, 12, True, [4, 8, 12], 11)),
                     ("two-new-positions-mean", msar_fuse_context_case(3, 1, 2, 4, 3, False, None, 2))]

MSAR_FUSE = [("partial-hpre-longest-kappa", msar_fuse_case(4, 1, 13, 4, 12, True, True, [4, 8, 12])),
             ("partial-mean", msar_fuse_case(3, 2, 3, 4, 2, True, False, None)),
             ("first-branch-mean-1-token", msar_fuse_case(2, 2, 1, 4, 2, False, False, None))]


def mhc_pre_case(lead, m, d):
    def build(dtype):
        n = m * m + 2 * m
        scale = torch.tensor([1.7, -2.3, 3.1], dtype=dtype, requires_grad=True)
        x, phi, bias = leaf(dtype, *lead, m, d, scale=1.3), leaf(dtype, n, m * d, scale=0.3), leaf(dtype, n, scale=0.5)
        return x, phi, bias, scale, EPS
    return build


# m = 4 takes the kernels' unrolled path, m = 3 the general one.
MHC_PRE = [("4-streams", mhc_pre_case((2, 3), 4, 4)), ("3-streams-1-token", mhc_pre_case((1, 1), 3, 2))]


def mhc_pre_backward_case(forward, grads):
    def build(dtype):
        x, phi, bias, scale, eps = detached(forward(dtype))
        outputs = ops.mhc_pre(x, phi, bias, scale, eps)
        g = [composed.randn(*o.shape).to(o.dtype) if given else None for o, given in zip(outputs, grads)]
        return (*g, x, phi, bias, scale, outputs[3], eps)
    return build


def mhc_sinkhorn_case(lead, m, iters):
    return lambda dtype: (leaf(dtype, *lead, m, m, scale=2.5), iters)


MHC_SINKHORN = [("4-streams-20-rounds", mhc_sinkhorn_case((2, 3), 4, 20)),
                ("3-streams-1-round-1-token", mhc_sinkhorn_case((1, 1), 3, 1))]


def mhc_merge_case(lead, m, d):
    def build(dtype):
        return leaf(dtype, *lead, m, d), leaf(dtype, *lead, d), leaf(dtype, *lead, m), leaf(dtype, *lead, m, m)
    return build


MHC_MERGE = [("4-streams", mhc_merge_case((2, 3), 4, 5)), ("3-streams-1-token", mhc_merge_case((1, 1), 3, 2))]


def rms_norm_case(*shape):
    return lambda dtype: (leaf(dtype, *shape, scale=2.0), (torch.rand(shape[-1], dtype=dtype) + 0.5).requires_grad_(),
                          1e-5)


RMS_NORM = [("3d", rms_norm_case(2, 3, 7)), ("1-row", rms_norm_case(1, 5))]


def rms_norm_backward_case(forward):
    def build(dtype):
        x, w, eps = detached(forward(dtype))
        return composed.randn(*x.shape).to(dtype), x, w, ops.rms_norm(x, w, eps)[1]  # the inverse RMS it keeps
    return build


def rope_qkv_case(B, T, H, KV, hd, offset):
    def build(dtype):
        cos, sin = composed.rope_tables(hd, T + offset + 1)
        return leaf(dtype, B, T, (H + 2 * KV) * hd), cos, sin, H, KV, offset
    return build


ROPE_QKV = [("gqa-offset", rope_qkv_case(2, 3, 4, 2, 6, 2)), ("mha-1-token", rope_qkv_case(1, 1, 2, 2, 4, 0))]


def rope_qkv_backward_case(forward, grads):
    def build(dtype):
        qkv, cos, sin, H, KV, offset = detached(forward(dtype))
        outputs = ops.rope_qkv(qkv, cos, sin, H, KV, offset)
        g = [composed.randn(*o.shape).to(dtype) if given else None for o, given in zip(outputs, grads)]
        return (*g, cos, sin, H, KV, offset)
    return build


SWIGLU = [("3d", lambda dtype: (leaf(dtype, 2, 3, 8, scale=4.0),)), ("1d", lambda dtype: (leaf(dtype, 4, scale=4.0),))]

# A history entry [P, d] or [B, T, d], and a transposed (non-contiguous) one: the copy is contiguous.
SHARED_SOURCE = [("flat", lambda dtype: (leaf(dtype, 6, 4),)), ("1-token", lambda dtype: (leaf(dtype, 1, 1, 3),)),
                 ("transposed", lambda dtype: (leaf(dtype, 4, 6).t(),))]


def linear_cross_entropy_case(N, V, d):
    def build(dtype):
        targets = torch.randint(V, (N,))
        return leaf(dtype, N, d), leaf(dtype, V, d, scale=0.5), targets
    return build


LINEAR_CROSS_ENTROPY = [("6-tokens", linear_cross_entropy_case(6, 9, 4)),
                        ("1-token", linear_cross_entropy_case(1, 3, 2))]


def renamed(cases, build_backward):
    return [(name, build_backward(build)) for name, build in cases]


CASES = {
    "depth_read": DEPTH_READ,
    "depth_read_backward": [("3-sources", depth_read_backward_case(DEPTH_READ[0][1], True)),
                            ("1-source-no-lse-grad", depth_read_backward_case(DEPTH_READ[1][1], False))],
    "depth_merge": DEPTH_MERGE,
    "depth_merge_backward": renamed(DEPTH_MERGE, lambda f: backward_of(f, [lambda a: a[0].shape])),
    "dar_read": DAR_READ,
    "dar_read_backward": [("partial-cross-keys", dar_read_backward_case(DAR_READ[0][1], True)),
                          ("block-start-no-beta-grad", dar_read_backward_case(DAR_READ[1][1], False))],
    "dar_write": DAR_WRITE,
    "dar_write_backward": renamed(DAR_WRITE, lambda f: backward_of(f, [lambda a: a[0].shape] * 2)),
    "msar_read": MSAR_READ + MSAR_READ_CONTEXT,
    "msar_read_backward": [("longest-kappa", msar_read_backward_case(MSAR_READ[0][1], True)),
                           ("1-source-1-token-no-lse-grad", msar_read_backward_case(MSAR_READ[1][1], False))],
    "msar_block_read": MSAR_BLOCK_READ,
    "msar_block_read_backward": [
        ("longest-kappa", msar_block_read_backward_case(MSAR_BLOCK_READ[0][1], [(True, True)] * 3)),
        ("1-source-1-token-partial-grads",
         msar_block_read_backward_case(MSAR_BLOCK_READ[1][1], [(True, False), (False, True), (False, False)]))],
    "msar_fuse": MSAR_FUSE + MSAR_FUSE_CONTEXT,
    "msar_fuse_backward": renamed(MSAR_FUSE, lambda f: backward_of(f, [lambda a: a[0].shape[1:]])),
    "mhc_pre": MHC_PRE,
    "mhc_pre_backward": [("4-streams", mhc_pre_backward_case(MHC_PRE[0][1], [True, True, True])),
                         ("3-streams-1-token-no-res-grad", mhc_pre_backward_case(MHC_PRE[1][1], [True, True, False]))],
    "mhc_sinkhorn": MHC_SINKHORN,
    "mhc_sinkhorn_backward": renamed(MHC_SINKHORN, lambda f: backward_of(f, [lambda a: a[0].shape])),
    "mhc_merge": MHC_MERGE,
    "mhc_merge_backward": renamed(MHC_MERGE, lambda f: backward_of(f, [lambda a: a[0].shape])),
    "rms_norm": RMS_NORM,
    "rms_norm_backward": renamed(RMS_NORM, rms_norm_backward_case),
    "rope_qkv": ROPE_QKV,
    "rope_qkv_backward": [("gqa-offset", rope_qkv_backward_case(ROPE_QKV[0][1], [True, True, True])),
                          ("mha-1-token-k-grad-only", rope_qkv_backward_case(ROPE_QKV[1][1], [False, True, False]))],
    "swiglu": SWIGLU,
    "swiglu_backward": renamed(SWIGLU, lambda f: backward_of(f, [lambda a: (*a[0].shape[:-1], a[0].shape[-1] // 2)])),
    "linear_cross_entropy": LINEAR_CROSS_ENTROPY,
    "linear_cross_entropy_backward": renamed(LINEAR_CROSS_ENTROPY, lambda f: lambda dtype: detached(f(dtype))),
    "shared_source": SHARED_SOURCE,
}


# ---- opcheck ------------------------------------------------------------------------------------


def test_every_operator_is_covered():
    """Every operator the dispatcher lists in the depthkit namespace has cases here and a fake
    implementation; a name here that is not registered is stale."""
    registered = composed.registered_operators()
    assert registered, "no depthkit operator is registered"
    assert sorted(CASES) == registered, f"cases for {sorted(CASES)}, registered {registered}"
    from torch._library.simple_registry import singleton
    missing = [op for op in registered if singleton.find(f"depthkit::{op}").fake_impl.kernel is None]
    assert not missing, f"no fake implementation (python/depthkit/_fake.py) for {', '.join(missing)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("op,build", [pytest.param(op, build, id=f"{op}-{name}")
                                      for op, cases in CASES.items() for name, build in cases])
def test_opcheck(op, build, dtype):
    torch.manual_seed(0)
    # All the default checks: test_schema, test_autograd_registration, test_faketensor,
    # test_aot_dispatch_dynamic (raise on the first failure).
    torch.library.opcheck(getattr(ops, op).default, build(dtype))


# ---- torch.compile and torch.export ----------------------------------------------------------


class Pathways(torch.nn.Module):
    """A small function of every forward operator, as a model would chain them: the backbone's
    norm, RoPE'd q/k/v, SwiGLU and loss around an AttnRes read with its partial merged in, DAR's
    read and write (both block positions; x a shared source of both reads), MSAR's read and fusion
    (with kernel lengths; a block's two reads at once, the first's outputs unused), and mHC's pre-mix, Sinkhorn and merge over 4 streams. x [B, T, d],
    targets [B, T]."""

    def __init__(self, d=4, vocab=7, max_len=16, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape, scale=1.0):
            return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * scale)

        m, n = 4, 4 * 4 + 2 * 4  # mHC streams and their m² + 2m logits
        self.norm, self.qkv, self.up = param(d, scale=0.3), param(4 * d, d, scale=0.5), param(2 * d, d, scale=0.5)
        self.q_read, self.q_dar, self.q_msar, self.q_msar2 = (param(1, d), param(2, d), param(3, d, scale=1.5),
                                                              param(3, d, scale=1.5))
        self.w_alpha, self.b_alpha, self.w_beta, self.b_beta = (param(2, 2 * d, scale=0.7), param(2),
                                                                param(2, 2 * d, scale=0.7), param(2))
        self.w_rho, self.b_rho = param(1, 2 * d), param(1)
        self.conv0, self.conv1, self.conv_part = (param(2, d, 3, scale=0.5) for _ in range(3))  # the partial's last
        self.w_pre, self.b_pre, self.alpha_pre = param(3, 3 * d, scale=0.3), param(3), param(1)
        self.phi, self.mhc_bias, self.mhc_scale = param(n, m * d, scale=0.3), param(n, scale=0.5), param(3)
        self.head = param(vocab, d, scale=0.5)
        cos, sin = composed.rope_tables(d, max_len)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, targets):
        B, T, d = x.shape
        y, _ = ops.rms_norm(x, self.norm + 1, 1e-5)
        q, k, v = ops.rope_qkv(y @ self.qkv.T, self.cos, self.sin, 2, 1, 0)  # 2 query heads, 1 k/v head
        a = q.sum(2) + k[:, :, 0] * v[:, :, 0]
        f = ops.swiglu(a @ self.up.T)
        # x is an entry of the history that two reads take (one gradient buffer for both).
        flat = [ops.shared_source(x.reshape(B * T, d)), f.reshape(B * T, d)]
        out, lse = ops.depth_read(self.q_read, flat, [], EPS)  # AttnRes: keys = values
        h = ops.depth_merge(out[0], lse[0], self.q_read[0], a.reshape(B * T, d), None, EPS)
        hd, beta, _ = ops.dar_read(self.q_dar, flat, [h, flat[1]], None, None, self.w_alpha, self.b_alpha, self.w_beta,
                                   self.b_beta, [1, 0], [0, 1], EPS)
        p0, p1 = ops.dar_write(hd, beta, None, None, None, None, EPS)
        p0, p1 = ops.dar_write(hd, beta, p0, p1, self.w_rho, self.b_rho, EPS)
        mo, mlse = ops.msar_read(self.q_msar, [x, f], [self.conv0, self.conv1], EPS, [2, 3])
        z = ops.msar_fuse(mo, mlse, self.q_msar, p0.reshape(B, T, d), self.conv_part, self.w_pre, self.b_pre,
                          self.alpha_pre, EPS, [2, 3])
        # A block's two branches reading the same sources at once (the pathway's phase 1).
        (_, mo2), (_, mlse2) = ops.msar_block_read([self.q_msar, self.q_msar2], [x, f], [self.conv0, self.conv1], EPS,
                                                   [2, 3])
        z = z + ops.msar_fuse(mo2, mlse2, self.q_msar2, None, None, None, None, None, EPS, [2, 3])
        streams = torch.stack([x, f, z, p1.reshape(B, T, d)], 2)
        h_pre, h_post, res_logits, _ = ops.mhc_pre(streams, self.phi, self.mhc_bias, self.mhc_scale, EPS)
        merged = ops.mhc_merge(streams, h_pre, h_post, ops.mhc_sinkhorn(res_logits, 5))
        loss = ops.linear_cross_entropy(merged.sum(2).reshape(B * T, d), self.head, targets.reshape(B * T))
        return loss, z, merged


def inputs(T, B=2, d=4, vocab=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(T)
    return (torch.randn(B, T, d, generator=g, dtype=dtype).requires_grad_(),
            torch.randint(vocab, (B, T), generator=g))


def run(model, x, targets):
    """Outputs, and the gradients of x and every parameter from one scalar of all of them."""
    loss, z, merged = model(x, targets)
    total = loss + (z * torch.linspace(-1, 1, z.shape[-1], dtype=z.dtype)).sum() + merged.square().mean()
    grads = torch.autograd.grad(total, [x, *model.parameters()])
    return [loss, z, merged], list(grads)


def expect_equal(got, want):
    # AOTAutograd's graphs run the same kernels and ATen operations on the same inputs, in the
    # same order: bitwise equal.
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def operators_called(graph):
    """The depthkit operators an FX graph calls: directly, or through auto_functionalized (a
    mutating backward operator, after functionalization)."""
    names = set()
    for node in graph.nodes:
        if node.op == "call_function":
            for target in (node.target, *node.args[:1]):
                if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                    overload = isinstance(target, torch._ops.OpOverload)
                    name = target._schema.name if overload else target._qualified_op_name
                    if name.startswith("depthkit::"):
                        names.add(name[len("depthkit::"):])
    return names


def test_compile_fullgraph_dynamic():
    """One graph, no break, across two sequence lengths (dynamic shapes, so the fake
    implementations and the Autograd kernels run on symbolic sizes), through AOTAutograd and
    functionalization (the mutating backward operators are auto-functionalized); its forward
    graph runs the 15 forward operators and its backward graph the 14 backward ones; outputs and
    gradients equal eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    # Graphs by (frame, compilation of that frame): a second key is a graph break (another frame's
    # graph) or a recompilation. Dynamo may restart one compilation (attempt 1: the float eps,
    # traced as a symbol, is specialised because the operators take a `float`); the last attempt's
    # graphs are the ones that run.
    dynamo_graphs, aot_graphs = {}, {}

    def compilation():
        compile_id = torch._guards.CompileContext.current_compile_id()
        return compile_id.frame_id, compile_id.frame_compile_id

    def keep(gm, example_inputs):
        aot_graphs.setdefault(compilation(), {})[len(aot_graphs.get(compilation(), {}))] = gm
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def counting(gm, example_inputs):
        dynamo_graphs[compilation()] = gm
        aot_graphs.pop(compilation(), None)  # an earlier attempt's
        return aot(gm, example_inputs)

    model = Pathways()
    compiled = torch.compile(model, backend=counting, fullgraph=True, dynamic=True)
    for T in (3, 5):
        x, targets = inputs(T)
        got, got_grads = run(compiled, x, targets)
        want, want_grads = run(model, x.detach().requires_grad_(), targets)
        expect_equal(got, want)
        expect_equal(got_grads, want_grads)
    assert len(dynamo_graphs) == 1, f"graphs of {sorted(dynamo_graphs)}: a graph break or a recompilation"
    (key, graph), = dynamo_graphs.items()
    everything = composed.registered_operators()
    assert operators_called(graph.graph) == {op for op in everything if not op.endswith("_backward")}
    forward_graph, backward_graph = aot_graphs[key].values()  # compiled once for both lengths
    # With gradients wanted, linear_cross_entropy's Autograd kernel runs its backward operator in
    # the forward (loss and gradients from the same chunk of logits: backbone_ops.cpp).
    assert operators_called(forward_graph.graph) | operators_called(backward_graph.graph) == \
        set(everything) - {"linear_cross_entropy"}
    assert all(op.endswith("_backward") for op in operators_called(backward_graph.graph))


def test_compile_inductor():
    """The default backend (Inductor) compiles the same model with fullgraph=True: outputs and
    gradients equal eager."""
    torch._dynamo.reset()
    model = Pathways()
    compiled = torch.compile(model, fullgraph=True)
    x, targets = inputs(4)
    got, got_grads = run(compiled, x, targets)
    want, want_grads = run(model, x.detach().requires_grad_(), targets)
    # Inductor writes its own loops for the ATen operations around the kernels (sums, products,
    # reshapes), whose vectorised reductions may add in another order: float64 roundings only.
    # (Measured bitwise equal here; the bound leaves room for another instruction set.)
    for g, w in zip(got + got_grads, want + want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_export():
    """torch.export with a symbolic sequence length; the exported program runs at another length
    and equals eager."""
    model = Pathways()
    T = torch.export.Dim("T", min=2, max=16)  # the RoPE tables hold 16 positions
    program = torch.export.export(model, inputs(3), dynamic_shapes={"x": {1: T}, "targets": {1: T}})
    called = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    forward = [op for op in composed.registered_operators() if not op.endswith("_backward")]
    assert {name for name in called if name.startswith("depthkit.")} == {f"depthkit.{op}.default" for op in forward}, \
        called
    x, targets = inputs(6)
    with torch.no_grad():
        for g, w in zip(program.module()(x, targets), model(x, targets), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---- Errors ----------------------------------------------------------------------------------


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# A bad call of each forward operator (and of the backward buffers' checks): the kernel's message.
BAD_CALLS = [
    ("depth_read", lambda: (t(2, 6), [t(5, 7)], [], EPS), "depth_read: queries have d = 6, keys d = 7"),
    ("depth_read", lambda: (t(2, 7), [t(5, 7)], [t(5, 3)], EPS),
     "depth_read: key/value 0 is [5, 7]/[5, 3], source 0 [5, 7]"),
    ("depth_read_backward",
     lambda: (t(2, 5, 7), None, t(2, 7), [t(5, 7)], [], t(2, 5), EPS, [t(5, 7, dtype=torch.float64)], []),
     "depth_read_backward: grad_keys: a buffer is [5, 7] Double, expected contiguous [5, 7] Float"),
    ("depth_merge", lambda: (t(5, 4), t(5), t(3), t(5, 4), None, EPS),
     "depth_merge: expected out, key_part, value_part [P, d], log_partition [P], query [d]"),
    ("dar_read", lambda: (t(2, 4), [t(3, 4)], [t(3, 4)], t(3, 4), None, t(2, 8), t(2), t(2, 8), t(2), [0, 1], [0, 1],
                          EPS), "dar_read: give both partial streams or neither"),
    ("dar_read", lambda: (t(2, 4), [t(3, 4)], [t(3, 4)], None, None, t(2, 8), t(2), t(2, 8), t(2), [0, 2], [0, 1],
                          EPS), "dar_read: stream indices must be 0 or 1, got 2"),
    ("dar_write", lambda: (t(3, 4), t(3, 2), t(3, 4), t(3, 4), t(1, 4), t(1), EPS),
     "dar_write: expected partial streams [3, 4], w_rho [1, 8] and b_rho [1]"),
    ("msar_read", lambda: (t(3, 4), [t(1, 5, 4)], [t(2, 4, 3)], EPS, [2, 4]),
     "msar_read: kernel_lengths[1] = 4 is outside 1 ... K = 3 (the padded kernel)"),
    ("msar_read", lambda: (t(3, 4), [t(1, 5, 4)], [t(3, 4, 3)], EPS, None),
     "msar_read: conv 0 is [3, 4, 3], expected [m - 1, d, K] = [2, 4, K >= 1] as conv 0"),
    ("msar_block_read", lambda: ([t(3, 4), t(2, 4)], [t(1, 5, 4)], [t(2, 4, 3)], EPS, None),
     "msar_read: queries 1 are [2, 4], queries 0 [3, 4]"),
    ("msar_fuse", lambda: (t(3, 1, 5, 4), t(3, 1, 5), t(3, 4), None, None, t(3, 12), None, None, EPS, None),
     "msar_fuse: w_pre, b_pre and alpha_pre come together (none of them: mean fusion)"),
    ("mhc_pre", lambda: (t(2, 4, 3), t(24, 11), t(24), t(3), EPS),
     "mhc_pre: phi must be [m² + 2m, md] = [24, 12], got [24, 11]"),
    ("mhc_sinkhorn", lambda: (t(2, 3, 4), 3), "mhc_sinkhorn: expected logits [*, m, m], got [2, 3, 4]"),
    ("mhc_merge", lambda: (t(2, 3, 4), t(2, 4), t(2, 2), t(2, 3, 3)), "mhc_merge: h_post must be [2, 3], got [2, 2]"),
    ("rms_norm", lambda: (t(2, 5), t(4), 1e-5), "rms_norm: weight [4] does not match input [2, 5]"),
    ("rope_qkv", lambda: (t(1, 3, 24), *composed.rope_tables(6, 2), 2, 1, 0),
     "rope_qkv: positions 0 … 2 exceed the tables' 2"),
    ("swiglu", lambda: (t(2, 5),), "swiglu: expected gate_up [..., 2F], got [2, 5]"),
    ("linear_cross_entropy", lambda: (t(3, 4), t(5, 4), torch.zeros(2, dtype=torch.int64)),
     "linear_cross_entropy: expected int64 targets [3], got [2]"),
]


@pytest.mark.parametrize("op,build,message", [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(BAD_CALLS)])
def test_bad_input_is_one_line_error(op, build, message):
    """The same RuntimeError, one line, from the kernel (eager) and from the fake implementation
    (FakeTensorMode, as torch.compile and torch.export trace): never an abort."""
    args = build()
    with pytest.raises(RuntimeError) as eager:
        getattr(ops, op)(*args)
    with FakeTensorMode() as mode:
        fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        with pytest.raises(RuntimeError) as fake:
            getattr(ops, op)(*fake_args)
    assert str(eager.value) == message
    assert str(fake.value) == message
