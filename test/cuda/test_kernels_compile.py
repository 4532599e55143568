"""Every CUDA kernel compiles, for the GPUs the project targets, with no GPU needed.

nvcc builds each file of csrc/cuda for sm_80 (A100) and sm_90 (H100/H200) with the
include path CuPy uses at run time; NVRTC itself is exercised by the CUDA tests.
"""

import os
import shutil
import subprocess
import sys

import pytest

from dynamicemb.ops.cuda import _KERNELS, cuda_source_root

ROOT = cuda_source_root()
SOURCES = sorted(os.listdir(os.path.join(ROOT, "cuda")))


def test_every_kernel_has_a_source():
    """The launcher's kernel table names files that exist and kernels they define."""
    for name, source in _KERNELS.items():
        with open(os.path.join(ROOT, "cuda", source)) as f:
            assert f'extern "C" __global__ void {name}(' in f.read(), name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", [s for s in SOURCES if s.endswith(".cu")])
def test_kernel_compiles(source, arch, tmp_path):
    result = subprocess.run(
        ["nvcc", "-std=c++17", f"-arch={arch}", "-I", ROOT, "-Werror", "all-warnings",
         "-c", os.path.join(ROOT, "cuda", source), "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_built_package_carries_kernel_sources(tmp_path):
    """A built (non-editable) package holds what the run-time compile includes, where
    ``cuda_source_root`` looks first (dynamicemb/csrc)."""
    repo = os.path.dirname(ROOT)
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for folder in ("cuda", "dynamicemb"):
        want = sorted(os.listdir(os.path.join(ROOT, folder)))
        assert sorted(os.listdir(tmp_path / "dynamicemb" / "csrc" / folder)) == want
