#!/usr/bin/env bash
# Paper-scale state on CPU ranks (docs/training.md, "Sharded state", "Recomputation",
# "Checkpoints across layouts"), each layout against one rank with the same global batch (8
# sequences a step):
#   - ZeRO-2 on 1, 2 and 4 ranks: the same losses and parameters (bit for bit on 1 and 2 ranks,
#     within float32 rounding on 4: the reduction order differs); each rank keeps
#     1/W of the gradients and AdamW state, and the peak falls from 2 to 4 ranks by exactly what
#     that arithmetic says;
#   - train.recompute = branch: the same run bit for bit, on one rank and under ZeRO-2;
#   - a checkpoint written by 4 ranks under ZeRO-2 resumes on 1 rank and on 2 ranks under ZeRO-1
#     with the uninterrupted run's losses and parameters (within float32 rounding).
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"
compare() { python3 "$SRC/tests/compare_runs.py" "$@"; }

"$DK" data prepare --input /usr/share/doc/python3.11/html/_sources/tutorial --out data --vocab-size 512 \
  --val-fraction 0.2 --json >/dev/null
SETS=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
      --set model.d_ff=128 --set model.n_layers=2 --set data.dir=data --set train.eval_tokens=2048
      --set train.eval_every=10 --set train.checkpoint_every=10 --set optim.warmup_steps=5 --set train.log_every=1
      --set train.steps=20 --set train.threads=1 --set residual.kind=dar)
train() {  # train RUN RANKS ARGS...: 8 sequences a step over RANKS ranks (accumulation fills the rest)
  local run=$1 ranks=$2; shift 2
  "$DK" train "${SETS[@]}" --run-dir "$run" --nproc "$ranks" --set train.micro_batch=$((ranks == 4 ? 2 : 4)) \
    --set train.grad_accum=$((ranks == 1 ? 2 : 1)) "$@" >/dev/null 2>"$run.log" || { cat "$run.log"; fail "$run"; }
}

# Against data parallel with the same global batch. On 1 and 2 ranks the arithmetic is the same, bit
# for bit (the mean of two is exact either way; the clipping norm is summed in float64, so its
# pieces' order does not reach float32). On 4 ranks Gloo's reduce-scatter adds the four ranks'
# gradients in another order than its all-reduce: one float32 rounding apart, which AdamW
# amplifies where a gradient is near zero (m/√v of two tiny numbers), to a few 1e-6 after 20
# steps: the losses are held to 1e-5, the parameters to 1e-4.
train one 1
train ddp_4 4
train zero2_1 1 --set train.zero=2
compare zero2_1 one --exact || fail "ZeRO-2 on 1 rank differs from data parallel"
train zero2_2 2 --set train.zero=2
compare zero2_2 one --exact || fail "ZeRO-2 on 2 ranks differs from data parallel"
train zero2_4 4 --set train.zero=2
compare zero2_4 ddp_4 --param-limit 1e-4 || fail "ZeRO-2 on 4 ranks differs from data parallel"
grep -q "ZeRO-2: AdamW state of .*; gradients" zero2_2.log || fail "ZeRO-2 does not report its per-rank state"

# Recomputation changes no bit.
train recompute 1 --set train.recompute=branch
compare recompute one --exact || fail "train.recompute = branch changed the run"
train recompute_zero2 2 --set train.recompute=branch --set train.zero=2
compare recompute_zero2 zero2_2 --exact || fail "train.recompute = branch changed the ZeRO-2 run"

# Per-rank memory on a model whose state outweighs its activations (1.57M parameters, one
# sequence of 16 tokens a micro-step): gradients and AdamW state are 1/W each, and the peak of
# 2 ranks exceeds that of 4 by 3 copies of the parameters x (1/2 - 1/4), within 1 %.
MEM=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=16 --set model.d_model=256
     --set model.d_ff=512 --set model.n_heads=4 --set model.n_kv_heads=4 --set model.n_layers=2 --set data.dir=data
     --set train.micro_batch=1 --set train.eval_tokens=256 --set train.eval_every=0 --set train.checkpoint_every=0
     --set train.steps=2 --set train.threads=1 --set train.zero=2)
for ranks in 1 2 4; do
  "$DK" train "${MEM[@]}" --run-dir mem_$ranks --nproc $ranks --set train.grad_accum=$((4 / ranks)) >/dev/null 2>mem.log \
    || { cat mem.log; fail "memory run on $ranks ranks"; }
done
python3 - <<'PY' || fail "ZeRO-2 per-rank memory does not follow the arithmetic"
import json
s = {w: json.load(open(f"mem_{w}/summary.json")) for w in (1, 2, 4)}
full = s[1]["gradient_bytes_per_rank"]  # 4 bytes x parameters
for w in (2, 4):
    for key, copies in (("gradient_bytes_per_rank", 1), ("optimizer_state_bytes_per_rank", 2)):
        got, want = s[w][key], copies * full / w
        assert abs(got - want) <= copies * 64 * 4 * w, f"{key} on {w} ranks: {got}, expected {want}"
drop = s[2]["peak_tensor_bytes"] - s[4]["peak_tensor_bytes"]
want = 3 * full * (1 / 2 - 1 / 4)
print(f"peak per rank: {[s[w]['peak_tensor_bytes'] for w in (1, 2, 4)]}; 2 -> 4 ranks {drop}, arithmetic {want:.0f}")
assert abs(drop - want) <= 0.01 * want, (drop, want)
PY

# A 4-rank ZeRO-2 checkpoint resumes under other layouts.
for layout in one_rank zero1_2; do
  rc=0; "$DK" train "${SETS[@]}" --run-dir moved_$layout --nproc 4 --set train.micro_batch=2 --set train.zero=2 \
    --stop-after 7 >/dev/null 2>moved.log || rc=$?
  [ $rc = 130 ] || { cat moved.log; fail "--stop-after 7 on 4 ranks exited $rc, expected 130 (interrupted)"; }
done
"$DK" train --resume --run-dir moved_one_rank --set train.micro_batch=4 --set train.grad_accum=2 >/dev/null 2>r1.log \
  || { cat r1.log; fail "the 4-rank ZeRO-2 checkpoint did not resume on 1 rank"; }
compare moved_one_rank zero2_4 || fail "4 ranks (ZeRO-2) resumed on 1 rank differ from the uninterrupted run"
"$DK" train --resume --run-dir moved_zero1_2 --nproc 2 --set train.micro_batch=4 --set train.zero=1 >/dev/null 2>r2.log \
  || { cat r2.log; fail "the 4-rank ZeRO-2 checkpoint did not resume on 2 ranks under ZeRO-1"; }
compare moved_zero1_2 zero2_4 || fail "4 ranks (ZeRO-2) resumed on 2 ranks (ZeRO-1) differ from the uninterrupted run"
echo "cli_sharding: ok"
