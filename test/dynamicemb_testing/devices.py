"""The backends the table, module and storage suites run on."""

from typing import List

import torch


def cuda_ready() -> bool:
    """A CUDA device, PyTorch built with CUDA, and CuPy (the CUDA kernels' runtime)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def devices() -> List[str]:
    """``["cpu"]``, plus ``"cuda"`` where the CUDA backend can run."""
    return ["cpu", "cuda"] if cuda_ready() else ["cpu"]
