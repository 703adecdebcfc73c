"""Multi-Stream Attention Residuals (MSAR eq. 9–17, Appendix C): the fused path of
pathways/msar.cpp, on depthkit::msar_block_read and depthkit::msar_fuse.

Sources are single-stream, as in AttnRes: the embedding, then each completed block's sum of branch
outputs (eq. 15; S = 1: each branch output, Full MSAR). A read expands each source into m streams
by causal depthwise convolutions (eq. 9–10):
  v⁽⁰⁾ = v,   v⁽ʳ⁾_t = Σ_{δ<κ_r} c_{r,δ} ⊙ v_{t−δ}   (zero before position 0), r = 1 … m−1,
and reads stream r by depth attention with its own pseudo-query, keys = values = the expanded
sources (eq. 11–12): msar_block_read over the raw sources and their banks, for all of a block's
branches at once (the expansions are never stored). msar_fuse merges the block's partial,
expanded by bank ℓ−1, by online softmax (eq. 17; absent at a block's first branch) and fuses the
m retrieved states Z (eq. 13–14):
  H_pre = σ(α_pre · Norm(flatten Z) W_preᵀ + b_pre),   h_ℓ = Σ_r H_pre[r] z⁽ʳ⁾   (or their mean).
The final hidden state is the residual merge of the last branch, h_L + f_L(h_L) (§3.2).

Banks (Appendix C): bank 0 expands the embedding, a completed block uses the bank of its last
branch, the partial before branch ℓ uses bank ℓ−1; L banks (the last output is never expanded).
Parameters: ℓ.queries [m, d] (zeros); with fusion = "hpre" ℓ.pre.weight [m, m·d] (normal(0,
init_std)), ℓ.pre.bias [m] (zeros), ℓ.pre.scale [1] (α_pre = 0.01); with conv, bank.k.conv<r> [d, κ_r]
for k = 0 … L−1, r = 1 … m−1 (zeros: streams r ≥ 1 start empty). Ablations: conv = false (each
stream a replica of the source: identity taps, no bank parameters), fusion = "mean".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (KEY_NORM_EPS, Holder, Pathway, Schedule, cast_like, child, constant_, new_parameter, normal_,
                      shared)

PRE_SCALE = 0.01  # Msar::kPreScale, α_pre's initial value


class _Sources:
    def __init__(self):
        self.raw: list[Tensor] = []  # completed sources [B, T, d], expanded at each read
        self.taps: list[Tensor] = []  # their banks [m − 1, d, K]
        self.partial: Tensor | None = None  # the current block's sum; None at a block's start
        self.last_input: Tensor | None = None  # h_ℓ of the last read
        self.last_output: Tensor | None = None  # f_ℓ(h_ℓ) of the last write
        self.block: dict[int, tuple[Tensor, Tensor]] = {}  # phase 1 of the block's branches yet to read


class MSAR(Pathway):
    """residual.kind = "msar" (options block_sublayers, streams, kernels, conv, conv_init, fusion)."""

    kind = "msar"
    OPTIONS = ("block_sublayers", "streams", "kernels", "conv", "conv_init", "fusion")
    OPERATORS = ("msar_block_read", "msar_fuse", "shared_source")

    def __init__(self, d_model: int, n_branches: int, *, block_sublayers: int = 2, streams: int = 4,
                 kernels=(4, 8, 12), conv: bool = True, conv_init: str = "zeros", fusion: str = "hpre",
                 impl: str = "fused", init_std: float = 0.02, device=None, dtype=None):
        super().__init__(d_model, n_branches, {"block_sublayers": block_sublayers, "streams": streams,
                                               "kernels": kernels, "conv": conv, "conv_init": conv_init,
                                               "fusion": fusion, "impl": impl}, init_std)
        o = self.options
        m, self.conv, self.mean = o["streams"], o["conv"], o["fusion"] == "mean"
        if self.conv and len(o["kernels"]) != m - 1:  # the registry's check (pathways/msar.cpp)
            raise ValueError(f"depthkit.nn.MSAR: key 'residual.kernels' has {len(o['kernels'])} kernel sizes; MSAR "
                             f"with residual.streams = {m} needs {m - 1} (stream 0 is the identity)")
        factory = {"device": device, "dtype": dtype}
        d = d_model
        self.m, self.kernels = m, o["kernels"]
        self.schedule = Schedule(o["block_sublayers"], n_branches)  # no sharing for MSAR
        # The kernels' lengths: their taps past it are padding, which the operators skip.
        self._lengths = list(self.kernels) if self.conv and m > 1 else None
        self._K = max(self.kernels) if self._lengths else 1
        for l in range(1, n_branches + 1):
            b = Holder()
            self.add_module(str(l), b)
            new_parameter(b, "queries", (m, d), factory)
            if not self.mean:
                pre = child(b, "pre")
                new_parameter(pre, "weight", (m, m * d), factory)
                new_parameter(pre, "bias", (m,), factory)
                new_parameter(pre, "scale", (1,), factory)
        if self.conv and m > 1:
            bank = child(self, "bank")
            for k in range(n_branches):
                for r in range(1, m):
                    new_parameter(child(bank, str(k)), f"conv{r}", (d, self.kernels[r - 1]), factory)
        self.reset_parameters()

    def reset_parameters(self):
        """depthkit's initialisation: queries 0, W_pre normal(0, init_std), b_pre 0, α_pre 0.01; the
        convolutions per conv_init: 0 (the paper), 1/κ_r (average) or normal(0, init_std)."""
        for l in range(1, self.n_branches + 1):
            b = getattr(self, str(l))
            constant_(b.queries, 0.0)
            if not self.mean:
                normal_(b.pre.weight, self.init_std)
                constant_(b.pre.bias, 0.0)
                constant_(b.pre.scale, PRE_SCALE)
        if "bank" in self._modules:
            for k in range(self.n_branches):
                for r in range(1, self.m):
                    p = getattr(getattr(self.bank, str(k)), f"conv{r}")
                    if self.options["conv_init"] == "average":
                        constant_(p, 1.0 / self.kernels[r - 1])
                    elif self.options["conv_init"] == "normal":
                        normal_(p, self.init_std)
                    else:
                        constant_(p, 0.0)

    def taps(self, k: int, like: Tensor) -> Tensor:
        """Bank k as the operators take it, [m − 1, d, K]: each kernel's taps zero-padded to the
        largest K; identity taps (ones, K = 1) without convolutions (conv = false, or m = 1)."""
        if self._lengths is None:
            return torch.ones(self.m - 1, self.d_model, 1, dtype=like.dtype, device=like.device)
        bank = getattr(self.bank, str(k))
        return torch.stack([F.pad(getattr(bank, f"conv{r}"), (0, self._K - self.kernels[r - 1]))
                            for r in range(1, self.m)])

    def _append(self, s: _Sources, source: Tensor, k: int) -> None:
        s.raw.append(shared(source))  # its reads add its gradient into one buffer
        s.taps.append(self.taps(k, source))

    def begin(self, x: Tensor) -> _Sources:
        s = _Sources()
        self._append(s, x, 0)  # bank 0: the embedding
        return s

    def read(self, s: _Sources, l: int) -> Tensor:
        b = getattr(self, str(l))
        e = s.raw[0]  # the parameters in the activations' dtype: the operators take one dtype
        queries = cast_like(b.queries, e)
        # Phase 1 over the completed sources, expanded by their banks (eq. 10–12), for this branch
        # and the rest of its block at once (their sources are the same, MSAR §3.4): made by the
        # block's first read, taken by each branch.
        if l not in s.block:
            last = min(self.schedule.block_of(l) * self.schedule.size, self.n_branches)
            outs, lses = torch.ops.depthkit.msar_block_read(
                [cast_like(getattr(self, str(k)).queries, e) for k in range(l, last + 1)], s.raw,
                [cast_like(t, e) for t in s.taps], KEY_NORM_EPS, self._lengths)
            s.block = {k: read for k, read in zip(range(l, last + 1), zip(outs, lses))}
        out, lse = s.block.pop(l)
        # Phase 2: the partial expanded by bank ℓ−1 (none at a block's first branch), then the H_pre
        # fusion (eq. 13–14) or the mean.
        opens = self.schedule.opens(l)
        partial = None if opens else s.partial
        partial_taps = None if opens else cast_like(self.taps(l - 1, e), e)
        if self.mean:
            w_pre = b_pre = alpha_pre = None
        else:
            w_pre, b_pre, alpha_pre = (cast_like(b.pre.weight, e), cast_like(b.pre.bias, e),
                                       cast_like(b.pre.scale, e))
        h = torch.ops.depthkit.msar_fuse(out, lse, queries, partial, partial_taps, w_pre, b_pre, alpha_pre,
                                         KEY_NORM_EPS, self._lengths)
        s.last_input = h
        return h

    def write(self, s: _Sources, l: int, out: Tensor) -> None:
        s.last_output = out
        s.partial = out if self.schedule.opens(l) else s.partial + out  # eq. 16
        if self.schedule.closes(l):  # eq. 15: the block is complete
            if l < self.n_branches:  # (the last one is never read)
                self._append(s, s.partial, l)  # with the bank of its last branch
            s.partial = None

    def finish(self, s: _Sources) -> Tensor:
        return s.last_input + s.last_output  # the residual merge of the last branch (§3.2)
