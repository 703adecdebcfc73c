"""AttnRes + mHC (MSAR Table 2, row 4; pathways/attnres_mhc.cpp): the AttnRes history of completed
sources and mHC's m recurrent streams side by side. Each branch reads the sum of the two readouts
and its output is written to both; the final hidden state is the sum of AttnRes's output read and
mHC's stream sum. Parameters: both pathways', under attnres.* and mhc.*."""
from __future__ import annotations

from torch import Tensor

from ._common import Pathway
from .attnres import AttnRes
from .mhc import MHC


class AttnResMHC(Pathway):
    """residual.kind = "attnres_mhc" (options block_sublayers, share_within_block, streams, sinkhorn_iters)."""

    kind = "attnres_mhc"
    OPTIONS = ("block_sublayers", "share_within_block", "streams", "sinkhorn_iters")
    OPERATORS = AttnRes.OPERATORS + MHC.OPERATORS

    def __init__(self, d_model: int, n_branches: int, *, block_sublayers: int = 2, share_within_block: bool = False,
                 streams: int = 4, sinkhorn_iters: int = 20, impl: str = "fused", init_std: float = 0.02,
                 device=None, dtype=None):
        super().__init__(d_model, n_branches, {"block_sublayers": block_sublayers,
                                               "share_within_block": share_within_block, "streams": streams,
                                               "sinkhorn_iters": sinkhorn_iters, "impl": impl}, init_std)
        common = {"impl": impl, "init_std": init_std, "device": device, "dtype": dtype}
        self.attnres = AttnRes(d_model, n_branches, block_sublayers=block_sublayers,
                               share_within_block=share_within_block, **common)
        self.mhc = MHC(d_model, n_branches, streams=streams, sinkhorn_iters=sinkhorn_iters, **common)

    def reset_parameters(self):
        self.attnres.reset_parameters()
        self.mhc.reset_parameters()

    def begin(self, x: Tensor):
        return self.attnres.begin(x), self.mhc.begin(x)

    def read(self, s, l: int) -> Tensor:
        return self.attnres.read(s[0], l) + self.mhc.read(s[1], l)

    def write(self, s, l: int, out: Tensor) -> None:
        self.attnres.write(s[0], l, out)
        self.mhc.write(s[1], l, out)

    def finish(self, s) -> Tensor:
        return self.attnres.finish(s[0]) + self.mhc.finish(s[1])
