"""What every pathway module shares: the [residual] options and their checks, the block schedule,
the parameter containers and initialisation, the device check of the operators, and `Pathway`,
the base class that owns the depth loop.

The modules hold parameters and call the fused operators (torch.ops.depthkit.*); the math lives in
the operators (/work/shared/DESIGN.md, "Meeting users where they are"). Each module follows its C++
pathway's fused path (src/depthkit/pathways/*.cpp) call for call, so that it equals depthkit's
model on the same parameters.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

# kKeyNormEps (ops/reference/depth_attention.h): the epsilon of Norm(·), the weightless RMSNorm of
# the keys (DAR eq. 2) and of the gate inputs (DAR eq. 13, 16; MSAR eq. 13; mHC's rms(x)).
KEY_NORM_EPS = 1e-6

# The [residual] keys of depthkit's TOML (src/depthkit/config/config.cpp) with their defaults
# (config.h, ResidualConfig), `kind` aside: it is make()'s first argument.
DEFAULTS = {
    "block_sublayers": 2,
    "share_within_block": False,
    "routing": "cross",
    "streams": 4,
    "kernels": (4, 8, 12),
    "conv": True,
    "conv_init": "zeros",
    "fusion": "hpre",
    "sinkhorn_iters": 20,
    "impl": "fused",
}

_CHOICES = {
    "routing": ("cross", "self", "cross_value", "fixed"),
    "fusion": ("hpre", "mean"),
    "conv_init": ("zeros", "average", "normal"),
    "impl": ("reference", "fused"),
}
_RANGES = {"block_sublayers": (1, 1 << 20), "streams": (1, 64), "kernels": (1, 4096), "sinkhorn_iters": (1, 1000)}


def _describe(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _is_int(value) -> bool:
    # An integer as TOML has them: a bool is not one (True would pass as 1).
    return isinstance(value, int) and not isinstance(value, bool)


def check_option(where: str, key: str, value):
    """`value` of [residual] key `key`, checked as depthkit's config loader checks it (type, range,
    choices) and normalised (kernels → tuple); ValueError with one line naming the key otherwise."""
    name = f"residual.{key}"
    if key not in DEFAULTS:
        raise ValueError(f"{where}: unknown key '{name}' (the [residual] keys: {', '.join(DEFAULTS)})")
    if key in ("share_within_block", "conv"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: key '{name}' must be true or false, got {_describe(value)}")
        return value
    if key in _CHOICES:
        if not isinstance(value, str) or value not in _CHOICES[key]:
            choices = ", ".join(f'"{c}"' for c in _CHOICES[key])
            raise ValueError(f"{where}: key '{name}' must be one of {choices}, got {_describe(value)}")
        return value
    lo, hi = _RANGES[key]
    if key == "kernels":
        if not isinstance(value, (list, tuple)) or not all(_is_int(k) for k in value):
            raise ValueError(f"{where}: key '{name}' must be an array of integers, got {_describe(value)}")
        for k in value:
            if not lo <= k <= hi:
                raise ValueError(f"{where}: key '{name}' must hold integers in [{lo}, {hi}], got {k}")
        return tuple(value)
    if not _is_int(value):
        raise ValueError(f"{where}: key '{name}' must be an integer, got {_describe(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: key '{name}' must be an integer in [{lo}, {hi}], got {value}")
    return value


def check_shape_args(where: str, d_model, n_branches, init_std):
    if not _is_int(d_model) or d_model < 1:
        raise ValueError(f"{where}: d_model must be a positive integer, got {_describe(d_model)}")
    if not _is_int(n_branches) or n_branches < 1:
        raise ValueError(f"{where}: n_branches must be a positive integer, got {_describe(n_branches)}")
    if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not 0 <= init_std <= 10:
        raise ValueError(f"{where}: init_std (model.init_std) must be a number in [0, 10], got {_describe(init_std)}")


class Schedule:
    """The block schedule (pathways/pathway.h, BlockSchedule; DAR eq. 8–9, MSAR eq. 15–16):
    branches ℓ = 1 … L in blocks of S, the last block possibly shorter. The first branch of a block
    reads the completed sources only; the branch that closes a block turns its partial into a
    completed source. S = 1 is the Full form."""

    def __init__(self, size: int, branches: int, shared: bool = False):
        self.size, self.branches, self.shared = size, branches, shared

    def opens(self, l: int) -> bool:
        return (l - 1) % self.size == 0

    def closes(self, l: int) -> bool:
        return l % self.size == 0 or l == self.branches

    def blocks(self) -> int:
        return (self.branches + self.size - 1) // self.size

    def block_of(self, l: int) -> int:
        return (l - 1) // self.size + 1

    def owner(self, l: int) -> int:
        """The branch whose parameters ℓ uses: ℓ, or with share_within_block the first branch of ℓ's
        block of ℓ's type (branches alternate attention, feed-forward: odd ℓ attention)."""
        if not self.shared:
            return l
        first = (self.block_of(l) - 1) * self.size + 1
        return first if (first - l) % 2 == 0 else first + 1


class Holder(nn.Module):
    """A bare container, so that parameters get depthkit's dotted names ("query.2", "3.alpha.weight",
    "bank.0.conv1") in state_dict. Attributes are reached with getattr, which torch.compile traces."""


def new_parameter(holder: nn.Module, name: str, shape, factory) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, **factory))
    holder.register_parameter(name, p)
    return p


def child(parent: nn.Module, name: str) -> nn.Module:
    """parent's submodule `name`, created (a Holder) if it has none."""
    if name not in parent._modules:
        parent.add_module(name, Holder())
    return parent._modules[name]


