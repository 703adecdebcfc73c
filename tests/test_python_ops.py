"""The fused operators from Python: load libdepthkit_ops.so with torch.ops.load_library, and for
every registered forward operator torch.ops.depthkit.X compare, in float64 on random inputs, its
outputs with a PyTorch composition written here from the papers' equations, its gradients
(through its hand-written backward operator) with autograd's gradients of that composition from
the same random cotangents, and run torch.autograd.gradcheck through it.

One function `check_X(ops)` per operator X. The operators are listed from the dispatcher
(torch._C._jit_get_all_schemas): an operator without its check fails here, and each check's
gradient comparisons must run both X and X_backward (seen by the profiler). tests/test_operator_checklist.cpp reads the
`def check_X(` lines of this file to hold every operator to having one.

usage: python test_python_ops.py path/to/libdepthkit_ops.so
"""
import sys

import torch
import torch.nn.functional as F

EPS = 1e-6  # kKeyNormEps (ops/reference/depth_attention.h): the keys' RMSNorm, the gates' Norm
TOL = 1e-10  # float64, relative to max(1, max |want|)
F64 = dict(dtype=torch.float64)


# ---- Compositions from the equations --------------------------------------------------------


def norm(x, eps=EPS):
    """Weightless RMSNorm over the last dimension (Norm_h, DAR eq. 2)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def depth_read(q, keys, values):
    """Per target m: softmax over sources r of q_m · Norm(K_r), applied to V_r (DAR eq. 3–5)."""
    logits = torch.einsum("md,npd->mnp", q, norm(keys))
    weights = torch.softmax(logits, dim=1)
    return torch.einsum("mnp,npd->mpd", weights, values), torch.logsumexp(logits, dim=1)


def merge(out, log_partition, q, key, value):
    """A completed read (out, ζ) and one more candidate merged by online softmax (DAR eq. A.6–A.10):
    with a = q · Norm(key), λ = e^ζ / (e^ζ + e^a) = σ(ζ − a) and h = λ out + (1 − λ) value."""
    lam = torch.sigmoid(log_partition - (norm(key) * q).sum(-1))[..., None]
    return lam * out + (1 - lam) * value


def dar_read(q, h0, h1, p0, p1, wa, ba, wb, bb, key, value):
    """DAR eq. 10–15 with the partial as one more candidate."""
    streams = [h0, h1] if p0 is None else [torch.cat([h0, p0[None]]), torch.cat([h1, p1[None]])]
    z = [depth_read(q[j : j + 1], streams[key[j]], streams[value[j]])[0][0] for j in range(2)]
    hbar = norm(torch.cat(z, -1))
    alpha = torch.sigmoid(hbar @ wa.T + ba)
    beta = 2 * torch.sigmoid(hbar @ wb.T + bb)
    return alpha[:, :1] * z[0] + alpha[:, 1:] * z[1], beta


def dar_write(f, beta, p0, p1, w_rho, b_rho):
    """DAR eq. 16–17."""
    w0, w1 = beta[:, :1] * f, beta[:, 1:] * f
    if p0 is None:
        return w0, w1
    rho = torch.sigmoid(norm(torch.cat([p0, p1], -1)) @ w_rho.T + b_rho)
    return rho * p0 + (1 - rho) * p1 + w0, (1 - rho) * p0 + rho * p1 + w1


def msar_expand(x, bank, lengths=None):
    """The m streams [m, B, T, d] of x [B, T, d] (MSAR eq. 9–10): stream 0 is x, stream r the causal
    depthwise convolution Σ_δ bank[r − 1, :, δ] ⊙ x_{t−δ} (zero before t = 0) over its first
    lengths[r − 1] taps (all K without lengths: the rest is padding, never read)."""
    T = x.shape[1]
    streams = [x]
    for r in range(bank.shape[0]):
        taps = bank.shape[2] if lengths is None else lengths[r]
        y = torch.zeros_like(x)
        for delta in range(min(taps, T)):
            y = y + bank[r, :, delta] * F.pad(x, (0, 0, delta, 0))[:, :T]  # x_{t−δ}
        streams.append(y)
    return torch.stack(streams)


def msar_read(q, sources, conv, lengths=None):
    """Per stream r: depth attention over the N sources' r-th expanded streams (eq. 11–12)."""
    E = torch.stack([msar_expand(x, c, lengths) for x, c in zip(sources, conv)], 1)  # [m, N, B, T, d]
    logits = torch.einsum("rd,rnbtd->rnbt", q, norm(E))
    weights = torch.softmax(logits, dim=1)
    return torch.einsum("rnbt,rnbtd->rbtd", weights, E), torch.logsumexp(logits, dim=1)


