#!/usr/bin/env bash
# Pipeline stages on CPU ranks (docs/training.md, "Pipeline stages"; docs/design.md, "Pipeline
# stages"), each against one rank (or the same data-parallel layout without stages) with the same
# global batch, 4 layers, 8 sequences a step in 4 micro-batches:
#   - every kind on 2 stages and on 4 stages: the same losses, gradient norms and parameters bit for
#     bit (a source's gradient from the next stage starts its accumulator, so every sum is added in
#     one rank's order), but MSAR, whose convolution banks are read by layers of both stages: their
#     gradients are summed per stage, then over the stages (float32 rounding apart);
#   - every kind on 2 stages × 2 virtual stages (the interleaved schedule, cross-stage caching): a
#     source's gradient is summed over two paths (the next stage's and this rank's later chunk), so
#     within float32 rounding: held over the first 6 steps, where the gradient norms agree to a few
#     1e-9 to 3e-7 (later, this tiny model's loss spikes at lr 3e-3 amplify rounding chaotically: a
#     norm 1e-9 apart at step 1 is 2e-3 apart at step 10), the parameters within 1e-4, where AdamW's
#     m/√v amplifies a rounding in a near-zero gradient (mHC's scales move most, by 3e-5);
#   - stages × data parallel, with ZeRO-1, -2, -3 and layer recomputation, the MoE backbone with
#     experts split, bfloat16, against the same layout without stages;
#   - checkpoints: 2 stages stopped at step 7 resume on 1 rank, and 1 rank's on 2 stages × 2;
#   - the bytes each boundary sends per micro-batch, against docs/design.md's formula, for every
#     kind in its Block and Full forms, with and without cross-stage caching;
#   - bad layouts refused before any rank starts, in one line naming the keys, nothing written.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"
compare() { python3 "$SRC/tests/compare_runs.py" "$@"; }

"$DK" data prepare --input /usr/share/doc/python3.11/html/_sources/tutorial --out data --vocab-size 512 \
  --val-fraction 0.2 --json >/dev/null
SETS=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
      --set model.d_ff=128 --set model.n_layers=4 --set data.dir=data --set train.eval_tokens=2048
      --set train.eval_every=10 --set train.checkpoint_every=10 --set optim.warmup_steps=5 --set train.log_every=1
      --set train.steps=20 --set train.threads=1 --set train.grad_accum=4)
train() {  # train RUN RANKS ARGS...: 8 sequences a step in 4 micro-batches per pipe (2 sequences each)
  local run=$1 ranks=$2; shift 2
  "$DK" train "${SETS[@]}" --run-dir "$run" --nproc "$ranks" --set train.micro_batch=2 "$@" >/dev/null 2>"$run.log" \
    || { cat "$run.log"; fail "$run"; }
}
kinds=$({ "$DK" train "${SETS[@]}" --set residual.kind=? --run-dir none 2>&1 || true; } | grep -o '"[a-z_]*"' | tr -d '"')
[ "$(echo "$kinds" | wc -l)" -ge 7 ] || fail "could not list the pathway kinds: $kinds"

for kind in $kinds; do
  K=(--set residual.kind=$kind)
  train one_$kind 1 "${K[@]}"
  train pp2_$kind 2 "${K[@]}" --set train.pipeline_stages=2
  train pp4_$kind 4 "${K[@]}" --set train.pipeline_stages=4
  train vpp_$kind 2 "${K[@]}" --set train.pipeline_stages=2 --set train.virtual_stages=2 --set train.steps=6
  train six_$kind 1 "${K[@]}" --set train.steps=6
  if [ "$kind" = msar ]; then
    compare pp2_$kind one_$kind || fail "$kind: 2 stages differ from one rank"
    compare pp4_$kind one_$kind || fail "$kind: 4 stages differ from one rank"
  else
    compare pp2_$kind one_$kind --exact || fail "$kind: 2 stages differ from one rank"
    compare pp4_$kind one_$kind --exact || fail "$kind: 4 stages differ from one rank"
  fi
  compare vpp_$kind six_$kind --steps 6 --param-limit 1e-4 || fail "$kind: 2 × 2 virtual stages differ from one rank"
done
# The Full forms (a source per branch) and a block boundary inside a stage's chunk.
train full_attnres 2 --set residual.kind=attnres --set residual.block_sublayers=1 --set train.pipeline_stages=2
train full_msar 4 --set residual.kind=msar --set residual.block_sublayers=1 --set train.pipeline_stages=2 \
  --set train.virtual_stages=2 --set train.steps=6
train odd_dar 4 --set residual.kind=dar --set residual.block_sublayers=3 --set train.pipeline_stages=4
train odd_one 1 --set residual.kind=dar --set residual.block_sublayers=3
compare odd_dar odd_one --exact || fail "DAR with blocks across stage boundaries differs from one rank"
# MSAR reads a block's branches at its first (msar_block_read): a stage that starts mid-block
# reads the rest itself, and one that ends mid-block leaves its later reads unused.
train odd_msar 4 --set residual.kind=msar --set residual.block_sublayers=3 --set train.pipeline_stages=4
train odd_msar_one 1 --set residual.kind=msar --set residual.block_sublayers=3
compare odd_msar odd_msar_one || fail "MSAR with blocks across stage boundaries differs from one rank"

