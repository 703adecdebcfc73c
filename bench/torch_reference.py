#!/usr/bin/env python3
"""The depthkit model, with every residual pathway, written independently in plain PyTorch.

For `bench/compare-eager`: the same dense backbone as src/depthkit/model (Pre-Norm, GQA with
RoPE rotate-half, SwiGLU, RMSNorm with weight, untied head, no biases) and each pathway written
from its paper's equations, vectorised over sources, streams and tokens as a PyTorch user would
write it (so that torch.compile can fuse it). Parameter names, shapes, initialisation and
conventions (key normalisation, block schedule, gates, MSAR banks, mHC Sinkhorn) are depthkit's
(docs/design.md), so that a depthkit checkpoint loads by name.

Two modes:
  --check      for each kind, a depthkit checkpoint (`depthkit init`, every parameter then
               perturbed here so that zero-initialised queries, convolutions and gates are
               exercised) is loaded by name, and the logits of `depthkit forward` on the same
               tokens are compared with this model's (float32); exits 1 when a kind disagrees.
  (default)    times --steps training steps of one kind (forward, cross-entropy, backward,
               clip, AdamW with the config's hyperparameters) in --mode eager or compile
               (torch.compile of forward + loss; the warm-up steps absorb compilation) and
               prints one JSON line.

Equation numbers: DAR = dual-attention-residuals, MSAR = multi-stream-attention-residuals
(/work/shared/papers/; AttnRes as restated in DAR §2 and MSAR §3.1, mHC as in MSAR §2.2).
"""
import argparse
import json
import math
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tomllib

import torch
import torch.nn.functional as F

KEY_NORM_EPS = 1e-6  # depthkit's kKeyNormEps: Norm(·), the weightless RMSNorm of keys and gate inputs
RHO_BIAS, GATE_LOGIT_STD = 4.0, 0.2  # DAR initialisation (docs/design.md, "DAR")
MSAR_PRE_SCALE, MHC_GATE_SCALE = 0.01, 0.01
KINDS = ["residual", "attnres", "dar", "msar", "mhc", "attnres_sepv", "attnres_mhc"]


def inv_rms(x):
    """1 / rms(x) over the last axis: Norm(x) = x · inv_rms(x)."""
    return torch.rsqrt(x.square().mean(-1) + KEY_NORM_EPS)


def norm(x):
    """Norm(x), weightless RMSNorm (the key normalisation of AttnRes; DAR eq. 13, 16; MSAR eq. 13)."""
    return F.rms_norm(x, (x.shape[-1],), eps=KEY_NORM_EPS)


class Stack:
    """Completed sources stacked on axis `dim` ([N, ..., d] values), with each one's 1/rms (its key's
    normalisation, computed once when it is appended). Grows by one entry per completed block."""

    def __init__(self, x, dim=0):
        self.dim = dim
        self.v, self.r = x.unsqueeze(dim), inv_rms(x).unsqueeze(dim)

    def append(self, x):
        self.v = torch.cat([self.v, x.unsqueeze(self.dim)], self.dim)
        self.r = torch.cat([self.r, inv_rms(x).unsqueeze(self.dim)], self.dim)


def depth_read(q, keys, values, key_part=None, value_part=None):
    """Depth attention over the completed sources (and the block's partial, one more candidate):
    a_r = qᵀ Norm(k_r), w = softmax_r(a) over the candidates, h = Σ_r w_r v_r (DAR eq. 2–5).
    keys: Stack over [N, B, T, d]; values: [N, B, T, d] (values = keys.v for AttnRes); q: [d]."""
    logits = (keys.v @ q) * keys.r  # [N, B, T]
    if key_part is None:
        w = torch.softmax(logits, 0)
        return (w.unsqueeze(-1) * values).sum(0)
    a_part = (key_part @ q) * inv_rms(key_part)
    w = torch.softmax(torch.cat([logits, a_part.unsqueeze(0)]), 0)
    return (w[:-1].unsqueeze(-1) * values).sum(0) + w[-1].unsqueeze(-1) * value_part


