#!/usr/bin/env python3
"""The fused operators on a CUDA device: parity with the CPU kernels and read bandwidth.

    python3 bench/gpu_ops.py --lib build/libdepthkit_ops.so [--out DIR]

Parity: every operator that has a CUDA kernel runs on identical inputs on the CPU (whose kernels
the test suite holds equal to the reference compositions) and on the GPU; the forward outputs and
every input gradient (of a random weighting of the outputs) are compared: float32 within 1e-4
relative (to max(1, max |CPU value|)), float64 within 1e-10, bfloat16 within 2e-2. Operators
without a CUDA kernel are listed as such, and a CUDA kernel registered for an operator that no
case here runs (a new kernel without its check) fails the check. Bandwidth: the fused depth_read forward's bytes to move
(keys read, output and log-partition written) over its median time, against a device-to-device
copy of the keys measured in the same run. Prints one table; --out DIR also writes gpu_ops.json.
"""
import argparse
import json
import os
import sys

import torch

TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 2e-2}
EPS = 1e-6


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


def run(op, inputs, device, dtype, seed):
    """Outputs and input gradients of sum(w · outputs) for the op on `device`."""
    g = torch.Generator().manual_seed(seed)
    xs = [x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype).requires_grad_(x.is_floating_point())
          if x is not None else None for x in inputs]
    outs = op(*xs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(device)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [x for x in xs if x is not None and x.requires_grad], allow_unused=True)
    return [o.detach() for o in outs], [gr for gr in grads]


def cases(gen):
    """(name, op, inputs): the operators at small shapes with odd d, shared and separate values."""
    def r(*shape):
        return torch.randn(*shape, generator=gen)
    N, P, d, M = 5, 37, 67, 3
    ops = torch.ops.depthkit
    # depth_read takes its sources as lists (one tensor per history entry).
    yield "depth_read", lambda q, *kv: ops.depth_read(q, kv[:N], kv[N:], EPS), \
        [r(M, d)] + [r(P, d) for _ in range(2 * N)]
    yield "depth_read (values = keys)", lambda q, *k: ops.depth_read(q, k, [], EPS), [r(M, d)] + [r(P, d) for _ in range(N)]
    yield "depth_merge", lambda o, l, q, k, v: ops.depth_merge(o, l, q, k, v, EPS), \
        [r(P, d), r(P), r(d), r(P, d), r(P, d)]
    yield "depth_merge (value = key)", lambda o, l, q, k: ops.depth_merge(o, l, q, k, None, EPS), \
        [r(P, d), r(P), r(d), r(P, d)]


def registered_cuda_kernels():
    """(the depthkit operators with a CUDA kernel, those without): what the loaded library registered."""
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("depthkit::"))
    cuda = [n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(f"depthkit::{n}", "CUDA")]
    return cuda, [n for n in names if n not in cuda]


def unchecked(cuda_kernels):
    """CUDA kernels no parity case exercises (a case runs an op forward and, through autograd, its _backward)."""
    checked = {name.split()[0] for name, _, _ in cases(torch.Generator())}
    return [n for n in cuda_kernels if n.removesuffix("_backward") not in checked]


def parity():
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, op, inputs in cases(gen):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            row = {"op": name, "dtype": str(dtype).replace("torch.", "")}
            try:
                cpu_out, cpu_grads = run(op, inputs, "cpu", dtype, 1)
                gpu_out, gpu_grads = run(op, inputs, "cuda", dtype, 1)
            except (RuntimeError, NotImplementedError) as e:
                row.update(status="no CUDA kernel" if "CUDA" in str(e) else f"error: {str(e).splitlines()[0]}")
                rows.append(row)
                continue
            errs = [rel_err(a, b) for a, b in zip(gpu_out, cpu_out)]
            errs += [rel_err(a, b) for a, b in zip(gpu_grads, cpu_grads) if a is not None and b is not None]
            worst = max(errs)
            row.update(worst_rel_err=worst, tolerance=TOL[dtype], status="ok" if worst <= TOL[dtype] else "FAIL")
            rows.append(row)
    return rows


def median_ms(fn, repeats=20):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        fn()
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def bandwidth():
    rows = []
    for label, N, P, d in (("tiny", 5, 4096, 128), ("0.1b", 9, 4096 * 8, 640)):
        for dtype in (torch.float32, torch.bfloat16):
            k = torch.randn(N, P, d, device="cuda", dtype=dtype)
            q = torch.randn(1, d, device="cuda", dtype=dtype)
            dst = torch.empty_like(k)
            sources = list(k)
            t_read = median_ms(lambda: torch.ops.depthkit.depth_read(q, sources, [], EPS))
            t_copy = median_ms(lambda: dst.copy_(k))
            moved = k.numel() * k.element_size() + P * d * k.element_size() + P * 4
            read_gbs = moved / t_read / 1e6
            copy_gbs = 2 * k.numel() * k.element_size() / t_copy / 1e6
            rows.append({"shape": f"{label}: N={N} P={P} d={d}", "dtype": str(dtype).replace("torch.", ""),
                         "read_ms": t_read, "read_gbs": read_gbs, "copy_gbs": copy_gbs,
                         "fraction_of_copy": read_gbs / copy_gbs})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="build/libdepthkit_ops.so")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_ops: error: no CUDA device visible to torch", file=sys.stderr)
        return 1
    torch.ops.load_library(a.lib)
    cuda_kernels, no_cuda_kernel = registered_cuda_kernels()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda_kernels": cuda_kernels, "unchecked_cuda_kernels": unchecked(cuda_kernels),
              "no_cuda_kernel": no_cuda_kernel, "parity": parity(), "bandwidth": bandwidth()}
    print(f"{result['device']}, torch {result['torch']}")
    print(f"{'op':30} {'dtype':9} {'worst rel err':>14} {'tolerance':>10}  status")
    for r in result["parity"]:
        err = f"{r['worst_rel_err']:.2e}" if "worst_rel_err" in r else "-"
        tol = f"{r['tolerance']:.0e}" if "tolerance" in r else "-"
        print(f"{r['op']:30} {r['dtype']:9} {err:>14} {tol:>10}  {r['status']}")
    print(f"\n{'fused depth_read forward':30} {'dtype':9} {'ms':>8} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8}")
    for r in result["bandwidth"]:
        print(f"{r['shape']:30} {r['dtype']:9} {r['read_ms']:8.3f} {r['read_gbs']:8.1f} {r['copy_gbs']:10.1f} "
              f"{100 * r['fraction_of_copy']:7.1f}%")
    print(f"\nCUDA kernels: {', '.join(cuda_kernels) or 'none'}")
    print(f"no CUDA kernel: {', '.join(no_cuda_kernel) or 'none'}")
    if result["unchecked_cuda_kernels"]:
        print(f"FAIL: CUDA kernels no case checks: {', '.join(result['unchecked_cuda_kernels'])} (add them to cases())")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_ops.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    parity_ok = all(r["status"] in ("ok", "no CUDA kernel") for r in result["parity"])
    return 0 if parity_ok and not result["unchecked_cuda_kernels"] else 1


if __name__ == "__main__":
    sys.exit(main())
