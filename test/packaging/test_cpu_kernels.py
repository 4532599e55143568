"""The copies of the CPU kernels, one per instruction-set level, and the dispatcher
that picks one (``dynamicemb.ops.cpu_kernels``).

Each copy this CPU runs is driven through the reference suites (the dict-model table,
the dense-PyTorch module, the all-resident storage twin) in a process forced onto it;
the copy the dispatcher picks by default is the one every other test here runs.
"""

# CPU only: these are the CPU extension's copies.

import pathlib
import platform

import pytest

from dynamicemb.ops import cpu_kernels, for_device
from dynamicemb_testing.scripts import run_python

# The reference suites each copy must pass (about a minute per copy on 2 cores).
REFERENCE_SUITES = (
    "test/table/test_hash_table_grid.py",
    "test/table/test_dedup_find_or_insert.py",
    "test/module/test_against_dense.py",
    "test/storage/test_exactness.py",
    "test/module/test_sixteen_bit_kernels.py",
)

# The suites under pytest in a process that first says which copy it runs (one process:
# a separate one for the check cost 5 s). The SIMT cases run the CUDA source, which no
# CPU copy changes, and agree with the CPU bit for bit only where its float32 arithmetic
# is the default copy's (fused multiply-adds): left out.
_SUITES = """
import sys
import pytest
from dynamicemb.ops import for_device
print("USED", for_device("cpu").kernels.__name__, flush=True)
sys.exit(pytest.main(["-x", "-p", "no:cacheprovider", "-k", "not simt", *sys.argv[1:]]))
"""

# What /proc/cpuinfo must list for a level (the psABI's x86-64 levels).
LEVEL_FLAGS = {
    "x86_64_v3": {"avx2", "fma", "bmi1", "bmi2", "sse4_2", "popcnt"},
    "x86_64_v4": {"avx2", "fma", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd",
                  "avx512dq", "avx512vl"},
}
X86_64 = platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags():
    info = pathlib.Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo to check the CPU's levels against")
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo lists no flags")


@pytest.mark.skipif(not X86_64, reason="the levels are x86-64's")
def test_an_x86_install_carries_every_level_or_one_named_target():
    assert cpu_kernels.built() in (["x86_64_v4", "x86_64_v3", "baseline"], ["local"])


@pytest.mark.skipif(not X86_64, reason="the levels are x86-64's")
def test_the_cpu_check_agrees_with_proc_cpuinfo():
    if "baseline" not in cpu_kernels.built():
        pytest.skip("a DYNAMICEMB_CPU_ARCH build has one copy and no check")
    flags = cpu_flags()
    runs = cpu_kernels.runnable()
    assert "baseline" in runs
    for level, needed in LEVEL_FLAGS.items():
        assert (level in runs) == needed.issubset(flags), (level, sorted(needed - flags))


def test_the_default_is_the_best_copy_this_cpu_runs(monkeypatch):
    monkeypatch.delenv("DYNAMICEMB_CPU_KERNELS", raising=False)
    cpu_kernels.load.cache_clear()
    try:
        chosen = cpu_kernels.load()
    finally:
        cpu_kernels.load.cache_clear()
    assert chosen.__name__ == f"dynamicemb._C_{cpu_kernels.runnable()[0]}"
    assert for_device("cpu").kernels.__name__ in {f"dynamicemb._C_{c}" for c in cpu_kernels.built()}


def test_the_choice_is_logged_once_at_debug_level():
    done = run_python(["-c", (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s')\n"
        "from dynamicemb.table import ScoredHashTable\n"
        "for _ in range(2):\n"
        "    t = ScoredHashTable(capacity=1024)\n"
        "    t.find_or_insert(torch.arange(10))\n"
        "from dynamicemb.ops import for_device\n"
        "print('USED', for_device('cpu').kernels.__name__)\n")], check=True)
    lines = [ln for ln in done.stderr.splitlines() if "dynamicemb CPU kernels:" in ln]
    used = done.stdout.split("USED ")[1].strip()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("dynamicemb ") and used in lines[0]


# Forces each copy of argv in turn and asks for the CPU backend; prints how each ended.
# One process for both copies (a process each cost 5 s): the variable is read when the
# kernels load, and a refused load leaves nothing cached.
_REFUSALS = """
import os, sys
import torch
from dynamicemb.ops import cpu_kernels, for_device
for copy in sys.argv[1:]:
    os.environ["DYNAMICEMB_CPU_KERNELS"] = copy
    cpu_kernels.load.cache_clear()
    try:
        print("LOADED", copy, for_device("cpu").kernels.__name__)
    except Exception as err:
        print("REFUSED", copy, type(err).__name__, err)
"""


def test_an_unknown_or_unbuilt_copy_is_refused_by_name():
    missing = [c for c in cpu_kernels.COPIES if c not in cpu_kernels.built()]
    done = run_python(["-c", _REFUSALS, "avx9000", missing[0]], check=True)
    unknown, unbuilt = done.stdout.splitlines()
    assert unknown.startswith("REFUSED avx9000 ValueError "), done.stdout
    assert "DYNAMICEMB_CPU_KERNELS='avx9000'" in unknown and "x86_64_v3" in unknown
    assert unbuilt.startswith(f"REFUSED {missing[0]} ImportError "), done.stdout
    assert "is not built in this install" in unbuilt


@pytest.mark.parametrize("copy", cpu_kernels.COPIES)
def test_each_copy_this_cpu_runs_passes_the_reference_suites(copy):
    if copy not in cpu_kernels.built():
        pytest.skip(f"{copy} is not built in this install")
    if copy not in cpu_kernels.runnable():
        pytest.skip(f"this CPU cannot run {copy}")
    if copy == cpu_kernels.runnable()[0]:
        pytest.skip(f"{copy} is the default copy: every other test here runs it")
    suites = run_python(["-c", _SUITES, *REFERENCE_SUITES], env={"DYNAMICEMB_CPU_KERNELS": copy},
                        timeout=1200)
    used = suites.stdout.splitlines()[0] if suites.stdout else ""
    assert used == f"USED dynamicemb._C_{copy}", suites.stdout[-4000:] + suites.stderr[-2000:]
    assert suites.returncode == 0, suites.stdout[-4000:] + suites.stderr[-2000:]
    assert " passed" in suites.stdout and " failed" not in suites.stdout
