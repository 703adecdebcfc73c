#!/usr/bin/env bash
# The commands end to end on real text: data prepare (on a slice of the bundled corpus), train,
# SIGINT → checkpoint → --resume, eval --json, params --json on the paper configs, bench --json.
set -euo pipefail
source "$(dirname "$0")/lib.sh" "$@"

# Paper parameter counts (DAR Table A.3), printed by `params --json`.
for pair in dense-0.1b:98325120 dense-0.3b:304129024 dense-0.5b:491572480 dense-1b:1069631488; do
  got=$("$DK" params --config "$SRC/configs/paper/${pair%%:*}.toml" --json | json '["non_vocab"]')
  [ "$got" = "${pair##*:}" ] || fail "params ${pair%%:*}: non_vocab $got, expected ${pair##*:}"
  res=$("$DK" params --config "$SRC/configs/paper/${pair%%:*}.toml" --json | json '["residual"]')
  [ "$res" = 0 ] || fail "params ${pair%%:*}: residual $res"
done
got=$("$DK" params --config "$SRC/configs/paper/dense-0.1b.toml" --set model.n_layers=28 --json | json '["non_vocab"]')
[ "$got" = $((98325120 / 16 * 28 - 640 * 28 / 16 + 640)) ] || fail "--set model.n_layers=28 gave $got"
# Sparse-MoE counts (DAR Table A.5, billions to three decimals): total excl./incl. vocabulary,
# active per token under top-8 excl./incl.
for row in residual:6.949:7.217:1.136:1.404 attnres:6.949:7.217:1.136:1.404 dar:6.949:7.218:1.136:1.405; do
  IFS=: read -r kind te ti ae ai <<<"$row"
  "$DK" params --config "$SRC/configs/paper/dar-moe-7b.toml" --set residual.kind="$kind" --json >moe_params.json
  for pair in non_vocab:$te total:$ti active_non_vocab:$ae active:$ai; do
    got=$(json "[\"${pair%%:*}\"]" <moe_params.json)
    [ "$(python3 -c "print(f'{$got / 1e9:.3f}')")" = "${pair##*:}" ] || fail "params dar-moe-7b $kind: ${pair%%:*} $got, expected ${pair##*:}B"
  done
done

CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
[ -d "$CORPUS" ] || fail "$CORPUS missing (scripts/setup installs python3.11-doc)"
"$DK" data prepare --input "$CORPUS" --out data --vocab-size 512 --val-fraction 0.2 --json >prep.json
[ "$(json '["vocab_size"]' <prep.json)" -le 512 ] || fail "vocab"
[ -f data/meta.json ] && [ -f data/train_000000.bin ] && [ -f data/val_000000.bin ] || fail "prepare outputs"

SETS=(--set model.vocab_size=512 --set model.seq_len=64 --set model.d_model=64 --set model.d_ff=128
      --set model.n_layers=2 --set train.micro_batch=4 --set data.dir=data --set train.eval_tokens=2048
      --set train.eval_every=10 --set train.checkpoint_every=10 --set optim.warmup_steps=5
      --set train.log_every=1)
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=200 --run-dir whole --json >whole.json
val=$(json '["val_loss"]' <whole.json)
python3 -c "import sys,math; sys.exit(not ($val < math.log(512) - 1))" || fail "val loss $val did not fall"
[ -f whole/checkpoints/step_00000200/model.safetensors ] || fail "final checkpoint"
[ "$(wc -l <whole/metrics.jsonl)" -ge 200 ] || fail "metrics.jsonl"

# eval --json on the final checkpoint equals the trainer's final evaluation.
ev=$("$DK" eval --run-dir whole --json | json '["val_loss"]')
[ "$ev" = "$val" ] || fail "eval $ev != train's final val $val"

# SIGINT during a run: a checkpoint at the step reached, exit 130, then --resume finishes
# with exactly the losses of the uninterrupted run.
"$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set train.steps=200 --set train.checkpoint_every=0 \
  --run-dir parts >/dev/null 2>parts.log &
