"""Fake (meta) implementations of the depthkit operators, for FakeTensor, torch.compile and
torch.export: each computes its operator's outputs' shapes, dtypes and devices from the inputs'
alone, and makes the same argument checks as the operator's CPU kernel (src/depthkit/ops/cpu/),
with the same one-line messages, so that a bad call fails the same way while tracing as when it
runs. One `_<op>` function per operator, registered with torch.library.register_fake.

Conventions the kernels keep and these mirror:
- Accumulation dtype ("acc"): float64 for float64 inputs, float32 otherwise (bfloat16 storage is
  read in float32). Log-partitions ζ, inverse RMS and mHC's gate logits are kept in it.
- Every output is a fresh contiguous tensor (the registration files copy the few outputs that
  the kernels return as views of one buffer: ops/registration.h, own_storage). The gradient of
  an absent optional input is None.
- The backward operators that add into gradient buffers (`Tensor(a!)[]`: depth_read_backward,
  dar_read_backward, msar_read_backward) return only their other outputs: a fake implementation
  of a mutating operator neither writes nor allocates the buffers it is given.

Sizes may be symbolic (torch.SymInt under dynamic shapes): they are only compared and combined,
never turned into Python ints. A check on them (through torch._check) becomes a guard of the
compiled graph, which is then reused for every size that passes it (T from 2 to the RoPE
tables' length, say) instead of being specialised to one. Checks on tensor values
(linear_cross_entropy's targets within the vocabulary) cannot run on fake tensors: the kernel
makes them when it runs.
"""
import math

import torch
from torch.library import register_fake

# at::ScalarType as the C++ messages print it (`<< t.scalar_type()`).
_SCALAR_TYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.bfloat16: "BFloat16",
                      torch.float16: "Half", torch.int64: "Long", torch.int32: "Int"}


def _shape(t):
    """Sizes as c10 prints an IntArrayRef: [2, 3]."""
    return "[" + ", ".join(str(s) for s in t) + "]"


def _dtype_name(dtype):
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def _require(ok, *message):
    """The kernel's `if (!ok) fail(message...)`: a RuntimeError with the message's parts joined."""
    torch._check(ok, lambda: "".join(str(part) for part in message))


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _same_shape(t, shape):
    return len(t.shape) == len(shape) and all(a == b for a, b in zip(t.shape, shape))


def _check_gradient_buffers(what, buffers, count, shape, dtype):
    """kernel_math.h, check_gradient_buffers: the buffers a backward kernel adds into."""
    _require(len(buffers) == count, what, ": ", len(buffers), " buffers for ", count, " sources")
    for b in buffers:
        _require(_same_shape(b, shape) and b.dtype == dtype and b.is_contiguous(), what, ": a buffer is ",
                 _shape(b.shape), " ", _dtype_name(b.dtype), ", expected contiguous ", _shape(shape), " ",
                 _dtype_name(dtype))


def _register(name):
    return register_fake(f"depthkit::{name}")


# ---- depth_read, depth_merge (DAR eq. A.1–A.10; cpu/depth_read_cpu.cpp) ---------------------------


def _check_depth_read(q, keys, values):
    _require(len(keys) > 0, "depth_read: needs at least one source")
    _require(q.dim() == 2 and keys[0].dim() == 2, "depth_read: expected queries [M, d], keys and values [P, d] each")
    _require(len(values) == len(keys), "depth_read: ", len(keys), " keys and ", len(values), " values")
    k0 = keys[0]
    for r, (k, v) in enumerate(zip(keys, values)):
        _require(_same_shape(k, k0.shape) and _same_shape(v, k0.shape), "depth_read: key/value ", r, " is ",
                 _shape(k.shape), "/", _shape(v.shape), ", source 0 ", _shape(k0.shape))
        _require(k.dtype == q.dtype and v.dtype == q.dtype, "depth_read: queries, keys and values must share a dtype")
    _require(q.shape[1] == k0.shape[1], "depth_read: queries have d = ", q.shape[1], ", keys d = ", k0.shape[1])


