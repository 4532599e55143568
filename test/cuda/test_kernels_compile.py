"""Every CUDA kernel compiles, for the GPUs the project targets, with no GPU needed.

Each file of csrc/cuda is built for sm_80 (A100) and sm_90 (H100/H200) twice: by nvcc
(with every warning an error), and by NVRTC, the compiler CuPy uses at run time, with
the exact code string and options ``CudaKernels`` hands CuPy (``kernel_program``) plus
the architecture CuPy adds. NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel
(requirements.txt) or the system; it needs no GPU. The row kernels of embedding.cu switch
on the row format into their float32, float16 and bfloat16 instantiations, so each build
compiles all three.
"""

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from dynamicemb.ops.cuda import _KERNELS, _source_digest, cuda_source_root, kernel_program

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


def nvrtc_library():
    """libnvrtc from the nvidia-cuda-nvrtc wheel, else the system's, else None."""
    spec = importlib.util.find_spec("nvidia")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(folder, "*", "lib")
        found = [f for f in sorted(glob.glob(os.path.join(lib, "libnvrtc.so.*"))) if ".alt." not in f]
        builtins = [f for f in sorted(glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*")))
                    if ".alt." not in f]
        if found and builtins:
            # NVRTC opens its builtins by name: loaded first, the loader finds them.
            ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(found[0])
    name = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(name) if name else None


def nvrtc_compile(lib, code: str, name: str, options) -> str:
    """Compiles ``code`` with NVRTC; returns "" on success, else the program log."""
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code.encode(), name.encode(), 0,
                                  None, None) == 0
    try:
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(program, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if status != 0:
            return log.value.decode(errors="replace") or f"NVRTC status {status}"
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        return "" if size.value > 0 else "NVRTC produced an empty cubin"
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", [s for s in SOURCES if s.endswith(".cu")])
def test_kernel_compiles_with_nvrtc_as_cupy_does(source, arch):
    lib = nvrtc_library()
    if lib is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    code, options = kernel_program(ROOT, _source_digest(ROOT), source)
    log = nvrtc_compile(lib, code, source, [*options, f"-arch={arch}"])
    assert log == "", log
