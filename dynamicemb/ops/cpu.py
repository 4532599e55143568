"""The CPU backend: the ``Backend`` verbs over the compiled extension (``csrc/cpu``,
built by ``pip install -e .`` once per instruction-set level; ``cpu_kernels`` picks the
copy), with table arrays on huge pages."""

from types import ModuleType
from typing import Optional

import torch

from dynamicemb.ops import cpu_kernels, huge_pages
from dynamicemb.ops.interface import OptimizerUpdate, optimizer_code
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

    def sum_gradients(self, *, starts, rank, offsets, weights, feature_col, batch, mean,
                      grad, out, error=None) -> int:
        """``Backend.sum_gradients``; ``error`` (the module's word, set: the batch was
        refused) writes nothing and returns 0."""
        no_offsets = torch.empty(0, dtype=torch.int64)
        return self.kernels.sum_gradients(
            starts, rank, no_offsets if offsets is None else offsets, weights, feature_col,
            batch, mean, grad, out, error=error)

    def fused_backward(self, *, sources, row_ref, starts, rank, offsets, weights, feature_col,
                       batch, dim, mean, grad, update: OptimizerUpdate, error=None,
                       schedule=None, sums=None):
        """The update from ``sums`` (``sum_gradients``, the batch already checked), or
        else one pass that sums each row and updates it where its sum is finite.
        ``error`` set (a refused batch): nothing is updated, 0 returned and the
        ``schedule``'s step not advanced; ``schedule``: the step's scalars from its
        device memory instead of from ``update``."""
        optimizer = (optimizer_code(update.optimizer), update.lr, update.eps, update.beta1,
                     update.beta2, update.weight_decay, update.step_size,
                     update.bias_correction2_sqrt, update.decay_scale)
        tiers = [sources.device, sources.host]
        if sums is not None:
            self.kernels.update_rows(tiers, row_ref, sums, *optimizer, error=error,
                                     schedule=schedule)
            return 0
        no_offsets = torch.empty(0, dtype=torch.int64)
        return self.kernels.sum_and_update_rows(
            tiers, row_ref, starts, rank, no_offsets if offsets is None else offsets, weights,
            feature_col, batch, mean, grad, dim, *optimizer, error=error, schedule=schedule)