@_register("depth_read")
def _depth_read(queries, keys, values, eps):
    # No values: the values are the keys (AttnRes).
    _check_depth_read(queries, keys, values if len(values) else keys)
    (M, _), (P, d) = queries.shape, keys[0].shape
    k0 = keys[0]
    return k0.new_empty((M, P, d)), k0.new_empty((M, P), dtype=_acc(k0.dtype))


@_register("depth_read_backward")
def _depth_read_backward(grad_out, grad_log_partition, queries, keys, values, log_partition, eps, grad_keys,
                         grad_values):
    values_are_keys = len(values) == 0
    _check_depth_read(queries, keys, keys if values_are_keys else values)
    N, (P, d) = len(keys), keys[0].shape
    # The buffers are in ζ's dtype (the accumulation type); values that are the keys have none.
    _check_gradient_buffers("depth_read_backward: grad_keys", grad_keys, N, (P, d), log_partition.dtype)
    _check_gradient_buffers("depth_read_backward: grad_values", grad_values, 0 if values_are_keys else N, (P, d),
                            log_partition.dtype)
    return queries.new_empty(queries.shape)


@_register("depth_merge")
def _depth_merge(out, log_partition, query, key_part, value_part, eps):
    value = key_part if value_part is None else value_part
    _require(out.dim() == 2 and _same_shape(key_part, out.shape) and _same_shape(value, out.shape)
             and log_partition.dim() == 1 and log_partition.shape[0] == out.shape[0] and query.dim() == 1
             and query.shape[0] == out.shape[1],
             "depth_merge: expected out, key_part, value_part [P, d], log_partition [P], query [d]")
    _require(all(t.dtype == out.dtype for t in (query, key_part, value)),
             "depth_merge: out, query, key_part and value_part must share a dtype")
    return out.new_empty(out.shape)


@_register("depth_merge_backward")
def _depth_merge_backward(grad, out, log_partition, query, key_part, value_part, eps):
    # The kernel checks nothing here (its forward did); a value that is the key has no gradient.
    P, d = out.shape
    return (out.new_empty((P, d)), log_partition.new_empty((P,)), query.new_empty((d,)),
            out.new_empty((P, d)), None if value_part is None else out.new_empty((P, d)))



@_register("shared_source")
def _shared_source(x):
    # A copy of x (ops/shared_source.cpp): the history entry whose gradient the reads accumulate.
    return torch.empty_like(x, memory_format=torch.contiguous_format)

# ---- dar_read, dar_write (DAR eq. 10–17; cpu/dar_cpu.cpp) ---------------------------------------


def _check_dar_routing(key_stream, value_stream):
    """The routing of output stream j (DAR eq. 22): which stream gives its keys and its values."""
    _require(len(key_stream) == 2 and len(value_stream) == 2,
             "dar_read: key_stream and value_stream must name 2 streams each")
    for s in (*key_stream, *value_stream):
        _require(s in (0, 1), "dar_read: stream indices must be 0 or 1, got ", s)


def _check_dar_read(q, h0, h1, p0, p1, wa, ba, wb, bb):
    _require(len(h0) > 0 and len(h0) == len(h1),
             "dar_read: expected completed streams h0, h1 of N >= 1 entries each, got ", len(h0), " and ", len(h1))
    e0 = h0[0]
    _require(e0.dim() == 2, "dar_read: completed entries must be [P, d], got ", _shape(e0.shape))
    for n, (a, b) in enumerate(zip(h0, h1)):
        for t in (a, b):
            _require(_same_shape(t, e0.shape), "dar_read: completed entry ", n, " of h0, h1 is ", _shape(t.shape),
                     ", entry 0 of h0 ", _shape(e0.shape))
            _require(t.dtype == q.dtype, "dar_read: all inputs must share one dtype")
    P, d = e0.shape
    _require(q.dim() == 2 and q.shape[0] == 2 and q.shape[1] == d, "dar_read: queries must be [2, ", d, "], got ",
             _shape(q.shape))
    _require((p0 is None) == (p1 is None), "dar_read: give both partial streams or neither")
    if p0 is not None:
        _require(_same_shape(p0, (P, d)) and _same_shape(p1, p0.shape), "dar_read: partial streams must be [", P, ", ",
                 d, "], got ", _shape(p0.shape), " and ", _shape(p1.shape))
    for w in (wa, wb):
        _require(_same_shape(w, (2, 2 * d)), "dar_read: gate weights must be [2, ", 2 * d, "], got ", _shape(w.shape))
    for b in (ba, bb):
        _require(_same_shape(b, (2,)), "dar_read: gate biases must be [2], got ", _shape(b.shape))
    for t in (wa, ba, wb, bb) + (() if p0 is None else (p0, p1)):
        _require(t.dtype == q.dtype, "dar_read: all inputs must share one dtype")


