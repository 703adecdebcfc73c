#!/usr/bin/env python3
"""A small GPT in plain PyTorch whose residual stream is a depthkit.nn pathway.

The model is yours: token embedding, causal self-attention with rotary positions and a GELU MLP per
layer (each with its own pre-norm), final RMSNorm and an untied head. Only the residual stream comes
from depthkit: the pathway owns the depth loop and calls your branches in order, attention then MLP
of each layer, feeding each the input it retrieves across depth (DAR, MSAR, AttnRes, mHC, ...).

    .venv/bin/python examples/train_gpt.py --kind dar --steps 200
    .venv/bin/python examples/train_gpt.py --kind msar --set block_sublayers=4 --set kernels=[2,4,8] --compile

It trains on llm.c-format token shards (docs/data.md), by default the bundled corpus that
`scripts/quickstart` (or `build/depthkit data prepare`) writes to data/pydoc, and prints the
training loss and throughput of every step.
"""
import argparse
import json
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import depthkit.nn

# ---- data: llm.c token shards -------------------------------------------------------------------

# The header is 256 little-endian int32: magic, version, token count, zeros (src/depthkit/data/shards.cpp).
SHARD_LAYOUTS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, token type)


def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header.size < 256:
        raise SystemExit(f"{path}: smaller than the 1024-byte header")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in SHARD_LAYOUTS:
        raise SystemExit(f"{path}: wrong magic {magic}: not an llm.c token shard")
    want_version, dtype = SHARD_LAYOUTS[magic]
    if version != want_version:
        raise SystemExit(f"{path}: unsupported version {version} for magic {magic} (expected {want_version})")
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=1024)
    if tokens.size != count:
        raise SystemExit(f"{path}: header says {count} tokens, the file holds {tokens.size}")
    return tokens


class Batches:
    """Random windows of seq_len + 1 tokens (inputs and next-token targets) from the training shards
    (every *train_*.bin of the folder), never crossing a shard boundary."""

    def __init__(self, folder, seq_len, batch, seed):
        paths = sorted(pathlib.Path(folder).glob("*train_*.bin"))
        if not paths:
            raise SystemExit(f"{folder}: no *train_*.bin shards (run scripts/quickstart, or give --data)")
        self.shards = [s for s in map(read_shard, paths) if s.size > seq_len]
        if not self.shards:
            raise SystemExit(f"{folder}: no shard holds more than seq_len = {seq_len} tokens")
        self.seq_len, self.batch = seq_len, batch
        self.gen = np.random.default_rng(seed)
        self.max_token = max(int(s.max()) for s in self.shards)

    def next(self):
        rows = []
        for _ in range(self.batch):
            shard = self.shards[self.gen.integers(len(self.shards))]
            start = self.gen.integers(shard.size - self.seq_len)
            rows.append(np.asarray(shard[start:start + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


# ---- the model: plain PyTorch branches, a depthkit.nn residual pathway -----------------------------


def rotary(x, cos, sin):
    """Rotary position embedding, rotate-half pairing (RoFormer eq. 34): x [B, H, T, hd]."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Attention(nn.Module):
    """Branch 2i + 1: pre-norm, causal multi-head self-attention with rotary positions."""

    def __init__(self, d, heads, seq_len):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        inv = 10000.0 ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, h):
        B, T, d = h.shape
        q, k, v = self.qkv(self.norm(h)).view(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:T], self.sin[:T]
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    """Branch 2i + 2: pre-norm, GELU feed-forward of width 4d."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len, kind, options):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        branches = []
        for _ in range(layers):
            branches += [Attention(d, heads, seq_len), MLP(d)]
        self.branches = nn.ModuleList(branches)
        # The residual stream: depthkit's pathway of `kind`, with its own parameters and initialisation.
        self.residual = depthkit.nn.make(kind, d, len(branches), **options)
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        # GPT-2's initialisation: normal(0, 0.02), the branch output projections 1/√(2·layers) smaller
        # so that the residual sum's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.startswith("residual.") or p.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)

    def forward(self, tokens):
        hidden = self.residual(self.embedding(tokens), self.branches)  # the depth loop over the branches
        return self.head(self.norm(hidden))


def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


# ---- training ----------------------------------------------------------------------------------


def parse_set(items):
    """--set key=value (a [residual] key, "residual." optional): TOML-like values, i.e. true, 4,
    [4, 8, 12], "mean" or a bare word."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: expected key=value")
        try:
            options[key.removeprefix("residual.")] = json.loads(value)
        except json.JSONDecodeError:
            options[key.removeprefix("residual.")] = value
    return options


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/pydoc", help="folder of *train_*.bin shards")
    ap.add_argument("--kind", default="dar", choices=list(depthkit.nn.KINDS), help="residual.kind")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a [residual] option, e.g. block_sublayers=4, routing=self, kernels=[2,4,8]")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=0, help="0: meta.json's, else the largest token id + 1")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) of forward + loss")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    data = Batches(args.data, args.seq_len, args.batch, args.seed)
    vocab = args.vocab_size
    meta = pathlib.Path(args.data) / "meta.json"
    if not vocab and meta.is_file():
        vocab = json.loads(meta.read_text())["vocab_size"]
    vocab = vocab or data.max_token + 1
    if data.max_token >= vocab:
        raise SystemExit(f"token id {data.max_token} in the shards is outside the vocabulary of {vocab}")

    try:
        model = GPT(vocab, args.d_model, args.layers, args.heads, args.seq_len, args.kind, parse_set(args.set))
    except ValueError as e:  # a bad --set: one line naming the key
        raise SystemExit(str(e))
    model.to(args.device)
    print(f"{args.kind}: {model.residual.extra_repr()}; "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{sum(p.numel() for p in model.residual.parameters()):,} of them the pathway's")

    # AdamW with weight decay on matrices only; the pathway's gates and queries are vectors.
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step_loss = torch.compile(loss_of, fullgraph=True) if args.compile else loss_of

    tokens_per_step = args.batch * args.seq_len
    timed = []
    for step in range(1, args.steps + 1):
        batch = data.next().to(args.device)
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        opt.zero_grad(set_to_none=True)
        loss = step_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = loss.item()  # waits for the step to finish
        seconds = time.perf_counter() - t0
        if step > 1:  # the first step compiles (with --compile) and warms up
            timed.append(seconds)
        print(f"step {step:5d}  loss {value:.4f}  {tokens_per_step / seconds:10.0f} tokens/s", flush=True)
        if not math.isfinite(value):
            raise SystemExit(f"step {step}: the loss is {value}")
    if timed:
        print(f"mean after the first step: {tokens_per_step * len(timed) / sum(timed):.0f} tokens/s")


if __name__ == "__main__":
    main()
