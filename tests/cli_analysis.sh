#!/usr/bin/env bash
# compare, analyze, cost and scaling end to end on real text: a small comparison trained,
# resumed (nothing retrained), tabulated and plotted; every analysis of a DAR and an mHC run;
# the accounting of MSAR Table 6; a scaling fit on points from a known law. Every PNG is checked
# to be a PNG of the size its figure asks for.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"
# png_size FILE WIDTH HEIGHT: a PNG (signature, IHDR) of exactly that size.
png_size() {
  python3 - "$@" <<'PY' || fail "$1 is not a ${2}x${3} PNG"
import struct, sys
raw = open(sys.argv[1], "rb").read()
assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
w, h = struct.unpack(">II", raw[16:24])
assert (w, h) == (int(sys.argv[2]), int(sys.argv[3])), (w, h)
assert len(raw) > 5000, "suspiciously small"
PY
}

"$DK" data prepare --input /usr/share/doc/python3.11/html/_sources/tutorial --out data --vocab-size 512 \
  --val-fraction 0.2 --json >/dev/null
cat >spec.toml <<TOML
base = "$SRC/configs/tiny.toml"
seeds = [1, 2]
set = ["model.vocab_size=512", "model.seq_len=32", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
       "model.n_kv_heads=1", "model.n_layers=3", "train.micro_batch=4", "data.dir='data'", "train.steps=30",
       "train.eval_every=0", "train.eval_tokens=1024", "train.checkpoint_every=10", "train.log_every=1",
       "optim.warmup_steps=3"]
smooth = 5
[[run]]
name = "residual"
kind = "residual"
[[run]]
name = "dar-full"
kind = "dar"
set = ["residual.block_sublayers=2"]
[[run]]
name = "mhc2"
kind = "mhc"
set = ["residual.streams=2"]
TOML
"$DK" compare --spec spec.toml --out cmp --json >cmp.json 2>cmp.log || { cat cmp.log; fail "compare"; }
python3 - <<'PY' || fail "compare results"
import json, math
r = json.load(open("cmp.json"))
assert r == json.load(open("cmp/results.json"))
names = [x["name"] for x in r["runs"]]
assert names == ["residual", "dar-full", "mhc2"], names
base = r["runs"][0]
assert base["delta_percent"] == 0 and base["parameters"]["residual"] == 0
for run in r["runs"]:
    assert len(run["seeds"]) == 2 and run["tokens_per_s"] > 0 and run["peak_rss_bytes"] > 0
    # the tensors alone: more than the parameters with their gradients and AdamW moments
    assert run["peak_tensor_bytes"] > 16 * run["parameters"]["total"], run
    v = [s["val_loss"] for s in run["seeds"]]
    assert abs(run["val_loss_mean"] - sum(v) / 2) < 1e-12
    assert abs(run["val_loss_std"] - abs(v[0] - v[1]) / math.sqrt(2)) < 1e-12
    assert v[0] != v[1], "two seeds gave the same loss"
    assert run["val_loss_mean"] < math.log(512), run
assert r["runs"][1]["parameters"]["residual"] > 0
# every run saw the same batches: the data seed is shared, the initialisation seed is not
import tomllib
for run in r["runs"]:
    for s in run["seeds"]:
        c = tomllib.load(open(s["run_dir"] + "/config.toml", "rb"))
        assert c["train"]["data_seed"] == 42 and c["train"]["seed"] == s["seed"], c["train"]
table = open("cmp/table.md").read().splitlines()
assert table[0].startswith("| run | kind |") and len([l for l in table if l.startswith("| ")]) == 4, table
assert "±" in table[3] and "+0.00 %" in table[2], table
PY
png_size cmp/loss_curves.png 800 500
# --resume trains nothing again; without it the directory is refused.
"$DK" compare --spec spec.toml --out cmp --resume --json >cmp2.json 2>cmp2.log
[ "$(grep -c 'finished earlier' cmp2.log)" = 6 ] || { cat cmp2.log; fail "compare --resume retrained"; }
cmp -s <(python3 -c "import json; r=json.load(open('cmp.json')); print([x['val_loss_mean'] for x in r['runs']])") \
       <(python3 -c "import json; r=json.load(open('cmp2.json')); print([x['val_loss_mean'] for x in r['runs']])") \
  || fail "resumed comparison differs"
