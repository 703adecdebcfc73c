#!/usr/bin/env bash
# Many processes on c10d with Gloo (docs/training.md, "Many processes"), each run launched here:
#   - 2 ranks x accumulation 1 equal 1 rank x accumulation 2 (per-step losses, final parameters)
#     for residual, dar and msar;
#   - ZeRO-1 equals unsharded, byte for byte; a 2-rank checkpoint resumes on 1 rank with the
#     uninterrupted run's losses and parameters, and a resume that changes the global batch is refused;
#   - torchrun (from the pip torch) launches `depthkit train`;
#   - a killed rank makes the other exit non-zero within train.timeout_s, naming it; a rank that
#     fails at start-up is named by the others.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
"$DK" data prepare --input "$CORPUS" --out data --vocab-size 512 --val-fraction 0.2 --json >/dev/null
SETS=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
      --set model.d_ff=128 --set model.n_layers=2 --set train.micro_batch=4 --set data.dir=data
      --set train.eval_tokens=2048 --set train.eval_every=10 --set train.checkpoint_every=10
      --set optim.warmup_steps=5 --set train.log_every=1 --set train.steps=20)

# compare.py A B [--exact]: per-step losses (metrics.jsonl) within 1e-5 relative and the final
# parameters within float32 rounding (1e-5 of max(1, |p|)), or identical with --exact.
cat >compare.py <<'EOF'
import json, struct, sys
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

def losses(run):
    return {j["step"]: j["loss"] for j in map(json.loads, open(f"{run}/metrics.jsonl")) if "loss" in j}

a, b, exact = sys.argv[1], sys.argv[2], "--exact" in sys.argv
la, lb = losses(a), losses(b)
assert la.keys() == lb.keys() and len(la) == 20, f"steps {sorted(la)} vs {sorted(lb)}"
worst_loss = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in la)
ta = tensors(f"{a}/checkpoints/step_00000020/model.safetensors")
tb = tensors(f"{b}/checkpoints/step_00000020/model.safetensors")
assert ta.keys() == tb.keys()
worst_param = max(float(np.max(np.abs(ta[k].astype(np.float64) - tb[k]) / max(1.0, float(np.abs(tb[k]).max())))) for k in ta)
print(f"{a} vs {b}: losses {worst_loss:.2e}, parameters {worst_param:.2e} (largest relative difference)")
limit = 0 if exact else 1e-5
sys.exit(0 if worst_loss <= limit and worst_param <= limit else 1)
EOF

for kind in residual dar msar; do
  "$DK" train "${SETS[@]}" --set residual.kind=$kind --run-dir two_$kind --nproc 2 >/dev/null 2>two_$kind.log \
    || { cat two_$kind.log; fail "$kind: 2 ranks"; }
  "$DK" train "${SETS[@]}" --set residual.kind=$kind --set train.grad_accum=2 --set train.threads=1 \
    --run-dir one_$kind >/dev/null 2>one_$kind.log || { cat one_$kind.log; fail "$kind: 1 rank"; }
  [ "$(json '["world_size"]' <two_$kind/summary.json)" = 2 ] || fail "$kind: summary world_size"
  python3 compare.py two_$kind one_$kind || fail "$kind: 2 ranks x accumulation 1 differ from 1 rank x accumulation 2"
done

# ZeRO-1: the same arithmetic, sharded: identical parameters and optimizer state (one thread a
# rank: the same ATen code path for every element); half the state.
"$DK" train "${SETS[@]}" --run-dir zero --nproc 2 --set train.zero=1 >/dev/null 2>zero.log || { cat zero.log; fail "zero"; }
cmp -s zero/checkpoints/step_00000020/model.safetensors two_residual/checkpoints/step_00000020/model.safetensors \
  || fail "ZeRO-1 parameters differ from unsharded"
cmp -s zero/checkpoints/step_00000020/optimizer.safetensors two_residual/checkpoints/step_00000020/optimizer.safetensors \
  || fail "ZeRO-1 optimizer state differs from unsharded"
full=$(json '["optimizer_state_bytes_per_rank"]' <two_residual/summary.json)
half=$(json '["optimizer_state_bytes_per_rank"]' <zero/summary.json)
# Half, up to the alignment of the shard boundary (under 64 elements x 2 moments x 4 bytes).
[ $((2 * half)) -ge "$full" ] && [ $((2 * half - full)) -le $((2 * 64 * 2 * 4)) ] \
  || fail "ZeRO-1 per-rank optimizer state $half bytes, unsharded $full"
grep -q "ZeRO-1: AdamW state of" zero.log || fail "ZeRO-1 does not report its per-rank state"

# A 2-rank ZeRO-1 checkpoint resumes on 1 rank (keeping the global batch) with the uninterrupted
# run's losses and parameters; a resume that would change the global batch is refused.
rc=0; "$DK" train "${SETS[@]}" --run-dir moved --nproc 2 --set train.zero=1 --stop-after 7 >/dev/null 2>moved.log || rc=$?
[ $rc = 130 ] || { cat moved.log; fail "--stop-after 7 exited $rc, expected 130 (interrupted)"; }
rc=0; "$DK" train --resume --run-dir moved >/dev/null 2>refused.log || rc=$?
[ $rc = 1 ] && grep -q "global batch of 8 sequences.*--set train.grad_accum=2" refused.log \
  || { cat refused.log; fail "a resume with another global batch was not refused"; }