class Schedule:
    """Branches ℓ = 1 … L_b in blocks of S (DAR eq. 8–9, MSAR eq. 15–16); the last may be shorter."""

    def __init__(self, S, L, shared=False):
        self.S, self.L, self.shared = S, L, shared

    def opens(self, l):
        return (l - 1) % self.S == 0

    def closes(self, l):
        return l % self.S == 0 or l == self.L

    def blocks(self):
        return (self.L + self.S - 1) // self.S

    def owner(self, l):  # residual.share_within_block: the first branch of ℓ's block and type
        if not self.shared:
            return l
        first = (l - 1) // self.S * self.S + 1
        return first if (first - l) % 2 == 0 else first + 1


class Params:
    """Registers parameters on a module under depthkit's dotted names (a submodule per name part), so
    that named_parameters() are the names of depthkit's model.safetensors; initialised as depthkit."""

    def __init__(self, root, prefix=""):
        self.root, self.prefix = root, prefix

    def __call__(self, name, shape, init, std=0.0):
        t = torch.empty(shape)
        if init == "normal":
            t.normal_(0.0, std)
        elif init == "identity":
            t.zero_().diagonal().fill_(1.0)
        else:
            t.fill_({"zeros": 0.0, "ones": 1.0}.get(init, init))  # a number: constant
        *path, leaf = (self.prefix + name).split(".")
        mod = self.root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        p = torch.nn.Parameter(t)
        mod.register_parameter(leaf, p)
        return p


# ---- Pathways: begin(e) → state; read(state, ℓ) → h_ℓ; write(state, ℓ, f_ℓ); finish(state) --------


class Residual:
    def __init__(self, r, m, P):
        pass

    def begin(self, e):
        return {"h": e}

    def read(self, s, l):
        return s["h"]

    def write(self, s, l, f):
        s["h"] = s["h"] + f  # h_{ℓ+1} = h_ℓ + f_ℓ(h_ℓ)

    def finish(self, s):
        return s["h"]


class AttnRes:
    """Attention Residuals, Full (S = 1) or Block (DAR eq. 2–5, 8–9; MSAR §3.1); attnres_sepv: source
    r's value W_{v,r} v_r (DAR eq. 21), keys unchanged. Sources: the embedding, then each completed
    block's sum of outputs; the current block's partial sum is one more candidate."""

    def __init__(self, r, m, P, sepv=False):
        d = m["d_model"]
        self.sched = Schedule(r["block_sublayers"], 2 * m["n_layers"], r["share_within_block"])
        self.q = [None, None]
        for l in range(2, self.sched.L + 1):  # branch 1 has one candidate: no query of its own
            o = self.sched.owner(l)
            if o < l and self.q[o] is None:  # shared with a block's first branch: it gets one (query.1)
                self.q[o] = P(f"query.{o}", (d,), "zeros")
            self.q.append(self.q[o] if o < l else P(f"query.{l}", (d,), "zeros"))
        self.out_q = P("out_query", (d,), "zeros")
        n_src = 1 + self.sched.blocks()
        self.wv = [P(f"value_map.{i}", (d, d), "identity") for i in range(n_src)] if sepv else None

    def value(self, i, x):  # eq. 4 (the source itself) or eq. 21 (W_{v,i} x)
        return x if self.wv is None else F.linear(x, self.wv[i])

    def begin(self, e):
        return {"keys": Stack(e), "values": [self.value(0, e)], "vstack": None, "partial": None}

    def values(self, s):
        if self.wv is None:
            return s["keys"].v
        if s["vstack"] is None:
            s["vstack"] = torch.stack(s["values"])
        return s["vstack"]

    def read(self, s, l):
        keys, partial = s["keys"], s["partial"]
        if partial is None and keys.v.shape[0] == 1:  # branch 1: the embedding, weight 1
            return s["values"][0]
        if partial is None:  # first branch of a block: the completed sources only (eq. 9, i = 1)
            return depth_read(self.q[l], keys, self.values(s))
        return depth_read(self.q[l], keys, self.values(s), partial, self.value(keys.v.shape[0], partial))

    def write(self, s, l, f):
        s["partial"] = f if self.sched.opens(l) else s["partial"] + f
        if self.sched.closes(l):  # the block's sum becomes a completed source
            s["values"].append(self.value(s["keys"].v.shape[0], s["partial"]))
            s["keys"].append(s["partial"])
            s["vstack"], s["partial"] = None, None

    def finish(self, s):  # the output query reads the completed sources
        return depth_read(self.out_q, s["keys"], self.values(s))


