#!/usr/bin/env bash
# Downstream evaluation end to end on real text: data make-task (deterministic, atomic, refuses to
# overwrite), eval --task on a small trained run (text and --json, --limit, --shots, --seed),
# HellaSwag-style, ARC-style and generation task files, and malformed task files (one line naming
# file and line, non-zero exit).
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
[ -d "$CORPUS" ] || fail "$CORPUS missing (scripts/setup installs python3.11-doc)"
"$DK" data prepare --input "$CORPUS" --out data --vocab-size 512 --val-fraction 0.2 --json >/dev/null 2>&1

# make-task: the same seed gives the same bytes, another seed another file.
"$DK" data make-task --data data --out cloze.jsonl --items 40 --dev-items 6 --seed 3 --json >make.json
"$DK" data make-task --data data --out cloze-again.jsonl --items 40 --dev-items 6 --seed 3 >make.txt
"$DK" data make-task --data data --out cloze-other.jsonl --items 40 --dev-items 6 --seed 4 >/dev/null
cmp -s cloze.jsonl cloze-again.jsonl || fail "make-task with the same seed wrote different files"
cmp -s cloze.jsonl cloze-other.jsonl && fail "make-task with another seed wrote the same file"
grep -q "^wrote cloze-again.jsonl: 40 items + 6 dev items, 4 choices each" make.txt || fail "make-task: $(cat make.txt)"
python3 - <<'PY' || fail "make-task output"
import json
m = json.load(open("make.json"))
assert m["items"] == 40 and m["dev_items"] == 6 and m["documents"] == 2 and m["dev_documents"] == 1, m
lines = open("cloze.jsonl").read().splitlines()
header = json.loads(lines[0])["task"]
assert "name" not in header and header["seed"] == 3 and header["shots"] == 0, header
items = [json.loads(l) for l in lines[1:]]
assert len(items) == 46 and sum(i["split"] == "dev" for i in items) == 6, len(items)
for i in items:
    assert len(i["choices"]) == 4 and 0 <= i["gold"] < 4 and i["context"].endswith("\n"), i
    assert len(set(c.strip() for c in i["choices"])) == 4, i["choices"]
PY
# The least --context-bytes the command takes still yields items.
"$DK" data make-task --data data --out short.jsonl --items 5 --dev-items 0 --context-bytes 300 --json >short.json \
  || fail "make-task --context-bytes 300"
[ "$(json '["items"]' <short.json)" -ge 1 ] || fail "make-task --context-bytes 300 made no item"
"$DK" data make-task --data data --out cloze.jsonl 2>err.txt && fail "make-task overwrote its output"
grep -q "cloze.jsonl: already exists (pass --force" err.txt || fail "make-task overwrite: $(cat err.txt)"
cmp -s cloze.jsonl cloze-again.jsonl || fail "a refused make-task changed its output"

SETS=(--set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64 --set model.d_ff=128
      --set model.n_layers=2 --set train.micro_batch=4 --set data.dir=data --set train.eval_tokens=1024
      --set train.eval_every=0 --set train.checkpoint_every=0 --set optim.warmup_steps=5 --set train.steps=60)
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --run-dir run --json >/dev/null 2>train.log \
  || { cat train.log; fail "train"; }

# eval --task: four accuracies (total, per token, per byte, acc_norm) with standard errors, chance, truncations; the text says the same.
"$DK" eval --run-dir run --task cloze.jsonl --json >ev.json 2>ev.log || { cat ev.log; fail "eval --task"; }
"$DK" eval --run-dir run --task cloze.jsonl >ev.txt 2>/dev/null
python3 - <<'PY' || fail "eval --task --json"
import json, math
r = json.load(open("ev.json"))
assert r["type"] == "multiple_choice" and r["metric"] == "per_token" and r["task"] == "cloze", r
assert r["items"] == 40 and r["sequences"] == 160 and r["shots"] == 0 and r["seed"] == 3, r
assert r["step"] == 60 and r["checkpoint"].endswith("step_00000060"), r
assert r["chance"] == 0.25, r
for m in ("per_token", "total", "per_byte", "acc_norm"):
    a = r["accuracy"][m]
    right = round(a["value"] * 40)
    assert abs(a["value"] - right / 40) < 1e-12, a
    p = right / 40
    assert abs(a["stderr"] - math.sqrt(p * (1 - p) / 39)) < 1e-12, (m, a)
