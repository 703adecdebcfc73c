"""Manifold-constrained Hyper-Connections, mHC (MSAR eq. 3–5; docs/design.md, "mHC"): the fused path
of pathways/mhc.cpp, on depthkit::mhc_pre, depthkit::mhc_sinkhorn and depthkit::mhc_merge.

The state is m streams X = (x_1 … x_m), all starting as the embedding. For branch ℓ, from the
flattened state x = [x_1; …; x_m] ∈ R^{md}:
  logits = α ⊙ (x φ_ℓᵀ) / rms(x) + b_ℓ,   α = (α_pre, α_post, α_res) over the m, m and m² logits
  H_pre = σ(logits_pre), H_post = 2σ(logits_post), h_ℓ = Σ_i H_pre[i] x_i          (eq. 3–4: mhc_pre)
  H_res = Sinkhorn–Knopp(exp(logits_res)), `sinkhorn_iters` rounds of rows then columns (mhc_sinkhorn)
  x'_j = H_post[j] f_ℓ(h_ℓ) + Σ_i H_res[i, j] x_i                                   (eq. 5: mhc_merge)
The final hidden state is the sum of the streams.

Parameters per branch: ℓ.phi [m² + 2m, md] (normal(0, init_std)), ℓ.bias [m² + 2m] (zeros: H_pre = ½,
H_post = 1, H_res uniform), ℓ.scale [3] (α = 0.01).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import KEY_NORM_EPS, Holder, Pathway, cast_like, constant_, new_parameter, normal_

GATE_SCALE = 0.01  # Mhc::kGateScale


class _Streams:
    def __init__(self, x: Tensor):
        self.x = x  # [B, T, m, d]
        self.h_post: Tensor | None = None  # of the last read: [B, T, m]
        self.h_res: Tensor | None = None  # [B, T, m, m], rows the source stream i, columns the target j


class MHC(Pathway):
    """residual.kind = "mhc" (options streams, sinkhorn_iters)."""

    kind = "mhc"
    OPTIONS = ("streams", "sinkhorn_iters")
    OPERATORS = ("mhc_pre", "mhc_sinkhorn", "mhc_merge")

    def __init__(self, d_model: int, n_branches: int, *, streams: int = 4, sinkhorn_iters: int = 20,
                 impl: str = "fused", init_std: float = 0.02, device=None, dtype=None):
        super().__init__(d_model, n_branches, {"streams": streams, "sinkhorn_iters": sinkhorn_iters, "impl": impl},
                         init_std)
        factory = {"device": device, "dtype": dtype}
        self.m, self.iters = self.options["streams"], self.options["sinkhorn_iters"]
        n = self.m * self.m + 2 * self.m
        for l in range(1, n_branches + 1):
            b = Holder()
            self.add_module(str(l), b)
            new_parameter(b, "phi", (n, self.m * d_model), factory)
            new_parameter(b, "bias", (n,), factory)
            new_parameter(b, "scale", (3,), factory)
        self.reset_parameters()

    def reset_parameters(self):
        """depthkit's initialisation: φ normal(0, init_std), b = 0, α = 0.01."""
        for l in range(1, self.n_branches + 1):
            b = getattr(self, str(l))
            normal_(b.phi, self.init_std)
            constant_(b.bias, 0.0)
            constant_(b.scale, GATE_SCALE)

    def begin(self, x: Tensor) -> _Streams:
        return _Streams(x.unsqueeze(2).expand(-1, -1, self.m, -1))  # every stream starts as the embedding

    def read(self, s: _Streams, l: int) -> Tensor:
        b = getattr(self, str(l))
        # The parameters in the streams' dtype; H_post and the H_res logits come out in float32 (or
        # float64) whatever it is, and Sinkhorn runs in it (docs/design.md, "Precision").
        h, s.h_post, res_logits, _ = torch.ops.depthkit.mhc_pre(s.x, cast_like(b.phi, s.x), cast_like(b.bias, s.x),
                                                                cast_like(b.scale, s.x), KEY_NORM_EPS)  # eq. 3–4
        s.h_res = torch.ops.depthkit.mhc_sinkhorn(res_logits, self.iters)
        return h

    def write(self, s: _Streams, l: int, out: Tensor) -> None:
        s.x = torch.ops.depthkit.mhc_merge(s.x, out, s.h_post, s.h_res)  # eq. 5

    def finish(self, s: _Streams) -> Tensor:
        return s.x.sum(2)