class Dar:
    """Dual Attention Residuals (DAR eq. 6–18; routing eq. 22). Two streams H⁰, H¹ per history entry;
    stream j reads with its own query, keys from stream k_j (normalised), values from stream v_j."""

    ROUTES = {"cross": ((1, 0), (0, 1)), "self": ((0, 0), (1, 1)), "cross_value": ((0, 1), (1, 0)),
              "fixed": ((0, 1), (0, 1))}  # (key stream, value stream) of j = 0, 1

    def __init__(self, r, m, P):
        d = m["d_model"]
        self.sched = Schedule(r["block_sublayers"], 2 * m["n_layers"], r["share_within_block"])
        self.route = self.ROUTES[r["routing"]]
        gate_std = GATE_LOGIT_STD / math.sqrt(2 * d)
        self.b = [None]
        for l in range(1, self.sched.L + 1):
            o = self.sched.owner(l)
            if o == l:
                b = {"q": [P(f"{l}.q0", (d,), "zeros"), P(f"{l}.q1", (d,), "zeros")],
                     "w_alpha": P(f"{l}.alpha.weight", (2, 2 * d), "normal", gate_std),
                     "b_alpha": P(f"{l}.alpha.bias", (2,), "zeros"),
                     "w_beta": P(f"{l}.beta.weight", (2, 2 * d), "normal", gate_std),
                     "b_beta": P(f"{l}.beta.bias", (2,), "zeros")}
            else:
                b = self.b[o]
            if not self.sched.opens(l) and "w_rho" not in b:  # transport gate: where a partial exists
                b["w_rho"] = P(f"{o}.rho.weight", (1, 2 * d), "zeros")
                b["b_rho"] = P(f"{o}.rho.bias", (1,), RHO_BIAS)
            self.b.append(b)
        self.out_q = [P("out.q0", (d,), "zeros"), P("out.q1", (d,), "zeros")]

    def begin(self, e):
        return {"H": [Stack(e), Stack(e)], "P": None, "beta": None}  # H_0 = [e, e] (eq. 6)

    def read(self, s, l):
        b, H, P = self.b[l], s["H"], s["P"]
        z = []
        for j, (k, v) in enumerate(self.route):  # eq. 10–12, the partial as one more candidate (eq. 9)
            z.append(depth_read(b["q"][j], H[k], H[v].v, *((P[k], P[v]) if P else ())))
        hbar = norm(torch.cat(z, -1))                                   # eq. 13
        alpha = torch.sigmoid(F.linear(hbar, b["w_alpha"], b["b_alpha"]))  # eq. 14
        s["beta"] = 2 * torch.sigmoid(F.linear(hbar, b["w_beta"], b["b_beta"]))
        return alpha[..., :1] * z[0] + alpha[..., 1:] * z[1]            # eq. 15

    def write(self, s, l, f):
        b, beta, P = self.b[l], s["beta"], s["P"]
        w0, w1 = beta[..., :1] * f, beta[..., 1:] * f                   # β ⊗ f(h_ℓ)
        if self.sched.opens(l):
            s["P"] = [w0, w1]                                           # eq. 17, i = 1
        else:
            rho = torch.sigmoid(F.linear(norm(torch.cat(P, -1)), b["w_rho"], b["b_rho"]))  # eq. 16
            s["P"] = [rho * P[0] + (1 - rho) * P[1] + w0, (1 - rho) * P[0] + rho * P[1] + w1]  # eq. 17
        if self.sched.closes(l):                                        # H_b = P^S (eq. 18)
            s["H"][0].append(s["P"][0])
            s["H"][1].append(s["P"][1])
            s["P"] = None

    def finish(self, s):  # h_out = h⁰_out + h¹_out over the completed history
        H = s["H"]
        return sum(depth_read(self.out_q[j], H[k], H[v].v) for j, (k, v) in enumerate(self.route))