@_register("dar_read")
def _dar_read(queries, h0, h1, p0, p1, w_alpha, b_alpha, w_beta, b_beta, key_stream, value_stream, eps):
    _check_dar_routing(key_stream, value_stream)
    _check_dar_read(queries, h0, h1, p0, p1, w_alpha, b_alpha, w_beta, b_beta)
    P, d = h0[0].shape
    # h [P, d] (eq. 15), β [P, 2] (eq. 14), ζ of both reads [2, P] in the accumulation dtype.
    return (queries.new_empty((P, d)), queries.new_empty((P, 2)),
            queries.new_empty((2, P), dtype=_acc(queries.dtype)))


@_register("dar_read_backward")
def _dar_read_backward(grad_h, grad_beta, queries, h0, h1, p0, p1, w_alpha, b_alpha, w_beta, b_beta, log_partition,
                       key_stream, value_stream, eps, grad_h0, grad_h1):
    _check_dar_routing(key_stream, value_stream)
    _check_dar_read(queries, h0, h1, p0, p1, w_alpha, b_alpha, w_beta, b_beta)
    N, (P, d) = len(h0), h0[0].shape
    acc = _acc(queries.dtype)
    _check_gradient_buffers("dar_read_backward: grad_h0", grad_h0, N, (P, d), acc)
    _check_gradient_buffers("dar_read_backward: grad_h1", grad_h1, N, (P, d), acc)
    # ∂q, ∂p0, ∂p1 (None at a block's start), ∂W_α, ∂b_α, ∂W_β, ∂b_β; the entries' are in the buffers.
    partials = (None, None) if p0 is None else (queries.new_empty((P, d)), queries.new_empty((P, d)))
    return (queries.new_empty((2, d)), *partials, queries.new_empty((2, 2 * d)), queries.new_empty((2,)),
            queries.new_empty((2, 2 * d)), queries.new_empty((2,)))


@_register("dar_write")
def _dar_write(f, beta, p0, p1, w_rho, b_rho, eps):
    _require(f.dim() == 2 and _same_shape(beta, (f.shape[0], 2)), "dar_write: expected f [P, d] and beta [P, 2], got ",
             _shape(f.shape), " and ", _shape(beta.shape))
    P, d = f.shape
    if p0 is not None:  # the transport M(ρ) of the previous partial (eq. 16–17)
        _require(p1 is not None and w_rho is not None and b_rho is not None and _same_shape(p0, f.shape)
                 and _same_shape(p1, f.shape) and _same_shape(w_rho, (1, 2 * d)) and _same_shape(b_rho, (1,)),
                 "dar_write: expected partial streams [", P, ", ", d, "], w_rho [1, ", 2 * d, "] and b_rho [1]")
    for t in (beta, p0, p1, w_rho, b_rho):
        _require(t is None or t.dtype == f.dtype, "dar_write: all inputs must share one dtype")
    return f.new_empty((P, d)), f.new_empty((P, d))


