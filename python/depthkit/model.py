"""A depthkit run as a torch module: `depthkit.load(run_dir_or_checkpoint)`.

The backbone is src/depthkit/model's, term for term (docs/design.md, "The backbone"):

    h_1 = Embedding(tokens)
    branches ℓ = 1 … 2L: odd ℓ the attention of layer (ℓ−1)/2, even ℓ its feed-forward, each with
    its own input RMSNorm; the pathway (depthkit.nn) reads each branch's input and takes its output
    logits = W_head · RMSNorm(h_out)

with the same fused operators where the C++ model runs them (model.impl = "fused"):
torch.ops.depthkit.rms_norm for every RMSNorm, rope_qkv on the stacked q/k/v product, swiglu on
the stacked gate/up product of the dense feed-forward; "reference" runs their ATen compositions,
as the C++ model does. The sparse feed-forward is src/depthkit/model/moe.cpp's: the router table
of router.cpp, stable top-k by logit, dispatch sorted by expert, shared experts, leading dense
layers. Parameter names are the checkpoint's (model.safetensors), so state_dict() round-trips.
"""
import json
import math
import pathlib
import struct
import sys
import tomllib

import torch
import torch.nn.functional as F

from .nn import KINDS as PATHWAY_KINDS
from .nn import make as make_pathway
from .tokenizer import Tokenizer

# The keys the model reads, with config.h's defaults (a state.json from before a key existed
# resolves it as the C++ loader would).
MODEL_DEFAULTS = {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0, "d_ff": 384,
                  "vocab_size": 4096, "seq_len": 256, "tie_embeddings": False, "rope_theta": 10000.0,
                  "norm_eps": 1e-5, "init_std": 0.02, "impl": "fused"}
MOE_DEFAULTS = {"n_experts": 0, "top_k": 2, "expert_d_ff": 0, "n_shared_experts": 0, "shared_d_ff": 0,
                "leading_dense_layers": 0, "router": "softmax_topk", "renormalize": False, "aux_loss_coef": 0.01,
                "z_loss_coef": 0.0, "expert_impl": "auto"}
RESIDUAL_DEFAULTS = {"kind": "residual", "block_sublayers": 2, "share_within_block": False, "routing": "cross",
                     "streams": 4, "kernels": [4, 8, 12], "conv": True, "conv_init": "zeros", "fusion": "hpre", "sinkhorn_iters": 20,
                     "impl": "fused"}
DATA_DEFAULTS = {"dir": "data/pydoc"}

# src/depthkit/model/router.cpp's table, in its order (the pathway kinds are depthkit.nn.KINDS).
ROUTERS = ("softmax_topk", "sigmoid_topk")
DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


def dtype_of(value, what):
    """A torch dtype from a dtype or its name ("float32", "float64", "bfloat16"); None stays None."""
    if value is None or value in DTYPES:
        return value
    for dtype, name in DTYPES.items():
        if value == name:
            return dtype
    raise ValueError(f"{what} {value}: depthkit models run in float32, float64 or bfloat16")


# ---- the backbone's operators: fused where the library has the device's kernel ---------------------


