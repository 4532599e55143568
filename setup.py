"""Builds dynamicemb and its CPU kernels (a torch C++ extension with OpenMP).

The CUDA kernels under ``csrc/cuda`` are not built here: CuPy compiles them at
run time (``pip install -e .[cuda]``), so a built package carries their sources and
the shared headers as ``dynamicemb/csrc/{cuda,dynamicemb}`` (``RUNTIME_SOURCES``).
"""

import glob
import os
import re
import shutil
import subprocess
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    """The one version string: ``__version__`` in ``dynamicemb/__init__.py``."""
    with open(os.path.join(ROOT, "dynamicemb", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def arch_flags() -> list:
    """``-march=<DYNAMICEMB_CPU_ARCH>`` (default ``native``: the building machine's
    vector units, e.g. AVX-512, which the row loops need to run at memory speed).

    The extension is built where it runs (``make build``); for a binary that must
    run on other CPUs set ``DYNAMICEMB_CPU_ARCH`` to a baseline (``x86-64-v3``) or
    to ``none`` (the compiler's default). Skipped when the compiler refuses the flag.
    """
    arch = os.environ.get("DYNAMICEMB_CPU_ARCH", "native").strip()
    if arch in ("", "none"):
        return []
    flag = f"-march={arch}"
    compiler = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()
    try:
        subprocess.run(compiler + [flag, "-x", "c++", "-E", "-", "-o", os.devnull],
                       input=b"", check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        print(f"dynamicemb: the compiler refuses {flag}; building without it")
        return []
    return [flag]


def cpu_extension() -> CppExtension:
    """The ``dynamicemb._C`` extension: bulk loops over the per-key primitives."""
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    return CppExtension(
        name="dynamicemb._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17"] + arch_flags(),
        extra_link_args=["-fopenmp"],
    )


# What the CUDA backend compiles at run time: its kernels and the shared headers.
RUNTIME_SOURCES = ("cuda", "dynamicemb")


class BuildPyWithKernelSources(build_py):
    """Copies csrc/cuda and csrc/dynamicemb into the built package (dynamicemb/csrc),
    where ``dynamicemb.ops.cuda.cuda_source_root`` finds them outside a checkout."""

    def run(self) -> None:
        super().run()
        for folder in RUNTIME_SOURCES:
            target = os.path.join(self.build_lib, "dynamicemb", "csrc", folder)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(ROOT, "csrc", folder), target)


setup(
    name="dynamicemb",
    version=version(),
    description="TorchRec-compatible dynamic embedding tables backed by a scored hash table",
    packages=find_packages(include=["dynamicemb", "dynamicemb.*"]),
    python_requires=">=3.10",
    ext_modules=[cpu_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True),
              "build_py": BuildPyWithKernelSources},
    # torch: the range tested (2.11 with CUDA on the GPU machine, 2.13 CPU here).
    install_requires=["torch>=2.11", "numpy>=1.24"],
    extras_require={
        # TorchRec asks for the CUDA fbgemm-gpu; on CPU-only machines install
        # fbgemm-gpu-cpu, then torchrec with --no-deps (see requirements-nodeps.txt).
        "torchrec": ["torchrec>=1.8"],
        "cuda": ["cupy-cuda13x"],
        "examples": ["tqdm", "torchmetrics", "pyarrow", "matplotlib"],
    },
    zip_safe=False,
)
