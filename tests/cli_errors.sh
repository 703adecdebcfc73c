#!/usr/bin/env bash
# Bad input to every command: a non-zero exit, exactly one line on stderr that names the
# problem, no crash, and nothing half-written.
set -uo pipefail
source "$(dirname "$0")/lib.sh" "$@"
failures=0; checks=0

# expect_error EXPECTED_SUBSTRING -- ARGS...
expect_error() {
  local want=$1; shift; shift
  checks=$((checks + 1))
  "$DK" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$? lines
  lines=$(wc -l <"$TMP/err")
  if [ $rc -eq 0 ] || [ $rc -ge 128 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$want" "$TMP/err"; then
    echo "FAIL: depthkit $* -> rc=$rc, $lines stderr lines, wanted '$want':"; cat "$TMP/err"
    failures=$((failures + 1))
  fi
}

printf '[model]\nn_layer = 3\n' >unknown.toml
printf '[model]\nn_layers = "four"\n' >wrongtype.toml
printf '[model\n' >syntax.toml
mkdir -p badshards && head -c 2048 /dev/zero | tr '\0' 'g' >badshards/train_000000.bin && cp badshards/train_000000.bin badshards/val_000000.bin

expect_error "unknown command 'frobnicate'" -- frobnicate
expect_error "--nope"                  -- train --nope
expect_error "missing.toml"            -- train --config missing.toml
expect_error "unknown key 'model.n_layer'" -- params --config unknown.toml
expect_error "'model.n_layers' must be an integer" -- params --config wrongtype.toml
expect_error "syntax.toml:1"           -- params --config syntax.toml
expect_error "'model.n_layers' must be in [1, 4096], got 0" -- params --config "$SRC/configs/tiny.toml" --set model.n_layers=0
expect_error "unknown key 'model.bogus'" -- bench --config "$SRC/configs/tiny.toml" --set model.bogus=1
expect_error "--steps"                 -- bench --config "$SRC/configs/tiny.toml" --steps 0
expect_error "'residual.kind'"         -- bench --config "$SRC/configs/tiny.toml" --kinds residual,bogus
expect_error "--kinds: empty item"     -- bench --config "$SRC/configs/tiny.toml" --kinds residual,,dar
expect_error "tiny, 0.1b or all"       -- bench --ops huge
expect_error "'moe.expert_impl'"       -- bench --config "$SRC/configs/tiny-moe.toml" --set moe.expert_impl=fast
expect_error "moe.expert_d_ff (6)"     -- bench --config "$SRC/configs/tiny-moe.toml" --set moe.expert_impl=grouped --set moe.expert_d_ff=6
expect_error "--variant \"x:\": empty override" -- bench --config "$SRC/configs/tiny-moe.toml" --variant x:
expect_error "NAME[:section.key=value" -- bench --config "$SRC/configs/tiny-moe.toml" --variant moe.expert_impl=loop
expect_error "--kinds"                 -- bench --config "$SRC/configs/tiny-moe.toml" --variant a --kinds residual,dar
expect_error "the name 'a' is given twice" -- bench --config "$SRC/configs/tiny-moe.toml" --variant a --variant a:moe.top_k=1
expect_error "variant 'b': --set moe.bogus=1: unknown key 'moe.bogus'" -- bench --config "$SRC/configs/tiny-moe.toml" --variant a --variant b:moe.bogus=1
expect_error "variant 'b': key 'moe.expert_impl'" -- bench --config "$SRC/configs/tiny-moe.toml" --variant a --variant b:moe.expert_impl=grouped,train.dtype=bfloat16,moe.expert_d_ff=4
expect_error "--config is required"    -- bench --steps 2
expect_error "/nonexistent/input"      -- data prepare --input /nonexistent/input --out prepared
[ -e prepared ] && { echo "FAIL: data prepare left 'prepared' behind"; failures=$((failures + 1)); }
expect_error "--out"                   -- data prepare --input "$SRC/README.md"
expect_error "data directory not found" -- train --config "$SRC/configs/tiny.toml" --set data.dir=nowhere --run-dir run1
[ -e run1 ] && { echo "FAIL: train with bad data left run1 behind"; failures=$((failures + 1)); }
expect_error "wrong magic"             -- train --config "$SRC/configs/tiny.toml" --set data.dir=badshards --run-dir run2
[ -e run2 ] && { echo "FAIL: train with bad shards left run2 behind"; failures=$((failures + 1)); }
mkdir -p bigvocab && cp "$SRC/tests/cli_errors.sh" bigvocab/dummy && printf '{"vocab_size": 9000}' >bigvocab/meta.json
expect_error "meta.json: vocab_size 9000 exceeds model.vocab_size 4096" -- train --config "$SRC/configs/tiny.toml" --set data.dir=bigvocab --run-dir run3
expect_error "nowhere: not found (expected a run directory)" -- eval --run-dir nowhere
expect_error "README.md: is a regular file, not a run directory" -- eval --run-dir "$SRC/README.md"
# Issue 30: numbers parsed whole and range checked, in one place (bad usage: exit 2); integers
# printed as integers.
expect_usage() {  # expect_usage EXPECTED_SUBSTRING -- ARGS...: as expect_error, and the exit is 2
  local before=$failures rc
  expect_error "$@"
  shift 2; "$DK" "$@" >/dev/null 2>&1; rc=$?
  [ $failures = "$before" ] && [ $rc != 2 ] && { echo "FAIL: depthkit $* exited $rc, expected 2"; failures=$((failures + 1)); }
  return 0
}
expect_usage "--temperature='' must be a finite number >= 0" -- generate --run-dir nowhere --prompt x --temperature ''
expect_usage "--seed='-1' must be an integer >= 0" -- generate --run-dir nowhere --prompt x --seed -1
expect_usage "--top-p='0' must be a finite number in (0, 1]" -- generate --run-dir nowhere --prompt x --top-p 0
expect_usage "--val-fraction='1' must be a finite number in (0, 1)" -- data prepare --input x --out y --val-fraction 1
expect_usage "--limit='9223372036854775808' must be an integer >= 1" -- eval --run-dir nowhere --task t.jsonl --limit 9223372036854775808
expect_usage "--decode: an empty value" -- bench --config "$SRC/configs/tiny.toml" --decode ''
expect_usage "--kinds: an empty value" -- bench --config "$SRC/configs/tiny.toml" --kinds ''
expect_usage "--context-bytes='100' must be an integer in [300, 1048576]" -- data make-task --data nowhere --out t.jsonl --context-bytes 100
expect_usage "--nope" -- train --nope
expect_error "--decode='99999999999' must be an integer in [2, 16777216]" -- bench --config "$SRC/configs/tiny.toml" --decode 99999999999
expect_error "'moe.expert_d_ff' must be in [0, 4194304], got 4194305" -- params --config "$SRC/configs/tiny-moe.toml" --set moe.expert_d_ff=4194305
expect_error "--resume needs --run-dir" -- train --resume
expect_error "--run-dir"               -- eval --json

printf '1 2 3\n4 5\n' >ragged.txt
printf '1 2 x\n' >word.txt
printf '1 99999\n' >big.txt
"$DK" init --config "$SRC/configs/tiny.toml" --set model.n_layers=1 --out ck >/dev/null 2>&1
expect_error "ragged.txt:2: 2 ids, but the first sequence has 3" -- forward --checkpoint ck --tokens ragged.txt --out o.safetensors
expect_error "word.txt:1: 'x' is not a token id" -- forward --checkpoint ck --tokens word.txt --out o.safetensors
expect_error "token id 99999 is >= vocab_size 4096" -- forward --checkpoint ck --tokens big.txt --out o.safetensors
[ -e o.safetensors ] && { echo "FAIL: forward left o.safetensors behind"; failures=$((failures + 1)); }
expect_error "nothere: not a checkpoint" -- forward --checkpoint nothere --tokens big.txt --out o.safetensors
expect_error "ck: already exists"      -- init --config "$SRC/configs/tiny.toml" --out ck
expect_error "collinear"               -- init --config "$SRC/configs/tiny.toml" --set residual.kind=dar --set residual.block_sublayers=1 --out ck2

# Issue 14: sizes refused before anything is allocated, files that are not files, values that
# would overflow or smuggle keys, run directories that are not fresh.
T=(--config "$SRC/configs/tiny.toml")
expect_error "beyond this machine's"   -- init "${T[@]}" --set model.vocab_size=1073741824 --set model.d_model=16384 --out big1
expect_error "beyond this machine's"   -- init "${T[@]}" --set model.d_ff=4194304 --set model.d_model=1048576 --out big2
python3 - <<'PY'
import os, struct
os.makedirs("shards", exist_ok=True)
for split in ("train", "val"):  # llm.c token shards: 256 int32 of header, then uint16 ids
    ids = [i % 100 for i in range(5000)]
    with open(f"shards/{split}_000000.bin", "wb") as f:
        f.write(struct.pack("<3i", 20240520, 1, len(ids)) + bytes(1012) + struct.pack(f"<{len(ids)}H", *ids))
PY
expect_error "training the model: its" -- train "${T[@]}" --set data.dir=shards --set model.vocab_size=16777216 --set model.d_model=4096 --run-dir big3
[ -e big3 ] && { echo "FAIL: a refused train left big3 behind"; failures=$((failures + 1)); }
[ -e big1 ] || [ -e big2 ] && { echo "FAIL: a refused init left its output"; failures=$((failures + 1)); }
expect_error "'model.rope_theta' must be a finite number" -- params "${T[@]}" --set model.rope_theta=inf
expect_error "overflows 64 bits"       -- params "${T[@]}" --set train.steps=0 --set train.tokens=9223372036854775807 --set train.micro_batch=1048576
expect_error "overflows 64 bits"       -- params "${T[@]}" --set train.micro_batch=1048576 --set train.grad_accum=1048576 --set model.seq_len=16777216
expect_error "line break"              -- params "${T[@]}" --set "model.n_layers=2
model.d_model = 64"
expect_error "'data.dir' must not be empty" -- params "${T[@]}" --set 'data.dir=""'
expect_error "/dev/zero: not a regular file" -- params --config /dev/zero
mkdir -p adir
expect_error "adir: is a directory"    -- params --config adir
expect_error "adir: is a directory"    -- forward --checkpoint ck --tokens adir --out o.safetensors
expect_error "/dev/zero: not a regular file" -- forward --checkpoint ck --tokens /dev/zero --out o.safetensors
printf '1 2 3\n' >ok.txt
expect_error "adir: is a directory, expected a .safetensors file" -- forward --checkpoint ck --tokens ok.txt --out adir
[ -z "$(ls adir)" ] || { echo "FAIL: forward --out DIR left files in it"; failures=$((failures + 1)); }
ls ./*.tmp* >/dev/null 2>&1 && { echo "FAIL: forward left a temporary file"; failures=$((failures + 1)); }
expect_error "adir: is a directory"    -- scaling --runs adir
expect_error "/dev/zero: not a regular file" -- scaling --runs /dev/zero
expect_error "adir: is a directory"    -- compare --spec adir --out c0
expect_error "/dev/zero: not a regular file" -- compare --spec /dev/zero --out c0
# forward streams its logits a chunk at a time; an output no disk could hold is refused up front.
"$DK" init "${T[@]}" --set model.n_layers=1 --set model.vocab_size=65536 --out ckwide >/dev/null 2>&1
python3 -c "import numpy as np; np.save('long.npy', np.zeros((400000, 16), dtype=np.int16))"
expect_error "o.safetensors: the logits of 400000 x 16 tokens over 65536 ids need 1677721600000 bytes" -- forward --checkpoint ckwide --tokens long.npy --out o.safetensors
ls o.safetensors* >/dev/null 2>&1 && { echo "FAIL: a refused forward left its output"; failures=$((failures + 1)); }
mkdir -p stale/checkpoints/step_00000005
expect_error "already has checkpoints" -- train "${T[@]}" --run-dir stale
[ -d stale/checkpoints/step_00000005 ] && [ ! -e stale/config.toml ] || { echo "FAIL: a refused fresh run changed stale/"; failures=$((failures + 1)); }
cp -r ck negstep && sed -i 's/"step": 0/"step": -3/' negstep/state.json
expect_error "state.json: field 'step' must be a non-negative integer, got -3" -- forward --checkpoint negstep --tokens ok.txt --out o.safetensors
mkdir -p lat/checkpoints && cp -r ck lat/checkpoints/step_00000001 && printf 'step_00000001\0\n' >lat/checkpoints/latest
expect_error "latest: does not name a checkpoint" -- forward --checkpoint lat --tokens ok.txt --out o.safetensors

# compare, analyze, scaling, cost.
printf 'base = "%s/configs/tiny.toml"\nsedes = [1]\n[[run]]\nkind = "dar"\n' "$SRC" >spec_key.toml
printf 'base = "%s/configs/tiny.toml"\n[[run]]\nkind = "dar"\nset = ["train.steps=5"]\n' "$SRC" >spec_budget.toml
printf 'base = "%s/configs/tiny.toml"\n[[run]]\nkind = "dar"\nset = ["residual.block_sublayers=1"]\n' "$SRC" >spec_bad.toml
printf 'base = "nowhere.toml"\n[[run]]\nkind = "dar"\n' >spec_base.toml
printf 'base = "%s/configs/tiny.toml"\n[[run]]\nkind = "dar"\n[[run]]\nkind = "dar"\n' "$SRC" >spec_twice.toml
expect_error "missing.toml: not found" -- compare --spec missing.toml --out c1
expect_error "spec_key.toml: unknown key 'sedes'" -- compare --spec spec_key.toml --out c1
expect_error "override 'train.steps=5': a run may set residual.* and model.* keys only" -- compare --spec spec_budget.toml --out c1
expect_error "run 'dar'"               -- compare --spec spec_bad.toml --out c1
expect_error "config file 'nowhere.toml' not found" -- compare --spec spec_base.toml --out c1
expect_error "name 'dar' is used twice" -- compare --spec spec_twice.toml --out c1
[ -e c1 ] && { echo "FAIL: compare with a bad spec left c1 behind"; failures=$((failures + 1)); }
expect_error "nowhere: not found (expected a run directory)" -- analyze --run-dir nowhere
printf 'method,compute,loss\nresidual,1e18,3\nresidual,1e19,0.5\n' >below.csv
expect_error "loss 0.5 is not above the irreducible loss 0.72" -- scaling --runs below.csv
expect_error "missing.csv: not found"  -- scaling --runs missing.csv
expect_error "unknown key 'residual.bogus'" -- cost --config "$SRC/configs/tiny.toml" --set residual.bogus=1

echo "cli_errors: $((checks - failures)) passed, $failures failed"
[ $failures -eq 0 ]
