#!/usr/bin/env bash
# The set-up on a stock Debian 12 interpreter (issue 14): a clean clone of this repository, then
# scripts/setup with Debian's own /usr/bin/python3, which refuses `pip install` (PEP 668). The
# set-up must make its project-local virtual environment from it, install torch, numpy and
# matplotlib there (not into Debian's Python), and configure the build against that torch.
# Not part of `scripts/test` (it downloads or reinstalls the torch wheel, minutes); run by hand:
#   tests/setup_debian.sh            # install + configure (DEPTHKIT_SETUP_BUILD=0)
#   SETUP_TEST_BUILD=1 tests/setup_debian.sh   # and build as well
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=/usr/bin/python3
[ -x $PY ] || { echo "setup_debian: $PY missing (not a Debian machine)"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
git clone -q "$SRC" "$TMP/clone"
cd "$TMP/clone"
# Debian's interpreter indeed refuses a plain pip install (else this test proves nothing).
if $PY -m pip --version >/dev/null 2>&1; then
  $PY -m pip install --dry-run six >/dev/null 2>"$TMP/pep668" && fail "$PY accepts pip install: not a PEP 668 interpreter"
  grep -q "externally-managed-environment" "$TMP/pep668" || fail "unexpected pip refusal: $(cat "$TMP/pep668")"
fi
PYTHON=$PY DEPTHKIT_SETUP_BUILD=${SETUP_TEST_BUILD:-0} scripts/setup >"$TMP/setup.log" 2>&1 \
  || { tail -20 "$TMP/setup.log"; fail "scripts/setup with $PY failed"; }
[ -x .venv/bin/python ] || fail "no .venv/bin/python"
grep -q "^home = /usr/bin" .venv/pyvenv.cfg || fail ".venv was not made from $PY: $(cat .venv/pyvenv.cfg)"
.venv/bin/python -c "import torch, numpy, matplotlib; assert torch.__version__.startswith('2.11.0'), torch.__version__" \
  || fail "the environment lacks torch 2.11.0, numpy or matplotlib"
grep -q "$TMP/clone/.venv" build/CMakeCache.txt || fail "the build is not configured against .venv's torch"
git status --porcelain | grep -q . && fail "the set-up left files git does not ignore: $(git status --porcelain)"
echo "setup_debian: passed ($PY -> .venv, torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