# passages of up to 600 bytes do not all fit 64 positions: some contexts were cut, and counted
assert 0 < r["truncated"] <= 160 and r["tokens"] > 0, r
text = open("ev.txt").read()
assert "accuracy by per-token mean log-likelihood:" in text and "(chance 25.0 %)" in text, text
assert f"{r['truncated']} of 160 candidates" in text, text
PY
# --limit scores the first items, --shots prepends dev items (longer contexts: more cut), --seed
# changes which.
"$DK" eval --run-dir run --task cloze.jsonl --limit 10 --shots 2 --json >ev2.json 2>/dev/null
"$DK" eval --run-dir run --task cloze.jsonl --limit 10 --shots 2 --seed 5 --json >ev3.json 2>/dev/null
"$DK" eval --run-dir run --task cloze.jsonl --limit 10 --json >ev4.json 2>/dev/null
python3 - <<'PY' || fail "eval --task --limit --shots --seed"
import json
a, b, c = (json.load(open(f)) for f in ("ev2.json", "ev3.json", "ev4.json"))
assert a["items"] == 10 and a["sequences"] == 40 and a["shots"] == 2 and a["seed"] == 3 and b["seed"] == 5, (a, b)
assert a["truncated"] == 40 and c["truncated"] <= 40, (a, c)
assert c["shots"] == 0
PY

# Exported HellaSwag-style and ARC-style lines load as they are; a generation task decodes.
cat >hs.jsonl <<'EOF'
{"ind": 1, "activity_label": "Python", "ctx": "To print a value in Python, you", "endings": ["call the print function.", "paint the screen.", "ask the compiler.", "wait a day."], "label": "0", "split": "val"}
{"ind": 2, "ctx_a": "A list holds several values.", "ctx_b": "You", "endings": ["can index it.", "cannot read it.", "eat it.", "fly it."], "label": 0, "split": "val"}
EOF
cat >arc.jsonl <<'EOF'
{"id": "q1", "question": "Which keyword defines a function in Python?", "choices": {"text": ["def", "class", "import"], "label": ["A", "B", "C"]}, "answerKey": "A"}
{"id": "q2", "question": "Which type is immutable?", "choices": {"text": ["list", "tuple", "dict", "set"], "label": ["1", "2", "3", "4"]}, "answerKey": "2"}
EOF
cat >gen.jsonl <<'EOF'
{"task": {"name": "echo", "stop": ["\n"], "regex": "(\\w+)", "max_new_tokens": 8, "shots": 1}}
{"prompt": "Q: the first word of the tutorial?\nA:", "answers": ["Python"], "split": "dev", "target": " Python\n"}
{"prompt": "Q: a keyword?\nA:", "answers": ["def", "class"]}
{"prompt": "Q: a type?\nA:", "answers": "list"}
EOF
"$DK" eval --run-dir run --task hs.jsonl --json >hs.json 2>/dev/null || fail "eval HellaSwag-style"
"$DK" eval --run-dir run --task arc.jsonl --json >arc.json 2>/dev/null || fail "eval ARC-style"
"$DK" eval --run-dir run --task gen.jsonl --json >gen.json 2>gen.log || { cat gen.log; fail "eval generation"; }
"$DK" eval --run-dir run --task gen.jsonl >gen.txt 2>/dev/null
python3 - <<'PY' || fail "schemas and generation"
import json
hs, arc, gen = (json.load(open(f)) for f in ("hs.json", "arc.json", "gen.json"))
assert hs["items"] == 2 and hs["sequences"] == 8 and hs["chance"] == 0.25, hs
assert arc["items"] == 2 and arc["sequences"] == 7 and abs(arc["chance"] - (1 / 3 + 1 / 4) / 2) < 1e-12, arc
assert gen["type"] == "generation" and gen["metric"] == "exact_match" and gen["task"] == "echo", gen
assert gen["items"] == 2 and gen["shots"] == 1 and gen["chance"] is None, gen
assert gen["accuracy"]["exact_match"]["value"] in (0, 0.5, 1), gen
assert "exact match:" in open("gen.txt").read()
PY