def shared(entry: Tensor) -> Tensor:
    """A history entry that many reads take, as depthkit::shared_source (ops/shared_source.h): the
    reads' backward operators add its gradient into one buffer, where autograd would otherwise take
    one gradient tensor per read and sum them (under torch.compile, a zero buffer cloned and a sum
    per read and entry). The entry itself where no gradient is recorded. The C++ pathways do the same."""
    if torch.is_grad_enabled() and entry.requires_grad:
        return torch.ops.depthkit.shared_source(entry)
    return entry


def cast_like(weight: Tensor | None, activation: Tensor) -> Tensor | None:
    """The parameter in the activation's dtype (nn/precision.h: the operators take one dtype); the
    parameter itself when the dtypes agree. None stays None (an absent optional input)."""
    return None if weight is None else weight.to(activation.dtype)


# Whether the operator library has each operator's kernel, and its backward's, for CUDA; known once
# the library is loaded (import depthkit), so computed once here and only looked up while a model
# runs, which torch.compile traces as a constant. ops/cuda/ registers depth_read and depth_merge.
_CUDA_KERNELS: dict[str, bool] = {}


def _has_cuda_kernel(op: str) -> bool:
    if op not in _CUDA_KERNELS:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        forward, backward = f"depthkit::{op}", f"depthkit::{op}_backward"
        ok = has(forward, "CUDA")
        if ok and torch._C._dispatch_has_kernel(backward):
            ok = has(backward, "CUDA")
        _CUDA_KERNELS[op] = ok
    return _CUDA_KERNELS[op]


class Pathway(nn.Module):
    """A residual pathway that owns the depth loop (docs/design.md, "The seam").

    forward(x, branches): x [B, T, d] is the token embedding (source 0 of the depth pathways);
    branches[ℓ − 1] is branch ℓ = 1 … n_branches, any callable [B, T, d] → [B, T, d] that includes
    its own pre-norm (depthkit's backbone: odd ℓ the attention of layer (ℓ − 1) // 2, even ℓ its
    feed-forward). For each ℓ the pathway computes the branch input h_ℓ (read), calls the branch
    and takes its output f_ℓ(h_ℓ) (write); it returns the hidden state for the final norm (finish).

    begin / read / write / finish are that loop's steps, for callers that drive it themselves.
    """

    kind = ""
    OPTIONS: tuple[str, ...] = ()  # the [residual] keys the kind reads (all are accepted by make)
    OPERATORS: tuple[str, ...] = ()  # the depthkit operators it runs

    def __init__(self, d_model: int, n_branches: int, options: dict, init_std: float = 0.02):
        super().__init__()
        where = f"depthkit.nn.{type(self).__name__}"
        check_shape_args(where, d_model, n_branches, init_std)
        self.d_model, self.n_branches, self.init_std = d_model, n_branches, float(init_std)
        self.options = {k: check_option(where, k, v) for k, v in options.items()}
        # impl: depthkit.nn always runs the operators (their kernels): "reference" is accepted so that
        # a run's [residual] table passes unchanged; its reference compositions are the C++ ones,
        # equal to the kernels (tests/test_python_ops.py, tests/test_fused_*.cpp).
        self.options.setdefault("impl", "fused")

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k in self.OPTIONS)
        return f"d_model={self.d_model}, n_branches={self.n_branches}" + (f", {opts}" if opts else "")

    def check_device(self, x: Tensor):
        """A clear error where the operator library has no kernel for x's device (CUDA: only
        depth_read and depth_merge), rather than the dispatcher's."""
        if x.device.type == "cuda":
            for op in self.OPERATORS:
                if not _has_cuda_kernel(op):
                    raise RuntimeError(f"depthkit.nn.{type(self).__name__}: the operator depthkit::{op} has no CUDA "
                                       f"kernel (ops/cuda/ has depth_read and depth_merge); run residual kind "
                                       f"'{self.kind}' on the CPU")

    def forward(self, x: Tensor, branches: Sequence[Callable[[Tensor], Tensor]]) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"depthkit.nn.{type(self).__name__}: x must be [B, T, d_model = {self.d_model}], "
                             f"got {list(x.shape)}")
        if len(branches) != self.n_branches:
            raise ValueError(f"depthkit.nn.{type(self).__name__}: {len(branches)} branches given, the pathway "
                             f"was made for n_branches = {self.n_branches}")
        self.check_device(x)
        state = self.begin(x)
        for l, branch in enumerate(branches, start=1):
            self.write(state, l, branch(self.read(state, l)))
        return self.finish(state)

    # The loop's steps, defined by each kind.
    def begin(self, x: Tensor):
        raise NotImplementedError

    def read(self, state, l: int) -> Tensor:
        raise NotImplementedError

    def write(self, state, l: int, out: Tensor) -> None:
        raise NotImplementedError

    def finish(self, state) -> Tensor:
        raise NotImplementedError


def normal_(p: Tensor, std: float):
    with torch.no_grad():
        return p.normal_(0.0, std)


def constant_(p: Tensor, value: float):
    with torch.no_grad():
        return p.fill_(value)


def identity_(p: Tensor):
    with torch.no_grad():
        p.zero_()
        return p.diagonal().fill_(1.0)


def dar_gate_std(d_model: int, logit_std: float) -> float:
    """DAR's gate weights: normal(0, logit_std / √(2d)), so that the gate logits on the unit-RMS
    input h̄ (2d features) have standard deviation logit_std at any width (docs/design.md, "DAR")."""
    return logit_std / math.sqrt(2.0 * d_model)