def fused_available(op, device_type):
    """Whether torch.ops.depthkit.<op> and its backward have a kernel for `device_type` (the C++
    model's has_fused_kernel, ops/kernel_choice.cpp): otherwise its ATen composition runs."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    registered, has = torch._C._dispatch_has_kernel, torch._C._dispatch_has_kernel_for_dispatch_key
    name, backward = f"depthkit::{op}", f"depthkit::{op}_backward"
    if key is None or not registered(name) or not has(name, key):
        return False
    return not registered(backward) or has(backward, key)


class BackboneOps:
    """rms_norm, rope_qkv and swiglu as model.impl chooses (ops/reference/backbone.cpp for the
    compositions). The choice per device type is made once, outside any traced code."""

    OPS = ("rms_norm", "rope_qkv", "swiglu")

    def __init__(self, impl):
        self.fused = {dev: {op: impl == "fused" and fused_available(op, dev) for op in self.OPS}
                      for dev in ("cpu", "cuda")}

    def _use(self, op, x):
        return self.fused.get(x.device.type, {}).get(op, False)

    def rms_norm(self, x, weight, eps):
        w = weight.to(x.dtype)  # the C++ model's cast_like(weight, x)
        if self._use("rms_norm", x):
            return torch.ops.depthkit.rms_norm(x, w, eps)[0]  # (y, 1/rms): the second is for its backward
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def rope_qkv(self, qkv, cos, sin, n_heads, n_kv_heads):
        """q, k rotated (rotate-half: dimension i pairs with i + hd/2) and v, each [B, T, heads, hd]."""
        if self._use("rope_qkv", qkv):
            return torch.ops.depthkit.rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, 0)
        B, T = qkv.shape[0], qkv.shape[1]
        hd = qkv.shape[2] // (n_heads + 2 * n_kv_heads)
        half = hd // 2
        c = cos[:T].to(qkv.dtype).unsqueeze(1)  # [T, 1, hd/2], broadcast over heads
        s = sin[:T].to(qkv.dtype).unsqueeze(1)

        def rotate(x):
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

        q = qkv[..., : n_heads * hd].view(B, T, n_heads, hd)
        k = qkv[..., n_heads * hd: (n_heads + n_kv_heads) * hd].view(B, T, n_kv_heads, hd)
        v = qkv[..., (n_heads + n_kv_heads) * hd:].reshape(B, T, n_kv_heads, hd)
        return rotate(q), rotate(k), v

    def swiglu(self, gate_up):
        """silu(gate) ⊙ up, gate the first half of the last axis."""
        if self._use("swiglu", gate_up):
            return torch.ops.depthkit.swiglu(gate_up)
        f = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :f]) * gate_up[..., f:]


class Rope(torch.nn.Module):
    """The RoPE tables (layers.cpp, Rope): θ_i = theta^(−2i/hd), angles t·θ_i computed in float64
    and kept in float32 whatever the model's dtype, as the C++ model keeps them."""

    def __init__(self, head_dim, max_len, theta):
        super().__init__()
        i = torch.arange(head_dim // 2, dtype=torch.float64)
        inv_freq = torch.exp(i * (-2.0 * math.log(theta) / head_dim))
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .double() / .half() must not convert the tables: the fused kernel reads them
        # as float32, and the C++ model rotates with float32 tables in every precision.
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos = cos.to(device=self.cos.device, dtype=torch.float32)
        self.sin = sin.to(device=self.sin.device, dtype=torch.float32)
        return self


def _param(*shape):
    # Uninitialised: every parameter is overwritten by the checkpoint's tensor (load()).
    return torch.nn.Parameter(torch.empty(*shape))


class Attention(torch.nn.Module):
    """f_attn(h) = W_o · Attn(RoPE(W_q x), RoPE(W_k x), W_v x), x = RMSNorm(h): grouped-query,
    causal, no biases (layers.cpp, Attention::forward)."""

    def __init__(self, m, ops, rope):
        super().__init__()
        d, hd = m["d_model"], resolved_head_dim(m)
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = m["n_heads"], m["n_kv_heads"], hd, m["norm_eps"]
        self.norm = _param(d)
        self.wq = _param(self.n_heads * hd, d)
        self.wk = _param(self.n_kv_heads * hd, d)
        self.wv = _param(self.n_kv_heads * hd, d)
        self.wo = _param(d, self.n_heads * hd)
        self.ops = ops
        object.__setattr__(self, "rope", rope)  # the model's tables, not registered here a second time

    def forward(self, h):
        B, T = h.shape[0], h.shape[1]
        x = self.ops.rms_norm(h, self.norm, self.eps)
        # One product for q, k and v, as the C++ model stacks them: the same rounding as its logits.
        qkv = F.linear(x, torch.cat([self.wq, self.wk, self.wv]).to(x.dtype))
        q, k, v = self.ops.rope_qkv(qkv, self.rope.cos, self.rope.sin, self.n_heads, self.n_kv_heads)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return F.linear(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), self.wo.to(o.dtype))