class Msar:
    """Multi-Stream Attention Residuals (MSAR eq. 9–17, Appendix C). Each source is expanded into m
    streams by causal depthwise convolutions (eq. 10), once, when it is completed; stream r reads its
    expanded sources with its own query (eq. 11–12, 17), the block's partial (expanded by bank ℓ−1)
    as one more candidate; the m reads are fused by H_pre (eq. 13–14) or their mean. Bank 0 expands
    the embedding, a completed block uses the bank of its last branch. Output: h_L + f_L(h_L) (§3.2)."""

    def __init__(self, r, m, P):
        d, self.m = m["d_model"], r["streams"]
        self.sched = Schedule(r["block_sublayers"], 2 * m["n_layers"])
        self.conv, self.mean = r["conv"], r["fusion"] == "mean"
        self.K = max(r["kernels"]) if self.conv else 1
        self.b = [None]
        for l in range(1, self.sched.L + 1):
            b = {"q": P(f"{l}.queries", (self.m, d), "zeros")}
            if not self.mean:
                b["w_pre"] = P(f"{l}.pre.weight", (self.m, self.m * d), "normal", m.get("init_std", 0.02))
                b["b_pre"] = P(f"{l}.pre.bias", (self.m,), "zeros")
                b["alpha_pre"] = P(f"{l}.pre.scale", (1,), MSAR_PRE_SCALE)
            self.b.append(b)
        self.bank = [[P(f"bank.{k}.conv{i}", (d, r["kernels"][i - 1]), "zeros") for i in range(1, self.m)]
                     for k in range(self.sched.L)] if self.conv else None

    def expand(self, x, k):
        """[m, B, T, d]: v⁽⁰⁾ = v, v⁽ʳ⁾_t = Σ_{δ<κ_r} c_{r,δ} ⊙ v_{t−δ} (eq. 10) with bank k, as one
        depthwise conv1d (groups = d, m − 1 output channels per input), taps zero-padded to K."""
        if self.m == 1:
            return x.unsqueeze(0)
        B, T, d = x.shape
        if not self.conv:  # ablation: m replicas of the source
            return x.unsqueeze(0).expand(self.m, B, T, d)
        taps = torch.stack([F.pad(c, (0, self.K - c.shape[1])) for c in self.bank[k]])  # [m−1, d, K]
        weight = taps.transpose(0, 1).reshape(-1, 1, self.K).flip(-1)  # channel g·(m−1) + r; conv1d correlates
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.K - 1, 0)), weight, groups=d)  # [B, (m−1)d, T]
        y = y.view(B, d, self.m - 1, T).permute(2, 0, 3, 1)
        return torch.cat([x.unsqueeze(0), y])

    def begin(self, e):
        return {"src": Stack(self.expand(e, 0), dim=1), "partial": None, "h": None, "f": None}

    def read(self, s, l):
        b, src = self.b[l], s["src"]
        logits = torch.einsum("mnbtd,md->mnbt", src.v, b["q"]) * src.r  # per-stream scores (eq. 11)
        if self.sched.opens(l):
            w = torch.softmax(logits, 1)                                # eq. 12
            Z = (w.unsqueeze(-1) * src.v).sum(1)
        else:                                                           # the partial, eq. 17
            part = self.expand(s["partial"], l - 1)
            a_part = torch.einsum("mbtd,md->mbt", part, b["q"]) * inv_rms(part)
            w = torch.softmax(torch.cat([logits, a_part.unsqueeze(1)], 1), 1)
            Z = (w[:, :-1].unsqueeze(-1) * src.v).sum(1) + w[:, -1].unsqueeze(-1) * part
        Z = Z.permute(1, 2, 0, 3)                                       # [B, T, m, d]
        if self.mean:
            h = Z.mean(-2)
        else:                                                           # eq. 13–14
            pre = torch.sigmoid(b["alpha_pre"] * F.linear(norm(Z.flatten(-2)), b["w_pre"]) + b["b_pre"])
            h = (pre.unsqueeze(-1) * Z).sum(-2)
        s["h"] = h
        return h

    def write(self, s, l, f):
        s["f"] = f
        s["partial"] = f if self.sched.opens(l) else s["partial"] + f  # eq. 16
        if self.sched.closes(l):                                        # eq. 15: a completed source
            if l < self.sched.L:                                        # (the last one is never read)
                s["src"].append(self.expand(s["partial"], l))
            s["partial"] = None

    def finish(self, s):
        return s["h"] + s["f"]