# The bytes sent forward over each boundary per micro-batch (summary.json), against the formula of
# docs/design.md: per token, b·d·(w·(n(ℓ) − n(h)) + c(ℓ)) after branch ℓ, where the receiver holds
# the sources up to branch h from its earlier chunk (none: n(h) = 0).
python3 - "$SRC" <<'PY'
import json
B, T, d, m, layers = 2, 64, 64, 4, 4
L = 2 * layers
def expected(run, kind, S, stages, virtual):
    chunks = stages * virtual
    first = lambda c: c * layers // chunks
    n = lambda l: 1 + l // S  # the embedding and the blocks closed by branch l
    out = []
    for c in range(chunks - 1):
        l = 2 * first(c + 1)
        held = n(2 * first(c + 2 - stages)) if c + 1 >= stages else 0
        partial = 1 if l % S else 0
        w, carried = {"residual": (0, 1), "mhc": (0, m), "attnres": (1, partial), "msar": (1, partial),
                      "attnres_sepv": (2, partial), "dar": (2, 2 * partial),
                      "attnres_mhc": (1, partial + m)}[kind]
        sources = n(l) - held if w else 0
        out.append(4 * B * T * d * (w * sources + carried))
    got = json.load(open(f"{run}/summary.json"))["pipeline_sent_bytes_per_micro_batch"]
    assert got == out, (run, got, out)
for kind in ["residual", "mhc", "attnres", "msar", "attnres_sepv", "dar", "attnres_mhc"]:
    expected(f"pp2_{kind}", kind, 2, 2, 1)
    expected(f"pp4_{kind}", kind, 2, 4, 1)
    expected(f"vpp_{kind}", kind, 2, 2, 2)
expected("full_attnres", "attnres", 1, 2, 1)
expected("full_msar", "msar", 1, 2, 2)
expected("odd_dar", "dar", 3, 4, 1)
# Block MSAR sends what Block AttnRes sends (MSAR §3.4): single-stream sources, never m streams.
sent = lambda run: json.load(open(f"{run}/summary.json"))["pipeline_sent_bytes_per_micro_batch"]
assert sent("pp4_msar") == sent("pp4_attnres"), (sent("pp4_msar"), sent("pp4_attnres"))
# Cross-stage caching: the third boundary sends only the sources made since the receiver's chunk.
assert sent("vpp_attnres")[2] < sent("pp4_attnres")[2], (sent("vpp_attnres"), sent("pp4_attnres"))
for run in ["pp2_dar", "pp4_dar", "vpp_dar"]:
    s = json.load(open(f"{run}/summary.json"))
    assert 0 < s["pipeline_bubble"] < 1, s["pipeline_bubble"]
PY

# Stages × data parallel: 2 stages of 2 ranks against 2 ranks without stages (1 sequence a
# micro-batch), with each ZeRO stage. ZeRO-0 and -1 are bit for bit. Under ZeRO-2 and -3 the
# pathway's own parameters, read by every stage, are averaged by one all-reduce after the last
# micro-batch, where ZeRO-2 reduce-scatters each micro-batch's: float32 rounding apart, held over
# the first 6 steps as the virtual stages are.
for zero in 0 1 2 3; do
  Z=(--set residual.kind=dar --set train.micro_batch=1 --set train.zero=$zero --set train.recompute=layer)
  if [ $zero -le 1 ]; then
    train dp_z$zero 2 "${Z[@]}"
    train ppdp_z$zero 4 "${Z[@]}" --set train.pipeline_stages=2
    compare ppdp_z$zero dp_z$zero --exact || fail "2 stages × 2 ranks, ZeRO-$zero, differ from 2 ranks"
  else
    train dp_z$zero 2 "${Z[@]}" --set train.steps=6
    train ppdp_z$zero 4 "${Z[@]}" --set train.pipeline_stages=2 --set train.steps=6
    compare ppdp_z$zero dp_z$zero --steps 6 || fail "2 stages × 2 ranks, ZeRO-$zero, differ from 2 ranks"
  fi
done
# bfloat16: the gradients crossing a boundary are rounded to bfloat16 once there, where one rank keeps
# a float32 sum (the residual stream, with no sources, stays bit for bit). The losses are held within
# bfloat16's resolution (2^-8) and the final parameters within 2e-2 (1e-2 measured); the gradient
# norms are not held: at this tiny model's loss spikes they move with any rounding (step 13: 0.89
# against 0.62).
train bf_one 1 --set residual.kind=dar --set train.dtype=bfloat16
train bf_pp 2 --set residual.kind=dar --set train.dtype=bfloat16 --set train.pipeline_stages=2
compare bf_pp bf_one --limit 4e-3 --param-limit 2e-2 --norm-limit 10 || fail "2 stages in bfloat16 differ from one rank"
train bf_res_one 1 --set residual.kind=residual --set train.dtype=bfloat16
train bf_res_pp 2 --set residual.kind=residual --set train.dtype=bfloat16 --set train.pipeline_stages=2
compare bf_res_pp bf_res_one --exact || fail "2 stages of the residual stream in bfloat16 differ from one rank"