pid=$!
for _ in $(seq 200); do [ -f parts/metrics.jsonl ] && [ "$(wc -l <parts/metrics.jsonl)" -ge 3 ] && break; sleep 0.05; done
kill -INT $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 130 ] || { cat parts.log; fail "SIGINT exit code $rc, expected 130"; }
step=$(cat parts/checkpoints/latest)
[ -n "$step" ] || fail "no checkpoint written on SIGINT"
"$DK" train --resume --run-dir parts --json >parts.json 2>/dev/null
python3 - whole/metrics.jsonl parts/metrics.jsonl <<'PY' || fail "resumed losses differ"
import json, sys
def losses(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert a == b, (a, b)
PY
[ "$(json '["val_loss"]' <parts.json)" = "$val" ] || fail "resumed final val loss differs"

# init → forward, with text and .npy token files; forward on a run directory uses its latest checkpoint.
"$DK" init --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set residual.kind=dar --out ck0 >/dev/null
[ -f ck0/model.safetensors ] && [ -f ck0/state.json ] || fail "init outputs"
printf '1 2 3 4 5\n6 7 8 9 10\n' >toks.txt
python3 -c "import numpy as np; np.save('toks.npy', np.array([[1,2,3,4,5],[6,7,8,9,10]], dtype=np.int32))"
"$DK" forward --checkpoint ck0 --tokens toks.txt --out a.safetensors >/dev/null
"$DK" forward --checkpoint ck0 --tokens toks.npy --out b.safetensors >/dev/null
"$DK" forward --checkpoint whole --tokens toks.npy --out c.safetensors >/dev/null
python3 - <<'PY' || fail "forward output"
import json, struct
def load(p):
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    return h["logits"], raw[8 + n:]
(ha, da), (hb, db), (hc, dc) = load("a.safetensors"), load("b.safetensors"), load("c.safetensors")
assert ha["dtype"] == "F32" and ha["shape"] == [2, 5, 512], ha
assert da == db, "text and .npy token files gave different logits"
assert dc != da, "the trained run's logits equal the fresh checkpoint's"
PY

# Every pathway trains: the loss falls within a few dozen steps.
for kind in residual attnres dar msar mhc attnres_sepv attnres_mhc; do
  "$DK" train --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set residual.kind=$kind --set train.steps=40 \
    --set train.eval_every=0 --run-dir "kind-$kind" --json >"kind-$kind.json" 2>/dev/null || fail "train $kind"
  python3 - "kind-$kind/metrics.jsonl" <<'PY' || fail "$kind: loss did not fall"
import json, sys
losses = [j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j]
assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
PY
done

"$DK" bench --config "$SRC/configs/tiny.toml" "${SETS[@]}" --steps 3 --warmup 1 --json | json '["tokens_per_s"]' >/dev/null
# Interleaved kinds: one result per kind, overheads against the first; each kind's pathway traffic
# per step is `depthkit cost`'s (per token per branch, forward) × 2 (backward) × branches (2
# layers: 4) × tokens (4 × 64), and its bound in ms is that beyond the first kind's at the copy
# bandwidth measured in the run (0 for the first).
"$DK" cost --config "$SRC/configs/tiny.toml" "${SETS[@]}" --set residual.kind=dar --json >cost_dar.json
"$DK" bench --config "$SRC/configs/tiny.toml" "${SETS[@]}" --kinds residual,dar,msar --steps 2 --warmup 0 --json \
  | python3 -c "
import json, sys
r = json.load(sys.stdin)['runs']
assert [x['kind'] for x in r] == ['residual', 'dar', 'msar'] and r[0]['overhead'] == 0 and r[0]['overhead_ms'] == 0, r
assert all(x['copy_gbs'] > 0 and x['copy_gbs'] == r[0]['copy_gbs'] for x in r), r
assert r[0]['traffic_bytes_per_step'] == 2 * 3 * 64 * 4 * 4 * 256, r[0]  # residual: 3d a branch
dar = json.load(open('cost_dar.json'))['traffic_per_token_per_branch']['total_bytes_fp32']
assert abs(r[1]['traffic_bytes_per_step'] - 2 * dar * 4 * 256) < 1e-6 * r[1]['traffic_bytes_per_step'], (r[1], dar)
assert r[0]['traffic_bound_ms'] == 0 and 0 < r[1]['traffic_bound_ms'] < r[2]['traffic_bound_ms'], r
for x in r:
  assert abs(x['traffic_ms'] - x['traffic_bytes_per_step'] / x['copy_gbs'] / 1e6) < 1e-9 * x['traffic_ms'], x
  assert abs(x['traffic_bound_ms'] - (x['traffic_ms'] - r[0]['traffic_ms'])) < 1e-12 + 1e-9 * x['traffic_ms'], x
# The FLOP bound: each kind's pathway FLOPs per step, \`depthkit cost\`'s per token x the tokens, at
# the GEMM rate timed in the run; the floor is both bounds together, of the first kind's step.
assert all(x['gemm_gflops'] > 0 and x['gemm_gflops'] == r[0]['gemm_gflops'] for x in r), r
dar_flops = json.load(open('cost_dar.json'))['training_flops_per_token']['pathway']
assert abs(r[1]['pathway_flops_per_step'] - dar_flops * 4 * 64) < 1e-9 * dar_flops * 256, (r[1], dar_flops)
assert r[0]['flop_bound_ms'] == 0 and 0 < r[1]['flop_bound_ms'] < r[2]['flop_bound_ms'], r
for x in r:
  assert abs(x['flop_ms'] - x['pathway_flops_per_step'] / x['gemm_gflops'] / 1e6) < 1e-9 * x['flop_ms'], x
  assert abs(x['floor_ms'] - x['flop_bound_ms'] - x['traffic_bound_ms']) < 1e-9 * (1 + x['floor_ms']), x
  assert abs(x['floor'] - x['floor_ms'] / (r[0]['median_step_s'] * 1e3)) < 1e-12, x
" || fail "bench --kinds"
# The table prints the same columns; the 0.1B-width preset (configs/bench/wide.toml), made small
# in depth and tokens here, runs through it.
"$DK" bench --config "$SRC/configs/bench/wide.toml" --set model.n_layers=1 --set model.seq_len=16 \
  --set train.micro_batch=1 --kinds residual,attnres --steps 1 --warmup 0 >kinds.txt
grep -q "overhead ms.*floor.*FLOP bound ms.*traffic bound ms" kinds.txt \
  || fail "bench --kinds: no floor columns: $(cat kinds.txt)"
grep -q "^attnres " kinds.txt && grep -q "GB/s, timed among the steps" kinds.txt \
  && grep -q "GFLOP/s (\[tokens, d\] . \[d, d\], timed among the steps)" kinds.txt \
  || fail "bench --kinds: $(cat kinds.txt)"
# Variants of the MoE config interleaved: the grouped expert product, the per-expert loop, and the
# dense model of the same active parameters less the router (d_ff 384 = top_k 2 · 128 + 1 shared · 128);
# the dispatch's memory is measured for the MoE variants only. No timing is asserted.
MOE_SETS=(--set model.vocab_size=512 --set model.seq_len=32 --set model.d_model=64 --set model.n_layers=2
          --set train.micro_batch=2)
"$DK" bench --config "$SRC/configs/tiny-moe.toml" "${MOE_SETS[@]}" --steps 1 --warmup 0 \
  --variant grouped:moe.expert_impl=grouped --variant loop:moe.expert_impl=loop --variant dense:moe.n_experts=0 >variants.txt
for v in grouped loop dense; do grep -q "^$v " variants.txt || fail "bench --variant: no row for $v: $(cat variants.txt)"; done
grep -q "MoE dispatch memory per token" variants.txt || fail "bench --variant: no dispatch memory: $(cat variants.txt)"
"$DK" bench --config "$SRC/configs/tiny-moe.toml" "${MOE_SETS[@]}" --steps 1 --warmup 0 --json \
  --variant grouped:moe.expert_impl=grouped --variant loop:moe.expert_impl=loop --variant dense:moe.n_experts=0 \
  | python3 -c "
import json, sys
r = {x['variant']: x for x in json.load(sys.stdin)['runs']}
assert list(r) == ['grouped', 'loop', 'dense'] and r['grouped']['ratio'] == 1, r
assert r['loop']['overrides'] == ['moe.expert_impl=loop'] and all(x['kind'] == 'residual' for x in r.values()), r
assert r['grouped']['dispatch']['expert_impl'] == 'grouped' and r['loop']['dispatch']['expert_impl'] == 'loop', r
assert r['dense']['dispatch'] is None and r['dense']['active_parameters'] == r['dense']['parameters'], r['dense']
# one MoE layer (the first is dense): the MoE model's active parameters are the dense model's plus its router, 8 x 64
assert r['grouped']['active_parameters'] == r['dense']['active_parameters'] + 8 * 64, r
assert r['grouped']['dispatch']['sorted_copy_bytes_per_token'] == 2 * 64 * 4, r['grouped']['dispatch']
assert r['grouped']['dispatch']['kept_bytes_per_token'] > r['grouped']['dispatch']['sorted_copy_bytes_per_token'], r
" || fail "bench --variant"
# The operator profile: DAR's step runs its fused read forward and backward, the residual's does not;
# self times add up to no more than each operator's total.
"$DK" bench --config "$SRC/configs/tiny.toml" "${SETS[@]}" --kinds residual,dar --steps 1 --warmup 0 --profile 1 --json \
  | python3 -c "
import json, sys
runs = {r['kind']: {p['op']: p for p in r['profile']} for r in json.load(sys.stdin)['runs']}
assert 'aten::mm' in runs['residual'] and 'depthkit::dar_read' not in runs['residual'], runs['residual'].keys()
assert runs['dar']['depthkit::dar_read']['calls_per_step'] == 4, runs['dar']['depthkit::dar_read']  # one per branch (2 layers)
assert 'depthkit::dar_read_backward' in runs['dar'], runs['dar'].keys()
assert all(0 <= p['self_ms_per_step'] <= p['total_ms_per_step'] + 1e-9 for r in runs.values() for p in r.values())
" || fail "bench --profile"
# Every fused operator (all 14) timed against its reference.
# Each reports the bytes its fused form must move (depth_read at the tiny shapes, N = 5, P = 4096,
# d = 128: (3N + 2)·P·d floats) and the speedup it would have at copy speed; only mhc_pre and
# linear_cross_entropy have work that fusion cannot remove (their GEMMs).
"$DK" bench --ops tiny --steps 1 --json | python3 -c "
import json, sys
r = json.load(sys.stdin)
ops = {o['op']: o for o in r['ops']}
assert all(o['fused_ms'] > 0 and o['bytes'] > 0 for o in ops.values()), r
assert ops['depth_read']['bytes'] == 4 * 17 * 4096 * 128, ops['depth_read']
assert all(o['copy_bound_speedup'] > 0 and abs(o['gbs'] - o['bytes'] / o['fused_ms'] / 1e6) < 1e-6 * o['gbs'] for o in ops.values()), r
with_gemms = {'mhc_pre', 'linear_cross_entropy'}
assert all((o['irreducible_ms'] > 0) == (k in with_gemms) for k, o in ops.items()), r
assert r['bandwidth'][0]['copy_gbs'] > 0, r
every = {'depth_read', 'depth_merge', 'dar_read', 'dar_write', 'msar_read', 'msar_block_read', 'msar_fuse', 'mhc_pre', 'mhc_sinkhorn',
         'mhc_merge', 'rms_norm', 'rope_qkv', 'swiglu', 'linear_cross_entropy', 'shared_source'}
assert set(ops) == every, sorted(ops)
# N = 5 reads of N entries, and the entries' copies
assert ops['shared_source']['bytes'] == 4 * (5 * (3 * 5 + 2) + 2 * 5) * 4096 * 128, ops['shared_source']
# MSAR's (m = 4): the read's (3N + 2m)·P·d floats, the fuse's (3m + 5)·P·d
assert ops['msar_read']['bytes'] == 4 * (3 * 5 + 2 * 4) * 4096 * 128, ops['msar_read']
assert ops['msar_fuse']['bytes'] == 4 * (3 * 4 + 5) * 4096 * 128, ops['msar_fuse']
assert ops['msar_block_read']['bytes'] == 4 * (3 * 5 + 4 * 4) * 4096 * 128, ops['msar_block_read']  # S = 2
# and their FLOPs as the kernels run them (the count in bench/op_bench.cpp, per token, sum of the
# kernels' lengths 24): the read 72d forward + 196d backward per source, the fuse 124d + 340d;
# the floor is those FLOPs at the GEMM rate timed beside them. The other ops' FLOPs are not counted.
assert ops['msar_read']['flops'] == (72 + 196) * 128 * 5 * 4096, ops['msar_read']
assert ops['msar_fuse']['flops'] == (124 + 340) * 128 * 4096, ops['msar_fuse']
# (the block's two reads: the expansions and transposes once, the streams' terms twice)
assert ops['msar_block_read']['flops'] == (96 + 248) * 128 * 5 * 4096, ops['msar_block_read']
for o in (ops['msar_read'], ops['msar_block_read'], ops['msar_fuse']):
  assert o['gemm_gflops'] > 0 and abs(o['flop_floor_ms'] - o['flops'] / o['gemm_gflops'] / 1e6) < 1e-9 * o['flop_floor_ms'], o
  assert abs(o['of_flop_floor'] - o['fused_ms'] / o['flop_floor_ms']) < 1e-9 * o['of_flop_floor'], o
  # the floor: the FLOP floor plus the bytes at the copy speed measured in the same run
  assert abs(o['floor_ms'] - o['flop_floor_ms'] - o['traffic_floor_ms']) < 1e-9 * o['floor_ms'], o
  assert abs(o['of_floor'] - o['fused_ms'] / o['floor_ms']) < 1e-9 * o['of_floor'], o
assert all(o['flops'] is None and o['of_flop_floor'] is None and o['floor_ms'] is None
           for k, o in ops.items() if not k.startswith('msar')), r
copy_gbs = {b['shape']: b['copy_gbs'] for b in r['bandwidth']}
assert all(abs(o['traffic_floor_ms'] - o['bytes'] / copy_gbs[o['shape']] / 1e6) < 1e-9 * o['traffic_floor_ms']
           for o in ops.values()), r
" || fail "bench --ops"

# The fused operators follow the reference compositions through training, for every kind
# (bench/parity: losses step by step, within its float32 tolerance; a wrong gradient moves
# them by ~1e-2).
python3 "$SRC/bench/parity" --depthkit "$DK" --config "$SRC/configs/tiny.toml" --steps 8 \
  "${SETS[@]}" --set train.eval_tokens=1024 >parity.txt || { cat parity.txt; fail "parity"; }

# MSAR's MoE backbones (MSAR Appendix A Table 3, Appendix B Table 4; docs/design.md, "MSAR's MoE
# backbones"): exact counts of the Vanilla backbone as shipped and with --set residual.kind=msar
# (eq. 20's increment on every count); then the paper's figures, at the paper's precision, from
# its accounting: Table 3's totals count everything, Table 4's totals and both tables' activated
# counts drop the input embedding only ("-": the table has no such figure).
for row in msar-moe-10b:9784584160:9151997920:1420388320:787802080:2745750:10:1.1:9.47:1.10 \
           msar-moe-18b:17722165824:17079847488:2087553600:1445235264:5204248:18:1.7:17.40:1.77 \
           msar-moe-28b:27979082240:27200514560:3112102400:2333534720:7209280:28:2.7:-:- \
           msar-moe-scaling-2.21b:2365815808:2054388736:494107648:182680576:1351830:-:-:2.21:0.34 \
           msar-moe-scaling-3.75b:3906089200:3589796080:620155120:303862000:2105190:-:-:3.75:0.46; do
  IFS=: read -r cfg total nonv act actnv msar t3tot t3act t4tot t4act <<<"$row"
  for kind in residual msar; do
    add=0; [ $kind = msar ] && add=$msar
    "$DK" params --config "$SRC/configs/paper/$cfg.toml" --set residual.kind=$kind --json >msar_moe_$kind.json
    for pair in total:$((total + add)) non_vocab:$((nonv + add)) active:$((act + add)) \
                active_non_vocab:$((actnv + add)) residual:$add; do
      got=$(json "[\"${pair%%:*}\"]" <msar_moe_$kind.json)
      [ "$got" = "${pair##*:}" ] || fail "params $cfg $kind: ${pair%%:*} $got, expected ${pair##*:}"
    done
  done
  python3 - msar_moe_residual.json "$t3tot" "$t3act" "$t4tot" "$t4act" <<'PY' || fail "params $cfg: the paper's figures"
import json, sys
c = json.load(open(sys.argv[1]))
emb = c["components"]["embedding"]
ours = [c["total"], c["active"] - emb, c["total"] - emb, c["active"] - emb]
for i, (paper, n) in enumerate(zip(sys.argv[2:], ours)):
    if paper != "-":
        places = len(paper.split(".")[1]) if "." in paper else 0
        if i == 1:  # Table 3's activated counts are cut, not rounded: 18B's 1.766B is its "1.7B"
            n = n // 10 ** (9 - places) * 10 ** (9 - places)
        assert f"{n / 1e9:.{places}f}" == paper, (n, paper)
PY
done
echo "cli_end_to_end: 1 passed, 0 failed"
