#!/usr/bin/env bash
# train.dtype = bfloat16 against float32 (docs/design.md, "Precision"): configs/tiny.toml trained
# 200 steps from the same seed and data order in each dtype, on a slice of the bundled corpus,
# evaluated at the end; the two final validation losses agree within 2 % (relative).
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

CORPUS=/usr/share/doc/python3.11/html/_sources
[ -d "$CORPUS" ] || fail "$CORPUS missing (scripts/setup installs python3.11-doc)"
# tiny.toml's vocabulary (4,096) on about 1.6 MB of text: enough for 200 steps, quick to prepare.
"$DK" data prepare --input "$CORPUS/tutorial" "$CORPUS/reference" "$CORPUS/howto" "$CORPUS/faq" --out data \
  --vocab-size 4096 --val-fraction 0.1 --seed 42 --json >prep.json

# Evaluation only at the end, on 64 windows (the same ones for both dtypes); one checkpoint.
SETS=(--set data.dir=data --set train.steps=200 --set train.eval_every=0 --set train.eval_tokens=16384
      --set train.checkpoint_every=0 --set train.log_every=50)
for dtype in float32 bfloat16; do
  start=$(date +%s.%N)
  "$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.dtype=$dtype --run-dir "$dtype" --json \
    >"$dtype.json" 2>"$dtype.log" || { cat "$dtype.log"; fail "training in $dtype"; }
  end=$(date +%s.%N)
  [ "$(python3 -c "import tomllib; print(tomllib.load(open('$dtype/config.toml', 'rb'))['train']['dtype'])")" = "$dtype" ] \
    || fail "$dtype/config.toml does not record train.dtype"
  printf '%-8s final validation loss %s (train loss %s), %.0f s\n' "$dtype" "$(json '["val_loss"]' <"$dtype.json")" \
    "$(json '["train_loss"]' <"$dtype.json")" "$(python3 -c "print($end - $start)")"
done
python3 - float32.json bfloat16.json <<'PY' || fail "bfloat16's validation loss is not within 2 % of float32's"
import json, math, sys
f32, bf16 = (json.load(open(p))["val_loss"] for p in sys.argv[1:])
rel = abs(bf16 - f32) / f32
print(f"relative difference {100 * rel:.2f} % (float32 {f32:.4f}, bfloat16 {bf16:.4f})")
assert math.isfinite(bf16) and f32 < math.log(4096) - 1, (f32, bf16)  # both trained
assert rel < 0.02, rel
PY