@_register("dar_write_backward")
def _dar_write_backward(grad0, grad1, f, beta, p0, p1, w_rho, b_rho, eps):
    # The kernel checks nothing here (its forward did). At a block's start (no partial) only f and
    # β have gradients.
    P, d = f.shape
    if p0 is None:
        return f.new_empty((P, d)), f.new_empty((P, 2)), None, None, None, None
    return (f.new_empty((P, d)), f.new_empty((P, 2)), f.new_empty((P, d)), f.new_empty((P, d)),
            f.new_empty((1, 2 * d)), f.new_empty((1,)))


# ---- msar_read, msar_fuse (MSAR eq. 9–17; cpu/msar_cpu.cpp) -------------------------------------


def _check_kernel_lengths(lengths, L, K, op):
    """causal_window.h, kernel_lengths: each of the m − 1 kernels' length κ_r within the padded K."""
    if lengths is None:
        return
    _require(len(lengths) == L, op, ": kernel_lengths has ", len(lengths),
             " entries, expected one per convolved stream (m - 1 = ", L, ")")
    for r, length in enumerate(lengths):
        _require(1 <= length and length <= K, op, ": kernel_lengths[", r, "] = ", length, " is outside 1 ... K = ", K,
                 " (the padded kernel)")


def _check_msar_read(queries, x, c, lengths):
    """queries: the list of msar_block_read ([queries] for msar_read)."""
    _require(len(queries) > 0, "msar_read: needs at least one query tensor")
    _require(len(x) > 0, "msar_read: needs at least one source")
    q = queries[0]
    _require(q.dim() == 2 and x[0].dim() == 3, "msar_read: expected queries [m, d], sources [B, T, d] each")
    m, d = q.shape
    _require(m >= 1, "msar_read: needs at least one stream")
    for j, qj in enumerate(queries[1:], 1):
        _require(_same_shape(qj, q.shape), "msar_read: queries ", j, " are ", _shape(qj.shape), ", queries 0 ",
                 _shape(q.shape))
        _require(qj.dtype == q.dtype, "msar_read: every queries tensor must share a dtype")
    _require(x[0].shape[2] == d, "msar_read: queries have d = ", d, ", sources d = ", x[0].shape[2])
    _require(len(c) == len(x), "msar_read: ", len(x), " sources and ", len(c), " banks (conv)")
    for n, (xn, cn) in enumerate(zip(x, c)):
        _require(_same_shape(xn, x[0].shape), "msar_read: source ", n, " is ", _shape(xn.shape), ", source 0 ",
                 _shape(x[0].shape))
        _require(cn.dim() == 3 and cn.shape[0] == m - 1 and cn.shape[1] == d and cn.shape[2] >= 1
                 and _same_shape(cn, c[0].shape), "msar_read: conv ", n, " is ", _shape(cn.shape),
                 ", expected [m - 1, d, K] = [", m - 1, ", ", d, ", K >= 1] as conv 0")
        _require(xn.dtype == q.dtype and cn.dtype == q.dtype, "msar_read: queries, sources and conv must share a dtype")
    # Banks padded to the longest kernel K (MSAR Appendix C: κ = {4, 8, 12} padded to 12).
    _check_kernel_lengths(lengths, c[0].shape[0], c[0].shape[2], "msar_read")


@_register("msar_read")
def _msar_read(queries, sources, conv, eps, kernel_lengths=None, context=0):
    outs, lses = _msar_block_read([queries], sources, conv, eps, kernel_lengths, context)
    return outs[0], lses[0]


@_register("msar_block_read")
def _msar_block_read(queries, sources, conv, eps, kernel_lengths=None, context=0):
    _check_msar_read(queries, sources, conv, kernel_lengths)
    m = queries[0].shape[0]
    B, T, d = sources[0].shape
    _require(0 <= context and context < T, "msar_read: context = ", context, " must leave a position of the sources' T = ",
             T, " (0 <= context < T)")
    # Per queries tensor, the m streams' reads (eq. 11–12) of the positions after the context (the
    # windows' rows): out [m, B, T − context, d], ζ [m, B, T − context] in the accumulation dtype.
    return ([sources[0].new_empty((m, B, T - context, d)) for _ in queries],
            [sources[0].new_empty((m, B, T - context), dtype=_acc(queries[0].dtype)) for _ in queries])


