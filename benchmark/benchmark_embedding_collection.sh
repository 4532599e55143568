#!/usr/bin/env bash
# Sharded EmbeddingCollection benchmark: dedup on/off x TorchRec static tables / one
# dynamic table, measured in one run on gloo ranks (CPU).
#   bash benchmark/benchmark_embedding_collection.sh [use_index_dedup] [use_dynamic_embedding] [batch_size]
# use_index_dedup / use_dynamic_embedding: true, false or both (default both both: the
# full 2x2 table); batch_size per rank (default 8192; upstream: True True 65536 on GPUs).
# Extra flags go to the .py (e.g. --collection ebc for the EmbeddingBagCollection).
# Writes benchmark/out/embedding_collection.{json,md} (embedding_bag_collection for ebc).
# NPROC ranks per node (default 2). One node by default (torchrun --standalone); several
# nodes: run it on each with NNODES, NODE_RANK (0 .. NNODES-1), MASTER_ADDR (node 0's
# address) and optionally MASTER_PORT (default 29500), e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=1 bash benchmark/benchmark_embedding_collection.sh true both 2048
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { make build >/dev/null && PY=.venv/bin/python; }
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
    NODES=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
           --master_addr "${MASTER_ADDR:?set MASTER_ADDR (node 0)}" --master_port "${MASTER_PORT:-29500}")
else
    NODES=(--standalone)
fi
exec "$PY" -m torch.distributed.run "${NODES[@]}" --nproc_per_node "$NPROC" \
    benchmark/benchmark_embedding_collection.py \
    --use_index_dedup "${1:-both}" --use_dynamic_embedding "${2:-both}" --batch_size "${3:-8192}" "${@:4}"