class FeedForward(torch.nn.Module):
    """f_ffn(h) = W_down (silu(W_gate x) ⊙ W_up x), x = RMSNorm(h) (layers.cpp, FeedForward)."""

    def __init__(self, m, ops):
        super().__init__()
        d, f = m["d_model"], m["d_ff"]
        self.eps = m["norm_eps"]
        self.norm = _param(d)
        self.w_gate = _param(f, d)
        self.w_up = _param(f, d)
        self.w_down = _param(d, f)
        self.ops = ops

    def forward(self, h):
        x = self.ops.rms_norm(h, self.norm, self.eps)
        gated = self.ops.swiglu(F.linear(x, torch.cat([self.w_gate, self.w_up]).to(x.dtype)))
        return F.linear(gated, self.w_down.to(gated.dtype))


def grouped_unsupported(device_type, dtype, d_model, expert_d_ff):
    """Why at::_grouped_mm cannot run the experts here; "" when it can (config.cpp,
    grouped_experts_unsupported): its CPU kernel takes float32 or bfloat16 rows of a multiple of
    16 bytes, and the C++ model runs other devices on the loop."""
    if device_type != "cpu":
        return f"at::_grouped_mm runs the experts on the CPU only, and the device is {device_type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"at::_grouped_mm takes float32 or bfloat16, not {DTYPES.get(dtype, str(dtype))}"
    size = 4 if dtype == torch.float32 else 2
    if (d_model * size) % 16 or (expert_d_ff * size) % 16:
        return (f"at::_grouped_mm needs rows of a multiple of 16 bytes: model.d_model ({d_model}) and "
                f"moe.expert_d_ff ({expert_d_ff}) multiples of {16 // size} in {DTYPES[dtype]}")
    return ""


