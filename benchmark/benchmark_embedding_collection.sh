#!/usr/bin/env bash
# Sharded EmbeddingCollection benchmark: dedup on/off x TorchRec static tables / one
# dynamic table, measured in one run on 2 gloo ranks (CPU).
#   bash benchmark/benchmark_embedding_collection.sh [use_index_dedup] [use_dynamic_embedding] [batch_size]
# use_index_dedup / use_dynamic_embedding: true, false or both (default both both: the
# full 2x2 table); batch_size per rank (default 8192; upstream: True True 65536 on GPUs).
# Extra flags go to the .py (e.g. --collection ebc for the EmbeddingBagCollection).
# Writes benchmark/out/embedding_collection.{json,md} (embedding_bag_collection for ebc).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { make build >/dev/null && PY=.venv/bin/python; }
NPROC=${NPROC:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    benchmark/benchmark_embedding_collection.py \
    --use_index_dedup "${1:-both}" --use_dynamic_embedding "${2:-both}" --batch_size "${3:-8192}" "${@:4}"
