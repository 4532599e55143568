"""The CPU backend: the ``Backend`` verbs over the compiled extension ``dynamicemb._C``
(``csrc/cpu``, built by ``pip install -e .``), with table arrays on huge pages."""

from dynamicemb.ops import huge_pages
from dynamicemb.ops.kernels import KernelBackend

__all__ = ["CpuBackend"]


def _load_extension():
    try:
        from dynamicemb import _C  # noqa: PLC0415 (the single import site)
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "dynamicemb's CPU kernels (dynamicemb._C) are not built. Run "
            "`make build` (or `pip install --no-build-isolation -e .`) in the "
            "repository root."
        ) from err
    return _C


class CpuBackend(KernelBackend):
    """Kernels over CPU tensors (OpenMP loops over the shared per-key procedures)."""

    def __init__(self) -> None:
        super().__init__(_load_extension())

    def zeros(self, shape, dtype, device):
        """Zeroed, 2 MiB-aligned and advised ``MADV_HUGEPAGE`` from 2 MiB up
        (``dynamicemb.ops.huge_pages``): a table's random probes then miss the TLB
        far less."""
        return huge_pages.zeros(shape, dtype, device)
