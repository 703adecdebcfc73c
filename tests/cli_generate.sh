#!/usr/bin/env bash
# depthkit generate and bench --decode on a small model trained on real text: the text streamed to
# stdout alone, equal to --json's; greedy and seeded sampling reproducible; top-k 1 is greedy;
# refusals of bad arguments in one line.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

"$DK" data prepare --input /usr/share/doc/python3.11/html/_sources/tutorial --out data --vocab-size 512 \
  --val-fraction 0.2 >/dev/null
for kind in msar dar; do
  "$DK" train --config "$SRC/configs/tiny.toml" --set model.vocab_size=512 --set model.seq_len=64 \
    --set model.d_model=64 --set model.d_ff=128 --set model.n_layers=2 --set train.micro_batch=8 \
    --set data.dir=data --set train.eval_every=0 --set train.checkpoint_every=0 --set optim.warmup_steps=5 \
    --set train.steps=60 --set residual.kind=$kind --run-dir run-$kind --json >/dev/null 2>&1
done

for kind in msar dar; do
  # Greedy: the streamed stdout is the text alone, and equals --json's text; stderr has the rates.
  "$DK" generate --run-dir run-$kind --prompt "The Python " --max-new-tokens 40 --temperature 0 \
    >greedy.txt 2>greedy.err
  grep -q "tokens/s" greedy.err || fail "$kind: no rates on stderr: $(cat greedy.err)"
  "$DK" generate --run-dir run-$kind --prompt "The Python " --max-new-tokens 40 --temperature 0 --json >greedy.json
  python3 - "$kind" <<'PY' || fail "$kind: greedy stdout differs from --json text"
import json, sys
j = json.load(open("greedy.json"))
text = open("greedy.txt", encoding="utf-8").read()
assert text == j["text"], (text, j["text"])
assert 0 < j["generated_tokens"] <= 40 and j["stopped"] in ("eos", "limit"), j
assert j["prefill_tokens"] == j["prompt_tokens"] and j["prefill_tokens_per_s"] > 0, j
assert j["decode_tokens"] == j["generated_tokens"] - 1, j
PY
  # top-k 1 at temperature 1 is greedy; a seed reproduces a sample, another seed differs.
  "$DK" generate --run-dir run-$kind --prompt "The Python " --max-new-tokens 40 --top-k 1 >top1.txt 2>/dev/null
  cmp -s top1.txt greedy.txt || fail "$kind: top-k 1 differs from greedy"
  printf 'Lists are\nmutable, and ' >prompt.txt
  for run in a:1 b:1 c:2; do
    "$DK" generate --run-dir run-$kind --prompt-file prompt.txt --max-new-tokens 30 --temperature 1.2 --top-p 0.9 \
      --seed "${run#*:}" --json >"sample-${run%%:*}.json"
  done
  python3 - <<'PY' || fail "$kind: sampling is not reproducible for a seed"
import json
a, b, c = (json.load(open(f"sample-{x}.json")) for x in "abc")
assert a["text"] == b["text"], (a["text"], b["text"])
assert a["text"] != c["text"] or a["generated_tokens"] < 3, "seeds 1 and 2 gave the same text"
PY
done

# Refusals: one line each, non-zero exit.
expect() {  # expect MESSAGE -- ARGS...
  local msg=$1; shift 2
  if "$DK" "$@" >out.txt 2>err.txt; then fail "expected failure: $*"; fi
  grep -qF -- "$msg" err.txt || fail "'$msg' not in: $(cat err.txt)"
  [ "$(wc -l <err.txt)" -le 2 ] || fail "more than one line: $(cat err.txt)"
}
expect "exactly one of --prompt and --prompt-file" -- generate --run-dir run-msar
expect "exactly one of --prompt and --prompt-file" -- generate --run-dir run-msar --prompt a --prompt-file greedy.txt
expect "missing.txt"                               -- generate --run-dir run-msar --prompt-file missing.txt
expect "--temperature='-1' must be a finite number >= 0" -- generate --run-dir run-msar --prompt a --temperature -1
expect "--top-p='1.5' must be a finite number in (0, 1]" -- generate --run-dir run-msar --prompt a --top-p 1.5
expect "more than the model's context, model.seq_len 64" -- generate --run-dir run-msar --prompt "$(head -c 4000 /usr/share/doc/python3.11/html/_sources/tutorial/classes.rst.txt)"
expect "tokenizer.model: not found"                -- generate --run-dir run-msar --prompt a --data .
expect "--decode='x' must be an integer in [2, 16777216]" -- bench --config "$SRC/configs/tiny.toml" --decode 64,x

# bench --decode: both rates, the cache's bytes, per kind.
"$DK" bench --config "$SRC/configs/tiny.toml" --set model.n_layers=2 --kinds residual,msar --decode 32,64 --steps 4 \
  --json >decode.json 2>/dev/null
python3 - <<'PY' || fail "bench --decode"
import json
rows = json.load(open("decode.json"))
assert [(r["kind"], r["length"]) for r in rows] == [("residual", 32), ("residual", 64), ("msar", 32), ("msar", 64)], rows
for r in rows:
    assert r["cached_ms"] > 0 and r["recompute_ms"] > 0 and r["cache_bytes"] > 0, r
kv = 2 * 2 * 2 * 32 * 4  # layers, K and V, KV heads, head_dim, float32: bytes per position
assert rows[0]["cache_bytes"] == 32 * kv and rows[2]["cache_bytes"] == 32 * kv + 4 * 11 * 128 * 4, rows
PY
echo "cli_generate: ok"
