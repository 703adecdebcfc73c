#!/usr/bin/env bash
# Faults during training (issue 14): kill -9 at random moments of a run that checkpoints every
# step. After each kill the latest checkpoint loads (eval succeeds on it), and --resume carries the
# run on; at the end its losses (metrics.jsonl) and final weights equal an uninterrupted run's
# bit for bit. Also: two trainings into one directory (the second is refused, naming the first's
# PID), a shard that shrinks under a running training (one line naming it, no SIGBUS), and
# --resume of a finished run (says so, changes nothing).
#   DEPTHKIT_FAULT_KILLS  number of kill -9 (default 6); DEPTHKIT_FAULT_SEED (default 1)
set -uo pipefail
source "$(dirname "$0")/lib.sh" "$@"
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$TMP"' EXIT  # no training outlives the test
RANDOM=${DEPTHKIT_FAULT_SEED:-1}
KILLS=${DEPTHKIT_FAULT_KILLS:-6}

CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
"$DK" data prepare --input "$CORPUS" --out data --vocab-size 512 --val-fraction 0.2 >/dev/null 2>&1 || fail "data prepare"
SETS=(--set model.vocab_size=512 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
      --set model.n_layers=1 --set model.n_heads=2 --set model.n_kv_heads=1 --set train.micro_batch=2
      --set data.dir=data --set train.eval_tokens=256 --set train.eval_every=0 --set train.checkpoint_every=1
      --set train.keep_checkpoints=2 --set optim.warmup_steps=5 --set train.log_every=1 --set train.threads=1
      --set residual.kind=dar)
STEPS=150
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=$STEPS --run-dir whole >/dev/null 2>&1 \
  || fail "uninterrupted run"

# The killed run: started, killed at a random moment, checked, resumed, until it finishes.
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=$STEPS --run-dir killed >/dev/null 2>&1 &
pid=$!
kills=0
while :; do
  sleep "0.$((RANDOM % 9 + 1))"
  if ! kill -0 $pid 2>/dev/null; then wait $pid || fail "the run failed on its own"; break; fi
  kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
  kills=$((kills + 1))
  if [ -f killed/checkpoints/latest ]; then
    "$DK" eval --run-dir killed --tokens 64 >/dev/null 2>eval.err || { cat eval.err; fail "latest checkpoint after kill $kills does not load"; }
    latest=$(cat killed/checkpoints/latest)
    [ -d "killed/checkpoints/$latest" ] || fail "latest names a missing checkpoint after kill $kills"
    args=(--resume --run-dir killed)
  else
    rm -rf killed  # killed before its first checkpoint: start again
    args=(--config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=$STEPS --run-dir killed)
  fi
  if [ $kills -ge "$KILLS" ]; then
    "$DK" train "${args[@]}" >/dev/null 2>resume.err || { cat resume.err; fail "final resume"; }
    break
  fi
  "$DK" train "${args[@]}" >/dev/null 2>&1 &
  pid=$!
done
[ "$(cat killed/checkpoints/latest)" = "step_$(printf %08d $STEPS)" ] || fail "the killed run did not finish"
cmp -s whole/checkpoints/step_$(printf %08d $STEPS)/model.safetensors killed/checkpoints/step_$(printf %08d $STEPS)/model.safetensors \
  || fail "final weights differ after $kills kills"
python3 - whole/metrics.jsonl killed/metrics.jsonl $STEPS <<'PY' || fail "losses differ after kills"
import json, sys
def losses(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert a == b and len(a) == int(sys.argv[3]), (len(a), len(b))
PY
echo "cli_faults: $kills kills, resumed bit-identically"

# --resume of a finished run: one line saying so, exit 0, nothing changed.
before=$(cd whole && find . -type f -exec sha1sum {} + | sort)
"$DK" train --resume --run-dir whole >out.txt 2>err.txt || fail "--resume of a finished run failed"
grep -q "the run is complete (step $STEPS of $STEPS)" err.txt || { cat err.txt; fail "no 'complete' message"; }
[ "$before" = "$(cd whole && find . -type f -exec sha1sum {} + | sort)" ] || fail "--resume of a finished run changed files"

# A resumed run that meets bad data before its next checkpoint puts back what it changed.
cp -r data data3
python3 - data3/train_000000.bin <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[1024:] = b"\xff" * (len(b) - 1024)  # every id 65535, past the vocabulary
open(sys.argv[1], "wb").write(b)
PY
"$DK" train --resume --run-dir whole --set train.steps=$((STEPS + 5)) --set data.dir=data3 >/dev/null 2>err.txt \
  && fail "a run on ids past the vocabulary trained"
grep -q "data3/train_000000.bin: token id 65535" err.txt || { cat err.txt; fail "bad-id message"; }
[ "$before" = "$(cd whole && find . -type f -exec sha1sum {} + | sort)" ] || fail "a failed resume changed the run's files"

# Two trainings into one directory: the second is refused at once, naming the first's PID.
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=100000 --run-dir busy >/dev/null 2>&1 &
pid=$!
for _ in $(seq 400); do [ -f busy/metrics.jsonl ] && break; sleep 0.05; done
"$DK" train --resume --run-dir busy >/dev/null 2>err.txt && fail "a second training into a busy directory ran"
grep -q "in use by another run (process $pid holds its lock)" err.txt || { cat err.txt; fail "lock message"; }
[ "$(wc -l <err.txt)" -eq 1 ] || fail "lock message is not one line"

# The running training's shard shrinks: it stops with one line naming the shard, not SIGBUS.
cp -r data data2 && rm -f busy2
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set data.dir=data2 --set train.steps=100000 \
  --run-dir busy2 >/dev/null 2>shrink.err &
pid2=$!
for _ in $(seq 400); do [ -f busy2/metrics.jsonl ] && break; sleep 0.05; done
truncate -s 2048 data2/train_000000.bin
rc=0; wait $pid2 || rc=$?
[ $rc -eq 1 ] || { cat shrink.err; fail "shrunk shard: exit code $rc, expected 1"; }
tail -n 1 shrink.err | grep -q "data2/train_000000.bin: shard changed while in use" || { cat shrink.err; fail "shrink message"; }
kill -INT $pid; wait $pid
echo "cli_faults: passed"