# The MoE backbone, with the experts split over the 2 ranks of each stage: the parameters and gradient
# norms bit for bit; the logged loss adds the stages' parts (the last stage's cross-entropy, each
# stage's auxiliary terms) in float64, where one rank adds them in float32.
MOE=(--config "$SRC/configs/tiny-moe.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
     --set model.n_layers=4 --set model.d_ff=128 --set moe.expert_d_ff=32 --set moe.shared_d_ff=32 --set data.dir=data
     --set train.eval_tokens=2048 --set train.eval_every=10 --set train.checkpoint_every=10 --set optim.warmup_steps=5
     --set train.log_every=1 --set train.steps=20 --set train.threads=1 --set train.grad_accum=4 --set train.micro_batch=1
     --set residual.kind=dar)
"$DK" train "${MOE[@]}" --run-dir ep --nproc 2 --set moe.expert_parallel=2 >/dev/null 2>ep.log || { cat ep.log; fail ep; }
"$DK" train "${MOE[@]}" --run-dir ep_pp --nproc 4 --set moe.expert_parallel=2 --set train.pipeline_stages=2 >/dev/null \
  2>ep_pp.log || { cat ep_pp.log; fail ep_pp; }
compare ep_pp ep --limit 1e-6 --param-limit 1e-12 --norm-limit 1e-12 || fail "2 stages × experts over 2 differ from experts over 2"
python3 - <<'PY'
import json
a = [json.loads(l) for l in open("ep/metrics.jsonl") if "expert_load" in l]
b = [json.loads(l) for l in open("ep_pp/metrics.jsonl") if "expert_load" in l]
assert len(a) == len(b) == 20 and all(x["expert_load"] == y["expert_load"] for x, y in zip(a, b)), "expert loads differ"
PY

# Checkpoints across layouts: 2 stages stopped at step 7, resumed on one rank; one rank's on 2 × 2.
rc=0; "$DK" train "${SETS[@]}" --run-dir moved_pp --nproc 2 --set train.micro_batch=2 --set residual.kind=dar \
  --set train.pipeline_stages=2 --stop-after 7 >/dev/null 2>moved_pp.log || rc=$?
[ $rc = 130 ] || { cat moved_pp.log; fail "--stop-after 7 on 2 stages exited $rc, expected 130 (interrupted)"; }
"$DK" train --resume --run-dir moved_pp --set train.pipeline_stages=1 >/dev/null 2>r1.log \
  || { cat r1.log; fail "the 2-stage checkpoint did not resume on one rank"; }
compare moved_pp one_dar --exact || fail "2 stages resumed on one rank differ from the uninterrupted run"
rc=0; "$DK" train "${SETS[@]}" --run-dir moved_one --set train.micro_batch=2 --set residual.kind=dar --stop-after 7 \
  >/dev/null 2>moved.log || rc=$?
[ $rc = 130 ] || { cat moved.log; fail "--stop-after 7 exited $rc, expected 130 (interrupted)"; }
"$DK" train --resume --run-dir moved_one --nproc 4 --set train.pipeline_stages=2 --set train.micro_batch=1 >/dev/null \
  2>r2.log || { cat r2.log; fail "one rank's checkpoint did not resume on 2 stages × 2 ranks"; }
compare moved_one one_dar || fail "one rank resumed on 2 stages × 2 ranks differs from the uninterrupted run"

# Bad layouts: one line naming the keys, before any rank starts, nothing written.
refused() {  # refused PATTERN ARGS...
  local pattern=$1; shift
  out=$("$DK" train "${SETS[@]}" --run-dir refused "$@" 2>&1) && fail "accepted: $*"
  [ "$(echo "$out" | wc -l)" = 1 ] && echo "$out" | grep -q "$pattern" || fail "refused unclearly ($*): $out"
  [ ! -e refused ] || fail "a refused layout left refused/ behind ($*)"
}
refused "'train.pipeline_stages' × 'train.virtual_stages' (8 × 1 = 8) exceeds model.n_layers (4)" \
  --set train.pipeline_stages=8 --nproc 8
refused "'train.pipeline_stages' × 'train.virtual_stages' (2 × 4 = 8) exceeds model.n_layers (4)" \
  --set train.pipeline_stages=2 --set train.virtual_stages=4 --nproc 2
refused "key 'train.pipeline_stages' (3) must divide the number of ranks (4)" --set train.pipeline_stages=3 --nproc 4
refused "key 'train.pipeline_stages' (2) must divide the number of ranks (1)" --set train.pipeline_stages=2
refused "key 'train.virtual_stages' is 2, which needs key 'train.pipeline_stages' > 1" --set train.virtual_stages=2
refused "key 'train.grad_accum' (3) must be a multiple of key 'train.pipeline_stages' (2)" \
  --set train.pipeline_stages=2 --set train.virtual_stages=2 --set train.grad_accum=3 --nproc 2
echo "cli_pipeline: OK"