@_register("msar_read_backward")
def _msar_read_backward(grad_out, grad_log_partition, queries, sources, conv, log_partition, eps, kernel_lengths,
                        grad_sources):
    _, gc = _msar_block_read_backward([grad_out], [grad_log_partition], [queries], sources, conv, [log_partition],
                                       eps, kernel_lengths, grad_sources)
    return queries.new_empty(queries.shape), gc


@_register("msar_block_read_backward")
def _msar_block_read_backward(grad_out, grad_log_partition, queries, sources, conv, log_partition, eps, kernel_lengths,
                              grad_sources):
    _check_msar_read(queries, sources, conv, kernel_lengths)
    S = len(queries)
    _require(len(grad_out) == S and len(grad_log_partition) == S and len(log_partition) == S, "msar_read_backward: ", S,
             " queries, ", len(grad_out), " grad_out, ", len(grad_log_partition), " grad_log_partition and ",
             len(log_partition), " log_partition")
    m = queries[0].shape[0]
    B, T, d = sources[0].shape
    for j, lse in enumerate(log_partition):
        _require(_same_shape(lse, (m, B, T)), "msar_read_backward: log_partition ", j, " is ", _shape(lse.shape),
                 ", expected [m, B, T] = [", m, ", ", B, ", ", T, "]")
    _check_gradient_buffers("msar_read_backward: grad_sources", grad_sources, len(sources), (B, T, d),
                            _acc(queries[0].dtype))
    # ∂q stacked [S, m, d]; the banks' gradients stacked [N, m − 1, d, K]; the sources' go into
    # the buffers.
    return queries[0].new_empty((S, *queries[0].shape)), queries[0].new_empty((len(conv), *conv[0].shape))


def _check_msar_fuse(out, lse, q, partial, partial_conv, w_pre, b_pre, alpha_pre, lengths, context=0):
    _require(out.dim() == 4 and lse.dim() == 3 and q.dim() == 2,
             "msar_fuse: expected out [m, B, T, d], log_partition [m, B, T], queries [m, d]")
    m, B, T, d = out.shape
    _require(_same_shape(lse, out.shape[:3]), "msar_fuse: log_partition ", _shape(lse.shape), " vs out ",
             _shape(out.shape))
    _require(q.shape[0] == m and q.shape[1] == d, "msar_fuse: queries ", _shape(q.shape), " vs out ", _shape(out.shape))
    _require((partial is None) == (partial_conv is None), "msar_fuse: partial and partial_conv come together")
    _require(context >= 0 and (context == 0 or partial is not None), "msar_fuse: context = ", context,
             " must be 0, or positive with a partial (its window rows)")
    if partial is not None:
        _require(_same_shape(partial, (B, context + T, d)), "msar_fuse: partial ", _shape(partial.shape),
                 " vs [B, context + T, d] of out ", _shape(out.shape), " and context = ", context)
        _require(partial_conv.dim() == 3 and partial_conv.shape[0] == m - 1 and partial_conv.shape[1] == d
                 and partial_conv.shape[2] >= 1, "msar_fuse: partial_conv ", _shape(partial_conv.shape),
                 " does not match [m - 1, d, K] = [", m - 1, ", ", d, ", K]")
    hpre = w_pre is not None
    _require(hpre == (b_pre is not None) and hpre == (alpha_pre is not None),
             "msar_fuse: w_pre, b_pre and alpha_pre come together (none of them: mean fusion)")
    if hpre:  # H_pre = σ(α Norm(flatten Z) W_preᵀ + b_pre) (eq. 13–14)
        _require(w_pre.dim() == 2 and w_pre.shape[0] == m and w_pre.shape[1] == m * d and b_pre.numel() == m
                 and alpha_pre.numel() == 1, "msar_fuse: expected w_pre [m, m d], b_pre [m], alpha_pre [1] for m = ", m,
                 ", d = ", d)
    if partial is not None:
        _check_kernel_lengths(lengths, m - 1, partial_conv.shape[2], "msar_fuse")


