#!/usr/bin/env bash
# The whole GPU validation in one command (`make gpu-check`), for a machine with
# a GPU, PyTorch with CUDA and CuPy (no TorchRec needed, no package registry):
# builds the CPU extension against the torch found there, runs the test suites
# that need no TorchRec with the CUDA tests enabled (CPU twins included), a
# compute-sanitizer memcheck of a short CUDA run, then the hash-table and
# batched-tables benchmarks. Logs, JSON and markdown go to $OUT (default
# benchmark/out/gpu); `summary.txt` there has one exit code per stage.
#
# Stages: GPU_STAGES="build tests sanitizer racecheck hash tables caching steps profile" (default: all).
set -uo pipefail
OUT=${OUT:-benchmark/out/gpu}
PY=${PYTHON:-python3}
STAGES=${GPU_STAGES:-build tests sanitizer racecheck hash tables caching steps profile}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: > "$OUT/summary.txt"

stage() {  # stage NAME COMMAND...: runs it unless not asked for, logs, records rc
  local name=$1
  shift
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/summary.txt"
}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  $PY -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'; } \
  > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

stage build $PY -m pip install -q --no-build-isolation --no-deps -e .
stage tests $PY -m pytest ${GPU_TESTS:-test/cuda test/table test/module test/storage} -q -p no:cacheprovider \
  --junitxml="$OUT/tests.xml"
stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
  $PY -m pytest -q -p no:cacheprovider test/cuda/test_table_twins.py test/cuda/test_module_twins.py \
  -k "(random_calls and LRU and 16) or EXACT_SGD-SUM-w or ADAM-MEAN"
# shared-memory hazards (the fused update's per-warp rows, the inserting warps)
stage racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
  $PY -m pytest -q -p no:cacheprovider test/cuda/test_table_twins.py test/cuda/test_module_twins.py \
  -k "(random_calls and LRU and 16) or ADAM-SUM-w or large_batch"
stage hash $PY benchmark/benchmark_hash_table.py --device cuda --capacity 1048576 \
  --batch 1048576 --dims 8 64 128 --reps 20 --out "$OUT/hash_table_1M"
stage hash $PY benchmark/benchmark_hash_table.py --device cuda --capacity 67108864 \
  --batch 1048576 --dims 8 --reps 20 --out "$OUT/hash_table_64M"
stage tables $PY benchmark/benchmark_gpu_tables.py --batch_sizes 65536 1048576 \
  --num_embeddings 8388608 --optimizers sgd adam --graphed --out "$OUT/gpu_tables_8M"
# 64M rows: SGD only (Adam's states for both tables would not fit in 80 GB at once)
stage tables $PY benchmark/benchmark_gpu_tables.py --batch_sizes 65536 1048576 \
  --num_embeddings 67108864 --optimizers sgd --graphed --out "$OUT/gpu_tables_64M"
# the seed's caching rows (its budgets: 4 GiB of HBM for SGD's rows, 12 GiB for Adam's,
# i.e. every row of an 8M table and 1/8 of a 64M one): an HBM cache over the host store
# (rows in pinned host memory) and rows read in place, beside the static table. 64M x
# Adam is left out: the static SparseAdam table (96 GB) does not fit an 80 GB GPU.
stage caching $PY benchmark/benchmark_gpu_tables.py --batch_sizes 65536 1048576 \
  --num_embeddings 8388608 67108864 --optimizers sgd --hbm_gib 4 --skip_all_hbm --graphed \
  --out "$OUT/gpu_caching_sgd"
stage caching $PY benchmark/benchmark_gpu_tables.py --batch_sizes 65536 1048576 \
  --num_embeddings 8388608 --optimizers adam --hbm_gib 12 --skip_all_hbm \
  --out "$OUT/gpu_caching_adam"
# the step's syncs as PyTorch's sync debug mode sees them (the CPU guard says none), a
# step under the "error" mode, a captured CUDA graph's replays against eager training,
# and training at the widest dims against the CPU
stage steps $PY benchmark/gpu_step_check.py --lookups 65536
stage profile $PY benchmark/profile_gpu_step.py --batch 65536 --num_embeddings 8388608
! grep -v "rc=0" "$OUT/summary.txt"
