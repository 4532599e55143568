"""Builds dynamicemb and its CPU kernels (a torch C++ extension with OpenMP).

The CUDA kernels under ``csrc/cuda`` are not built here: CuPy compiles them at
run time (``pip install -e .[cuda]``).
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def cpu_extension() -> CppExtension:
    """The ``dynamicemb._C`` extension: bulk loops over the per-key primitives."""
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    return CppExtension(
        name="dynamicemb._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17"],
        extra_link_args=["-fopenmp"],
    )


setup(
    name="dynamicemb",
    version="0.1.0",
    description="TorchRec-compatible dynamic embedding tables backed by a scored hash table",
    packages=find_packages(include=["dynamicemb", "dynamicemb.*"]),
    python_requires=">=3.10",
    ext_modules=[cpu_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    extras_require={"cuda": ["cupy-cuda13x"]},
    zip_safe=False,
)