@_register("msar_fuse")
def _msar_fuse(out, log_partition, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, eps,
               kernel_lengths=None, context=0):
    _check_msar_fuse(out, log_partition, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, kernel_lengths,
                     context)
    _, B, T, d = out.shape
    return out.new_empty((B, T, d))


@_register("msar_fuse_backward")
def _msar_fuse_backward(grad, out, log_partition, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, eps,
                        kernel_lengths=None):
    _check_msar_fuse(out, log_partition, queries, partial, partial_conv, w_pre, b_pre, alpha_pre, kernel_lengths)
    m, _, _, d = out.shape
    # Each gradient in its input's dtype; ∂b_pre is [m] whatever b_pre's shape, ∂α_pre has α_pre's.
    part = None if partial is None else (partial.new_empty(partial.shape), partial_conv.new_empty(partial_conv.shape))
    gates = None if w_pre is None else (w_pre.new_empty((m, m * d)), b_pre.new_empty((m,)),
                                        alpha_pre.new_empty(alpha_pre.shape))
    return (out.new_empty(out.shape), log_partition.new_empty(log_partition.shape), queries.new_empty(queries.shape),
            *(part or (None, None)), *(gates or (None, None, None)))


# ---- mhc_pre, mhc_sinkhorn, mhc_merge (MSAR eq. 3–5; cpu/mhc_cpu.cpp) ------------------------------


def _check_streams(op, x):
    _require(x.dim() >= 2 and x.shape[-2] >= 1, op, ": expected streams x [*, m, d] with m ≥ 1, got ",
             _shape(x.shape))
    _require(x.dtype.is_floating_point and x.dtype != torch.float16, op, ": x must be float32, float64 or bfloat16")


def _check_mhc_pre(x, phi, bias, scale):
    _check_streams("mhc_pre", x)
    m, d = x.shape[-2:]
    n = m * m + 2 * m  # the H_pre, H_post and H_res logits
    _require(phi.dim() == 2 and phi.shape[0] == n and phi.shape[1] == m * d, "mhc_pre: phi must be [m² + 2m, md] = [",
             n, ", ", m * d, "], got ", _shape(phi.shape))
    _require(bias.dim() == 1 and bias.shape[0] == n, "mhc_pre: bias must be [", n, "], got ", _shape(bias.shape))
    _require(scale.dim() == 1 and scale.shape[0] == 3, "mhc_pre: scale must be [3] (pre, post, res), got ",
             _shape(scale.shape))
    _require(phi.dtype == x.dtype, "mhc_pre: x and phi must share a dtype")


@_register("mhc_pre")
def _mhc_pre(x, phi, bias, scale, eps):
    _check_mhc_pre(x, phi, bias, scale)
    *lead, m, d = x.shape
    wide = _acc(x.dtype)
    # h [*, d] (eq. 4), H_post [*, m], the H_res logits [*, m, m] and the projection [*, m² + 2m].
    return (x.new_empty((*lead, d)), x.new_empty((*lead, m), dtype=wide), x.new_empty((*lead, m, m), dtype=wide),
            x.new_empty((*lead, m * m + 2 * m), dtype=wide))


@_register("mhc_pre_backward")
def _mhc_pre_backward(grad_h, grad_h_post, grad_res_logits, x, phi, bias, scale, proj, eps):
    _check_mhc_pre(x, phi, bias, scale)
    return x.new_empty(x.shape), phi.new_empty(phi.shape), bias.new_empty(bias.shape), scale.new_empty((3,))


def _check_square(op, logits):
    _require(logits.dim() >= 2 and logits.shape[-1] == logits.shape[-2] and logits.shape[-1] >= 1, op,
             ": expected logits [*, m, m], got ", _shape(logits.shape))
    _require(logits.dtype.is_floating_point and logits.dtype != torch.float16, op,
             ": logits must be float32, float64 or bfloat16")


