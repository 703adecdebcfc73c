#!/usr/bin/env bash
# Many processes on c10d with Gloo (docs/training.md, "Many processes"), each run launched here:
#   - 2 ranks x accumulation 1 equal 1 rank x accumulation 2 (per-step losses, final parameters)
#     for residual, dar and msar;
#   - ZeRO-1 equals unsharded, byte for byte; a 2-rank checkpoint resumes on 1 rank with the
#     uninterrupted run's losses and parameters, and a resume that changes the global batch is refused;
#   - torchrun (from the pip torch) launches `depthkit train`;
#   - the job speaks once: a killed rank is named by the launcher in one line (exit 1); what every
#     rank would find wrong alike is found by the launcher before any rank starts; the launcher
#     killed, its ranks stop with a checkpoint that resumes;
#   - hand-launched ranks that disagree (config keys, data, WORLD_SIZE, a RANK taken twice) are
#     refused at the rendezvous in one line naming what differs; a missing store or peer, and the
#     store's host killed, are one line each, without c10d's own log lines.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
"$DK" data prepare --input "$CORPUS" --out data --vocab-size 512 --val-fraction 0.2 --json >/dev/null
SETS=(--config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64
      --set model.d_ff=128 --set model.n_layers=2 --set train.micro_batch=4 --set data.dir=data
      --set train.eval_tokens=2048 --set train.eval_every=10 --set train.checkpoint_every=10
      --set optim.warmup_steps=5 --set train.log_every=1 --set train.steps=20)

# compare A B [--exact]: per-step losses within 1e-5 relative and the final parameters within
# float32 rounding, or identical with --exact (tests/compare_runs.py).
compare() { python3 "$SRC/tests/compare_runs.py" "$@"; }

for kind in residual dar msar; do
  "$DK" train "${SETS[@]}" --set residual.kind=$kind --run-dir two_$kind --nproc 2 >/dev/null 2>two_$kind.log \
    || { cat two_$kind.log; fail "$kind: 2 ranks"; }
  "$DK" train "${SETS[@]}" --set residual.kind=$kind --set train.grad_accum=2 --set train.threads=1 \
    --run-dir one_$kind >/dev/null 2>one_$kind.log || { cat one_$kind.log; fail "$kind: 1 rank"; }
  [ "$(json '["world_size"]' <two_$kind/summary.json)" = 2 ] || fail "$kind: summary world_size"
  compare two_$kind one_$kind || fail "$kind: 2 ranks x accumulation 1 differ from 1 rank x accumulation 2"
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
compare moved two_residual --exact || fail "the 2-rank checkpoint resumed on 1 rank differs from the uninterrupted run"

# torchrun launches the program itself (its agent hosts the store).
timeout 300 torchrun --nproc-per-node 2 --no-python "$DK" train "${SETS[@]}" --run-dir torchrun >/dev/null 2>torchrun.log \
  || { cat torchrun.log; fail "torchrun"; }
compare torchrun two_residual --exact || fail "torchrun's run differs from --nproc's"

# One line from one process: every failure below must leave exactly one line on stderr (besides
# the progress lines of a run that started) and exit below 128.
errors_only() { grep -v -e '^run directory ' -e '^train \[' -e '^stopped at step' "$1"; }
expect_error() {  # expect_error PATTERN COMMAND...
  local pattern=$1; shift
  rc=0; "$@" >/dev/null 2>err.log || rc=$?
  [ $rc != 0 ] && [ $rc -lt 128 ] && [ "$(errors_only err.log | wc -l)" = 1 ] && grep -q -e "$pattern" err.log \
    || { cat err.log; fail "expected one line matching '$pattern' and an exit in [1, 127], got $rc"; }
}

# A rank killed mid-run: the job stops within seconds, and its launcher says which rank, once, exit 1.
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
[ $rc = 1 ] || { cat killed.log; fail "the job exited $rc after rank 1 was killed, expected 1"; }
[ $took -lt 20 ] || fail "the job took $took s to stop (train.timeout_s = 20)"
[ "$(errors_only killed.log | wc -l)" = 1 ] && grep -q "rank 1 was ended by signal 9 (SIGKILL)" killed.log \
  || { cat killed.log; fail "the job did not name the killed rank in one line"; }