class Mhc:
    """Manifold-constrained Hyper-Connections (MSAR eq. 3–5; docs/design.md, "mHC"): m streams X, and
    per branch, from x = [x_1; …; x_m]: logits = α ⊙ (Norm(x) φᵀ) + b, H_pre = σ(·), H_post = 2σ(·),
    H_res = Sinkhorn–Knopp(exp(·)) (rows then columns, `sinkhorn_iters` times)."""

    def __init__(self, r, m, P):
        d, self.m, self.iters = m["d_model"], r["streams"], r["sinkhorn_iters"]
        n = self.m * self.m + 2 * self.m
        self.b = [None] + [{"phi": P(f"{l}.phi", (n, self.m * d), "normal", m.get("init_std", 0.02)),
                            "bias": P(f"{l}.bias", (n,), "zeros"),
                            "scale": P(f"{l}.scale", (3,), MHC_GATE_SCALE)}
                           for l in range(1, 2 * m["n_layers"] + 1)]

    def begin(self, e):
        return {"X": e.unsqueeze(2).expand(-1, -1, self.m, -1), "post": None, "res": None}  # [B, T, m, d]

    def read(self, s, l):
        b, X, m = self.b[l], s["X"], self.m
        sc = b["scale"]  # α_pre, α_post, α_res over their m, m and m² logits
        alpha = torch.cat([sc[0:1].expand(m), sc[1:2].expand(m), sc[2:3].expand(m * m)])
        logits = alpha * F.linear(norm(X.flatten(-2)), b["phi"]) + b["bias"]
        pre = torch.sigmoid(logits[..., :m])
        s["post"] = 2 * torch.sigmoid(logits[..., m:2 * m])
        res = logits[..., 2 * m:].unflatten(-1, (m, m))                 # rows: source i, columns: target j
        res = torch.exp(res - res.amax((-2, -1), keepdim=True).detach())
        for _ in range(self.iters):                                     # Sinkhorn–Knopp
            res = res / res.sum(-1, keepdim=True)
            res = res / res.sum(-2, keepdim=True)
        s["res"] = res
        return (pre.unsqueeze(-1) * X).sum(-2)                           # eq. 4: Σ_i H_pre[i] x_i

    def write(self, s, l, f):  # eq. 5: x'_j = H_post[j] f + Σ_i H_res[i, j] x_i
        s["X"] = s["post"].unsqueeze(-1) * f.unsqueeze(-2) + s["res"].transpose(-1, -2) @ s["X"]

    def finish(self, s):
        return s["X"].sum(2)


class AttnResMhc:
    """attnres_mhc: AttnRes and mHC side by side; each branch reads the sum of their reads."""

    def __init__(self, r, m, P):
        self.a = AttnRes(r, m, Params(P.root, "residual.attnres."))
        self.h = Mhc(r, m, Params(P.root, "residual.mhc."))

    def begin(self, e):
        return (self.a.begin(e), self.h.begin(e))

    def read(self, s, l):
        return self.a.read(s[0], l) + self.h.read(s[1], l)

    def write(self, s, l, f):
        self.a.write(s[0], l, f)
        self.h.write(s[1], l, f)

    def finish(self, s):
        return self.a.finish(s[0]) + self.h.finish(s[1])


