#!/usr/bin/env bash
# The GPU validation (`make gpu-check`), as two runs of about 8 minutes each on an
# H100, for a machine with a GPU, PyTorch with CUDA and CuPy (no TorchRec needed, no
# package registry). GPU_RUN=A (default) or B picks the run:
#
#   A, most valuable first: steps (gpu_step_check.py: syncs, sync debug mode "error",
#      the profiler's waits and a real CUDA graph against an eager twin, for every
#      layout), twins (the GPU twins against the CPU backend), wide_dims, memcheck
#      (the kernel sweep, caching allocator off), tables_8m and caching_64m (the
#      seed's rows at batch 65,536 beside plain PyTorch), hash and hash_64m (load
#      0.75, dim 8, 1M and 64M slots).
#   B: racecheck and synccheck (the kernel sweep), suites (every CUDA-parametrized
#      test), tables_1m (batch 1,048,576), tables_64m (64M rows all in HBM),
#      caching_adam, hash_grid and hash_grid_64m (every load and dim), profile.
#
# The CPU extension (one copy, DYNAMICEMB_CPU_ARCH=native) builds in the background
# while the first stages run (they use only the GPU and time nothing); a stage that
# needs it, or that times, waits for it, and one that needs it is skipped if it
# failed. Each stage runs under its own timeout, and an overall deadline
# (GPU_DEADLINE_S, default 480 s) skips a stage whose estimate no longer fits.
# Everything goes to $OUT as it comes (default benchmark/out/gpu-<run>): device.txt,
# one appended log per stage (<stage>.log), the scripts' JSON, stages/<stage>.json
# when the stage ends and a line per stage in summary.txt (status, rc, seconds).
# Exit code 0 when every stage passed, else 1.
#
# GPU_DRY_RUN=1 runs every stage on the CPU at tiny sizes instead (the CUDA path
# emulated, the graph stand-in; sanitizer stages run the sweep without the
# sanitizer, test stages collect their selection, the build stage checks the built
# extension loads): what CI runs so that no GPU run is a script's first.
# Also: GPU_STAGES="steps twins" (only those), GPU_STAGE_LIMIT_S (caps every
# stage's timeout), PYTHON (default python3; .venv/bin/python in a dry run).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RUN=${GPU_RUN:-A}
DRY=${GPU_DRY_RUN:-0}
[[ $RUN == A || $RUN == B ]] || { echo "GPU_RUN must be A or B, got $RUN" >&2; exit 2; }
if [[ $DRY == 1 ]]; then
  OUT=${OUT:-benchmark/out/gpu-dry-$RUN}
  DEFAULT_PY=python3
  [[ -x .venv/bin/python ]] && DEFAULT_PY=.venv/bin/python
  PY=${PYTHON:-$DEFAULT_PY}
else
  OUT=${OUT:-benchmark/out/gpu-$RUN}
  PY=${PYTHON:-python3}
