"""The one place that loads compiled code.

``ops_for(device)`` returns the kernels for a device: for CPU tensors the
``dynamicemb._C`` torch extension built by ``pip install -e .``; for CUDA tensors
``dynamicemb.ops.cuda.CudaKernels``, the kernels of ``csrc/cuda`` compiled at run
time by CuPy. Both offer the same functions with the same arguments.
"""

from functools import lru_cache
from typing import Any

import torch

__all__ = ["ops_for", "resolve_device"]


def _load_cpu() -> Any:
    try:
        from dynamicemb import _C  # noqa: PLC0415 (the single import site)
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "dynamicemb's CPU kernels (dynamicemb._C) are not built. Run "
            "`make build` (or `pip install --no-build-isolation -e .`) in the "
            "repository root."
        ) from err
    return _C


@lru_cache(maxsize=1)
def _load_cuda() -> Any:
    """The process's one CUDA backend (it caches compiled kernels per device)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "dynamicemb got CUDA tensors, but this PyTorch sees no CUDA device "
            "(a CPU-only build of torch, or no GPU): create the tables with device='cpu'")
    from dynamicemb.ops.cuda import CudaKernels  # noqa: PLC0415 (CuPy is optional)

    return CudaKernels()


def resolve_device(device) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:<current>``), so that
    a table's device compares equal to the device of the tensors made on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def ops_for(device: torch.device) -> Any:
    """Kernels for tensors on ``device``.

    Args:
        device: where the table's tensors live.

    Returns:
        An object whose functions take that device's tensors (the CPU extension
        module, or ``CudaKernels``).

    Raises:
        RuntimeError: when no backend exists for the device.
        ImportError: for CUDA without CuPy (the message says what to install).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _load_cpu()
    if device.type == "cuda":
        return _load_cuda()
    raise RuntimeError(
        f"dynamicemb has no kernels for device {device}: use 'cpu' or 'cuda'.")