"$DK" compare --spec spec.toml --out cmp >/dev/null 2>err.txt && fail "compare over an existing comparison"
grep -q "pass --resume" err.txt || fail "compare over an existing comparison: $(cat err.txt)"
# An interrupted run is resumed from its checkpoint (not restarted): drop one run's summary.
rm cmp/runs/mhc2-seed2/summary.json
"$DK" compare --spec spec.toml --out cmp --resume --json >cmp3.json 2>cmp3.log
grep -q "mhc2-seed2 (mhc): resuming" cmp3.log || { cat cmp3.log; fail "compare --resume did not resume"; }

# On an MoE backbone the table and results gain the router's balance, and aux_curves.png plots it.
sed -e "s|configs/tiny.toml|configs/tiny-moe.toml|" -e 's|seeds = \[1, 2\]|seeds = [1]|' \
    -e 's|"model.n_layers=3",|"model.n_layers=3", "moe.expert_d_ff=16", "moe.shared_d_ff=16",|' spec.toml >moe.toml
"$DK" compare --spec moe.toml --out cmp-moe --json >cmp-moe.json 2>cmp-moe.log || { cat cmp-moe.log; fail "compare moe"; }
python3 - <<'PY' || fail "compare moe results"
import json
r = json.load(open("cmp-moe.json"))
for run in r["runs"]:
    assert 0.5 < run["router_balance"] <= 8, run  # E * sum f*P: 1 at uniform use, E at most
table = open("cmp-moe/table.md").read()
assert "router balance |" in table.splitlines()[0] and "Router balance:" in table, table
curves = json.load(open("cmp-moe/aux_curves.json"))
assert [s["label"] for s in curves["series"]] == ["residual", "dar-full", "mhc2"]
assert curves["reference"]["y"] == 1.0 and all(len(s["steps"]) == 30 for s in curves["series"])
PY
png_size cmp-moe/aux_curves.png 800 500
grep -q "router balance" cmp/table.md && fail "a dense comparison's table has the router column"
[ ! -e cmp/aux_curves.png ] || fail "a dense comparison plotted router balance"

# analyze: every analysis DAR supports, and mHC's.
"$DK" analyze --run-dir cmp/runs/dar-full-seed1 --sequences 3 --positions 16 --json >dar.json
python3 - <<'PY' || fail "analyze dar"
import json, math
r = json.load(open("dar.json"))
assert r["kind"] == "dar" and r["sequences"] == 3 and r["positions"] == 16
maps = r["maps"]
assert maps["source_labels"] == ["emb", "b1", "b2", "b3"] and len(maps["streams"]) == 2
for s in maps["streams"]:
    for key in ("pre_attention", "pre_mlp"):
        rows = s[key]
        assert len(rows) == 3
        for layer, row in enumerate(rows, 1):
            avail = [v for v in row if v is not None]
            # layer l (block l, S = 2): pre-attention reads the embedding and blocks < l; pre-MLP also its partial
            assert len(avail) == layer + (key == "pre_mlp"), (key, layer, row)
            assert abs(sum(avail) - 1) < 1e-6 and all(v >= 0 for v in avail), row
    assert len(s["readout"]) == 4 and abs(sum(s["readout"]) - 1) < 1e-6
cka = r["cka"]["pairs"]
assert len(cka) == 1 and len(cka[0]["matrix"]) == 3 and all(0 <= v <= 1 + 1e-9 for row in cka[0]["matrix"] for v in row)
res = r["rescue"]
assert res["layers"] == [1, 2, 3] and len(res["streams"]) == 2
for j, s in enumerate(res["streams"]):
    for l, g in enumerate(s["gain"]):
        assert math.isfinite(g) and abs(g - (1 - res["kl_keep"][l][j] / res["kl_zero_all"][l])) < 1e-9
assert all(v > 0 for v in res["kl_zero_all"])
g = r["gates"]
assert len(g["g"]) == 3 and all(abs(d - (res["streams"][1]["gain"][i] - res["streams"][0]["gain"][i])) < 1e-12 for i, d in enumerate(g["d"]))
assert abs(g["mean_abs_g"] - sum(abs(x) for x in g["g"]) / 3) < 1e-12
PY
for f in maps cka rescue gates; do [ -f cmp/runs/dar-full-seed1/analysis/$f.json ] || fail "$f.json"; done
png_size cmp/runs/dar-full-seed1/analysis/maps.png 1000 780
png_size cmp/runs/dar-full-seed1/analysis/cka.png 480 470
png_size cmp/runs/dar-full-seed1/analysis/rescue.png 840 400
png_size cmp/runs/dar-full-seed1/analysis/gates.png 600 500
"$DK" analyze --run-dir cmp/runs/mhc2-seed1 --out mhc-analysis --positions 8 >mhc.txt
grep -q "rescue gain, keep stream 1" mhc.txt || fail "analyze mhc: $(cat mhc.txt)"
[ -f mhc-analysis/cka.png ] && [ -f mhc-analysis/rescue.png ] && [ ! -f mhc-analysis/maps.png ] || fail "analyze mhc outputs"