fi
DEADLINE_S=${GPU_DEADLINE_S:-480}
STAGE_LIMIT_S=${GPU_STAGE_LIMIT_S:-600}
STAGES=${GPU_STAGES:-}
export PYTHONUNBUFFERED=1
# this checkout's package and the test helpers (the emulation), before the build ends
export PYTHONPATH="$ROOT:$ROOT/test${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/stages"
: > "$OUT/summary.txt"
rm -f "$OUT"/stages/*.json
T0=$SECONDS

json_string() {  # the argument as a JSON string
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "${s//$'\n'/ }"
}

record() {  # record NAME STATUS RC SECONDS TIMEOUT ESTIMATE COMMAND...
  local name=$1 status=$2 rc=$3 seconds=$4 timeout=$5 estimate=$6
  shift 6
  echo "$name status=$status rc=$rc seconds=$seconds timeout=$timeout estimate=$estimate" \
    | tee -a "$OUT/summary.txt"
  printf '{"stage": "%s", "run": "%s", "dry_run": %s, "status": "%s", "rc": %s, "seconds": %s, "timeout": %s, "estimate": %s, "log": "%s.log", "command": %s}\n' \
    "$name" "$RUN" "$([[ $DRY == 1 ]] && echo true || echo false)" "$status" "$rc" "$seconds" \
    "$timeout" "$estimate" "$name" "$(json_string "$*")" > "$OUT/stages/$name.json"
}

selected() { [[ -z $STAGES || " $STAGES " == *" $1 "* ]]; }

run_stage() {  # run_stage NAME ESTIMATE LIMIT COMMAND...: timeout, log, record
  local name=$1 estimate=$2 limit=$3
  shift 3
  local left=$((DEADLINE_S - (SECONDS - T0)))
  if ((left < estimate)); then
    echo "== $name: skipped, ${left}s left before the deadline, estimate ${estimate}s" \
      | tee -a "$OUT/$name.log"
    record "$name" skipped -1 0 0 "$estimate" "$@"
    return 0
  fi
  local timeout=$limit
  ((STAGE_LIMIT_S < timeout)) && timeout=$STAGE_LIMIT_S
  ((left < timeout)) && timeout=$left
  echo "== $name (estimate ${estimate}s, timeout ${timeout}s, $(date -u +%T)): $*" \
    | tee -a "$OUT/$name.log"
  local start=$SECONDS
  timeout -k 10 "$timeout" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]} status=ok
  ((rc != 0)) && status=failed
  ((rc == 124 || rc == 137)) && status=timeout
  record "$name" "$status" "$rc" $((SECONDS - start)) "$timeout" "$estimate" "$@"
}

BUILD_PID=""
start_build() {  # the CPU extension, one copy, in the background
  selected build || return 0
  if [[ $DRY == 1 ]]; then  # CI has built it: check that it loads
    run_stage build 5 60 "$PY" -c \
      "from dynamicemb.ops import cpu_kernels; print('CPU kernels:', cpu_kernels.load().__name__)" &
  else
    run_stage build 60 300 env DYNAMICEMB_CPU_ARCH=native \
      "$PY" -m pip install -q --no-build-isolation --no-deps -e . &
  fi
  BUILD_PID=$!
}

build_ok() {  # waits for the build; true if it passed (or was not asked for here)
  if [[ -n $BUILD_PID ]]; then
    wait "$BUILD_PID"
    BUILD_PID=""
  fi
  [[ ! -f $OUT/stages/build.json ]] || grep -q '"status": "ok"' "$OUT/stages/build.json"
}

stage() {  # stage NAME ESTIMATE LIMIT [needs-build|after-build|gpu-only] COMMAND...
  local name=$1 estimate=$2 limit=$3 when=$4
  shift 4
  selected "$name" || return 0
  if [[ $when != gpu-only ]]; then
    # timings and CPU twins wait for the build; CPU twins need it to have passed
    if ! build_ok && [[ $when == needs-build ]]; then
      echo "== $name: skipped, the CPU extension's build failed" | tee -a "$OUT/$name.log"
      record "$name" skipped -1 0 0 "$estimate" "$@"
      return 0
    fi
  fi
  run_stage "$name" "$estimate" "$limit" "$@"
}

# ------------------------------------------------------------------ the machine
{
  echo "gpu-check run $RUN$([[ $DRY == 1 ]] && echo ' (dry run on the CPU)'), $(date -u)"
  command -v nvidia-smi > /dev/null && \
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" - <<'EOF'
import importlib.util, os, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("cupy", "xdist", "torchrec"):
    spec = importlib.util.find_spec(name)
    version = getattr(__import__(name), "__version__", "?") if spec else None
    print(f"{name}: {version or 'absent'}")
print("cores", len(os.sched_getaffinity(0)))
EOF
} 2>&1 | tee "$OUT/device.txt"

XDIST=()
if "$PY" -c "import xdist" 2> /dev/null; then
  workers=$(nproc)
  ((workers > 14)) && workers=14
  XDIST=(-n "$workers")
fi
TESTS=("$PY" -m pytest -p no:cacheprovider -vv "${XDIST[@]}")
SANITIZE=()
[[ $DRY == 1 ]] && TESTS+=(--collect-only)  # the selection exists and imports
EMULATED=()
[[ $DRY == 1 ]] && EMULATED=(--emulated)
sanitizer() {  # sanitizer TOOL: the command prefix of a compute-sanitizer run
  SANITIZE=()
  [[ $DRY == 1 ]] || SANITIZE=(compute-sanitizer --tool "$1" --error-exitcode 1)
}
# sizes: the GPU's, or tiny ones for a dry run on the CPU
if [[ $DRY == 1 ]]; then
  LOOKUPS=(--lookups 256 --num-ids 128 --dim 8 --replays 2)
  WIDE=(--wide-dims 8 40)
  SMALL=(--num_embeddings 4096); LARGE=(--num_embeddings 8192)
  BATCH=256; BIG_BATCH=512
  TABLE_ARGS=(--embedding_dim 16 --num_iterations 2 --warmup 1 --distinct_batches 2
              --leak_slack_mib 0.01)
  HBM_SGD=0.00002; HBM_ADAM=0.00006
  HASH=(--batch 1024 --reps 2); HASH_1M=(--capacity 4096); HASH_64M=(--capacity 8192)
  PROFILE=(--batch 256 --num_embeddings 4096 --steps 2 --table_log2_slots 10)
else
  LOOKUPS=(--lookups 65536)
  WIDE=()
  SMALL=(--num_embeddings 8388608); LARGE=(--num_embeddings 67108864)
  BATCH=65536; BIG_BATCH=1048576
  TABLE_ARGS=()
  HBM_SGD=4; HBM_ADAM=12  # the seed's budgets: 1/8 of a 64M SGD table, all of an 8M Adam one
  HASH=(--batch 1048576 --reps 20); HASH_1M=(--capacity 1048576); HASH_64M=(--capacity 67108864)
  PROFILE=(--batch 65536 --num_embeddings 8388608)
fi
TWINS=(test/cuda/test_table_twins.py test/cuda/test_module_twins.py test/cuda/test_prefetch_streams.py
       test/cuda/test_host_memory.py::test_on_a_gpu_the_host_store_takes_no_gpu_memory_and_trains_as_the_cpu
       test/storage/test_exactness.py)
GPU_TABLES=("$PY" benchmark/benchmark_gpu_tables.py "${EMULATED[@]}" "${TABLE_ARGS[@]}")
HASH_TABLE=("$PY" benchmark/benchmark_hash_table.py --device cuda "${EMULATED[@]}" "${HASH[@]}")
SWEEP=("$PY" benchmark/gpu_kernel_sweep.py "${EMULATED[@]}")

start_build
if [[ $RUN == A ]]; then
  stage steps 70 180 gpu-only "$PY" benchmark/gpu_step_check.py "${EMULATED[@]}" "${LOOKUPS[@]}" \
    --parts syncs graph --out "$OUT/steps"
  stage twins 60 150 needs-build "${TESTS[@]}" --junitxml="$OUT/twins.xml" "${TWINS[@]}" \
    -k "cuda and not emulated"
  stage wide_dims 15 60 needs-build "$PY" benchmark/gpu_step_check.py "${EMULATED[@]}" \
    "${LOOKUPS[@]}" "${WIDE[@]}" --parts wide_dims --out "$OUT/wide_dims"
  sanitizer memcheck  # the caching allocator would hide small out-of-bounds accesses
  stage memcheck 75 150 after-build env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SANITIZE[@]}" \
    "${SWEEP[@]}" --out "$OUT/memcheck_sweep.json"
  stage tables_8m 20 90 after-build "${GPU_TABLES[@]}" --batch_sizes "$BATCH" "${SMALL[@]}" \
    --optimizers sgd adam --layouts all-hbm all-hbm-graphed --out "$OUT/gpu_tables_8M"
  stage caching_64m 45 150 after-build "${GPU_TABLES[@]}" --batch_sizes "$BATCH" "${LARGE[@]}" \
    --optimizers sgd --hbm_gib "$HBM_SGD" --layouts cache-graphed --out "$OUT/gpu_caching_64M"
  stage hash 10 60 after-build "${HASH_TABLE[@]}" "${HASH_1M[@]}" --loads 0.75 --dims 8 \
    --out "$OUT/hash_table_1M"
  stage hash_64m 15 60 after-build "${HASH_TABLE[@]}" "${HASH_64M[@]}" --loads 0.75 --dims 8 \
    --out "$OUT/hash_table_64M"
else
  # the sanitizers use the GPU only and time nothing: they run during the build
  sanitizer racecheck  # shared-memory hazards (the fused update's rows, the inserting warps)
  stage racecheck 75 120 gpu-only "${SANITIZE[@]}" "${SWEEP[@]}" --out "$OUT/racecheck_sweep.json"
  sanitizer synccheck
  stage synccheck 45 90 gpu-only "${SANITIZE[@]}" "${SWEEP[@]}" --out "$OUT/synccheck_sweep.json"
  stage suites 120 200 needs-build "${TESTS[@]}" --junitxml="$OUT/suites.xml" "${TWINS[@]}" \
    test/table test/module test/storage -k "cuda and not emulated"
  stage tables_1m 30 120 after-build "${GPU_TABLES[@]}" --batch_sizes "$BIG_BATCH" "${SMALL[@]}" \
    --optimizers sgd adam --layouts all-hbm all-hbm-graphed --out "$OUT/gpu_tables_8M_1M"
  # 64M rows all in HBM: the static table (34 GB) beside one dynamic layout at a time
  stage tables_64m 50 150 after-build "${GPU_TABLES[@]}" --batch_sizes "$BATCH" "$BIG_BATCH" \
    "${LARGE[@]}" --optimizers sgd --layouts all-hbm all-hbm-graphed --out "$OUT/gpu_tables_64M"
  stage caching_adam 40 120 after-build "${GPU_TABLES[@]}" --batch_sizes "$BATCH" "$BIG_BATCH" \
    "${SMALL[@]}" --optimizers adam --hbm_gib "$HBM_ADAM" --skip_all_hbm --graphed \
    --out "$OUT/gpu_caching_adam"  # the flags' way to ask for cache, in-place, cache graphed
  stage hash_grid 20 90 after-build "${HASH_TABLE[@]}" "${HASH_1M[@]}" --loads 0.5 0.75 1.0 \
    --dims 8 64 128 --out "$OUT/hash_table_grid_1M"
  stage hash_grid_64m 25 90 after-build "${HASH_TABLE[@]}" "${HASH_64M[@]}" --loads 0.5 0.75 1.0 \
    --dims 8 --out "$OUT/hash_table_grid_64M"
  stage profile 20 60 after-build "$PY" benchmark/profile_gpu_step.py "${EMULATED[@]}" \
    "${PROFILE[@]}"
fi
build_ok > /dev/null  # a build still running is waited for and recorded

total=$((SECONDS - T0))
not_ok=$(cat "$OUT"/stages/*.json 2> /dev/null | grep -vc '"status": "ok"')
echo "gpu-check run $RUN: $(ls "$OUT"/stages/*.json 2> /dev/null | wc -l) stages, $not_ok not ok, ${total}s" \
  | tee -a "$OUT/summary.txt"
((not_ok == 0))
