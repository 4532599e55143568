"""The backend seam: ``for_device(device)`` is the one way to reach compiled code. The
contract is ``dynamicemb.ops.interface``; ``cpu.py`` and ``cuda/`` implement it."""

from functools import lru_cache

import torch

from dynamicemb.ops.interface import Backend

__all__ = ["Backend", "for_device", "resolve_device"]


@lru_cache(maxsize=1)
def _cpu() -> Backend:
    from dynamicemb.ops.cpu import CpuBackend  # noqa: PLC0415 (loads the extension)

    return CpuBackend()


@lru_cache(maxsize=1)
def _cuda() -> Backend:
    """The process's one CUDA backend (it caches compiled kernels per device)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "dynamicemb got CUDA tensors, but this PyTorch sees no CUDA device "
            "(a CPU-only build of torch, or no GPU): create the tables with device='cpu'")
    from dynamicemb.ops.cuda import CudaBackend  # noqa: PLC0415 (CuPy is optional)

    return CudaBackend()


def resolve_device(device) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:<current>``), so that
    a table's device compares equal to the device of the tensors made on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def for_device(device) -> Backend:
    """The backend for tensors on ``device``.

    Raises:
        RuntimeError: no backend for the device, or CUDA where PyTorch sees no GPU.
        ImportError: CUDA without CuPy (the message says what to install).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu()
    if device.type == "cuda":
        return _cuda()
    raise RuntimeError(
        f"dynamicemb has no kernels for device {device}: use 'cpu' or 'cuda'.")