class MoeFeedForward(torch.nn.Module):
    """The sparse feed-forward branch (moe.cpp): RMSNorm, the router (router.cpp's table), each token
    through its top_k routed experts weighted by their gates, plus the shared experts (one SwiGLU of
    width n_shared · shared_d_ff, exactly the sum of n_shared experts: SwiGLU is per hidden unit)."""

    def __init__(self, m, ops):
        super().__init__()
        moe, d = m["moe"], m["d_model"]
        E, f = moe["n_experts"], moe["expert_d_ff"]
        self.E, self.k, self.eps = E, moe["top_k"], m["norm_eps"]
        self.router_name, self.renormalize, self.expert_impl = moe["router"], moe["renormalize"], moe["expert_impl"]
        self.norm = _param(d)
        self.router = _param(E, d)
        self.experts = torch.nn.Module()
        self.experts.w_gate = _param(E, f, d)
        self.experts.w_up = _param(E, f, d)
        self.experts.w_down = _param(E, d, f)
        if moe["n_shared_experts"] > 0:
            fs = moe["n_shared_experts"] * (moe["shared_d_ff"] or f)
            self.shared = torch.nn.Module()
            self.shared.w_gate = _param(fs, d)
            self.shared.w_up = _param(fs, d)
            self.shared.w_down = _param(d, fs)
        else:
            self.shared = None
        self.ops = ops

    def route(self, x):
        """(experts [N, k], gates [N, k]). softmax_topk (Switch, GShard, DeepSeekMoE): p = softmax(W_r x),
        gates the selected p_e. sigmoid_topk (DeepSeek-V3 §2.1.2, eqs. 13–15): s_e = σ(W_r x)_e, gates
        the selected s_e. Either divided by their sum when moe.renormalize. The k experts are those of
        largest logit by a stable descending sort: equal logits go to the lower index, and σ's
        rounding to equal values in float32 (logits above ~17) cannot reorder them."""
        logits = F.linear(x.to(self.router.dtype), self.router)
        scores = torch.softmax(logits, -1) if self.router_name == "softmax_topk" else torch.sigmoid(logits)
        experts = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices[:, : self.k]
        gates = scores.gather(-1, experts)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates

    def uses_grouped(self, x):
        if self.expert_impl == "loop":
            return False
        why = grouped_unsupported(x.device.type, x.dtype, x.shape[-1], self.experts.w_gate.shape[1])
        if self.expert_impl == "grouped" and why:
            raise ValueError(f"key 'moe.expert_impl' is \"grouped\", but {why}; use \"auto\" or \"loop\"")
        return not why and hasattr(torch, "_grouped_mm")

    def forward(self, h):
        d = h.shape[-1]
        x = self.ops.rms_norm(h, self.norm, self.eps).reshape(-1, d)
        experts, gates = self.route(x)
        wg, wu, wd = (w.to(x.dtype) for w in (self.experts.w_gate, self.experts.w_up, self.experts.w_down))
        if torch.compiler.is_compiling():
            y = self._dense(x, experts, gates, wg, wu, wd)
        else:
            y = self._dispatched(x, experts, gates, wg, wu, wd)
        if self.shared is not None:
            a = F.silu(F.linear(x, self.shared.w_gate.to(x.dtype))) * F.linear(x, self.shared.w_up.to(x.dtype))
            y = y + F.linear(a, self.shared.w_down.to(a.dtype))
        return y.view(h.shape)

    def _dispatched(self, x, experts, gates, wg, wu, wd):
        """moe.cpp's dispatch: the N·k (token, expert) assignments sorted by expert (stable: by token
        within one), each expert's contiguous slice through its SwiGLU (at::_grouped_mm, or one
        product per expert), each copy weighted by its gate and added back to its token."""
        N, d = x.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = torch.div(order, self.k, rounding_mode="floor")
        counts = torch.bincount(flat, minlength=self.E)
        xs = x.index_select(0, token_of)
        if self.uses_grouped(x):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            a = F.silu(torch._grouped_mm(xs, wg.transpose(1, 2), offs)) * torch._grouped_mm(xs, wu.transpose(1, 2), offs)
            ys = torch._grouped_mm(a, wd.transpose(1, 2), offs)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n == 0:
                    continue
                xe = xs[start:start + n]
                parts.append((F.silu(xe @ wg[e].t()) * (xe @ wu[e].t())) @ wd[e].t())
                start += n
            ys = torch.cat(parts) if parts else xs[:0]
        gate_sorted = gates.reshape(-1).index_select(0, order).to(ys.dtype)
        return torch.zeros(N, d, dtype=ys.dtype, device=ys.device).index_add(0, token_of, ys * gate_sorted.unsqueeze(1))

    def _dense(self, x, experts, gates, wg, wu, wd):
        """The same sum, Σ_e g_e(x) · SwiGLU_e(x) over the selected experts, with shapes that do not
        depend on the routing, for torch.compile(fullgraph=True): every expert runs on every token and
        the unselected ones are weighted by 0 (E / top_k times the experts' products; the dispatch's
        slices have data-dependent sizes, and at::_grouped_mm's fake implementation takes bfloat16 only)."""
        weight = torch.zeros(x.shape[0], self.E, dtype=x.dtype, device=x.device).scatter(1, experts, gates.to(x.dtype))
        a = F.silu(torch.einsum("nd,efd->enf", x, wg)) * torch.einsum("nd,efd->enf", x, wu)
        ys = torch.einsum("enf,edf->end", a, wd)
        return (ys * weight.t().unsqueeze(-1)).sum(0)


class Layer(torch.nn.Module):
    def __init__(self, attention, feed_forward):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward


def resolved_head_dim(m):
    return m["head_dim"] or m["d_model"] // m["n_heads"]


