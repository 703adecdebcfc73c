"""The fused operators from Python: load libdepthkit_ops.so with torch.ops.load_library, compare
each operator with a PyTorch composition written here from the papers' equations, and run
torch.autograd.gradcheck (float64) through the hand-written backward passes.

usage: python test_python_ops.py path/to/libdepthkit_ops.so
"""
import sys

import torch

EPS = 1e-6


def norm(x):
    """Weightless RMSNorm over the last dimension (Norm_h, DAR eq. 2)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def depth_read(q, keys, values):
    """Per target m: softmax over sources r of q_m · Norm(K_r), applied to V_r (DAR eq. 3–5)."""
    logits = torch.einsum("md,npd->mnp", q, norm(keys))
    weights = torch.softmax(logits, dim=1)
    return torch.einsum("mnp,npd->mpd", weights, values), torch.logsumexp(logits, dim=1)


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


def check(name, got, want, tol):
    for g, w in zip(got, want):
        err = (g - w).abs().max().item()
        if err > tol * max(1.0, w.abs().max().item()):
            sys.exit(f"FAIL {name}: max |diff| {err}")
    print(f"ok   {name}")


def main():
    torch.ops.load_library(sys.argv[1])
    ops = torch.ops.depthkit
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)
    M, N, P, d = 2, 3, 5, 7

    q, k, v = torch.randn(M, d, **f64), torch.randn(N, P, d, **f64), torch.randn(N, P, d, **f64)
    # The sources are lists, one tensor per history entry.
    check("depth_read", ops.depth_read(q, list(k), list(v), EPS), depth_read(q, k, v), 1e-10)
    check("depth_read, values = keys", ops.depth_read(q, list(k), [], EPS), depth_read(q, k, k), 1e-10)
    out, lse = ops.depth_read(q[:1], list(k), list(v), EPS)
    kp, vp = torch.randn(P, d, **f64), torch.randn(P, d, **f64)
    merged = ops.depth_merge(out[0], lse[0], q[0], kp, vp, EPS)
    check("depth_merge", [merged], [depth_read(q[:1], torch.cat([k, kp[None]]), torch.cat([v, vp[None]]))[0][0]], 1e-10)

    gates = [torch.randn(2, 2 * d, **f64) * 0.7, torch.randn(2, **f64), torch.randn(2, 2 * d, **f64) * 0.7,
             torch.randn(2, **f64)]
    h0, h1, p0, p1 = torch.randn(N, P, d, **f64), torch.randn(N, P, d, **f64), kp, vp
    for key, value in [([1, 0], [0, 1]), ([0, 1], [0, 1]), ([0, 1], [1, 0]), ([0, 0], [1, 1])]:
        for part in [(None, None), (p0, p1)]:
            h, beta, _ = ops.dar_read(q, list(h0), list(h1), *part, *gates, key, value, EPS)
            check(f"dar_read key {key} value {value} partial {part[0] is not None}", [h, beta],
                  dar_read(q, h0, h1, *part, *gates, key, value), 1e-10)
    f, beta = torch.randn(P, d, **f64), torch.rand(P, 2, **f64) * 2
    w_rho, b_rho = torch.randn(1, 2 * d, **f64), torch.randn(1, **f64)
    check("dar_write", ops.dar_write(f, beta, None, None, None, None, EPS), dar_write(f, beta, None, None, None, None),
          1e-10)
    check("dar_write, transport", ops.dar_write(f, beta, p0, p1, w_rho, b_rho, EPS),
          dar_write(f, beta, p0, p1, w_rho, b_rho), 1e-10)

    def leaves(*ts):
        return [t.clone().requires_grad_() for t in ts]

    gradchecks = {
        "depth_read": (lambda q, *kv: ops.depth_read(q, kv[:N], kv[N:], EPS), leaves(q, *k, *v)),
        "depth_read, values = keys": (lambda q, *k: ops.depth_read(q, k, [], EPS), leaves(q, *k)),
        "depth_merge": (lambda o, l, q, kp, vp: ops.depth_merge(o, l, q, kp, vp, EPS),
                        leaves(out[0], lse[0], q[0], kp, vp)),
        "dar_read": (lambda q, *t: ops.dar_read(q, t[:N], t[N:2 * N], *t[2 * N:], [1, 0], [0, 1], EPS)[:2],
                     leaves(q, *h0, *h1, p0, p1, *gates)),
        "dar_write": (lambda *t: ops.dar_write(*t, EPS), leaves(f, beta, p0, p1, w_rho, b_rho)),
    }
    for name, (fn, inputs) in gradchecks.items():
        if not torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-6):
            sys.exit(f"FAIL gradcheck {name}")
        print(f"ok   gradcheck {name}")

    # float32 in, float32 out; bad shapes are one clear error.
    out32, _ = ops.depth_read(q.float(), list(k.float()), [], EPS)
    assert out32.dtype == torch.float32
    try:
        ops.depth_read(q, list(k), list(v[:, :, :3]), EPS)
        sys.exit("FAIL: mismatched values accepted")
    except RuntimeError as e:
        assert "depth_read" in str(e), e
    print("ok   dtypes and errors")


if __name__ == "__main__":
    main()