"$DK" train --resume --run-dir moved --set train.grad_accum=2 >/dev/null 2>resumed.log || { cat resumed.log; fail "resume on 1 rank"; }
python3 compare.py moved two_residual --exact || fail "the 2-rank checkpoint resumed on 1 rank differs from the uninterrupted run"

# torchrun launches the program itself (its agent hosts the store).
timeout 300 torchrun --nproc-per-node 2 --no-python "$DK" train "${SETS[@]}" --run-dir torchrun >/dev/null 2>torchrun.log \
  || { cat torchrun.log; fail "torchrun"; }
python3 compare.py torchrun two_residual --exact || fail "torchrun's run differs from --nproc's"

# A rank killed mid-run: the other stops within train.timeout_s, naming it.
LONG=("${SETS[@]}" --set train.steps=100000 --set train.checkpoint_every=0 --set train.timeout_s=20)
"$DK" train "${LONG[@]}" --run-dir killed --nproc 2 2>killed.log >/dev/null &
launcher=$!
for _ in $(seq 300); do [ -s killed/metrics.jsonl ] && break; sleep 0.1; done
[ -s killed/metrics.jsonl ] || fail "the 2-rank run did not start"
rank1=""
for c in $(pgrep -P $launcher); do tr '\0' '\n' </proc/$c/environ | grep -qx RANK=1 && rank1=$c; done
[ -n "$rank1" ] || fail "rank 1 not found among the launcher's children"
start=$(date +%s)
kill -9 "$rank1"
rc=0; wait $launcher || rc=$?
took=$(( $(date +%s) - start ))
[ $rc != 0 ] || fail "the job exited 0 after rank 1 was killed"
[ $took -lt 20 ] || fail "the job took $took s to stop (train.timeout_s = 20)"
grep -q "rank 0 stops: rank 1 is gone" killed.log || { cat killed.log; fail "rank 0 did not name the dead rank"; }

# Ctrl-C reaches the launcher: every rank stops at the same step, rank 0 checkpoints it, exit 130.
"$DK" train "${LONG[@]}" --run-dir interrupted --nproc 2 2>interrupted.log >/dev/null &
launcher=$!
for _ in $(seq 300); do [ -s interrupted/metrics.jsonl ] && break; sleep 0.1; done
kill -INT $launcher
rc=0; wait $launcher || rc=$?
[ $rc = 130 ] || { cat interrupted.log; fail "the interrupted job exited $rc, expected 130"; }
[ -f interrupted/checkpoints/latest ] || fail "the interrupted job left no checkpoint"
grep -q "stopped at step" interrupted.log || fail "the interrupted job did not say where it stopped"

# A rank that fails at start-up (rank 0 cannot take the run directory's lock) is named by the others.
"$DK" train "${LONG[@]}" --run-dir locked >/dev/null 2>holder.log &
holder=$!
for _ in $(seq 300); do [ -s locked/metrics.jsonl ] && break; sleep 0.1; done
rc=0; "$DK" train "${LONG[@]}" --run-dir locked --nproc 2 >/dev/null 2>locked.log || rc=$?
kill -INT $holder; wait $holder || true
[ $rc != 0 ] || fail "a job whose rank 0 could not lock the run directory exited 0"
grep -q "rank 0 failed during start-up" locked.log || { cat locked.log; fail "rank 1 did not name rank 0's failure"; }
# Malformed launch variables and keys: one line naming them, before anything starts.
expect_error() {  # expect_error PATTERN COMMAND...
  local pattern=$1; shift
  rc=0; "$@" >/dev/null 2>err.log || rc=$?
  [ $rc != 0 ] && [ "$(wc -l <err.log)" = 1 ] && grep -q -e "$pattern" err.log || { cat err.log; fail "expected one line matching '$pattern'"; }
}
expect_error "environment variable RANK='5' must be an integer in \[0, 1\]" \
  env RANK=5 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 "$DK" train "${SETS[@]}" --run-dir bad
expect_error "environment variable MASTER_PORT is not set" env -u MASTER_PORT RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
  "$DK" train "${SETS[@]}" --run-dir bad
expect_error "--nproc given inside a launched job" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
  "$DK" train "${SETS[@]}" --run-dir bad --nproc 2
expect_error 'train.backend = "nccl" needs train.device = "cuda"' "$DK" train "${SETS[@]}" --set train.backend=nccl --nproc 2 --run-dir bad
# A rank that never comes: the other names it after train.timeout_s.
expect_error "rank 1 never joined the job" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + RANDOM % 300)) \
  "$DK" train "${SETS[@]}" --set train.timeout_s=3 --run-dir lonely
[ ! -e bad ] && [ ! -e lonely ] || fail "a refused job left a run directory"
echo "cli_distributed: ok"