# analyze MSAR: its maps per stream and its streams (key RMS, H_pre gates, shares), a few steps in.
"$DK" train --config "$SRC/configs/tiny.toml" --run-dir msar --set residual.kind=msar --set residual.streams=3 \
  --set "residual.kernels=[2, 4]" --set model.vocab_size=512 --set model.seq_len=32 --set model.d_model=32 \
  --set model.d_ff=64 --set model.n_heads=2 --set model.n_kv_heads=1 --set model.n_layers=2 \
  --set train.micro_batch=4 --set "data.dir='data'" --set train.steps=5 --set train.eval_every=0 \
  --set train.eval_tokens=1024 --set optim.warmup_steps=2 >/dev/null 2>&1 || fail "train msar"
"$DK" analyze --run-dir msar --positions 8 --json >msar.json || fail "analyze msar"
python3 - <<'PY' || fail "analyze msar streams"
import json
r = json.load(open("msar.json"))
assert len(r["maps"]["streams"]) == 3
s = r["streams"]
assert s["reads"] == [1, 2, 3, 4], s["reads"]
for key in ("key_rms", "gates", "shares"):
    assert len(s[key]) == 4 and all(len(row) == 3 for row in s[key]), key
for row in s["shares"]:
    assert abs(sum(row) - 1) < 1e-6 and all(0 <= v <= 1 for v in row), row
assert all(0 < v < 1 for row in s["gates"] for v in row)
# five steps from zero taps: the convolved streams have begun, far below stream 0
assert all(0 < row[1] < row[0] and 0 < row[2] < row[0] for row in s["key_rms"]), s["key_rms"]
PY
png_size msar/analysis/streams.png 1400 400
"$DK" analyze --run-dir msar --what streams --positions 8 >msar.txt
grep -q "streams: shares" msar.txt || fail "analyze msar text: $(cat msar.txt)"

# cost: MSAR Table 6's typical column (N = 8 blocks, S = 16, m = 4).
for pair in residual:3 mhc:34 attnres:5.5 msar:21.5; do
  got=$("$DK" cost --config "$SRC/configs/tiny.toml" --set model.n_layers=64 --set residual.block_sublayers=16 \
        --set residual.streams=4 --set residual.kind=${pair%%:*} --json \
        | python3 -c "import json,sys; print(json.load(sys.stdin)['traffic_per_token_per_branch']['total_d'])")
  python3 -c "import sys; sys.exit(abs($got - ${pair##*:}) > 1e-12)" || fail "cost ${pair%%:*}: ${got}d, expected ${pair##*:}d"
done
"$DK" cost --config "$SRC/configs/paper/dense-0.1b.toml" --set residual.kind=dar --set residual.block_sublayers=4 | grep -q "overhead" \
  || fail "cost text"

# scaling: points from known laws are fitted back; the plot is written.
python3 - <<'PY'
with open("points.csv", "w") as f:
    f.write("method,compute,loss\n")
    for c in (1e18, 3e18, 1e19, 4e19):
        f.write(f"residual,{c},{9.0 * c ** -0.08 + 0.72}\n")
        f.write(f"msar,{c},{7.0 * c ** -0.08 + 0.72}\n")
PY
"$DK" scaling --runs points.csv --json >fit.json
python3 - <<'PY' || fail "scaling fit"
import json
r = json.load(open("fit.json"))
res, msar = r["fits"]
assert abs(res["beta"] - 0.08) < 1e-9 and abs(res["A"] / 9.0 - 1) < 1e-9 and abs(res["speedup"] - 1) < 1e-9
assert abs(msar["speedup"] - (9.0 / 7.0) ** (1 / 0.08)) < 1e-6 * msar["speedup"], msar
PY
png_size points.scaling.png 700 500
echo "cli_analysis: 1 passed, 0 failed"
