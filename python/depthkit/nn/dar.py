"""Dual Attention Residuals (DAR eq. 6–18, routing variants eq. 22): the fused path of
pathways/dar.cpp, on depthkit::dar_read, depthkit::dar_write and depthkit::depth_read.

History entries have two streams, H_r = [H_r⁰, H_r¹], from H_0 = [e, e] (eq. 6). Branch ℓ, the i-th
of its block, reads the candidates H_b (i = 1) or (H_b, P^{i−1}) (i > 1) (eq. 9) once per stream j
with its own query q_ℓʲ (key: the opposite stream, normalised; value: stream j; eq. 10–12), then
  h̄ = Norm([h⁰; h¹]),  α = σ(h̄ W_α + b_α),  β = 2σ(h̄ W_β + b_β)   (eq. 13–14),  h_ℓ = α⁰h⁰ + α¹h¹ (eq. 15)
— all of it one dar_read. The branch output is written to the block's partial (one dar_write):
  P^i = β ⊗ f(h_ℓ) (i = 1),  P^i = M(ρ) P^{i−1} + β ⊗ f(h_ℓ) (i > 1),  ρ = σ(Norm([P⁰; P¹]) W_ρ + b_ρ) (eq. 16–17)
and appended as H_b = P^S when the block closes (eq. 18; the last block may be shorter). Two output
queries read the completed history the same way (two depth_reads); h_out = h⁰_out + h¹_out.

Parameters ("ℓ." the owner branch: ℓ, or with share_within_block the first of ℓ's block and type):
ℓ.q0, ℓ.q1 [d] (zeros), ℓ.alpha.weight, ℓ.beta.weight [2, 2d] (normal(0, 0.2/√(2d)): small random
logits that break the swap symmetry of the two streams), ℓ.alpha.bias, ℓ.beta.bias [2] (zeros:
α ≈ (½, ½), β ≈ (1, 1)), and where a partial exists (a branch that does not open its block)
ℓ.rho.weight [1, 2d] (zeros) and ℓ.rho.bias [1] (4: ρ ≈ 0.98, transport near the identity);
out.q0, out.q1 [d] (zeros). DAR then starts close to AttnRes-Block (docs/design.md, "DAR").
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import (KEY_NORM_EPS, Holder, Pathway, Schedule, cast_like, child, constant_, dar_gate_std,
                      new_parameter, normal_, shared)

RHO_BIAS = 4.0  # Dar::kRhoBias
GATE_LOGIT_STD = 0.2  # Dar::kGateLogitStd

# Output stream j's (key stream, value stream) under each routing rule (DAR eq. 22).
ROUTES = {
    "cross": ((1, 0), (0, 1)),  # DAR: the other stream's key, its own value (eq. 10)
    "self": ((0, 0), (1, 1)),  # DAR-SelfKV
    "cross_value": ((0, 1), (1, 0)),  # DAR-CrossV
    "fixed": ((0, 1), (0, 1)),  # DAR-FixedKV
}


class _DualHistory:
    """Flat [B·T, d] tensors, as the operators take them: the completed entries of each stream
    (lists, never stacked; each a shared entry, shared()), the block's partial (None at a block's
    start) and the last read's β."""

    def __init__(self, x: Tensor):
        self.B, self.T, self.d = x.shape
        e = x.reshape(self.B * self.T, self.d)
        self.h0: list[Tensor] = [shared(e)]  # H_0 = [e, e] (eq. 6), an entry of each stream
        self.h1: list[Tensor] = [shared(e)]
        self.p0: Tensor | None = None
        self.p1: Tensor | None = None
        self.beta: Tensor | None = None  # [B·T, 2]