class DepthkitModel(torch.nn.Module):
    """The depthkit Transformer of a resolved config (the dict of a checkpoint's state.json):
    model(tokens [B, T] long) -> logits [B, T, vocab_size]. Parameters are left uninitialised: load()
    fills them from a checkpoint (or load_state_dict from one of your own)."""

    def __init__(self, config):
        super().__init__()
        m = dict(config["model"])
        m["moe"] = config["moe"]
        r = dict(config["residual"])
        d, V, L = m["d_model"], m["vocab_size"], m["n_layers"]
        self.seq_len, self.vocab_size, self.eps = m["seq_len"], V, m["norm_eps"]
        self.ops = BackboneOps(m["impl"])
        self.rope = Rope(resolved_head_dim(m), m["seq_len"], m["rope_theta"])
        self.embedding = _param(V, d)
        moe = config["moe"]
        self.layers = torch.nn.ModuleList(
            Layer(Attention(m, self.ops, self.rope),
                  MoeFeedForward(m, self.ops) if moe["n_experts"] > 0 and i >= moe["leading_dense_layers"]
                  else FeedForward(m, self.ops))
            for i in range(L))
        kind = r.pop("kind")
        self.residual = make_pathway(kind, d, 2 * L, **r)
        self.final_norm = _param(d)
        self.tie_embeddings = bool(m["tie_embeddings"])
        if not self.tie_embeddings:
            self.lm_head = _param(V, d)
        # Branch ℓ = branches[ℓ−1]: odd ℓ the attention of layer (ℓ−1)/2, even ℓ its feed-forward. A
        # plain list: the modules are registered once, under layers.
        object.__setattr__(self, "branches", [b for layer in self.layers for b in (layer.attention, layer.feed_forward)])
        self.config = config
        self.compute_dtype = None  # None: the parameters' dtype; torch.bfloat16 over float32 ones: mixed precision
        self.checkpoint, self.step = None, None
        self._tokenizer, self._tokenizer_missing = None, "no tokenizer was given to this model"

    def forward(self, tokens):
        """logits [B, T, V] of tokens [B, T] (Transformer::logits)."""
        return self.head(self.hidden(tokens))

    def hidden(self, tokens):
        """RMSNorm(h_out) [B, T, d] in the compute dtype: the head's input (Transformer::hidden)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, T], got a tensor of shape {list(tokens.shape)}")
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds model.seq_len {self.seq_len}")
        if not torch.compiler.is_compiling() and tokens.numel():
            top, low = int(tokens.max()), int(tokens.min())
            if top >= self.vocab_size or low < 0:
                raise ValueError(f"token id {top if top >= self.vocab_size else low} is outside 0 … "
                                 f"model.vocab_size - 1 ({self.vocab_size - 1})")
        # The looked-up rows are cast to the compute dtype; every branch and the pathway then cast
        # their parameters to the activations' dtype (the C++ model's cast_like, nn/precision.h).
        x = F.embedding(tokens, self.embedding)
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        return self.ops.rms_norm(self.residual(x, self.branches), self.final_norm, self.eps)

    @property
    def head_weight(self):
        """W_head [V, d]: lm_head, or the embedding when model.tie_embeddings."""
        return self.embedding if self.tie_embeddings else self.lm_head

    def head(self, h):
        """The logits of hidden states: the product in the compute dtype, the logits in the parameters'
        dtype (Transformer::head); bfloat16 parameters give float32 logits."""
        w = self.head_weight
        logits = F.linear(h, w.to(h.dtype)).to(w.dtype)
        return logits.float() if logits.dtype == torch.bfloat16 else logits

    @property
    def tokenizer(self):
        """The run's tokenizer (depthkit.tokenizer.Tokenizer): encode, decode, eos_id, vocab_size."""
        if self._tokenizer is None:
            raise FileNotFoundError(self._tokenizer_missing)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value):
        object.__setattr__(self, "_tokenizer", value)