@_register("mhc_sinkhorn")
def _mhc_sinkhorn(logits, iters):
    _check_square("mhc_sinkhorn", logits)
    _require(iters >= 0, "mhc_sinkhorn: iters must be ≥ 0, got ", iters)
    # The doubly stochastic H_res in the accumulation dtype.
    return logits.new_empty(logits.shape, dtype=_acc(logits.dtype))


@_register("mhc_sinkhorn_backward")
def _mhc_sinkhorn_backward(grad, logits, iters):
    _check_square("mhc_sinkhorn_backward", logits)
    _require(_same_shape(grad, logits.shape), "mhc_sinkhorn_backward: grad ", _shape(grad.shape), " and logits ",
             _shape(logits.shape), " differ")
    return logits.new_empty(logits.shape)


def _check_mhc_merge(x, f, h_post, h_res):
    _check_streams("mhc_merge", x)
    *lead, m, d = x.shape
    for name, t, shape in (("f", f, (*lead, d)), ("h_post", h_post, (*lead, m)), ("h_res", h_res, (*lead, m, m))):
        _require(_same_shape(t, shape), "mhc_merge: ", name, " must be ", _shape(shape), ", got ", _shape(t.shape))
    _require(f.dtype == x.dtype, "mhc_merge: x and f must share a dtype")


@_register("mhc_merge")
def _mhc_merge(x, f, h_post, h_res):
    _check_mhc_merge(x, f, h_post, h_res)
    return x.new_empty(x.shape)  # x'_j = H_post[j] f + Σ_i H_res[i, j] x_i (eq. 5)


@_register("mhc_merge_backward")
def _mhc_merge_backward(grad, x, f, h_post, h_res):
    _check_mhc_merge(x, f, h_post, h_res)
    _require(_same_shape(grad, x.shape), "mhc_merge_backward: grad ", _shape(grad.shape), " and x ", _shape(x.shape),
             " differ")
    return x.new_empty(x.shape), f.new_empty(f.shape), h_post.new_empty(h_post.shape), h_res.new_empty(h_res.shape)


# ---- rms_norm, rope_qkv, swiglu, linear_cross_entropy (cpu/backbone_cpu.cpp, backbone_ops.cpp) ----


def _last_dim(t):
    """The features; the kernels' t.size(-1), which a 0-dim tensor refuses with c10's IndexError."""
    if t.dim() == 0:
        raise IndexError("dimension specified as -1 but tensor has no dimensions")
    return t.shape[-1]


def _rows(op, t):
    """rows_of: the rows of a tensor whose last dimension (at least one) is the features."""
    _require(t.dim() >= 1 and t.shape[-1] != 0, op, ": the last dimension of ", _shape(t.shape), " is empty")
    return math.prod(t.shape[:-1])


@_register("rms_norm")
def _rms_norm(x, weight, eps):
    _require(weight.dim() == 1 and _last_dim(x) == weight.shape[0], "rms_norm: weight ",
             _shape(weight.shape), " does not match input ", _shape(x.shape))
    _require(x.dtype == weight.dtype, "rms_norm: input and weight must share a dtype")
    rows = _rows("rms_norm", x)
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=_acc(x.dtype))  # y, and 1/rms of each row


@_register("rms_norm_backward")
def _rms_norm_backward(grad, x, weight, inv_rms):
    _require(_same_shape(grad, x.shape), "rms_norm_backward: gradient ", _shape(grad.shape), " does not match input ",
             _shape(x.shape))
    _rows("rms_norm_backward", x)
    return x.new_empty(x.shape), weight.new_empty((x.shape[-1],))


def _check_rope_tables(cos, sin, T, head_dim, offset):
    _require(cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous(),
             "rope_qkv: the cos and sin tables must be contiguous float32")
    _require(cos.dim() == 2 and _same_shape(sin, cos.shape) and cos.shape[1] * 2 == head_dim, "rope_qkv: tables ",
             _shape(cos.shape), " do not match head_dim ", head_dim)
    _require(offset >= 0 and offset + T <= cos.shape[0], "rope_qkv: positions ", offset, " … ", offset + T - 1,
             " exceed the tables' ", cos.shape[0])


