#!/usr/bin/env bash
# The CPU speed guards (benchmark/guards.py): every promised ratio measured side by
# side with its baseline, printed against its goal; exits 1 when one is past its goal
# by more than its noise. Run before landing; say in the commit when a ratio moved.
#   bash benchmark/guards.sh [--only P2 P4] [--reps 21] [--out guards.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { make build >/dev/null && PY=.venv/bin/python; }
exec "$PY" benchmark/guards.py "$@"