def msar_fuse(out, lse, q, partial, partial_conv, w_pre, b_pre, alpha_pre, lengths=None):
    """The partial's expansion merged into each stream (eq. 17, A.6–A.10), then the m streams fused:
    h = Σ_r H_pre[r] z_r with H_pre = σ(α Norm(flatten Z) W_preᵀ + b_pre) (eq. 13–14), or their mean."""
    z = out
    if partial is not None:
        e = msar_expand(partial, partial_conv, lengths)
        z = merge(out, lse, q[:, None, None], e, e)
    Z = z.permute(1, 2, 0, 3)  # [B, T, m, d]
    if w_pre is None:
        return Z.mean(-2)
    pre = torch.sigmoid(alpha_pre * (norm(Z.flatten(-2)) @ w_pre.T) + b_pre)
    return (pre[..., None] * Z).sum(-2)


def mhc_pre(x, phi, bias, scale):
    """mHC's pre-mix (MSAR eq. 3–4): l = α ⊙ (x φᵀ)/rms(x) + b over the m + m + m² logits (α_pre,
    α_post, α_res spread over them); h = Σ_i σ(l_pre)[i] x_i, H_post = 2 σ(l_post), the H_res
    logits, and the normalised projection (x φᵀ)/rms(x)."""
    m = x.shape[-2]
    flat = x.flatten(-2)
    proj = (flat @ phi.T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
    alpha = torch.cat([scale[0:1].expand(m), scale[1:2].expand(m), scale[2:3].expand(m * m)])
    logits = alpha * proj + bias
    pre = torch.sigmoid(logits[..., :m])
    post = 2 * torch.sigmoid(logits[..., m : 2 * m])
    res = logits[..., 2 * m :].reshape(*x.shape[:-2], m, m)
    return (pre[..., None] * x).sum(-2), post, res, proj


def sinkhorn(logits, iters):
    """Sinkhorn–Knopp on exp(logits − max): `iters` rounds of rows, then columns."""
    p = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iters):
        p = p / p.sum(-1, keepdim=True)
        p = p / p.sum(-2, keepdim=True)
    return p


def mhc_merge(x, f, h_post, h_res):
    """MSAR eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i."""
    return h_post[..., None] * f[..., None, :] + torch.einsum("...ij,...id->...jd", h_res, x)


def rms_norm(x, weight, eps):
    """RMSNorm with weight: r = 1/√(mean x² + ε) per row, y = x r ⊙ w; and r of every row."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * r * weight, r.reshape(-1)


def rope_tables(hd, max_len, theta=10000.0):
    """RoPE's cos, sin [max_len, hd / 2] (float32, as the model keeps them): angle t θ^(−2i/hd)."""
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, offset):
    """q, k, v heads of the fused projection, q and k rotated by RoPE with rotate-half pairing
    (dimension i with i + hd/2; RoFormer eq. 34): (x₁, x₂) → (x₁ c − x₂ s, x₁ s + x₂ c)."""
    B, T, C = qkv.shape
    hd = C // (n_heads + 2 * n_kv_heads)
    c = cos[offset : offset + T, None].to(qkv.dtype)
    s = sin[offset : offset + T, None].to(qkv.dtype)

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    q, k, v = qkv.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], -1)
    return (rotate(q.reshape(B, T, n_heads, hd)), rotate(k.reshape(B, T, n_kv_heads, hd)),
            v.reshape(B, T, n_kv_heads, hd))