PATHWAYS = {"residual": Residual, "attnres": AttnRes, "dar": Dar, "msar": Msar, "mhc": Mhc,
            "attnres_sepv": lambda r, m, P: AttnRes(r, m, P, sepv=True), "attnres_mhc": AttnResMhc}

RESIDUAL_DEFAULTS = {"kind": "residual", "block_sublayers": 2, "share_within_block": False, "routing": "cross",
                     "streams": 4, "kernels": [4, 8, 12], "conv": True, "fusion": "hpre", "sinkhorn_iters": 20}


class Model(torch.nn.Module):
    """The backbone (src/depthkit/model): branches ℓ = 1 … 2L alternate attention and SwiGLU, each
    reading its input from the pathway and writing its output back (docs/design.md, "The seam")."""

    def __init__(self, m, r, nn=False):
        super().__init__()
        d, V, L = m["d_model"], m["vocab_size"], m["n_layers"]
        self.H, self.KV = m["n_heads"], m.get("n_kv_heads", m["n_heads"])
        self.hd = m.get("head_dim", 0) or d // self.H
        self.eps = m.get("norm_eps", 1e-5)
        std = m.get("init_std", 0.02)
        out_std = std / math.sqrt(2 * L)  # output projections: 1/sqrt(2·n_layers) smaller
        P = Params(self)
        self.embedding = P("embedding", (V, d), "normal", std)
        self.attn, self.ffn = [], []
        for i in range(L):
            a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
            self.attn.append({"norm": P(a + "norm", (d,), "ones"), "wq": P(a + "wq", (self.H * self.hd, d), "normal", std),
                              "wk": P(a + "wk", (self.KV * self.hd, d), "normal", std),
                              "wv": P(a + "wv", (self.KV * self.hd, d), "normal", std),
                              "wo": P(a + "wo", (d, self.H * self.hd), "normal", out_std)})
            self.ffn.append({"norm": P(f + "norm", (d,), "ones"), "w_gate": P(f + "w_gate", (m["d_ff"], d), "normal", std),
                             "w_up": P(f + "w_up", (m["d_ff"], d), "normal", std),
                             "w_down": P(f + "w_down", (d, m["d_ff"]), "normal", out_std)})
        if nn:  # the pathway from depthkit.nn (fused operators), under the same parameter names
            import depthkit.nn

            options = {k: v for k, v in r.items() if k not in ("kind", "impl")}
            self.add_module("residual", depthkit.nn.make(r["kind"], d, 2 * L, **options))
            self.path = None
        else:
            self.path = PATHWAYS[r["kind"]](r, m, Params(self, "residual."))
        self.final_norm = P("final_norm", (d,), "ones")
        self.lm_head = self.embedding if m.get("tie_embeddings", False) else P("lm_head", (V, d), "normal", std)
        theta = m.get("rope_theta", 10000.0)
        inv = torch.exp(torch.arange(self.hd // 2, dtype=torch.float64) * (-2 * math.log(theta) / self.hd))
        ang = torch.outer(torch.arange(m["seq_len"], dtype=torch.float64), inv)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def rope(self, x):  # rotate-half
        T, half = x.shape[2], x.shape[3] // 2
        c, s = self.cos[:T], self.sin[:T]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def attention(self, p, h):
        B, T, _ = h.shape
        x = F.rms_norm(h, (h.shape[-1],), p["norm"], self.eps)
        q = F.linear(x, p["wq"]).view(B, T, self.H, self.hd).transpose(1, 2)
        k = F.linear(x, p["wk"]).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = F.linear(x, p["wv"]).view(B, T, self.KV, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=self.KV != self.H)
        return F.linear(o.transpose(1, 2).reshape(B, T, -1), p["wo"])

    def feed_forward(self, p, h):
        x = F.rms_norm(h, (h.shape[-1],), p["norm"], self.eps)
        return F.linear(F.silu(F.linear(x, p["w_gate"])) * F.linear(x, p["w_up"]), p["w_down"])

    def forward(self, tokens):
        if self.path is None:  # depthkit.nn owns the depth loop over the same branches
            branches = []
            for i in range(len(self.attn)):
                branches += [lambda h, i=i: self.attention(self.attn[i], h),
                             lambda h, i=i: self.feed_forward(self.ffn[i], h)]
            h = self.residual(F.embedding(tokens, self.embedding), branches)
            h = F.rms_norm(h, (self.final_norm.shape[0],), self.final_norm, self.eps)
            return F.linear(h, self.lm_head)
        s = self.path.begin(F.embedding(tokens, self.embedding))
        for l in range(1, 2 * len(self.attn) + 1):
            h = self.path.read(s, l)
            i = (l - 1) // 2
            self.path.write(s, l, self.attention(self.attn[i], h) if l % 2 else self.feed_forward(self.ffn[i], h))
        h = F.rms_norm(self.path.finish(s), (self.final_norm.shape[0],), self.final_norm, self.eps)
        return F.linear(h, self.lm_head)


def lm_loss(model, batch):
    T = batch.shape[1] - 1
    logits = model(batch[:, :T])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def load_config(path, kind=None):
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    r = dict(RESIDUAL_DEFAULTS, **cfg.get("residual", {}))
    if kind:
        r["kind"] = kind
    return cfg, r


# ---- safetensors (by hand: 8-byte little-endian header length, JSON header, raw data) ------------

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "I64": torch.int64}
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=dtypes[e["dtype"]]).view(e["shape"]).clone()
    return out, meta


