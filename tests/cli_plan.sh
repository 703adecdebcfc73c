#!/usr/bin/env bash
# The layout planner (docs/training.md, "Planning a layout"): its memory prediction per rank
# against the peak each layout measures (summary.json's peak_tensor_bytes, the rank 0 of the
# job) on CPU ranks, within 10 %, for every kind on 1, 2 and 4 ranks (one rank, 2 and 4 pipeline
# stages), for four ZeRO-3 with branch recomputation on 4, for three each recomputation mode and ZeRO-2,
# for two the rest (ZeRO-1, virtual stages, stages × data parallel), and the MoE backbone with its
# experts split; its JSON and table, the recommendation and the torchrun command; bad
# arguments refused in one line.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

"$DK" data prepare --input /usr/share/doc/python3.11/html/_sources/tutorial --out data --vocab-size 512 \
  --val-fraction 0.2 --json >/dev/null

python3 - "$DK" "$SRC" <<'PY'
import json, subprocess, sys
DK, SRC = sys.argv[1], sys.argv[2]
DENSE = ["--config", f"{SRC}/configs/tiny.toml", "--set", "model.d_model=128", "--set", "model.n_layers=4"]
MOE = ["--config", f"{SRC}/configs/tiny-moe.toml", "--set", "model.d_model=128", "--set", "model.n_layers=4",
       "--set", "moe.expert_d_ff=64", "--set", "moe.shared_d_ff=64"]
COMMON = ["--set", "data.dir=data", "--set", "model.vocab_size=512", "--set", "model.seq_len=128",
          "--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
          "--set", "train.eval_tokens=8192", "--set", "train.threads=1", "--set", "train.micro_batch=4",
          "--set", "train.grad_accum=4"]
KEYS = {"micro_batch": "train.micro_batch", "grad_accum": "train.grad_accum", "zero": "train.zero",
        "recompute": "train.recompute", "expert_parallel": "moe.expert_parallel",
        "pipeline_stages": "train.pipeline_stages", "virtual_stages": "train.virtual_stages"}

