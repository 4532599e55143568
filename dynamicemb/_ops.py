"""The one place that loads compiled code.

``ops_for(device)`` returns the kernel module for a device. The CPU kernels are
the ``dynamicemb._C`` torch extension built by ``pip install -e .``; the CUDA
backend is compiled at run time by CuPy and is not available yet.
"""

from types import ModuleType

import torch

__all__ = ["ops_for"]


def _load_cpu() -> ModuleType:
    try:
        from dynamicemb import _C  # noqa: PLC0415 (the single import site)
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "dynamicemb's CPU kernels (dynamicemb._C) are not built. Run "
            "`make build` (or `pip install --no-build-isolation -e .`) in the "
            "repository root."
        ) from err
    return _C


def ops_for(device: torch.device) -> ModuleType:
    """Kernel module for tensors on ``device``.

    Args:
        device: where the table's tensors live.

    Returns:
        The module whose functions take that device's tensors.

    Raises:
        RuntimeError: when no backend exists for the device.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _load_cpu()
    raise RuntimeError(
        f"dynamicemb has no kernels for device {device} yet: only the CPU backend "
        "is built. Create the table with device='cpu'."
    )
