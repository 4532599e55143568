"""The CPU backend: the ``Backend`` verbs over the compiled extension (``csrc/cpu``,
built by ``pip install -e .`` once per instruction-set level; ``cpu_kernels`` picks the
copy), with table arrays on huge pages."""

from types import ModuleType
from typing import Optional

from dynamicemb.ops import cpu_kernels, huge_pages
from dynamicemb.ops.kernels import KernelBackend

__all__ = ["CpuBackend"]


class CpuBackend(KernelBackend):
    """Kernels over CPU tensors (OpenMP loops over the shared per-key procedures).

    Args:
        kernels: one copy of the extension (``cpu_kernels.load_copy``); default the
            process's choice, ``cpu_kernels.load()``.
    """

    def __init__(self, kernels: Optional[ModuleType] = None) -> None:
        super().__init__(kernels if kernels is not None else cpu_kernels.load())

    def zeros(self, shape, dtype, device):
        """Zeroed, 2 MiB-aligned and advised ``MADV_HUGEPAGE`` from 2 MiB up
        (``dynamicemb.ops.huge_pages``): a table's random probes then miss the TLB
        far less."""
        return huge_pages.zeros(shape, dtype, device)