# ---- reading a checkpoint ---------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20


def read_safetensors(path):
    """{name: tensor} of a safetensors file (8-byte little-endian header length, JSON header of
    dtype, shape and data_offsets per tensor, then the data), checked as io/safetensors.cpp checks it."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    if sys.byteorder != "little":
        raise ValueError(f"{path}: safetensors data is little-endian, this machine is not")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: header of {n} bytes does not fit the file's {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: header is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        header.pop("__metadata__", None)
        base, out = 8 + n, {}
        for name, e in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]
                              if isinstance(kv[1], dict) else 0):
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
                raise ValueError(f"{path}: tensor '{name}' lacks dtype, shape or data_offsets")
            dtype = SAFETENSORS_DTYPES.get(e["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {e['dtype']!r}")
            shape, (a, b) = e["shape"], e["data_offsets"]
            if not all(isinstance(s, int) and s >= 0 for s in shape) or not 0 <= a <= b <= size - base:
                raise ValueError(f"{path}: tensor '{name}' has shape {shape} and data_offsets {[a, b]} outside the file")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if b - a != nbytes:
                raise ValueError(f"{path}: tensor '{name}': shape and dtype need {nbytes} bytes but data_offsets give {b - a}")
            f.seek(base + a)
            buf = bytearray(f.read(nbytes))
            out[name] = torch.frombuffer(buf, dtype=dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return out


def resolve_checkpoint(path):
    """The checkpoint folder of `path`: a checkpoint folder (it holds state.json), or a run directory
    (the folder its checkpoints/latest names), as `depthkit forward --checkpoint` resolves it."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_file() and p.name in ("state.json", "model.safetensors"):
        p = p.parent  # a file of a checkpoint folder: the folder
    if not p.is_dir():
        raise ValueError(f"{p}: not a directory (a checkpoint folder or a run directory)")
    if (p / "state.json").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"{p}: not a checkpoint (no state.json) nor a run directory with checkpoints")
    text = latest.read_bytes()[:4096].decode("utf-8", "replace").rstrip()  # a CRLF or blanks are forgiven
    if not (text.startswith("step_") and 5 < len(text) <= 23 and text[5:].isdigit() and text[5:].isascii()):
        shown = f"{len(text)} bytes" if len(text) > 40 else f"'{text}'"
        raise ValueError(f"{latest}: does not name a checkpoint (expected one line 'step_NNNNNNNN', got {shown})")
    folder = p / "checkpoints" / text
    if not folder.is_dir():
        raise FileNotFoundError(f"{latest}: names missing checkpoint '{text}'")
    return folder


