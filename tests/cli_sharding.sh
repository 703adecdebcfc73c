#!/usr/bin/env bash
# Paper-scale state on CPU ranks (docs/training.md, "Sharded state", "Recomputation",
# "Checkpoints across layouts"), each layout against one rank with the same global batch (8
# sequences a step):
#   - ZeRO-2 on 1, 2 and 4 ranks: the same losses and parameters (bit for bit on 1 and 2 ranks,
#     within float32 rounding on 4: the reduction order differs); each rank keeps
#     1/W of the gradients and AdamW state, and the peak falls from 2 to 4 ranks by exactly what
#     that arithmetic says;
#   - ZeRO-3 (with recompute = branch, which it needs) likewise on 1, 2 and 4 ranks, on the dense
#     and the MoE backbone, with experts over 2 and 4 ranks, with accumulation and in bfloat16;
#     its peak falls from 2 to 4 ranks by what the arithmetic says, the branches' parameters
#     included;
#   - train.recompute = branch and layer: the same run bit for bit, on one rank, under ZeRO-2 and
#     ZeRO-3, and with the experts split;
#   - a checkpoint written by 4 ranks under ZeRO-2 (and by 4 ranks with experts over 2 under ZeRO-2
#     and ZeRO-3) resumes on 1 rank and on 2 ranks under ZeRO-1 with the uninterrupted run's losses
#     and parameters (within float32 rounding), and one rank's resumes under ZeRO-3 on 4.
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
grep -q "ZeRO-2: AdamW state of .*, gradients" zero2_2.log || fail "ZeRO-2 does not report its per-rank state"
# ZeRO-3: the same sums on the same elements; only where each rank keeps the parameters changes.
R=(--set train.recompute=branch)
train zero3_1 1 --set train.zero=3 "${R[@]}"
compare zero3_1 one --exact || fail "ZeRO-3 on 1 rank differs from data parallel"
train zero3_2 2 --set train.zero=3 "${R[@]}"
compare zero3_2 one --exact || fail "ZeRO-3 on 2 ranks differs from data parallel"
train zero3_4 4 --set train.zero=3 "${R[@]}"
compare zero3_4 ddp_4 --param-limit 1e-4 || fail "ZeRO-3 on 4 ranks differs from data parallel"
grep -q "ZeRO-3: AdamW state of .*, parameters .* bytes between uses (5 units)" zero3_2.log \
  || fail "ZeRO-3 does not report its per-rank state"
# Each branch gathered before forward and again before backward's recomputation (4 branches here),
# all but the first of each pass while the branch before it ran.
gathers() { json '["parameter_gathers_per_step"]' <$1/summary.json; }
[ "$(gathers zero3_2)" = "{'all': 8.0, 'prefetched': 6.0}" ] || fail "ZeRO-3's gathers per step: $(gathers zero3_2)"
train bf16 2 --set train.dtype=bfloat16
train zero3_bf16 2 --set train.dtype=bfloat16 --set train.zero=3 "${R[@]}"
compare zero3_bf16 bf16 --exact || fail "ZeRO-3 in bfloat16 differs from data parallel in bfloat16"

# Recomputation changes no bit.
train recompute 1 --set train.recompute=branch
compare recompute one --exact || fail "train.recompute = branch changed the run"
train recompute_zero2 2 --set train.recompute=branch --set train.zero=2
compare recompute_zero2 zero2_2 --exact || fail "train.recompute = branch changed the ZeRO-2 run"
train recompute_layer 1 --set train.recompute=layer
compare recompute_layer one --exact || fail "train.recompute = layer changed the run"
train recompute_layer_zero3 2 --set train.recompute=layer --set train.zero=3
compare recompute_layer_zero3 one --exact || fail "train.recompute = layer changed the ZeRO-3 run"
[ "$(gathers recompute_layer_zero3)" = "{'all': 8.0, 'prefetched': 6.0}" ] \
  || fail "ZeRO-3's gathers per step under layer recomputation: $(gathers recompute_layer_zero3)"

