#!/usr/bin/env bash
# Benchmark BatchedDynamicEmbeddingTables beside TorchRec's static table (FBGEMM TBE)
# on the same device, in one run. CPU defaults fit 2 cores in a few minutes; pass
# flags to reach the upstream scale, e.g.
#   bash benchmark/benchmark_batched_dynamicemb_tables.sh \
#       --batch_sizes 65536 1048576 --num_embeddings 8388608 67108864 --num_iterations 100
# Writes benchmark/out/batched_dynamicemb_tables.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { make build >/dev/null && PY=.venv/bin/python; }
exec "$PY" benchmark/benchmark_batched_dynamicemb_tables.py "$@"
