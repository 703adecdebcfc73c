#!/usr/bin/env bash
# scripts/gpu-check where there is no GPU, so that it does not rot between GPU runs: with
# --no-build on a build folder holding this build's program, --debs with a package whose
# pkg-config and CMake files name /usr, and the training check on the CPU at a small size
# (bench/gpu_train_check.py --device cpu). The kernel check needs a GPU: it must be recorded (failed
# here), and the rest must still run. An unknown kind must fail and say why. For dar the depthkit
# given says, as the library does for an operator without a kernel on the model's device, that
# dar_read runs its reference composition, and succeeds: dar must pass and its entry list dar_read.
set -uo pipefail
source "$(dirname "$0")/lib.sh" "$@"
CORPUS=/usr/share/doc/python3.11/html/_sources/tutorial
[ -d "$CORPUS" ] || fail "$CORPUS missing (scripts/setup installs python3.11-doc)"

mkdir -p build debs
cat >build/depthkit <<EOF
#!/usr/bin/env bash
if [[ "\$*" == *residual.kind=dar* || "\$*" == *--kinds*dar* ]] && [[ \$1 == train || \$1 == bench ]]; then
  echo 'depthkit: dar_read has no CUDA kernel; running its reference composition (impl = "fused")' >&2
fi
exec "$DK" "\$@"
EOF
chmod +x build/depthkit
ln -s "$(cd "$(dirname "$DK")" && pwd)/libdepthkit_ops.so" build/libdepthkit_ops.so

debs=()
if command -v dpkg-deb >/dev/null; then
  mkdir -p pkg/DEBIAN pkg/usr/lib/x86_64-linux-gnu/pkgconfig pkg/usr/share/cmake/Foo
  printf 'Package: foo\nVersion: 1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: t\n' >pkg/DEBIAN/control
  # shellcheck disable=SC2016  # ${prefix} is pkg-config's, literally
  printf 'prefix=/usr\nlibdir=/usr/lib/x86_64-linux-gnu\nincludedir=${prefix}/include\n' \
    >pkg/usr/lib/x86_64-linux-gnu/pkgconfig/foo.pc
  printf 'set(FOO_LIBRARY "/usr/lib/libfoo.so")\nset(FOO_PREFIX "/usr")\n' >pkg/usr/share/cmake/Foo/FooConfig.cmake
  dpkg-deb -b pkg debs/foo_1_all.deb >/dev/null || fail "dpkg-deb -b"
  debs=(--debs "$TMP/debs")
fi

SMALL=(--set model.vocab_size=512 --set model.n_layers=1 --set model.d_model=32 --set model.n_heads=2
       --set model.n_kv_heads=1 --set model.d_ff=64 --set model.seq_len=32 --set train.micro_batch=4
       --set train.eval_tokens=128 --set train.threads=1 --set optim.warmup_steps=1 --set optim.lr=1e-2)
BUILD_DIR=$TMP/build CORPUS=$CORPUS OMP_NUM_THREADS=1 "$SRC/scripts/gpu-check" --no-build "${debs[@]}" \
  --out "$TMP/out" --budget 400 -- --device cpu --dtype '' --config configs/tiny.toml \
  --kinds residual,dar,bogus --steps 5 --bench-steps 2 --bench-warmup 1 "${SMALL[@]}" >run.log 2>&1
status=$?
[ "$status" = 1 ] || { cat run.log; fail "gpu-check exited $status, expected 1 (kinds failed)"; }
[ -f out/gpu_check.json ] && [ -f out/gpu-check.log ] || fail "no summary or log in --out"
grep -q "^residual  *yes" run.log || { cat run.log; fail "no table row for residual"; }
grep -q "^dar: reference composition .* dar_read" run.log || { cat run.log; fail "no reference line for dar"; }

python3 - "$TMP/out/gpu_check.json" "${#debs[@]}" "$TMP/build/prefix" <<'EOF' || fail "gpu_check.json (above)"
import json, sys
s = json.load(open(sys.argv[1]))
kinds = {e["kind"]: e for e in s["kinds"]}
assert not s["ok"] and s["failed_kinds"] == ["bogus"], (s["ok"], s["failed_kinds"])
stages = {st["stage"]: st for st in s["stages"]}
assert stages["build"]["status"] == "skipped", stages
assert stages["kernels"]["status"] in ("ok", "failed") and stages["kernels"]["message"], stages
for k in ("residual", "dar"):
    e = kinds[k]
    assert e["ok"] and e["error"] is None, e
    assert e["loss_fell"] and e["loss_last"] < e["loss_first"] and e["train_steps_logged"] == 5, e
    assert e["tokens_per_s"] > 0 and e["peak_bytes"] > 0 and e["flops_per_token"] > 0 and e["mfu"] > 0, e
assert kinds["residual"]["overhead_vs_residual"] == 0 and kinds["residual"]["reference_operators"] == []
dar = kinds["dar"]
assert dar["reference_operators"] == ["dar_read"] and dar["overhead_vs_residual"] is not None, dar
assert s["config"]["impl"] == "fused", s["config"]
sh = s["sharded"]  # ZeRO-3 and recomputation on one rank: float32 on the CPU changes no bit
assert sh["status"] == "ok" and sh["loss_max_relative_difference"] == 0.0, sh
assert sh["summary"]["zero"] == 3 and sh["summary"]["recompute"] == "branch", sh
bogus = kinds["bogus"]
assert not bogus["ok"] and "residual.kind" in bogus["error"] and bogus["train_error"], bogus
# bogus fails the interleaved bench, so each kind is timed beside residual: dar's run passes (the
# line is no failure) and, like every run with dar, lists dar_read.
runs = s["bench_runs"]
assert all(r["reference_operators"] == (["dar_read"] if "dar" in r["kinds"] else []) for r in runs), runs
assert any(r["kinds"] == ["residual", "dar"] and r["ok"] for r in runs), runs
if sys.argv[2] != "0":  # the package's /usr paths point into the prefix
    prefix = sys.argv[3]
    assert stages["debs"]["status"] == "ok", stages
    pc = open(f"{prefix}/usr/lib/x86_64-linux-gnu/pkgconfig/foo.pc").read()
    assert f"prefix={prefix}/usr\n" in pc and f"libdir={prefix}/usr/lib/x86_64-linux-gnu\n" in pc, pc
    cm = open(f"{prefix}/usr/share/cmake/Foo/FooConfig.cmake").read()
    assert f'"{prefix}/usr/lib/libfoo.so"' in cm and f'"{prefix}/usr"' in cm, cm
EOF

# A summary is left however the check ends: with no program at all, every kind says so.
rm build/depthkit
BUILD_DIR=$TMP/build "$SRC/scripts/gpu-check" --no-build --out "$TMP/out2" --budget 60 -- --device cpu --dtype '' \
  --kinds residual >run2.log 2>&1
[ $? = 1 ] || fail "gpu-check without a program did not exit 1"
python3 -c "
import json; s = json.load(open('$TMP/out2/gpu_check.json'))
assert s['failed_kinds'] == ['residual'] and 'no depthkit program' in s['kinds'][0]['error'], s['kinds']" \
  || fail "summary without a program"
echo "gpu_check_cpu: ok"