# Per-rank memory on a model whose state outweighs its activations (5.4M parameters in 32 layers,
# none over 66k, one sequence of 16 tokens a micro-step): gradients and AdamW state are 1/W each,
# and the peak of 2 ranks exceeds that of 4 by 3 copies of the parameters x (1/2 - 1/4), give or
# take the buckets in flight (Gloo's worker threads hold copies of a few and free them when they
# are done, which varies: the least peak of three runs is taken, and the 64 KiB buckets, a
# parameter each, keep what is left within 10 % of the difference).
MEM=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=16 --set model.d_model=128
     --set model.d_ff=256 --set model.n_heads=4 --set model.n_kv_heads=4 --set model.n_layers=32 --set data.dir=data
     --set train.micro_batch=1 --set train.eval_tokens=256 --set train.eval_every=0 --set train.checkpoint_every=0
     --set train.steps=2 --set train.threads=1 --set train.bucket_bytes=65536)
for zero in 2 3; do
  for ranks in 1 2 2 2 4 4 4; do  # the least of three: a lingering buffer only ever adds
    run=mem${zero}_$ranks; rm -rf $run
    "$DK" train "${MEM[@]}" --run-dir $run --nproc $ranks --set train.grad_accum=$((4 / ranks)) --set train.zero=$zero \
      --set train.recompute=$([ $zero = 3 ] && echo branch || echo none) >/dev/null 2>mem.log \
      || { cat mem.log; fail "memory run on $ranks ranks"; }
    json '["peak_tensor_bytes"]' <$run/summary.json >>peaks${zero}_$ranks
  done
done
# ZeRO-3 keeps 1/W of the branches' parameters too (all but the embedding, head, final norm and the
# pathway's own), so its peak falls by that much more; the branch gathered, the one prefetched and
# the gather's buffer are the same size at any W (but for padding).
python3 - <<'PY' || fail "ZeRO-2/3 per-rank memory does not follow the arithmetic"
import json
for zero in (2, 3):
    s = {w: json.load(open(f"mem{zero}_{w}/summary.json")) for w in (1, 2, 4)}
    full = s[1]["gradient_bytes_per_rank"]  # 4 bytes x parameters
    units = 1 if zero == 2 else 2 * 32 + 1  # sharded apart: ZeRO-3's branches, and the rest
    for w in (2, 4):
        for key, copies in (("gradient_bytes_per_rank", 1), ("optimizer_state_bytes_per_rank", 2)):
            got, want = s[w][key], copies * full / w  # each unit's shards padded to 64-element boundaries
            assert abs(got - want) <= copies * 64 * 4 * w * units, f"ZeRO-{zero} {key} on {w} ranks: {got}, expected {want}"
    kept = [s[w]["parameter_bytes_per_rank"] for w in (1, 2, 4)]
    assert zero == 3 or kept == [full] * 3, kept
    peak = {w: min(int(x) for x in open(f"peaks{zero}_{w}").read().split()) for w in (1, 2, 4)}
    drop = peak[2] - peak[4]
    want = 3 * full * (1 / 2 - 1 / 4) + (kept[1] - kept[2])
    print(f"ZeRO-{zero}: peak per rank {[peak[w] for w in (1, 2, 4)]}, parameters kept {kept}; "
          f"2 -> 4 ranks {drop}, arithmetic {want:.0f}")
    slack = 8 * 65536 * 4  # eight buckets of one 65,536-element parameter
    assert slack < 0.15 * want
    assert abs(drop - want) <= slack, (zero, drop, want, slack)
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
# ---- Expert parallelism (moe.expert_parallel), on the MoE backbone ----
MOE=(--config "$SRC/configs/tiny-moe.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
     --set model.n_layers=2 --set model.d_ff=128 --set moe.expert_d_ff=32 --set moe.shared_d_ff=32 --set data.dir=data
     --set train.eval_tokens=2048 --set train.eval_every=10 --set train.checkpoint_every=10 --set optim.warmup_steps=5
     --set train.log_every=1 --set train.steps=20 --set train.threads=1)
