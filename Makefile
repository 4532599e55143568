# Two commands: `make demo` and `make test`. Both set up .venv from the pinned
# requirements on first use (only Python 3.11 and pip are needed), build the
# package's C++ kernels, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.package-built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
# the slowest tests are listed at the end of each run: the suite must stay under 20 minutes
PYTEST_ARGS ?= --durations=20

.PHONY: all demo test build bench guards gpu-check clean distclean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt requirements-nodeps.txt | $(PY)
	$(PIP) install --disable-pip-version-check -q -r requirements.txt
	$(PIP) install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt
	touch $@

# --no-build-isolation: the extension builds against the pinned torch in .venv
# (an isolated build would fetch the newest torch with CUDA packages).
$(BUILD_STAMP): $(DEPS_STAMP) setup.py $(CSRC)
	$(PIP) install --disable-pip-version-check -q --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILD_STAMP)

# The main job at demo size: synthetic Criteo-like data with raw int64 ids, a DLRM
# whose big tables are dynamic with device caches smaller than what they end up
# holding, 2 gloo ranks under torchrun; prints the eval AUC and where the plot is.
DEMO_ARGS ?= --num-samples 600000 --eval-samples 40000 --batch-size 1024 --eval-every 100

demo: $(BUILD_STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/dlrm/train.py $(DEMO_ARGS)

test: $(BUILD_STAMP)
	$(PY) -m pytest test $(PYTEST_ARGS)

bench: $(BUILD_STAMP)
	$(PY) benchmark/benchmark_hash_table.py

# The CPU speed guards: each ratio against its goal (run before landing).
guards: $(BUILD_STAMP)
	bash benchmark/guards.sh

# On a machine with a GPU, PyTorch with CUDA and CuPy (uses that python, no venv):
# run A (about 8 minutes on an H100, the most valuable checks first), GPU_RUN=B the
# rest; GPU_DRY_RUN=1 runs every stage on the CPU at tiny sizes (benchmark/gpu_check.sh).
gpu-check:
	bash benchmark/gpu_check.sh

clean:
	rm -rf build dynamicemb/*.so dynamicemb/*.egg-info *.egg-info $(BUILD_STAMP)

distclean: clean
	rm -rf $(VENV)