@_register("rope_qkv")
def _rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, offset):
    heads = n_heads + 2 * n_kv_heads  # q, then k, then v heads of the fused projection
    _require(qkv.dim() == 3 and n_heads >= 1 and n_kv_heads >= 1 and qkv.shape[2] % heads == 0,
             "rope_qkv: expected qkv [B, T, (H + 2 KV) · head_dim], got ", _shape(qkv.shape), " for H = ", n_heads,
             ", KV = ", n_kv_heads)
    B, T, C = qkv.shape
    hd = C // heads
    _require(hd % 2 == 0, "rope_qkv: head_dim ", hd, " is odd")  # rotate-half pairs i with i + hd/2
    _check_rope_tables(cos, sin, T, hd, offset)
    kv = (B, T, n_kv_heads, hd)
    return qkv.new_empty((B, T, n_heads, hd)), qkv.new_empty(kv), qkv.new_empty(kv)


@_register("rope_qkv_backward")
def _rope_qkv_backward(grad_q, grad_k, grad_v, cos, sin, n_heads, n_kv_heads, offset):
    given = next((g for g in (grad_q, grad_k, grad_v) if g is not None), None)
    _require(given is not None, "rope_qkv_backward: no gradient given")
    B, T, hd = given.shape[0], given.shape[1], given.shape[3]
    _check_rope_tables(cos, sin, T, hd, offset)
    for g, heads in ((grad_q, n_heads), (grad_k, n_kv_heads), (grad_v, n_kv_heads)):
        if g is not None:
            _require(_same_shape(g, (B, T, heads, hd)), "rope_qkv_backward: gradient of shape ", _shape(g.shape))
    return given.new_empty((B, T, (n_heads + 2 * n_kv_heads) * hd))


@_register("swiglu")
def _swiglu(gate_up):
    _require(gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0, "swiglu: expected gate_up [..., 2F], got ",
             _shape(gate_up.shape))
    _rows("swiglu", gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))  # silu(gate) ⊙ up


@_register("swiglu_backward")
def _swiglu_backward(grad, gate_up):
    F = _last_dim(gate_up) // 2
    rows = _rows("swiglu_backward", gate_up)
    _require(grad.numel() == rows * F, "swiglu_backward: gradient ", _shape(grad.shape), " does not match ",
             _shape(gate_up.shape))
    return gate_up.new_empty(gate_up.shape)


def _check_linear_cross_entropy(hidden, weight, targets):
    _require(hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1],
             "linear_cross_entropy: expected hidden [N, d] and weight [V, d], got ", _shape(hidden.shape), " and ",
             _shape(weight.shape))
    _require(hidden.dtype == weight.dtype, "linear_cross_entropy: hidden and weight must share a dtype")
    N = hidden.shape[0]
    _require(targets.dim() == 1 and targets.shape[0] == N and targets.dtype == torch.int64,
             "linear_cross_entropy: expected int64 targets [", N, "], got ", _shape(targets.shape))
    _require(N != 0, "linear_cross_entropy: no tokens")
    # (Targets outside [0, V) are a check on values: the kernel makes it when it runs.)


@_register("linear_cross_entropy")
def _linear_cross_entropy(hidden, weight, targets):
    _check_linear_cross_entropy(hidden, weight, targets)
    return hidden.new_empty((), dtype=_acc(hidden.dtype))  # the mean loss, in the accumulation dtype


@_register("linear_cross_entropy_backward")
def _linear_cross_entropy_backward(hidden, weight, targets):
    _check_linear_cross_entropy(hidden, weight, targets)
    acc = _acc(hidden.dtype)
    # (loss, ∂hidden, ∂weight) for a unit upstream gradient, all in the accumulation dtype.
    return hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape, dtype=acc), weight.new_empty(weight.shape,
                                                                                                       dtype=acc)