def layouts(base, ranks):
    out = subprocess.run([DK, "plan", *base, *COMMON, "--gpus", str(ranks), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["layouts"]

worst = 0
def check(name, base, ranks, **want):
    global worst
    want.setdefault("expert_parallel", 1)
    want.setdefault("virtual_stages", 1)
    found = [l for l in layouts(base, ranks)
             if all(l["layout"][k] == v for k, v in want.items()) and l["layout"]["micro_batch"] * l["layout"]["data"] == 4]
    assert found, (name, ranks, want)
    layout, predicted = found[0]["layout"], found[0]["memory_bytes"]["total"]
    args = [DK, "train", *base, *COMMON, "--run-dir", name, "--nproc", str(ranks)]
    for key, setting in KEYS.items():
        args += ["--set", f"{setting}={layout[key]}"]
    # Under ZeRO-2 and -3 Gloo's worker threads allocate while the collectives they run overlap the
    # step, so a peak can gain a few percent from timing alone (one-sided): the least of two runs.
    peaks = []
    for _ in range(2 if layout["zero"] >= 2 and ranks > 1 else 1):
        run = subprocess.run(args, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        peaks.append(json.load(open(f"{name}/summary.json"))["peak_tensor_bytes"])
        subprocess.run(["rm", "-rf", name])
    peak = min(peaks)
    ratio = predicted / peak
    worst = max(worst, abs(ratio - 1))
    print(f"{name:28} {ranks} ranks {str(want):75} predicted {predicted / 1e6:6.2f} MB, measured {peak / 1e6:6.2f} MB ({ratio:.3f})")
    assert 0.9 <= ratio <= 1.1, f"{name}: the prediction is {ratio:.3f} of the measured peak"

kinds = ["residual", "attnres", "attnres_sepv", "dar", "msar", "mhc", "attnres_mhc"]
for kind in kinds:
    base = DENSE + ["--set", f"residual.kind={kind}"]
    check(f"{kind}_none", base, 1, zero=0, recompute="none", pipeline_stages=1)
    if kind in ("residual", "dar", "msar"):
        check(f"{kind}_layer", base, 1, zero=0, recompute="layer", pipeline_stages=1)
        check(f"{kind}_zero2", base, 2, zero=2, recompute="none", pipeline_stages=1)
    check(f"{kind}_pp2", base, 2, zero=0, recompute="none", pipeline_stages=2)
    if kind in ("residual", "attnres", "dar", "msar"):
        check(f"{kind}_zero3", base, 4, zero=3, recompute="branch", pipeline_stages=1)
    check(f"{kind}_pp4", base, 4, zero=0, recompute="none", pipeline_stages=4)
for kind in ["residual", "dar"]:
    base = DENSE + ["--set", f"residual.kind={kind}"]
    check(f"{kind}_branch", base, 1, zero=0, recompute="branch", pipeline_stages=1)
    check(f"{kind}_zero1", base, 2, zero=1, recompute="none", pipeline_stages=1)
    check(f"{kind}_vpp", base, 2, zero=0, recompute="none", pipeline_stages=2, virtual_stages=2)
    check(f"{kind}_pp2_zero1", base, 4, zero=1, recompute="none", pipeline_stages=2)
base = MOE + ["--set", "residual.kind=dar"]
check("moe_dar", base, 1, zero=0, recompute="none", pipeline_stages=1)
check("moe_dar_ep2", base, 2, zero=1, recompute="none", pipeline_stages=1, expert_parallel=2)
check("moe_dar_ep2_pp2", base, 4, zero=0, recompute="branch", pipeline_stages=2, expert_parallel=2)
print(f"largest difference {100 * worst:.1f} %")
PY

# The table, the recommendation and its torchrun command; JSON a script reads.
"$DK" plan --config "$SRC/configs/paper/dar-moe-7b.toml" --gpus 8 --gpu-memory 80GiB --set residual.kind=dar > plan.txt
grep -q "^recommended: " plan.txt || { cat plan.txt; fail "no recommendation"; }
grep -q "^torchrun --nnodes 1 --nproc-per-node 8 --no-python depthkit train --config .*dar-moe-7b.toml" plan.txt \
  || { cat plan.txt; fail "no torchrun command"; }
"$DK" plan --config "$SRC/configs/paper/msar-moe-28b.toml" --gpus 32 --nodes 4 --json > plan.json
python3 - <<'PY'
import json
j = json.load(open("plan.json"))
best = j["recommended"]
assert best["fits"] and best["memory_bytes"]["total"] <= j["gpu_memory_bytes"]
assert abs(sum(v for k, v in best["memory_bytes"].items() if k != "total") - best["memory_bytes"]["total"]) < 1e3
assert best["layout"]["data"] * best["layout"]["pipeline_stages"] == 32
assert "--rdzv-endpoint" in j["torchrun"] and "--nnodes 4" in j["torchrun"]
fitting = [l for l in j["layouts"] if l["fits"]]
assert all(l["step_seconds_estimate"] >= best["step_seconds_estimate"] for l in fitting)
PY
# A cluster too small: no layout fits, said, exit 1.
rc=0; "$DK" plan --config "$SRC/configs/paper/msar-moe-28b.toml" --gpus 1 --gpu-memory 16GiB > small.txt || rc=$?
[ $rc = 1 ] && grep -q "^no layout fits" small.txt || { cat small.txt; fail "a cluster too small was not said so"; }
# Bad arguments: one line each.
for bad in "--gpu-memory 80XB" "--gpu-memory -1GiB" "--gpus 6 --nodes 4"; do
  out=$("$DK" plan --config "$SRC/configs/tiny.toml" $bad 2>&1) && fail "accepted $bad"
  [ "$(echo "$out" | wc -l)" = 1 ] || fail "refused $bad in more than one line: $out"
done
echo "cli_plan: OK"