def write_safetensors(path, tensors, meta):
    header, blobs, off = {"__metadata__": meta} if meta else {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().float().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- --check: logits equal to depthkit's on a shared checkpoint ---------------------------------

def perturb(name, t, gen):
    """Moves every parameter off its initial value (zero queries, convolutions and gates read and
    mix uniformly, which would hide a wrong index): vectors by N(0, 0.5²), matrices by half their
    spread (at least 0.3/√fan_in); the gate scales α (mHC, MSAR's α_pre) by N(0, 4²), so that H_res
    is far from uniform and Sinkhorn's iteration count shows in the logits."""
    if name.endswith(".scale"):
        s = 4.0
    elif t.dim() == 1:
        s = 0.5
    else:
        s = 0.5 * max(t.std().item(), 0.3 / math.sqrt(t.shape[-1]))
    return t + s * torch.randn(t.shape, generator=gen, dtype=t.dtype)


def check(args):
    depthkit = os.environ.get("DEPTHKIT", "build/depthkit")
    failed = []
    with tempfile.TemporaryDirectory(prefix="depthkit-torchref-") as tmp:
        for kind in args.kinds.split(","):
            gen = torch.Generator().manual_seed(1234 + KINDS.index(kind))  # the same draws whatever --kinds
            cfg, r = load_config(args.config, kind)
            m = cfg["model"]
            ck = os.path.join(tmp, kind)
            subprocess.run([depthkit, "init", "--config", args.config, "--set", f"residual.kind={kind}", "--out", ck],
                           check=True, stdout=subprocess.DEVNULL)
            tensors, meta = read_safetensors(os.path.join(ck, "model.safetensors"))
            tensors = {n: perturb(n, t, gen) for n, t in tensors.items()}
            write_safetensors(os.path.join(ck, "model.safetensors"), tensors, meta)
            model = Model(m, r)
            ours = dict(model.named_parameters())
            if set(ours) != set(tensors) or any(ours[n].shape != tensors[n].shape for n in ours):
                missing, extra = sorted(set(tensors) - set(ours)), sorted(set(ours) - set(tensors))
                sys.exit(f"{kind}: parameter sets differ: only in depthkit {missing[:8]}, only here {extra[:8]}"
                         f" (or shapes differ)")
            with torch.no_grad():
                for n, p in ours.items():
                    p.copy_(tensors[n])
            tokens = torch.randint(m["vocab_size"], (args.batch, m["seq_len"]), generator=gen)
            tok_path, out_path = os.path.join(tmp, kind + ".txt"), os.path.join(tmp, kind + ".safetensors")
            with open(tok_path, "w") as f:
                f.write("\n".join(" ".join(map(str, row)) for row in tokens.tolist()) + "\n")
            subprocess.run([depthkit, "forward", "--checkpoint", ck, "--tokens", tok_path, "--out", out_path],
                           check=True, stdout=subprocess.DEVNULL)
            theirs = read_safetensors(out_path)[0]["logits"]
            with torch.no_grad():
                mine = (torch.compile(model) if args.mode == "compile" else model)(tokens)
                exact = model.double()(tokens)  # float32 rounding of either program shows against it
            diff = (mine - theirs).abs()
            max_abs, scale = diff.max().item(), theirs.abs().max().item()
            rel = max_abs / scale
            ok = rel <= args.rtol
            failed += [] if ok else [kind]
            print(json.dumps({"kind": kind, "mode": args.mode, "tensors": len(ours), "tokens": list(tokens.shape),
                              "max_abs_diff": max_abs, "max_abs_logit": scale, "max_rel_diff": rel,
                              "mean_abs_diff": diff.mean().item(),
                              "depthkit_vs_float64": (theirs.double() - exact).abs().max().item(),
                              "torch_vs_float64": (mine.double() - exact).abs().max().item(), "ok": ok}), flush=True)
    if failed:
        sys.exit(f"logits differ from depthkit's beyond {args.rtol:g} (relative to the largest |logit|): {failed}")


# ---- timing -------------------------------------------------------------------------------------

def time_steps(args):
    cfg, r = load_config(args.config, args.kind)
    m, t, o = cfg["model"], cfg.get("train", {}), cfg.get("optim", {})
    torch.manual_seed(t.get("seed", 42))
    if t.get("threads", 0):
        torch.set_num_threads(t["threads"])
    model = Model(m, r)
    if args.mode.startswith("nn-"):  # the pathway from depthkit.nn, the rest as written here,
        plain, model = model, Model(m, r, nn=True)  # from the same initial parameters
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(dict(plain.named_parameters())[name])
    decay = [p for p in model.parameters() if p.dim() >= 2]  # as depthkit: matrices decay
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.get("weight_decay", 0.1)},
                             {"params": other, "weight_decay": 0.0}],
                            lr=o.get("lr", 3e-4), betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)), eps=o.get("eps", 1e-8),
                            # compile mode is the fastest a PyTorch user gets: with ATen's fused AdamW kernel too
                            fused=args.mode.endswith("compile"))
    loss_fn = torch.compile(lm_loss, dynamic=False) if args.mode.endswith("compile") else lm_loss
    B, accum, T, V = t.get("micro_batch", 8), t.get("grad_accum", 1), m["seq_len"], m["vocab_size"]
    times, warm = [], []
    for i in range(args.warmup + args.steps):
        batches = [torch.randint(V, (B, T + 1)) for _ in range(accum)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for b in batches:
            (loss_fn(model, b) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        (times if i >= args.warmup else warm).append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({"impl": f"pytorch-{args.mode}", "kind": args.kind, "median_step_s": med,
                      "tokens_per_s": B * accum * T / med, "threads": torch.get_num_threads(),
                      "warmup_s": sum(warm), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "step_s": times}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--kind", default="residual", choices=KINDS, help="the pathway to time")
    ap.add_argument("--mode", default="eager", choices=["eager", "compile", "nn-compile"],
                    help="nn-compile: the pathway from depthkit.nn (fused operators), compiled with the rest")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens in the first)")
    ap.add_argument("--check", action="store_true", help="compare logits with `depthkit forward` for --kinds")
    ap.add_argument("--kinds", default=",".join(KINDS), help="--check: comma-separated kinds")
    ap.add_argument("--batch", type=int, default=2, help="--check: sequences of model.seq_len tokens")
    ap.add_argument("--rtol", type=float, default=1e-5, help="--check: max |difference| / max |logit|")
    args = ap.parse_args()
    check(args) if args.check else time_steps(args)


if __name__ == "__main__":
    main()