class DAR(Pathway):
    """residual.kind = "dar" (options block_sublayers ≥ 2, share_within_block, routing)."""

    kind = "dar"
    OPTIONS = ("block_sublayers", "share_within_block", "routing")
    OPERATORS = ("dar_read", "dar_write", "depth_read", "shared_source")

    def __init__(self, d_model: int, n_branches: int, *, block_sublayers: int = 2, share_within_block: bool = False,
                 routing: str = "cross", impl: str = "fused", init_std: float = 0.02, device=None, dtype=None):
        super().__init__(d_model, n_branches, {"block_sublayers": block_sublayers,
                                               "share_within_block": share_within_block, "routing": routing,
                                               "impl": impl}, init_std)
        if self.options["block_sublayers"] == 1:  # the registry's check (pathways/dar.cpp)
            raise ValueError("depthkit.nn.DAR: key 'residual.block_sublayers' = 1 is degenerate for DAR: a one-branch "
                             "block stores beta (x) f(h), two collinear streams (DAR eq. 19-20); use 2 (Full DAR, "
                             "one layer) or more")
        factory = {"device": device, "dtype": dtype}
        d = d_model
        self.schedule = Schedule(self.options["block_sublayers"], n_branches, self.options["share_within_block"])
        self.routes = ROUTES[self.options["routing"]]
        # Branch ℓ's parameter set is the submodule named after its owner (owners come first).
        self._owner: list[str | None] = [None]
        for l in range(1, n_branches + 1):
            name = str(self.schedule.owner(l))
            if name == str(l):
                b = Holder()
                self.add_module(name, b)
                new_parameter(b, "q0", (d,), factory)
                new_parameter(b, "q1", (d,), factory)
                for gate in ("alpha", "beta"):
                    new_parameter(child(b, gate), "weight", (2, 2 * d), factory)
                    new_parameter(child(b, gate), "bias", (2,), factory)
            b = self._modules[name]
            # The transport gate exists where a partial does: for a set one of whose branches does
            # not open its block.
            if not self.schedule.opens(l) and "rho" not in b._modules:
                new_parameter(child(b, "rho"), "weight", (1, 2 * d), factory)
                new_parameter(child(b, "rho"), "bias", (1,), factory)
            self._owner.append(name)
        out = child(self, "out")
        new_parameter(out, "q0", (d,), factory)
        new_parameter(out, "q1", (d,), factory)
        self.reset_parameters()

    def reset_parameters(self):
        """depthkit's initialisation (docs/design.md, "DAR")."""
        std = dar_gate_std(self.d_model, GATE_LOGIT_STD)
        for name in dict.fromkeys(self._owner[1:]):
            b = self._modules[name]
            constant_(b.q0, 0.0)
            constant_(b.q1, 0.0)
            for gate in (b.alpha, b.beta):
                normal_(gate.weight, std)
                constant_(gate.bias, 0.0)
            if "rho" in b._modules:
                constant_(b.rho.weight, 0.0)
                constant_(b.rho.bias, RHO_BIAS)
        constant_(self.out.q0, 0.0)
        constant_(self.out.q1, 0.0)

    def begin(self, x: Tensor) -> _DualHistory:
        return _DualHistory(x)

    def read(self, s: _DualHistory, l: int) -> Tensor:
        b = getattr(self, self._owner[l])
        e = s.h0[0]  # the parameters in the activations' dtype: the operators take one dtype
        (k0, v0), (k1, v1) = self.routes
        # eq. 10–15: both streams' reads (the partial the last candidate) and the gates α, β.
        h, beta, _ = torch.ops.depthkit.dar_read(
            torch.stack([cast_like(b.q0, e), cast_like(b.q1, e)]), s.h0, s.h1, s.p0, s.p1,
            cast_like(b.alpha.weight, e), cast_like(b.alpha.bias, e), cast_like(b.beta.weight, e),
            cast_like(b.beta.bias, e), [k0, k1], [v0, v1], KEY_NORM_EPS)
        s.beta = beta
        return h.view(s.B, s.T, s.d)

    def write(self, s: _DualHistory, l: int, out: Tensor) -> None:
        f = out.reshape(s.B * s.T, s.d)
        # eq. 16–17: β ⊗ f at a block's start; M(ρ) P^{i−1} + β ⊗ f after (a branch that opens its
        # block has no transport, though a shared set may hold a gate).
        if self.schedule.opens(l):
            s.p0, s.p1 = torch.ops.depthkit.dar_write(f, s.beta, None, None, None, None, KEY_NORM_EPS)
        else:
            rho = getattr(self, self._owner[l]).rho
            s.p0, s.p1 = torch.ops.depthkit.dar_write(f, s.beta, s.p0, s.p1, cast_like(rho.weight, f),
                                                      cast_like(rho.bias, f), KEY_NORM_EPS)
        if self.schedule.closes(l):  # H_b = P^S (eq. 18)
            s.h0.append(shared(s.p0))
            s.h1.append(shared(s.p1))
            s.p0 = s.p1 = None

    def finish(self, s: _DualHistory) -> Tensor:
        completed = (s.h0, s.h1)
        out = None
        for j, q in enumerate((self.out.q0, self.out.q1)):  # h_out = h⁰_out + h¹_out
            k, v = self.routes[j]
            o, _ = torch.ops.depthkit.depth_read(cast_like(q, s.h0[0]).unsqueeze(0), completed[k], completed[v],
                                                 KEY_NORM_EPS)
            out = o[0] if out is None else out + o[0]
        return out.view(s.B, s.T, s.d)
