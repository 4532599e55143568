"""Builds dynamicemb and its CPU kernels (torch C++ extensions with OpenMP), one copy
per x86-64 instruction-set level unless ``DYNAMICEMB_CPU_ARCH`` names one target.

The CUDA kernels under ``csrc/cuda`` are not built here: CuPy compiles them at
run time (``pip install -e .[cuda]``), so a built package carries their sources and
the shared headers as ``dynamicemb/csrc/{cuda,dynamicemb}`` (``RUNTIME_SOURCES``).
"""

import copy
import glob
import os
import platform
import re
import shutil
import subprocess
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    """The one version string: ``__version__`` in ``dynamicemb/__init__.py``."""
    with open(os.path.join(ROOT, "dynamicemb", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


# The instruction-set levels a dispatched x86-64 build carries, best first: the
# module suffix and the -march level. ``dynamicemb.ops.cpu_kernels`` loads the best one
# the running CPU supports; each is the same sources compiled for its level.
X86_64_LEVELS = (("x86_64_v4", "x86-64-v4"),   # AVX-512 (F, BW, CD, DQ, VL)
                 ("x86_64_v3", "x86-64-v3"),   # AVX2, FMA, BMI2
                 ("baseline", "x86-64"))       # SSE2: runs on every x86-64 CPU


def torch_requirement() -> str:
    """The torch the kernels are built against, to its minor version.

    A C++ extension is bound to the libtorch it was compiled with (its C++ ABI changes
    between minor versions), so a wheel built with torch 2.13 asks for ``torch==2.13.*``.
    The versions tested are 2.11 (CUDA, on the GPU machine) and 2.13 (CPU, here).
    """
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 11):
        raise SystemExit(f"dynamicemb needs torch >= 2.11 to build; found {torch.__version__}")
    return f"torch=={major}.{minor}.*"


def compiler_accepts(flag: str) -> bool:
    """Whether the C++ compiler accepts ``flag`` (old compilers lack the levels)."""
    compiler = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()
    try:
        subprocess.run(compiler + [flag, "-x", "c++", "-E", "-", "-o", os.devnull],
                       input=b"", check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def cpu_variants() -> list:
    """``(module suffix, isa, flags)`` for each copy of the CPU kernels to build.

    By default an x86-64 build carries one copy per level of ``X86_64_LEVELS`` and
    picks at import (a wheel then runs on any x86-64 CPU at full speed on each);
    other machines build one copy for the compiler's default target.
    ``DYNAMICEMB_CPU_ARCH=<arch>`` builds a single copy with ``-march=<arch>``
    (``native``: for the building machine only; ``none``: no flag), loaded as
    ``dynamicemb._C_local``.
    """
    arch = os.environ.get("DYNAMICEMB_CPU_ARCH", "").strip()
    if arch:
        flags = [] if arch == "none" else [f"-march={arch}"]
        if flags and not compiler_accepts(flags[0]):
            raise SystemExit(f"DYNAMICEMB_CPU_ARCH: the compiler refuses {flags[0]}")
        return [("local", arch, flags)]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [("baseline", platform.machine().lower(), [])]
    variants = []
    for suffix, level in X86_64_LEVELS:
        flag = f"-march={level}"
        if compiler_accepts(flag):
            variants.append((suffix, level, [flag]))
        elif suffix == "baseline":
            variants.append((suffix, level, []))
        else:
            print(f"dynamicemb: the compiler refuses {flag}; building without that level")
    return variants


def cpu_extension(suffix: str, isa: str, flags: list) -> CppExtension:
    """One copy of the CPU kernels, ``dynamicemb._C_<suffix>``, built for ``isa``."""
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    return CppExtension(
        name=f"dynamicemb._C_{suffix}",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[("DYNAMICEMB_ISA", isa.replace("-", "_"))],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17"] + flags,
        extra_link_args=["-fopenmp"],
    )


class BuildCpuCopies(BuildExtension):
    """Builds the copies of the CPU kernels side by side (``parallel``), each in its own
    object folder: they compile the same sources with other flags, so a shared folder
    would let one copy's objects overwrite another's."""

    def build_extension(self, ext) -> None:
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
        BuildExtension.build_extension(own, ext)


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


CPU_VARIANTS = cpu_variants()

setup(
    name="dynamicemb",
    version=version(),
    description="TorchRec-compatible dynamic embedding tables backed by a scored hash table",
    packages=find_packages(include=["dynamicemb", "dynamicemb.*"]),
    python_requires=">=3.10",
    ext_modules=[cpu_extension(*variant) for variant in CPU_VARIANTS],
    cmdclass={"build_ext": BuildCpuCopies.with_options(use_ninja=True),
              "build_py": BuildPyWithKernelSources},
    install_requires=[torch_requirement(), "numpy>=1.24"],
    extras_require={
        # TorchRec asks for the CUDA fbgemm-gpu; on CPU-only machines install
        # fbgemm-gpu-cpu, then torchrec with --no-deps (see requirements-nodeps.txt).
        "torchrec": ["torchrec>=1.8"],
        "cuda": ["cupy-cuda13x"],
        "examples": ["tqdm", "torchmetrics", "pyarrow", "matplotlib"],
        # graph-partitioned placement files (dynamicemb.partition)
        "partition": ["pymetis>=2025.2"],
    },
    options={"build_ext": {"parallel": len(CPU_VARIANTS)}},
    zip_safe=False,
)