moe() {  # moe RUN RANKS ARGS...: as train, on the MoE backbone
  local run=$1 ranks=$2; shift 2
  "$DK" train "${MOE[@]}" --run-dir "$run" --nproc "$ranks" --set train.micro_batch=$((ranks == 4 ? 2 : 4)) \
    --set train.grad_accum=$((ranks == 1 ? 2 : 1)) "$@" >/dev/null 2>"$run.log" || { cat "$run.log"; fail "$run"; }
}
# Every kind: 2 ranks splitting the 8 experts equal 2 ranks holding all of them. Only the order of
# the experts' sums differs (an expert's rows from both ranks in one product and its gradient
# summed there, against two products and an all-reduce): the losses agree to the bit over 20 steps
# here, and the parameters within 1e-4, where AdamW's m/√v amplifies a rounding in a near-zero
# gradient (mHC's scales and biases move most, by 4e-5).
kinds=$({ "$DK" train "${MOE[@]}" --set residual.kind=? --run-dir none 2>&1 || true; } | grep -o '"[a-z_]*"' | tr -d '"')
[ "$(echo "$kinds" | wc -l)" -ge 7 ] || fail "could not list the pathway kinds: $kinds"
for kind in $kinds; do
  moe dp2_$kind 2 --set residual.kind=$kind
  moe ep2_$kind 2 --set residual.kind=$kind --set moe.expert_parallel=2
  compare ep2_$kind dp2_$kind --param-limit 1e-4 || fail "$kind: experts split over 2 ranks differ from data parallel"
done
grep -q "ZeRO-0, experts over 2 ranks: replicated: AdamW state of .*; experts: AdamW state of" ep2_dar.log \
  || fail "expert parallelism does not report its sets"
# And one rank with the same micro-batches (accumulation 2).
moe one_moe 1 --set residual.kind=dar
compare ep2_dar one_moe --param-limit 1e-4 || fail "experts split over 2 ranks differ from one rank"

# Layouts on 4 ranks (DAR): experts over 2 and over 4 ranks, with ZeRO-1 and -2, against data parallel;
# with accumulation on 2 ranks against data parallel with the same micro-batches (the balancing
# loss is a product of means over a micro-batch: other micro-batches, another loss);
# recomputation changes no bit.
moe dp4 4 --set residual.kind=dar
for layout in "2 0" "4 0" "2 1" "2 2" "4 2" "2 3" "4 3"; do
  set -- $layout
  moe ep$1_zero$2 4 --set residual.kind=dar --set moe.expert_parallel=$1 --set train.zero=$2 \
    --set train.recompute=$([ $2 = 3 ] && echo branch || echo none)
  compare ep$1_zero$2 dp4 --param-limit 1e-4 || fail "experts over $1 of 4 ranks (ZeRO-$2) differ from data parallel"
done
accum() {  # accum RUN ARGS...: 2 ranks, 2 micro-batches of 2 sequences each
  local run=$1; shift
  "$DK" train "${MOE[@]}" --run-dir $run --nproc 2 --set residual.kind=dar --set train.micro_batch=2 \
    --set train.grad_accum=2 "$@" >/dev/null 2>$run.log || { cat $run.log; fail "$run"; }
}
accum dp2_accum
accum ep2_accum --set moe.expert_parallel=2
compare ep2_accum dp2_accum --param-limit 1e-4 || fail "experts over 2 ranks with accumulation differ from data parallel"
accum ep2_zero3_accum --set moe.expert_parallel=2 --set train.zero=3 --set train.recompute=branch
compare ep2_zero3_accum dp2_accum --param-limit 1e-4 || fail "ZeRO-3, experts over 2 ranks, with accumulation differ"
moe ep2_recompute 2 --set residual.kind=dar --set moe.expert_parallel=2 --set train.recompute=branch
compare ep2_recompute ep2_dar --exact || fail "recomputation changed the expert-parallel run"
moe ep2_zero3_layer 4 --set residual.kind=dar --set moe.expert_parallel=2 --set train.zero=3 --set train.recompute=layer
compare ep2_zero3_layer ep2_zero3 --exact || fail "layer recomputation changed the ZeRO-3 expert-parallel run"
# All of it in bfloat16: experts over 2 with ZeRO-3 and recomputation against experts over 2 alone.
moe ep2_bf16 2 --set residual.kind=dar --set moe.expert_parallel=2 --set train.dtype=bfloat16
moe ep2_zero3_bf16 2 --set residual.kind=dar --set moe.expert_parallel=2 --set train.dtype=bfloat16 --set train.zero=3 \
  --set train.recompute=layer
compare ep2_zero3_bf16 ep2_bf16 --exact || fail "ZeRO-3 with recomputation changed the bfloat16 expert-parallel run"

