"""Attention Residuals (DAR eq. 2–5, 8–9; MSAR §3.1, §3.3), Full (block_sublayers = 1) and Block, and
AttnRes + SepV (DAR eq. 21): the fused path of pathways/attnres.cpp.

Sources: the token embedding (source 0), then one entry per completed block (with S = 1 each branch
output, eq. 4; with S > 1 the block's sum of outputs). Branch ℓ reads the completed sources by depth
attention with its pseudo-query q_ℓ, keys = values = the sources (eq. 3–5); after the first branch
of a block the block's partial sum is one more candidate of the same softmax (eq. 9), appended to
the list of sources depthkit::depth_read takes. The final hidden state is read from the completed
sources by the output query.

Parameters (names as depthkit's checkpoint, without "residual."): query.ℓ [d] for ℓ = 2 … L (branch
1 has a single candidate and no query; with share_within_block a block's branches of one type share
their first's, named after it), out_query [d]; zeros (uniform retrieval). SepV adds value_map.r
[d, d] for the 1 + ⌈L / S⌉ sources, the identity (the model starts as AttnRes): source r's value is
W_{v,r} v_r, its key stays Norm(v_r); the partial uses the map of the source it becomes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import KEY_NORM_EPS, Holder, Pathway, Schedule, cast_like, constant_, identity_, new_parameter, shared


class _History:
    """The sources as depth_read takes them: flat [B·T, d], each a shared entry (shared())."""

    def __init__(self, x: Tensor):
        self.B, self.T, self.d = x.shape
        self.completed: list[Tensor] = []
        self.values: list[Tensor] = []  # SepV: W_{v,r} · source r, mapped once when appended; else empty
        self.partial: Tensor | None = None  # the current block's sum [B, T, d]; None at a block's start

    def flat(self, x: Tensor) -> Tensor:
        return x.reshape(self.B * self.T, self.d)

    def source(self, x: Tensor) -> Tensor:
        return shared(self.flat(x))


class AttnRes(Pathway):
    """residual.kind = "attnres" (options block_sublayers, share_within_block)."""

    kind = "attnres"
    OPTIONS = ("block_sublayers", "share_within_block")
    OPERATORS = ("depth_read", "shared_source")
    SEPV = False

    def __init__(self, d_model: int, n_branches: int, *, block_sublayers: int = 2, share_within_block: bool = False,
                 impl: str = "fused", init_std: float = 0.02, device=None, dtype=None):
        super().__init__(d_model, n_branches,
                         {"block_sublayers": block_sublayers, "share_within_block": share_within_block, "impl": impl},
                         init_std)
        factory = {"device": device, "dtype": dtype}
        self.schedule = Schedule(self.options["block_sublayers"], n_branches, self.options["share_within_block"])
        # The name of the query branch ℓ uses (its owner's); none for branch 1.
        self._query_of: list[str | None] = [None, None]
        self.query = Holder()
        for l in range(2, n_branches + 1):
            name = str(self.schedule.owner(l))
            if name not in self.query._parameters:
                new_parameter(self.query, name, (d_model,), factory)
            self._query_of.append(name)
        self.out_query = nn.Parameter(torch.empty(d_model, **factory))
        if self.SEPV:
            self.value_map = Holder()
            for r in range(1 + self.schedule.blocks()):
                new_parameter(self.value_map, str(r), (d_model, d_model), factory)
        self.reset_parameters()

    def reset_parameters(self):
        """depthkit's initialisation: queries 0 (uniform retrieval), value maps the identity."""
        for p in self.query.parameters():
            constant_(p, 0.0)
        constant_(self.out_query, 0.0)
        if self.SEPV:
            for p in self.value_map.parameters():
                identity_(p)

    def _value(self, r: int, x: Tensor) -> Tensor:
        """The value of source index r: the source (eq. 4), or W_{v,r} x (SepV, eq. 21)."""
        if not self.SEPV:
            return x
        return F.linear(x, cast_like(getattr(self.value_map, str(r)), x))

    def _read(self, s: _History, q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        # One depth_read (DAR eq. 3–5) with one target; values [] means values = keys.
        out, _ = torch.ops.depthkit.depth_read(cast_like(q, keys[0]).unsqueeze(0), keys, values, KEY_NORM_EPS)
        return out[0].view(s.B, s.T, s.d)

    def begin(self, x: Tensor) -> _History:
        s = _History(x)
        s.completed.append(s.source(x))
        if self.SEPV:
            s.values.append(s.source(self._value(0, x)))
        return s

    def read(self, s: _History, l: int) -> Tensor:
        opens = self.schedule.opens(l)
        if opens and len(s.completed) == 1:  # branch 1: one candidate, weight 1
            return (s.values[0] if self.SEPV else s.completed[0]).view(s.B, s.T, s.d)
        q = getattr(self.query, self._query_of[l])
        if opens:  # eq. 9, i = 1: the completed sources only
            return self._read(s, q, s.completed, s.values)
        # The block's partial is the last candidate of one softmax over N + 1 (eq. 9), valued with
        # the map of the source index it will take.
        keys = s.completed + [s.flat(s.partial)]
        values = s.values + [s.flat(self._value(len(s.completed), s.partial))] if self.SEPV else []
        return self._read(s, q, keys, values)

    def write(self, s: _History, l: int, out: Tensor) -> None:
        s.partial = out if self.schedule.opens(l) else s.partial + out
        if self.schedule.closes(l):  # a block boundary (the last block may be shorter)
            if self.SEPV:
                s.values.append(s.source(self._value(len(s.completed), s.partial)))
            s.completed.append(s.source(s.partial))
            s.partial = None

    def finish(self, s: _History) -> Tensor:
        return self._read(s, self.out_query, s.completed, s.values)


class AttnResSepV(AttnRes):
    """residual.kind = "attnres_sepv": AttnRes with a value map per source (DAR eq. 21)."""

    kind = "attnres_sepv"
    SEPV = True
