"""The CPU probe's instruction-set paths against the scalar probe.

The extension is built for one instruction set (``DYNAMICEMB_CPU_ARCH``, default the
building machine's), so the other paths of ``csrc/cpu/probe.h`` (64 digests per compare
with AVX-512BW or AVX2, 16 with SSE2, one at a time without) are compiled here into a
small standalone program each and run against ``probe_bucket_scalar``.
"""

# CPU only: compiles and runs the C++ probe paths of the CPU kernels.

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = pathlib.Path(__file__).with_name("probe_paths_check.cpp")
COMPILER = shutil.which("g++") or shutil.which("c++")

PATHS = {
    "avx512bw": ["-mavx512bw", "-mavx512f", "-mavx2"],
    "avx2": ["-mavx2", "-mno-avx512f"],
    "sse2": ["-msse2", "-mno-avx"],
    "scalar": ["-mno-sse2"],
}


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
@pytest.mark.parametrize("path", sorted(PATHS))
def test_probe_path_matches_scalar(path, tmp_path):
    exe = tmp_path / "probe_paths_check"
    build = subprocess.run(
        [COMPILER, "-O2", "-std=c++17", *PATHS[path], f"-I{ROOT / 'csrc'}", str(SOURCE),
         "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the compiler does not build the {path} path here: {build.stderr[-300:]}")
    # The AVX paths need the instructions to run; the machine may not have them.
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    needed = {"avx512bw": "avx512bw", "avx2": "avx2"}.get(path)
    if needed and needed not in flags.split():
        pytest.skip(f"this CPU has no {needed}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 wrong" in run.stdout