# Bad input: one line naming file, line and fault; a non-zero exit.
expect_one_line() {  # WANT -- ARGS...
  local want=$1; shift 2
  local rc=0
  "$DK" "$@" >out.txt 2>err.txt || rc=$?
  [ $rc -ne 0 ] && [ $rc -lt 128 ] || fail "depthkit $* exited $rc"
  [ "$(wc -l <err.txt)" -eq 1 ] || fail "depthkit $*: $(wc -l <err.txt) lines on stderr: $(cat err.txt)"
  grep -qF -- "$want" err.txt || fail "depthkit $*: wanted '$want', got: $(cat err.txt)"
}
{ head -3 cloze.jsonl; echo '{"context": "x", "choices": [" a", " b"], "gold": 0'; } >bad.jsonl
expect_one_line "bad.jsonl:4: not valid JSON" -- eval --run-dir run --task bad.jsonl
{ head -2 cloze.jsonl; echo '{"context": "x", "choices": [" a", " b"], "gold": 5}'; } >bad2.jsonl
expect_one_line "bad2.jsonl:3: gold index 5 is outside the 2 choices" -- eval --run-dir run --task bad2.jsonl --json
python3 -c "print('{\"context\": \"x\", \"choices\": [\"' + ' value' * 200 + '\", \" b\"], \"gold\": 1}')" >long.jsonl
expect_one_line "long.jsonl:1: choice 0 is" -- eval --run-dir run --task long.jsonl
expect_one_line "cloze.jsonl: 7 shots (--shots, or the header's \"shots\") need 7 few-shot items" -- eval --run-dir run --task cloze.jsonl --shots 7
expect_one_line "missing.jsonl: task file not found" -- eval --run-dir run --task missing.jsonl
expect_one_line "--shots" -- eval --run-dir run --shots 2
expect_one_line "--tokens" -- eval --run-dir run --task cloze.jsonl --tokens 100
expect_one_line "nowhere/tokenizer.model: not found" -- data make-task --data nowhere --out x.jsonl
[ ! -e x.jsonl ] || fail "a failed make-task left its output"
# compare with tasks: a column per task (mean ± spread over seeds), per-seed accuracies in
# results.json; --resume reuses the kept task results; a malformed task stops it before training.
cat >spec.toml <<TOML
base = "$SRC/configs/tiny.toml"
seeds = [1, 2]
set = ["model.vocab_size=512", "model.seq_len=64", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
       "model.n_kv_heads=1", "model.n_layers=2", "train.micro_batch=4", "data.dir='data'", "train.steps=20",
       "train.eval_every=0", "train.eval_tokens=512", "train.checkpoint_every=0", "optim.warmup_steps=3"]
tasks = ["cloze.jsonl", "arc.jsonl"]
[[run]]
name = "residual"
kind = "residual"
[[run]]
name = "dar"
kind = "dar"
set = ["residual.block_sublayers=2"]
TOML
"$DK" compare --spec spec.toml --out cmp --json >cmp.json 2>cmp.log || { cat cmp.log; fail "compare with tasks"; }
[ "$(grep -c 'compare: scoring' cmp.log)" = 8 ] || { cat cmp.log; fail "compare: not every run scored on every task"; }
python3 - <<'PY' || fail "compare task results"
import json, statistics
r = json.load(open("cmp.json"))
assert [t["name"] for t in r["tasks"]] == ["cloze", "arc"], r["tasks"]
assert r["tasks"][0]["metric"] == "per_token" and r["tasks"][0]["items"] == 40 and r["tasks"][0]["chance"] == 0.25
for run in r["runs"]:
    for k, name in enumerate(("cloze", "arc")):
        acc = [s["tasks"][name] for s in run["seeds"]]
        kept = json.load(open(f"cmp/tasks/{run['name']}-seed{run['seeds'][0]['seed']}.{k}.{name}.json"))
        assert kept["accuracy"]["per_token"]["value"] == acc[0], (kept, acc)
        t = run["tasks"][name]
        assert abs(t["accuracy_mean"] - sum(acc) / 2) < 1e-12 and abs(t["accuracy_std"] - statistics.stdev(acc)) < 1e-12, t
table = open("cmp/table.md").read()
head = table.splitlines()[0]
assert "| cloze acc. % (per-token LL) | arc acc. % (per-token LL) |" in head, head
assert "cloze (cloze.jsonl, 40 items, 0-shot): accuracy of the candidate with the highest mean log-likelihood per token" in table, table
assert "chance 25.0 %" in table, table
PY
"$DK" compare --spec spec.toml --out cmp --resume --json >cmp2.json 2>cmp2.log
grep -q "compare: scoring" cmp2.log && { cat cmp2.log; fail "compare --resume scored the tasks again"; }
cmp -s <(python3 -c "import json; print(json.load(open('cmp.json'))['runs'])") \
       <(python3 -c "import json; print(json.load(open('cmp2.json'))['runs'])") || fail "resumed task results differ"
sed -i 's|tasks = \["cloze.jsonl", "arc.jsonl"\]|tasks = ["cloze.jsonl", "bad2.jsonl"]|' spec.toml
expect_one_line "spec.toml: key 'tasks': bad2.jsonl:3: gold index 5" -- compare --spec spec.toml --out cmp-bad
[ ! -e cmp-bad ] || fail "compare with a malformed task wrote its output directory"

# The validation-loss mode is unchanged.
"$DK" eval --run-dir run --json | json '["val_loss"]' >/dev/null || fail "eval without --task"
echo "cli_tasks: 1 passed, 0 failed"