# A checkpoint of 4 ranks, experts over 2, ZeRO-2 or ZeRO-3, resumes on 1 rank and on 2 ranks
# (ZeRO-1, experts whole): the tensors are named and shaped as one rank's. The micro-batches stay
# of 2 sequences (the balancing loss is taken per micro-batch), accumulation making up the global
# batch. And one rank's checkpoint resumes on 4 ranks, experts over 2, under ZeRO-3.
for zero in 2 3; do
  for layout in one_rank two_ranks; do
    rc=0; "$DK" train "${MOE[@]}" --set residual.kind=dar --run-dir ep_moved${zero}_$layout --nproc 4 \
      --set train.micro_batch=2 --set moe.expert_parallel=2 --set train.zero=$zero \
      --set train.recompute=$([ $zero = 3 ] && echo branch || echo none) --stop-after 7 >/dev/null 2>moved.log || rc=$?
    [ $rc = 130 ] || { cat moved.log; fail "--stop-after 7 (experts over 2 of 4 ranks, ZeRO-$zero) exited $rc, expected 130"; }
  done
  "$DK" train --resume --run-dir ep_moved${zero}_one_rank --set train.micro_batch=2 --set train.grad_accum=4 \
    --set moe.expert_parallel=1 --set train.zero=0 --set train.recompute=none >/dev/null 2>r1.log \
    || { cat r1.log; fail "expert-parallel ZeRO-$zero checkpoint on 1 rank"; }
  compare ep_moved${zero}_one_rank ep2_zero$zero --param-limit 1e-4 \
    || fail "experts over 2 of 4 ranks (ZeRO-$zero) resumed on 1 rank differ"
  "$DK" train --resume --run-dir ep_moved${zero}_two_ranks --nproc 2 --set train.grad_accum=2 --set moe.expert_parallel=1 \
    --set train.zero=1 --set train.recompute=none >/dev/null 2>r2.log \
    || { cat r2.log; fail "expert-parallel ZeRO-$zero checkpoint on 2 ranks"; }
  compare ep_moved${zero}_two_ranks ep2_zero$zero --param-limit 1e-4 \
    || fail "experts over 2 of 4 ranks (ZeRO-$zero) resumed on 2 ranks differ"
done
rc=0; "$DK" train "${MOE[@]}" --set residual.kind=dar --run-dir to_zero3 --set train.micro_batch=2 --set train.grad_accum=4 \
  --stop-after 7 >/dev/null 2>moved.log || rc=$?
[ $rc = 130 ] || { cat moved.log; fail "--stop-after 7 on 1 rank exited $rc, expected 130"; }
"$DK" train --resume --run-dir to_zero3 --nproc 4 --set train.grad_accum=1 --set moe.expert_parallel=2 --set train.zero=3 \
  --set train.recompute=branch >/dev/null 2>r3.log || { cat r3.log; fail "one rank's checkpoint on 4 ranks under ZeRO-3"; }
compare to_zero3 ep2_zero3 --param-limit 1e-4 || fail "one rank's checkpoint resumed on 4 ranks (ZeRO-3) differs"

# Bad layouts: one line naming the keys, before any rank starts.
refused() {  # refused PATTERN ARGS...
  local pattern=$1 rc=0; shift
  "$DK" train "${MOE[@]}" --run-dir refused "$@" >/dev/null 2>refused.log || rc=$?
  [ $rc = 1 ] && grep -qF -- "$pattern" refused.log && [ "$(grep -c . refused.log)" = 1 ] && [ ! -e refused ] \
    || { cat refused.log; fail "not refused in one line: $*"; }
}
refused "key 'moe.expert_parallel' (4) must divide the number of ranks (2)" --nproc 2 --set moe.expert_parallel=4
refused "key 'moe.expert_parallel' (3) must divide moe.n_experts (8)" --nproc 3 --set moe.expert_parallel=3
refused "key 'moe.expert_parallel' is 2 but the model has no experts" --nproc 2 --set moe.n_experts=0 \
  --set moe.expert_parallel=2
refused "key 'train.zero' is 3, which needs key 'train.recompute' = \"branch\" or \"layer\" (got \"none\")" --nproc 2 --set train.zero=3
echo "cli_sharding: ok"