def swiglu(gate_up):
    """SwiGLU's activation (Shazeer 2020): silu(gate) ⊙ up, gate first."""
    gate, up = gate_up.chunk(2, -1)
    return gate * torch.sigmoid(gate) * up


def linear_cross_entropy(hidden, weight, targets):
    """The mean over tokens of −log softmax(hidden Wᵀ)[target] = logsumexp(z) − z[target]."""
    z = hidden @ weight.T
    return (torch.logsumexp(z, -1) - z.gather(-1, targets[:, None])[:, 0]).mean()


# ---- Checks ---------------------------------------------------------------------------------


def expect_near(name, got, want, tol=TOL):
    if len(got) != len(want):
        sys.exit(f"FAIL {name}: {len(got)} outputs, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            sys.exit(f"FAIL {name}: output {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
        err = (g - w).abs().max().item() if g.numel() else 0.0
        if err > tol * max(1.0, w.abs().max().item() if w.numel() else 0.0):
            sys.exit(f"FAIL {name}: output {i}: max |diff| {err}")
    print(f"ok   {name}")


# The depthkit operators that the gradient comparisons of the running check dispatched.
DISPATCHED = set()


def expect_same_gradients(name, fused, composed, inputs, differentiated, seed=1):
    """fused and composed, functions of `inputs` returning their outputs, agree on the outputs and on
    the gradient of every input from the same random cotangents of the first `differentiated`
    outputs (the others carry no gradient); then gradcheck runs through the fused one. The
    depthkit operators that the fused forward and backward dispatch (the profiler records every
    dispatcher call) go into DISPATCHED."""
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().clone().requires_grad_() for t in inputs]
    gen = torch.Generator().manual_seed(seed)
    with torch.autograd.profiler.profile() as prof:
        got = fused(*a)
        cotangents = [torch.randn(g.shape, generator=gen, **F64) for g in got[:differentiated]]
        ga = torch.autograd.grad(got[:differentiated], a, cotangents, allow_unused=True)
    DISPATCHED.update(e.name[len("depthkit::"):] for e in prof.function_events if e.name.startswith("depthkit::"))
    want = composed(*b)
    expect_near(name, got, want)
    gb = torch.autograd.grad(want[:differentiated], b, cotangents, allow_unused=True)
    zeros = [torch.zeros_like(t) for t in inputs]
    expect_near(f"{name}: gradients", [g if g is not None else z for g, z in zip(ga, zeros)],
                [g if g is not None else z for g, z in zip(gb, zeros)])
    if not torch.autograd.gradcheck(lambda *t: fused(*t)[:differentiated], a, eps=1e-6, atol=1e-7, rtol=1e-6):
        sys.exit(f"FAIL gradcheck {name}")
    print(f"ok   {name}: gradcheck")


def randn(*shape, scale=1.0):
    return torch.randn(*shape, **F64) * scale


def check_depth_read(ops):
    M, N, P, d = 2, 3, 5, 7
    q, k, v = randn(M, d), randn(N, P, d), randn(N, P, d)
    # The sources are lists, one tensor per history entry.
    expect_same_gradients("depth_read", lambda q, *kv: ops.depth_read(q, kv[:N], kv[N:], EPS),
                          lambda q, *kv: depth_read(q, torch.stack(kv[:N]), torch.stack(kv[N:])),
                          [q, *k, *v], 2)
    expect_same_gradients("depth_read, values = keys", lambda q, *k: ops.depth_read(q, k, [], EPS),
                          lambda q, *k: depth_read(q, torch.stack(k), torch.stack(k)), [q, *k], 2)


def check_depth_merge(ops):
    N, P, d = 3, 5, 7
    q, k, v, kp, vp = randn(d), randn(N, P, d), randn(N, P, d), randn(P, d), randn(P, d)
    out, lse = ops.depth_read(q[None], list(k), list(v), EPS)
    # After the read, the merge equals one softmax over all N + 1 candidates.
    merged = ops.depth_merge(out[0], lse[0], q, kp, vp, EPS)
    expect_near("depth_merge after depth_read = one softmax",
                [merged], [depth_read(q[None], torch.cat([k, kp[None]]), torch.cat([v, vp[None]]))[0][0]])
    # On its own, with any (out, ζ): the online-softmax merge.
    expect_same_gradients("depth_merge", lambda o, l, q, kp, vp: (ops.depth_merge(o, l, q, kp, vp, EPS),),
                          lambda o, l, q, kp, vp: (merge(o, l, q, kp, vp),), [out[0], lse[0], q, kp, vp], 1)
    expect_same_gradients("depth_merge, value = key", lambda o, l, q, kp: (ops.depth_merge(o, l, q, kp, None, EPS),),
                          lambda o, l, q, kp: (merge(o, l, q, kp, kp),), [out[0], lse[0], q, kp], 1)


def check_dar_read(ops):
    N, P, d = 3, 5, 7
    q, h0, h1, p0, p1 = randn(2, d), randn(N, P, d), randn(N, P, d), randn(P, d), randn(P, d)
    gates = [randn(2, 2 * d, scale=0.7), randn(2), randn(2, 2 * d, scale=0.7), randn(2)]
    for key, value in [([1, 0], [0, 1]), ([0, 1], [0, 1]), ([0, 1], [1, 0]), ([0, 0], [1, 1])]:
        for part in [(None, None), (p0, p1)]:
            h, beta, _ = ops.dar_read(q, list(h0), list(h1), *part, *gates, key, value, EPS)
            expect_near(f"dar_read key {key} value {value} partial {part[0] is not None}", [h, beta],
                        dar_read(q, h0, h1, *part, *gates, key, value))
    # ζ, the third output, carries no gradient.
    expect_same_gradients(
        "dar_read", lambda q, *t: ops.dar_read(q, t[:N], t[N:2 * N], *t[2 * N:], [1, 0], [0, 1], EPS)[:2],
        lambda q, *t: dar_read(q, torch.stack(t[:N]), torch.stack(t[N:2 * N]), *t[2 * N:], [1, 0], [0, 1]),
        [q, *h0, *h1, p0, p1, *gates], 2)


def check_dar_write(ops):
    P, d = 5, 7
    f, beta, p0, p1 = randn(P, d), torch.rand(P, 2, **F64) * 2, randn(P, d), randn(P, d)
    w_rho, b_rho = randn(1, 2 * d), randn(1)
    expect_same_gradients("dar_write", lambda f, beta: ops.dar_write(f, beta, None, None, None, None, EPS),
                          lambda f, beta: dar_write(f, beta, None, None, None, None), [f, beta], 2)
    expect_same_gradients("dar_write, transport", lambda *t: ops.dar_write(*t, EPS), dar_write,
                          [f, beta, p0, p1, w_rho, b_rho], 2)


def check_msar_read(ops):
    m, N, B, T, d, K = 3, 2, 2, 4, 5, 3  # T − 1 ≥ K − 1: every tap reaches a token
    q, x, c = randn(m, d, scale=1.5), randn(N, B, T, d), randn(N, m - 1, d, K, scale=0.5)
    expect_same_gradients("msar_read", lambda q, *t: ops.msar_read(q, t[:N], t[N:], EPS),
                          lambda q, *t: msar_read(q, t[:N], t[N:]), [q, *x, *c], 2)
    # With kernel lengths the taps past them are padding: not read, no gradient (zero).
    lengths = [2, 3]
    expect_same_gradients("msar_read, kernel lengths", lambda q, *t: ops.msar_read(q, t[:N], t[N:], EPS, lengths),
                          lambda q, *t: msar_read(q, t[:N], t[N:], lengths), [q, *x, *c], 2)


def check_msar_block_read(ops):
    """A block's S = 3 reads of the same sources at once: each equals its own msar_read of the
    equations; outputs (out_0, out_1, out_2, ζ_0, ζ_1, ζ_2), all differentiated."""
    m, N, B, T, d, K, S = 3, 2, 2, 4, 5, 3, 3
    qs, x, c = [randn(m, d, scale=1.5) for _ in range(S)], randn(N, B, T, d), randn(N, m - 1, d, K, scale=0.5)
    lengths = [2, 3]

    def fused(*t):
        outs, lses = ops.msar_block_read(t[:S], t[S:S + N], t[S + N:], EPS, lengths)
        return (*outs, *lses)

    def composed(*t):
        reads = [msar_read(q, t[S:S + N], t[S + N:], lengths) for q in t[:S]]
        return (*(r[0] for r in reads), *(r[1] for r in reads))

    expect_same_gradients("msar_block_read, kernel lengths", fused, composed, [*qs, *x, *c], 2 * S)


def check_msar_fuse(ops):
    m, N, B, T, d, K = 3, 2, 2, 4, 5, 3
    q, x, c = randn(m, d, scale=1.5), randn(N, B, T, d), randn(N, m - 1, d, K, scale=0.5)
    part, pconv = randn(B, T, d), randn(m - 1, d, K, scale=0.5)
    w_pre, b_pre, alpha_pre = randn(m, m * d, scale=0.3), randn(m), randn(1) + 1.0
    out, lse = ops.msar_read(q, list(x), list(c), EPS)
    # After the read, the merge equals one read over the N + 1 sources (the partial the last).
    fused_mean = ops.msar_fuse(out, lse, q, part, pconv, None, None, None, EPS)
    one_read = msar_read(q, [*x, part], [*c, pconv])[0]
    expect_near("msar_fuse after msar_read = one softmax", [fused_mean], [one_read.mean(0)])
    # On its own, with any (out, ζ): with and without the partial, H_pre or the mean, kernel lengths.
    out, lse = randn(m, B, T, d), randn(m, B, T)
    expect_same_gradients(
        "msar_fuse, partial and H_pre", lambda *t: (ops.msar_fuse(*t, EPS),), lambda *t: (msar_fuse(*t),),
        [out, lse, q, part, pconv, w_pre, b_pre, alpha_pre], 1)
    expect_same_gradients(
        "msar_fuse, first branch, mean", lambda o: (ops.msar_fuse(o, lse, q, None, None, None, None, None, EPS),),
        lambda o: (msar_fuse(o, lse, q, None, None, None, None, None),), [out], 1)
    lengths = [1, 3]
    expect_same_gradients(
        "msar_fuse, kernel lengths", lambda *t: (ops.msar_fuse(*t, EPS, lengths),),
        lambda *t: (msar_fuse(*t, lengths),), [out, lse, q, part, pconv, w_pre, b_pre, alpha_pre], 1)


def check_mhc_pre(ops):
    B, T, m, d = 2, 3, 3, 4
    n = m * m + 2 * m
    x, phi, bias = randn(B, T, m, d, scale=1.3), randn(n, m * d, scale=0.3), randn(n, scale=0.5)
    scale = torch.tensor([1.7, -2.3, 3.1], **F64)
    # The projection, the fourth output, is kept for the backward and carries no gradient.
    expect_same_gradients("mhc_pre", lambda *t: ops.mhc_pre(*t, EPS), mhc_pre, [x, phi, bias, scale], 3)


def check_mhc_sinkhorn(ops):
    logits = randn(2, 3, 4, 4, scale=2.5)
    for iters in [1, 20]:
        expect_same_gradients(f"mhc_sinkhorn, {iters} rounds", lambda l: (ops.mhc_sinkhorn(l, iters),),
                              lambda l: (sinkhorn(l, iters),), [logits], 1)


def check_mhc_merge(ops):
    B, T, m, d = 2, 3, 4, 5
    expect_same_gradients("mhc_merge", lambda *t: (ops.mhc_merge(*t),), lambda *t: (mhc_merge(*t),),
                          [randn(B, T, m, d), randn(B, T, d), randn(B, T, m) + 1, randn(B, T, m, m)], 1)


def check_rms_norm(ops):
    x, w = randn(2, 3, 7, scale=2.0), torch.rand(7, **F64) + 0.5
    # r, the second output, is kept for the backward and carries no gradient.
    expect_same_gradients("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-5), lambda x, w: rms_norm(x, w, 1e-5),
                          [x, w], 1)


def check_rope_qkv(ops):
    B, T, H, KV, hd, offset = 2, 3, 4, 2, 6, 2  # grouped-query heads; an offset, as decoding takes
    cos, sin = rope_tables(hd, T + offset + 1)
    expect_same_gradients("rope_qkv", lambda qkv: ops.rope_qkv(qkv, cos, sin, H, KV, offset),
                          lambda qkv: rope_qkv(qkv, cos, sin, H, KV, offset), [randn(B, T, (H + 2 * KV) * hd)], 3)


def check_swiglu(ops):
    # Gates spread over ±12, where the sigmoid saturates on both sides.
    expect_same_gradients("swiglu", lambda gu: (ops.swiglu(gu),), lambda gu: (swiglu(gu),),
                          [randn(2, 3, 8, scale=4.0)], 1)


def check_linear_cross_entropy(ops):
    N, V, d = 6, 9, 4
    targets = torch.randint(V, (N,))
    expect_same_gradients("linear_cross_entropy", lambda h, w: (ops.linear_cross_entropy(h, w, targets),),
                          lambda h, w: (linear_cross_entropy(h, w, targets),), [randn(N, d), randn(V, d, scale=0.5)],
                          1)



def check_shared_source(ops):
    P, d = 5, 7
    x = randn(P, d)
    y = ops.shared_source(x)  # a copy: equal, and a tensor of its own
    expect_near("shared_source is a copy", [y], [x], 0.0)
    if y.data_ptr() == x.data_ptr():
        sys.exit("FAIL shared_source: returns its input's storage")
    # An entry that three reads take (as keys, as keys and values, and twice in one read) and a plain
    # operation too: its gradient, accumulated in one buffer by the reads' backward operators and
    # added to the plain one's, equals autograd's sum of each consumer's.
    def consumers(wrap):
        def f(q, x, k):
            e = wrap(x)
            a, _ = ops.depth_read(q, [e, k], [], EPS)
            b, _ = ops.depth_read(q[:1], [k, e], [e, k], EPS)
            c, _ = ops.depth_read(q[1:], [e, e], [], EPS)
            return (a.sum(0) + b[0] + c[0] + e.sin(),)
        return f
    expect_same_gradients("shared_source", consumers(ops.shared_source), consumers(lambda t: t),
                          [randn(2, d), x, randn(P, d)], 1)

def registered_operators():
    """The operators in the depthkit namespace, from the dispatcher's schemas."""
    names = {s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("depthkit::")}
    return sorted(n[len("depthkit::"):] for n in names)


def main():
    torch.ops.load_library(sys.argv[1])
    ops = torch.ops.depthkit
    torch.manual_seed(0)
    operators = registered_operators()
    forward = [op for op in operators if not op.endswith("_backward")]
    if not forward:
        sys.exit("FAIL: no depthkit operator is registered")
    checks = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}
    missing = [op for op in forward if op not in checks]
    if missing:
        sys.exit(f"FAIL: no check_<op> in tests/test_python_ops.py for {', '.join(missing)}")
    stale = [op for op in checks if op not in forward]
    if stale:
        sys.exit(f"FAIL: check_<op> for operators that are not registered: {', '.join(stale)}")
    for op in forward:
        DISPATCHED.clear()
        checks[op](ops)
        # A backward operator is covered by its forward's check, whose gradient comparison must run it.
        for needed in [op, f"{op}_backward"]:
            if needed in operators and needed not in DISPATCHED:
                sys.exit(f"FAIL check_{op}: its gradient comparisons never ran depthkit::{needed}")

    # float32 in, float32 out; bad shapes are one clear error.
    q, k = torch.randn(2, 7), torch.randn(3, 5, 7)
    out32, _ = ops.depth_read(q, list(k), [], EPS)
    assert out32.dtype == torch.float32
    try:
        ops.depth_read(q, list(k), list(k[:, :, :3]), EPS)
        sys.exit("FAIL: mismatched values accepted")
    except RuntimeError as e:
        assert "depth_read" in str(e), e
    print("ok   dtypes and errors")
    print(f"ok   all {len(forward)} operators: {', '.join(forward)}")


if __name__ == "__main__":
    main()
