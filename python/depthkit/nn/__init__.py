"""depthkit.nn: the residual pathways as torch modules that own the depth loop over your branches.

    path = depthkit.nn.make("dar", d_model, n_branches, block_sublayers=4)
    hidden = path(embedding, [layer.attention, layer.feed_forward, ...])   # → your final norm

One class per residual.kind of depthkit's pathway registry (src/depthkit/pathways/registry.cpp):
Residual, AttnRes, AttnResSepV, DAR, MSAR, MHC, AttnResMHC. Options are the TOML's [residual] keys
with depthkit's defaults; the parameters carry depthkit's checkpoint names (without "residual.")
and initialisation; the forward runs the fused operators torch.ops.depthkit.* as depthkit's
residual.impl = "fused" does, so it equals depthkit's model on the same parameters, and it traces
under torch.compile(fullgraph=True). docs/python.md shows it in a model.
"""
from __future__ import annotations

from ._common import DEFAULTS, KEY_NORM_EPS, Pathway, check_option
from .attnres import AttnRes, AttnResSepV
from .attnres_mhc import AttnResMHC
from .dar import DAR
from .mhc import MHC
from .msar import MSAR
from .residual import Residual

# residual.kind → its module, in the registry's order (pathways/registry.cpp).
KINDS: dict[str, type[Pathway]] = {
    "residual": Residual,
    "attnres": AttnRes,
    "dar": DAR,
    "msar": MSAR,
    "mhc": MHC,
    "attnres_sepv": AttnResSepV,
    "attnres_mhc": AttnResMHC,
}


def make(kind: str, d_model: int, n_branches: int, /, *, init_std: float = 0.02, device=None, dtype=None,
         **options) -> Pathway:
    """The pathway residual.kind = `kind` for a model of width d_model with n_branches branches
    (depthkit's backbone: 2 · n_layers). `options` are [residual] keys (block_sublayers,
    share_within_block, routing, streams, kernels, conv, fusion, sinkhorn_iters, impl), each checked
    as depthkit's config checks it; keys the kind does not read are accepted, as in the TOML.
    init_std is model.init_std (MSAR's W_pre and mHC's φ are drawn from normal(0, init_std)).
    A whole [residual] table may be passed, its `kind` too when it is `kind`.
    An unknown kind or key, or a bad value: ValueError, one line naming the key."""
    where = "depthkit.nn.make"
    if kind not in KINDS:
        raise ValueError(f"{where}: key 'residual.kind' must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if "kind" in options and options.pop("kind") != kind:
        raise ValueError(f"{where}: key 'residual.kind' given twice, as {kind!r} and in the options as a different kind")
    checked = {key: check_option(where, key, value) for key, value in options.items()}
    cls = KINDS[kind]
    mine = {k: v for k, v in checked.items() if k in cls.OPTIONS or k == "impl"}
    return cls(d_model, n_branches, init_std=init_std, device=device, dtype=dtype, **mine)


__all__ = ["make", "KINDS", "DEFAULTS", "KEY_NORM_EPS", "Pathway", "Residual", "AttnRes", "AttnResSepV", "DAR",
           "MSAR", "MHC", "AttnResMHC"]