def read_config(checkpoint):
    """(the resolved config as a dict, the step) from a checkpoint's state.json, with config.h's
    defaults for any key of [model], [moe], [residual], [data] it predates."""
    where = checkpoint / "state.json"
    try:
        state = json.loads(where.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{where}: not valid JSON") from None
    if not isinstance(state, dict):
        raise ValueError(f"{where}: not a JSON object")
    if not isinstance(state.get("config"), str):
        raise ValueError(f"{where}: field 'config' is missing or not a string")
    try:
        config = tomllib.loads(state["config"])
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: field 'config' is not valid TOML ({e})") from None
    for section, defaults in (("model", MODEL_DEFAULTS), ("moe", MOE_DEFAULTS), ("residual", RESIDUAL_DEFAULTS),
                              ("data", DATA_DEFAULTS)):
        config[section] = dict(defaults, **config.get(section, {}))
    check_config(config, where)
    step = state.get("step")
    return config, step if isinstance(step, int) else None


def check_config(c, where):
    """What this module cannot build is refused with one line naming the key (config.cpp's rules
    that shape the model, and the names of the pathway and router tables)."""
    m, moe, r = c["model"], c["moe"], c["residual"]

    def bad(key, why):
        raise ValueError(f"{where}: key '{key}' {why}")

    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
        if not isinstance(m[key], int) or isinstance(m[key], bool) or m[key] < 1:
            bad(f"model.{key}", f"must be a positive integer, got {m[key]!r}")
    if not isinstance(m["head_dim"], int) or m["head_dim"] < 0:
        bad("model.head_dim", f"must be a non-negative integer, got {m['head_dim']!r}")
    if r["kind"] not in PATHWAY_KINDS:
        bad("residual.kind", f"must be one of {', '.join(map(json.dumps, PATHWAY_KINDS))}, got {json.dumps(r['kind'])}")
    for key, section in (("model.impl", m), ("residual.impl", r)):
        if section["impl"] not in ("fused", "reference"):
            bad(key, f"must be one of \"fused\", \"reference\", got {json.dumps(section['impl'])}")
    if m["n_heads"] % m["n_kv_heads"]:
        bad("model.n_kv_heads", f"({m['n_kv_heads']}) must divide model.n_heads ({m['n_heads']})")
    if m["head_dim"] == 0 and m["d_model"] % m["n_heads"]:
        bad("model.head_dim", f"is unset and model.d_model ({m['d_model']}) is not a multiple of model.n_heads "
                              f"({m['n_heads']})")
    if resolved_head_dim(m) % 2:
        bad("model.head_dim", f"must be even for RoPE, got {resolved_head_dim(m)}")
    if moe["n_experts"] > 0:
        if moe["router"] not in ROUTERS:
            bad("moe.router", f"must be one of {', '.join(map(json.dumps, ROUTERS))}, got {json.dumps(moe['router'])}")
        if not 1 <= moe["top_k"] <= moe["n_experts"]:
            bad("moe.top_k", f"({moe['top_k']}) must be in 1 … moe.n_experts ({moe['n_experts']})")
        if moe["expert_d_ff"] < 1:
            bad("moe.expert_d_ff", f"must be set (>= 1) when moe.n_experts is {moe['n_experts']}")
        if moe["leading_dense_layers"] >= m["n_layers"]:
            bad("moe.leading_dense_layers", f"({moe['leading_dense_layers']}) must be less than model.n_layers "
                                            f"({m['n_layers']})")
        if moe["expert_impl"] not in ("auto", "grouped", "loop"):
            bad("moe.expert_impl", f"must be one of \"auto\", \"grouped\", \"loop\", got {json.dumps(moe['expert_impl'])}")


def _data_dir_tokenizer(data_dir):
    """The tokenizer file of a prepared data directory, as src/depthkit/data/tokenizer.cpp picks it: the
    one meta.json names, else tokenizer.json or tokenizer.model; None when there is none."""
    meta = data_dir / "meta.json"
    if meta.is_file():
        try:
            name = json.loads(meta.read_text()).get("tokenizer")
        except (ValueError, OSError, AttributeError):
            name = None
        if isinstance(name, str) and name and "/" not in name and (data_dir / name).is_file():
            return data_dir / name
    for name in ("tokenizer.json", "tokenizer.model"):
        if (data_dir / name).is_file():
            return data_dir / name
    return None


def find_tokenizer(checkpoint, config):
    """The run's tokenizer: a tokenizer.model or tokenizer.json the checkpoint folder carries, else the
    one of data.dir (data.dir as `depthkit eval` takes it: absolute, or relative to the working
    directory; then, for a run moved or loaded from elsewhere, relative to each folder above the
    checkpoint)."""
    for name in ("tokenizer.model", "tokenizer.json"):
        if (checkpoint / name).is_file():
            return checkpoint / name, None
    data_dir = pathlib.Path(config["data"]["dir"])
    tried = [data_dir]
    if not data_dir.is_absolute():
        tried += [parent / data_dir for parent in checkpoint.resolve().parents]
    for folder in tried:
        found = _data_dir_tokenizer(folder)
        if found is not None:
            return found, None
    return None, (f"{data_dir / 'tokenizer.model'}: not found, nor tokenizer.json (text is tokenized with the "
                  f"tokenizer of the data the model was trained on, prepared by `depthkit data prepare`; pass "
                  f"depthkit.load(..., tokenizer=PATH))")


def load(path, device=None, dtype=None, compute_dtype=None, tokenizer=None):
    """A depthkit run directory (its latest checkpoint) or checkpoint folder as a DepthkitModel in
    eval mode: model(tokens [B, T] long) -> logits [B, T, V], with `.tokenizer` (the run's, or the
    tokenizer.model / tokenizer.json file or prepared data directory `tokenizer` names), `.config` (the resolved
    config, a dict), `.checkpoint` and `.step`.

    dtype: the parameters' dtype, float32 (default, as `depthkit forward`), float64 or bfloat16.
    compute_dtype: the activations' dtype; None: dtype's; "trained": the run's train.dtype over
    float32 parameters, as `depthkit eval` and `generate` run a checkpoint (bfloat16 mixed precision
    for a run trained so). Logits come in the parameters' dtype (float32 for bfloat16 ones).
    device: where it runs (the CPU by default)."""
    dtype = dtype_of(dtype, "dtype") or torch.float32
    checkpoint = resolve_checkpoint(path)
    config, step = read_config(checkpoint)
    if isinstance(compute_dtype, str) and compute_dtype == "trained":
        trained = config.get("train", {}).get("dtype", "float32")
        if trained not in ("float32", "bfloat16"):
            raise ValueError(f"{checkpoint / 'state.json'}: key 'train.dtype' must be \"float32\" or \"bfloat16\", "
                             f"got {json.dumps(trained)}")
        compute_dtype = torch.bfloat16 if trained == "bfloat16" else torch.float32
    compute_dtype = dtype_of(compute_dtype, "compute_dtype")
    weights = checkpoint / "model.safetensors"
    tensors = read_safetensors(weights)
    try:
        model = DepthkitModel(config)
    except ValueError as e:  # a [residual] value depthkit.nn refuses: one line, naming the key
        raise ValueError(f"{checkpoint / 'state.json'}: {e}") from None
    ours = dict(model.named_parameters())
    for name, p in ours.items():
        if name not in tensors:
            raise ValueError(f"{weights}: missing tensor '{name}'")
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{weights}: tensor '{name}' has shape {list(t.shape)}, the model needs {list(p.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{weights}: tensor '{name}' has dtype {t.dtype}, the model needs floating point")
    for name in tensors:
        if name not in ours:
            raise ValueError(f"{weights}: unexpected tensor '{name}' (not a parameter of this model)")
    # The parameters take the file's tensors as their data: no second copy of the weights (the
    # placeholders were never written, so their pages were never touched); a parameter shared by two
    # modules is one Parameter object, and keeps being shared.
    for name, p in ours.items():
        p.data = tensors[name]
    del tensors
    model.checkpoint, model.step = checkpoint, step
    if tokenizer is not None:
        tok_path = pathlib.Path(tokenizer)
        if tok_path.is_dir():
            tok_path = _data_dir_tokenizer(tok_path) or tok_path / "tokenizer.model"
        missing = None
    else:
        tok_path, missing = find_tokenizer(checkpoint, config)
    if tok_path is not None:
        tok = Tokenizer(tok_path)
        if tok.vocab_size > model.vocab_size:
            raise ValueError(f"{tok_path}: tokenizer has {tok.vocab_size} ids, more than the model's model.vocab_size "
                             f"{model.vocab_size}")
        model.tokenizer = tok
    else:
        model._tokenizer_missing = missing
    model.to(device=device, dtype=dtype)
    model.compute_dtype = None if compute_dtype == dtype else compute_dtype
    return model.eval()


__all__ = ["DepthkitModel", "Tokenizer", "load", "read_safetensors", "resolve_checkpoint"]
