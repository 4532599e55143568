"""Suites that pick the kernels' own source by environment, each in a subprocess.

- The step's guards (``DEMB_CUDA_EMULATION=simt``: every ``emulated_cuda()`` runs the
  real kernels): no sync and the launch budgets of a steady step, the graph stand-in,
  input errors, host memory, launch configuration, the padded and promotion kernels
  against the CPU's (where a hot row's two-level gradient sum differs from the CPU's
  rank-order sum by rounding, on a GPU too, ``test_step_syncs.py`` compares to that
  rounding).
- The address sanitizer (with the undefined-behaviour sanitizer, fatal there): the
  suites that run the kernels (exactness for every cache size, the table twins, the
  runtime's tests) pass in a process that preloads libasan, and an out-of-bounds read
  in a kernel is reported (the ordinary build reads past the array unseen).
"""

import os
import subprocess
import sys

import pytest

from dynamicemb_testing.scripts import ROOT, script_env


def _libasan() -> str:
    found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                           text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else ""


LIBASAN = _libasan()
needs_asan = pytest.mark.skipif(not LIBASAN, reason="gcc's libasan is not installed")


def test_the_step_guards_pass_on_the_kernels_source():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
         "test/cuda/test_step_syncs.py", "test/cuda/test_cuda_graph.py",
         "test/cuda/test_input_errors.py", "test/cuda/test_host_memory.py",
         "test/cuda/test_launch_config.py", "test/table/test_cpu_step_kernels.py",
         "test/storage/test_cpu_promotion_kernels.py"],
        cwd=ROOT, env=script_env(DEMB_CUDA_EMULATION="simt"), capture_output=True, text=True,
        timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def _env():
    return script_env(DEMB_SIMT_SANITIZE="address", LD_PRELOAD=LIBASAN,
                      ASAN_OPTIONS="detect_leaks=0")


@needs_asan
def test_the_kernel_suites_pass_under_the_address_sanitizer():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-x",
         "test/storage/test_exactness.py", "test/cuda/test_table_twins.py",
         "test/cuda/test_simt_runtime.py", "-k", "simt or test_simt_runtime"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


_READ_PAST = r"""
import sys, tempfile
import numpy as np
from dynamicemb_testing.simt import build, launch, load
src = {"oob.cu": 'extern "C" __global__ void t_read(const int* in, int* out, int n) '
                 '{ out[threadIdx.x] = in[n + threadIdx.x]; }'}
lib = load(build(tempfile.mkdtemp(), sources=src))
x, out = np.arange(64, dtype=np.int32), np.zeros(32, np.int32)
launch(lib, "t_read", 1, 32, 0, [np.uint64(x.ctypes.data), np.uint64(out.ctypes.data),
                                 np.int32(int(sys.argv[1]))], 0, 1)
print("read", out[:4].tolist())
"""


@needs_asan
def test_an_out_of_bounds_read_is_reported():
    def read(n):
        return subprocess.run([sys.executable, "-c", _READ_PAST, str(n)], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=300)

    inside = read(32)  # lanes read x[32..63]: all inside
    assert inside.returncode == 0 and "read [32, 33, 34, 35]" in inside.stdout, inside.stderr
    past = read(40)  # lanes 24-31 read x[64..71]
    assert past.returncode != 0 and "heap-buffer-overflow" in past.stderr
    assert "t_read" in past.stderr
