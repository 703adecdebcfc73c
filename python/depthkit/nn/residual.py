"""The standard residual stream (pathways/residual.cpp): h_{ℓ+1} = h_ℓ + f_ℓ(h_ℓ). No parameters, no
operators; the baseline the depth pathways are compared with."""
from __future__ import annotations

from torch import Tensor

from ._common import Pathway


class _Stream:
    def __init__(self, h: Tensor):
        self.h = h


class Residual(Pathway):
    """residual.kind = "residual": every branch reads the running sum and adds its output to it."""

    kind = "residual"
    OPTIONS = ()
    OPERATORS = ()

    def __init__(self, d_model: int, n_branches: int, *, impl: str = "fused", init_std: float = 0.02,
                 device=None, dtype=None):
        super().__init__(d_model, n_branches, {"impl": impl}, init_std)

    def begin(self, x: Tensor) -> _Stream:
        return _Stream(x)

    def read(self, state: _Stream, l: int) -> Tensor:
        return state.h

    def write(self, state: _Stream, l: int, out: Tensor) -> None:
        state.h = state.h + out

    def finish(self, state: _Stream) -> Tensor:
        return state.h