# The launcher killed: its ranks stop within seconds (SIGTERM from the kernel: checkpoint and stop),
# and the checkpoint they leave resumes.
"$DK" train "${LONG[@]}" --run-dir orphaned --nproc 2 2>orphaned.log >/dev/null &
launcher=$!
for _ in $(seq 300); do [ -s orphaned/metrics.jsonl ] && break; sleep 0.1; done
ranks=$(pgrep -P $launcher | tr '\n' ' ')
[ -n "$ranks" ] || fail "the launcher's ranks not found"
kill -9 $launcher
wait $launcher 2>/dev/null || true
for _ in $(seq 200); do
  alive=0; for p in $ranks; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 0.1
done
[ $alive = 0 ] || { kill -9 $ranks 2>/dev/null; fail "ranks trained on for 20 s after their launcher died"; }
grep -q "stopped at step" orphaned.log || { cat orphaned.log; fail "the orphaned ranks did not stop with a checkpoint"; }
step=$(sed 's/step_0*//' orphaned/checkpoints/latest)
"$DK" train --resume --run-dir orphaned --set train.steps=$((step + 2)) --nproc 2 >/dev/null 2>resumed.log \
  || { cat resumed.log; fail "the orphaned ranks' checkpoint does not resume"; }

# Ctrl-C reaches the launcher: every rank stops at the same step, rank 0 checkpoints it, exit 130.
"$DK" train "${LONG[@]}" --run-dir interrupted --nproc 2 2>interrupted.log >/dev/null &
launcher=$!
for _ in $(seq 300); do [ -s interrupted/metrics.jsonl ] && break; sleep 0.1; done
kill -INT $launcher
rc=0; wait $launcher || rc=$?
[ $rc = 130 ] || { cat interrupted.log; fail "the interrupted job exited $rc, expected 130"; }
[ -f interrupted/checkpoints/latest ] || fail "the interrupted job left no checkpoint"
grep -q "stopped at step" interrupted.log || fail "the interrupted job did not say where it stopped"

# What every rank would find wrong alike is found by the launcher, before any rank starts: one line.
expect_error "nowhere: data directory not found" "$DK" train "${SETS[@]}" --set data.dir=nowhere --run-dir bad --nproc 3
expect_error "two_residual: run directory already has checkpoints" "$DK" train "${SETS[@]}" --run-dir two_residual --nproc 3
expect_error "vocab_size 512 exceeds model.vocab_size 100" "$DK" train "${SETS[@]}" --set model.vocab_size=100 --run-dir bad --nproc 3
# (More ranks than any machine has GPUs: refused here whether or not this one has some.)
expect_error "CUDA" "$DK" train "${SETS[@]}" --set train.device=cuda --run-dir bad --nproc 1024
expect_error "global batch of 8 sequences" "$DK" train --resume --run-dir moved --set train.steps=30 \
  --set train.grad_accum=2 --nproc 2
"$DK" train "${LONG[@]}" --run-dir locked >/dev/null 2>holder.log &
holder=$!
for _ in $(seq 300); do [ -s locked/metrics.jsonl ] && break; sleep 0.1; done
expect_error "locked: in use by another run" "$DK" train "${LONG[@]}" --run-dir locked --nproc 3
kill -INT $holder; wait $holder || true

# Malformed launch variables and keys: one line naming them, before anything starts.
expect_error "environment variable RANK='5' must be an integer in \[0, 1\]" \
  env RANK=5 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 "$DK" train "${SETS[@]}" --run-dir bad
expect_error "environment variable MASTER_PORT is not set" env -u MASTER_PORT RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
  "$DK" train "${SETS[@]}" --run-dir bad
expect_error "--nproc given inside a launched job" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
  "$DK" train "${SETS[@]}" --run-dir bad --nproc 2
expect_error 'train.backend = "nccl" needs train.device = "cuda"' "$DK" train "${SETS[@]}" --set train.backend=nccl --nproc 2 --run-dir bad
# A rank that never comes: the other names it after train.timeout_s. A store nobody hosts, or an
# address that does not resolve: one line, without c10d's own log lines and stack traces.
port() {  # a port the kernel says is free now
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
expect_error "rank 1 never joined the job" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) \
  "$DK" train "${SETS[@]}" --set train.timeout_s=3 --run-dir lonely
expect_error "rank 1: cannot reach the rendezvous store at 127.0.0.1:" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=$(port) "$DK" train "${SETS[@]}" --set train.timeout_s=1 --run-dir lonely
expect_error "cannot reach the rendezvous store at no-such-host.invalid:" env RANK=1 WORLD_SIZE=2 \
  MASTER_ADDR=no-such-host.invalid MASTER_PORT=$(port) "$DK" train "${SETS[@]}" --set train.timeout_s=1 --run-dir lonely
[ ! -e bad ] && [ ! -e lonely ] || fail "a refused job left a run directory"

