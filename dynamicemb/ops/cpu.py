"""The CPU backend: the ``Backend`` verbs over the compiled extension (``csrc/cpu``)."""

from types import ModuleType
from typing import Optional

import torch

from dynamicemb.ops import cpu_kernels, huge_pages
from dynamicemb.ops.interface import OptimizerUpdate, optimizer_code
from dynamicemb.ops.kernels import KernelBackend

__all__ = ["CpuBackend"]


class CpuBackend(KernelBackend):
    """Kernels over CPU tensors (OpenMP loops over the shared per-key procedures);
    ``kernels``: a copy of the extension (default ``cpu_kernels.load()``)."""

    row_dtypes = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, kernels: Optional[ModuleType] = None) -> None:
        super().__init__(kernels if kernels is not None else cpu_kernels.load())

    def zeros(self, shape, dtype, device):
        """Zeroed, on huge pages from 2 MiB up (a table's random probes miss the TLB less)."""
        return huge_pages.zeros(shape, dtype, device)

    def sum_gradients(self, *, starts, rank, offsets, weights, feature_col, batch, mean,
                      grad, out, error=None) -> int:
        """``Backend.sum_gradients``."""
        no_offsets = torch.empty(0, dtype=torch.int64)
        return self.kernels.sum_gradients(
            starts, rank, no_offsets if offsets is None else offsets, weights, feature_col,
            batch, mean, grad, out, error=error)

    def fused_backward(self, *, sources, row_ref, starts, rank, offsets, weights, feature_col,
                       batch, dim, mean, grad, update: OptimizerUpdate, error=None,
                       schedule=None, sums=None, rounding=None):
        """``Backend.fused_backward``: the update from ``sums`` if given, else one pass that
        sums each row and updates it where its sum is finite."""
        optimizer = (optimizer_code(update.optimizer), update.lr, update.eps, update.beta1,
                     update.beta2, update.weight_decay, update.step_size,
                     update.bias_correction2_sqrt, update.decay_scale)
        tiers = [sources.device, sources.host]
        formatted = self._formatted(sources.format, rounding)
        if sums is not None:
            self.kernels.update_rows(tiers, row_ref, sums, *optimizer, error=error,
                                     schedule=schedule, **formatted)
            return 0
        no_offsets = torch.empty(0, dtype=torch.int64)
        return self.kernels.sum_and_update_rows(
            tiers, row_ref, starts, rank, no_offsets if offsets is None else offsets, weights,
            feature_col, batch, mean, grad, dim, *optimizer, error=error, schedule=schedule,
            **formatted)
