"""compare_runs.py A B [--exact] [--steps N] [--limit X] [--param-limit Y] [--norm-limit Z]: two
training runs' per-step losses within X relative (default 1e-5), gradient norms within Z (default
1e-4: a norm moves with the parameters' own rounding differences, more than the loss does) and
final parameters (the checkpoint of step N, default 20) within Y (default X) of max(1, |p|); or
identical with --exact (the norms then within 1e-12: they are summed in float64, shard by shard
under ZeRO-2, and only float64's last bits may differ). The gradient norm, taken before clipping, catches a gradient scaled wrong,
which AdamW (invariant to a gradient's scale) would hide from the losses and parameters. Prints the largest
differences; exits 1 when a limit is passed."""
import argparse
import json
import struct
import sys

import numpy as np


def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    out = {}
    for name, e in json.loads(raw[8:8 + n]).items():
        if name != "__metadata__":
            s, t = e["data_offsets"]
            out[name] = np.frombuffer(raw[8 + n + s:8 + n + t], dtype={"F32": np.float32, "I64": np.int64}[e["dtype"]])
    return out


def logged(run, key):
    return {j["step"]: j[key] for j in map(json.loads, open(f"{run}/metrics.jsonl")) if key in j}


parser = argparse.ArgumentParser()
parser.add_argument("a")
parser.add_argument("b")
parser.add_argument("--exact", action="store_true")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--limit", type=float, default=1e-5)
parser.add_argument("--param-limit", type=float, help="the parameters' limit, when not --limit")
parser.add_argument("--norm-limit", type=float, default=1e-4, help="the gradient norms' limit")
args = parser.parse_args()
la, lb = logged(args.a, "loss"), logged(args.b, "loss")
assert la.keys() == lb.keys() and len(la) == args.steps, f"steps {sorted(la)} vs {sorted(lb)}"
worst_loss = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in la)
na, nb = logged(args.a, "grad_norm"), logged(args.b, "grad_norm")
assert na.keys() == la.keys() and nb.keys() == lb.keys(), "a step without its gradient norm"
worst_norm = max(abs(na[s] - nb[s]) / abs(nb[s]) for s in na)
checkpoint = f"checkpoints/step_{args.steps:08d}/model.safetensors"
ta, tb = tensors(f"{args.a}/{checkpoint}"), tensors(f"{args.b}/{checkpoint}")
assert ta.keys() == tb.keys()
worst_param = max(float(np.max(np.abs(ta[k].astype(np.float64) - tb[k]) / max(1.0, float(np.abs(tb[k]).max()))))
                  for k in ta)
print(f"{args.a} vs {args.b}: losses {worst_loss:.2e}, gradient norms {worst_norm:.2e}, parameters {worst_param:.2e}"
      " (largest relative difference)")
limit = 0 if args.exact else args.limit
param_limit = 0 if args.exact else args.param_limit or args.limit
norm_limit = 1e-12 if args.exact else args.norm_limit
sys.exit(0 if worst_loss <= limit and worst_norm <= norm_limit and worst_param <= param_limit else 1)