# Hand-launched ranks (torchrun's variables) that disagree: each refuses at the rendezvous, in one
# line naming what differs, before anything is written. hand RANK WORLD_SIZE PORT ARGS...
hand() {
  local rank=$1 size=$2 port=$3; shift 3
  env RANK=$rank WORLD_SIZE=$size MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$DK" train "${SETS[@]}" \
    --set train.timeout_s=10 --set train.threads=1 --run-dir mismatched "$@"
}
both_refuse() {  # both_refuse PATTERN RANK1_ARGS...: rank 0 as SETS has it, rank 1 with the arguments
  local pattern=$1 p; shift
  p=$(port)
  hand 0 2 "$p" >/dev/null 2>rank0.log & local a=$!
  hand 1 2 "$p" "$@" >/dev/null 2>rank1.log & local b=$!
  local rc0=0 rc1=0; wait $a || rc0=$?; wait $b || rc1=$?
  for r in 0 1; do
    local rc; [ $r = 0 ] && rc=$rc0 || rc=$rc1
    [ $rc != 0 ] && [ $rc -lt 128 ] && [ "$(wc -l <rank$r.log)" = 1 ] && grep -q -e "$pattern" rank$r.log \
      || { cat rank$r.log; fail "rank $r (rank 1 with $*): exit $rc, expected one line matching '$pattern'"; }
  done
  [ ! -e mismatched ] || fail "ranks that disagree ($*) left a run directory"
}
both_refuse "train.seed = 7 (rank 0: 42)" --set train.seed=7
both_refuse "train.data_seed = 3 (rank 0: -1)" --set train.data_seed=3
both_refuse "optim.lr = 0.001 (rank 0: 0.003)" --set optim.lr=0.001
both_refuse "train.micro_batch = 2 (rank 0: 4)" --set train.micro_batch=2
both_refuse "train.dtype = 'bfloat16' (rank 0: 'float32')" --set train.dtype=bfloat16
both_refuse "model.d_ff = 256 (rank 0: 128)" --set model.d_ff=256
both_refuse "train.steps = 21 (rank 0: 20)" --set train.steps=21
both_refuse "train.zero = 1 (rank 0: 0)" --set train.zero=1
"$DK" data prepare --input "$CORPUS" --out other_data --vocab-size 512 --val-fraction 0.2 --seed 7 >/dev/null 2>&1
both_refuse "data (meta.json, shard names and sizes)" --set data.dir=other_data
# Launched with another WORLD_SIZE: named at once, not after train.timeout_s (60 s here).
p=$(port); start=$(date +%s)
hand 0 2 "$p" --set train.timeout_s=60 >/dev/null 2>rank0.log & a=$!
hand 1 3 "$p" --set train.timeout_s=60 >/dev/null 2>rank1.log & b=$!
rc0=0; rc1=0; wait $a || rc0=$?; wait $b || rc1=$?
[ $rc0 = 1 ] && [ $rc1 = 1 ] && [ $(( $(date +%s) - start )) -lt 30 ] && grep -q "WORLD_SIZE=3" rank0.log \
  && grep -q "WORLD_SIZE=2" rank1.log && [ "$(cat rank0.log rank1.log | wc -l)" = 2 ] \
  || { cat rank0.log rank1.log; fail "ranks launched with WORLD_SIZE 2 and 3 were not refused at once, by name"; }
# Two processes with the same RANK: the second is refused, naming it.
p=$(port)
PAIR=(env WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p "$DK" train "${LONG[@]}" --set train.timeout_s=5
      --set train.threads=1 --run-dir mismatched)
env RANK=0 "${PAIR[@]}" >/dev/null 2>rank0.log & a=$!
env RANK=1 "${PAIR[@]}" >/dev/null 2>rank1.log & b=$!
for _ in $(seq 300); do [ -s mismatched/metrics.jsonl ] && break; sleep 0.1; done
[ -s mismatched/metrics.jsonl ] || { cat rank0.log rank1.log; fail "the hand-launched pair did not start"; }
expect_error "RANK=1 is claimed by 2 processes" hand 1 2 "$p" --set train.steps=100000
# The store's host (rank 0) killed in a hand launch: the survivor says so in one line.
kill -9 $a
rc=0; wait $b || rc=$?
[ $rc != 0 ] && [ $rc -lt 128 ] && [ "$(errors_only rank1.log | wc -l)" = 1 ] && grep -q "rank 0 is gone" rank1.log \
  || { cat rank1.log; fail "rank 1 did not name rank 0 in one line after it was killed (exit $rc)"; }
wait $a 2>/dev/null || true
echo "cli_distributed: ok"
