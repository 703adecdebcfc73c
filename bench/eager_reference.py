#!/usr/bin/env python3
"""The depthkit dense model written in PyTorch eager mode, for `bench/compare-eager`.

Same architecture as src/depthkit/model (Pre-Norm, GQA with RoPE rotate-half, SwiGLU,
RMSNorm with weight, untied head, no biases), same initialisation scheme, the same step
(forward, backward, clip 1.0, AdamW) on random tokens. Prints one JSON line.
"""
import argparse
import json
import math
import resource
import statistics
import time
import tomllib

import torch
import torch.nn.functional as F


class Model(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        d, V, L = m["d_model"], m["vocab_size"], m["n_layers"]
        self.H, self.KV = m["n_heads"], m["n_kv_heads"]
        self.hd = m.get("head_dim", 0) or d // self.H
        self.eps = m.get("norm_eps", 1e-5)
        std = m.get("init_std", 0.02)
        out_std = std / math.sqrt(2 * L)
        p = lambda *shape, s: torch.nn.Parameter(torch.randn(*shape) * s)
        ones = lambda n: torch.nn.Parameter(torch.ones(n))
        self.embedding = p(V, d, s=std)
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            layer = torch.nn.Module()
            layer.attn_norm, layer.ffn_norm = ones(d), ones(d)
            layer.wq = p(self.H * self.hd, d, s=std)
            layer.wk = p(self.KV * self.hd, d, s=std)
            layer.wv = p(self.KV * self.hd, d, s=std)
            layer.wo = p(d, self.H * self.hd, s=out_std)
            layer.w_gate = p(m["d_ff"], d, s=std)
            layer.w_up = p(m["d_ff"], d, s=std)
            layer.w_down = p(d, m["d_ff"], s=out_std)
            self.layers.append(layer)
        self.final_norm = ones(d)
        self.lm_head = p(V, d, s=std)
        theta = m.get("rope_theta", 10000.0)
        inv = torch.exp(torch.arange(self.hd // 2, dtype=torch.float64) * (-2 * math.log(theta) / self.hd))
        ang = torch.outer(torch.arange(m["seq_len"], dtype=torch.float64), inv)
        self.register_buffer("cos", ang.cos().float())
        self.register_buffer("sin", ang.sin().float())

    def rope(self, x):
        T, half = x.shape[2], x.shape[3] // 2
        c, s = self.cos[:T], self.sin[:T]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def forward(self, tokens):
        B, T = tokens.shape
        h = F.embedding(tokens, self.embedding)
        for l in self.layers:
            x = F.rms_norm(h, (h.shape[-1],), l.attn_norm, self.eps)
            q = F.linear(x, l.wq).view(B, T, self.H, self.hd).transpose(1, 2)
            k = F.linear(x, l.wk).view(B, T, self.KV, self.hd).transpose(1, 2)
            v = F.linear(x, l.wv).view(B, T, self.KV, self.hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True,
                                               enable_gqa=self.KV != self.H)
            h = h + F.linear(o.transpose(1, 2).reshape(B, T, -1), l.wo)
            x = F.rms_norm(h, (h.shape[-1],), l.ffn_norm, self.eps)
            h = h + F.linear(F.silu(F.linear(x, l.w_gate)) * F.linear(x, l.w_up), l.w_down)
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.final_norm, self.eps), self.lm_head)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    m, t, o = cfg["model"], cfg.get("train", {}), cfg.get("optim", {})
    torch.manual_seed(t.get("seed", 42))
    if t.get("threads", 0):
        torch.set_num_threads(t["threads"])
    model = Model(m)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.get("weight_decay", 0.1)},
                             {"params": other, "weight_decay": 0.0}],
                            lr=o.get("lr", 3e-4), betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
                            eps=o.get("eps", 1e-8))
    B, accum, T, V = t.get("micro_batch", 8), t.get("grad_accum", 1), m["seq_len"], m["vocab_size"]
    times = []
    for i in range(args.warmup + args.steps):
        batches = [torch.randint(V, (B, T + 1)) for _ in range(accum)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for b in batches:
            logits = model(b[:, :T])
            loss = F.cross_entropy(logits.reshape(-1, V), b[:, 1:].reshape(-1)) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({"impl": "pytorch-eager", "median_step_s": med, "tokens_per_s": B * accum * T / med,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "step_s": times}))


if __name__ == "__main__":
    main()
