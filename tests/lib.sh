# The preamble the shell tests share, sourced as their first command:
#   source "$(dirname "$0")/lib.sh" "$@"
# DK is the depthkit binary (the test's first argument), SRC the source tree; the test runs in a
# fresh temporary directory, TMP, removed when it exits.
DK=$1
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
# fail MESSAGE...: report and stop.
fail() { echo "FAIL: $*"; exit 1; }
# json EXPR < FILE: a field of a JSON document, e.g. json '["loss"]'.
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
